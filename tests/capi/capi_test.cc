// The C API (include/strata/strata.h) as a client sees it: libstrata.so against
// the C++ scalar reference of cpu_optim (bit for bit) and float64 references,
// errors with codes and messages, thread-local last error, exported symbols.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "base/dtype.h"
#include "cpu_optim/adafactor.h"
#include "cpu_optim/adagrad.h"
#include "cpu_optim/adamw.h"
#include "cpu_optim/adamw8bit.h"
#include "cpu_optim/lion.h"
#include "cpu_optim/sgd.h"
#include "strata/strata.h"
#include "tests/capi/c_header_check.h"

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// Random values spanning large and tiny magnitudes, with zeros and negatives.
std::vector<float> RandomValues(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 4);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = i % 97 == 3 ? 0.0f : scale * normal(rng) * std::ldexp(1.0f, exponent(rng));
  }
  return out;
}

// Gradient bytes of the given dtype holding the values of g (rounded as base/dtype.h).
std::vector<uint16_t> To16(const std::vector<float>& g, strata_dtype dtype) {
  std::vector<uint16_t> out(g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    out[i] = dtype == STRATA_DTYPE_BF16 ? strata::FloatToBf16(g[i]) : strata::FloatToHalf(g[i]);
  }
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

strata_optimizer* MakeOptimizer(strata_optimizer_kind kind, const strata_adamw_config& config,
                                int num_threads = 0) {
  strata_optimizer_options options;
  strata_optimizer_options_init(&options);
  options.num_threads = num_threads;
  strata_optimizer* opt = nullptr;
  EXPECT_EQ(strata_optimizer_create(kind, &config, &options, &opt), STRATA_OK)
      << strata_last_error();
  return opt;
}

strata_adamw_config NonDefaultConfig() {
  strata_adamw_config c;
  strata_adamw_config_init(&c);
  c.lr = 3e-3f;
  c.beta1 = 0.85f;
  c.beta2 = 0.995f;
  c.eps = 1e-7f;
  c.weight_decay = 0.05f;
  return c;
}

TEST(CApiVersion, MatchesHeaderMacros) {
  char expected[32];
  std::snprintf(expected, sizeof(expected), "%d.%d.%d", STRATA_VERSION_MAJOR, STRATA_VERSION_MINOR,
                STRATA_VERSION_PATCH);
  EXPECT_STREQ(strata_version(), expected);
  EXPECT_EQ(strata_version_number(), STRATA_VERSION_NUMBER);
}

TEST(CApiStatus, NamesMirrorStatusCodes) {
  EXPECT_STREQ(strata_status_name(STRATA_OK), "OK");
  EXPECT_STREQ(strata_status_name(STRATA_INVALID_ARGUMENT), "INVALID_ARGUMENT");
  EXPECT_STREQ(strata_status_name(STRATA_UNIMPLEMENTED), "UNIMPLEMENTED");
  EXPECT_STREQ(strata_status_name(STRATA_DATA_LOSS), "DATA_LOSS");
  EXPECT_STREQ(strata_status_name(static_cast<strata_status>(16)), "UNKNOWN_CODE");
  EXPECT_STREQ(strata_status_name(static_cast<strata_status>(-1)), "UNKNOWN_CODE");
}

TEST(CApiDType, SizesAndUnknownValues) {
  EXPECT_EQ(strata_dtype_size(STRATA_DTYPE_F32), 4u);
  EXPECT_EQ(strata_dtype_size(STRATA_DTYPE_F16), 2u);
  EXPECT_EQ(strata_dtype_size(STRATA_DTYPE_BF16), 2u);
  EXPECT_EQ(strata_dtype_size(static_cast<strata_dtype>(3)), 0u);
  // 256 would alias kF32 if the API truncated to the C++ enum's uint8_t.
  EXPECT_EQ(strata_dtype_size(static_cast<strata_dtype>(256)), 0u);
}

TEST(CApiKernel, NameIsAKnownVariant) {
  const std::string name = strata_kernel_name();
  EXPECT_TRUE(name == "avx512" || name == "avx2" || name == "generic") << name;
}

// AdamW and Adam through the C API equal cpu_optim's scalar reference bit for bit,
// for every gradient dtype and copy-out dtype, over several steps, on an odd length
// that spans many tiles.
TEST(CApiOptimizer, AdamWAndAdamEqualScalarReferenceBitForBit) {
  constexpr size_t n = 100003;
  for (strata_optimizer_kind kind : {STRATA_OPTIMIZER_ADAMW, STRATA_OPTIMIZER_ADAM}) {
    for (strata_dtype grad_dtype : {STRATA_DTYPE_F32, STRATA_DTYPE_F16, STRATA_DTYPE_BF16}) {
      for (int out_kind = 0; out_kind < 4; ++out_kind) {  // none, f32, f16, bf16
        SCOPED_TRACE(testing::Message()
                     << "kind " << kind << " grad " << grad_dtype << " out " << out_kind);
        const strata_adamw_config c = NonDefaultConfig();
        strata_optimizer* opt = MakeOptimizer(kind, c);
        ASSERT_NE(opt, nullptr);
        const strata::cpu_optim::AdamWConfig ref_config{
            .lr = c.lr,
            .beta1 = c.beta1,
            .beta2 = c.beta2,
            .eps = c.eps,
            .weight_decay = c.weight_decay,
            .decoupled_weight_decay = kind == STRATA_OPTIMIZER_ADAMW,
            .bias_correction = true};
        std::vector<float> p = RandomValues(n, 1, 1.0f), m(n, 0.0f), v(n, 0.0f);
        std::vector<float> rp = p, rm = m, rv = v;
        std::vector<uint16_t> out16(n), rout16(n);
        std::vector<float> out32(n), rout32(n);
        const strata_dtype out_dtype = out_kind == 1   ? STRATA_DTYPE_F32
                                       : out_kind == 2 ? STRATA_DTYPE_F16
                                                       : STRATA_DTYPE_BF16;
        void* out = out_kind == 0   ? nullptr
                    : out_kind == 1 ? static_cast<void*>(out32.data())
                                    : static_cast<void*>(out16.data());
        void* rout = out_kind == 0   ? nullptr
                     : out_kind == 1 ? static_cast<void*>(rout32.data())
                                     : static_cast<void*>(rout16.data());
        for (int64_t step = 1; step <= 3; ++step) {
          const std::vector<float> g = RandomValues(n, 100 + step, 0.1f);
          const std::vector<uint16_t> g16 =
              grad_dtype == STRATA_DTYPE_F32 ? std::vector<uint16_t>() : To16(g, grad_dtype);
          const void* grad =
              grad_dtype == STRATA_DTYPE_F32 ? static_cast<const void*>(g.data()) : g16.data();
          float* state[2] = {m.data(), v.data()};
          ASSERT_EQ(strata_optimizer_step(opt, step, 0.5f, p.data(), state, 2, grad, grad_dtype,
                                          out, out_dtype, n),
                    STRATA_OK)
              << strata_last_error();
          ASSERT_TRUE(strata::cpu_optim::AdamWUpdateReference(
                          ref_config, {.step = step, .grad_scale = 0.5f}, rp, rm, rv,
                          {grad, static_cast<strata::DType>(grad_dtype)},
                          {rout, static_cast<strata::DType>(out_dtype)})
                          .ok());
        }
        EXPECT_TRUE(SameBits(p, rp));
        EXPECT_TRUE(SameBits(m, rm));
        EXPECT_TRUE(SameBits(v, rv));
        EXPECT_EQ(out16, rout16);
        EXPECT_TRUE(SameBits(out32, rout32));
        strata_optimizer_destroy(opt);
      }
    }
  }
}

// One optimizer kind with a non-default config, and the cpu_optim scalar
// reference it must equal: (step, grad_scale, params, state buffers, grad, copy-out).
struct ReferenceCase {
  const char* name;
  strata_optimizer_kind kind;
  const void* config;
  int num_state;
  std::function<strata::Status(const strata::cpu_optim::OptimStep&, std::span<float>,
                               std::vector<std::vector<float>>&, strata::cpu_optim::GradView,
                               strata::cpu_optim::CopyOut)>
      reference;
  // State before the first step (torch's initialisation): zeros unless given.
  float initial_state = 0.0f;
};

// Runs `steps` steps of c through the C API and through the reference, for every
// gradient and copy-out dtype, and compares params, state and copy-out bit for bit.
void ExpectEqualsReference(const ReferenceCase& c, size_t n, int64_t steps) {
  for (strata_dtype grad_dtype : {STRATA_DTYPE_F32, STRATA_DTYPE_F16, STRATA_DTYPE_BF16}) {
    for (int out_kind = 0; out_kind < 3; ++out_kind) {  // none, f32, bf16
      SCOPED_TRACE(testing::Message() << c.name << " grad " << grad_dtype << " out " << out_kind);
      strata_optimizer* opt = nullptr;
      ASSERT_EQ(strata_optimizer_create(c.kind, c.config, nullptr, &opt), STRATA_OK)
          << strata_last_error();
      ASSERT_EQ(strata_optimizer_num_state(opt), c.num_state);
      std::vector<float> p = RandomValues(n, 5, 1.0f), rp = p;
      std::vector<std::vector<float>> state(c.num_state, std::vector<float>(n, c.initial_state));
      std::vector<std::vector<float>> rstate = state;
      std::vector<uint16_t> out16(n), rout16(n);
      std::vector<float> out32(n), rout32(n);
      const strata_dtype out_dtype = out_kind == 1 ? STRATA_DTYPE_F32 : STRATA_DTYPE_BF16;
      void* out = out_kind == 0   ? nullptr
                  : out_kind == 1 ? static_cast<void*>(out32.data())
                                  : static_cast<void*>(out16.data());
      void* rout = out_kind == 0   ? nullptr
                   : out_kind == 1 ? static_cast<void*>(rout32.data())
                                   : static_cast<void*>(rout16.data());
      for (int64_t step = 1; step <= steps; ++step) {
        const std::vector<float> g = RandomValues(n, 200 + step, 0.1f);
        const std::vector<uint16_t> g16 =
            grad_dtype == STRATA_DTYPE_F32 ? std::vector<uint16_t>() : To16(g, grad_dtype);
        const void* grad =
            grad_dtype == STRATA_DTYPE_F32 ? static_cast<const void*>(g.data()) : g16.data();
        std::vector<float*> ptrs;
        for (auto& s : state) ptrs.push_back(s.data());
        ASSERT_EQ(strata_optimizer_step(opt, step, 0.75f, p.data(), ptrs.data(), c.num_state, grad,
                                        grad_dtype, out, out_dtype, n),
                  STRATA_OK)
            << strata_last_error();
        const strata::Status status = c.reference({.step = step, .grad_scale = 0.75f}, rp, rstate,
                                                  {grad, static_cast<strata::DType>(grad_dtype)},
                                                  {rout, static_cast<strata::DType>(out_dtype)});
        ASSERT_TRUE(status.ok()) << status.ToString();
      }
      EXPECT_TRUE(SameBits(p, rp));
      for (int i = 0; i < c.num_state; ++i) EXPECT_TRUE(SameBits(state[i], rstate[i])) << i;
      EXPECT_EQ(out16, rout16);
      EXPECT_TRUE(SameBits(out32, rout32));
      // The update really moved the weights (a no-op would equal a no-op reference).
      EXPECT_FALSE(SameBits(p, RandomValues(n, 5, 1.0f)));
      strata_optimizer_destroy(opt);
    }
  }
}

using strata::cpu_optim::CopyOut;
using strata::cpu_optim::GradView;
using strata::cpu_optim::OptimStep;
using State = std::vector<std::vector<float>>;

TEST(CApiOptimizer, AmsgradAndMaximizeEqualScalarReferenceBitForBit) {
  for (strata_optimizer_kind kind : {STRATA_OPTIMIZER_ADAMW, STRATA_OPTIMIZER_ADAM}) {
    for (int variant = 0; variant < 3; ++variant) {  // amsgrad, maximize, both
      strata_adamw_config c = NonDefaultConfig();
      c.amsgrad = variant != 1;
      c.maximize = variant != 0;
      const strata::cpu_optim::AdamWConfig ref{
          .lr = c.lr,
          .beta1 = c.beta1,
          .beta2 = c.beta2,
          .eps = c.eps,
          .weight_decay = c.weight_decay,
          .decoupled_weight_decay = kind == STRATA_OPTIMIZER_ADAMW,
          .bias_correction = true,
          .amsgrad = c.amsgrad != 0,
          .maximize = c.maximize != 0};
      ExpectEqualsReference(
          {.name = kind == STRATA_OPTIMIZER_ADAMW ? "AdamW" : "Adam",
           .kind = kind,
           .config = &c,
           .num_state = c.amsgrad ? 3 : 2,
           .reference =
               [&](const OptimStep& t, std::span<float> p, State& s, GradView g, CopyOut o) {
                 return strata::cpu_optim::AdamWUpdateReference(
                     ref, t, p, s[0], s[1], g, o,
                     ref.amsgrad ? std::span<float>(s[2]) : std::span<float>());
               }},
          10007, 4);
    }
  }
}

TEST(CApiOptimizer, AdagradEqualsScalarReferenceBitForBit) {
  strata_adagrad_config c;
  strata_adagrad_config_init(&c);
  c.lr = 0.05f;
  c.lr_decay = 0.01f;
  c.weight_decay = 0.02f;
  c.initial_accumulator_value = 0.1f;
  c.eps = 1e-8f;
  for (int maximize : {0, 1}) {
    c.maximize = maximize;
    const strata::cpu_optim::AdagradConfig ref{.lr = c.lr,
                                               .lr_decay = c.lr_decay,
                                               .weight_decay = c.weight_decay,
                                               .initial_accumulator_value = 0.1f,
                                               .eps = c.eps,
                                               .maximize = maximize != 0};
    ExpectEqualsReference(
        {.name = "Adagrad",
         .kind = STRATA_OPTIMIZER_ADAGRAD,
         .config = &c,
         .num_state = 1,
         .reference =
             [&](const OptimStep& t, std::span<float> p, State& s, GradView g, CopyOut o) {
               return strata::cpu_optim::AdagradUpdateReference(ref, t, p, s[0], g, o);
             },
         .initial_state = 0.1f},
        10007, 4);
  }
}

TEST(CApiOptimizer, LionEqualsScalarReferenceBitForBit) {
  strata_lion_config c;
  strata_lion_config_init(&c);
  c.lr = 3e-4f;
  c.beta1 = 0.95f;
  c.beta2 = 0.98f;
  c.weight_decay = 0.5f;
  for (int maximize : {0, 1}) {
    c.maximize = maximize;
    const strata::cpu_optim::LionConfig ref{.lr = c.lr,
                                            .beta1 = c.beta1,
                                            .beta2 = c.beta2,
                                            .weight_decay = c.weight_decay,
                                            .maximize = maximize != 0};
    ExpectEqualsReference(
        {.name = "Lion",
         .kind = STRATA_OPTIMIZER_LION,
         .config = &c,
         .num_state = 1,
         .reference =
             [&](const OptimStep& t, std::span<float> p, State& s, GradView g, CopyOut o) {
               return strata::cpu_optim::LionUpdateReference(ref, t, p, s[0], g, o);
             }},
        10007, 4);
  }
}

TEST(CApiOptimizer, SgdEqualsScalarReferenceBitForBit) {
  struct Variant {
    float momentum, dampening, weight_decay;
    int nesterov, maximize;
  };
  for (const Variant& v : {Variant{0.9f, 0.1f, 0.01f, 0, 0}, Variant{0.8f, 0.0f, 0.0f, 1, 0},
                           Variant{0.7f, 0.0f, 0.05f, 1, 1}, Variant{0.0f, 0.0f, 0.03f, 0, 1}}) {
    strata_sgd_config c;
    strata_sgd_config_init(&c);
    c.lr = 0.02f;
    c.momentum = v.momentum;
    c.dampening = v.dampening;
    c.weight_decay = v.weight_decay;
    c.nesterov = v.nesterov;
    c.maximize = v.maximize;
    const strata::cpu_optim::SgdConfig ref{.lr = c.lr,
                                           .momentum = c.momentum,
                                           .dampening = c.dampening,
                                           .weight_decay = c.weight_decay,
                                           .nesterov = c.nesterov != 0,
                                           .maximize = c.maximize != 0};
    const int num_state = v.momentum != 0.0f ? 1 : 0;
    ExpectEqualsReference(
        {.name = "SGD",
         .kind = STRATA_OPTIMIZER_SGD,
         .config = &c,
         .num_state = num_state,
         .reference =
             [&](const OptimStep& t, std::span<float> p, State& s, GradView g, CopyOut o) {
               return strata::cpu_optim::SgdUpdateReference(
                   ref, t, p, num_state ? std::span<float>(s[0]) : std::span<float>(), g, o);
             },
         // Ignored at step 1 (torch creates the buffer from the gradient).
         .initial_state = 123.0f},
        10007, 4);
  }
}

// Defaults of the *_config_init functions are torch.optim's (lion-pytorch's for Lion).
TEST(CApiOptimizer, ConfigInitSetsTorchDefaults) {
  strata_adagrad_config a;
  strata_adagrad_config_init(&a);
  EXPECT_EQ(a.struct_size, sizeof(a));
  EXPECT_EQ(a.lr, 1e-2f);
  EXPECT_EQ(a.lr_decay, 0.0f);
  EXPECT_EQ(a.weight_decay, 0.0f);
  EXPECT_EQ(a.initial_accumulator_value, 0.0f);
  EXPECT_EQ(a.eps, 1e-10f);
  EXPECT_EQ(a.maximize, 0);
  strata_lion_config l;
  strata_lion_config_init(&l);
  EXPECT_EQ(l.struct_size, sizeof(l));
  EXPECT_EQ(l.lr, 1e-4f);
  EXPECT_EQ(l.beta1, 0.9f);
  EXPECT_EQ(l.beta2, 0.99f);
  EXPECT_EQ(l.weight_decay, 0.0f);
  EXPECT_EQ(l.maximize, 0);
  strata_sgd_config s;
  strata_sgd_config_init(&s);
  EXPECT_EQ(s.struct_size, sizeof(s));
  EXPECT_EQ(s.momentum, 0.0f);
  EXPECT_EQ(s.dampening, 0.0f);
  EXPECT_EQ(s.weight_decay, 0.0f);
  EXPECT_EQ(s.nesterov, 0);
  EXPECT_EQ(s.maximize, 0);
}

TEST(CApiOptimizer, NewKindsRejectBadConfigsWithMessages) {
  strata_optimizer* opt = reinterpret_cast<strata_optimizer*>(0x1);
  auto expect_invalid = [&](strata_optimizer_kind kind, const void* config, const char* what) {
    EXPECT_EQ(strata_optimizer_create(kind, config, nullptr, &opt), STRATA_INVALID_ARGUMENT)
        << what;
    EXPECT_EQ(opt, nullptr);
    EXPECT_THAT(strata_last_error(), HasSubstr(what));
  };
  strata_adagrad_config a;
  strata_adagrad_config_init(&a);
  a.lr_decay = -0.1f;
  expect_invalid(STRATA_OPTIMIZER_ADAGRAD, &a, "lr_decay");
  strata_adagrad_config_init(&a);
  a.initial_accumulator_value = NAN;
  expect_invalid(STRATA_OPTIMIZER_ADAGRAD, &a, "initial_accumulator_value");
  strata_adagrad_config_init(&a);
  a.eps = -1.0f;
  expect_invalid(STRATA_OPTIMIZER_ADAGRAD, &a, "eps");

  strata_lion_config l;
  strata_lion_config_init(&l);
  l.beta1 = 1.5f;
  expect_invalid(STRATA_OPTIMIZER_LION, &l, "beta");
  strata_lion_config_init(&l);
  l.weight_decay = -1.0f;
  expect_invalid(STRATA_OPTIMIZER_LION, &l, "weight_decay");

  strata_sgd_config s;
  strata_sgd_config_init(&s);
  s.nesterov = 1;  // without momentum
  expect_invalid(STRATA_OPTIMIZER_SGD, &s, "esterov");
  s.momentum = 0.9f;
  s.dampening = 0.1f;  // nesterov with dampening
  expect_invalid(STRATA_OPTIMIZER_SGD, &s, "esterov");
  strata_sgd_config_init(&s);
  s.momentum = -0.5f;
  expect_invalid(STRATA_OPTIMIZER_SGD, &s, "momentum");
  strata_sgd_config_init(&s);
  s.lr = INFINITY;
  expect_invalid(STRATA_OPTIMIZER_SGD, &s, "lr");

  // A struct_size of another header version (or of AdamW's struct) is refused.
  strata_sgd_config_init(&s);
  s.struct_size -= sizeof(int);
  expect_invalid(STRATA_OPTIMIZER_SGD, &s, "struct_size");
  strata_lion_config_init(&l);
  l.struct_size = sizeof(strata_adamw_config);
  expect_invalid(STRATA_OPTIMIZER_LION, &l, "struct_size");
  strata_adagrad_config_init(&a);
  a.struct_size = 0;
  expect_invalid(STRATA_OPTIMIZER_ADAGRAD, &a, "struct_size");
}

// The number of state buffers follows the config: amsgrad adds max_exp_avg_sq, SGD
// without momentum has none; a step with another count is refused.
TEST(CApiOptimizer, NumStateFollowsConfig) {
  strata_adamw_config c = NonDefaultConfig();
  strata_optimizer* opt = MakeOptimizer(STRATA_OPTIMIZER_ADAMW, c);
  ASSERT_NE(opt, nullptr);
  EXPECT_EQ(strata_optimizer_num_state(opt), 2);
  c.amsgrad = 1;
  ASSERT_EQ(strata_optimizer_set_config(opt, &c), STRATA_OK);
  EXPECT_EQ(strata_optimizer_num_state(opt), 3);
  std::vector<float> p(8, 1.0f), m(8), v(8), vmax(8);
  const std::vector<float> g(8, 0.5f);
  float* two[2] = {m.data(), v.data()};
  EXPECT_EQ(strata_optimizer_step(opt, 1, 1.0f, p.data(), two, 2, g.data(), STRATA_DTYPE_F32,
                                  nullptr, STRATA_DTYPE_F32, 8),
            STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("num_state is 2, expected 3"));
  float* three[3] = {m.data(), v.data(), v.data()};  // max_exp_avg_sq aliases v
  EXPECT_EQ(strata_optimizer_step(opt, 1, 1.0f, p.data(), three, 3, g.data(), STRATA_DTYPE_F32,
                                  nullptr, STRATA_DTYPE_F32, 8),
            STRATA_INVALID_ARGUMENT);
  EXPECT_TRUE(SameBits(p, std::vector<float>(8, 1.0f)));
  strata_optimizer_destroy(opt);

  strata_sgd_config s;
  strata_sgd_config_init(&s);
  s.lr = 0.5f;
  ASSERT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_SGD, &s, nullptr, &opt), STRATA_OK);
  EXPECT_EQ(strata_optimizer_get_kind(opt), STRATA_OPTIMIZER_SGD);
  EXPECT_EQ(strata_optimizer_num_state(opt), 0);
  ASSERT_EQ(strata_optimizer_step(opt, 1, 1.0f, p.data(), nullptr, 0, g.data(), STRATA_DTYPE_F32,
                                  nullptr, STRATA_DTYPE_F32, 8),
            STRATA_OK)
      << strata_last_error();
  EXPECT_TRUE(SameBits(p, std::vector<float>(8, 0.75f)));  // 1 - 0.5 * 0.5, exact
  s.momentum = 0.9f;
  ASSERT_EQ(strata_optimizer_set_config(opt, &s), STRATA_OK);
  EXPECT_EQ(strata_optimizer_num_state(opt), 1);
  EXPECT_EQ(strata_optimizer_step(opt, 2, 1.0f, p.data(), nullptr, 0, g.data(), STRATA_DTYPE_F32,
                                  nullptr, STRATA_DTYPE_F32, 8),
            STRATA_INVALID_ARGUMENT);
  strata_optimizer_destroy(opt);
}

