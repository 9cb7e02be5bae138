// The GPT's CUDA kernels (models/cuda/) against the host kernels (models/gpt_kernels.h)
// run in double: every block's forward and backward on random inputs and odd shapes,
// the whole model through GptModel on a CUDA stream, and determinism. Tests that need
// a GPU skip with the reason without one; the argument checks and the tolerance's own
// check run everywhere.
//
// Tolerance (fp32 against a double reference): an element passes when
//   |gpu - ref| <= kSlack * L * eps32 * (|ref| + rms(ref))
// with eps32 = 2^-23 and L the longest chain of fp32 roundings that produced it (the
// reduction lengths along the path: C, 4C, T, the rows of a parameter-gradient sum, V).
// That is the classic worst-case bound of recursive summation (Higham, "Accuracy and
// Stability of Numerical Algorithms", ch. 4) with rms(ref) standing in for the size of
// the summands, so cancellation to a small |ref| does not make the check impossible.
// The GptCudaTolerance tests check, without a GPU, that the same bound accepts the host's
// own fp32 kernels (layer and whole model) and rejects a one-element error. Measured on
// x86-64: the host's fp32 results pass with kSlack = 0.04 and fail with 0.004, so
// kSlack = 1 leaves the GPU (other summation orders, other expf/tanhf) a margin of ~25x
// over the host's own rounding while an indexing or masking bug (errors of O(|ref|))
// still fails by orders of magnitude.
#include "models/cuda/gpt_cuda.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/model.h"
#include "gpu/cuda/cuda_native.h"
#include "models/cuda/gpt_cuda.cuh"
#include "models/gpt.h"
#include "tests/gpu/cuda_test_util.h"
#include "tests/models/gpt_test_model.h"

namespace strata::models {
namespace {

using test_model::CastModel;
using test_model::Model;
using test_model::RandomModel;
using test_model::RandomTokens;

constexpr double kSlack = 1.0;

double Rms(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return v.empty() ? 0.0 : std::sqrt(s / static_cast<double>(v.size()));
}

// Counts the elements of `got` (fp32) outside the tolerance around `ref` (double); reports
// the first few through ADD_FAILURE when `report`. `allowance`, when given, adds a
// per-element absolute term: the error a library function's own accuracy contributes,
// propagated to the output (see the GELU test).
template <typename Got>
int64_t CountOutside(const std::vector<Got>& got, const std::vector<double>& ref, double L,
                     const std::string& what, bool report = true,
                     const std::vector<double>* allowance = nullptr) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  const double rms = Rms(ref);
  const double rel = kSlack * L * FLT_EPSILON;
  int64_t bad = 0;
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    const double g = static_cast<double>(got[i]);
    const double tol = rel * (std::abs(ref[i]) + rms) + (allowance ? allowance->at(i) : 0.0);
    if (!(std::abs(g - ref[i]) <= tol)) {
      if (report && ++bad <= 5) {
        ADD_FAILURE() << what << "[" << i << "]: got " << g << ", reference " << ref[i]
                      << ", tolerance " << tol << " (L=" << L << ")";
      } else if (!report) {
        ++bad;
      }
    }
  }
  return bad;
}

template <typename Got>
void ExpectClose(const std::vector<Got>& got, const std::vector<double>& ref, double L,
                 const std::string& what) {
  EXPECT_EQ(CountOutside(got, ref, L, what), 0) << what;
}

std::vector<double> RandomVector(size_t n, double scale, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-scale, scale);
  std::vector<double> v(n);
  for (double& x : v) x = u(gen);
  return v;
}

std::vector<float> ToFloat(const std::vector<double>& v) { return {v.begin(), v.end()}; }
std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// An odd GPT shape: C = 48 with 3 heads (head size 16), V = 256.
GptShape OddShape(int layers, int max_seq_len) { return GptShape{256, max_seq_len, layers, 3, 48}; }

struct Batch {
  int B, T;
};
// B*T not a multiple of 32; T = 1 and 7; B > the layer's group (several groups, the
// accumulate path of the parameter gradients); T > 64 (past the host's row block).
const Batch kBatches[] = {{5, 7}, {3, 1}, {40, 7}, {2, 67}};

// Reduction length along the layer's longest path (C, 4C, T, plus the rows summed into
// a parameter gradient).
double LayerChain(const GptShape& s, int B, int T) {
  return 3.0 * s.channels + 4.0 * s.channels + 2.0 * T + double(B) * T;
}

// The whole model: errors compound through the layers, so the chain is every layer's
// (forward and backward) plus the head's.
double ModelChain(const GptShape& s, int B, int T) {
  return s.num_layers * 2 * LayerChain(s, B, T) +
         2.0 * (2.0 * s.channels + s.vocab_size + double(B) * T);
}

// ---------------------------------------------------------------------------
// Runs without a GPU.

TEST(GptCudaTolerance, ToleranceAdmitsHostFp32AndRejectsAnError) {
  const GptShape s = OddShape(1, 16);
  const int B = 5, T = 7;
  const Model<double> md = RandomModel(s, 11);
  const Model<float> mf = CastModel<float>(md);
  const std::vector<double> x = RandomVector(int64_t{B} * T * s.channels, 1.0, 12);
  const std::vector<float> xf = ToFloat(x);
  std::vector<double> yd(x.size()), scd(LayerScratchElems(s, B, T));
  std::vector<float> yf(x.size()), scf(LayerScratchElems(s, B, T));
  LayerForward<double>(s, md.blocks[1].data(), x.data(), yd.data(), B, T, scd.data());
  LayerForward<float>(s, mf.blocks[1].data(), xf.data(), yf.data(), B, T, scf.data());
  ExpectClose(yf, yd, LayerChain(s, B, T), "host fp32 layer forward");
  yf[17] += static_cast<float>(1e-3 * (std::abs(yd[17]) + Rms(yd)));
  EXPECT_EQ(CountOutside(yf, yd, LayerChain(s, B, T), "perturbed", /*report=*/false), 1);
}

