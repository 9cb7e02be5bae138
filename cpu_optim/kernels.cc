// Variant selection by CPUID, argument checks and per-call scalars.
#include "cpu_optim/kernels.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <iterator>

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
  // libgcc's probe also checks that the OS saves the YMM/ZMM state (XCR0).
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    s.tables[s.count++] = &kAvx512Kernels;
  }
  if (__builtin_cpu_supports("avx2")) s.tables[s.count++] = &kAvx2Kernels;
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

Status ValidateAdamWParams(const AdamWConfig& c, const AdamWStep& step) {
  if (!Finite(c.lr) || c.lr < 0.0f) {
    return InvalidArgumentError(fmt::format("AdamW: lr must be finite and >= 0, got {}", c.lr));
  }
  if (!Finite(c.eps) || c.eps < 0.0f) {
    return InvalidArgumentError(fmt::format("AdamW: eps must be finite and >= 0, got {}", c.eps));
  }
  if (!Finite(c.weight_decay) || c.weight_decay < 0.0f) {
    return InvalidArgumentError(
        fmt::format("AdamW: weight_decay must be finite and >= 0, got {}", c.weight_decay));
  }
  if (!(c.beta1 >= 0.0f && c.beta1 < 1.0f) || !(c.beta2 >= 0.0f && c.beta2 < 1.0f)) {
    return InvalidArgumentError(
        fmt::format("AdamW: betas must lie in [0, 1), got ({}, {})", c.beta1, c.beta2));
  }
  if (step.step < 1) {
    return InvalidArgumentError(fmt::format("AdamW: step must be >= 1, got {}", step.step));
  }
  if (!Finite(step.grad_scale)) {
    return InvalidArgumentError(
        fmt::format("AdamW: grad_scale must be finite, got {}", step.grad_scale));
  }
  return Status::Ok();
}

Status ValidateAdamWBuffers(std::span<float> master, std::span<float> m, std::span<float> v,
                            GradView grad, CopyOut copy_out) {
  const size_t n = master.size();
  if (m.size() != n || v.size() != n) {
    return InvalidArgumentError(
        fmt::format("AdamW: master, m and v must have the same num_elems, got {}, {} and {}", n,
                    m.size(), v.size()));
  }
  if (!IsValidDType(grad.dtype)) {
    return InvalidArgumentError(
        fmt::format("AdamW: unknown gradient dtype {}", static_cast<int>(grad.dtype)));
  }
  if (copy_out.data != nullptr && !IsValidDType(copy_out.dtype)) {
    return InvalidArgumentError(
        fmt::format("AdamW: unknown copy-out dtype {}", static_cast<int>(copy_out.dtype)));
  }
  if (n == 0) return Status::Ok();
  if (master.data() == nullptr || m.data() == nullptr || v.data() == nullptr ||
      grad.data == nullptr) {
    return InvalidArgumentError(
        fmt::format("AdamW: null master, m, v or gradient pointer with num_elems {}", n));
  }
  struct Range {
    const void* p;
    size_t size_bytes;
    const char* name;
  };
  const Range ranges[] = {
      {master.data(), master.size_bytes(), "master"},
      {m.data(), m.size_bytes(), "m"},
      {v.data(), v.size_bytes(), "v"},
      {grad.data, n * SizeOf(grad.dtype), "grad"},
      {copy_out.data, copy_out.data ? n * SizeOf(copy_out.dtype) : 0, "copy_out"},
  };
  for (size_t i = 0; i < std::size(ranges); ++i) {
    for (size_t j = i + 1; j < std::size(ranges); ++j) {
      if (Overlaps(ranges[i].p, ranges[i].size_bytes, ranges[j].p, ranges[j].size_bytes)) {
        return InvalidArgumentError(
            fmt::format("AdamW: buffers {} and {} overlap", ranges[i].name, ranges[j].name));
      }
    }
  }
  return Status::Ok();
}

AdamWScalars PrepareAdamW(const AdamWConfig& c, const AdamWStep& step) {
  const double lr = c.lr, beta1 = c.beta1, beta2 = c.beta2, wd = c.weight_decay;
  AdamWScalars s{};
  s.beta1 = c.beta1;
  s.beta2 = c.beta2;
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = c.eps;
  s.grad_scale = step.grad_scale;
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

}  // namespace strata::cpu_optim::internal