// One AdamW step against float64 arithmetic (torch.optim.AdamW's formula): the
// fp32 result is within a few fp32 roundings of it, relative to the update size.
TEST(CApiOptimizer, AdamWUpdateMatchesFloat64Reference) {
  constexpr size_t n = 4099;
  const strata_adamw_config c = NonDefaultConfig();
  strata_optimizer* opt = MakeOptimizer(STRATA_OPTIMIZER_ADAMW, c);
  ASSERT_NE(opt, nullptr);
  std::vector<float> p = RandomValues(n, 7, 1.0f), m = RandomValues(n, 8, 0.01f), v(n);
  for (size_t i = 0; i < n; ++i) v[i] = m[i] * m[i] * 2.0f;
  const std::vector<float> g = RandomValues(n, 9, 0.1f);
  const std::vector<float> p0 = p, m0 = m, v0 = v;
  constexpr int64_t t = 10;
  float* state[2] = {m.data(), v.data()};
  ASSERT_EQ(strata_optimizer_step(opt, t, 1.0f, p.data(), state, 2, g.data(), STRATA_DTYPE_F32,
                                  nullptr, STRATA_DTYPE_F32, n),
            STRATA_OK)
      << strata_last_error();
  const double lr = c.lr, b1 = c.beta1, b2 = c.beta2, eps = c.eps, wd = c.weight_decay;
  for (size_t i = 0; i < n; ++i) {
    const double gd = g[i];
    const double md = b1 * m0[i] + (1 - b1) * gd;
    const double vd = b2 * v0[i] + (1 - b2) * gd * gd;
    const double denom = std::sqrt(vd) / std::sqrt(1 - std::pow(b2, t)) + eps;
    const double step_size = lr / (1 - std::pow(b1, t));
    const double update = step_size * md / denom;
    const double pd = p0[i] * (1 - lr * wd) - update;
    // Each of the ~12 fp32 operations contributes at most 2^-24 relative error
    // to its term; the terms are bounded by |p| and |update|. m itself is only
    // known to 4 * 2^-24 * (|m0| + |g|) (below), which can exceed 2^-24 * |m| when
    // beta1 * m0 and (1 - beta1) * g cancel; that error reaches p scaled by
    // step_size / denom.
    const double m_tol = 4 * 0x1p-24 * (std::abs(m0[i]) + std::abs(gd));
    const double tol =
        16 * 0x1p-24 * (std::abs(p0[i]) + std::abs(update)) + step_size * m_tol / denom + 1e-30;
    ASSERT_NEAR(p[i], pd, tol) << "element " << i;
    ASSERT_NEAR(m[i], md, m_tol + 1e-30) << i;
    ASSERT_NEAR(v[i], vd, 4 * 0x1p-24 * (std::abs(v0[i]) + gd * gd) + 1e-38) << i;
  }
  strata_optimizer_destroy(opt);
}

