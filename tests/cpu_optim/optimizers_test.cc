// AdamW (amsgrad, maximize), Adagrad, Lion and SGD: every ISA variant against the
// scalar reference bit for bit, and both against a float64 reference with an error
// bound derived from fp32's unit roundoff (test_data.h, Bounded), element by element.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "cpu_optim/adagrad.h"
#include "cpu_optim/adamw.h"
#include "cpu_optim/grad_stats.h"
#include "cpu_optim/kernels.h"
#include "cpu_optim/lion.h"
#include "cpu_optim/sgd.h"
#include "cpu_optim/threading.h"
#include "tests/cpu_optim/test_data.h"

namespace strata::cpu_optim {
namespace {

using testing::Bits;
using testing::Bounded;
using testing::Exact;
using testing::FloatBuffer;
using testing::GradData;
using testing::kU;
using testing::Mismatches;
using testing::Mix;
using testing::RoundedOnce;
using testing::SameFloat;
using testing::Within;
using States = std::vector<std::span<float>>;

// One optimizer with a fixed config, as the tests drive it.
struct Optim {
  std::string name;
  int num_states = 1;
  std::vector<bool> nonnegative_state;  // e.g. v, state_sum
  // kernels == nullptr: the public entry point.
  std::function<Status(const internal::KernelTable*, const OptimStep&, std::span<float>,
                       const States&, GradView, CopyOut)>
      update;
  std::function<Status(const OptimStep&, std::span<float>, const States&, GradView, CopyOut)>
      reference;
  // Float64 step of one element from its fp32 inputs: expected master and states.
  std::function<void(const OptimStep&, float p, const float* states, float g, Bounded* p_out,
                     Bounded* states_out)>
      float64;
  // Bit-level kernel over [begin, end) of base pointers (tile-split checks).
  std::function<void(const internal::KernelTable&, const OptimStep&, float*, float* const*,
                     const void*, DType, void*, DType, int64_t, int64_t)>
      kernel;
};

Bounded Grad(float g, const OptimStep& st, bool maximize) {
  const Bounded x = Exact(g) * Exact(st.grad_scale);
  return maximize ? -x : x;
}

Optim MakeAdamW(std::string name, AdamWConfig c) {
  Optim o;
  o.name = std::move(name);
  o.num_states = c.amsgrad ? 3 : 2;
  o.nonnegative_state = {false, true, true};
  o.update = [c](const internal::KernelTable* k, const OptimStep& st, std::span<float> p,
                 const States& s, GradView g, CopyOut out) {
    const std::span<float> max_v = c.amsgrad ? s[2] : std::span<float>();
    return k ? internal::AdamWUpdateWith(*k, c, st, p, s[0], s[1], g, out, max_v)
             : AdamWUpdate(c, st, p, s[0], s[1], g, out, max_v);
  };
  o.reference = [c](const OptimStep& st, std::span<float> p, const States& s, GradView g,
                    CopyOut out) {
    return AdamWUpdateReference(c, st, p, s[0], s[1], g, out,
                                c.amsgrad ? s[2] : std::span<float>());
  };
  o.float64 = [c](const OptimStep& st, float p0, const float* s, float gv, Bounded* p_out,
                  Bounded* s_out) {
    const double lr = c.lr, b1 = c.beta1, b2 = c.beta2, wd = c.weight_decay;
    const double t = static_cast<double>(st.step);
    Bounded g = Grad(gv, st, c.maximize);
    Bounded p = Exact(p0);
    if (wd != 0.0) {
      if (c.decoupled_weight_decay) {
        p = p * RoundedOnce(1.0 - lr * wd);
      } else {
        g = g + Exact(wd) * p;
      }
    }
    // m = beta1 * m + (1 - beta1) * g, as torch's lerp evaluates it.
    const Bounded m0 = Exact(s[0]);
    const Bounded m = static_cast<float>(1.0 - b1) < 0.5f ? m0 + RoundedOnce(1.0 - b1) * (g - m0)
                                                          : g - (g - m0) * Bounded{b1, 2 * kU};
    const Bounded v = Exact(b2) * Exact(s[1]) + (RoundedOnce(1.0 - b2) * g) * g;
    const Bounded v_used = c.amsgrad ? testing::Max(Exact(s[2]), v) : v;
    const Bounded bc2 =
        c.bias_correction ? RoundedOnce(std::sqrt(1.0 - std::pow(b2, t))) : Exact(1);
    const Bounded step_size =
        c.bias_correction ? RoundedOnce(lr / (1.0 - std::pow(b1, t))) : Exact(lr);
    const Bounded denom = testing::Sqrt(v_used) / bc2 + Exact(c.eps);
    *p_out = p - (step_size * m) / denom;
    s_out[0] = m;
    s_out[1] = v;
    if (c.amsgrad) s_out[2] = v_used;
  };
  o.kernel = [c](const internal::KernelTable& k, const OptimStep& st, float* p, float* const* s,
                 const void* g, DType gd, void* out, DType od, int64_t begin, int64_t end) {
    const internal::AdamWScalars sc = internal::PrepareAdamW(c, st);
    const internal::AdamWBuffers b{.master = p,
                                   .m = s[0],
                                   .v = s[1],
                                   .grad = g,
                                   .grad_dtype = gd,
                                   .out = out,
                                   .out_dtype = od,
                                   .max_v = c.amsgrad ? s[2] : nullptr};
    k.adamw(sc, b, begin, end);
  };
  return o;
}

Optim MakeAdagrad(std::string name, AdagradConfig c) {
  Optim o;
  o.name = std::move(name);
  o.nonnegative_state = {true};
  o.update = [c](const internal::KernelTable* k, const OptimStep& st, std::span<float> p,
                 const States& s, GradView g, CopyOut out) {
    return k ? internal::AdagradUpdateWith(*k, c, st, p, s[0], g, out)
             : AdagradUpdate(c, st, p, s[0], g, out);
  };
  o.reference = [c](const OptimStep& st, std::span<float> p, const States& s, GradView g,
                    CopyOut out) { return AdagradUpdateReference(c, st, p, s[0], g, out); };
  o.float64 = [c](const OptimStep& st, float p0, const float* s, float gv, Bounded* p_out,
                  Bounded* s_out) {
    Bounded g = Grad(gv, st, c.maximize);
    const Bounded p = Exact(p0);
    if (c.weight_decay != 0.0f) g = g + Exact(c.weight_decay) * p;
    const Bounded sum = Exact(s[0]) + g * g;
    const Bounded std_dev = testing::Sqrt(sum) + Exact(c.eps);
    const double t = static_cast<double>(st.step);
    const Bounded clr = RoundedOnce(static_cast<double>(c.lr) /
                                    (1.0 + (t - 1.0) * static_cast<double>(c.lr_decay)));
    *p_out = p - (clr * g) / std_dev;
    s_out[0] = sum;
  };
  o.kernel = [c](const internal::KernelTable& k, const OptimStep& st, float* p, float* const* s,
                 const void* g, DType gd, void* out, DType od, int64_t begin, int64_t end) {
    k.adagrad(
        internal::PrepareAdagrad(c, st),
        {.master = p, .state = s[0], .grad = g, .grad_dtype = gd, .out = out, .out_dtype = od},
        begin, end);
  };
  return o;
}

Optim MakeLion(std::string name, LionConfig c) {
  Optim o;
  o.name = std::move(name);
  o.nonnegative_state = {false};
  o.update = [c](const internal::KernelTable* k, const OptimStep& st, std::span<float> p,
                 const States& s, GradView g, CopyOut out) {
    return k ? internal::LionUpdateWith(*k, c, st, p, s[0], g, out)
             : LionUpdate(c, st, p, s[0], g, out);
  };
  o.reference = [c](const OptimStep& st, std::span<float> p, const States& s, GradView g,
                    CopyOut out) { return LionUpdateReference(c, st, p, s[0], g, out); };
  o.float64 = [c](const OptimStep& st, float p0, const float* s, float gv, Bounded* p_out,
                  Bounded* s_out) {
    const double lr = c.lr, b1 = c.beta1, b2 = c.beta2;
    const Bounded g = Grad(gv, st, c.maximize);
    Bounded p = Exact(p0);
    if (c.weight_decay != 0.0f) p = p * RoundedOnce(1.0 - lr * c.weight_decay);
    const Bounded m = Exact(s[0]);
    const Bounded interp = Exact(b1) * m + RoundedOnce(1.0 - b1) * g;
    // sign() is discontinuous: where fp32 rounding may decide the sign, any of
    // -1, 0, +1 is right, so the update is lr * [-1, 1].
    Bounded lr_sign{0.0, lr};
    if (std::abs(interp.v) > 2.0 * interp.err) {
      lr_sign = Exact(lr) * Exact(interp.v > 0.0 ? 1.0 : -1.0);
    } else if (interp.v == 0.0 && interp.err == 0.0) {
      lr_sign = Exact(0.0);
    }
    *p_out = p - lr_sign;
    s_out[0] = Exact(b2) * m + RoundedOnce(1.0 - b2) * g;
  };
  o.kernel = [c](const internal::KernelTable& k, const OptimStep& st, float* p, float* const* s,
                 const void* g, DType gd, void* out, DType od, int64_t begin, int64_t end) {
    k.lion(internal::PrepareLion(c, st),
           {.master = p, .state = s[0], .grad = g, .grad_dtype = gd, .out = out, .out_dtype = od},
           begin, end);
  };
  return o;
}

Optim MakeSgd(std::string name, SgdConfig c) {
  Optim o;
  o.name = std::move(name);
  o.num_states = c.momentum != 0.0f ? 1 : 0;
  o.nonnegative_state = {false};
  o.update = [c](const internal::KernelTable* k, const OptimStep& st, std::span<float> p,
                 const States& s, GradView g, CopyOut out) {
    const std::span<float> buf = s.empty() ? std::span<float>() : s[0];
    return k ? internal::SgdUpdateWith(*k, c, st, p, buf, g, out)
             : SgdUpdate(c, st, p, buf, g, out);
  };
  o.reference = [c](const OptimStep& st, std::span<float> p, const States& s, GradView g,
                    CopyOut out) {
    return SgdUpdateReference(c, st, p, s.empty() ? std::span<float>() : s[0], g, out);
  };
  o.float64 = [c](const OptimStep& st, float p0, const float* s, float gv, Bounded* p_out,
                  Bounded* s_out) {
    Bounded g = Grad(gv, st, c.maximize);
    const Bounded p = Exact(p0);
    if (c.weight_decay != 0.0f) g = g + Exact(c.weight_decay) * p;
    if (c.momentum != 0.0f) {
      const Bounded buf = st.step == 1
                              ? g
                              : Exact(c.momentum) * Exact(s[0]) +
                                    RoundedOnce(1.0 - static_cast<double>(c.dampening)) * g;
      s_out[0] = buf;
      g = c.nesterov ? g + Exact(c.momentum) * buf : buf;
    }
    *p_out = p - Exact(c.lr) * g;
  };
  o.kernel = [c](const internal::KernelTable& k, const OptimStep& st, float* p, float* const* s,
                 const void* g, DType gd, void* out, DType od, int64_t begin, int64_t end) {
    k.sgd(internal::PrepareSgd(c, st),
          {.master = p,
           .state = c.momentum != 0.0f ? s[0] : nullptr,
           .grad = g,
           .grad_dtype = gd,
           .out = out,
           .out_dtype = od},
          begin, end);
  };
  return o;
}

std::vector<Optim> AllOptims() {
  std::vector<Optim> v;
  {
    AdamWConfig c;
    c.amsgrad = true;
    c.weight_decay = 0.05f;
    v.push_back(MakeAdamW("adamw_amsgrad", c));
    c.maximize = true;
    c.beta1 = 0.3f;  // torch's lerp takes its other form for weights >= 0.5
    v.push_back(MakeAdamW("adamw_amsgrad_maximize_beta1_0.3", c));
    AdamWConfig l2;
    l2.decoupled_weight_decay = false;
    l2.weight_decay = 0.01f;
    l2.maximize = true;
    l2.bias_correction = false;
    v.push_back(MakeAdamW("adam_l2_maximize_no_bias_correction", l2));
    v.push_back(MakeAdamW("adamw_default", AdamWConfig{}));
  }
  v.push_back(MakeAdagrad("adagrad_default", AdagradConfig{}));
  v.push_back(MakeAdagrad("adagrad_decay_maximize", AdagradConfig{.lr = 0.05f,
                                                                  .lr_decay = 1e-3f,
                                                                  .weight_decay = 0.1f,
                                                                  .initial_accumulator_value = 0.1f,
                                                                  .eps = 1e-6f,
                                                                  .maximize = true}));
  v.push_back(MakeLion("lion_default", LionConfig{}));
  v.push_back(MakeLion(
      "lion_decay_maximize",
      LionConfig{
          .lr = 3e-4f, .beta1 = 0.95f, .beta2 = 0.98f, .weight_decay = 0.5f, .maximize = true}));
  v.push_back(MakeSgd("sgd_plain", SgdConfig{}));
  v.push_back(
      MakeSgd("sgd_momentum_dampening_decay",
              SgdConfig{.lr = 0.01f, .momentum = 0.9f, .dampening = 0.1f, .weight_decay = 1e-2f}));
  v.push_back(MakeSgd(
      "sgd_nesterov_maximize",
      SgdConfig{
          .lr = 0.1f, .momentum = 0.8f, .weight_decay = 0.0f, .nesterov = true, .maximize = true}));
  v.push_back(MakeSgd("sgd_decay_no_momentum", SgdConfig{.lr = 0.02f, .weight_decay = 0.3f}));
  return v;
}

// Master, states, gradient and copy-out of one test problem, offset by `offset`
// elements from their allocations.
struct Problem {
  FloatBuffer p;
  std::vector<FloatBuffer> s;
  GradData g{DType::kF32, 0};
  std::vector<unsigned char> out;
  int64_t n = 0, offset = 0;
  DType out_dtype = DType::kBF16;
  bool has_out = false;