// The whole-model bound admits the host's fp32 kernels on the shapes the GPU test uses.
TEST(GptCudaTolerance, WholeModelBoundAdmitsHostFp32) {
  const GptShape s = OddShape(3, 72);
  for (const Batch& b : {Batch{5, 7}, Batch{2, 67}}) {
    SCOPED_TRACE("B=" + std::to_string(b.B) + " T=" + std::to_string(b.T));
    const Model<double> md = RandomModel(s, 51);
    const std::vector<int32_t> tokens = RandomTokens(b.B * b.T, s.vocab_size, 52);
    const std::vector<int32_t> targets = RandomTokens(b.B * b.T, s.vocab_size, 53);
    test_model::Runner<double> rd(s, b.B, b.T);
    test_model::Runner<float> rf(s, b.B, b.T);
    std::vector<std::vector<double>> gd;
    std::vector<std::vector<float>> gf;
    std::vector<double> dxd;
    std::vector<float> dxf;
    const double loss_d = rd.Backward(md, tokens, targets, &gd, &dxd);
    const float loss_f = rf.Backward(CastModel<float>(md), tokens, targets, &gf, &dxf);
    const double L = ModelChain(s, b.B, b.T);
    ExpectClose(std::vector<float>{loss_f}, {loss_d}, L, "loss");
    ExpectClose(dxf, dxd, L, "d(embedding output)");
    for (size_t k = 0; k < gd.size(); ++k)
      ExpectClose(gf[k], gd[k], L, "block " + std::to_string(k));
  }
}

