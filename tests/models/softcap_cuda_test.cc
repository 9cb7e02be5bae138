// Gemma 2's soft-capping on CUDA in fp32, bf16 and fp16: attention with AttentionDims::softcap on
// both kernel sets (head dim 24: CUDA cores only; 64 and 128: the tensor cores for 16-bit S) and
// the chunked LM head with a softcap (both weight layouts, ignored targets, the last logits),
// each against the host op of the same storage type (ops/attention.h, ops/cross_entropy.h: the
// same rounding points; the differences are summation orders and the GPU's expf/tanhf) and
// against the host op at S = double on the same S-rounded inputs, element by element with the
// bounds of llama_cuda_test.cc (attention) and gpt_cuda_test.cc (the head), written beside each
// check.
//
// Every case caps hard: softcaps 0.5 to 2 against scores and logits of one or two units, so tanh
// saturates and its derivative 1 - tanh^2 is far from 1. A host-only test (no GPU needed, so it
// runs in CI) checks that each case's capped host results lie well outside those bounds around
// the uncapped ones — a CUDA op that ignored the softcap would fail its case — and that the
// backward's factor 1 - tanh^2 averages well below 1 over the pairs each case's queries see, so
// a backward that dropped it would move dq and dk by far more than their bounds.
// Label gpu: without a GPU the device tests skip with the reason; the host-side checks and the
// argument checks (which run before any CUDA call) run anyway.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "engine/plan/model.h"
#include "gpu/cuda/cuda_native.h"
#include "gpu/device.h"
#include "models/ops/attention.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/cuda/ops.cuh"
#include "tests/gpu/cuda_test_util.h"
#include "tests/models/llama_op_test_util.h"
#include "tests/models/terms_bound.h"

namespace strata::models {
namespace {

namespace lops = ops::cuda;
using op_test::Cast;
using op_test::Eps;
using op_test::ExpectWithinBound;
using op_test::RandomValues;
using op_test::Rounded;
using op_test::ToDoubles;

template <typename S>
using DevOf = std::conditional_t<std::is_same_v<S, Bf16>, __nv_bfloat16,
                                 std::conditional_t<std::is_same_v<S, Fp16>, __half, float>>;

using StorageTypes = ::testing::Types<float, Bf16, Fp16>;

// The largest |got - ref| over its bound k eps (|ref| + rms(ref)) (terms_bound.h), without
// reporting: how far outside the bound of ref a result lies.
double WorstOverBound(const std::vector<double>& got, const std::vector<double>& ref, double k,
                      double eps) {
  const double rms = terms_bound::Rms(ref);
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double bound = terms_bound::BoundOf(i, ref, {}, rms, k, eps);
    if (bound > 0) worst = std::max(worst, std::abs(got[i] - ref[i]) / bound);
  }
  return worst;
}

// position_ids of rows of tokens, row b holding examples of the lengths rows[b] in order.
std::vector<int32_t> PackedPositions(const std::vector<std::vector<int>>& rows) {
  std::vector<int32_t> ids;
  for (const std::vector<int>& row : rows) {
    for (const int len : row) {
      for (int p = 0; p < len; ++p) ids.push_back(p);
    }
  }
  return ids;
}

// ---------------------------------------------------------------------------
// Attention. Rows [q | k | v] of H + 2 Hkv heads; q, k, v uniform in [-2, 2] (scaled scores of
// about 1.3 rms).

struct AttentionCase {
  int B, T, H, Hkv, hs;
  std::vector<std::vector<int>> rows;  // example lengths per row; empty: not packed
  int window;                          // AttentionDims::window
  double scale;                        // AttentionDims::scale
  double softcap;                      // AttentionDims::softcap
  int64_t N() const { return int64_t{B} * T; }
  int64_t Dq() const { return int64_t{H} * hs; }
  int64_t Dkv() const { return int64_t{Hkv} * hs; }
  int64_t ld() const { return Dq() + 2 * Dkv(); }
  // The longest fp32 sum (llama_cuda_test.cc): T keys times the group, plus a dot product.
  double K() const { return static_cast<double>(T) * (H / Hkv) + hs; }
  std::string Name() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " H=" + std::to_string(H) +
           " Hkv=" + std::to_string(Hkv) + " hs=" + std::to_string(hs) +
           (rows.empty() ? "" : " packed") + " window=" + std::to_string(window) +
           " scale=" + std::to_string(scale) + " softcap=" + std::to_string(softcap);
  }
};

