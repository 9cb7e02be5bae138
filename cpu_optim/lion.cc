// LionUpdate (ISA variants over oneTBB tiles) and its scalar reference.
#include "cpu_optim/lion.h"

#include <cmath>

#include "cpu_optim/kernels.h"
#include "cpu_optim/parallel.h"

namespace strata::cpu_optim {
namespace internal {
namespace {

Status Validate(const LionConfig& config, const OptimStep& step, std::span<float> master,
                std::span<float> exp_avg, GradView grad, CopyOut copy_out) {
  STRATA_RETURN_IF_ERROR(ValidateLionParams(config, step));
  const NamedState states[] = {{exp_avg, "exp_avg"}};
  return ValidateBuffers("Lion", master, states, grad, copy_out);
}

// sign(c): +1, -1, +0 for +-0 (as torch.sign), NaN for NaN.
float Sign(float c) {
  if (std::isnan(c)) return c;
  return c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : 0.0f;
}

}  // namespace

Status LionUpdateWith(const KernelTable& kernels, const LionConfig& config, const OptimStep& step,
                      std::span<float> master, std::span<float> exp_avg, GradView grad,
                      CopyOut copy_out) {
  STRATA_RETURN_IF_ERROR(Validate(config, step, master, exp_avg, grad, copy_out));
  const LionScalars s = PrepareLion(config, step);
  const StateBuffers b{.master = master.data(),
                       .state = exp_avg.data(),
                       .grad = grad.data,
                       .grad_dtype = grad.dtype,
                       .out = copy_out.data,
                       .out_dtype = copy_out.dtype};
  return ParallelForTiles(static_cast<int64_t>(master.size()), kOptimTileElems,
                          [&](int64_t begin, int64_t end) { kernels.lion(s, b, begin, end); });
}

}  // namespace internal

Status LionUpdate(const LionConfig& config, const OptimStep& step, std::span<float> master,
                  std::span<float> exp_avg, GradView grad, CopyOut copy_out) {
  return internal::LionUpdateWith(internal::BestKernelTable(), config, step, master, exp_avg, grad,
                                  copy_out);
}

Status LionUpdateReference(const LionConfig& config, const OptimStep& step, std::span<float> master,
                           std::span<float> exp_avg, GradView grad, CopyOut copy_out) {
  STRATA_RETURN_IF_ERROR(internal::Validate(config, step, master, exp_avg, grad, copy_out));
  const internal::LionScalars s = internal::PrepareLion(config, step);
  for (size_t i = 0; i < master.size(); ++i) {
    const float g = internal::ReferenceLoad(grad, i) * s.grad_scale;
    float p = master[i];
    const float m = exp_avg[i];
    if (s.has_weight_decay) p = p * s.decay;
    const float c = s.beta1 * m + s.one_minus_beta1 * g;
    p = p - s.lr * internal::Sign(c);
    master[i] = p;
    exp_avg[i] = s.beta2 * m + s.one_minus_beta2 * g;
    if (copy_out.data != nullptr) internal::ReferenceStore(copy_out, i, p);
  }
  return Status::Ok();
}

}  // namespace strata::cpu_optim
