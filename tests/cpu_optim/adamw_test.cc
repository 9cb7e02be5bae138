#include "cpu_optim/adamw.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <tuple>
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

struct State {
  std::vector<float> p, m, v;
};

State RandomInitialState(int64_t n, std::mt19937& rng) {
  State s{std::vector<float>(n), std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f)};
  for (auto& x : s.p) {
    const uint32_t r = rng() % 100;
    x = r < 85   ? testing::RandomFloat(rng, -8, 3)
        : r < 90 ? testing::RandomFloat(rng, 10, 30)
        : r < 95 ? testing::RandomFloat(rng, -120, -40)
                 : testing::RandomDenormal(rng);
  }
  return s;
}

// Float64 AdamW/Adam step written from the papers and torch's documentation, with
// a forward error bound per element for the fp32 kernel: each fp32 quantity is
// within kK * u * (sum of the magnitudes of the terms that formed it) of the exact
// value (u = 2^-24, the fp32 unit roundoff), plus kK * FLT_TRUE_MIN where a product
// may underflow; bounds are propagated through sqrt and the division.
struct Float64Result {
  double p, m, v;
  double tol_p, tol_m, tol_v;
};

struct BiasCorrection {
  BiasCorrection(const AdamWConfig& c, const OptimStep& st) {
    const double t = static_cast<double>(st.step);
    bc1 = c.bias_correction ? 1.0 - std::pow(static_cast<double>(c.beta1), t) : 1.0;
    bc2_sqrt = c.bias_correction ? std::sqrt(1.0 - std::pow(static_cast<double>(c.beta2), t)) : 1.0;
  }
  double bc1, bc2_sqrt;
};

Float64Result Float64Step(const AdamWConfig& c, const OptimStep& st, const BiasCorrection& bc,
                          double p, double m0, double v0, double grad) {
  constexpr double u = 0x1p-24, kK = 8.0, tiny = FLT_TRUE_MIN;
  const double b1 = c.beta1, b2 = c.beta2, lr = c.lr, wd = c.weight_decay, eps = c.eps;
  const double bc1 = bc.bc1, bc2_sqrt = bc.bc2_sqrt;

  double g = grad * st.grad_scale;
  double mag_g = std::abs(g);
  if (!c.decoupled_weight_decay && wd != 0.0) {
    g += wd * p;
    mag_g += std::abs(wd * p);
  }
  double pd = p;
  if (c.decoupled_weight_decay && wd != 0.0) pd = p * (1.0 - lr * wd);

  Float64Result r{};
  r.m = b1 * m0 + (1.0 - b1) * g;
  r.tol_m = kK * u * (b1 * std::abs(m0) + (1.0 - b1) * mag_g) + kK * tiny;
  r.v = b2 * v0 + (1.0 - b2) * g * g;
  r.tol_v = kK * u * (b2 * std::abs(v0) + (1.0 - b2) * mag_g * mag_g) + kK * tiny;

  const double denom = std::sqrt(r.v) / bc2_sqrt + eps;
  const double sqrt_err =
      r.v > 0.0 ? std::min(std::sqrt(r.tol_v), r.tol_v / (2 * std::sqrt(r.v))) : std::sqrt(r.tol_v);
  const double tol_denom = sqrt_err / bc2_sqrt + kK * u * denom;
  const double step_size = lr / bc1;
  const double update = step_size * r.m / denom;
  const double low_denom = std::max(denom - tol_denom, denom * 0.5);
  const double tol_update = step_size * (r.tol_m + kK * u * std::abs(r.m)) / low_denom +
                            std::abs(update) * tol_denom / low_denom + kK * tiny / low_denom;
  r.p = pd - update;
  r.tol_p = kK * u * (2 * std::abs(pd) + std::abs(update)) + tol_update + kK * tiny;
  return r;
}

void ExpectCopyOutEqualsRounding(const OutData& out, const std::vector<float>& p,
                                 const std::string& where) {
  if (!out.has()) return;
  Mismatches bad(where + " copy-out " + std::string(DTypeName(out.dtype())));
  for (size_t i = 0; i < p.size(); ++i) {
    switch (out.dtype()) {
      case DType::kF32:
        if (out.u32(i) != Bits(p[i])) bad.Add(fmt::format("[{}] {}", i, p[i]));
        break;
      case DType::kF16:
        if (out.u16(i) != FloatToHalf(p[i])) {
          bad.Add(fmt::format("[{}] {:#06x} != FloatToHalf({}) = {:#06x}", i, out.u16(i), p[i],
                              FloatToHalf(p[i])));
        }
        break;
      case DType::kBF16:
        if (out.u16(i) != FloatToBf16(p[i])) {
          bad.Add(fmt::format("[{}] {:#06x} != FloatToBf16({}) = {:#06x}", i, out.u16(i), p[i],
                              FloatToBf16(p[i])));
        }
        break;
    }
  }
  EXPECT_EQ(bad.count(), 0) << bad.Report();
}