// Every kernel set and mask: GQA on CUDA cores (hs 24) with and without packed sequences and a
// window; MQA at hs 64 across the 64-row tiles; packed + window + a given scale at hs 64; MHA and
// GQA with a window at hs 128 (the tensor cores' dk/dv query tile 32); Gemma's head dim 256 (CUDA
// cores only, their dynamic shared tiles), GQA, and MQA packed with a window and a given scale.
const std::vector<AttentionCase>& SoftcapCases() {
  static const std::vector<AttentionCase> cases = {
      {2, 37, 4, 2, 24, {}, 0, 0, 1.0},
      {2, 37, 4, 2, 24, {{10, 20, 7}, {37}}, 5, 0, 0.5},
      {1, 150, 2, 1, 64, {}, 0, 0, 2.0},
      {2, 150, 2, 1, 64, {{10, 70, 60, 10}, {64, 1, 85}}, 37, 0.3, 0.5},
      {1, 130, 2, 2, 128, {}, 0, 0, 1.0},
      {1, 200, 4, 2, 128, {}, 70, 0, 1.5},
      {1, 70, 4, 2, 256, {}, 0, 0, 1.0},
      {2, 45, 2, 1, 256, {{20, 25}, {45}}, 16, 0.0625, 1.5},
  };
  return cases;
}

// The inputs of case k in S (rounded, as doubles) and the host op's results on them.
struct AttentionRun {
  std::vector<double> out, lse, dqkv;
};

struct AttentionInputs {
  std::vector<double> qkv, dout;
  std::vector<int32_t> pos;
};

template <typename S>
AttentionInputs InputsOf(const AttentionCase& k) {
  AttentionInputs in;
  in.qkv = Rounded<S>(RandomValues(k.N() * k.ld(), 2.0, 161 + k.T + k.hs));
  in.dout = Rounded<S>(RandomValues(k.N() * k.Dq(), 1.0, 162 + k.T + k.hs));
  in.pos = PackedPositions(k.rows);
  return in;
}

ops::AttentionDims DimsOf(const AttentionCase& k, const int32_t* pos, double softcap) {
  ops::AttentionDims d{k.B, k.T, k.H, k.Hkv, k.hs, k.ld()};
  d.position_ids = pos;
  d.window = k.window;
  d.scale = k.scale;
  d.softcap = softcap;
  return d;
}

// The host op in storage type T (S or double) on the inputs (given as doubles holding S values).
template <typename T>
AttentionRun HostAttention(const AttentionCase& k, const AttentionInputs& in, double softcap) {
  const ops::AttentionDims d = DimsOf(k, in.pos.empty() ? nullptr : in.pos.data(), softcap);
  const int64_t Dq = k.Dq(), Dkv = k.Dkv();
  const std::vector<T> qkv = Cast<T>(in.qkv), dout = Cast<T>(in.dout);
  std::vector<T> out(k.N() * Dq), dqkv(k.N() * k.ld(), T(0));
  std::vector<ComputeType<T>> lse(int64_t{k.B} * k.H * k.T);
  ops::AttentionForward<T>(d, qkv.data(), qkv.data() + Dq, qkv.data() + Dq + Dkv, out.data(),
                           lse.data());
  ops::AttentionBackward<T>(d, qkv.data(), qkv.data() + Dq, qkv.data() + Dq + Dkv, out.data(),
                            dout.data(), lse.data(), dqkv.data(), dqkv.data() + Dq,
                            dqkv.data() + Dq + Dkv);
  return {ToDoubles(out), std::vector<double>(lse.begin(), lse.end()), ToDoubles(dqkv)};
}

