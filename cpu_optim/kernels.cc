// Variant selection by CPUID, argument checks and per-call scalars.
#include "cpu_optim/kernels.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <iterator>

#include "base/cpu_info.h"
#include "base/logging.h"

namespace strata::cpu_optim::internal {

extern const KernelTable kGenericKernels;
#if defined(STRATA_CPU_OPTIM_X86_VARIANTS)
extern const KernelTable kAvx2Kernels;
extern const KernelTable kAvx512Kernels;
#endif

namespace {

struct Supported {
  const KernelTable* tables[3] = {};
  size_t count = 0;
};

Supported Probe() {
  Supported s;
#if defined(STRATA_CPU_OPTIM_X86_VARIANTS)
  // CPUID and XGETBV (the OS saves the YMM/ZMM state): base/cpu_info.h. Not
  // __builtin_cpu_supports, which clang 14 cannot ask about F16C.
  const CpuIsa isa = DetectCpuIsa();
  if (isa.avx512f && isa.avx512bw && isa.avx512vl && isa.avx512dq) {
    s.tables[s.count++] = &kAvx512Kernels;
  }
  if (isa.avx2 && isa.f16c) s.tables[s.count++] = &kAvx2Kernels;
#endif
  s.tables[s.count++] = &kGenericKernels;
  return s;
}

const Supported& GetSupported() {
  static const Supported supported = [] {
    Supported s = Probe();
    STRATA_LOG_DEBUG("cpu_optim: kernel variant {}", s.tables[0]->name);
    return s;
  }();
  return supported;
}

bool Finite(float x) { return std::isfinite(x); }

}  // namespace

std::span<const KernelTable* const> SupportedKernelTables() {
  const Supported& s = GetSupported();
  return {s.tables, s.count};
}

const KernelTable& BestKernelTable() { return *GetSupported().tables[0]; }

const KernelTable* FindKernelTable(std::string_view name) {
  for (const KernelTable* t : SupportedKernelTables()) {
    if (name == t->name) return t;
  }
  return nullptr;
}

bool IsValidDType(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto ua = reinterpret_cast<uintptr_t>(a);
  const auto ub = reinterpret_cast<uintptr_t>(b);
  return ua < ub + b_bytes && ub < ua + a_bytes;
}

Status ValidateAdamWParams(const AdamWConfig& c, const OptimStep& step,
                           std::string_view optimizer) {
  if (!Finite(c.lr) || c.lr < 0.0f) {
    return InvalidArgumentError(
        fmt::format("{}: lr must be finite and >= 0, got {}", optimizer, c.lr));
  }
  if (!Finite(c.eps) || c.eps < 0.0f) {
    return InvalidArgumentError(
        fmt::format("{}: eps must be finite and >= 0, got {}", optimizer, c.eps));
  }
  if (!Finite(c.weight_decay) || c.weight_decay < 0.0f) {
    return InvalidArgumentError(
        fmt::format("{}: weight_decay must be finite and >= 0, got {}", optimizer, c.weight_decay));
  }
  if (!(c.beta1 >= 0.0f && c.beta1 < 1.0f) || !(c.beta2 >= 0.0f && c.beta2 < 1.0f)) {
    return InvalidArgumentError(
        fmt::format("{}: betas must lie in [0, 1), got ({}, {})", optimizer, c.beta1, c.beta2));
  }
  if (step.step < 1) {
    return InvalidArgumentError(fmt::format("{}: step must be >= 1, got {}", optimizer, step.step));
  }
  if (!Finite(step.grad_scale)) {
    return InvalidArgumentError(
        fmt::format("{}: grad_scale must be finite, got {}", optimizer, step.grad_scale));
  }
  return Status::Ok();
}

Status ValidateBuffers(std::string_view optimizer, std::span<float> master,
                       std::span<const NamedState> states, GradView grad, CopyOut copy_out) {
  const size_t n = master.size();
  for (const NamedState& st : states) {
    if (st.data.size() != n) {
      return InvalidArgumentError(fmt::format(
          "{}: {} has {} elements but master has {}; every state buffer needs num_elems elements",
          optimizer, st.name, st.data.size(), n));
    }
  }
  if (!IsValidDType(grad.dtype)) {
    return InvalidArgumentError(fmt::format("{}: unknown gradient dtype {} (use F32, F16 or BF16)",
                                            optimizer, static_cast<int>(grad.dtype)));
  }
  if (copy_out.data != nullptr && !IsValidDType(copy_out.dtype)) {
    return InvalidArgumentError(fmt::format("{}: unknown copy-out dtype {} (use F32, F16 or BF16)",
                                            optimizer, static_cast<int>(copy_out.dtype)));
  }
  if (n == 0) return Status::Ok();
  if (master.data() == nullptr || grad.data == nullptr) {
    return InvalidArgumentError(fmt::format("{}: null {} pointer with num_elems {}", optimizer,
                                            master.data() == nullptr ? "master" : "gradient", n));
  }
  struct Range {
    const void* p;
    size_t size_bytes;
    const char* name;
  };
  Range ranges[8];
  size_t count = 0;
  ranges[count++] = {master.data(), master.size_bytes(), "master"};
  for (const NamedState& st : states) {
    if (st.data.data() == nullptr) {
      return InvalidArgumentError(
          fmt::format("{}: null {} pointer with num_elems {}", optimizer, st.name, n));
    }
    if (count + 2 >= std::size(ranges)) return InternalError("ValidateBuffers: too many states");
    ranges[count++] = {st.data.data(), st.data.size_bytes(), st.name};
  }
  ranges[count++] = {grad.data, n * SizeOf(grad.dtype), "grad"};
  ranges[count++] = {copy_out.data, copy_out.data ? n * SizeOf(copy_out.dtype) : 0, "copy_out"};
  for (size_t i = 0; i < count; ++i) {
    for (size_t j = i + 1; j < count; ++j) {
      if (Overlaps(ranges[i].p, ranges[i].size_bytes, ranges[j].p, ranges[j].size_bytes)) {
        return InvalidArgumentError(fmt::format("{}: buffers {} and {} overlap", optimizer,
                                                ranges[i].name, ranges[j].name));
      }
    }
  }
  return Status::Ok();
}

Status ValidateAdamWBuffers(const AdamWConfig& config, std::span<float> master, std::span<float> m,
                            std::span<float> v, std::span<float> max_exp_avg_sq, GradView grad,
                            CopyOut copy_out) {
  const NamedState states[] = {{m, "m"}, {v, "v"}, {max_exp_avg_sq, "max_exp_avg_sq (amsgrad)"}};
  return ValidateBuffers("AdamW", master, std::span(states, config.amsgrad ? 3 : 2), grad,
                         copy_out);
}

AdamWScalars PrepareAdamW(const AdamWConfig& c, const OptimStep& step) {
  const double lr = c.lr, beta1 = c.beta1, beta2 = c.beta2, wd = c.weight_decay;
  AdamWScalars s{};
  s.beta1 = c.beta1;
  s.beta2 = c.beta2;
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = c.eps;
  s.grad_scale = c.maximize ? -step.grad_scale : step.grad_scale;
  s.lerp_small = s.one_minus_beta1 < 0.5f;
  s.lerp_one_minus_w = 1.0f - s.one_minus_beta1;  // fp32, as torch's lerp computes it
  s.amsgrad = c.amsgrad;
  if (c.bias_correction) {
    const double t = static_cast<double>(step.step);
    s.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, t)));
    s.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)));
  } else {
    s.step_size = c.lr;
    s.bias_correction2_sqrt = 1.0f;
  }
  s.weight_decay = c.weight_decay;
  s.decay = static_cast<float>(1.0 - lr * wd);
  s.weight_decay_mode = c.weight_decay == 0.0f     ? WeightDecayMode::kNone
                        : c.decoupled_weight_decay ? WeightDecayMode::kDecoupled
                                                   : WeightDecayMode::kL2;
  return s;
}