TEST(GptCudaArguments, AreCheckedBeforeAnythingIsLaunched) {
  // Op launchers: a negative size or a missing pointer is refused before the launch (the
  // null cudaStream_t is never used).
  float dummy = 0;
  EXPECT_EQ(cuda::LaunchGeluForward(nullptr, &dummy, -1, &dummy).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      cuda::LaunchLayerNormForward(nullptr, nullptr, &dummy, &dummy, 3, 4, &dummy, &dummy, &dummy)
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::LaunchMeanLoss(nullptr, &dummy, 0, &dummy).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(
      cuda::LaunchEmbeddingBackward(nullptr, nullptr, nullptr, 10, 3, 4, 8, 16, &dummy, &dummy)
          .code(),
      StatusCode::kInvalidArgument);  // 10 rows are not whole sequences of 3
  EXPECT_TRUE(cuda::LaunchGeluForward(nullptr, nullptr, 0, nullptr).ok());  // nothing to do

  // Block functions check the batch before they touch the stream (a host stream here).
  auto dev = gpu::CreateHostDevice({});
  ASSERT_TRUE(dev.ok());
  auto stream = (*dev)->CreateStream("s");
  ASSERT_TRUE(stream.ok());
  const GptShape s = OddShape(1, 16);
  const Status too_long =
      cuda::CudaLayerForward(s, **stream, &dummy, &dummy, &dummy, 1, 17, &dummy);
  EXPECT_EQ(too_long.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.message().find("max_seq_len"), std::string::npos) << too_long.ToString();
  EXPECT_EQ(
      cuda::CudaHeadForward(s, **stream, &dummy, &dummy, nullptr, 0, 4, &dummy, &dummy, nullptr)
          .code(),
      StatusCode::kInvalidArgument);
}

TEST(GptCudaScratch, CoversTheHostFigureAndTheModelTakesTheMaximum) {
  const GptShape s = OddShape(2, 128);
  for (const Batch& b : kBatches) {
    EXPECT_GE(cuda::CudaLayerScratchElems(s, b.B, b.T), LayerScratchElems(s, b.B, b.T));
    EXPECT_EQ(cuda::CudaHeadScratchElems(s, b.B, b.T), HeadScratchElems(s, b.B, b.T));
  }
  auto model = GptModel::Create(s);
  ASSERT_TRUE(model.ok());
  const engine::MicroBatchShape mb{2, 67};
  EXPECT_EQ((*model)->scratch_bytes(1, mb), cuda::CudaLayerScratchElems(s, 2, 67) * 4);
  EXPECT_EQ((*model)->scratch_bytes(3, mb), HeadScratchElems(s, 2, 67) * 4);
}

// ---------------------------------------------------------------------------
// On a GPU.

// A layer's forward and backward in double on random input (x, dy uniform in [-1, 1], seeds
// 22 and 23): the reference the CUDA layer is compared with. Shapes as in gpt_kernels.h.
struct LayerReference {
  std::vector<double> x, dy;  // (B, T, C)
  std::vector<double> y, dx;  // (B, T, C)
  std::vector<double> grads;  // the layer chunk
};

LayerReference ComputeLayerReference(const GptShape& s, const std::vector<double>& pd, int B,
                                     int T) {
  const int64_t N = int64_t{B} * T, C = s.channels;
  LayerReference r{RandomVector(N * C, 1.0, 22), RandomVector(N * C, 1.0, 23),
                   std::vector<double>(N * C), std::vector<double>(N * C),
                   std::vector<double>(pd.size())};
  std::vector<double> scratch(LayerScratchElems(s, B, T));
  LayerForward<double>(s, pd.data(), r.x.data(), r.y.data(), B, T, scratch.data());
  LayerBackward<double>(s, pd.data(), r.x.data(), r.dy.data(), r.dx.data(), r.grads.data(), B, T,
                        scratch.data());
  return r;
}

class GptCudaTest : public gpu::testing::CudaTest {
 protected:
  template <typename T>
  gpu::DeviceSpan Put(const std::vector<T>& v) {
    gpu::DeviceSpan d = Carve(std::max<size_t>(v.size() * sizeof(T), 4));
    Upload(d, v);
    return d;
  }
  // n floats of NaN: outputs must be written, never read first.
  gpu::DeviceSpan Poisoned(size_t n) {
    return Put(std::vector<float>(n, std::numeric_limits<float>::quiet_NaN()));
  }
  std::vector<float> Get(gpu::DeviceSpan d, size_t n) { return Download<float>(d, n); }
  // Scratch of n floats (NaN) followed by a guard of kGuard sentinels that the kernels must
  // leave alone: the scratch sizes in gpt_cuda.h cover what the kernels use.
  static constexpr size_t kGuard = 256;
  static constexpr float kSentinel = 12345.0f;
  gpu::DeviceSpan GuardedScratch(size_t n) {
    std::vector<float> v(n + kGuard, std::numeric_limits<float>::quiet_NaN());
    std::fill(v.begin() + n, v.end(), kSentinel);
    return Put(v);
  }
  void ExpectGuardIntact(gpu::DeviceSpan scratch, size_t n, const char* what) {
    const std::vector<float> v = Get(scratch, n + kGuard);
    for (size_t i = n; i < v.size(); ++i) {
      ASSERT_EQ(v[i], kSentinel) << what << " wrote past its scratch (element " << i << ")";
    }
  }
  void Sync() {
    const Status st = stream_->Synchronize();
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  // One layer's forward and backward on the GPU against the host kernels in double: outputs,
  // input gradient and every parameter gradient, element by element; the scratch's guard
  // stays intact.
  void CheckLayer(const GptShape& s, const std::vector<double>& pd, int B, int T) {
    SCOPED_TRACE("C=" + std::to_string(s.channels) + " H=" + std::to_string(s.num_heads) +
                 " B=" + std::to_string(B) + " T=" + std::to_string(T));
    const int64_t N = int64_t{B} * T, C = s.channels;
    const LayerReference ref = ComputeLayerReference(s, pd, B, T);
    const std::vector<double>&x = ref.x, &dy = ref.dy, &y_ref = ref.y, &dx_ref = ref.dx,
          &g_ref = ref.grads;

    const gpu::DeviceSpan p = Put(ToFloat(pd)), xi = Put(ToFloat(x)), d = Put(ToFloat(dy));
    const gpu::DeviceSpan y = Poisoned(N * C), dx = Poisoned(N * C), g = Poisoned(pd.size());
    const size_t scratch_elems = cuda::CudaLayerScratchElems(s, B, T);
    const gpu::DeviceSpan sc = GuardedScratch(scratch_elems);
    gpu::Stream& stream = *stream_;
    Status st = cuda::CudaLayerForward(s, stream, p.as<float>(), xi.as<float>(), y.as<float>(), B,
                                       T, sc.as<float>());
    ASSERT_TRUE(st.ok()) << st.ToString();
    st = cuda::CudaLayerBackward(s, stream, p.as<float>(), xi.as<float>(), d.as<float>(),
                                 dx.as<float>(), g.as<float>(), B, T, sc.as<float>());
    ASSERT_TRUE(st.ok()) << st.ToString();
    Sync();
    ExpectGuardIntact(sc, scratch_elems, "the layer");
    const double L = LayerChain(s, B, T);
    ExpectClose(Get(y, N * C), y_ref, L, "x_out");
    ExpectClose(Get(dx, N * C), dx_ref, 2 * L, "dx_in");
    const std::vector<float> grads = Get(g, pd.size());
    for (const TensorInfo& t : LayerTensors(s)) {
      const std::vector<float> got(grads.begin() + t.offset,
                                   grads.begin() + t.offset + t.num_elems);
      const std::vector<double> ref(g_ref.begin() + t.offset,
                                    g_ref.begin() + t.offset + t.num_elems);
      ExpectClose(got, ref, 2 * L, "d" + t.name);
    }
  }
};

// ---- Each op alone, against a double reference written out here (the host kernels'
// formulas), so that a failure of a block test can be traced to its op.

TEST_F(GptCudaTest, LayerNormForwardAndGradientsMatchADoubleReference) {
  const cudaStream_t cs = gpu::NativeStream(*stream_);
  for (const int64_t C : {7, 48, 200}) {
    for (const int64_t rows : {1, 35, 300}) {
      SCOPED_TRACE("rows=" + std::to_string(rows) + " C=" + std::to_string(C));
      const std::vector<double> x = RandomVector(rows * C, 2.0, 61),
                                dy = RandomVector(rows * C, 1.0, 62);
      const std::vector<double> w = RandomVector(C, 1.5, 63), b = RandomVector(C, 0.5, 64);
      const std::vector<double> res = RandomVector(rows * C, 1.0, 65);
      const std::vector<double> dw0 = RandomVector(C, 1.0, 66), db0 = RandomVector(C, 1.0, 67);
      std::vector<double> y(rows * C), mean(rows), rstd(rows), dx(rows * C), dw = dw0, db = db0;
      for (int64_t r = 0; r < rows; ++r) {
        double m = 0, v = 0;
        for (int64_t c = 0; c < C; ++c) m += x[r * C + c];
        m /= C;
        for (int64_t c = 0; c < C; ++c) v += (x[r * C + c] - m) * (x[r * C + c] - m);
        const double sd = 1.0 / std::sqrt(v / C + 1e-5);
        mean[r] = m, rstd[r] = sd;
        double gm = 0, gxm = 0;
        for (int64_t c = 0; c < C; ++c) {
          const double xh = (x[r * C + c] - m) * sd, g = dy[r * C + c] * w[c];
          y[r * C + c] = xh * w[c] + b[c];
          gm += g, gxm += g * xh;
          dw[c] += dy[r * C + c] * xh;
          db[c] += dy[r * C + c];
        }
        gm /= C, gxm /= C;
        for (int64_t c = 0; c < C; ++c) {
          const double xh = (x[r * C + c] - m) * sd;
          dx[r * C + c] = res[r * C + c] + sd * (dy[r * C + c] * w[c] - gm - xh * gxm);
        }
      }
      const gpu::DeviceSpan xd = Put(ToFloat(x)), wd = Put(ToFloat(w)), bd = Put(ToFloat(b));
      const gpu::DeviceSpan yd = Poisoned(rows * C), md = Poisoned(rows), sd = Poisoned(rows);
      const gpu::DeviceSpan g = Put(ToFloat(dy)), rd = Put(ToFloat(res));
      const gpu::DeviceSpan dwd = Put(ToFloat(dw0)), dbd = Put(ToFloat(db0));
      ASSERT_TRUE(cuda::LaunchLayerNormForward(cs, xd.as<float>(), wd.as<float>(), bd.as<float>(),
                                               rows, C, yd.as<float>(), md.as<float>(),
                                               sd.as<float>())
                      .ok());
      ASSERT_TRUE(cuda::LaunchLayerNormParamGrads(cs, xd.as<float>(), g.as<float>(), md.as<float>(),
                                                  sd.as<float>(), rows, C, dwd.as<float>(),
                                                  dbd.as<float>(), true)
                      .ok());
      // In place over the residual: dx = residual + LayerNorm input gradient.
      ASSERT_TRUE(cuda::LaunchLayerNormInputGrad(cs, xd.as<float>(), wd.as<float>(), g.as<float>(),
                                                 md.as<float>(), sd.as<float>(), rd.as<float>(),
                                                 rows, C, rd.as<float>())
                      .ok());
      Sync();
      ExpectClose(Get(yd, rows * C), y, 2.0 * C, "y");
      ExpectClose(Get(md, rows), mean, C, "mean");
      ExpectClose(Get(sd, rows), rstd, 2.0 * C, "rstd");
      ExpectClose(Get(dwd, C), dw, 2.0 * C + rows, "dw");
      ExpectClose(Get(dbd, C), db, rows, "db");
      ExpectClose(Get(rd, rows * C), dx, 4.0 * C, "dx");
      // The recomputation from saved statistics gives the forward's y bit for bit.
      const gpu::DeviceSpan y2 = Poisoned(rows * C);
      ASSERT_TRUE(cuda::LaunchLayerNormApply(cs, xd.as<float>(), wd.as<float>(), bd.as<float>(),
                                             md.as<float>(), sd.as<float>(), rows, C,
                                             y2.as<float>())
                      .ok());
      Sync();
      EXPECT_EQ(Get(y2, rows * C), Get(yd, rows * C));
    }
  }
}

// CUDA's tanhf is within 2 ulps of the correctly rounded result (CUDA C++ Programming
// Guide, "Mathematical Functions": single-precision maximum ulp errors).
constexpr double kTanhfUlps = 2;

TEST_F(GptCudaTest, GeluBiasAndColumnSumsMatchADoubleReference) {
  const cudaStream_t cs = gpu::NativeStream(*stream_);
  const int64_t rows = 35, cols = 144, n = rows * cols;
  const std::vector<double> x = RandomVector(n, 4.0, 71), dy = RandomVector(n, 1.0, 72);
  const std::vector<double> bias = RandomVector(cols, 1.0, 73), out0 = RandomVector(cols, 1.0, 74);
  std::vector<double> y(n), dx(n), sums = out0;
  // tanhf's own error (up to kTanhfUlps ulps of th, ulp(th) <= eps |th|) reaches the outputs
  // amplified by d(out)/d(th): 0.5 |x| for y and |dy (0.5 - x th du)| for dx. The latter is
  // ~10 at |x| = 4, where 1 - th^2 cancels, so a tolerance of a few eps of the output
  // (enough for the products and sums) would reject a correct kernel there.
  std::vector<double> y_allow(n), dx_allow(n);
  const double k = 0.7978845608028654, a = 0.044715;
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i], th = std::tanh(k * (v + a * v * v * v)), du = k * (1 + 3 * a * v * v);
    y[i] = 0.5 * v * (1 + th);
    dx[i] = dy[i] * (0.5 * (1 + th) + 0.5 * v * (1 - th * th) * du);
    sums[i % cols] += x[i];
    const double th_err = kTanhfUlps * FLT_EPSILON * std::abs(th);
    y_allow[i] = th_err * 0.5 * std::abs(v);
    dx_allow[i] = th_err * std::abs(dy[i] * (0.5 - v * th * du));
  }
  const gpu::DeviceSpan xd = Put(ToFloat(x)), yd = Poisoned(n), g = Put(ToFloat(dy));
  const gpu::DeviceSpan bd = Put(ToFloat(bias)), sd = Put(ToFloat(out0)), xb = Put(ToFloat(x));
  ASSERT_TRUE(cuda::LaunchGeluForward(cs, xd.as<float>(), n, yd.as<float>()).ok());
  ASSERT_TRUE(cuda::LaunchGeluBackward(cs, xd.as<float>(), g.as<float>(), n, g.as<float>()).ok());
  ASSERT_TRUE(cuda::LaunchColumnSums(cs, xd.as<float>(), rows, cols, sd.as<float>(), true).ok());
  ASSERT_TRUE(
      cuda::LaunchRowsPlusBias(cs, xb.as<float>(), bd.as<float>(), rows, cols, xb.as<float>())
          .ok());
  Sync();
  EXPECT_EQ(CountOutside(Get(yd, n), y, 8, "gelu", true, &y_allow), 0);
  EXPECT_EQ(CountOutside(Get(g, n), dx, 8, "gelu backward", true, &dx_allow), 0);
  ExpectClose(Get(sd, cols), sums, rows + 1, "column sums");
  const std::vector<float> xf = ToFloat(x), bf = ToFloat(bias);
  std::vector<float> plus(n);
  for (int64_t i = 0; i < n; ++i) plus[i] = xf[i] + bf[i % cols];
  EXPECT_EQ(Get(xb, n), plus);  // one fp32 addition: exact
}