// The mean of 1 - tanh^2(s / c) over the (query, key) pairs the case's queries see, s the scaled
// score in double: the backward's factor on dS.
double MeanSlope(const AttentionCase& k, const AttentionInputs& in) {
  const double scale = k.scale > 0 ? k.scale : 1.0 / std::sqrt(static_cast<double>(k.hs));
  double sum = 0;
  int64_t n = 0;
  for (int b = 0; b < k.B; ++b) {
    for (int h = 0; h < k.H; ++h) {
      const int kh = h / (k.H / k.Hkv);
      for (int t = 0; t < k.T; ++t) {
        int lo = in.pos.empty() ? 0 : t - in.pos[int64_t{b} * k.T + t];
        if (k.window > 0) lo = std::max(lo, t - k.window + 1);
        const double* q = &in.qkv[(int64_t{b} * k.T + t) * k.ld() + int64_t{h} * k.hs];
        for (int s = lo; s <= t; ++s) {
          const double* key =
              &in.qkv[(int64_t{b} * k.T + s) * k.ld() + k.Dq() + int64_t{kh} * k.hs];
          double dot = 0;
          for (int j = 0; j < k.hs; ++j) dot += q[j] * key[j];
          const double u = std::tanh(dot * scale / k.softcap);
          sum += 1 - u * u;
          ++n;
        }
      }
    }
  }
  return sum / static_cast<double>(n);
}

template <typename S>
class SoftcapHostTest : public ::testing::Test {};
TYPED_TEST_SUITE(SoftcapHostTest, StorageTypes);

// Not vacuous: for every case the host op with the softcap lies outside the bounds of the CUDA
// test around the host op without it (out: 8, dqkv: 24 eps; by a factor 4, so that a CUDA op
// that ignored the softcap, within its own bound of the uncapped op, still fails), and the
// backward's factor 1 - tanh^2 averages below 0.8 over the pairs seen (a backward without it
// scales every dS by 1.25 or more on average, where the dqkv bound is 24 eps, about 0.09 in bf16).
TYPED_TEST(SoftcapHostTest, EveryAttentionCaseWouldFailWithTheSoftcapIgnored) {
  using S = TypeParam;
  for (const AttentionCase& k : SoftcapCases()) {
    SCOPED_TRACE(k.Name());
    const AttentionInputs in = InputsOf<S>(k);
    const AttentionRun capped = HostAttention<S>(k, in, k.softcap);
    const AttentionRun plain = HostAttention<S>(k, in, 0);
    const double eps = Eps<S>(k.K());
    const double out = WorstOverBound(plain.out, capped.out, 8, eps);
    const double dqkv = WorstOverBound(plain.dqkv, capped.dqkv, 24, eps);
    const double slope = MeanSlope(k, in);
    std::cout << k.Name() << ": uncapped out " << out << ", dqkv " << dqkv
              << " bounds away; mean 1 - tanh^2 " << slope << "\n";
    EXPECT_GT(out, 4.0) << "out";
    EXPECT_GT(dqkv, 4.0) << "dqkv";
    EXPECT_LT(slope, 0.8);
  }
}

template <typename S>
class SoftcapCudaTest : public gpu::testing::CudaTest {
 protected:
  using Dev = DevOf<S>;

  template <typename T>
  gpu::DeviceSpan Put(const std::vector<T>& v) {
    gpu::DeviceSpan d = Carve(std::max<size_t>(v.size() * sizeof(T), 256));
    Upload(d, v);
    return d;
  }
  // Device memory of NaN bytes (0xff), so unwritten outputs show.
  gpu::DeviceSpan Poisoned(size_t bytes) {
    gpu::DeviceSpan d = Carve(std::max<size_t>(bytes, 256));
    Upload(d, std::vector<uint8_t>(d.size_bytes, 0xff));
    return d;
  }
  std::vector<double> Get(gpu::DeviceSpan d, size_t n) {
    return ToDoubles(this->template Download<S>(d, n));
  }
  cudaStream_t Native() { return gpu::NativeStream(*this->stream_); }

