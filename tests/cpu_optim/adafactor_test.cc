// Adafactor: the public entry point against a float64 step written here from the
// formulas of adafactor.h (Shazeer & Stern 2018, as Hugging Face transformers'
// Adafactor), element by element with a stated relative tolerance; against the
// scalar reference bit for bit on every ISA variant and thread count; argument
// errors; and convergence on a least-squares problem.
#include "cpu_optim/adafactor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "cpu_optim/kernels.h"
#include "tests/cpu_optim/test_data.h"

namespace strata::cpu_optim {
namespace {

using testing::Bits;
using testing::GradData;
using testing::Mismatches;
using testing::Mix;
using testing::OutData;
using testing::SameFloat;
using Shape = std::vector<int64_t>;

// Relative tolerance of the float64 comparison: 64 fp32 ulps of the magnitudes
// involved. One step rounds about 25 times along the longest chain (u, the mean, the
// moving average, mean(R), the ratio, sqrt, the reciprocal, two products, the step
// size from RMS(update), the first moment, the decay, the subtraction), each at most
// half an ulp; the float64 reference itself is exact to 2^-50.
constexpr double kRelTol = 0x1p-18;

int64_t NumElems(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Master weights, state, gradient and copy-out of one tensor.
struct Tensor {
  Shape shape;
  int64_t n = 0, rows = 1, cols = 1;
  bool factored = false;
  std::vector<float> p, row, col, v, m;
  GradData g{DType::kF32, 0};
  OutData out;

  AdafactorState state() {
    return {.exp_avg_sq_row = row, .exp_avg_sq_col = col, .exp_avg_sq = v, .exp_avg = m};
  }
};

// Values with a wide but safe spread: weights N(0, 1) * 2^[-3, 3]; gradients
// N(0, 1) * 2^[-8, 6] times a per-row scale 2^[-6, 4] (so row factors differ; fp16
// denormals included, fp16 overflow not), some exact zeros. Rounded to the gradient dtype (the
// tests use the rounded values).
Tensor MakeTensor(const AdafactorConfig& c, const Shape& shape, DType grad_dtype, int out_kind,
                  std::mt19937& rng) {
  Tensor t;
  t.shape = shape;
  t.n = NumElems(shape);
  t.factored = AdafactorFactored(shape);
  if (t.factored) {
    t.cols = shape.back();
    t.rows = t.n / t.cols;
    t.row.assign(t.rows, 0.0f);
    t.col.assign(t.cols, 0.0f);
  } else {
    t.cols = t.n;
    t.v.assign(t.n, 0.0f);
  }
  if (c.beta1 > 0.0f) t.m.assign(t.n, 0.0f);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> exp_dist(-3, 3);
  t.p.resize(t.n);
  for (float& x : t.p) x = std::ldexp(normal(rng), exp_dist(rng));
  t.g = GradData(grad_dtype, t.n);
  const DType out_dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  if (out_kind < 3) t.out = OutData(out_dtypes[out_kind], t.n);
  return t;
}

void NewGradient(Tensor& t, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> elem_exp(-8, 6), row_exp(-6, 4);
  for (int64_t i = 0; i < t.rows; ++i) {
    const int re = row_exp(rng);
    for (int64_t j = 0; j < t.cols; ++j) {
      const float x = rng() % 16 == 0 ? 0.0f : std::ldexp(normal(rng), elem_exp(rng) + re);
      t.g.Set(i * t.cols + j, x);
    }
  }
}

// ---- The float64 step, written from the formulas of adafactor.h ----

struct Float64Step {
  std::vector<double> p, row, col, v, m;
  std::vector<double> p_scale, m_scale;  // magnitudes of the terms that formed p and m
};

Float64Step StepFloat64(const AdafactorConfig& c, const OptimStep& st, const Tensor& t) {
  const int64_t n = t.n, rows = t.rows, cols = t.cols;
  const double step = static_cast<double>(st.step);
  double lr = c.lr;
  if (c.relative_step) {
    lr = std::min(c.warmup_init ? 1e-6 * step : 1e-2, 1.0 / std::sqrt(step));
  }
  if (c.scale_parameter) {
    double ss = 0.0;
    for (float x : t.p) ss += static_cast<double>(x) * x;
    lr *= std::max(static_cast<double>(c.eps2), std::sqrt(ss / static_cast<double>(n)));
  }
  const double beta2t = 1.0 - std::pow(step, static_cast<double>(c.decay_rate));
  const double sign = c.maximize ? -1.0 : 1.0;
  std::vector<double> g(n), u(n), update(n);
  for (int64_t i = 0; i < n; ++i) {
    g[i] = sign * static_cast<double>(t.g.value(i)) * st.grad_scale;
    u[i] = g[i] * g[i] + c.eps1;
  }
  Float64Step r;
  if (t.factored) {
    r.row.resize(rows);
    r.col.resize(cols);
    for (int64_t i = 0; i < rows; ++i) {
      double sum = 0.0;
      for (int64_t j = 0; j < cols; ++j) sum += u[i * cols + j];
      r.row[i] = beta2t * t.row[i] + (1.0 - beta2t) * (sum / static_cast<double>(cols));
    }
    for (int64_t j = 0; j < cols; ++j) {
      double sum = 0.0;
      for (int64_t i = 0; i < rows; ++i) sum += u[i * cols + j];
      r.col[j] = beta2t * t.col[j] + (1.0 - beta2t) * (sum / static_cast<double>(rows));
    }
    double mean_r = 0.0;
    for (double x : r.row) mean_r += x;
    mean_r /= static_cast<double>(rows);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        update[i * cols + j] = g[i * cols + j] / std::sqrt(r.row[i] / mean_r) / std::sqrt(r.col[j]);
      }
    }
  } else {
    r.v.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      r.v[i] = beta2t * t.v[i] + (1.0 - beta2t) * u[i];
      update[i] = g[i] / std::sqrt(r.v[i]);
    }
  }
  double ss = 0.0;
  for (double x : update) ss += x * x;
  const double rms = std::sqrt(ss / static_cast<double>(n));
  const double scale = lr / std::max(1.0, rms / c.clip_threshold);
  r.p.resize(n);
  r.p_scale.resize(n);
  if (c.beta1 > 0.0f) {
    r.m.resize(n);
    r.m_scale.resize(n);
  }
  for (int64_t i = 0; i < n; ++i) {
    double upd = update[i] * scale;
    if (c.beta1 > 0.0f) {
      const double a = c.beta1 * static_cast<double>(t.m[i]), b = (1.0 - c.beta1) * upd;
      r.m[i] = a + b;
      r.m_scale[i] = std::abs(a) + std::abs(b);
      upd = r.m[i];
    }
    const double kept = static_cast<double>(t.p[i]) * (1.0 - c.weight_decay * lr);
    r.p[i] = kept - upd;
    r.p_scale[i] = std::abs(kept) + std::abs(upd);
  }
  return r;
}

