// The Llama family on CUDA in fp32, bf16 and fp16, on random data with odd shapes:
//   - each CUDA op (models/ops/cuda/ops.cuh: the scaled embedding, RMSNorm forward/backward/
//     weight gradient, the rotary table and rotation, SwiGLU and GeGLU, grouped-query attention
//     with strided rows) against the host op of the same storage type (which rounds at the same
//     points: the differences are summation orders and the GPU's expf/sqrtf) and against the
//     host op at S = double fed the same S-rounded inputs, element by element, with bounds
//     k eps (|ref| + rms(ref)), eps = u + K 2^-24 (op_test::Eps, u the unit roundoff of S, K the
//     longest fp32 sum) and k the rounding points on the path, written beside each check;
//   - attention for MHA, GQA and MQA groupings, head dims 24 and 64, T across the key tiles;
//     determinism of the backward (two runs bit-identical);
//   - packed sequences (position_ids, issue 31): the rotation at each token's position, and
//     block-diagonal causal attention on both paths against the host op, one example's results
//     unchanged bit for bit when another example of its row changes;
//   - sliding-window attention (AttentionDims::window), alone and with packed sequences, on both
//     paths against the host op; a window of T or more bit-identical to none; a key outside a
//     query's window leaving that query's results unchanged bit for bit;
//   - a given score scale (AttentionDims::scale) on both paths against the host op; 1 / sqrt(hs)
//     given explicitly bit-identical to the default;
//   - the whole model through LlamaModel::Forward/Backward with the engine's buffer layout
//     (tests/models/gpt_model_run.h), tied and untied, on the CUDA device against the host
//     device and against the double block functions: the loss, the logits, every block's
//     gradient tensor by tensor, the tied gradient and the embedding output's gradient.
// Label gpu: without a GPU every device test skips with the reason; the argument checks (which
// run before any CUDA call) run anyway.
#include "models/cuda/llama_cuda.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "gpu/cuda/cuda_native.h"
#include "gpu/device.h"
#include "models/llama.h"
#include "models/llama_kernels.h"
#include "models/ops/attention.h"
#include "models/ops/cuda/ops.cuh"
#include "models/ops/embedding.h"
#include "models/ops/rms_norm.h"
#include "models/ops/rope.h"
#include "models/ops/swiglu.h"
#include "tests/gpu/cuda_test_util.h"
#include "tests/models/gpt_model_run.h"
#include "tests/models/llama_op_test_util.h"
#include "tests/models/llama_test_model.h"

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

template <typename T>
T* As(gpu::DeviceSpan d) {
  return d.as<T>();
}

template <typename S>
class LlamaCudaTest : public gpu::testing::CudaTest {
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
  void Sync() { ASSERT_TRUE(this->stream_->Synchronize().ok()); }
};

using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(LlamaCudaTest, StorageTypes);

// ---------------------------------------------------------------------------
// The scaled embedding (Gemma's embed_scale = sqrt(hidden_size), ops/embedding.h): C = 71 odd,
// scale sqrt(71) rounded to S first, tokens with repeats and absent ones. Forward without
// positions: D(t s) of two S values, an exact fp32 product rounded once, equal to the host op's to
// the bit; scale 1.0 an exact copy. With a position table (the GPT path) within two roundings of
// double. dwte: an fp32 sum of up to N rows times s, one rounding (K = N + 1).
TYPED_TEST(LlamaCudaTest, ScaledEmbeddingMatchesTheHostOpAndDouble) {
  using S = TypeParam;
  using Dev = DevOf<S>;
  constexpr int V = 53, B = 3, T = 13;
  constexpr int64_t C = 71, N = int64_t{B} * T;
  const double scale = std::sqrt(static_cast<double>(C));
  std::vector<int32_t> tokens(N);
  for (int64_t r = 0; r < N; ++r) tokens[r] = static_cast<int32_t>((r * 7 + r / 5) % (V / 2));
  tokens[5] = tokens[20] = tokens[33] = 7;  // a token repeated across sequences
  const std::vector<double> wte = Rounded<S>(RandomValues(V * C, 1.0, 41));
  const std::vector<double> wpe = Rounded<S>(RandomValues(T * C, 1.0, 42));
  const std::vector<double> dx = Rounded<S>(RandomValues(N * C, 1.0, 43));
  const std::vector<S> wte_s = Cast<S>(wte), wpe_s = Cast<S>(wpe), dx_s = Cast<S>(dx);
  auto gwte = this->Put(wte_s), gwpe = this->Put(wpe_s), gdx = this->Put(dx_s);
  auto gtok = this->Put(tokens);
  auto gout = this->Poisoned(N * C * sizeof(S)), gcopy = this->Poisoned(N * C * sizeof(S));
  auto gpos_out = this->Poisoned(N * C * sizeof(S)), gdwte = this->Poisoned(V * C * sizeof(S));
  auto counts = this->Put(std::vector<int32_t>(V)),
       offsets = this->Put(std::vector<int32_t>(V + 1));
  auto cursor = this->Put(std::vector<int32_t>(V)), order = this->Put(std::vector<int32_t>(N));
  const lops::CountingSortScratch by_token{As<int32_t>(counts), As<int32_t>(offsets),
                                           As<int32_t>(cursor), As<int32_t>(order)};
  cudaStream_t cs = this->Native();
  const int32_t* tok = As<int32_t>(gtok);
  ASSERT_TRUE(lops::LaunchEmbeddingForward(cs, As<Dev>(gwte), static_cast<const Dev*>(nullptr), tok,
                                           N, T, C, V, As<Dev>(gout), nullptr, scale)
                  .ok());
  ASSERT_TRUE(lops::LaunchEmbeddingForward(cs, As<Dev>(gwte), static_cast<const Dev*>(nullptr), tok,
                                           N, T, C, V, As<Dev>(gcopy), nullptr, 1.0)
                  .ok());
  ASSERT_TRUE(lops::LaunchEmbeddingForward(cs, As<Dev>(gwte), As<Dev>(gwpe), tok, N, T, C, V,
                                           As<Dev>(gpos_out), nullptr, scale)
                  .ok());
  ASSERT_TRUE(lops::LaunchEmbeddingBackward(cs, tok, As<Dev>(gdx), N, T, C, V, T, As<Dev>(gdwte),
                                            static_cast<Dev*>(nullptr), by_token, nullptr, {},
                                            scale)
                  .ok());
  this->Sync();

  // The host op.
  std::vector<S> out_h(N * C), pos_out_h(N * C), dwte_h(V * C);
  ops::EmbeddingForward<S>(wte_s.data(), tokens.data(), N, C, V, out_h.data(), nullptr, 0, nullptr,
                           scale);
  ops::EmbeddingForward<S>(wte_s.data(), tokens.data(), N, C, V, pos_out_h.data(), wpe_s.data(), T,
                           nullptr, scale);
  std::vector<unsigned char> scratch(ops::EmbeddingBackwardScratchBytes(N, V));
  ops::EmbeddingBackward<S>(tokens.data(), dx_s.data(), N, C, V, dwte_h.data(), scratch.data(),
                            nullptr, 0, nullptr, scale);
  // Double, with the scale rounded to S.
  const double s = Rounded<S>({scale})[0];
  std::vector<double> out_d(N * C), pos_out_d(N * C), dwte_d(V * C, 0.0);
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      out_d[r * C + c] = wte[tokens[r] * C + c] * s;
      pos_out_d[r * C + c] = out_d[r * C + c] + wpe[(r % T) * C + c];
      dwte_d[tokens[r] * C + c] += s * dx[r * C + c];
    }
  }

  const std::vector<S> out = this->template Download<S>(gout, N * C);
  EXPECT_EQ(std::memcmp(out.data(), out_h.data(), out.size() * sizeof(S)), 0)
      << "the scaled lookup differs from the host op's";
  ExpectWithinBound("out vs double", ToDoubles(out), out_d, 2, Eps<S>(1));
  const std::vector<S> copy = this->template Download<S>(gcopy, N * C);
  for (int64_t r = 0; r < N; ++r) {
    ASSERT_EQ(std::memcmp(&copy[r * C], &wte_s[tokens[r] * C], C * sizeof(S)), 0) << "row " << r;
  }
  const std::vector<double> pos_out = this->Get(gpos_out, N * C);
  ExpectWithinBound("out with positions vs double", pos_out, pos_out_d, 4, Eps<S>(2));
  ExpectWithinBound("out with positions vs host", pos_out, ToDoubles(pos_out_h), 8, Eps<S>(2));
  const std::vector<double> dwte = this->Get(gdwte, V * C);
  ExpectWithinBound("dwte vs double", dwte, dwte_d, 2, Eps<S>(N + 1));
  ExpectWithinBound("dwte vs host", dwte, ToDoubles(dwte_h), 4, Eps<S>(N + 1));
}