  // The CUDA op's forward and backward of case k on `path`.
  AttentionRun CudaAttention(const AttentionCase& k, const AttentionInputs& in,
                             lops::AttentionPath path) {
    const int64_t N = k.N(), Dq = k.Dq(), Dkv = k.Dkv(), ld = k.ld();
    const int64_t stats = int64_t{k.B} * k.H * k.T;
    const gpu::DeviceSpan gqkv = Put(Cast<S>(in.qkv)), gdout = Put(Cast<S>(in.dout));
    const gpu::DeviceSpan gpos = Put(in.pos.empty() ? std::vector<int32_t>{0} : in.pos);
    const gpu::DeviceSpan out = Poisoned(N * Dq * sizeof(S)), lse = Poisoned(stats * 4),
                          delta = Poisoned(stats * 4), dqkv = Poisoned(N * ld * sizeof(S));
    const ops::AttentionDims d =
        DimsOf(k, in.pos.empty() ? nullptr : gpos.as<int32_t>(), k.softcap);
    const cudaStream_t cs = Native();
    const Dev* q = gqkv.as<Dev>();
    Dev* g = dqkv.as<Dev>();
    EXPECT_TRUE(lops::LaunchAttentionForward(cs, d, q, q + Dq, q + Dq + Dkv, out.as<Dev>(),
                                             lse.as<float>(), path)
                    .ok());
    EXPECT_TRUE(lops::LaunchAttentionBackward(cs, d, q, q + Dq, q + Dq + Dkv, out.as<Dev>(),
                                              gdout.as<Dev>(), lse.as<float>(), delta.as<float>(),
                                              g, g + Dq, g + Dq + Dkv, path)
                    .ok());
    EXPECT_TRUE(this->stream_->Synchronize().ok());
    const std::vector<float> l = this->template Download<float>(lse, stats);
    return {Get(out, N * Dq), std::vector<double>(l.begin(), l.end()), Get(dqkv, N * ld)};
  }
};
TYPED_TEST_SUITE(SoftcapCudaTest, StorageTypes);

// Each case on both paths (kAuto: the tensor cores for 16-bit S at hs 64 and 128; kCudaCores)
// against the host op and double with the bounds of llama_cuda_test.cc's attention tests: out one
// rounding after the probabilities' (k = 4 vs double, 8 vs the host op, whose own error adds),
// lse in fp32 (4), dq, dk, dv through the rounded P and dS (12 and 24); eps = Eps<S>(T group + hs).
TYPED_TEST(SoftcapCudaTest, AttentionMatchesTheHostOpAndDoubleOnBothPaths) {
  using S = TypeParam;
  for (const AttentionCase& k : SoftcapCases()) {
    const AttentionInputs in = InputsOf<S>(k);
    const AttentionRun host = HostAttention<S>(k, in, k.softcap);
    const AttentionRun ref = HostAttention<double>(k, in, k.softcap);
    const double eps = Eps<S>(k.K());
    for (const lops::AttentionPath path :
         {lops::AttentionPath::kAuto, lops::AttentionPath::kCudaCores}) {
      SCOPED_TRACE(k.Name() + (path == lops::AttentionPath::kAuto ? " auto" : " CUDA cores"));
      const AttentionRun got = this->CudaAttention(k, in, path);
      ExpectWithinBound("out vs double", got.out, ref.out, 4, eps);
      ExpectWithinBound("out vs host", got.out, host.out, 8, eps);
      ExpectWithinBound("lse vs double", got.lse, ref.lse, 4, Eps<float>(k.K()));
      ExpectWithinBound("dqkv vs double", got.dqkv, ref.dqkv, 12, eps);
      ExpectWithinBound("dqkv vs host", got.dqkv, host.dqkv, 24, eps);
    }
  }
}

