// The scalar reference of AdamWUpdate: one element at a time, base/dtype.h
// conversions, the operation order documented in adamw.h.
#include <cmath>
#include <cstdint>

#include "cpu_optim/adamw.h"
#include "cpu_optim/kernels.h"

namespace strata::cpu_optim {

Status AdamWUpdateReference(const AdamWConfig& config, const OptimStep& step,
                            std::span<float> master, std::span<float> m, std::span<float> v,
                            GradView grad, CopyOut copy_out, std::span<float> max_exp_avg_sq) {
  using internal::WeightDecayMode;
  STRATA_RETURN_IF_ERROR(internal::ValidateAdamWParams(config, step));
  STRATA_RETURN_IF_ERROR(
      internal::ValidateAdamWBuffers(config, master, m, v, max_exp_avg_sq, grad, copy_out));
  const internal::AdamWScalars s = internal::PrepareAdamW(config, step);
  for (size_t i = 0; i < master.size(); ++i) {
    float g = internal::ReferenceLoad(grad, i) * s.grad_scale;
    float p = master[i];
    if (s.weight_decay_mode == WeightDecayMode::kL2) g = g + s.weight_decay * p;
    if (s.weight_decay_mode == WeightDecayMode::kDecoupled) p = p * s.decay;
    // torch.lerp(m, g, w), w = 1 - beta1.
    const float new_m =
        s.lerp_small ? m[i] + s.one_minus_beta1 * (g - m[i]) : g - (g - m[i]) * s.lerp_one_minus_w;
    const float new_v = s.beta2 * v[i] + (s.one_minus_beta2 * g) * g;
    float v_used = new_v;
    if (s.amsgrad) {
      // torch.maximum: NaN when either operand is NaN.
      const float old_max = max_exp_avg_sq[i];
      v_used = std::isnan(old_max)                      ? old_max
               : (std::isnan(new_v) || new_v > old_max) ? new_v
                                                        : old_max;
      max_exp_avg_sq[i] = v_used;
    }
    const float denom = std::sqrt(v_used) / s.bias_correction2_sqrt + s.eps;
    p = p - (s.step_size * new_m) / denom;
    master[i] = p;
    m[i] = new_m;
    v[i] = new_v;
    if (copy_out.data != nullptr) internal::ReferenceStore(copy_out, i, p);
  }
  return Status::Ok();
}

}  // namespace strata::cpu_optim