// ---------------------------------------------------------------------------
// RMSNorm: y = S(x rstd w) one rounding; dx = S(dres + RMS'(dy)) one rounding after C-term fp32
// sums; dw = S(column sum) one rounding after a rows-term fp32 sum.
TYPED_TEST(LlamaCudaTest, RmsNormMatchesTheHostOpAndDouble) {
  using S = TypeParam;
  using Dev = DevOf<S>;
  const int64_t rows = 131, C = 77;  // rows span three weight-gradient partials
  const double eps = 1e-5;
  const std::vector<double> x = Rounded<S>(RandomValues(rows * C, 1.5, 1));
  std::vector<double> w = RandomValues(C, 0.3, 2);
  for (double& v : w) v += 1.0;
  w = Rounded<S>(w);
  const std::vector<double> dy = Rounded<S>(RandomValues(rows * C, 1.0, 3));
  const std::vector<double> dres = Rounded<S>(RandomValues(rows * C, 1.0, 4));

  auto gx = this->Put(Cast<S>(x)), gw = this->Put(Cast<S>(w)), gdy = this->Put(Cast<S>(dy)),
       gres = this->Put(Cast<S>(dres));
  auto gy = this->Poisoned(rows * C * sizeof(S)), grstd = this->Poisoned(rows * 4),
       gdx = this->Poisoned(rows * C * sizeof(S)), gdw = this->Poisoned(C * sizeof(S)),
       gpart = this->Poisoned(lops::RmsPartials(rows) * C * 4);
  cudaStream_t cs = this->Native();
  ASSERT_TRUE(lops::LaunchRmsNormForward(cs, As<Dev>(gx), As<Dev>(gw), static_cast<float>(eps),
                                         rows, C, As<Dev>(gy), As<float>(grstd))
                  .ok());
  ASSERT_TRUE(lops::LaunchRmsNormWeightGrad(cs, As<Dev>(gx), As<float>(grstd), As<Dev>(gdy), rows,
                                            C, As<float>(gpart), As<Dev>(gdw))
                  .ok());
  ASSERT_TRUE(lops::LaunchRmsNormBackward(cs, As<Dev>(gx), As<Dev>(gw), As<float>(grstd),
                                          As<Dev>(gdy), As<Dev>(gres), rows, C, As<Dev>(gdx))
                  .ok());
  this->Sync();

  // Host op in S, and in double.
  std::vector<S> y_h(rows * C), dx_h(rows * C), dw_h(C);
  std::vector<float> rstd_h(rows);
  const std::vector<S> xs = Cast<S>(x), ws = Cast<S>(w), dys = Cast<S>(dy), ress = Cast<S>(dres);
  ops::RmsNormForward<S>(xs.data(), ws.data(), eps, rows, C, y_h.data(), rstd_h.data());
  ops::RmsNormBackward<S>(xs.data(), ws.data(), rstd_h.data(), dys.data(), ress.data(), rows, C,
                          dx_h.data(), dw_h.data());
  std::vector<double> y_d(rows * C), dx_d(rows * C), dw_d(C), rstd_d(rows);
  ops::RmsNormForward<double>(x.data(), w.data(), eps, rows, C, y_d.data(), rstd_d.data());
  ops::RmsNormBackward<double>(x.data(), w.data(), rstd_d.data(), dy.data(), dres.data(), rows, C,
                               dx_d.data(), dw_d.data());

  const std::vector<double> y = this->Get(gy, rows * C), dx = this->Get(gdx, rows * C),
                            dw = this->Get(gdw, C);
  const std::vector<float> rstd = this->template Download<float>(grstd, rows);
  ExpectWithinBound("rstd vs double", std::vector<double>(rstd.begin(), rstd.end()), rstd_d, 4,
                    Eps<float>(C));
  ExpectWithinBound("y vs double", y, y_d, 2, Eps<S>(C));  // one rounding + fp32 rstd
  ExpectWithinBound("y vs host", y, ToDoubles(y_h), 4, Eps<S>(C));
  ExpectWithinBound("dx vs double", dx, dx_d, 4, Eps<S>(C));
  ExpectWithinBound("dx vs host", dx, ToDoubles(dx_h), 8, Eps<S>(C));
  ExpectWithinBound("dw vs double", dw, dw_d, 2, Eps<S>(rows));
  ExpectWithinBound("dw vs host", dw, ToDoubles(dw_h), 4, Eps<S>(rows));
}

// ---------------------------------------------------------------------------
// The host op's rotation of x (rows of `stride`, `heads` turning heads of p.head_dim) with p's
// table for T positions, in S and in double; inverse: the backward's. What the device is held to.
template <typename S>
std::pair<std::vector<S>, std::vector<double>> HostRope(const ops::RopeParams& p,
                                                        const std::vector<double>& x, int64_t rows,
                                                        int64_t stride, int heads, int T,
                                                        bool inverse, const int32_t* pos) {
  const int rd = ops::RopeRotaryDim(p), half = rd / 2, hs = p.head_dim;
  std::vector<float> cos_h(int64_t{T} * half), sin_h(int64_t{T} * half);
  ops::RopeTable<float>(p, T, cos_h.data(), sin_h.data());
  std::vector<double> cos_d(int64_t{T} * half), sin_d(int64_t{T} * half);
  ops::RopeTable<double>(p, T, cos_d.data(), sin_d.data());
  std::vector<S> xh = Cast<S>(x);
  std::vector<double> xd = x;
  if (inverse) {
    ops::RopeBackward<S>(xh.data(), rows, stride, heads, hs, T, cos_h.data(), sin_h.data(), pos,
                         rd);
    ops::RopeBackward<double>(xd.data(), rows, stride, heads, hs, T, cos_d.data(), sin_d.data(),
                              pos, rd);
  } else {
    ops::RopeForward<S>(xh.data(), rows, stride, heads, hs, T, cos_h.data(), sin_h.data(), pos, rd);
    ops::RopeForward<double>(xd.data(), rows, stride, heads, hs, T, cos_d.data(), sin_d.data(), pos,
                             rd);
  }
  return {std::move(xh), std::move(xd)};
}

// Rotary embeddings: the device table against RopeTable<float> (the same double evaluation,
// rounded once: equal up to one fp32 ulp where the device's double cos/sin round the other way);
// the rotation in place on the q and k heads of a strided [q | k | v | pad] buffer (one rounding
// per output after a two-term fp32 sum), the v and pad columns untouched bit for bit. Twice: the
// whole head with Llama 3's scaling, and Phi-4-mini's partial rotary (12 of 16 columns) with
// LongRoPE factors and attention factor, whose other 4 columns of each head stay untouched too.
TYPED_TEST(LlamaCudaTest, RopeTableAndRotationMatchTheHostOpAndDouble) {
  using S = TypeParam;
  using Dev = DevOf<S>;
  ops::RopeParams llama3;
  llama3.head_dim = 16;
  llama3.theta = 500000.0;
  llama3.llama3 = true;
  llama3.original_max_position = 16;  // puts frequencies in all three llama3 bands
  ops::RopeParams longrope;
  longrope.head_dim = 16;
  longrope.rotary_dim = 12;
  longrope.ext_factors = {1.0, 1.5, 2.0, 4.0, 9.0, 30.0};
  longrope.attention_factor = 1.1902380714238083;
  for (const ops::RopeParams& p : {llama3, longrope}) {
    SCOPED_TRACE(p.rotary_dim == 0 ? "whole head, llama3" : "partial rotary, longrope");
    const int rd = ops::RopeRotaryDim(p);
    const int B = 2, T = 37, H = 4, Hkv = 2, hs = p.head_dim, half = rd / 2;
    const int64_t rows = int64_t{B} * T, stride = int64_t{H + 2 * Hkv} * hs + 5;
    const std::vector<double> x = Rounded<S>(RandomValues(rows * stride, 1.0, 11));

    auto gcos = this->Poisoned(int64_t{T} * half * 4), gsin = this->Poisoned(int64_t{T} * half * 4);
    auto gx = this->Put(Cast<S>(x)), gdx = this->Put(Cast<S>(x));
    cudaStream_t cs = this->Native();
    ASSERT_TRUE(lops::LaunchRopeTable(cs, p, T, As<float>(gcos), As<float>(gsin)).ok());
    ASSERT_TRUE(lops::LaunchRope(cs, As<Dev>(gx), rows, stride, H + Hkv, hs, T, As<float>(gcos),
                                 As<float>(gsin), false, nullptr, rd)
                    .ok());
    ASSERT_TRUE(lops::LaunchRope(cs, As<Dev>(gdx), rows, stride, H + Hkv, hs, T, As<float>(gcos),
                                 As<float>(gsin), true, nullptr, rd)
                    .ok());
    this->Sync();

    std::vector<double> cos_d(int64_t{T} * half), sin_d(int64_t{T} * half);
    ops::RopeTable<double>(p, T, cos_d.data(), sin_d.data());
    const std::vector<float> cos_g = this->template Download<float>(gcos, cos_d.size()),
                             sin_g = this->template Download<float>(gsin, sin_d.size());
    for (size_t i = 0; i < cos_d.size(); ++i) {
      // One rounding of the double value: within one fp32 unit roundoff of it (and the host's).
      EXPECT_LE(std::abs(cos_g[i] - cos_d[i]), 0x1p-24 * std::abs(cos_d[i]) + 1e-30) << i;
      EXPECT_LE(std::abs(sin_g[i] - sin_d[i]), 0x1p-24 * std::abs(sin_d[i]) + 1e-30) << i;
    }

    for (bool inverse : {false, true}) {
      SCOPED_TRACE(inverse ? "backward" : "forward");
      const auto [xh, xd] = HostRope<S>(p, x, rows, stride, H + Hkv, T, inverse, nullptr);
      const std::vector<S> got_s = this->template Download<S>(inverse ? gdx : gx, rows * stride);
      const std::vector<double> got = ToDoubles(got_s);
      ExpectWithinBound("rotated vs double", got, xd, 2, Eps<S>(2));
      ExpectWithinBound("rotated vs host", got, ToDoubles(xh), 4, Eps<S>(2));
      const std::vector<S> in = Cast<S>(x);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < stride; ++c) {
          if (c < int64_t{H + Hkv} * hs && c % hs < rd) continue;  // a turning column
          ASSERT_EQ(std::memcmp(&got_s[r * stride + c], &in[r * stride + c], sizeof(S)), 0)
              << "column " << c << " of row " << r << " does not turn but changed";
        }
      }
    }
  }
}