TEST(CApiOptimizer, ResultsAreBitIdenticalForAnyThreadCount) {
  constexpr size_t n = 300001;
  const strata_adamw_config c = NonDefaultConfig();
  const std::vector<float> p0 = RandomValues(n, 11, 1.0f);
  const std::vector<uint16_t> g = To16(RandomValues(n, 12, 0.1f), STRATA_DTYPE_BF16);
  std::vector<float> first_p;
  for (int threads : {0, 1, 2, 7}) {
    SCOPED_TRACE(threads);
    strata_optimizer* opt = MakeOptimizer(STRATA_OPTIMIZER_ADAMW, c, threads);
    ASSERT_NE(opt, nullptr);
    std::vector<float> p = p0, m(n, 0.0f), v(n, 0.0f);
    float* state[2] = {m.data(), v.data()};
    for (int64_t step = 1; step <= 2; ++step) {
      ASSERT_EQ(strata_optimizer_step(opt, step, 1.0f, p.data(), state, 2, g.data(),
                                      STRATA_DTYPE_BF16, nullptr, STRATA_DTYPE_BF16, n),
                STRATA_OK);
    }
    if (first_p.empty()) {
      first_p = p;
    } else {
      EXPECT_TRUE(SameBits(p, first_p));
    }
    strata_optimizer_destroy(opt);
  }
}