TEST_F(GptCudaTest, CausalSoftmaxForwardAndBackwardMatchADoubleReference) {
  const cudaStream_t cs = gpu::NativeStream(*stream_);
  for (const int T : {1, 7, 67}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    const int64_t mats = 6, n = mats * T * T;
    const std::vector<double> sc = RandomVector(n, 3.0, 81), dp = RandomVector(n, 1.0, 82);
    std::vector<double> p(n, 0.0), ds(n, 0.0);
    for (int64_t r = 0; r < mats * T; ++r) {
      const int64_t t = r % T;
      const double* row = sc.data() + r * T;
      double mx = row[0], sum = 0, dot = 0;
      for (int64_t s = 0; s <= t; ++s) mx = std::max(mx, row[s]);
      for (int64_t s = 0; s <= t; ++s) sum += std::exp(row[s] - mx);
      for (int64_t s = 0; s <= t; ++s) p[r * T + s] = std::exp(row[s] - mx) / sum;
      for (int64_t s = 0; s <= t; ++s) dot += p[r * T + s] * dp[r * T + s];
      for (int64_t s = 0; s <= t; ++s) ds[r * T + s] = p[r * T + s] * (dp[r * T + s] - dot);
    }
    const gpu::DeviceSpan pd = Put(ToFloat(sc)), dpd = Put(ToFloat(dp));
    ASSERT_TRUE(cuda::LaunchCausalSoftmaxForward(cs, pd.as<float>(), mats, T).ok());
    Sync();
    const std::vector<float> probs = Get(pd, n);
    ExpectClose(probs, p, 2.0 * T + 8, "probs");
    ASSERT_TRUE(
        cuda::LaunchCausalSoftmaxBackward(cs, pd.as<float>(), dpd.as<float>(), mats, T).ok());
    Sync();
    // Against the reference backward applied to the GPU's own probabilities, so the
    // forward's rounding does not count twice.
    std::vector<double> ds_own(n, 0.0);
    for (int64_t r = 0; r < mats * T; ++r) {
      const int64_t t = r % T;
      double dot = 0;
      for (int64_t s = 0; s <= t; ++s) dot += double(probs[r * T + s]) * dp[r * T + s];
      for (int64_t s = 0; s <= t; ++s) ds_own[r * T + s] = probs[r * T + s] * (dp[r * T + s] - dot);
    }
    ExpectClose(Get(pd, n), ds_own, 2.0 * T + 4, "score gradients");
    ExpectClose(Get(pd, n), ds, 4.0 * T + 12, "score gradients (double forward)");
  }
}