// position_ids of rows of tokens, row b holding examples of the lengths rows[b] in order
// (packed sequences: each example's positions restart at 0).
std::vector<int32_t> PackedPositions(const std::vector<std::vector<int>>& rows) {
  std::vector<int32_t> ids;
  for (const std::vector<int>& row : rows) {
    for (const int len : row) {
      for (int p = 0; p < len; ++p) ids.push_back(p);
    }
  }
  return ids;
}

// Packed sequences: row r rotated by the angle of position position_ids[r], against the host op
// given the same ids, with the bounds of the test above.
TYPED_TEST(LlamaCudaTest, RopeAtPositionIdsMatchesTheHostOpAndDouble) {
  using S = TypeParam;
  using Dev = DevOf<S>;
  ops::RopeParams p;
  p.head_dim = 16;
  const int B = 2, T = 37, H = 4, Hkv = 2, hs = p.head_dim, half = hs / 2;
  const std::vector<int32_t> pos = PackedPositions({{10, 20, 7}, {37}});
  const int64_t rows = int64_t{B} * T, stride = int64_t{H + 2 * Hkv} * hs;
  ASSERT_EQ(static_cast<int64_t>(pos.size()), rows);
  const std::vector<double> x = Rounded<S>(RandomValues(rows * stride, 1.0, 12));

  auto gcos = this->Poisoned(int64_t{T} * half * 4), gsin = this->Poisoned(int64_t{T} * half * 4);
  auto gx = this->Put(Cast<S>(x)), gdx = this->Put(Cast<S>(x)), gpos = this->Put(pos);
  cudaStream_t cs = this->Native();
  ASSERT_TRUE(lops::LaunchRopeTable(cs, p, T, As<float>(gcos), As<float>(gsin)).ok());
  for (const gpu::DeviceSpan& d : {gx, gdx}) {
    ASSERT_TRUE(lops::LaunchRope(cs, As<Dev>(d), rows, stride, H + Hkv, hs, T, As<float>(gcos),
                                 As<float>(gsin), d.data == gdx.data, As<int32_t>(gpos))
                    .ok());
  }
  this->Sync();

  for (bool inverse : {false, true}) {
    SCOPED_TRACE(inverse ? "backward" : "forward");
    const auto [xh, xd] = HostRope<S>(p, x, rows, stride, H + Hkv, T, inverse, pos.data());
    const std::vector<double> got = this->Get(inverse ? gdx : gx, rows * stride);
    ExpectWithinBound("rotated vs double", got, xd, 2, Eps<S>(2));
    ExpectWithinBound("rotated vs host", got, ToDoubles(xh), 4, Eps<S>(2));
  }
}

// ---------------------------------------------------------------------------
// SwiGLU: one rounding per output of a few fp32 operations (expf within 2 ulp on the GPU).
TYPED_TEST(LlamaCudaTest, SwigluMatchesTheHostOpAndDouble) {
  using S = TypeParam;
  using Dev = DevOf<S>;
  const int64_t rows = 19, I = 45;
  const std::vector<double> gu = Rounded<S>(RandomValues(rows * 2 * I, 4.0, 21));
  const std::vector<double> dh = Rounded<S>(RandomValues(rows * I, 1.0, 22));
  auto ggu = this->Put(Cast<S>(gu)), gdh = this->Put(Cast<S>(dh));
  auto gh = this->Poisoned(rows * I * sizeof(S));
  auto gdgu = this->Put(Cast<S>(gu));  // the backward in place over a copy of gate_up
  cudaStream_t cs = this->Native();
  ASSERT_TRUE(lops::LaunchSwigluForward(cs, As<Dev>(ggu), rows, I, As<Dev>(gh)).ok());
  ASSERT_TRUE(
      lops::LaunchSwigluBackward(cs, As<Dev>(gdgu), As<Dev>(gdh), rows, I, As<Dev>(gdgu)).ok());
  this->Sync();

  const std::vector<S> gus = Cast<S>(gu), dhs = Cast<S>(dh);
  std::vector<S> h_h(rows * I), dgu_h(rows * 2 * I);
  ops::SwigluForward<S>(gus.data(), rows, I, h_h.data());
  ops::SwigluBackward<S>(gus.data(), dhs.data(), rows, I, dgu_h.data());
  std::vector<double> h_d(rows * I), dgu_d(rows * 2 * I);
  ops::SwigluForward<double>(gu.data(), rows, I, h_d.data());
  ops::SwigluBackward<double>(gu.data(), dh.data(), rows, I, dgu_d.data());

  const std::vector<double> h = this->Get(gh, rows * I), dgu = this->Get(gdgu, rows * 2 * I);
  ExpectWithinBound("h vs double", h, h_d, 2, Eps<S>(8));
  ExpectWithinBound("h vs host", h, ToDoubles(h_h), 4, Eps<S>(8));
  ExpectWithinBound("dgate_up vs double", dgu, dgu_d, 2, Eps<S>(16));
  ExpectWithinBound("dgate_up vs host", dgu, ToDoubles(dgu_h), 4, Eps<S>(16));
}

// GeGLU (GatedActivation::kGeluTanh, Gemma's MLP): the same rounding points, gelu and gelu' in fp32
// with tanhf; gates with the huge (+-300), large (+-30, +-8) and near-zero (+-1e-3, +-1e-7, 0)
// values besides random ones, and the magnitude of the terms that cancel in 1 + tanh and
// 1 - tanh^2 (op_test::GegluTermsOf) added to the bound; where tanhf saturates (|g| >= 8) the
// results exactly those of gelu = g or 0, gelu' = 1 or 0.
TYPED_TEST(LlamaCudaTest, GegluMatchesTheHostOpAndDouble) {
  using S = TypeParam;
  using Dev = DevOf<S>;
  constexpr ops::GatedActivation kGelu = ops::GatedActivation::kGeluTanh;
  const int64_t rows = 19, I = 45;
  std::vector<double> gu = RandomValues(rows * 2 * I, 6.0, 23);
  const double special[] = {300, -300, 30, -30, 8, -8, -0.7518, 1e-3, -1e-3, 1e-7, -1e-7, 0};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < 12; ++c) gu[r * 2 * I + c] = special[(r + c) % 12];
  }
  gu = Rounded<S>(gu);
  const std::vector<double> dh = Rounded<S>(RandomValues(rows * I, 1.0, 24));
  auto ggu = this->Put(Cast<S>(gu)), gdh = this->Put(Cast<S>(dh));
  auto gh = this->Poisoned(rows * I * sizeof(S));
  auto gdgu = this->Put(Cast<S>(gu));  // the backward in place over a copy of gate_up
  cudaStream_t cs = this->Native();
  ASSERT_TRUE(lops::LaunchSwigluForward(cs, As<Dev>(ggu), rows, I, As<Dev>(gh), kGelu).ok());
  ASSERT_TRUE(
      lops::LaunchSwigluBackward(cs, As<Dev>(gdgu), As<Dev>(gdh), rows, I, As<Dev>(gdgu), kGelu)
          .ok());
  this->Sync();

  const std::vector<S> gus = Cast<S>(gu), dhs = Cast<S>(dh);
  std::vector<S> h_h(rows * I), dgu_h(rows * 2 * I);
  ops::SwigluForward<S>(gus.data(), rows, I, h_h.data(), kGelu);
  ops::SwigluBackward<S>(gus.data(), dhs.data(), rows, I, dgu_h.data(), kGelu);
  std::vector<double> h_d(rows * I), dgu_d(rows * 2 * I);
  ops::SwigluForward<double>(gu.data(), rows, I, h_d.data(), kGelu);
  ops::SwigluBackward<double>(gu.data(), dh.data(), rows, I, dgu_d.data(), kGelu);

  const op_test::GegluTerms terms = op_test::GegluTermsOf(gu, dh, rows, I);
  const std::vector<double> h = this->Get(gh, rows * I), dgu = this->Get(gdgu, rows * 2 * I);
  using terms_bound::ExpectWithinTermsBound;
  ExpectWithinTermsBound("h vs double", h, h_d, terms.h, 2, Eps<S>(8));
  ExpectWithinTermsBound("h vs host", h, ToDoubles(h_h), terms.h, 4, Eps<S>(8));
  ExpectWithinTermsBound("dgate_up vs double", dgu, dgu_d, terms.dgate_up, 2, Eps<S>(16));
  ExpectWithinTermsBound("dgate_up vs host", dgu, ToDoubles(dgu_h), terms.dgate_up, 4, Eps<S>(16));
  EXPECT_GT(op_test::ExpectSaturatedGegluIsExact<S>("CUDA", gu, dh, rows, I, h, dgu), 0);
}