bool Near(float x, double want, double scale) {
  return std::abs(static_cast<double>(x) - want) <= kRelTol * scale + 0x1p-140;
}

void ExpectNear(std::span<const float> got, const std::vector<double>& want,
                const std::vector<double>* scale, const std::string& what) {
  Mismatches bad(what);
  for (size_t i = 0; i < got.size(); ++i) {
    const double s = scale ? (*scale)[i] : std::abs(want[i]);
    if (!Near(got[i], want[i], s)) {
      bad.Add(fmt::format("[{}] {:.9g} vs {:.9g} (scale {:.3g})", i, got[i], want[i], s));
    }
  }
  EXPECT_EQ(bad.count(), 0) << bad.Report();
}

void ExpectSameBits(std::span<const float> a, std::span<const float> b, const std::string& what) {
  Mismatches bad(what);
  for (size_t i = 0; i < a.size(); ++i) {
    if (!SameFloat(a[i], b[i])) {
      bad.Add(fmt::format("[{}] {:a} vs {:a} ({:#010x} vs {:#010x})", i, a[i], b[i], Bits(a[i]),
                          Bits(b[i])));
    }
  }
  EXPECT_EQ(bad.count(), 0) << bad.Report();
}

// Master and state bit for bit (NaN payloads aside); the copy-out bytes too unless
// NaN payloads may differ (any_bits: then ExpectCopyOut checks each copy-out
// against its own master).
void ExpectSameTensor(Tensor& a, Tensor& b, const std::string& what, bool any_bits = false) {
  ExpectSameBits(a.p, b.p, what + " master");
  ExpectSameBits(a.row, b.row, what + " exp_avg_sq_row");
  ExpectSameBits(a.col, b.col, what + " exp_avg_sq_col");
  ExpectSameBits(a.v, b.v, what + " exp_avg_sq");
  ExpectSameBits(a.m, b.m, what + " exp_avg");
  if (!any_bits) {
    EXPECT_EQ(a.out.bytes(), b.out.bytes()) << what << " copy-out";
  }
}