// Core binding (strata_optimizer_options.cores) through cpu_optim::WorkerArena:
// bound steps equal unbound ones bit for bit, the caller's affinity mask is
// restored after a step, and bad core lists are refused.
TEST(CApiOptimizer, CoreBindingKeepsResultsAndRestoresCallerAffinity) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE && cores.size() < 2; ++c) {
    if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  }
  ASSERT_FALSE(cores.empty());
  constexpr size_t n = 100003;
  strata_lion_config c;
  strata_lion_config_init(&c);
  c.lr = 1e-3f;
  c.weight_decay = 0.1f;
  const std::vector<float> p0 = RandomValues(n, 61, 1.0f);
  const std::vector<uint16_t> g = To16(RandomValues(n, 62, 0.1f), STRATA_DTYPE_BF16);
  std::vector<std::vector<float>> results;
  for (int bind : {0, 1}) {
    strata_optimizer_options options;
    strata_optimizer_options_init(&options);
    options.num_threads = 3;
    if (bind) {
      options.cores = cores.data();
      options.num_cores = static_cast<int>(cores.size());
    }
    strata_optimizer* opt = nullptr;
    ASSERT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_LION, &c, &options, &opt), STRATA_OK)
        << strata_last_error();
    std::vector<float> p = p0, m(n, 0.0f);
    float* state[1] = {m.data()};
    for (int64_t step = 1; step <= 3; ++step) {
      ASSERT_EQ(strata_optimizer_step(opt, step, 1.0f, p.data(), state, 1, g.data(),
                                      STRATA_DTYPE_BF16, nullptr, STRATA_DTYPE_F32, n),
                STRATA_OK)
          << strata_last_error();
    }
    cpu_set_t after;
    CPU_ZERO(&after);
    ASSERT_EQ(sched_getaffinity(0, sizeof(after), &after), 0);
    EXPECT_TRUE(CPU_EQUAL(&after, &allowed)) << "the caller's affinity mask was not restored";
    results.push_back(p);
    strata_optimizer_destroy(opt);
  }
  EXPECT_TRUE(SameBits(results[0], results[1]));
  EXPECT_FALSE(SameBits(results[0], p0));

  strata_optimizer_options options;
  strata_optimizer_options_init(&options);
  strata_optimizer* opt = reinterpret_cast<strata_optimizer*>(0x1);
  const int twice[2] = {cores[0], cores[0]};
  options.cores = twice;
  options.num_cores = 2;
  EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_LION, &c, &options, &opt),
            STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("listed twice"));
  EXPECT_EQ(opt, nullptr);
  const int out_of_range[1] = {CPU_SETSIZE + 5};
  options.cores = out_of_range;
  options.num_cores = 1;
  EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_LION, &c, &options, &opt),
            STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("out of range"));
  options.cores = nullptr;
  EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_LION, &c, &options, &opt),
            STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("num_cores"));
  options.cores = cores.data();
  options.num_cores = -1;
  EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_LION, &c, &options, &opt),
            STRATA_INVALID_ARGUMENT);

  // A caller built against the 0.1.0 header passes the shorter struct: accepted,
  // without binding (the fields after num_threads are not read).
  strata_optimizer_options old;
  strata_optimizer_options_init(&old);
  old.struct_size = offsetof(strata_optimizer_options, cores);
  old.num_threads = 2;
  old.num_cores = -7;  // beyond the old struct: must be ignored
  ASSERT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_LION, &c, &old, &opt), STRATA_OK)
      << strata_last_error();
  strata_optimizer_destroy(opt);
}

TEST(CApiOptimizer, SetConfigChangesLearningRateAndKeepsOldOnError) {
  strata_adamw_config c = NonDefaultConfig();
  strata_optimizer* opt = MakeOptimizer(STRATA_OPTIMIZER_ADAM, c);
  ASSERT_NE(opt, nullptr);
  EXPECT_EQ(strata_optimizer_get_kind(opt), STRATA_OPTIMIZER_ADAM);
  c.lr = 0.25f;
  ASSERT_EQ(strata_optimizer_set_config(opt, &c), STRATA_OK);
  strata_adamw_config bad = c;
  bad.lr = -1.0f;
  EXPECT_EQ(strata_optimizer_set_config(opt, &bad), STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("lr"));
  // Step 1 with bias correction and v = g^2 (1 - beta2) ... the first Adam step
  // moves each weight by lr * sign(g) up to eps: check against the reference.
  std::vector<float> p = {1.0f, 2.0f, -3.0f}, m(3, 0.0f), v(3, 0.0f);
  std::vector<float> rp = p, rm = m, rv = v;
  const std::vector<float> g = {0.5f, -0.25f, 2.0f};
  float* state[2] = {m.data(), v.data()};
  ASSERT_EQ(strata_optimizer_step(opt, 1, 1.0f, p.data(), state, 2, g.data(), STRATA_DTYPE_F32,
                                  nullptr, STRATA_DTYPE_F32, 3),
            STRATA_OK);
  ASSERT_TRUE(strata::cpu_optim::AdamWUpdateReference({.lr = 0.25f,
                                                       .beta1 = c.beta1,
                                                       .beta2 = c.beta2,
                                                       .eps = c.eps,
                                                       .weight_decay = c.weight_decay,
                                                       .decoupled_weight_decay = false},
                                                      {.step = 1}, rp, rm, rv,
                                                      {g.data(), strata::DType::kF32})
                  .ok());
  EXPECT_TRUE(SameBits(p, rp));
  strata_optimizer_destroy(opt);
}