// ---------------------------------------------------------------------------
// Grouped-query attention on strided [q | k | v | pad] rows. Rounding points (ops/attention.h):
// out one rounding after the probabilities' rounding (k = 4 with T-term fp32 sums); dq, dk, dv
// through the rounded dS and P (k = 12 as the host op's own test, sums of T group terms).
TYPED_TEST(LlamaCudaTest, GqaAttentionMatchesTheHostOpAndDoubleAndIsDeterministic) {
  using S = TypeParam;
  using Dev = DevOf<S>;
  struct Case {
    int B, T, H, Hkv, hs;
  };
  for (const Case& k : {Case{2, 45, 4, 2, 24}, Case{1, 70, 4, 1, 64}, Case{2, 33, 3, 3, 24},
                        Case{1, 45, 4, 2, 256}}) {
    SCOPED_TRACE("B=" + std::to_string(k.B) + " T=" + std::to_string(k.T) +
                 " H=" + std::to_string(k.H) + " Hkv=" + std::to_string(k.Hkv) +
                 " hs=" + std::to_string(k.hs));
    const int64_t N = int64_t{k.B} * k.T, Dq = int64_t{k.H} * k.hs, Dkv = int64_t{k.Hkv} * k.hs;
    const int64_t ld = Dq + 2 * Dkv + 3;
    const ops::AttentionDims hd{k.B, k.T, k.H, k.Hkv, k.hs, ld};
    const ops::AttentionDims gd{k.B, k.T, k.H, k.Hkv, k.hs, ld};
    const std::vector<double> qkv = Rounded<S>(RandomValues(N * ld, 1.5, 31 + k.T));
    const std::vector<double> dout = Rounded<S>(RandomValues(N * Dq, 1.0, 32 + k.T));

    auto gqkv = this->Put(Cast<S>(qkv)), gdout = this->Put(Cast<S>(dout));
    auto gout = this->Poisoned(N * Dq * sizeof(S)),
         glse = this->Poisoned(int64_t{k.B} * k.H * k.T * 4),
         gdelta = this->Poisoned(int64_t{k.B} * k.H * k.T * 4),
         gd1 = this->Poisoned(N * ld * sizeof(S)), gd2 = this->Poisoned(N * ld * sizeof(S));
    cudaStream_t cs = this->Native();
    const Dev* q = As<Dev>(gqkv);
    ASSERT_TRUE(lops::LaunchAttentionForward(cs, gd, q, q + Dq, q + Dq + Dkv, As<Dev>(gout),
                                             As<float>(glse))
                    .ok());
    for (gpu::DeviceSpan dst : {gd1, gd2}) {
      Dev* d = As<Dev>(dst);
      ASSERT_TRUE(lops::LaunchAttentionBackward(cs, gd, q, q + Dq, q + Dq + Dkv, As<Dev>(gout),
                                                As<Dev>(gdout), As<float>(glse), As<float>(gdelta),
                                                d, d + Dq, d + Dq + Dkv)
                      .ok());
    }
    this->Sync();

    const std::vector<S> qkv_s = Cast<S>(qkv), dout_s = Cast<S>(dout);
    std::vector<S> out_h(N * Dq), dqkv_h = op_test::Poisoned<S>(N * ld);
    std::vector<float> lse_h(int64_t{k.B} * k.H * k.T);
    ops::AttentionForward<S>(hd, qkv_s.data(), qkv_s.data() + Dq, qkv_s.data() + Dq + Dkv,
                             out_h.data(), lse_h.data());
    ops::AttentionBackward<S>(hd, qkv_s.data(), qkv_s.data() + Dq, qkv_s.data() + Dq + Dkv,
                              out_h.data(), dout_s.data(), lse_h.data(), dqkv_h.data(),
                              dqkv_h.data() + Dq, dqkv_h.data() + Dq + Dkv);
    std::vector<double> out_d(N * Dq), dqkv_d(N * ld, 0.0), lse_d(lse_h.size());
    ops::AttentionForward<double>(hd, qkv.data(), qkv.data() + Dq, qkv.data() + Dq + Dkv,
                                  out_d.data(), lse_d.data());
    ops::AttentionBackward<double>(hd, qkv.data(), qkv.data() + Dq, qkv.data() + Dq + Dkv,
                                   out_d.data(), dout.data(), lse_d.data(), dqkv_d.data(),
                                   dqkv_d.data() + Dq, dqkv_d.data() + Dq + Dkv);

    const double K = k.T * (k.H / k.Hkv) + k.hs;
    const std::vector<double> out = this->Get(gout, N * Dq);
    ExpectWithinBound("out vs double", out, out_d, 4, Eps<S>(K));
    ExpectWithinBound("out vs host", out, ToDoubles(out_h), 8, Eps<S>(K));
    const std::vector<float> lse = this->template Download<float>(glse, lse_h.size());
    ExpectWithinBound("lse vs double", std::vector<double>(lse.begin(), lse.end()), lse_d, 4,
                      Eps<float>(K));
    // The gradient columns (the pad columns are not written by either side).
    const std::vector<S> d1 = this->template Download<S>(gd1, N * ld);
    const std::vector<S> d2 = this->template Download<S>(gd2, N * ld);
    EXPECT_EQ(std::memcmp(d1.data(), d2.data(), d1.size() * sizeof(S)), 0)
        << "two backward runs differ";
    const auto columns = [&](const std::vector<double>& v, int64_t c0, int64_t width) {
      std::vector<double> out_cols;
      for (int64_t r = 0; r < N; ++r) {
        for (int64_t c = c0; c < c0 + width; ++c) out_cols.push_back(v[r * ld + c]);
      }
      return out_cols;
    };
    const std::vector<double> d1d = ToDoubles(d1), dqkv_hd = ToDoubles(dqkv_h);
    const std::pair<const char*, std::pair<int64_t, int64_t>> blocks[] = {
        {"dq", {0, Dq}}, {"dk", {Dq, Dkv}}, {"dv", {Dq + Dkv, Dkv}}};
    for (const auto& [name, cw] : blocks) {
      const std::vector<double> got = columns(d1d, cw.first, cw.second);
      ExpectWithinBound(std::string(name) + " vs double", got, columns(dqkv_d, cw.first, cw.second),
                        12, Eps<S>(K));
      ExpectWithinBound(std::string(name) + " vs host", got, columns(dqkv_hd, cw.first, cw.second),
                        24, Eps<S>(K));
    }
  }
}

// ---------------------------------------------------------------------------
// Packed sequences (issue 31): rows holding several examples, query t seeing keys
// t - position_ids[t] .. t only. Against the host op with the same position_ids and double, with
// the bounds of the test above, on both paths (kAuto: the tensor cores for 16-bit S and hs 64);
// T = 150 crosses the 64-row tiles, so a query tile meets key tiles some of its rows do not see
// at all and dk/dv blocks meet query tiles none of whose queries sees their keys.

// One forward and backward of the op on device buffers: out (N, Dq) and dqkv (N, ld).
struct PackedRun {
  gpu::DeviceSpan out, lse, delta, dqkv;
};

template <typename S>
class LlamaPackedAttentionTest : public LlamaCudaTest<S> {
 protected:
  PackedRun Run(const ops::AttentionDims& d, const std::vector<double>& qkv,
                const std::vector<double>& dout, lops::AttentionPath path) {
    using Dev = DevOf<S>;
    const int64_t N = int64_t{d.batch_size} * d.seq_len, Dq = int64_t{d.num_heads} * d.head_dim;
    const int64_t Dkv = int64_t{d.num_kv_heads} * d.head_dim, ld = d.row_stride;
    const int64_t stats = int64_t{d.batch_size} * d.num_heads * d.seq_len * 4;
    const gpu::DeviceSpan gqkv = this->Put(Cast<S>(qkv)), gdout = this->Put(Cast<S>(dout));
    PackedRun r{this->Poisoned(N * Dq * sizeof(S)), this->Poisoned(stats), this->Poisoned(stats),
                this->Poisoned(N * ld * sizeof(S))};
    const cudaStream_t cs = this->Native();
    const Dev* q = As<Dev>(gqkv);
    Dev* g = As<Dev>(r.dqkv);
    EXPECT_TRUE(lops::LaunchAttentionForward(cs, d, q, q + Dq, q + Dq + Dkv, As<Dev>(r.out),
                                             As<float>(r.lse), path)
                    .ok());
    EXPECT_TRUE(lops::LaunchAttentionBackward(cs, d, q, q + Dq, q + Dq + Dkv, As<Dev>(r.out),
                                              As<Dev>(gdout), As<float>(r.lse), As<float>(r.delta),
                                              g, g + Dq, g + Dq + Dkv, path)
                    .ok());
    this->Sync();
    return r;
  }

  struct Case {
    int B, T, H, Hkv, hs;
    std::vector<std::vector<int>> rows;  // example lengths per row; empty: not packed
    int window = 0;                      // AttentionDims::window
    double scale = 0;                    // AttentionDims::scale
  };

  // Case k against the host op with the same position_ids and window and against double, on
  // both paths, with the bounds of GqaAttentionMatchesTheHostOpAndDoubleAndIsDeterministic.
  void ExpectMatchesTheHostOpAndDouble(const Case& k);
};
TYPED_TEST_SUITE(LlamaPackedAttentionTest, StorageTypes);

