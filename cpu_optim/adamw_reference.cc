// The scalar reference of AdamWUpdate: one element at a time, base/dtype.h
// conversions, the operation order documented in adamw.h.
#include <cmath>
#include <cstdint>

#include "base/dtype.h"
#include "cpu_optim/adamw.h"
#include "cpu_optim/kernels.h"

namespace strata::cpu_optim {
namespace {

float LoadGrad(GradView grad, size_t i) {
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

void StoreOut(CopyOut out, size_t i, float p) {
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

}  // namespace

Status AdamWUpdateReference(const AdamWConfig& config, const AdamWStep& step,
                            std::span<float> master, std::span<float> m, std::span<float> v,
                            GradView grad, CopyOut copy_out) {
  using internal::WeightDecayMode;
  STRATA_RETURN_IF_ERROR(internal::ValidateAdamWParams(config, step));
  STRATA_RETURN_IF_ERROR(internal::ValidateAdamWBuffers(master, m, v, grad, copy_out));
  const internal::AdamWScalars s = internal::PrepareAdamW(config, step);
  for (size_t i = 0; i < master.size(); ++i) {
    float g = LoadGrad(grad, i) * s.grad_scale;
    float p = master[i];
    if (s.weight_decay_mode == WeightDecayMode::kL2) g = g + s.weight_decay * p;
    if (s.weight_decay_mode == WeightDecayMode::kDecoupled) p = p * s.decay;
    const float new_m = s.beta1 * m[i] + s.one_minus_beta1 * g;
    const float new_v = s.beta2 * v[i] + (s.one_minus_beta2 * g) * g;
    const float denom = std::sqrt(new_v) / s.bias_correction2_sqrt + s.eps;
    p = p - (s.step_size * new_m) / denom;
    master[i] = p;
    m[i] = new_m;
    v[i] = new_v;
    if (copy_out.data != nullptr) StoreOut(copy_out, i, p);
  }
  return Status::Ok();
}

}  // namespace strata::cpu_optim