TEST_F(GptCudaTest, CrossEntropyAndMeanLossMatchADoubleReference) {
  const cudaStream_t cs = gpu::NativeStream(*stream_);
  const int64_t N = 35;
  const int V = 256;
  const float scale = 1.75f / N;
  const std::vector<double> logits = RandomVector(N * V, 6.0, 91);
  const std::vector<int32_t> targets = RandomTokens(static_cast<int>(N), V, 92);
  std::vector<double> losses(N), grad(N * V);
  double mean = 0;
  for (int64_t r = 0; r < N; ++r) {
    const double* row = logits.data() + r * V;
    double mx = row[0], sum = 0;
    for (int v = 0; v < V; ++v) mx = std::max(mx, row[v]);
    for (int v = 0; v < V; ++v) sum += std::exp(row[v] - mx);
    losses[r] = std::log(sum) + mx - row[targets[r]];
    mean += losses[r] / N;
    for (int v = 0; v < V; ++v) grad[r * V + v] = scale * std::exp(row[v] - mx) / sum;
    grad[r * V + targets[r]] -= scale;
  }
  const gpu::DeviceSpan ld = Put(ToFloat(logits)), td = Put(targets);
  const gpu::DeviceSpan lossd = Poisoned(N), meand = Poisoned(1);
  ASSERT_TRUE(
      cuda::LaunchCrossEntropyForward(cs, ld.as<float>(), td.as<int32_t>(), N, V, lossd.as<float>())
          .ok());
  ASSERT_TRUE(cuda::LaunchMeanLoss(cs, lossd.as<float>(), N, meand.as<float>()).ok());
  ASSERT_TRUE(
      cuda::LaunchCrossEntropyBackward(cs, ld.as<float>(), td.as<int32_t>(), N, V, scale).ok());
  Sync();
  ExpectClose(Get(lossd, N), losses, V + 8, "losses");
  ExpectClose(Get(meand, 1), {mean}, V + 8 + N, "mean loss");
  ExpectClose(Get(ld, N * V), grad, V + 8, "logit gradients");
}

TEST_F(GptCudaTest, EmbeddingForwardAndBackwardAreBitIdenticalToTheHost) {
  const GptShape s = OddShape(1, 128);
  for (const Batch& b : kBatches) {
    SCOPED_TRACE("B=" + std::to_string(b.B) + " T=" + std::to_string(b.T));
    const int64_t N = int64_t{b.B} * b.T, C = s.channels;
    const std::vector<float> params = CastModel<float>(RandomModel(s, 3)).blocks[0];
    const std::vector<int32_t> tokens = RandomTokens(static_cast<int>(N), s.vocab_size, 4);
    const std::vector<float> dx = ToFloat(RandomVector(N * C, 1.0, 5));
    std::vector<float> x_ref(N * C), g_ref(params.size());
    EmbeddingForward<float>(s, params.data(), tokens.data(), b.B, b.T, x_ref.data());
    EmbeddingBackward<float>(s, tokens.data(), dx.data(), b.B, b.T, g_ref.data());

    const gpu::DeviceSpan p = Put(params), t = Put(tokens), d = Put(dx);
    const gpu::DeviceSpan x = Poisoned(N * C), g = Poisoned(params.size());
    ASSERT_TRUE(cuda::CudaEmbeddingForward(s, *stream_, p.as<float>(), t.as<int32_t>(), b.B, b.T,
                                           x.as<float>())
                    .ok());
    ASSERT_TRUE(cuda::CudaEmbeddingBackward(s, *stream_, t.as<int32_t>(), d.as<float>(), b.B, b.T,
                                            g.as<float>())
                    .ok());
    Sync();
    EXPECT_EQ(Get(x, N * C), x_ref);
    EXPECT_EQ(Get(g, params.size()), g_ref);
  }
}

TEST_F(GptCudaTest, LayerForwardAndBackwardMatchTheHostInDouble) {
  const GptShape s = OddShape(1, 128);
  const Model<double> md = RandomModel(s, 21);
  for (const Batch& b : kBatches) CheckLayer(s, md.blocks[1], b.B, b.T);
}