template <typename S>
void LlamaPackedAttentionTest<S>::ExpectMatchesTheHostOpAndDouble(const Case& k) {
  const std::vector<int32_t> pos = PackedPositions(k.rows);
  const int64_t N = int64_t{k.B} * k.T, Dq = int64_t{k.H} * k.hs, Dkv = int64_t{k.Hkv} * k.hs;
  const int64_t ld = Dq + 2 * Dkv;
  ASSERT_TRUE(pos.empty() || static_cast<int64_t>(pos.size()) == N);
  const std::vector<double> qkv = Rounded<S>(RandomValues(N * ld, 1.5, 61 + k.T));
  const std::vector<double> dout = Rounded<S>(RandomValues(N * Dq, 1.0, 62 + k.T));
  ops::AttentionDims hd{k.B, k.T, k.H, k.Hkv, k.hs, ld};
  hd.position_ids = pos.empty() ? nullptr : pos.data();
  hd.window = k.window;
  hd.scale = k.scale;
  const std::vector<S> qkv_s = Cast<S>(qkv), dout_s = Cast<S>(dout);
  std::vector<S> out_h(N * Dq), dqkv_h(N * ld);
  std::vector<float> lse_h(int64_t{k.B} * k.H * k.T);
  ops::AttentionForward<S>(hd, qkv_s.data(), qkv_s.data() + Dq, qkv_s.data() + Dq + Dkv,
                           out_h.data(), lse_h.data());
  ops::AttentionBackward<S>(hd, qkv_s.data(), qkv_s.data() + Dq, qkv_s.data() + Dq + Dkv,
                            out_h.data(), dout_s.data(), lse_h.data(), dqkv_h.data(),
                            dqkv_h.data() + Dq, dqkv_h.data() + Dq + Dkv);
  std::vector<double> out_d(N * Dq), dqkv_d(N * ld), lse_d(lse_h.size());
  ops::AttentionForward<double>(hd, qkv.data(), qkv.data() + Dq, qkv.data() + Dq + Dkv,
                                out_d.data(), lse_d.data());
  ops::AttentionBackward<double>(hd, qkv.data(), qkv.data() + Dq, qkv.data() + Dq + Dkv,
                                 out_d.data(), dout.data(), lse_d.data(), dqkv_d.data(),
                                 dqkv_d.data() + Dq, dqkv_d.data() + Dq + Dkv);
  ops::AttentionDims gd = hd;
  if (!pos.empty()) gd.position_ids = As<int32_t>(this->Put(pos));
  const double K = k.T * (k.H / k.Hkv) + k.hs;
  for (const lops::AttentionPath path :
       {lops::AttentionPath::kAuto, lops::AttentionPath::kCudaCores}) {
    SCOPED_TRACE("T=" + std::to_string(k.T) + " hs=" + std::to_string(k.hs) +
                 (pos.empty() ? "" : " packed") + " window=" + std::to_string(k.window) +
                 " scale=" + std::to_string(k.scale) +
                 (path == lops::AttentionPath::kAuto ? " auto" : " CUDA cores"));
    const PackedRun r = this->Run(gd, qkv, dout, path);
    const std::vector<double> out = this->Get(r.out, N * Dq);
    ExpectWithinBound("out vs double", out, out_d, 4, Eps<S>(K));
    ExpectWithinBound("out vs host", out, ToDoubles(out_h), 8, Eps<S>(K));
    const std::vector<float> lse = this->template Download<float>(r.lse, lse_h.size());
    ExpectWithinBound("lse vs double", std::vector<double>(lse.begin(), lse.end()), lse_d, 4,
                      Eps<float>(K));
    const std::vector<double> dqkv = this->Get(r.dqkv, N * ld);
    ExpectWithinBound("dqkv vs double", dqkv, dqkv_d, 12, Eps<S>(K));
    ExpectWithinBound("dqkv vs host", dqkv, ToDoubles(dqkv_h), 24, Eps<S>(K));
  }
}

TYPED_TEST(LlamaPackedAttentionTest, MatchesTheHostOpAndDoubleOnBothPaths) {
  this->ExpectMatchesTheHostOpAndDouble({2, 37, 4, 2, 24, {{10, 20, 7}, {37}}});
  this->ExpectMatchesTheHostOpAndDouble({2, 150, 2, 1, 64, {{10, 70, 60, 10}, {64, 1, 85}}});
}

// Sliding windows: query t sees keys t - w + 1 .. t only (within its example when packed). Windows
// that divide no tile (5, 37, 70), the key tile itself (64), 1; head dims 24 (CUDA cores only),
// 64 and 128 (the tensor cores for 16-bit S, whose dk/dv query tile is 32 at 128); T across the
// 32- and 64-row tiles, so blocks start past key 0 and dk/dv blocks stop before the last query
// tile.
TYPED_TEST(LlamaPackedAttentionTest, SlidingWindowMatchesTheHostOpAndDoubleOnBothPaths) {
  this->ExpectMatchesTheHostOpAndDouble({2, 37, 4, 2, 24, {}, 5});
  this->ExpectMatchesTheHostOpAndDouble({1, 150, 2, 1, 64, {}, 64});
  this->ExpectMatchesTheHostOpAndDouble({2, 150, 2, 1, 64, {{10, 70, 60, 10}, {64, 1, 85}}, 37});
  this->ExpectMatchesTheHostOpAndDouble({1, 130, 2, 2, 128, {}, 1});
  this->ExpectMatchesTheHostOpAndDouble({1, 200, 4, 2, 128, {}, 70});
}

// A given score scale (AttentionDims::scale, Gemma's query_pre_attn_scalar^-0.5): 0.3 in both
// kernel sets (head dim 24 on CUDA cores only; 64 and 128 on the tensor cores for 16-bit S), alone,
// with a window and with packed sequences, against the host op and double with the same scale.
TYPED_TEST(LlamaPackedAttentionTest, AGivenScaleMatchesTheHostOpAndDoubleOnBothPaths) {
  this->ExpectMatchesTheHostOpAndDouble({2, 37, 4, 2, 24, {}, 0, 0.3});
  this->ExpectMatchesTheHostOpAndDouble({1, 150, 2, 1, 64, {}, 0, 0.3});
  this->ExpectMatchesTheHostOpAndDouble(
      {2, 150, 2, 1, 64, {{10, 70, 60, 10}, {64, 1, 85}}, 37, 0.3});
  this->ExpectMatchesTheHostOpAndDouble({1, 130, 2, 2, 128, {}, 0, 0.3});
}

// 1 / sqrt(hs) given as the scale is the default to the bit (out, lse, dqkv), on both paths: as
// the double 1 / sqrt(hs) for head dims 64 and 128 (its fp32 rounding is the fp32 quotient), as
// the fp32 quotient 1.0f / sqrtf(24) for head dim 24 (where the double rounds one ulp away).
TYPED_TEST(LlamaPackedAttentionTest, OneOverSqrtHeadDimGivenExplicitlyIsBitIdenticalToTheDefault) {
  using S = TypeParam;
  for (const auto& [hs, scale] :
       {std::pair{64, 1.0 / std::sqrt(64.0)}, std::pair{128, 1.0 / std::sqrt(128.0)},
        std::pair{24, double{1.0f / std::sqrt(24.0f)}}}) {
    const int B = 2, T = 70, H = 2, Hkv = 1;
    const int64_t N = int64_t{B} * T, Dq = int64_t{H} * hs, ld = Dq + 2 * int64_t{Hkv} * hs;
    const std::vector<double> qkv = Rounded<S>(RandomValues(N * ld, 1.5, 101));
    const std::vector<double> dout = Rounded<S>(RandomValues(N * Dq, 1.0, 102));
    const ops::AttentionDims plain{B, T, H, Hkv, hs, ld};
    ops::AttentionDims given = plain;
    given.scale = scale;
    for (const lops::AttentionPath path :
         {lops::AttentionPath::kAuto, lops::AttentionPath::kCudaCores}) {
      SCOPED_TRACE(std::string(path == lops::AttentionPath::kAuto ? "auto" : "CUDA cores") +
                   " hs=" + std::to_string(hs));
      const PackedRun a = this->Run(plain, qkv, dout, path), b = this->Run(given, qkv, dout, path);
      for (const auto& [x, y, bytes, what] :
           {std::tuple{a.out, b.out, N * Dq * int64_t{sizeof(S)}, "out"},
            std::tuple{a.lse, b.lse, int64_t{B} * H * T * 4, "lse"},
            std::tuple{a.dqkv, b.dqkv, N * ld * int64_t{sizeof(S)}, "dqkv"}}) {
        const std::vector<uint8_t> u = this->template Download<uint8_t>(x, bytes),
                                   v = this->template Download<uint8_t>(y, bytes);
        EXPECT_EQ(std::memcmp(u.data(), v.data(), size_t(bytes)), 0) << what;
      }
    }
  }
}

// A window of T or more masks nothing: out, lse and dqkv equal those without a window to the
// bit, on both paths.
TYPED_TEST(LlamaPackedAttentionTest, AWindowOfTOrMoreIsBitIdenticalToNoWindow) {
  using S = TypeParam;
  const int B = 1, T = 150, H = 2, Hkv = 1, hs = 64;
  const int64_t N = int64_t{B} * T, Dq = int64_t{H} * hs, ld = Dq + 2 * int64_t{Hkv} * hs;
  const std::vector<double> qkv = Rounded<S>(RandomValues(N * ld, 1.5, 81));
  const std::vector<double> dout = Rounded<S>(RandomValues(N * Dq, 1.0, 82));
  const ops::AttentionDims plain{B, T, H, Hkv, hs, ld};
  for (const lops::AttentionPath path :
       {lops::AttentionPath::kAuto, lops::AttentionPath::kCudaCores}) {
    const PackedRun a = this->Run(plain, qkv, dout, path);
    for (const int w : {T, T + 1, 1 << 30}) {
      SCOPED_TRACE(std::string(path == lops::AttentionPath::kAuto ? "auto" : "CUDA cores") +
                   " window=" + std::to_string(w));
      ops::AttentionDims d = plain;
      d.window = w;
      const PackedRun b = this->Run(d, qkv, dout, path);
      for (const auto& [x, y, bytes, what] :
           {std::tuple{a.out, b.out, N * Dq * int64_t{sizeof(S)}, "out"},
            std::tuple{a.lse, b.lse, int64_t{B} * H * T * 4, "lse"},
            std::tuple{a.dqkv, b.dqkv, N * ld * int64_t{sizeof(S)}, "dqkv"}}) {
        const std::vector<uint8_t> u = this->template Download<uint8_t>(x, bytes),
                                   v = this->template Download<uint8_t>(y, bytes);
        EXPECT_EQ(std::memcmp(u.data(), v.data(), size_t(bytes)), 0) << what;
      }
    }
  }
}