namespace {

// kInvalidArgument unless x is finite and >= 0.
Status CheckNonNegative(std::string_view optimizer, const char* name, float x) {
  if (Finite(x) && x >= 0.0f) return Status::Ok();
  return InvalidArgumentError(
      fmt::format("{}: {} must be finite and >= 0, got {}", optimizer, name, x));
}

Status CheckStep(std::string_view optimizer, const OptimStep& step) {
  if (step.step < 1) {
    return InvalidArgumentError(fmt::format("{}: step must be >= 1, got {}", optimizer, step.step));
  }
  if (!Finite(step.grad_scale)) {
    return InvalidArgumentError(
        fmt::format("{}: grad_scale must be finite, got {}", optimizer, step.grad_scale));
  }
  return Status::Ok();
}

}  // namespace

Status ValidateAdagradParams(const AdagradConfig& c, const OptimStep& step) {
  STRATA_RETURN_IF_ERROR(CheckNonNegative("Adagrad", "lr", c.lr));
  STRATA_RETURN_IF_ERROR(CheckNonNegative("Adagrad", "lr_decay", c.lr_decay));
  STRATA_RETURN_IF_ERROR(CheckNonNegative("Adagrad", "weight_decay", c.weight_decay));
  STRATA_RETURN_IF_ERROR(
      CheckNonNegative("Adagrad", "initial_accumulator_value", c.initial_accumulator_value));
  STRATA_RETURN_IF_ERROR(CheckNonNegative("Adagrad", "eps", c.eps));
  return CheckStep("Adagrad", step);
}