  States states() {
    States r;
    for (auto& b : s) r.push_back(b.span());
    return r;
  }
  std::vector<float*> state_ptrs() {
    std::vector<float*> r;
    for (auto& b : s) r.push_back(b.span().data());
    r.resize(3, nullptr);
    return r;
  }
  GradView grad() const {
    return {static_cast<const unsigned char*>(g.data()) + offset * SizeOf(g.dtype()), g.dtype()};
  }
  float grad_value(int64_t i) const { return g.value(offset + i); }
  CopyOut copy_out() {
    return has_out ? CopyOut{out.data() + offset * SizeOf(out_dtype), out_dtype} : CopyOut{};
  }
};

float RandomWeight(std::mt19937& rng) {
  const uint32_t r = rng() % 100;
  return r < 85   ? testing::RandomFloat(rng, -8, 3)
         : r < 90 ? testing::RandomFloat(rng, 10, 30)
         : r < 95 ? testing::RandomFloat(rng, -120, -40)
         : r < 98 ? testing::RandomDenormal(rng)
                  : 0.0f;
}

Problem MakeProblem(const Optim& o, int64_t n, int64_t offset, DType gd, int out_kind,
                    std::mt19937& rng, Mix mix) {
  Problem pr;
  pr.n = n;
  pr.offset = offset;
  pr.p = FloatBuffer(n, offset);
  for (int64_t i = 0; i < n; ++i)
    pr.p[i] = mix == Mix::kFinite ? RandomWeight(rng) : testing::RandomValue(rng, mix);
  for (int k = 0; k < o.num_states; ++k) {
    FloatBuffer b(n, offset);
    for (int64_t i = 0; i < n; ++i) {
      float x = testing::RandomValue(rng, mix);
      if (o.nonnegative_state[k] && mix == Mix::kFinite) x = std::abs(x);
      b[i] = x;
    }
    pr.s.push_back(std::move(b));
  }
  pr.g = GradData::Random(gd, n + offset, rng, mix);
  const DType out_dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  pr.has_out = out_kind < 3;
  if (pr.has_out) {
    pr.out_dtype = out_dtypes[out_kind];
    pr.out.assign((n + offset) * SizeOf(pr.out_dtype), 0xAB);
  }
  return pr;
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

// The copy-out equals base/dtype.h's rounding of the master weights.
void ExpectCopyOut(Problem& pr, const std::string& what) {
  if (!pr.has_out) return;
  Mismatches bad(what + " copy-out " + std::string(DTypeName(pr.out_dtype)));
  const unsigned char* base = pr.out.data() + pr.offset * SizeOf(pr.out_dtype);
  for (int64_t i = 0; i < pr.n; ++i) {
    const float p = pr.p[i];
    if (pr.out_dtype == DType::kF32) {
      uint32_t x;
      std::memcpy(&x, base + 4 * i, 4);
      if (x != Bits(p)) bad.Add(fmt::format("[{}] {:#010x} vs {:a}", i, x, p));
    } else {
      uint16_t x;
      std::memcpy(&x, base + 2 * i, 2);
      const uint16_t want = pr.out_dtype == DType::kF16 ? FloatToHalf(p) : FloatToBf16(p);
      if (x != want) bad.Add(fmt::format("[{}] {:#06x} vs {:#06x} of {:a}", i, x, want, p));
    }
  }
  EXPECT_EQ(bad.count(), 0) << bad.Report();
}

std::string DTypeLabel(DType d) { return std::string(DTypeName(d)); }

// Steps 1, 2 and 10^6 on the same state: the public entry point against the
// float64 reference (element by element, fp32-derived bound) and against the
// scalar reference bit for bit (master, state and copy-out).
void CheckAgainstReferences(const Optim& o, int64_t n, int64_t offset, DType gd, int out_kind,
                            std::mt19937& rng) {
  SCOPED_TRACE(
      fmt::format("{} n={} offset={} grad={} out={}", o.name, n, offset, DTypeLabel(gd), out_kind));
  Problem pr = MakeProblem(o, n, offset, gd, out_kind, rng, Mix::kFinite);
  Problem ref = pr;
  for (const int64_t t : {int64_t{1}, int64_t{2}, int64_t{1'000'000}}) {
    SCOPED_TRACE(fmt::format("step {}", t));
    const OptimStep st{.step = t, .grad_scale = t == 2 ? 1.0f / 1024.0f : 0.75f};
    if (t > 1) {  // a fresh gradient each step
      pr.g = GradData::Random(gd, n + offset, rng, Mix::kFinite);
      ref.g = pr.g;
    }
    const Problem before = pr;
    ASSERT_TRUE(o.update(nullptr, st, pr.p.span(), pr.states(), pr.grad(), pr.copy_out()).ok());
    ASSERT_TRUE(o.reference(st, ref.p.span(), ref.states(), ref.grad(), ref.copy_out()).ok());
    Mismatches bad("float64 reference");
    for (int64_t i = 0; i < n; ++i) {
      float s_in[3] = {};
      bool finite_inputs = std::isfinite(before.p[i]);
      for (int k = 0; k < o.num_states; ++k) {
        s_in[k] = before.s[k][i];
        finite_inputs = finite_inputs && std::isfinite(s_in[k]);
      }
      // A state that overflowed to inf in an earlier step (random m, v pairs can
      // make huge updates) has no float64 twin; the bit-exact check covers it.
      if (!finite_inputs) continue;
      Bounded want_p, want_s[3];
      o.float64(st, before.p[i], s_in, before.grad_value(i), &want_p, want_s);
      bool ok = Within(pr.p[i], want_p);
      for (int k = 0; k < o.num_states; ++k) ok = ok && Within(pr.s[k][i], want_s[k]);
      if (!ok) {
        std::string states;
        for (int k = 0; k < o.num_states; ++k) {
          states += fmt::format(", s{} {:.9g} -> {:.9g} vs {:.9g} (bound {:.3g})", k, s_in[k],
                                pr.s[k][i], want_s[k].v, want_s[k].err);
        }
        bad.Add(fmt::format("[{}] g={:g}: p {:.9g} -> {:.9g} vs {:.9g} (bound {:.3g}){}", i,
                            before.grad_value(i), before.p[i], pr.p[i], want_p.v, want_p.err,
                            states));
      }
    }
    ASSERT_EQ(bad.count(), 0) << bad.Report();
    ExpectSameBits(pr.p.span(), ref.p.span(), "master vs scalar reference");
    for (int k = 0; k < o.num_states; ++k) {
      ExpectSameBits(pr.s[k].span(), ref.s[k].span(), fmt::format("state {} vs reference", k));
    }
    EXPECT_EQ(pr.out, ref.out);
    ExpectCopyOut(pr, "public");
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(Optimizers, ShortLengthsMatchFloat64AndScalarReference) {
  std::mt19937 rng(11);
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  for (const Optim& o : AllOptims()) {
    for (int64_t n = 1; n <= 67; ++n) {
      for (DType gd : dtypes) {
        for (int out_kind = 0; out_kind < 4; ++out_kind) {
          CheckAgainstReferences(o, n, /*offset=*/n % 3, gd, out_kind, rng);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(Optimizers, LongBufferMatchesFloat64AndScalarReference) {
  std::mt19937 rng(12);
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  for (const Optim& o : AllOptims()) {
    for (DType gd : dtypes) {
      for (int out_kind = 0; out_kind < 4; ++out_kind) {
        CheckAgainstReferences(o, 100003, /*offset=*/out_kind % 2, gd, out_kind, rng);
        if (HasFailure()) return;
      }
    }
  }
}

// Any bit pattern (inf, NaN, overflow, denormals, negative accumulators): every
// ISA variant this CPU runs gives the scalar reference's bits, for every gradient
// and copy-out dtype, lengths that exercise vector tails, misaligned pointers.
TEST(Optimizers, EveryVariantMatchesScalarReferenceOnAnyBits) {
  std::mt19937 rng(13);
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  for (const internal::KernelTable* k : internal::SupportedKernelTables()) {
    for (const Optim& o : AllOptims()) {
      for (const int64_t n : {int64_t{1}, int64_t{15}, int64_t{33}, int64_t{67},
                              2 * internal::kOptimTileElems + 1237}) {
        for (DType gd : dtypes) {
          for (int out_kind = 0; out_kind < 4; ++out_kind) {
            SCOPED_TRACE(fmt::format("{} {} n={} grad={} out={}", k->name, o.name, n,
                                     DTypeLabel(gd), out_kind));
            const Mix mix = n > 100 || out_kind == 1 ? Mix::kAnyBits : Mix::kFinite;
            Problem pr = MakeProblem(o, n, n % 2, gd, out_kind, rng, mix);
            Problem ref = pr;
            for (const int64_t t : {int64_t{1}, int64_t{7}}) {
              const OptimStep st{.step = t, .grad_scale = 0.5f};
              ASSERT_TRUE(o.update(k, st, pr.p.span(), pr.states(), pr.grad(), pr.copy_out()).ok());
              ASSERT_TRUE(
                  o.reference(st, ref.p.span(), ref.states(), ref.grad(), ref.copy_out()).ok());
            }
            ExpectSameBits(pr.p.span(), ref.p.span(), "master");
            for (int s = 0; s < o.num_states; ++s) {
              ExpectSameBits(pr.s[s].span(), ref.s[s].span(), fmt::format("state {}", s));
            }
            ExpectCopyOut(pr, k->name);
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

// maximize is a flip of the gradient's sign: maximize on g gives the bits of the
// plain step on -g.
TEST(Optimizers, MaximizeEqualsStepOnNegatedGradient) {
  std::mt19937 rng(14);
  constexpr int64_t n = 4099;
  std::vector<std::pair<Optim, Optim>> pairs;
  AdamWConfig a;
  a.amsgrad = true;
  AdamWConfig a_max = a;
  a_max.maximize = true;
  pairs.emplace_back(MakeAdamW("adamw", a), MakeAdamW("adamw_max", a_max));
  pairs.emplace_back(MakeAdagrad("adagrad", {.weight_decay = 0.1f}),
                     MakeAdagrad("adagrad_max", {.weight_decay = 0.1f, .maximize = true}));
  pairs.emplace_back(MakeLion("lion", {.weight_decay = 0.1f}),
                     MakeLion("lion_max", {.weight_decay = 0.1f, .maximize = true}));
  pairs.emplace_back(
      MakeSgd("sgd", {.momentum = 0.9f, .weight_decay = 0.1f, .nesterov = true}),
      MakeSgd("sgd_max",
              {.momentum = 0.9f, .weight_decay = 0.1f, .nesterov = true, .maximize = true}));
  for (auto& [plain, maxi] : pairs) {
    SCOPED_TRACE(maxi.name);
    Problem pr = MakeProblem(plain, n, 0, DType::kF32, 3, rng, Mix::kFinite);
    Problem neg = pr;
    for (int64_t i = 0; i < n; ++i) neg.g.Set(i, -pr.g.value(i));
    for (const int64_t t : {int64_t{1}, int64_t{2}}) {
      ASSERT_TRUE(maxi.update(nullptr, {.step = t}, pr.p.span(), pr.states(), pr.grad(), {}).ok());
      ASSERT_TRUE(
          plain.update(nullptr, {.step = t}, neg.p.span(), neg.states(), neg.grad(), {}).ok());
    }
    ExpectSameBits(pr.p.span(), neg.p.span(), "master");
    for (int s = 0; s < plain.num_states; ++s) {
      ExpectSameBits(pr.s[s].span(), neg.s[s].span(), fmt::format("state {}", s));
    }
  }
}

// Results do not depend on the thread count (1, 2, 7 threads, and a WorkerArena
// that binds its threads to cores) nor on how the range is split into tiles.
TEST(Optimizers, BitIdenticalAcrossThreadCountsAndTileSplits) {
  std::mt19937 rng(15);
  constexpr int64_t n = 20 * internal::kOptimTileElems + 5;
  // oneTBB caps workers at the core count minus one by default; allow 7 threads
  // even on a 2-core machine.
  tbb::global_control allow_7(tbb::global_control::max_allowed_parallelism, 8);
  // Three threads bound round-robin to the cores this process may use.
  std::vector<int> cores;
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  for (int c = 0; c < CPU_SETSIZE && cores.size() < 4; ++c) {
    if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  }
  const auto arena_or = WorkerArena::Create({.num_threads = 3, .cores = cores});
  ASSERT_TRUE(arena_or.ok()) << arena_or.status().ToString();
  for (const Optim& o : AllOptims()) {
    SCOPED_TRACE(o.name);
    const Problem init = MakeProblem(o, n, 1, DType::kBF16, 2, rng, Mix::kFinite);
    auto run = [&](const std::function<void(const std::function<void()>&)>& in) {
      Problem pr = init;
      in([&] {
        for (const int64_t t : {int64_t{1}, int64_t{2}, int64_t{3}}) {
          ASSERT_TRUE(o.update(nullptr, {.step = t, .grad_scale = 0.5f}, pr.p.span(), pr.states(),
                               pr.grad(), pr.copy_out())
                          .ok());
        }
      });
      return pr;
    };
    Problem one = run([](const auto& f) { tbb::task_arena(1).execute(f); });
    auto expect_same = [&](Problem& other, const std::string& what) {
      ExpectSameBits(other.p.span(), one.p.span(), "master, " + what);
      for (int s = 0; s < o.num_states; ++s) {
        ExpectSameBits(other.s[s].span(), one.s[s].span(), fmt::format("state {}, {}", s, what));
      }
      EXPECT_EQ(other.out, one.out) << what;
    };
    for (int threads : {2, 7}) {
      Problem many = run([&](const auto& f) { tbb::task_arena(threads).execute(f); });
      expect_same(many, fmt::format("{} threads", threads));
    }
    Problem bound = run([&](const auto& f) { arena_or.value()->Execute(f); });
    expect_same(bound, "WorkerArena bound to cores");

    // Tile splits: the kernel over ragged ranges gives the bits of one whole range.
    for (const internal::KernelTable* k : internal::SupportedKernelTables()) {
      for (const int64_t tile : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{65537}}) {
        SCOPED_TRACE(fmt::format("{} tile {}", k->name, tile));
        Problem whole = init, split = init;
        constexpr int64_t m = 70001;  // a prefix keeps tile 1 quick
        const OptimStep st{.step = 2, .grad_scale = 0.5f};
        auto call = [&](Problem& pr, int64_t b, int64_t e) {
          const std::vector<float*> s = pr.state_ptrs();
          o.kernel(*k, st, pr.p.span().data(), s.data(), pr.grad().data, pr.g.dtype(),
                   pr.copy_out().data, pr.out_dtype, b, e);
        };
        call(whole, 0, m);
        for (int64_t b = 0; b < m; b += tile) call(split, b, std::min(m, b + tile));
        ExpectSameBits(split.p.span(), whole.p.span(), "master");
        for (int s = 0; s < o.num_states; ++s) {
          ExpectSameBits(split.s[s].span(), whole.s[s].span(), fmt::format("state {}", s));
        }
        EXPECT_EQ(split.out, whole.out);
      }
    }
    if (HasFailure()) return;
  }
}

// The loss-scaler protocol: the statistics pass flags inf/NaN, the caller skips
// the step, and the master weights stay untouched; a step taken anyway spreads
// NaN only to the elements whose gradient was not finite.
TEST(Optimizers, NonFiniteGradientIsFlaggedAndSkippedStepLeavesMasterUntouched) {
  std::mt19937 rng(16);
  constexpr int64_t n = 3 * internal::kOptimTileElems + 17;
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  for (const Optim& o : AllOptims()) {
    for (DType gd : dtypes) {
      SCOPED_TRACE(fmt::format("{} grad {}", o.name, DTypeLabel(gd)));
      Problem pr = MakeProblem(o, n, 0, gd, 2, rng, Mix::kFinite);
      pr.g.Set(5, std::numeric_limits<float>::quiet_NaN());
      pr.g.Set(n - 1, -std::numeric_limits<float>::infinity());
      Problem before = pr;
      const StatusOr<GradStats> stats = ComputeGradStats(pr.grad(), n, 1.0f / 512);
      ASSERT_TRUE(stats.ok());
      EXPECT_TRUE(stats->nonfinite);
      if (!stats->nonfinite) {
        ASSERT_TRUE(o.update(nullptr, {}, pr.p.span(), pr.states(), pr.grad(), pr.copy_out()).ok());
      }
      ExpectSameBits(before.p.span(), pr.p.span(), "skipped step");

      ASSERT_TRUE(o.update(nullptr, {}, pr.p.span(), pr.states(), pr.grad(), pr.copy_out()).ok());
      Problem ref = before;
      ASSERT_TRUE(o.reference({}, ref.p.span(), ref.states(), ref.grad(), ref.copy_out()).ok());
      ExpectSameBits(pr.p.span(), ref.p.span(), "step taken anyway");
      EXPECT_TRUE(std::isnan(pr.p[5]));
      EXPECT_TRUE(std::isfinite(pr.p[6]) || std::isinf(before.p[6]));
    }
  }
}

TEST(Optimizers, InvalidArgumentsAreRejectedAndNothingIsModified) {
  constexpr int64_t n = 64;
  std::vector<float> p(n, 1.0f), s(n, 0.5f), g(n, 1.0f), short_s(n - 1, 0.0f);
  const GradView grad{g.data(), DType::kF32};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    std::string name;
    Status prod, ref;
  };
  std::vector<Case> cases;
  auto adagrad = [&](std::string name, AdagradConfig c, OptimStep st, std::span<float> state,
                     CopyOut out = {}) {
    cases.push_back({"adagrad " + name, AdagradUpdate(c, st, p, state, grad, out),
                     AdagradUpdateReference(c, st, p, state, grad, out)});
  };
  auto lion = [&](std::string name, LionConfig c, OptimStep st, std::span<float> state) {
    cases.push_back({"lion " + name, LionUpdate(c, st, p, state, grad),
                     LionUpdateReference(c, st, p, state, grad)});
  };
  auto sgd = [&](std::string name, SgdConfig c, OptimStep st, std::span<float> state) {
    cases.push_back({"sgd " + name, SgdUpdate(c, st, p, state, grad),
                     SgdUpdateReference(c, st, p, state, grad)});
  };
  adagrad("lr < 0", {.lr = -1.0f}, {}, s);
  adagrad("lr_decay < 0", {.lr_decay = -1.0f}, {}, s);
  adagrad("weight_decay nan", {.weight_decay = nan}, {}, s);
  adagrad("initial_accumulator_value < 0", {.initial_accumulator_value = -1.0f}, {}, s);
  adagrad("eps < 0", {.eps = -1.0f}, {}, s);
  adagrad("step 0", {}, {.step = 0}, s);
  adagrad("grad_scale nan", {}, {.grad_scale = nan}, s);
  adagrad("state shorter", {}, {}, short_s);
  adagrad("state aliases master", {}, {}, p);
  adagrad("copy-out overlaps state", {}, {}, s, CopyOut{s.data() + 2, DType::kBF16});
  adagrad("bad copy-out dtype", {}, {}, s, CopyOut{short_s.data(), DType{5}});
  lion("lr nan", {.lr = nan}, {}, s);
  lion("beta1 > 1", {.beta1 = 1.5f}, {}, s);
  lion("beta2 < 0", {.beta2 = -0.1f}, {}, s);
  lion("weight_decay < 0", {.weight_decay = -0.1f}, {}, s);
  lion("null state", {}, {}, std::span<float>(static_cast<float*>(nullptr), n));
  sgd("momentum < 0", {.momentum = -0.9f}, {}, s);
  sgd("nesterov without momentum", {.nesterov = true}, {}, s);
  sgd("nesterov with dampening", {.momentum = 0.9f, .dampening = 0.1f, .nesterov = true}, {}, s);
  sgd("dampening inf", {.momentum = 0.9f, .dampening = std::numeric_limits<float>::infinity()}, {},
      s);
  sgd("momentum without buffer", {.momentum = 0.9f}, {}, {});
  sgd("lr < 0", {.lr = -1.0f}, {}, {});
  {
    AdamWConfig c;
    c.amsgrad = true;
    std::vector<float> v(n, 0.25f);
    cases.push_back({"adamw amsgrad max_exp_avg_sq missing", AdamWUpdate(c, {}, p, s, v, grad),
                     AdamWUpdateReference(c, {}, p, s, v, grad)});
    cases.push_back({"adamw max_exp_avg_sq aliases v", AdamWUpdate(c, {}, p, s, v, grad, {}, v),
                     AdamWUpdateReference(c, {}, p, s, v, grad, {}, v)});
  }
  for (const Case& c : cases) {
    EXPECT_EQ(c.prod.code(), StatusCode::kInvalidArgument) << c.name << ": " << c.prod.ToString();
    EXPECT_EQ(c.ref.code(), StatusCode::kInvalidArgument) << c.name << ": " << c.ref.ToString();
    EXPECT_FALSE(c.prod.message().empty()) << c.name;
  }
  EXPECT_TRUE(std::all_of(p.begin(), p.end(), [](float x) { return x == 1.0f; }));
  EXPECT_TRUE(std::all_of(s.begin(), s.end(), [](float x) { return x == 0.5f; }));

  // SGD without momentum needs no buffer; no elements is a no-op with null pointers.
  EXPECT_TRUE(SgdUpdate({}, {}, p, {}, grad).ok());
  EXPECT_TRUE(AdagradUpdate({}, {}, {}, {}, GradView{nullptr, DType::kBF16}).ok());
  EXPECT_TRUE(LionUpdateReference({}, {}, {}, {}, GradView{nullptr, DType::kF16}).ok());
}

}  // namespace
}  // namespace strata::cpu_optim