// A key outside a query's window does not influence it: with k and v of token `key` replaced
// (window w: seen by queries key .. key + w - 1 only), out and dq of every other query and dk, dv
// of every key none of whose queries is one of those are unchanged to the bit, on both paths;
// out row `key` does change (the check is not vacuous). T 150 and w 40 put the seeing queries
// inside one 64-row tile and the unchanged ones in tiles before, at and after it.
TYPED_TEST(LlamaPackedAttentionTest, AKeyOutsideTheWindowDoesNotInfluenceTheQuery) {
  using S = TypeParam;
  const int B = 1, T = 150, H = 2, Hkv = 1, hs = 64, w = 40, key = 70;
  const int64_t N = int64_t{B} * T, Dq = int64_t{H} * hs, Dkv = int64_t{Hkv} * hs;
  const int64_t ld = Dq + 2 * Dkv;
  const std::vector<double> qkv = Rounded<S>(RandomValues(N * ld, 1.5, 91));
  const std::vector<double> dout = Rounded<S>(RandomValues(N * Dq, 1.0, 92));
  std::vector<double> changed = qkv;
  const std::vector<double> other = Rounded<S>(RandomValues(N * ld, 1.5, 93));
  for (int64_t j = Dq; j < ld; ++j) changed[key * ld + j] = other[key * ld + j];
  ops::AttentionDims d{B, T, H, Hkv, hs, ld};
  d.window = w;
  for (const lops::AttentionPath path :
       {lops::AttentionPath::kAuto, lops::AttentionPath::kCudaCores}) {
    SCOPED_TRACE(path == lops::AttentionPath::kAuto ? "auto" : "CUDA cores");
    const PackedRun a = this->Run(d, qkv, dout, path), b = this->Run(d, changed, dout, path);
    const std::vector<S> out_a = this->template Download<S>(a.out, N * Dq),
                         out_b = this->template Download<S>(b.out, N * Dq);
    const std::vector<S> g_a = this->template Download<S>(a.dqkv, N * ld),
                         g_b = this->template Download<S>(b.dqkv, N * ld);
    const auto same = [](const std::vector<S>& u, const std::vector<S>& v, int64_t at, int64_t n) {
      return std::memcmp(&u[at], &v[at], size_t(n) * sizeof(S)) == 0;
    };
    for (int64_t t = 0; t < T; ++t) {
      if (t < key || t >= key + w) {
        EXPECT_TRUE(same(out_a, out_b, t * Dq, Dq)) << "out row " << t;
        EXPECT_TRUE(same(g_a, g_b, t * ld, Dq)) << "dq row " << t;
      }
      if (t < key - w + 1 || t >= key + w) {
        EXPECT_TRUE(same(g_a, g_b, t * ld + Dq, 2 * Dkv)) << "dk, dv row " << t;
      }
    }
    EXPECT_FALSE(same(out_a, out_b, key * Dq, Dq)) << "the changed key's own query";
  }
}