// GPT-2 small's width and head size (C = 768, 12 heads of 64) at T = 256: cuBLAS at
// realistic shapes, LayerNorm rows of 24 elements per lane, softmax rows of up to 8 per
// lane, and two groups (G = 1 at T = 256), so the parameter gradients also take the
// accumulate path.
TEST_F(GptCudaTest, LayerAtGpt2SmallWidthMatchesTheHostInDouble) {
  const GptShape s{256, 256, 1, 12, 768};
  CheckLayer(s, RandomModel(s, 24).blocks[1], 2, 256);
}

// GptCudaOptions::allow_tf32 really puts the products on TF32 tensor cores: the layer's
// output and input gradient move off the exact-fp32 result in most elements, and stay within
// a TF32 bound of the double reference: |got - ref| <= 32 * 2^-11 * (|ref| + rms(ref)) (inputs
// rounded to 10 mantissa bits, fp32 accumulation; an indexing bug is off by O(rms)).
TEST_F(GptCudaTest, Tf32LayerDiffersFromFp32AndStaysWithinTheTf32Bound) {
  const GptShape s{256, 256, 1, 12, 768};
  const std::vector<double> pd = RandomModel(s, 24).blocks[1];
  const int B = 2, T = 256;
  const int64_t N = int64_t{B} * T, C = s.channels;
  const LayerReference ref = ComputeLayerReference(s, pd, B, T);
  const std::vector<double>&x = ref.x, &dy = ref.dy, &y_ref = ref.y, &dx_ref = ref.dx;
  const gpu::DeviceSpan p = Put(ToFloat(pd)), xi = Put(ToFloat(x)), d = Put(ToFloat(dy));
  const gpu::DeviceSpan sc = GuardedScratch(cuda::CudaLayerScratchElems(s, B, T));
  std::vector<float> y[2], dx[2];
  for (int tf32 = 0; tf32 < 2; ++tf32) {
    const cuda::GptCudaOptions o{.allow_tf32 = tf32 == 1};
    const gpu::DeviceSpan yo = Poisoned(N * C), dxo = Poisoned(N * C), g = Poisoned(pd.size());
    Status st = cuda::CudaLayerForward(s, *stream_, p.as<float>(), xi.as<float>(), yo.as<float>(),
                                       B, T, sc.as<float>(), o);
    ASSERT_TRUE(st.ok()) << st.ToString();
    st = cuda::CudaLayerBackward(s, *stream_, p.as<float>(), xi.as<float>(), d.as<float>(),
                                 dxo.as<float>(), g.as<float>(), B, T, sc.as<float>(), o);
    ASSERT_TRUE(st.ok()) << st.ToString();
    Sync();
    y[tf32] = Get(yo, N * C);
    dx[tf32] = Get(dxo, N * C);
  }
  const auto check = [](const std::vector<float>& fp32, const std::vector<float>& tf32,
                        const std::vector<double>& ref, const char* what) {
    double ss = 0;
    for (double r : ref) ss += r * r;
    const double rms = std::sqrt(ss / static_cast<double>(ref.size()));
    size_t differ = 0, outside = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      differ += fp32[i] != tf32[i];
      outside += std::abs(double{tf32[i]} - ref[i]) > 32 * 0x1p-11 * (std::abs(ref[i]) + rms);
    }
    EXPECT_GT(differ, ref.size() / 2) << what << ": TF32 left most results as exact fp32";
    EXPECT_EQ(outside, 0u) << what << ": outside the TF32 bound";
  };
  check(y[0], y[1], y_ref, "x_out");
  check(dx[0], dx[1], dx_ref, "dx_in");
}

TEST_F(GptCudaTest, HeadForwardAndBackwardMatchTheHostInDouble) {
  const GptShape s = OddShape(1, 128);
  const Model<double> md = RandomModel(s, 31);
  const std::vector<double>& pd = md.blocks.back();
  const double dloss = 1.75;
  for (const Batch& b : kBatches) {
    SCOPED_TRACE("B=" + std::to_string(b.B) + " T=" + std::to_string(b.T));
    const int64_t N = int64_t{b.B} * b.T, C = s.channels, V = s.vocab_size;
    const std::vector<double> x = RandomVector(N * C, 1.0, 32);
    const std::vector<int32_t> targets = RandomTokens(static_cast<int>(N), s.vocab_size, 33);
    std::vector<double> logits_ref(N * V), dlogits_ref(N * V), dx_ref(N * C), g_ref(pd.size());
    std::vector<double> scratch(HeadScratchElems(s, b.B, b.T));
    const double loss_ref = HeadForward<double>(s, pd.data(), x.data(), targets.data(), b.B, b.T,
                                                logits_ref.data(), scratch.data());
    HeadBackward<double>(s, pd.data(), x.data(), targets.data(), dloss, b.B, b.T, dx_ref.data(),
                         g_ref.data(), dlogits_ref.data(), scratch.data());

    const gpu::DeviceSpan p = Put(ToFloat(pd)), xi = Put(ToFloat(x)), t = Put(targets);
    const gpu::DeviceSpan logits = Poisoned(N * V), loss = Poisoned(1);
    const gpu::DeviceSpan dx = Poisoned(N * C), g = Poisoned(pd.size());
    const size_t scratch_elems = cuda::CudaHeadScratchElems(s, b.B, b.T);
    const gpu::DeviceSpan sc = GuardedScratch(scratch_elems);
    Status st =
        cuda::CudaHeadForward(s, *stream_, p.as<float>(), xi.as<float>(), t.as<int32_t>(), b.B, b.T,
                              logits.as<float>(), sc.as<float>(), loss.as<float>());
    ASSERT_TRUE(st.ok()) << st.ToString();
    Sync();
    const double L = 2.0 * C + V + double(N);
    ExpectClose(Get(logits, N * V), logits_ref, L, "logits");
    ExpectClose(Get(loss, 1), {loss_ref}, L, "loss");

    st = cuda::CudaHeadBackward(s, *stream_, p.as<float>(), xi.as<float>(), t.as<int32_t>(),
                                static_cast<float>(dloss), b.B, b.T, dx.as<float>(), g.as<float>(),
                                logits.as<float>(), sc.as<float>());
    ASSERT_TRUE(st.ok()) << st.ToString();
    Sync();
    ExpectGuardIntact(sc, scratch_elems, "the head");
    ExpectClose(Get(logits, N * V), dlogits_ref, L, "dlogits");
    ExpectClose(Get(dx, N * C), dx_ref, 2 * L, "dx_in");
    const std::vector<float> grads = Get(g, pd.size());
    for (const TensorInfo& ti : HeadTensors(s)) {
      const std::vector<float> got(grads.begin() + ti.offset,
                                   grads.begin() + ti.offset + ti.num_elems);
      const std::vector<double> ref(g_ref.begin() + ti.offset,
                                    g_ref.begin() + ti.offset + ti.num_elems);
      ExpectClose(got, ref, 2 * L, "d" + ti.name);
    }
  }
}