AdagradScalars PrepareAdagrad(const AdagradConfig& c, const OptimStep& step) {
  AdagradScalars s{};
  const double t = static_cast<double>(step.step);
  s.clr = static_cast<float>(static_cast<double>(c.lr) /
                             (1.0 + (t - 1.0) * static_cast<double>(c.lr_decay)));
  s.weight_decay = c.weight_decay;
  s.eps = c.eps;
  s.grad_scale = c.maximize ? -step.grad_scale : step.grad_scale;
  s.has_weight_decay = c.weight_decay != 0.0f;
  return s;
}

Status ValidateLionParams(const LionConfig& c, const OptimStep& step) {
  STRATA_RETURN_IF_ERROR(CheckNonNegative("Lion", "lr", c.lr));
  STRATA_RETURN_IF_ERROR(CheckNonNegative("Lion", "weight_decay", c.weight_decay));
  if (!(c.beta1 >= 0.0f && c.beta1 <= 1.0f) || !(c.beta2 >= 0.0f && c.beta2 <= 1.0f)) {
    return InvalidArgumentError(
        fmt::format("Lion: betas must lie in [0, 1], got ({}, {})", c.beta1, c.beta2));
  }
  return CheckStep("Lion", step);
}

LionScalars PrepareLion(const LionConfig& c, const OptimStep& step) {
  LionScalars s{};
  s.lr = c.lr;
  s.decay = static_cast<float>(1.0 - static_cast<double>(c.lr) * c.weight_decay);
  s.beta1 = c.beta1;
  s.beta2 = c.beta2;
  s.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(c.beta1));
  s.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(c.beta2));
  s.grad_scale = c.maximize ? -step.grad_scale : step.grad_scale;
  s.has_weight_decay = c.weight_decay != 0.0f;
  return s;
}

Status ValidateSgdParams(const SgdConfig& c, const OptimStep& step) {
  STRATA_RETURN_IF_ERROR(CheckNonNegative("SGD", "lr", c.lr));
  STRATA_RETURN_IF_ERROR(CheckNonNegative("SGD", "momentum", c.momentum));
  STRATA_RETURN_IF_ERROR(CheckNonNegative("SGD", "weight_decay", c.weight_decay));
  if (!Finite(c.dampening)) {
    return InvalidArgumentError(fmt::format("SGD: dampening must be finite, got {}", c.dampening));
  }
  if (c.nesterov && (c.momentum <= 0.0f || c.dampening != 0.0f)) {
    return InvalidArgumentError(fmt::format(
        "SGD: nesterov momentum requires momentum > 0 and dampening 0, got momentum {} and "
        "dampening {}",
        c.momentum, c.dampening));
  }
  return CheckStep("SGD", step);
}

SgdScalars PrepareSgd(const SgdConfig& c, const OptimStep& step) {
  SgdScalars s{};
  s.lr = c.lr;
  s.momentum = c.momentum;
  s.one_minus_dampening = static_cast<float>(1.0 - static_cast<double>(c.dampening));
  s.weight_decay = c.weight_decay;
  s.grad_scale = c.maximize ? -step.grad_scale : step.grad_scale;
  s.has_weight_decay = c.weight_decay != 0.0f;
  s.nesterov = c.nesterov;
  s.momentum_mode = c.momentum == 0.0f ? SgdMomentumMode::kNone
                    : step.step == 1   ? SgdMomentumMode::kInit
                                       : SgdMomentumMode::kUpdate;
  return s;
}

float ReferenceLoad(GradView grad, size_t i) {
  switch (grad.dtype) {
    case DType::kF32:
      return static_cast<const float*>(grad.data)[i];
    case DType::kF16:
      return HalfToFloat(static_cast<const uint16_t*>(grad.data)[i]);
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(grad.data)[i]);
  }
  return 0.0f;
}

void ReferenceStore(CopyOut out, size_t i, float p) {
  switch (out.dtype) {
    case DType::kF32:
      static_cast<float*>(out.data)[i] = p;
      return;
    case DType::kF16:
      static_cast<uint16_t*>(out.data)[i] = FloatToHalf(p);
      return;
    case DType::kBF16:
      static_cast<uint16_t*>(out.data)[i] = FloatToBf16(p);
      return;
  }
}

}  // namespace strata::cpu_optim::internal