// ---------------------------------------------------------------------------
// The chunked LM head: B 2, T 37, C 48, V 97 in three chunks (the last one short), x uniform in
// [-1, 1] and W in [-0.6, 0.6] (logits of about 1.4 rms), a third of the targets ignored
// (engine::kIgnoreTarget) and the mean over the counted ones, untied (kInOut, W (C, V)) and tied
// (kOutIn, W (V, C)) layouts, softcaps 1 and 2.

struct HeadCase {
  ops::WeightLayout layout;
  double softcap;
  std::string Name() const {
    return std::string(layout == ops::WeightLayout::kInOut ? "untied" : "tied") +
           " softcap=" + std::to_string(softcap);
  }
};

const std::vector<HeadCase>& HeadCases() {
  static const std::vector<HeadCase> cases = {{ops::WeightLayout::kInOut, 1.0},
                                              {ops::WeightLayout::kOutIn, 1.0},
                                              {ops::WeightLayout::kInOut, 2.0},
                                              {ops::WeightLayout::kOutIn, 2.0}};
  return cases;
}

struct HeadShape {
  int B = 2, T = 37, C = 48, V = 97;
  int64_t N() const { return int64_t{B} * T; }
  int64_t rows() const { return N() / 3 + 1; }
  // The longest fp32 sums: the vocabulary (softmax, dx) and the rows (dW), plus the logit's.
  double K() const { return static_cast<double>(V + N() + C); }
};

struct HeadInputs {
  std::vector<double> x, w;  // (N, C); (C, V) or (V, C)
  std::vector<int32_t> targets;
  int64_t loss_tokens = 0;
};

template <typename S>
HeadInputs HeadInputsOf(const HeadShape& s) {
  HeadInputs in;
  in.x = Rounded<S>(RandomValues(s.N() * s.C, 1.0, 171));
  in.w = Rounded<S>(RandomValues(int64_t{s.C} * s.V, 0.6, 172));
  in.targets.resize(s.N());
  for (int64_t r = 0; r < s.N(); ++r) {
    const bool ignored = r % 3 == 1 || r == 9 || r == 29;  // scattered, and examples' ends
    in.targets[r] = ignored ? engine::kIgnoreTarget : static_cast<int32_t>((r * 37 + 11) % s.V);
    in.loss_tokens += ignored ? 0 : 1;
  }
  return in;
}

struct HeadRun {
  double loss = 0;
  std::vector<double> logits, dx, dw;  // (B, V), (N, C), the weight's shape
};

// The host op in storage type T on the inputs.
template <typename T>
HeadRun HostHead(const HeadShape& s, const HeadInputs& in, const HeadCase& k, double softcap) {
  const std::vector<T> x = Cast<T>(in.x), w = Cast<T>(in.w);
  std::vector<T> logits(int64_t{s.B} * s.V), dx(s.N() * s.C), dw(int64_t{s.C} * s.V);
  std::vector<uint64_t> scratch(ops::LmHeadScratchBytes<T>(s.B, s.T, s.C, s.V, s.rows()) / 8 + 8);
  HeadRun r;
  r.loss =
      ops::LmHeadForward<T>(x.data(), w.data(), k.layout, in.targets.data(), s.B, s.T, s.C, s.V,
                            logits.data(), scratch.data(), s.rows(), in.loss_tokens, softcap);
  ops::LmHeadBackward<T>(x.data(), w.data(), k.layout, in.targets.data(), ComputeType<T>(1), s.B,
                         s.T, s.C, s.V, dx.data(), dw.data(), scratch.data(), s.rows(),
                         in.loss_tokens, softcap);
  r.logits = ToDoubles(logits);
  r.dx = ToDoubles(dx);
  r.dw = ToDoubles(dw);
  return r;
}