TEST_F(GptCudaTest, LayerBackwardIsBitIdenticalFromRunToRun) {
  const GptShape s = OddShape(1, 128);
  const int B = 40, T = 7;
  const int64_t N = int64_t{B} * T, C = s.channels;
  const std::vector<float> pf = CastModel<float>(RandomModel(s, 41)).blocks[1];
  const gpu::DeviceSpan p = Put(pf), x = Put(ToFloat(RandomVector(N * C, 1.0, 42)));
  const gpu::DeviceSpan d = Put(ToFloat(RandomVector(N * C, 1.0, 43)));
  const gpu::DeviceSpan sc = Poisoned(cuda::CudaLayerScratchElems(s, B, T));
  std::vector<float> first_dx, first_g;
  for (int run = 0; run < 2; ++run) {
    const gpu::DeviceSpan dx = Poisoned(N * C), g = Poisoned(pf.size());
    ASSERT_TRUE(cuda::CudaLayerBackward(s, *stream_, p.as<float>(), x.as<float>(), d.as<float>(),
                                        dx.as<float>(), g.as<float>(), B, T, sc.as<float>())
                    .ok());
    Sync();
    if (run == 0) {
      first_dx = Get(dx, N * C);
      first_g = Get(g, pf.size());
    } else {
      EXPECT_EQ(Get(dx, N * C), first_dx);
      EXPECT_EQ(Get(g, pf.size()), first_g);
    }
  }
}

// Ends a death-test child after a block call that returned `launched`: synchronizes the
// stream when the call succeeded, prints the outcome and exits with 0 when a kernel fault
// was reported (by the synchronization, or already by a later launch check inside the
// call: cudaGetLastError also returns errors of earlier asynchronous kernels), 1 when
// nothing was reported (the bad index was read silently), 2 when the call was refused by
// an argument check before launching.
[[noreturn]] void ExitWithStreamOutcome(const Status& launched, gpu::Stream& stream) {
  const Status st = launched.ok() ? stream.Synchronize() : launched;
  std::fprintf(stderr, "stream: %s\n", st.ToString().c_str());
  if (st.code() == StatusCode::kInvalidArgument) std::_Exit(2);
  std::_Exit(st.ok() ? 1 : 0);
}

// A token or target outside [0, V) stops the kernel that reads it with a device trap
// (gpt_cuda.h): the stream reports a fault instead of the kernel reading the neighbouring
// rows (wpe right after wte for token V, memory before the chunk for -1). The fault leaves
// the process's CUDA context unusable, so each case runs in its own child process (a
// death test, re-executed: "threadsafe" style).
TEST_F(GptCudaTest, TokenOrTargetOutsideTheVocabularyTrapsOnTheDevice) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const GptShape s = OddShape(1, 16);
  const int B = 2, T = 7;
  const int64_t N = int64_t{B} * T, C = s.channels, V = s.vocab_size;
  const Model<float> m = CastModel<float>(RandomModel(s, 7));
  for (const int32_t bad : {s.vocab_size, -1}) {
    SCOPED_TRACE("bad index " + std::to_string(bad));
    std::vector<int32_t> ids = RandomTokens(static_cast<int>(N), s.vocab_size, 8);
    ids[N - 3] = bad;
    // Each runs in the child: uploads, launches, synchronizes, exits (no return).
    auto embedding_forward = [&] {
      const gpu::DeviceSpan p = Put(m.blocks[0]), t = Put(ids), x = Poisoned(N * C);
      ExitWithStreamOutcome(cuda::CudaEmbeddingForward(s, *stream_, p.as<float>(), t.as<int32_t>(),
                                                       B, T, x.as<float>()),
                            *stream_);
    };
    auto embedding_backward = [&] {
      const gpu::DeviceSpan t = Put(ids), d = Put(ToFloat(RandomVector(N * C, 1.0, 9)));
      const gpu::DeviceSpan g = Poisoned(m.blocks[0].size());
      ExitWithStreamOutcome(cuda::CudaEmbeddingBackward(s, *stream_, t.as<int32_t>(), d.as<float>(),
                                                        B, T, g.as<float>()),
                            *stream_);
    };
    auto cross_entropy_forward = [&] {
      const gpu::DeviceSpan p = Put(m.blocks.back()), t = Put(ids);
      const gpu::DeviceSpan x = Put(ToFloat(RandomVector(N * C, 1.0, 10)));
      const gpu::DeviceSpan logits = Poisoned(N * V), loss = Poisoned(1);
      const gpu::DeviceSpan sc = Poisoned(cuda::CudaHeadScratchElems(s, B, T));
      ExitWithStreamOutcome(
          cuda::CudaHeadForward(s, *stream_, p.as<float>(), x.as<float>(), t.as<int32_t>(), B, T,
                                logits.as<float>(), sc.as<float>(), loss.as<float>()),
          *stream_);
    };
    auto cross_entropy_backward = [&] {
      const gpu::DeviceSpan p = Put(m.blocks.back()), t = Put(ids);
      const gpu::DeviceSpan x = Put(ToFloat(RandomVector(N * C, 1.0, 11)));
      const gpu::DeviceSpan logits = Poisoned(N * V), dx = Poisoned(N * C);
      const gpu::DeviceSpan g = Poisoned(m.blocks.back().size());
      const gpu::DeviceSpan sc = Poisoned(cuda::CudaHeadScratchElems(s, B, T));
      ExitWithStreamOutcome(
          cuda::CudaHeadBackward(s, *stream_, p.as<float>(), x.as<float>(), t.as<int32_t>(), 1.0f,
                                 B, T, dx.as<float>(), g.as<float>(), logits.as<float>(),
                                 sc.as<float>()),
          *stream_);
    };
    EXPECT_EXIT(embedding_forward(), ::testing::ExitedWithCode(0), "stream: ")
        << "embedding forward";
    EXPECT_EXIT(embedding_backward(), ::testing::ExitedWithCode(0), "stream: ")
        << "embedding backward";
    EXPECT_EXIT(cross_entropy_forward(), ::testing::ExitedWithCode(0), "stream: ")
        << "cross-entropy forward";
    EXPECT_EXIT(cross_entropy_backward(), ::testing::ExitedWithCode(0), "stream: ")
        << "cross-entropy backward";
  }
}