void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b,
                    const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  Mismatches bad(what);
  for (size_t i = 0; i < a.size(); ++i) {
    if (!SameFloat(a[i], b[i])) {
      bad.Add(fmt::format("[{}] {:a} vs {:a} ({:#010x} vs {:#010x})", i, a[i], b[i], Bits(a[i]),
                          Bits(b[i])));
    }
  }
  EXPECT_EQ(bad.count(), 0) << bad.Report();
}

struct NamedConfig {
  const char* name;
  AdamWConfig config;
  float grad_scale;
};

std::vector<NamedConfig> Configs() {
  std::vector<NamedConfig> c;
  c.push_back({"adamw_no_decay", AdamWConfig{}, 1.0f});
  AdamWConfig wd;
  wd.weight_decay = 0.1f;
  wd.lr = 3e-3f;
  c.push_back({"adamw_decoupled_decay", wd, 0.75f / 1024.0f});
  AdamWConfig l2;
  l2.weight_decay = 0.01f;
  l2.decoupled_weight_decay = false;
  c.push_back({"adam_l2", l2, 1.0f / 256.0f});
  AdamWConfig wd_nobc = wd;
  wd_nobc.bias_correction = false;
  c.push_back({"adamw_decay_no_bias_correction", wd_nobc, 1.0f});
  AdamWConfig l2_nobc = l2;
  l2_nobc.bias_correction = false;
  l2_nobc.weight_decay = 0.02f;
  c.push_back({"adam_l2_no_bias_correction", l2_nobc, 0.5f});
  AdamWConfig other;
  other.lr = 1e-2f;
  other.beta1 = 0.8f;
  other.beta2 = 0.99f;
  other.eps = 1e-6f;
  c.push_back({"adam_other_betas", other, 3.0f});
  return c;
}

class AdamWAgainstReferences : public ::testing::TestWithParam<std::tuple<DType, int64_t>> {};