// Not vacuous: for every head case the host op with the softcap lies outside the bounds of the
// CUDA test around the host op without it by a factor 4 (the last logits: 4 eps; dx, dW: 32 eps).
// (The loss alone would not tell in 16 bits: its bound against double is 16 u, 6% in bf16.)
TYPED_TEST(SoftcapHostTest, EveryHeadCaseWouldFailWithTheSoftcapIgnored) {
  using S = TypeParam;
  const HeadShape s;
  const HeadInputs in = HeadInputsOf<S>(s);
  const double eps = Eps<S>(s.K());
  for (const HeadCase& k : HeadCases()) {
    SCOPED_TRACE(k.Name());
    const HeadRun capped = HostHead<S>(s, in, k, k.softcap), plain = HostHead<S>(s, in, k, 0);
    const double logits = WorstOverBound(plain.logits, capped.logits, 4, Eps<S>(s.C));
    const double dx = WorstOverBound(plain.dx, capped.dx, 32, eps);
    const double dw = WorstOverBound(plain.dw, capped.dw, 32, eps);
    std::cout << k.Name() << ": uncapped logits " << logits << ", dx " << dx << ", dW " << dw
              << " bounds away\n";
    EXPECT_GT(logits, 4.0) << "logits";
    EXPECT_GT(dx, 4.0) << "dx";
    EXPECT_GT(dw, 4.0) << "dW";
  }
}