// The whole model through GptModel::Forward/Backward on the CUDA stream, with buffers as
// the engine lays them out, against the host kernels in double (test_model::Runner).
class GptCudaModelTest : public GptCudaTest {
 protected:
  void Check(const GptShape& s, int B, int T) {
    SCOPED_TRACE("layers=" + std::to_string(s.num_layers) + " C=" + std::to_string(s.channels) +
                 " B=" + std::to_string(B) + " T=" + std::to_string(T));
    const int64_t N = int64_t{B} * T, C = s.channels, V = s.vocab_size;
    const Model<double> md = RandomModel(s, 51);
    const std::vector<int32_t> tokens = RandomTokens(static_cast<int>(N), s.vocab_size, 52);
    const std::vector<int32_t> targets = RandomTokens(static_cast<int>(N), s.vocab_size, 53);
    test_model::Runner<double> runner(s, B, T);
    std::vector<std::vector<double>> g_ref;
    std::vector<double> dx0_ref;
    const double loss_ref = runner.Backward(md, tokens, targets, &g_ref, &dx0_ref);

    auto model_or = GptModel::Create(s);
    ASSERT_TRUE(model_or.ok());
    GptModel& model = **model_or;
    const engine::MicroBatchShape mb{B, T};
    const int nb = model.num_blocks();
    int64_t scratch_bytes = 0;
    for (int k = 0; k < nb; ++k)
      scratch_bytes = std::max(scratch_bytes, model.scratch_bytes(k, mb));
    std::vector<gpu::DeviceSpan> params, grads, xs, dxs;
    for (int k = 0; k < nb; ++k) {
      params.push_back(Put(ToFloat(md.blocks[k])));
      grads.push_back(Poisoned(md.blocks[k].size()));
    }
    for (int k = 0; k <= s.num_layers; ++k) {
      xs.push_back(Poisoned(N * C));
      dxs.push_back(Poisoned(N * C));
    }
    const gpu::DeviceSpan tok = Put(tokens), tgt = Put(targets), logits = Poisoned(N * V);
    const gpu::DeviceSpan loss = Poisoned(1), scratch = Poisoned(scratch_bytes / 4);
    auto buffers = [&](int k) {
      engine::BlockBuffers bb;
      bb.params = params[k].as<float>();
      bb.grads = grads[k].as<float>();
      bb.shape = mb;
      bb.scratch = scratch.as<float>();
      if (k == 0) {
        bb.tokens = tok.as<int32_t>();
        bb.x_out = xs[0].as<float>();
        bb.dx_out = dxs[0].as<float>();
      } else {
        bb.x_in = xs[k - 1].as<float>();
        bb.dx_in = dxs[k - 1].as<float>();
        if (k == nb - 1) {
          bb.targets = tgt.as<int32_t>();
          bb.logits = logits.as<float>();
          bb.loss = loss.as<float>();
          bb.dloss = 1.0f;
        } else {
          bb.x_out = xs[k].as<float>();
          bb.dx_out = dxs[k].as<float>();
        }
      }
      return bb;
    };
    for (int k = 0; k < nb; ++k) {
      const Status st = model.Forward(k, buffers(k), *stream_);
      ASSERT_TRUE(st.ok()) << model.block_name(k) << ": " << st.ToString();
    }
    for (int k = nb - 1; k >= 0; --k) {
      const Status st = model.Backward(k, buffers(k), *stream_);
      ASSERT_TRUE(st.ok()) << model.block_name(k) << ": " << st.ToString();
    }
    Sync();
    const double L = ModelChain(s, B, T);
    ExpectClose(Get(loss, 1), {loss_ref}, L, "loss");
    ExpectClose(Get(dxs[0], N * C), dx0_ref, L, "d(embedding output)");
    for (int k = 0; k < nb; ++k) {
      const std::vector<float> got = Get(grads[k], md.blocks[k].size());
      for (const TensorInfo& ti : test_model::BlockTensors(s, k)) {
        const std::vector<float> g(got.begin() + ti.offset, got.begin() + ti.offset + ti.num_elems);
        const std::vector<double> r(g_ref[k].begin() + ti.offset,
                                    g_ref[k].begin() + ti.offset + ti.num_elems);
        ExpectClose(g, r, L, model.block_name(k) + ".d" + ti.name);
      }
    }
  }
};

TEST_F(GptCudaModelTest, TinyPresetLossAndEveryBlockGradientMatchTheHost) {
  auto s = GptPreset("tiny");
  ASSERT_TRUE(s.ok());
  Check(*s, 3, 16);
  Check(*s, 5, 7);
}

TEST_F(GptCudaModelTest, ThreeLayerOddShapeLossAndEveryBlockGradientMatchTheHost) {
  Check(OddShape(3, 72), 5, 7);
  Check(OddShape(3, 72), 3, 1);
  Check(OddShape(3, 72), 2, 67);
}

}  // namespace
}  // namespace strata::models