TEST(CApiOptimizer, CreateRejectsBadArgumentsWithMessages) {
  strata_adamw_config c;
  strata_adamw_config_init(&c);
  strata_optimizer* opt = reinterpret_cast<strata_optimizer*>(0x1);
  EXPECT_EQ(strata_optimizer_create(static_cast<strata_optimizer_kind>(8), &c, nullptr, &opt),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(opt, nullptr);
  EXPECT_THAT(strata_last_error(), StartsWith("INVALID_ARGUMENT: "));
  EXPECT_THAT(strata_last_error(), HasSubstr("unknown optimizer kind 8"));
  EXPECT_EQ(strata_optimizer_create(static_cast<strata_optimizer_kind>(0), &c, nullptr, &opt),
            STRATA_INVALID_ARGUMENT);

  EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW, nullptr, nullptr, &opt),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW, &c, nullptr, nullptr),
            STRATA_INVALID_ARGUMENT);

  strata_adamw_config wrong_size = c;
  wrong_size.struct_size = 8;
  EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW, &wrong_size, nullptr, &opt),
            STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("struct_size"));

  for (auto mutate : std::vector<void (*)(strata_adamw_config&)>{
           [](strata_adamw_config& x) { x.lr = -1e-3f; },
           [](strata_adamw_config& x) { x.eps = NAN; },
           [](strata_adamw_config& x) { x.beta1 = 1.0f; },
           [](strata_adamw_config& x) { x.beta2 = -0.1f; },
           [](strata_adamw_config& x) { x.weight_decay = INFINITY; }}) {
    strata_adamw_config bad = c;
    mutate(bad);
    EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW, &bad, nullptr, &opt),
              STRATA_INVALID_ARGUMENT);
    EXPECT_EQ(opt, nullptr);
  }

  strata_optimizer_options options;
  strata_optimizer_options_init(&options);
  options.num_threads = -2;
  EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW, &c, &options, &opt),
            STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("num_threads"));
  options.num_threads = 1;
  options.struct_size = 0;
  EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW, &c, &options, &opt),
            STRATA_INVALID_ARGUMENT);
  strata_optimizer_destroy(nullptr);  // allowed
}