// The CUDA head (ChunkedHeadForward / ChunkedHeadBackward, three chunks) against the host op and
// double: the last logits two roundings (the product, the capped value: k = 4 with the C-term
// sum); the loss as gpt_cuda_test.cc's head checks; dx and dW through the rounded capped logits
// and dlogits (k = 32, the softmax's V-term and dW's N-term sums); dx exactly 0 in the rows of
// ignored targets.
TYPED_TEST(SoftcapCudaTest, ChunkedHeadMatchesTheHostOpAndDouble) {
  using S = TypeParam;
  const double u = op_test::kUnitRoundoff<S>;
  const HeadShape s;
  const HeadInputs in = HeadInputsOf<S>(s);
  const double eps = Eps<S>(s.K());
  ASSERT_TRUE(lops::PrepareStream(*this->stream_).ok());
  const cudaStream_t cs = this->Native();
  const auto mm = lops::Products<S>::Make(*this->stream_, cs);
  ASSERT_TRUE(mm.ok()) << mm.status().ToString();
  for (const HeadCase& k : HeadCases()) {
    SCOPED_TRACE(k.Name());
    const HeadRun host = HostHead<S>(s, in, k, k.softcap);
    const HeadRun ref = HostHead<double>(s, in, k, k.softcap);
    const int64_t N = s.N(), C = s.C, V = s.V, rows = s.rows();
    const gpu::DeviceSpan x = this->Put(Cast<S>(in.x)), w = this->Put(Cast<S>(in.w)),
                          tgt = this->Put(in.targets);
    const gpu::DeviceSpan chunk = this->Poisoned(rows * V * sizeof(S)),
                          losses = this->Poisoned(N * 4),
                          x_last = this->Poisoned(int64_t{s.B} * C * sizeof(S)),
                          dw_acc = this->Poisoned(C * V * 4);
    const lops::HeadScratch<S> hs{rows, chunk.as<S>(), losses.as<float>(), x_last.as<S>(),
                                  dw_acc.as<void>()};
    const gpu::DeviceSpan logits = this->Poisoned(int64_t{s.B} * V * sizeof(S)),
                          loss = this->Poisoned(4), dx = this->Poisoned(N * C * sizeof(S)),
                          dw = this->Poisoned(C * V * sizeof(S));
    const float c = static_cast<float>(k.softcap);
    ASSERT_TRUE(lops::ChunkedHeadForward<S>(*mm, x.as<S>(), w.as<S>(), k.layout, s.B, s.T, C, V, hs,
                                            logits.as<S>(), tgt.as<int32_t>(), loss.as<float>(),
                                            in.loss_tokens, c)
                    .ok());
    ASSERT_TRUE(lops::ChunkedHeadBackward<S>(*mm, x.as<S>(), w.as<S>(), k.layout, tgt.as<int32_t>(),
                                             1.0f, N, C, V, hs, dw.as<S>(), dx.as<S>(),
                                             in.loss_tokens, c)
                    .ok());
    ASSERT_TRUE(this->stream_->Synchronize().ok());
    const double loss_gpu = this->template Download<float>(loss, 1)[0];
    EXPECT_NEAR(loss_gpu, host.loss, 64 * 0x1p-24 * std::abs(host.loss) + 8 * u) << "loss vs host";
    EXPECT_NEAR(loss_gpu, ref.loss, 16 * u * std::abs(ref.loss)) << "loss vs double";
    const std::vector<double> got_logits = this->Get(logits, int64_t{s.B} * V);
    ExpectWithinBound("last logits vs double", got_logits, ref.logits, 4, Eps<S>(C));
    ExpectWithinBound("last logits vs host", got_logits, host.logits, 4, Eps<S>(C));
    const std::vector<double> got_dx = this->Get(dx, N * C), got_dw = this->Get(dw, C * V);
    ExpectWithinBound("dx vs double", got_dx, ref.dx, 32, eps);
    ExpectWithinBound("dx vs host", got_dx, host.dx, 32, eps);
    ExpectWithinBound("dW vs double", got_dw, ref.dw, 32, eps);
    ExpectWithinBound("dW vs host", got_dw, host.dw, 32, eps);
    for (int64_t r = 0; r < N; ++r) {
      if (in.targets[r] != engine::kIgnoreTarget) continue;
      for (int64_t j = 0; j < C; ++j) {
        ASSERT_EQ(got_dx[r * C + j], 0.0) << "row " << r << " has an ignored target";
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Arguments, on any machine with the CUDA backend built: a softcap that is negative, not finite,
// or (attention, whose AttentionDims carries a double) 0 or inf once rounded to fp32, is
// kInvalidArgument before anything is launched.
TEST(SoftcapCudaArguments, BadSoftcapsAreRejectedBeforeLaunching) {
  float dummy = 0;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (const double c : {-1.0, nan, inf, 1e-60, 1e300}) {
    SCOPED_TRACE("softcap=" + std::to_string(c));
    ops::AttentionDims d{1, 4, 2, 2, 8, 32};
    d.softcap = c;
    const Status fwd =
        lops::LaunchAttentionForward<float>(nullptr, d, &dummy, &dummy, &dummy, &dummy, &dummy);
    EXPECT_EQ(fwd.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(fwd.message().find("softcap"), std::string::npos) << fwd.ToString();
    EXPECT_EQ(lops::LaunchAttentionBackward<float>(nullptr, d, &dummy, &dummy, &dummy, &dummy,
                                                   &dummy, &dummy, &dummy, &dummy, &dummy, &dummy)
                  .code(),
              StatusCode::kInvalidArgument);
  }
  lops::Products<float> mm{};
  const lops::HeadScratch<float> hs{1, &dummy, &dummy, &dummy, &dummy};
  int32_t target = 0;
  for (const float c :
       {-1.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE("softcap=" + std::to_string(c));
    EXPECT_EQ(lops::ChunkedHeadForward<float>(mm, &dummy, &dummy, ops::WeightLayout::kInOut, 1, 1,
                                              1, 1, hs, &dummy, &target, &dummy, 0, c)
                  .code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(lops::ChunkedHeadBackward<float>(mm, &dummy, &dummy, ops::WeightLayout::kInOut,
                                               &target, 1.0f, 1, 1, 1, hs, &dummy, &dummy, 0, c)
                  .code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(lops::LaunchCrossEntropy<float>(nullptr, &dummy, &target, 1, 1, &dummy, true, 1.0f, c)
                  .code(),
              StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace strata::models