// The copy-out holds base/dtype.h's rounding of the master weights.
void ExpectCopyOut(const Tensor& t) {
  if (!t.out.has()) return;
  Mismatches bad(fmt::format("copy-out {}", DTypeName(t.out.dtype())));
  for (int64_t i = 0; i < t.n; ++i) {
    const float p = t.p[i];
    if (t.out.dtype() == DType::kF32) {
      if (t.out.u32(i) != Bits(p)) bad.Add(fmt::format("[{}] {:a}", i, p));
    } else {
      const uint16_t want = t.out.dtype() == DType::kF16 ? FloatToHalf(p) : FloatToBf16(p);
      if (t.out.u16(i) != want)
        bad.Add(fmt::format("[{}] {:#06x} vs {:#06x}", i, t.out.u16(i), want));
    }
  }
  EXPECT_EQ(bad.count(), 0) << bad.Report();
}

struct NamedConfig {
  std::string name;
  AdafactorConfig config;
};

std::vector<NamedConfig> Configs() {
  std::vector<NamedConfig> v;
  v.push_back({"default", AdafactorConfig{}});
  v.push_back({"transformers_default",  // relative step, scaled by RMS(p)
               AdafactorConfig{.relative_step = true, .scale_parameter = true}});
  v.push_back({"warmup_beta1_decay", AdafactorConfig{.beta1 = 0.9f,
                                                     .weight_decay = 0.1f,
                                                     .relative_step = true,
                                                     .scale_parameter = true,
                                                     .warmup_init = true}});
  v.push_back({"beta1_clip_maximize", AdafactorConfig{.lr = 3e-2f,
                                                      .clip_threshold = 0.5f,
                                                      .decay_rate = -0.5f,
                                                      .beta1 = 0.9f,
                                                      .maximize = true}});
  v.push_back({"decay_no_clip_scale", AdafactorConfig{.lr = 1e-2f,
                                                      .eps2 = 5.0f,
                                                      .clip_threshold = 1e6f,
                                                      .weight_decay = 0.5f,
                                                      .scale_parameter = true}});
  return v;
}

// Several steps of AdafactorUpdate and AdafactorUpdateReference from the same state:
// each step against the float64 step from the pre-step fp32 values (tolerance
// kRelTol), and the two bit for bit (master, state, copy-out).
void CheckSteps(const NamedConfig& nc, const Shape& shape, DType gd, int out_kind,
                std::mt19937& rng) {
  SCOPED_TRACE(fmt::format("{} shape ({}) grad {} out {}", nc.name, fmt::join(shape, "x"),
                           DTypeName(gd), out_kind));
  const AdafactorConfig& c = nc.config;
  Tensor t = MakeTensor(c, shape, gd, out_kind, rng);
  Tensor ref = t;
  for (const int64_t step : {1, 2, 3, 10, 1000}) {
    SCOPED_TRACE(fmt::format("step {}", step));
    const OptimStep st{.step = step, .grad_scale = step == 2 ? 1.0f / 1024 : 0.75f};
    NewGradient(t, rng);
    ref.g = t.g;
    const Float64Step want = StepFloat64(c, st, t);
    ASSERT_TRUE(AdafactorUpdate(c, st, shape, t.p, t.state(), t.g.view(), t.out.copy_out()).ok());
    ASSERT_TRUE(
        AdafactorUpdateReference(c, st, shape, ref.p, ref.state(), ref.g.view(), ref.out.copy_out())
            .ok());
    ExpectNear(t.p, want.p, &want.p_scale, "master");
    ExpectNear(t.row, want.row, nullptr, "exp_avg_sq_row");
    ExpectNear(t.col, want.col, nullptr, "exp_avg_sq_col");
    ExpectNear(t.v, want.v, nullptr, "exp_avg_sq");
    ExpectNear(t.m, want.m, &want.m_scale, "exp_avg");
    ExpectSameTensor(t, ref, "vs scalar reference");
    ExpectCopyOut(t);
    if (::testing::Test::HasFailure()) return;
  }
}