// The examples of a row do not see each other: with the q, k, v rows of the middle example
// replaced, the outputs and the q, k, v gradients of the other two are bit-identical (the other
// example's keys are masked, not merely small), on both paths; the middle example's first row
// does change (the check is not vacuous).
TYPED_TEST(LlamaPackedAttentionTest, AnExamplesResultsDoNotDependOnTheOtherExamplesOfItsRow) {
  using S = TypeParam;
  const int B = 1, T = 150, H = 2, Hkv = 2, hs = 64, mid0 = 40, mid1 = 110;
  const std::vector<int32_t> pos = PackedPositions({{mid0, mid1 - mid0, T - mid1}});
  const int64_t N = int64_t{B} * T, Dq = int64_t{H} * hs, ld = Dq + 2 * int64_t{Hkv} * hs;
  const std::vector<double> qkv = Rounded<S>(RandomValues(N * ld, 1.5, 71));
  const std::vector<double> dout = Rounded<S>(RandomValues(N * Dq, 1.0, 72));
  std::vector<double> changed = qkv;
  const std::vector<double> other = Rounded<S>(RandomValues(N * ld, 1.5, 73));
  for (int64_t i = mid0 * ld; i < mid1 * ld; ++i) changed[i] = other[i];
  const gpu::DeviceSpan gpos = this->Put(pos);
  ops::AttentionDims d{B, T, H, Hkv, hs, ld};
  d.position_ids = As<int32_t>(gpos);
  for (const lops::AttentionPath path :
       {lops::AttentionPath::kAuto, lops::AttentionPath::kCudaCores}) {
    SCOPED_TRACE(path == lops::AttentionPath::kAuto ? "auto" : "CUDA cores");
    const PackedRun a = this->Run(d, qkv, dout, path), b = this->Run(d, changed, dout, path);
    for (const auto& [x, y, width, what] :
         {std::tuple{a.out, b.out, Dq, "out"}, std::tuple{a.dqkv, b.dqkv, ld, "dqkv"}}) {
      const std::vector<S> u = this->template Download<S>(x, N * width),
                           v = this->template Download<S>(y, N * width);
      for (int64_t t = 0; t < T; ++t) {
        const bool same = std::memcmp(&u[t * width], &v[t * width], size_t(width) * sizeof(S)) == 0;
        if (t < mid0 || t >= mid1) {
          EXPECT_TRUE(same) << what << " row " << t << " changed with another example";
        } else if (t == mid0) {
          EXPECT_FALSE(same) << what << " row " << t << ": the changed example's own row";
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// The whole model through LlamaModel on the CUDA device against the host device and the double
// block functions (llama_test::Runner<double> on the S-rounded parameters). Bound: the host block
// tests (llama_kernels_test) hold a layer's output to 20 and its gradients to 40 eps roundings;
// through L layers, the embedding and the head the loss is held to 8 + 20 L and the gradients to
// 10 + 40 (L + 1), eps = Eps<S>(max(K, N)) with K the longest fp32 sum (the widest product or the
// attention's T); the CUDA run against the host run to twice that (the sum of both runs' bounds).
// A layer's q_proj and k_proj gradients add the magnitude of the attention backward's cancelling
// terms to their bound (llama_test::AttentionProjectionTerms, terms_bound.h): with one key (T = 1)
// they are zero in exact arithmetic, the double reference's are its own rounding (~1e-17), and a
// bound relative to that alone cannot hold for any run in fp32 or 16 bits.
LlamaConfig WholeModelConfig(bool tied) {
  LlamaConfig c = *LlamaPreset("llama-tiny");
  c.vocab_size = 53;
  c.hidden_size = 48;
  c.intermediate_size = 37;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 12;
  c.num_layers = 2;
  c.tie_embeddings = tied;
  c.rope_llama3 = tied;  // both rotary settings covered
  c.rope_original_max_position = 16;
  return c;
}

template <typename S>
void ExpectWholeModelMatches(const LlamaConfig& c, int B, int T, gpu::Device& cuda_device,
                             gpu::Stream& cuda_stream) {
  SCOPED_TRACE(std::string(c.tie_embeddings ? "tied" : "untied") + " B=" + std::to_string(B) +
               " T=" + std::to_string(T));
  const std::vector<std::vector<double>> md = llama_test::RandomLlama(c, 91);
  test_model::Model<S> m;
  m.blocks = llama_test::CastBlocks<S>(md);
  std::vector<std::vector<double>> rounded;
  for (const auto& b : m.blocks) rounded.push_back(ToDoubles(b));
  const std::vector<int32_t> tokens = llama_test::RandomTokens(B * T, c.vocab_size, 92);
  const std::vector<int32_t> targets = llama_test::RandomTokens(B * T, c.vocab_size, 93);

  auto model = LlamaModel::Create(c);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  auto host_device = gpu::CreateHostDevice({});
  ASSERT_TRUE(host_device.ok()) << host_device.status().ToString();
  auto host_stream = (*host_device)->CreateStream("host compute");
  ASSERT_TRUE(host_stream.ok()) << host_stream.status().ToString();
  auto on_cuda = test_model::ModelRun<S>::Create(**model, cuda_device, {B, T});
  ASSERT_TRUE(on_cuda.ok()) << on_cuda.status().ToString();
  auto on_host = test_model::ModelRun<S>::Create(**model, **host_device, {B, T});
  ASSERT_TRUE(on_host.ok()) << on_host.status().ToString();
  const auto r_cuda = (*on_cuda)->ForwardBackward(cuda_stream, m, tokens, targets);
  ASSERT_TRUE(r_cuda.ok()) << "CUDA: " << r_cuda.status().ToString();
  const auto r_host = (*on_host)->ForwardBackward(**host_stream, m, tokens, targets);
  ASSERT_TRUE(r_host.ok()) << "host: " << r_host.status().ToString();

  llama_test::Runner<double> exact(c, B, T);
  std::vector<std::vector<double>> g_exact;
  std::vector<double> tied_exact, dx0_exact;
  const double loss_exact =
      exact.Backward(rounded, tokens, targets, &g_exact, &tied_exact, &dx0_exact);
  exact.Loss(rounded, tokens, targets.data());
  const std::vector<double> logits_exact = exact.logits();

  const int L = c.num_layers;
  const int64_t N = int64_t{B} * T;
  const double K =
      std::max<double>({static_cast<double>(N), static_cast<double>(c.intermediate_size) * 2,
                        static_cast<double>(c.vocab_size), static_cast<double>(T) * 2});
  const double e = Eps<S>(K), loss_k = 8 + 20.0 * L, grad_k = 10 + 40.0 * (L + 1);
  ExpectWithinBound("loss vs double", {r_cuda->loss}, {loss_exact}, loss_k, e);
  ExpectWithinBound("loss vs host", {r_cuda->loss}, {r_host->loss}, 2 * loss_k, e);
  ExpectWithinBound("logits vs double", ToDoubles(r_cuda->logits), logits_exact, loss_k, e);
  ExpectWithinBound("logits vs host", ToDoubles(r_cuda->logits), ToDoubles(r_host->logits),
                    2 * loss_k, e);
  for (size_t b = 0; b < g_exact.size(); ++b) {
    const std::vector<double> g = ToDoubles(r_cuda->grads[b]), gh = ToDoubles(r_host->grads[b]);
    const bool layer = b >= 1 && b <= static_cast<size_t>(L);
    const std::vector<double> terms =
        layer ? llama_test::AttentionProjectionTerms(c, rounded[b], exact.layer_input(b - 1),
                                                     exact.layer_output_grad(b - 1), B, T)
              : std::vector<double>(g.size(), 0.0);
    for (const LlamaTensor& t : llama_test::BlockTensors(c, static_cast<int>(b))) {
      const auto slice = [&](const std::vector<double>& v) {
        return std::vector<double>(v.begin() + t.offset, v.begin() + t.offset + t.num_elems);
      };
      terms_bound::ExpectWithinTermsBound(t.name + " grad vs double", slice(g), slice(g_exact[b]),
                                          slice(terms), grad_k, e);
      terms_bound::ExpectWithinTermsBound(t.name + " grad vs host", slice(g), slice(gh),
                                          slice(terms), 2 * grad_k, e);
    }
  }
  if (c.tie_embeddings) {
    const std::vector<double> tg = ToDoubles(r_cuda->tied_grads.back());
    ExpectWithinBound("head d(embed_tokens) vs double", tg, tied_exact, grad_k, e);
    ExpectWithinBound("head d(embed_tokens) vs host", tg, ToDoubles(r_host->tied_grads.back()),
                      2 * grad_k, e);
  }
  ExpectWithinBound("d(embedding output) vs double", ToDoubles(r_cuda->dx0), dx0_exact, grad_k, e);
  ExpectWithinBound("d(embedding output) vs host", ToDoubles(r_cuda->dx0), ToDoubles(r_host->dx0),
                    2 * grad_k, e);
}

TYPED_TEST(LlamaCudaTest, WholeModelLossAndEveryGradientMatchTheHostDeviceAndDouble) {
  for (bool tied : {false, true}) {
    for (const auto& [B, T] : {std::pair{3, 11}, std::pair{2, 40}, std::pair{1, 1}}) {
      ExpectWholeModelMatches<TypeParam>(WholeModelConfig(tied), B, T, *this->device_,
                                         *this->stream_);
    }
  }
}

// The Llama layer's families (llama_config.h) on CUDA against the host backend, whole model, in
// fp32 (both sides round every op to fp32 at the same points; they differ only in summation
// order inside the products, attention and reductions): the loss and logits within 1e-5
// relative, every gradient tensor within 1e-4 of its largest element plus 1e-6 (the bound of
// the float64 family tests, tests/python/test_hf_families.py, which hold the host side to the
// published architectures). Options that the host ops implement and the CUDA ops are held to
// here: Qwen2 biases with a window on one layer, Qwen3 q/k norms with attention_bias, Gemma 3's
// (1 + w) and sandwich norms, GeGLU, scaled embedding, query scale and two RoPE bases, Gemma 2's
// soft-capped scores and logits (caps that bend the tiny model's values), Phi-4-mini's partial
// rotary with LongRoPE's short (T 11) and long (T 40) factors and attention factor.
LlamaConfig FamilyConfig(LlamaArch arch) {
  LlamaConfig c = WholeModelConfig(/*tied=*/arch != LlamaArch::kQwen3);
  c.arch = arch;
  c.rope_llama3 = false;
  c.sliding_window = 5;
  c.sliding_layers = {false, true};
  if (arch == LlamaArch::kQwen2) c.qkv_bias = true;
  if (arch == LlamaArch::kQwen3) c.qkv_bias = c.o_bias = c.qk_norm = true;
  if (arch == LlamaArch::kGemma3) {
    c.qk_norm = c.norm_unit_offset = c.sandwich_norms = c.gelu_tanh_mlp = true;
    c.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
    c.query_pre_attn_scalar = 16;
    c.rope_local_theta = 100;
    c.rope_linear_factor = 4;
    c.sliding_layers = {true, false};
  }
  if (arch == LlamaArch::kGemma2) {
    c.norm_unit_offset = c.sandwich_norms = c.gelu_tanh_mlp = true;
    c.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
    c.query_pre_attn_scalar = 16;
    c.attn_logit_softcapping = 1.5;
    c.final_logit_softcapping = 2.0;
    c.sliding_layers = {true, false};
  }
  if (arch == LlamaArch::kPhi3) {  // Phi-4-mini's rotary: 8 of 12 columns turn, LongRoPE
    c.partial_rotary_factor = 0.67;
    for (int i = 0; i < LlamaRotaryDim(c) / 2; ++i) {
      c.rope_short_factor.push_back(1.0 + 0.5 * i);  // T = 11 <= 16 positions
      c.rope_long_factor.push_back(2.0 + 3.0 * i);   // T = 40 > 16
    }
    c.rope_attention_factor = LongRopeDefaultAttentionFactor(c.max_seq_len, 16);
  }
  return c;
}

void ExpectFamilyMatchesTheHost(const LlamaConfig& c, int B, int T, gpu::Device& cuda_device,
                                gpu::Stream& cuda_stream) {
  SCOPED_TRACE(std::string(LlamaArchName(c.arch)) + " B=" + std::to_string(B) +
               " T=" + std::to_string(T));
  ASSERT_TRUE(ValidateLlamaConfig(c).ok());
  test_model::Model<float> m;
  m.blocks = llama_test::CastBlocks<float>(llama_test::RandomLlama(c, 95));
  const std::vector<int32_t> tokens = llama_test::RandomTokens(B * T, c.vocab_size, 96);
  const std::vector<int32_t> targets = llama_test::RandomTokens(B * T, c.vocab_size, 97);
  auto model = LlamaModel::Create(c);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  auto host_device = gpu::CreateHostDevice({});
  ASSERT_TRUE(host_device.ok()) << host_device.status().ToString();
  auto host_stream = (*host_device)->CreateStream("host compute");
  ASSERT_TRUE(host_stream.ok()) << host_stream.status().ToString();
  auto on_cuda = test_model::ModelRun<float>::Create(**model, cuda_device, {B, T});
  ASSERT_TRUE(on_cuda.ok()) << on_cuda.status().ToString();
  auto on_host = test_model::ModelRun<float>::Create(**model, **host_device, {B, T});
  ASSERT_TRUE(on_host.ok()) << on_host.status().ToString();
  const auto r_cuda = (*on_cuda)->ForwardBackward(cuda_stream, m, tokens, targets);
  ASSERT_TRUE(r_cuda.ok()) << "CUDA: " << r_cuda.status().ToString();
  const auto r_host = (*on_host)->ForwardBackward(**host_stream, m, tokens, targets);
  ASSERT_TRUE(r_host.ok()) << "host: " << r_host.status().ToString();
  EXPECT_NEAR(r_cuda->loss, r_host->loss, 1e-5 * std::abs(r_host->loss));
  const auto close = [](const std::string& what, const std::vector<double>& got,
                        const std::vector<double>& want) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double max_want = 0, worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      max_want = std::max(max_want, std::abs(want[i]));
      const double err = std::abs(got[i] - want[i]);
      if (!(err <= worst)) worst = err, at = i;  // NaN counts as worst
    }
    EXPECT_LE(worst, 1e-4 * max_want + 1e-6)
        << what << ": worst at " << at << " cuda " << got[at] << " host " << want[at];
  };
  close("logits", ToDoubles(r_cuda->logits), ToDoubles(r_host->logits));
  for (size_t b = 0; b < r_host->grads.size(); ++b) {
    for (const LlamaTensor& t : llama_test::BlockTensors(c, static_cast<int>(b))) {
      const std::vector<double> g = ToDoubles(r_cuda->grads[b]), gh = ToDoubles(r_host->grads[b]);
      close(t.name + " grad",
            std::vector<double>(g.begin() + t.offset, g.begin() + t.offset + t.num_elems),
            std::vector<double>(gh.begin() + t.offset, gh.begin() + t.offset + t.num_elems));
    }
  }
  if (c.tie_embeddings) {
    close("head d(embed_tokens)", ToDoubles(r_cuda->tied_grads.back()),
          ToDoubles(r_host->tied_grads.back()));
  }
  close("d(embedding output)", ToDoubles(r_cuda->dx0), ToDoubles(r_host->dx0));
}

class LlamaFamilyCudaTest : public gpu::testing::CudaTest {};

TEST_F(LlamaFamilyCudaTest, EveryFamilyMatchesTheHostBackendInFp32) {
  for (LlamaArch arch : {LlamaArch::kQwen2, LlamaArch::kQwen3, LlamaArch::kGemma3,
                         LlamaArch::kGemma2, LlamaArch::kPhi3}) {
    for (const auto& [B, T] : {std::pair{3, 11}, std::pair{1, 40}}) {
      ExpectFamilyMatchesTheHost(FamilyConfig(arch), B, T, *device_, *stream_);
    }
  }
}

// Gemma 3 (and Gemma 2) at their own head dim, 256 (heads x head_dim != hidden, as the 1B, 4B
// and 12B models have it): the attention past 128, on CUDA cores with dynamic shared tiles.
TEST_F(LlamaFamilyCudaTest, GemmaAtHeadDim256MatchesTheHostBackendInFp32) {
  for (LlamaArch arch : {LlamaArch::kGemma3, LlamaArch::kGemma2}) {
    LlamaConfig c = FamilyConfig(arch);
    c.head_dim = 256;
    c.query_pre_attn_scalar = 256;
    ExpectFamilyMatchesTheHost(c, 2, 23, *device_, *stream_);
  }
}

// ---------------------------------------------------------------------------
// Argument checks run before any CUDA call, so they hold without a GPU.
TEST(LlamaCudaArguments, OpLaunchersRejectBadArgumentsBeforeLaunching) {
  float* p = reinterpret_cast<float*>(uintptr_t{256});  // never dereferenced
  const auto invalid = [](const Status& s) { return s.code() == StatusCode::kInvalidArgument; };
  EXPECT_TRUE(invalid(lops::LaunchRmsNormForward<float>(nullptr, p, p, 1e-5f, 4, 0, p, p)));
  EXPECT_TRUE(invalid(lops::LaunchRmsNormForward<float>(nullptr, p, p, 0.0f, 4, 8, p, p)));
  EXPECT_TRUE(invalid(lops::LaunchRmsNormForward<float>(nullptr, p, nullptr, 1e-5f, 4, 8, p, p)));
  EXPECT_TRUE(invalid(lops::LaunchRmsNormBackward<float>(nullptr, p, p, p, nullptr, p, 4, 8, p)));
  EXPECT_TRUE(invalid(lops::LaunchRmsNormWeightGrad<float>(nullptr, p, p, p, -1, 8, p, p)));
  ops::RopeParams odd;
  odd.head_dim = 7;
  EXPECT_TRUE(invalid(lops::LaunchRopeTable(nullptr, odd, 4, p, p)));
  ops::RopeParams wide;
  wide.head_dim = 2 * lops::kRopeMaxHeadDim;
  EXPECT_TRUE(invalid(lops::LaunchRopeTable(nullptr, wide, 4, p, p)));
  EXPECT_TRUE(invalid(lops::LaunchRope<float>(nullptr, p, 4, 15, 2, 8, 4, p, p, false)))
      << "row_stride < num_heads head_dim";
  EXPECT_TRUE(invalid(lops::LaunchRope<float>(nullptr, p, 4, 16, 2, 8, 4, p, p, false, nullptr, 5)))
      << "an odd rotary dim";
  EXPECT_TRUE(
      invalid(lops::LaunchRope<float>(nullptr, p, 4, 16, 2, 8, 4, p, p, false, nullptr, 10)))
      << "a rotary dim past head_dim";
  ops::RopeParams factors;
  factors.head_dim = 8;
  factors.rotary_dim = 6;
  factors.ext_factors = {1.0, 2.0};  // 3 needed
  EXPECT_TRUE(invalid(lops::LaunchRopeTable(nullptr, factors, 4, p, p)));
  factors.ext_factors = {1.0, 0.0, 2.0};
  EXPECT_TRUE(invalid(lops::LaunchRopeTable(nullptr, factors, 4, p, p)));
  factors.ext_factors = {1.0, 1.0, 2.0};
  factors.attention_factor = 0;
  EXPECT_TRUE(invalid(lops::LaunchRopeTable(nullptr, factors, 4, p, p)));
  // Config validation refuses these for a model; the launcher itself returns the error rather
  // than reaching RopeInverseFrequencies' process-ending checks.
  ops::RopeParams scaled;
  scaled.head_dim = 8;
  for (const double f : {0.0, -2.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    scaled.linear_factor = f;
    EXPECT_TRUE(invalid(lops::LaunchRopeTable(nullptr, scaled, 4, p, p))) << f;
  }
  scaled.linear_factor = 1.0;
  scaled.llama3 = true;
  scaled.high_freq_factor = scaled.low_freq_factor;
  EXPECT_TRUE(invalid(lops::LaunchRopeTable(nullptr, scaled, 4, p, p)));
  scaled.high_freq_factor = 4.0;
  scaled.factor = 0;
  EXPECT_TRUE(invalid(lops::LaunchRopeTable(nullptr, scaled, 4, p, p)));
  scaled.factor = 8.0;
  scaled.original_max_position = 0;
  EXPECT_TRUE(invalid(lops::LaunchRopeTable(nullptr, scaled, 4, p, p)));
  EXPECT_TRUE(invalid(lops::LaunchSwigluForward<float>(nullptr, p, 4, 0, p)));
  EXPECT_TRUE(invalid(lops::LaunchSwigluBackward<float>(nullptr, p, nullptr, 4, 8, p)));
  const lops::CountingSortScratch sort{reinterpret_cast<int32_t*>(p), reinterpret_cast<int32_t*>(p),
                                       reinterpret_cast<int32_t*>(p),
                                       reinterpret_cast<int32_t*>(p)};
  const int32_t* ids = reinterpret_cast<const int32_t*>(p);
  for (const double scale : {std::nan(""), std::numeric_limits<double>::infinity()}) {
    EXPECT_TRUE(invalid(lops::LaunchEmbeddingForward<float>(nullptr, p, nullptr, ids, 4, 4, 8, 16,
                                                            p, nullptr, scale)))
        << scale;
    EXPECT_TRUE(invalid(lops::LaunchEmbeddingBackward<float>(nullptr, ids, p, 4, 4, 8, 16, 4, p,
                                                             nullptr, sort, nullptr, {}, scale)))
        << scale;
  }
  const auto unknown_act = static_cast<ops::GatedActivation>(7);
  EXPECT_TRUE(invalid(lops::LaunchSwigluForward<float>(nullptr, p, 4, 8, p, unknown_act)));
  EXPECT_TRUE(invalid(lops::LaunchSwigluBackward<float>(nullptr, p, p, 4, 8, p, unknown_act)));
  const ops::AttentionDims not_grouped{1, 8, 3, 2, 8, 64};  // 3 % 2 != 0
  EXPECT_TRUE(invalid(lops::LaunchAttentionForward<float>(nullptr, not_grouped, p, p, p, p, p)));
  const ops::AttentionDims too_wide{1, 8, 2, 1, 2 * lops::kAttentionMaxHeadDim, 1024};
  EXPECT_TRUE(invalid(lops::LaunchAttentionForward<float>(nullptr, too_wide, p, p, p, p, p)));
  const ops::AttentionDims narrow_rows{1, 8, 4, 2, 8, 31};  // row_stride < H hs
  EXPECT_TRUE(invalid(
      lops::LaunchAttentionBackward<float>(nullptr, narrow_rows, p, p, p, p, p, p, p, p, p, p)));
  const ops::AttentionDims ok{1, 8, 4, 2, 8, 64};
  EXPECT_TRUE(invalid(
      lops::LaunchAttentionBackward<float>(nullptr, ok, p, p, p, p, p, p, nullptr, p, p, p)));
  ops::AttentionDims negative_window = ok;
  negative_window.window = -1;
  EXPECT_TRUE(
      invalid(lops::LaunchAttentionForward<float>(nullptr, negative_window, p, p, p, p, p)));
  EXPECT_TRUE(invalid(lops::LaunchAttentionBackward<float>(nullptr, negative_window, p, p, p, p, p,
                                                           p, p, p, p, p)));
  for (const double scale : {-0.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    ops::AttentionDims bad_scale = ok;
    bad_scale.scale = scale;
    EXPECT_TRUE(invalid(lops::LaunchAttentionForward<float>(nullptr, bad_scale, p, p, p, p, p)))
        << scale;
    EXPECT_TRUE(invalid(
        lops::LaunchAttentionBackward<float>(nullptr, bad_scale, p, p, p, p, p, p, p, p, p, p)))
        << scale;
  }
}

// A head_dim past the CUDA attention's is a valid model (the host blocks take it), refused for
// CUDA when the engine prepares its compute stream (DecoderModel::PrepareComputeStream), not at
// the first block of the first step. Needs no GPU.
TEST(LlamaCudaArguments, AHeadDimPastTheCudaAttentionsIsRefusedBeforeTheFirstStep) {
  LlamaConfig c = WholeModelConfig(/*tied=*/false);
  c.head_dim = cuda::kLlamaCudaMaxHeadDim;
  EXPECT_TRUE(LlamaFamily{c}.CudaSupports().ok());
  c.head_dim = cuda::kLlamaCudaMaxHeadDim + 32;
  ASSERT_TRUE(ValidateLlamaConfig(c).ok()) << "the host blocks take it";
  const Status s = LlamaFamily{c}.CudaSupports();
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("head_dim <= 256, not 288"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("--device host"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace strata::models