TEST(CApiOptimizer, StepRejectsBadArgumentsAndModifiesNothing) {
  strata_adamw_config c;
  strata_adamw_config_init(&c);
  strata_optimizer* opt = MakeOptimizer(STRATA_OPTIMIZER_ADAMW, c);
  ASSERT_NE(opt, nullptr);
  constexpr size_t n = 64;
  std::vector<float> p = RandomValues(n, 3, 1.0f), m(n, 0.5f), v(n, 0.25f);
  const std::vector<float> g = RandomValues(n, 4, 1.0f);
  const std::vector<float> p0 = p, m0 = m, v0 = v;
  float* state[2] = {m.data(), v.data()};
  auto step = [&](int64_t t, float scale, float* params, float* const* st, int ns, strata_dtype gd,
                  void* out, int64_t count) {
    return strata_optimizer_step(opt, t, scale, params, st, ns, g.data(), gd, out,
                                 STRATA_DTYPE_BF16, count);
  };
  EXPECT_EQ(strata_optimizer_step(nullptr, 1, 1.0f, p.data(), state, 2, g.data(), STRATA_DTYPE_F32,
                                  nullptr, STRATA_DTYPE_F32, n),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(step(0, 1.0f, p.data(), state, 2, STRATA_DTYPE_F32, nullptr, n),
            STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("step"));
  EXPECT_EQ(step(1, NAN, p.data(), state, 2, STRATA_DTYPE_F32, nullptr, n),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(step(1, 1.0f, p.data(), state, 1, STRATA_DTYPE_F32, nullptr, n),
            STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("num_state is 1, expected 2"));
  EXPECT_EQ(step(1, 1.0f, p.data(), nullptr, 2, STRATA_DTYPE_F32, nullptr, n),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(step(1, 1.0f, nullptr, state, 2, STRATA_DTYPE_F32, nullptr, n),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(step(1, 1.0f, p.data(), state, 2, static_cast<strata_dtype>(256), nullptr, n),
            STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("unknown dtype 256"));
  EXPECT_EQ(step(1, 1.0f, p.data(), state, 2, STRATA_DTYPE_F32, nullptr, -1),
            STRATA_INVALID_ARGUMENT);
  // m and v overlapping; copy-out on top of the params.
  float* overlapping[2] = {m.data(), m.data() + 1};
  EXPECT_EQ(step(1, 1.0f, p.data(), overlapping, 2, STRATA_DTYPE_F32, nullptr, n - 1),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(step(1, 1.0f, p.data(), state, 2, STRATA_DTYPE_F32, p.data(), n),
            STRATA_INVALID_ARGUMENT);
  EXPECT_TRUE(SameBits(p, p0));
  EXPECT_TRUE(SameBits(m, m0));
  EXPECT_TRUE(SameBits(v, v0));
  // Zero elements is a valid empty step.
  EXPECT_EQ(step(1, 1.0f, nullptr, state, 2, STRATA_DTYPE_F32, nullptr, 0), STRATA_OK);
  strata_optimizer_destroy(opt);
}

// A NULL buffer is refused naming the call and the parameter; one of no elements is allowed.
TEST(CApiErrors, ANullBufferIsNamedByItsParameter) {
  strata_adamw_config c;
  strata_adamw_config_init(&c);
  strata_optimizer* opt = MakeOptimizer(STRATA_OPTIMIZER_ADAMW, c);
  ASSERT_NE(opt, nullptr);
  std::vector<float> p(5, 1.0f), m(5, 0.0f), v(5, 0.0f), g(5, 0.5f);
  float* state[2] = {m.data(), v.data()};
  const std::vector<float> p_before = p;
  auto expect = [&](strata_status status, const std::string& message) {
    EXPECT_EQ(status, STRATA_INVALID_ARGUMENT) << message;
    EXPECT_EQ(std::string(strata_last_error()), "INVALID_ARGUMENT: " + message);
    EXPECT_EQ(p, p_before);  // nothing modified
  };
  expect(strata_optimizer_step(opt, 1, 1.0f, nullptr, state, 2, g.data(), STRATA_DTYPE_F32, nullptr,
                               STRATA_DTYPE_F32, 5),
         "strata_optimizer_step: params is NULL with num_elems 5");
  expect(strata_optimizer_step(opt, 1, 1.0f, p.data(), state, 2, nullptr, STRATA_DTYPE_F32, nullptr,
                               STRATA_DTYPE_F32, 5),
         "strata_optimizer_step: grad is NULL with num_elems 5");
  float* half_state[2] = {m.data(), nullptr};
  expect(strata_optimizer_step(opt, 1, 1.0f, p.data(), half_state, 2, g.data(), STRATA_DTYPE_F32,
                               nullptr, STRATA_DTYPE_F32, 5),
         "strata_optimizer_step: state[1] (exp_avg_sq) is NULL with num_elems 5");
  expect(strata_optimizer_step(opt, 1, 1.0f, p.data(), nullptr, 2, g.data(), STRATA_DTYPE_F32,
                               nullptr, STRATA_DTYPE_F32, 5),
         "strata_optimizer_step: state is NULL with num_state 2 and num_elems 5");
  // No elements: every buffer may be NULL, as the header says.
  EXPECT_EQ(strata_optimizer_step(opt, 1, 1.0f, nullptr, nullptr, 2, nullptr, STRATA_DTYPE_F32,
                                  nullptr, STRATA_DTYPE_F32, 0),
            STRATA_OK)
      << strata_last_error();
  const int64_t shape[1] = {5};
  void* sections[2] = {m.data(), v.data()};
  const int64_t sizes[2] = {20, 20};
  expect(strata_optimizer_step_state(opt, 1, 1.0f, nullptr, shape, 1, sections, sizes, 2, g.data(),
                                     STRATA_DTYPE_F32, nullptr, STRATA_DTYPE_F32),
         "strata_optimizer_step_state: params is NULL with num_elems 5");
  expect(strata_optimizer_step_state(opt, 1, 1.0f, p.data(), shape, 1, sections, sizes, 2, nullptr,
                                     STRATA_DTYPE_F32, nullptr, STRATA_DTYPE_F32),
         "strata_optimizer_step_state: grad is NULL with num_elems 5");
  strata_optimizer_destroy(opt);

  std::vector<float> accum(5, 0.0f);
  expect(strata_grad_accumulate(nullptr, g.data(), STRATA_DTYPE_F32, 5, 1, nullptr),
         "strata_grad_accumulate: accum is NULL with num_elems 5");
  expect(strata_grad_accumulate(accum.data(), nullptr, STRATA_DTYPE_F32, 5, 1, nullptr),
         "strata_grad_accumulate: grad is NULL with num_elems 5");
  strata_grad_stats stats;
  expect(strata_grad_stats_compute(nullptr, STRATA_DTYPE_F32, 5, 1.0f, &stats),
         "strata_grad_stats_compute: grad is NULL with num_elems 5");
  std::vector<uint16_t> h(5);
  expect(strata_convert_from_f32(nullptr, h.data(), STRATA_DTYPE_BF16, 5),
         "strata_convert_from_f32: src is NULL with num_elems 5");
  expect(strata_convert_from_f32(p.data(), nullptr, STRATA_DTYPE_BF16, 5),
         "strata_convert_from_f32: dst is NULL with num_elems 5");
  expect(strata_convert_to_f32(nullptr, STRATA_DTYPE_BF16, accum.data(), 5),
         "strata_convert_to_f32: src is NULL with num_elems 5");
  expect(strata_convert_to_f32(h.data(), STRATA_DTYPE_BF16, nullptr, 5),
         "strata_convert_to_f32: dst is NULL with num_elems 5");
}

TEST(CApiErrors, LastErrorIsPerThread) {
  EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW, nullptr, nullptr, nullptr),
            STRATA_INVALID_ARGUMENT);
  const std::string here = strata_last_error();
  EXPECT_THAT(here, HasSubstr("out is NULL"));
  std::string other = "unset";
  std::thread([&] { other = strata_last_error(); }).join();
  EXPECT_EQ(other, "");
  std::thread([] {
    strata_grad_stats s;
    EXPECT_EQ(strata_grad_stats_compute(nullptr, STRATA_DTYPE_F32, 1, 1.0f, &s),
              STRATA_INVALID_ARGUMENT);
  }).join();
  EXPECT_EQ(strata_last_error(), here);
  // A successful call leaves the last message in place.
  EXPECT_STREQ(strata_status_name(STRATA_OK), "OK");
  EXPECT_EQ(strata_last_error(), here);
}

TEST(CApiGrad, StatsMatchFloat64AndFlagNonFinite) {
  constexpr size_t n = 200003;
  const std::vector<uint16_t> g = To16(RandomValues(n, 21, 3.0f), STRATA_DTYPE_BF16);
  const float scale = 0.125f;
  double expected = 0.0;
  for (uint16_t h : g) {
    const double x = static_cast<double>(strata::Bf16ToFloat(h)) * scale;
    expected += x * x;
  }
  strata_grad_stats s{};
  ASSERT_EQ(strata_grad_stats_compute(g.data(), STRATA_DTYPE_BF16, n, scale, &s), STRATA_OK);
  EXPECT_EQ(s.num_elems, static_cast<int64_t>(n));
  EXPECT_EQ(s.nonfinite, 0);
  // Both sums are of the same exact fp64 squares, in different orders.
  EXPECT_NEAR(s.sum_squares, expected, 1e-12 * expected);

  std::vector<uint16_t> bad = g;
  bad[n / 2] = 0x7f80;  // +inf in bf16
  ASSERT_EQ(strata_grad_stats_compute(bad.data(), STRATA_DTYPE_BF16, n, scale, &s), STRATA_OK);
  EXPECT_EQ(s.nonfinite, 1);
  EXPECT_EQ(strata_grad_stats_compute(g.data(), static_cast<strata_dtype>(5), n, 1.0f, &s),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_grad_stats_compute(g.data(), STRATA_DTYPE_BF16, n, 1.0f, nullptr),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_grad_stats_compute(g.data(), STRATA_DTYPE_BF16, n, INFINITY, &s),
            STRATA_INVALID_ARGUMENT);
}

TEST(CApiGrad, AccumulateOverwritesThenAddsInFp32) {
  constexpr size_t n = 70001;
  const std::vector<float> a = RandomValues(n, 31, 1.0f), b = RandomValues(n, 32, 1.0f);
  const std::vector<uint16_t> a16 = To16(a, STRATA_DTYPE_F16), b16 = To16(b, STRATA_DTYPE_F16);
  std::vector<float> accum(n, 123.0f);
  ASSERT_EQ(strata_grad_accumulate(accum.data(), a16.data(), STRATA_DTYPE_F16, n, 1, nullptr),
            STRATA_OK);
  strata_grad_stats s{};
  ASSERT_EQ(strata_grad_accumulate(accum.data(), b16.data(), STRATA_DTYPE_F16, n, 0, &s),
            STRATA_OK);
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const float expected = strata::HalfToFloat(a16[i]) + strata::HalfToFloat(b16[i]);
    ASSERT_EQ(std::bit_cast<uint32_t>(accum[i]), std::bit_cast<uint32_t>(expected)) << i;
    sum += static_cast<double>(expected) * expected;
  }
  EXPECT_EQ(s.num_elems, static_cast<int64_t>(n));
  EXPECT_NEAR(s.sum_squares, sum, 1e-12 * sum);
  EXPECT_EQ(strata_grad_accumulate(accum.data(), accum.data(), STRATA_DTYPE_F32, n, 0, nullptr),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_grad_accumulate(accum.data(), nullptr, STRATA_DTYPE_F32, n, 0, nullptr),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_grad_accumulate(accum.data(), b16.data(), STRATA_DTYPE_F16, -5, 0, nullptr),
            STRATA_INVALID_ARGUMENT);
}

TEST(CApiGrad, ConversionsRoundToNearestEvenAndKeepNaN) {
  std::vector<float> src = RandomValues(5003, 41, 100.0f);
  src[0] = NAN;
  src[1] = INFINITY;
  src[2] = 1e30f;        // past fp16 range -> inf
  src[3] = 1e-41f;       // denormal
  src[4] = 1.00390625f;  // halfway between two bf16 values: ties to even
  for (strata_dtype d : {STRATA_DTYPE_F16, STRATA_DTYPE_BF16}) {
    std::vector<uint16_t> dst(src.size());
    ASSERT_EQ(strata_convert_from_f32(src.data(), dst.data(), d, src.size()), STRATA_OK);
    EXPECT_EQ(dst, To16(src, d));
    std::vector<float> back(src.size());
    ASSERT_EQ(strata_convert_to_f32(dst.data(), d, back.data(), src.size()), STRATA_OK);
    for (size_t i = 0; i < src.size(); ++i) {
      const float expected =
          d == STRATA_DTYPE_BF16 ? strata::Bf16ToFloat(dst[i]) : strata::HalfToFloat(dst[i]);
      ASSERT_EQ(std::bit_cast<uint32_t>(back[i]), std::bit_cast<uint32_t>(expected)) << i;
    }
    EXPECT_TRUE(std::isnan(back[0]));
  }
  std::vector<uint16_t> dst(4);
  EXPECT_EQ(strata_convert_from_f32(src.data(), dst.data(), static_cast<strata_dtype>(-1), 4),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_convert_to_f32(dst.data(), STRATA_DTYPE_F16, nullptr, 4),
            STRATA_INVALID_ARGUMENT);
}

TEST(CApiC, HeaderCompilesAsCAndSmokeStepMatchesReference) {
  float params[3];
  ASSERT_EQ(strata_capi_c_smoke(params), 0);
  std::vector<float> rp = {1.0f, -2.0f, 0.5f}, rm(3, 0.0f), rv(3, 0.0f);
  const std::vector<float> g = {0.5f, 0.25f, -1.0f};
  ASSERT_TRUE(strata::cpu_optim::AdamWUpdateReference({.lr = 0.1f, .weight_decay = 1e-2f},
                                                      {.step = 1}, rp, rm, rv,
                                                      {g.data(), strata::DType::kF32})
                  .ok());
  EXPECT_TRUE(SameBits(std::vector<float>(params, params + 3), rp));
}

// libstrata.so exports the C API and nothing else (no C++ symbols of cpu_optim,
// fmt or spdlog that could clash with a host framework's own copies).
TEST(CApiLibrary, ExportsOnlyStrataCSymbols) {
  const std::string cmd = std::string("nm -D --defined-only ") + STRATA_SHARED_LIBRARY_PATH;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) GTEST_SKIP() << "cannot run nm";
  std::set<std::string> symbols;
  char line[1024];
  while (std::fgets(line, sizeof(line), pipe) != nullptr) {
    std::string s(line);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    // "address type name"; type A is the version node (STRATA_0), not a symbol.
    const size_t space = s.rfind(' ');
    if (space == std::string::npos || space < 2 || s[space - 1] == 'A') continue;
    std::string name = s.substr(space + 1);
    name = name.substr(0, name.find('@'));  // "strata_x@@STRATA_0" with symbol versions
    symbols.insert(name);
  }
  if (pclose(pipe) != 0 && symbols.empty()) GTEST_SKIP() << "nm is not available: " << cmd;
  EXPECT_TRUE(symbols.count("strata_optimizer_step"));
  EXPECT_TRUE(symbols.count("strata_last_error"));
  for (const std::string& s : symbols) {
    EXPECT_THAT(s, StartsWith("strata_")) << "unexpected export from libstrata.so";
  }
}

// ---- AdamW8bit and Adafactor: the state layout API (0.4) ----

namespace cpu_optim = strata::cpu_optim;
using strata::DType;
using strata::FloatToBf16;

struct SectionBuffers {
  std::vector<strata_state_section> sections;
  std::vector<std::vector<std::byte>> bytes;  // 4-byte aligned storage per section
  std::vector<void*> ptrs;
  std::vector<int64_t> sizes;
};

SectionBuffers MakeSections(strata_optimizer* opt, const std::vector<int64_t>& shape) {
  SectionBuffers b;
  int count = -1;
  EXPECT_EQ(strata_optimizer_state_layout(opt, shape.data(), static_cast<int>(shape.size()),
                                          nullptr, 0, &count),
            STRATA_OK);
  b.sections.resize(count);
  EXPECT_EQ(strata_optimizer_state_layout(opt, shape.data(), static_cast<int>(shape.size()),
                                          b.sections.data(), count, &count),
            STRATA_OK);
  for (const auto& s : b.sections) b.bytes.emplace_back(s.size_bytes + 4);
  for (size_t i = 0; i < b.sections.size(); ++i) {
    b.ptrs.push_back(b.bytes[i].data());
    b.sizes.push_back(b.sections[i].size_bytes);
  }
  EXPECT_EQ(strata_optimizer_init_state(opt, shape.data(), static_cast<int>(shape.size()),
                                        b.ptrs.data(), count),
            STRATA_OK);
  return b;
}

std::vector<float> RandomVector(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

TEST(CApiStateLayout, AdamW8bitLayoutIsCodesAndBlockScales) {
  strata_adamw_config c;
  strata_adamw_config_init(&c);
  strata_optimizer* opt = nullptr;
  ASSERT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW8BIT, &c, nullptr, &opt), STRATA_OK);
  EXPECT_EQ(strata_optimizer_get_kind(opt), STRATA_OPTIMIZER_ADAMW8BIT);
  EXPECT_EQ(strata_optimizer_num_state(opt), 0);
  const int64_t shape[2] = {3, 1500};  // 4500 elements: 3 blocks of 2048
  strata_state_section sec[STRATA_MAX_STATE_SECTIONS];
  int count = 0;
  ASSERT_EQ(strata_optimizer_state_layout(opt, shape, 2, sec, STRATA_MAX_STATE_SECTIONS, &count),
            STRATA_OK);
  ASSERT_EQ(count, 4);
  EXPECT_STREQ(sec[0].name, "exp_avg");
  EXPECT_EQ(sec[0].dtype, STRATA_STATE_U8);
  EXPECT_EQ(sec[0].num_elems, 4500);
  EXPECT_EQ(sec[0].size_bytes, 4500);
  EXPECT_EQ(sec[0].initial_code, 127);
  EXPECT_STREQ(sec[1].name, "exp_avg.absmax");
  EXPECT_EQ(sec[1].dtype, STRATA_STATE_F32);
  EXPECT_EQ(sec[1].num_elems, 3);
  EXPECT_EQ(sec[1].size_bytes, 12);
  EXPECT_STREQ(sec[2].name, "exp_avg_sq");
  EXPECT_EQ(sec[2].initial_code, 0);
  EXPECT_STREQ(sec[3].name, "exp_avg_sq.absmax");
  // Fewer slots than sections: the count, and only the slots given are written.
  strata_state_section one[1];
  ASSERT_EQ(strata_optimizer_state_layout(opt, shape, 2, one, 1, &count), STRATA_OK);
  EXPECT_EQ(count, 4);
  EXPECT_STREQ(one[0].name, "exp_avg");
  strata_optimizer_destroy(opt);
}