const DType kGradDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

TEST(Adafactor, FactoredMatchesFloat64StepAndScalarReference) {
  std::mt19937 rng(21);
  for (const NamedConfig& nc : Configs()) {
    for (const Shape& shape :
         {Shape{3, 5}, Shape{1, 7}, Shape{7, 1}, Shape{67, 129}, Shape{2, 3, 5}}) {
      for (DType gd : kGradDTypes) {
        for (int out_kind = 0; out_kind < 4; ++out_kind) {
          CheckSteps(nc, shape, gd, out_kind, rng);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(Adafactor, VectorMatchesFloat64StepAndScalarReference) {
  std::mt19937 rng(22);
  for (const NamedConfig& nc : Configs()) {
    for (const Shape& shape : {Shape{}, Shape{1}, Shape{7}, Shape{4099}}) {
      for (DType gd : kGradDTypes) {
        for (int out_kind = 0; out_kind < 4; ++out_kind) {
          CheckSteps(nc, shape, gd, out_kind, rng);
          if (HasFailure()) return;
        }
      }
    }
  }
}

// Shapes of several tiles (factored) or several leaves (not factored): the fixed
// combination order of partial sums against float64.
TEST(Adafactor, ManyTilesMatchFloat64StepAndScalarReference) {
  std::mt19937 rng(23);
  const std::vector<NamedConfig> configs = Configs();
  for (const Shape& shape :
       {Shape{129, 2051}, Shape{3, 40000}, Shape{70001, 3}, Shape{4, 5, 6007}, Shape{300001}}) {
    for (const int k : {1, 2}) {
      CheckSteps(configs[k], shape, kGradDTypes[k], k, rng);
      if (HasFailure()) return;
    }
  }
}

// The shapes of the thread and variant tests: several row and column blocks.
std::vector<Shape> BigShapes() {
  return {Shape{300, 2500}, Shape{2, 100003}, Shape{70001, 3}, Shape{200003}};
}

// Any bit pattern (inf, NaN, huge, denormal gradients and weights): every ISA
// variant this CPU runs gives the scalar reference's bits.
TEST(Adafactor, EveryVariantMatchesScalarReferenceOnAnyBits) {
  std::mt19937 rng(24);
  const std::vector<NamedConfig> configs = Configs();
  std::vector<Shape> shapes = {Shape{3, 5},    Shape{1, 7}, Shape{33, 17},
                               Shape{2, 3, 5}, Shape{15},   Shape{67}};
  for (const Shape& s : BigShapes()) shapes.push_back(s);
  for (const internal::KernelTable* k : internal::SupportedKernelTables()) {
    for (const Shape& shape : shapes) {
      for (DType gd : kGradDTypes) {
        for (int out_kind = 0; out_kind < 4; ++out_kind) {
          // Big shapes: one copy-out kind per gradient dtype (time).
          if (NumElems(shape) > 100000 && out_kind != static_cast<int>(gd)) continue;
          const NamedConfig& nc = configs[(out_kind + static_cast<int>(gd)) % configs.size()];
          SCOPED_TRACE(fmt::format("{} {} shape ({}) grad {} out {}", k->name, nc.name,
                                   fmt::join(shape, "x"), DTypeName(gd), out_kind));
          const Mix mix = out_kind % 2 == 0 ? Mix::kAnyBits : Mix::kFinite;
          Tensor t = MakeTensor(nc.config, shape, gd, out_kind, rng);
          for (float& x : t.p) x = testing::RandomValue(rng, mix);
          Tensor ref = t;
          for (const int64_t step : {1, 7}) {
            t.g = GradData::Random(gd, t.n, rng, mix);
            ref.g = t.g;
            const OptimStep st{.step = step, .grad_scale = 0.5f};
            ASSERT_TRUE(internal::AdafactorUpdateWith(*k, nc.config, st, shape, t.p, t.state(),
                                                      t.g.view(), t.out.copy_out())
                            .ok());
            ASSERT_TRUE(AdafactorUpdateReference(nc.config, st, shape, ref.p, ref.state(),
                                                 ref.g.view(), ref.out.copy_out())
                            .ok());
          }
          ExpectSameTensor(t, ref, k->name, /*any_bits=*/true);
          ExpectCopyOut(ref);
          ExpectCopyOut(t);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(Adafactor, BitIdenticalAcrossThreadCounts) {
  std::mt19937 rng(25);
  tbb::global_control allow(tbb::global_control::max_allowed_parallelism, 4);
  const std::vector<NamedConfig> configs = Configs();
  for (const Shape& shape : BigShapes()) {
    for (const NamedConfig& nc : {configs[1], configs[2]}) {
      SCOPED_TRACE(fmt::format("{} shape ({})", nc.name, fmt::join(shape, "x")));
      Tensor init = MakeTensor(nc.config, shape, DType::kBF16, 2, rng);
      std::vector<GradData> grads;
      for (int s = 0; s < 3; ++s) {
        NewGradient(init, rng);
        grads.push_back(init.g);
      }
      auto run = [&](int threads) {
        Tensor t = init;
        tbb::task_arena(threads).execute([&] {
          for (int s = 0; s < 3; ++s) {
            t.g = grads[s];
            ASSERT_TRUE(AdafactorUpdate(nc.config, {.step = s + 1, .grad_scale = 0.5f}, shape, t.p,
                                        t.state(), t.g.view(), t.out.copy_out())
                            .ok());
          }
        });
        return t;
      };
      Tensor one = run(1);
      for (int threads : {2, 3}) {
        Tensor many = run(threads);
        ExpectSameTensor(many, one, fmt::format("{} threads", threads));
      }
      if (HasFailure()) return;
    }
  }
}

// maximize flips the gradient's sign: maximize on g gives the bits of the plain step
// on -g.
TEST(Adafactor, MaximizeEqualsStepOnNegatedGradient) {
  std::mt19937 rng(26);
  for (const Shape& shape : {Shape{33, 65}, Shape{4099}}) {
    AdafactorConfig plain{.beta1 = 0.9f, .weight_decay = 0.1f, .relative_step = true};
    AdafactorConfig maxi = plain;
    maxi.maximize = true;
    Tensor a = MakeTensor(plain, shape, DType::kF32, 3, rng);
    Tensor b = a;
    for (int64_t step = 1; step <= 3; ++step) {
      NewGradient(a, rng);
      for (int64_t i = 0; i < a.n; ++i) b.g.Set(i, -a.g.value(i));
      ASSERT_TRUE(AdafactorUpdate(maxi, {.step = step}, shape, a.p, a.state(), a.g.view()).ok());
      ASSERT_TRUE(AdafactorUpdate(plain, {.step = step}, shape, b.p, b.state(), b.g.view()).ok());
    }
    ExpectSameTensor(a, b, "maximize");
  }
}

TEST(Adafactor, StateSizesFollowTheShape) {
  const AdafactorConfig no_m{};
  const AdafactorConfig with_m{.beta1 = 0.9f};
  EXPECT_TRUE(AdafactorFactored(Shape{3, 5}));
  EXPECT_TRUE(AdafactorFactored(Shape{2, 3, 5}));
  EXPECT_FALSE(AdafactorFactored(Shape{7}));
  EXPECT_FALSE(AdafactorFactored(Shape{}));
  EXPECT_EQ(AdafactorStateElems(no_m, Shape{3, 5}), 8);
  EXPECT_EQ(AdafactorStateElems(no_m, Shape{2, 3, 5}), 11);
  EXPECT_EQ(AdafactorStateElems(with_m, Shape{2, 3, 5}), 41);
  EXPECT_EQ(AdafactorStateElems(no_m, Shape{7}), 7);
  EXPECT_EQ(AdafactorStateElems(with_m, Shape{7}), 14);
  EXPECT_EQ(AdafactorStateElems(no_m, Shape{}), 1);
  EXPECT_EQ(AdafactorStateElems(no_m, Shape{4096, 11008}), 4096 + 11008);
}

TEST(Adafactor, InvalidArgumentsAreRejectedAndNothingIsModified) {
  const Shape shape{4, 8};
  constexpr int64_t n = 32;
  std::vector<float> p(n, 1.0f), row(4, 0.5f), col(8, 0.5f), v(n, 0.5f), m(n, 0.5f), g(n, 1.0f);
  const GradView grad{g.data(), DType::kF32};
  const AdafactorState good{.exp_avg_sq_row = row, .exp_avg_sq_col = col};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    std::string name;
    AdafactorConfig config;
    OptimStep step;
    Shape shape;
    AdafactorState state;
    CopyOut out;
  };
  const std::vector<Case> cases = {
      {"lr < 0", {.lr = -1.0f}, {}, shape, good, {}},
      {"eps1 nan", {.eps1 = nan}, {}, shape, good, {}},
      {"eps2 < 0", {.eps2 = -1e-3f}, {}, shape, good, {}},
      {"clip_threshold 0", {.clip_threshold = 0.0f}, {}, shape, good, {}},
      {"decay_rate > 0", {.decay_rate = 0.8f}, {}, shape, good, {}},
      {"beta1 1", {.beta1 = 1.0f}, {}, shape, good, {}},
      {"weight_decay < 0", {.weight_decay = -0.1f}, {}, shape, good, {}},
      {"warmup_init without relative_step", {.warmup_init = true}, {}, shape, good, {}},
      {"step 0", {}, {.step = 0}, shape, good, {}},
      {"grad_scale inf",
       {},
       {.grad_scale = std::numeric_limits<float>::infinity()},
       shape,
       good,
       {}},
      {"shape product != size", {}, {}, Shape{4, 7}, good, {}},
      {"negative dimension", {}, {}, Shape{-4, -8}, good, {}},
      {"row state too short",
       {},
       {},
       shape,
       {.exp_avg_sq_row = std::span(row).first(3), .exp_avg_sq_col = col},
       {}},
      {"col state too long", {}, {}, Shape{8, 4}, good, {}},
      {"factored given exp_avg_sq",
       {},
       {},
       shape,
       {.exp_avg_sq_row = row, .exp_avg_sq_col = col, .exp_avg_sq = v},
       {}},
      {"vector without exp_avg_sq", {}, {}, Shape{32}, good, {}},
      {"beta1 without exp_avg", {.beta1 = 0.9f}, {}, shape, good, {}},
      {"exp_avg without beta1",
       {},
       {},
       shape,
       {.exp_avg_sq_row = row, .exp_avg_sq_col = col, .exp_avg = m},
       {}},
      {"row state aliases col state",
       {},
       {},
       Shape{4, 8, 1},
       {.exp_avg_sq_row = std::span(v), .exp_avg_sq_col = std::span(v).subspan(5, 1)},
       {}},
      {"exp_avg aliases master",
       {.beta1 = 0.5f},
       {},
       shape,
       {.exp_avg_sq_row = row, .exp_avg_sq_col = col, .exp_avg = p},
       {}},
      {"copy-out overlaps exp_avg_sq",
       {},
       {},
       Shape{32},
       {.exp_avg_sq = v},
       CopyOut{v.data() + 3, DType::kBF16}},
      {"bad copy-out dtype", {}, {}, shape, good, CopyOut{m.data(), DType{7}}},
  };
  for (const Case& c : cases) {
    const Status prod = AdafactorUpdate(c.config, c.step, c.shape, p, c.state, grad, c.out);
    const Status ref = AdafactorUpdateReference(c.config, c.step, c.shape, p, c.state, grad, c.out);
    EXPECT_EQ(prod.code(), StatusCode::kInvalidArgument) << c.name << ": " << prod.ToString();
    EXPECT_EQ(ref.code(), StatusCode::kInvalidArgument) << c.name << ": " << ref.ToString();
    EXPECT_FALSE(prod.message().empty()) << c.name;
  }
  const Status bad_grad = AdafactorUpdate({}, {}, shape, p, good, GradView{g.data(), DType{9}});
  EXPECT_EQ(bad_grad.code(), StatusCode::kInvalidArgument);
  for (const auto* buf : {&p, &row, &col, &v, &m}) {
    const float want = buf == &p ? 1.0f : 0.5f;
    EXPECT_TRUE(std::all_of(buf->begin(), buf->end(), [&](float x) { return x == want; }));
  }
  // An empty tensor is a no-op, with null pointers too.
  EXPECT_TRUE(AdafactorUpdate({}, {}, Shape{0, 5}, {}, {.exp_avg_sq_col = std::span(col).first(5)},
                              GradView{nullptr, DType::kBF16})
                  .ok());
  EXPECT_TRUE(AdafactorUpdate({}, {}, Shape{0}, {}, {}, GradView{nullptr, DType::kBF16}).ok());
}

// A few hundred steps on a least-squares problem Y = X W* + b*: the factored W and
// the non-factored b both converge.
TEST(Adafactor, LeastSquaresConverges) {
  constexpr int64_t kSamples = 64, kIn = 12, kOut = 9;
  std::mt19937 rng(27);
  std::normal_distribution<double> normal;
  std::vector<double> x(kSamples * kIn), w_true(kIn * kOut), b_true(kOut), y(kSamples * kOut);
  for (double& e : x) e = normal(rng);
  for (double& e : w_true) e = normal(rng);
  for (double& e : b_true) e = normal(rng);
  for (int64_t s = 0; s < kSamples; ++s) {
    for (int64_t o = 0; o < kOut; ++o) {
      double acc = b_true[o];
      for (int64_t i = 0; i < kIn; ++i) acc += x[s * kIn + i] * w_true[i * kOut + o];
      y[s * kOut + o] = acc;
    }
  }
  for (const NamedConfig& nc :
       {NamedConfig{"lr 0.05", {.lr = 0.05f}},
        NamedConfig{"beta1 0.9 decay", {.lr = 0.05f, .beta1 = 0.9f, .weight_decay = 1e-4f}},
        NamedConfig{"relative step", {.relative_step = true, .scale_parameter = false}}}) {
    SCOPED_TRACE(nc.name);
    const AdafactorConfig& c = nc.config;
    std::vector<float> w(kIn * kOut, 0.0f), b(kOut, 0.0f), gw(w.size()), gb(b.size());
    std::vector<float> row(kIn, 0.0f), col(kOut, 0.0f), v(kOut, 0.0f);
    std::vector<float> mw(c.beta1 > 0 ? w.size() : 0), mb(c.beta1 > 0 ? b.size() : 0);
    auto loss_and_grad = [&] {
      std::fill(gw.begin(), gw.end(), 0.0f);
      std::fill(gb.begin(), gb.end(), 0.0f);
      std::vector<double> dw(w.size(), 0.0), db(b.size(), 0.0);
      double loss = 0.0;
      for (int64_t s = 0; s < kSamples; ++s) {
        for (int64_t o = 0; o < kOut; ++o) {
          double pred = b[o];
          for (int64_t i = 0; i < kIn; ++i) pred += x[s * kIn + i] * w[i * kOut + o];
          const double r = pred - y[s * kOut + o];
          loss += 0.5 * r * r / kSamples;
          db[o] += r / kSamples;
          for (int64_t i = 0; i < kIn; ++i) dw[i * kOut + o] += r * x[s * kIn + i] / kSamples;
        }
      }
      for (size_t i = 0; i < w.size(); ++i) gw[i] = static_cast<float>(dw[i]);
      for (size_t i = 0; i < b.size(); ++i) gb[i] = static_cast<float>(db[i]);
      return loss;
    };
    const double initial = loss_and_grad();
    double loss = initial;
    for (int64_t step = 1; step <= 400; ++step) {
      ASSERT_TRUE(AdafactorUpdate(c, {.step = step}, Shape{kIn, kOut}, w,
                                  {.exp_avg_sq_row = row, .exp_avg_sq_col = col, .exp_avg = mw},
                                  GradView{gw.data(), DType::kF32})
                      .ok());
      ASSERT_TRUE(AdafactorUpdate(c, {.step = step}, Shape{kOut}, b,
                                  {.exp_avg_sq = v, .exp_avg = mb},
                                  GradView{gb.data(), DType::kF32})
                      .ok());
      loss = loss_and_grad();
    }
    EXPECT_LT(loss, 1e-3 * initial) << "initial " << initial << " final " << loss;
  }
}

}  // namespace
}  // namespace strata::cpu_optim