// Steps t = 1..5 from m = v = 0; after each step every element of master, m and v
// is checked against a float64 step from the same inputs (dtype-derived bound),
// against AdamWUpdateReference bit for bit, and the copy-out against base/dtype.h.
TEST_P(AdamWAgainstReferences, FiveStepsMatchFloat64AndScalarReference) {
  const auto [dtype, n] = GetParam();
  const DType out_dtypes[] = {DType::kF16, DType::kBF16, DType::kF32, DType::kBF16, DType::kF16};
  std::mt19937 rng(static_cast<uint32_t>(n * 7 + static_cast<int>(dtype)));
  for (const NamedConfig& nc : Configs()) {
    SCOPED_TRACE(nc.name);
    State s = RandomInitialState(n, rng);
    State ref = s;
    for (int64_t t = 1; t <= 5; ++t) {
      SCOPED_TRACE(fmt::format("step {}", t));
      const GradData g = GradData::Random(dtype, n, rng, Mix::kFinite);
      const OptimStep step{.step = t, .grad_scale = nc.grad_scale};
      const State before = s;
      OutData out = t == 4 ? OutData() : OutData(out_dtypes[t - 1], n);
      OutData ref_out = t == 4 ? OutData() : OutData(out_dtypes[t - 1], n);
      ASSERT_TRUE(AdamWUpdate(nc.config, step, s.p, s.m, s.v, g.view(), out.copy_out()).ok());
      ASSERT_TRUE(
          AdamWUpdateReference(nc.config, step, ref.p, ref.m, ref.v, g.view(), ref_out.copy_out())
              .ok());

      Mismatches bad("float64 reference");
      const BiasCorrection bc(nc.config, step);
      for (int64_t i = 0; i < n; ++i) {
        const Float64Result r =
            Float64Step(nc.config, step, bc, before.p[i], before.m[i], before.v[i], g.value(i));
        if (!(std::abs(s.m[i] - r.m) <= r.tol_m) || !(std::abs(s.v[i] - r.v) <= r.tol_v) ||
            !(std::abs(s.p[i] - r.p) <= r.tol_p)) {
          bad.Add(fmt::format(
              "[{}] g={:g}: p {:.9g} vs {:.9g} (tol {:.3g}), m {:.9g} vs {:.9g} (tol {:.3g}), v "
              "{:.9g} vs {:.9g} (tol {:.3g})",
              i, g.value(i), s.p[i], r.p, r.tol_p, s.m[i], r.m, r.tol_m, s.v[i], r.v, r.tol_v));
        }
      }
      ASSERT_EQ(bad.count(), 0) << bad.Report();
      ExpectSameBits(s.p, ref.p, "master vs AdamWUpdateReference");
      ExpectSameBits(s.m, ref.m, "m vs AdamWUpdateReference");
      ExpectSameBits(s.v, ref.v, "v vs AdamWUpdateReference");
      ExpectCopyOutEqualsRounding(out, s.p, "AdamWUpdate");
      if (out.has()) {
        EXPECT_EQ(out.bytes(), ref_out.bytes());
      }
      if (HasFatalFailure() || HasNonfatalFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    DTypesAndLengths, AdamWAgainstReferences,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                       ::testing::Values(int64_t{1}, int64_t{7}, int64_t{4096}, int64_t{100003})),
    [](const auto& info) {
      return fmt::format("{}_n{}", DTypeName(std::get<0>(info.param)), std::get<1>(info.param));
    });

// Random bit patterns everywhere (inf, NaN, overflow to inf, denormals, negative
// v): every ISA variant this CPU runs gives the scalar reference's bits.
TEST(AdamWKernels, EveryVariantMatchesScalarReferenceOnAnyBits) {
  constexpr int64_t n = 2 * internal::kAdamWTileElems + 1237;
  std::mt19937 rng(42);
  State init{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  for (int64_t i = 0; i < n; ++i) {
    init.p[i] = testing::RandomValue(rng, Mix::kAnyBits);
    init.m[i] = testing::RandomValue(rng, Mix::kAnyBits);
    init.v[i] = (i % 3 == 0) ? testing::RandomValue(rng, Mix::kAnyBits)
                             : std::abs(testing::RandomValue(rng, Mix::kFinite));
  }
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  std::vector<NamedConfig> configs = Configs();
  for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
    SCOPED_TRACE(kernels->name);
    for (DType gd : dtypes) {
      const GradData g = GradData::Random(gd, n, rng, Mix::kAnyBits);
      for (int out_kind = 0; out_kind < 4; ++out_kind) {
        const NamedConfig& nc = configs[(out_kind + static_cast<int>(gd)) % configs.size()];
        SCOPED_TRACE(fmt::format("grad {} out {} {}", DTypeName(gd), out_kind, nc.name));
        const OptimStep step{.step = 3, .grad_scale = nc.grad_scale};
        State s = init, ref = init;
        OutData out = out_kind == 3 ? OutData() : OutData(dtypes[out_kind], n);
        OutData ref_out = out_kind == 3 ? OutData() : OutData(dtypes[out_kind], n);
        ASSERT_TRUE(internal::AdamWUpdateWith(*kernels, nc.config, step, s.p, s.m, s.v, g.view(),
                                              out.copy_out())
                        .ok());
        ASSERT_TRUE(
            AdamWUpdateReference(nc.config, step, ref.p, ref.m, ref.v, g.view(), ref_out.copy_out())
                .ok());
        ExpectSameBits(s.p, ref.p, "master");
        ExpectSameBits(s.m, ref.m, "m");
        ExpectSameBits(s.v, ref.v, "v");
        ExpectCopyOutEqualsRounding(out, s.p, kernels->name);
        if (HasFailure()) return;
      }
    }
  }
}

// Every combination of weight decay mode and copy-out dtype, for every variant, on
// the three gradient dtypes: the instantiations are distinct code paths.
TEST(AdamWKernels, EveryModeAndCopyOutMatchesScalarReference) {
  constexpr int64_t n = internal::kAdamWTileElems + 333;
  std::mt19937 rng(7);
  State init = RandomInitialState(n, rng);
  for (auto& x : init.m) x = testing::RandomValue(rng, Mix::kFinite) * 1e-3f;
  for (auto& x : init.v) x = std::abs(testing::RandomValue(rng, Mix::kFinite)) * 1e-3f;
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
    for (DType gd : dtypes) {
      const GradData g = GradData::Random(gd, n, rng, Mix::kFinite);
      for (const NamedConfig& nc : Configs()) {
        for (int out_kind = 0; out_kind < 4; ++out_kind) {
          SCOPED_TRACE(
              fmt::format("{} grad {} out {} {}", kernels->name, DTypeName(gd), out_kind, nc.name));
          const OptimStep step{.step = 2, .grad_scale = nc.grad_scale};
          State s = init, ref = init;
          OutData out = out_kind == 3 ? OutData() : OutData(dtypes[out_kind], n);
          ASSERT_TRUE(internal::AdamWUpdateWith(*kernels, nc.config, step, s.p, s.m, s.v, g.view(),
                                                out.copy_out())
                          .ok());
          ASSERT_TRUE(AdamWUpdateReference(nc.config, step, ref.p, ref.m, ref.v, g.view()).ok());
          ExpectSameBits(s.p, ref.p, "master");
          ExpectSameBits(s.m, ref.m, "m");
          ExpectSameBits(s.v, ref.v, "v");
          ExpectCopyOutEqualsRounding(out, s.p, kernels->name);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(AdamW, ResultsDoNotDependOnThreadCount) {
  constexpr int64_t n = 20 * internal::kAdamWTileElems + 5;
  std::mt19937 rng(3);
  const State init = RandomInitialState(n, rng);
  const GradData g = GradData::Random(DType::kBF16, n, rng, Mix::kFinite);
  AdamWConfig config;
  config.weight_decay = 0.1f;
  // threads == 0: no arena of our own (the process default).
  auto run = [&](int threads) {
    State s = init;
    OutData out(DType::kBF16, n);
    auto steps = [&] {
      for (int64_t t = 1; t <= 3; ++t) {
        ASSERT_TRUE(AdamWUpdate(config, {.step = t, .grad_scale = 0.5f}, s.p, s.m, s.v, g.view(),
                                out.copy_out())
                        .ok());
      }
    };
    if (threads == 0) {
      steps();
    } else {
      tbb::task_arena arena(threads);
      arena.execute(steps);
    }
    return std::make_pair(s, out.bytes());
  };
  const auto [one, one_out] = run(1);
  {
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 1);
    const auto [limited, limited_out] = run(0);
    ExpectSameBits(limited.p, one.p, "master, global_control 1");
    EXPECT_EQ(limited_out, one_out);
  }
  for (int threads : {0, 2, tbb::info::default_concurrency()}) {
    SCOPED_TRACE(threads);
    const auto [many, many_out] = run(threads);
    ExpectSameBits(many.p, one.p, "master");
    ExpectSameBits(many.m, one.m, "m");
    ExpectSameBits(many.v, one.v, "v");
    EXPECT_EQ(many_out, one_out);
  }
}

TEST(AdamW, ConcurrentCallsOnDifferentBuffersMatchSequentialCalls) {
  constexpr int kThreads = 4;
  constexpr int64_t n = 5 * internal::kAdamWTileElems + 11;
  std::mt19937 rng(5);
  std::vector<State> states, expected;
  std::vector<GradData> grads;
  for (int k = 0; k < kThreads; ++k) {
    states.push_back(RandomInitialState(n, rng));
    grads.push_back(GradData::Random(DType::kF16, n, rng, Mix::kFinite));
  }
  expected = states;
  const AdamWConfig config;
  for (int k = 0; k < kThreads; ++k) {
    for (int64_t t = 1; t <= 3; ++t) {
      ASSERT_TRUE(AdamWUpdateReference(config, {.step = t}, expected[k].p, expected[k].m,
                                       expected[k].v, grads[k].view())
                      .ok());
    }
  }
  std::vector<std::thread> threads;
  std::vector<Status> results(kThreads);
  for (int k = 0; k < kThreads; ++k) {
    threads.emplace_back([&, k] {
      for (int64_t t = 1; t <= 3 && results[k].ok(); ++t) {
        results[k] = AdamWUpdate(config, {.step = t}, states[k].p, states[k].m, states[k].v,
                                 grads[k].view());
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int k = 0; k < kThreads; ++k) {
    EXPECT_TRUE(results[k].ok()) << results[k].ToString();
    ExpectSameBits(states[k].p, expected[k].p, fmt::format("thread {} master", k));
  }
}

TEST(AdamW, NoElementsIsANoOpEvenWithNullPointers) {
  EXPECT_TRUE(AdamWUpdate({}, {}, {}, {}, {}, GradView{nullptr, DType::kBF16}).ok());
  EXPECT_TRUE(AdamWUpdateReference({}, {}, {}, {}, {}, GradView{nullptr, DType::kF32}).ok());
}

TEST(AdamW, InvalidArgumentsAreRejectedAndNothingIsModified) {
  constexpr int64_t n = 64;
  std::vector<float> p(n, 1.0f), m(n, 0.5f), v(n, 0.25f), g(n, 1.0f);
  std::vector<uint16_t> out(n, 0);
  std::vector<float> short_v(n - 1, 0.0f);
  const GradView grad{g.data(), DType::kF32};
  const AdamWConfig ok_config;
  const OptimStep ok_step;
  auto config_with = [&](auto edit) {
    AdamWConfig c = ok_config;
    edit(c);
    return c;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    std::string name;
    Status status;
  };
  auto update = [&](const AdamWConfig& c, const OptimStep& s, std::span<float> pp,
                    std::span<float> mm, std::span<float> vv, GradView gg, CopyOut co = {}) {
    const Status prod = AdamWUpdate(c, s, pp, mm, vv, gg, co);
    const Status ref = AdamWUpdateReference(c, s, pp, mm, vv, gg, co);
    EXPECT_EQ(prod.code(), ref.code());
    return prod;
  };
  std::vector<Case> cases = {
      {"v shorter", update(ok_config, ok_step, p, m, short_v, grad)},
      {"null grad", update(ok_config, ok_step, p, m, v, GradView{nullptr, DType::kF32})},
      {"null master",
       update(ok_config, ok_step, std::span<float>(static_cast<float*>(nullptr), n), m, v, grad)},
      {"bad grad dtype", update(ok_config, ok_step, p, m, v, GradView{g.data(), DType{7}})},
      {"bad copy-out dtype",
       update(ok_config, ok_step, p, m, v, grad, CopyOut{out.data(), DType{9}})},
      {"m aliases v", update(ok_config, ok_step, p, m, m, grad)},
      {"grad overlaps master",
       update(ok_config, ok_step, p, m, v, GradView{p.data() + 1, DType::kBF16})},
      {"copy-out overlaps grad",
       update(ok_config, ok_step, p, m, v, grad, CopyOut{g.data() + 3, DType::kBF16})},
      {"step 0", update(ok_config, OptimStep{.step = 0}, p, m, v, grad)},
      {"grad_scale inf", update(ok_config, OptimStep{.grad_scale = inf}, p, m, v, grad)},
      {"grad_scale nan", update(ok_config, OptimStep{.grad_scale = nan}, p, m, v, grad)},
      {"lr < 0", update(config_with([](auto& c) { c.lr = -1e-3f; }), ok_step, p, m, v, grad)},
      {"lr nan", update(config_with([&](auto& c) { c.lr = nan; }), ok_step, p, m, v, grad)},
      {"beta1 = 1", update(config_with([](auto& c) { c.beta1 = 1.0f; }), ok_step, p, m, v, grad)},
      {"beta2 < 0", update(config_with([](auto& c) { c.beta2 = -0.1f; }), ok_step, p, m, v, grad)},
      {"eps < 0", update(config_with([](auto& c) { c.eps = -1e-8f; }), ok_step, p, m, v, grad)},
      {"weight_decay < 0",
       update(config_with([](auto& c) { c.weight_decay = -0.1f; }), ok_step, p, m, v, grad)},
      {"weight_decay inf",
       update(config_with([&](auto& c) { c.weight_decay = inf; }), ok_step, p, m, v, grad)},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.status.code(), StatusCode::kInvalidArgument)
        << c.name << ": " << c.status.ToString();
    EXPECT_FALSE(c.status.message().empty()) << c.name;
  }
  EXPECT_TRUE(std::all_of(p.begin(), p.end(), [](float x) { return x == 1.0f; }));
  EXPECT_TRUE(std::all_of(m.begin(), m.end(), [](float x) { return x == 0.5f; }));
  EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](float x) { return x == 0.25f; }));
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](uint16_t x) { return x == 0; }));
}

TEST(AdamW, ActiveKernelIsTheBestSupportedVariant) {
  const auto tables = internal::SupportedKernelTables();
  ASSERT_FALSE(tables.empty());
  EXPECT_EQ(ActiveKernelName(), tables.front()->name);
  EXPECT_STREQ(tables.back()->name, "generic");
  EXPECT_EQ(internal::FindKernelTable("generic"), tables.back());
  EXPECT_EQ(internal::FindKernelTable("no-such-isa"), nullptr);
}

}  // namespace
}  // namespace strata::cpu_optim