TEST(CApiStateLayout, AdafactorFactorsTensorsOfTwoOrMoreDimensions) {
  strata_adafactor_config c;
  strata_adafactor_config_init(&c);
  c.beta1 = 0.9f;
  strata_optimizer* opt = nullptr;
  ASSERT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAFACTOR, &c, nullptr, &opt), STRATA_OK);
  strata_state_section sec[STRATA_MAX_STATE_SECTIONS];
  int count = 0;
  const int64_t matrix[3] = {2, 3, 7};
  ASSERT_EQ(strata_optimizer_state_layout(opt, matrix, 3, sec, 8, &count), STRATA_OK);
  ASSERT_EQ(count, 3);
  EXPECT_STREQ(sec[0].name, "exp_avg_sq_row");
  EXPECT_EQ(sec[0].num_elems, 6);
  EXPECT_STREQ(sec[1].name, "exp_avg_sq_col");
  EXPECT_EQ(sec[1].num_elems, 7);
  EXPECT_STREQ(sec[2].name, "exp_avg");
  EXPECT_EQ(sec[2].num_elems, 42);
  const int64_t vec[1] = {10};
  ASSERT_EQ(strata_optimizer_state_layout(opt, vec, 1, sec, 8, &count), STRATA_OK);
  ASSERT_EQ(count, 2);
  EXPECT_STREQ(sec[0].name, "exp_avg_sq");
  EXPECT_EQ(sec[0].num_elems, 10);
  ASSERT_EQ(strata_optimizer_state_layout(opt, nullptr, 0, sec, 8, &count), STRATA_OK);  // scalar
  EXPECT_EQ(count, 2);
  EXPECT_EQ(sec[0].num_elems, 1);
  // Per-element kinds describe their torch.optim buffers.
  strata_adamw_config a;
  strata_adamw_config_init(&a);
  strata_optimizer* adamw = nullptr;
  ASSERT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW, &a, nullptr, &adamw), STRATA_OK);
  ASSERT_EQ(strata_optimizer_state_layout(adamw, matrix, 3, sec, 8, &count), STRATA_OK);
  ASSERT_EQ(count, 2);
  EXPECT_STREQ(sec[1].name, "exp_avg_sq");
  EXPECT_EQ(sec[1].num_elems, 42);
  strata_optimizer_destroy(adamw);
  strata_optimizer_destroy(opt);
}

TEST(CApiStateLayout, AdamW8bitStepEqualsTheCppKernelBitForBit) {
  strata_adamw_config c;
  strata_adamw_config_init(&c);
  c.lr = 1e-2f;
  c.weight_decay = 0.05f;
  strata_optimizer_options o;
  strata_optimizer_options_init(&o);
  o.num_threads = 3;
  strata_optimizer* opt = nullptr;
  ASSERT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW8BIT, &c, &o, &opt), STRATA_OK);
  const std::vector<int64_t> shape = {5001};
  SectionBuffers b = MakeSections(opt, shape);
  // The C++ reference state: the same initial values.
  const size_t n = 5001, blocks = 3;
  std::vector<uint8_t> m_codes(n, 127), v_codes(n, 0);
  std::vector<float> m_abs(blocks, 0.0f), v_abs(blocks, 0.0f);
  std::vector<float> p = RandomVector(n, 1, 1.0f), q = p;
  std::vector<uint16_t> out(n), want_out(n);
  const cpu_optim::AdamWConfig cfg{.lr = 1e-2f, .weight_decay = 0.05f};
  for (int t = 1; t <= 4; ++t) {
    std::vector<float> g32 = RandomVector(n, 10 + t, 0.1f);
    std::vector<uint16_t> g(n);
    for (size_t i = 0; i < n; ++i) g[i] = FloatToBf16(g32[i]);
    ASSERT_EQ(strata_optimizer_step_state(opt, t, 0.5f, p.data(), shape.data(), 1, b.ptrs.data(),
                                          b.sizes.data(), 4, g.data(), STRATA_DTYPE_BF16,
                                          out.data(), STRATA_DTYPE_BF16),
              STRATA_OK)
        << strata_last_error();
    ASSERT_TRUE(cpu_optim::AdamW8bitUpdate(
                    cfg, {.step = t, .grad_scale = 0.5f}, q, {m_codes, m_abs}, {v_codes, v_abs},
                    {g.data(), DType::kBF16}, {want_out.data(), DType::kBF16})
                    .ok());
    ASSERT_EQ(0, std::memcmp(p.data(), q.data(), n * 4)) << "step " << t;
    ASSERT_EQ(0, std::memcmp(b.bytes[0].data(), m_codes.data(), n));
    ASSERT_EQ(0, std::memcmp(b.bytes[1].data(), m_abs.data(), blocks * 4));
    ASSERT_EQ(0, std::memcmp(b.bytes[2].data(), v_codes.data(), n));
    ASSERT_EQ(0, std::memcmp(b.bytes[3].data(), v_abs.data(), blocks * 4));
    ASSERT_EQ(out, want_out);
  }
  strata_optimizer_destroy(opt);
}

TEST(CApiStateLayout, AdafactorStepEqualsTheCppKernelBitForBit) {
  for (float beta1 : {0.0f, 0.9f}) {
    strata_adafactor_config c;
    strata_adafactor_config_init(&c);
    c.beta1 = beta1;
    c.relative_step = 1;
    c.scale_parameter = 1;
    c.weight_decay = 0.01f;
    strata_optimizer* opt = nullptr;
    ASSERT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAFACTOR, &c, nullptr, &opt), STRATA_OK);
    cpu_optim::AdafactorConfig cfg{
        .weight_decay = 0.01f, .relative_step = true, .scale_parameter = true};
    cfg.beta1 = beta1;
    for (const std::vector<int64_t>& shape :
         std::vector<std::vector<int64_t>>{{37, 53}, {3, 4, 5}, {101}}) {
      SCOPED_TRACE(::testing::Message() << "beta1 " << beta1 << " ndim " << shape.size());
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      SectionBuffers b = MakeSections(opt, shape);
      const bool factored = shape.size() >= 2;
      std::vector<float> row(factored ? n / shape.back() : 0, 0.0f);
      std::vector<float> col(factored ? shape.back() : 0, 0.0f);
      std::vector<float> full(factored ? 0 : n, 0.0f), m(beta1 > 0 ? n : 0, 0.0f);
      std::vector<float> p = RandomVector(n, 3, 1.0f), q = p;
      for (int t = 1; t <= 3; ++t) {
        const std::vector<float> g = RandomVector(n, 20 + t, 0.3f);
        ASSERT_EQ(strata_optimizer_step_state(
                      opt, t, 1.0f, p.data(), shape.data(), static_cast<int>(shape.size()),
                      b.ptrs.data(), b.sizes.data(), static_cast<int>(b.ptrs.size()), g.data(),
                      STRATA_DTYPE_F32, nullptr, STRATA_DTYPE_F32),
                  STRATA_OK)
            << strata_last_error();
        ASSERT_TRUE(cpu_optim::AdafactorUpdate(cfg, {.step = t}, shape, q, {row, col, full, m},
                                               {g.data(), DType::kF32})
                        .ok());
        ASSERT_EQ(0, std::memcmp(p.data(), q.data(), n * 4)) << "step " << t;
        size_t i = 0;
        for (const std::vector<float>* want : {&row, &col, &full, &m}) {
          if (want->empty()) continue;
          ASSERT_EQ(0, std::memcmp(b.bytes[i].data(), want->data(), want->size() * 4))
              << b.sections[i].name;
          ++i;
        }
      }
    }
    strata_optimizer_destroy(opt);
  }
}

TEST(CApiStateLayout, BadUseIsInvalidArgumentAndChangesNothing) {
  strata_adamw_config c;
  strata_adamw_config_init(&c);
  strata_optimizer* opt = nullptr;
  c.amsgrad = 1;  // 8-bit state has no AMSGrad
  EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW8BIT, &c, nullptr, &opt),
            STRATA_INVALID_ARGUMENT);
  c.amsgrad = 0;
  ASSERT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW8BIT, &c, nullptr, &opt), STRATA_OK);
  strata_adafactor_config f;
  strata_adafactor_config_init(&f);
  EXPECT_EQ(strata_optimizer_set_config(opt, &f), STRATA_INVALID_ARGUMENT);  // not its struct
  const int64_t shape[1] = {100};
  SectionBuffers b = MakeSections(opt, {100});
  std::vector<float> p(100, 1.0f), g(100, 0.5f);
  // The per-element step refuses these kinds and says what to use.
  float* none[1] = {nullptr};
  EXPECT_EQ(strata_optimizer_step(opt, 1, 1.0f, p.data(), none, 0, g.data(), STRATA_DTYPE_F32,
                                  nullptr, STRATA_DTYPE_F32, 100),
            STRATA_INVALID_ARGUMENT);
  EXPECT_NE(std::string(strata_last_error()).find("strata_optimizer_step_state"),
            std::string::npos);
  // A wrong section size names the section.
  std::vector<int64_t> sizes = b.sizes;
  sizes[1] = 8;
  EXPECT_EQ(
      strata_optimizer_step_state(opt, 1, 1.0f, p.data(), shape, 1, b.ptrs.data(), sizes.data(), 4,
                                  g.data(), STRATA_DTYPE_F32, nullptr, STRATA_DTYPE_F32),
      STRATA_INVALID_ARGUMENT);
  EXPECT_NE(std::string(strata_last_error()).find("exp_avg.absmax"), std::string::npos);
  // Too few sections, bad shapes, a bad step.
  EXPECT_EQ(
      strata_optimizer_step_state(opt, 1, 1.0f, p.data(), shape, 1, b.ptrs.data(), b.sizes.data(),
                                  3, g.data(), STRATA_DTYPE_F32, nullptr, STRATA_DTYPE_F32),
      STRATA_INVALID_ARGUMENT);
  const int64_t bad_shape[2] = {10, 0};
  int count = 0;
  EXPECT_EQ(strata_optimizer_state_layout(opt, bad_shape, 2, nullptr, 0, &count),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_optimizer_state_layout(opt, nullptr, 1, nullptr, 0, &count),
            STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_optimizer_state_layout(opt, shape, 1, nullptr, 2, &count),
            STRATA_INVALID_ARGUMENT);
  // A shape whose state bytes would overflow (2^62 elements: its fp32 absmax and codes) is
  // refused, not answered with wrapped sizes.
  const int64_t huge_shape[2] = {int64_t{1} << 40, int64_t{1} << 22};
  EXPECT_EQ(strata_optimizer_state_layout(opt, huge_shape, 2, nullptr, 0, &count),
            STRATA_INVALID_ARGUMENT);
  EXPECT_NE(std::string(strata_last_error()).find("at most 2^50 elements"), std::string::npos)
      << strata_last_error();
  // An fp32 section's buffer must be 4-byte aligned (as step_state wants it), codes need not be.
  std::vector<void*> shifted = b.ptrs;
  bool any_f32 = false;
  for (size_t i = 0; i < b.sections.size(); ++i) {
    if (b.sections[i].dtype != STRATA_STATE_F32) continue;
    any_f32 = true;
    shifted[i] = static_cast<std::byte*>(b.ptrs[i]) + 1;  // inside its buffer (4 spare bytes)
  }
  ASSERT_TRUE(any_f32);
  EXPECT_EQ(
      strata_optimizer_init_state(opt, shape, 1, shifted.data(), static_cast<int>(shifted.size())),
      STRATA_INVALID_ARGUMENT);
  EXPECT_NE(std::string(strata_last_error()).find("not 4-byte aligned"), std::string::npos)
      << strata_last_error();
  EXPECT_EQ(
      strata_optimizer_step_state(opt, 0, 1.0f, p.data(), shape, 1, b.ptrs.data(), b.sizes.data(),
                                  4, g.data(), STRATA_DTYPE_F32, nullptr, STRATA_DTYPE_F32),
      STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(p, std::vector<float>(100, 1.0f));
  for (size_t i = 0; i < b.sections.size(); ++i) {
    for (int64_t k = 0; k < b.sections[i].size_bytes; ++k) {
      if (b.sections[i].dtype == STRATA_STATE_U8) {
        ASSERT_EQ(static_cast<int>(b.bytes[i][k]), b.sections[i].initial_code);
      } else {
        ASSERT_EQ(static_cast<int>(b.bytes[i][k]), 0);
      }
    }
  }
  strata_optimizer_destroy(opt);
}

}  // namespace
