// AdagradUpdate (ISA variants over oneTBB tiles) and its scalar reference.
#include "cpu_optim/adagrad.h"

#include <cmath>

#include "cpu_optim/kernels.h"
#include "cpu_optim/parallel.h"

namespace strata::cpu_optim {
namespace internal {
namespace {

Status Validate(const AdagradConfig& config, const OptimStep& step, std::span<float> master,
                std::span<float> state_sum, GradView grad, CopyOut copy_out) {
  STRATA_RETURN_IF_ERROR(ValidateAdagradParams(config, step));
  const NamedState states[] = {{state_sum, "state_sum"}};
  return ValidateBuffers("Adagrad", master, states, grad, copy_out);
}

}  // namespace

Status AdagradUpdateWith(const KernelTable& kernels, const AdagradConfig& config,
                         const OptimStep& step, std::span<float> master, std::span<float> state_sum,
                         GradView grad, CopyOut copy_out) {
  STRATA_RETURN_IF_ERROR(Validate(config, step, master, state_sum, grad, copy_out));
  const AdagradScalars s = PrepareAdagrad(config, step);
  const StateBuffers b{.master = master.data(),
                       .state = state_sum.data(),
                       .grad = grad.data,
                       .grad_dtype = grad.dtype,
                       .out = copy_out.data,
                       .out_dtype = copy_out.dtype};
  return ParallelForTiles(static_cast<int64_t>(master.size()), kOptimTileElems,
                          [&](int64_t begin, int64_t end) { kernels.adagrad(s, b, begin, end); });
}

}  // namespace internal

Status AdagradUpdate(const AdagradConfig& config, const OptimStep& step, std::span<float> master,
                     std::span<float> state_sum, GradView grad, CopyOut copy_out) {
  return internal::AdagradUpdateWith(internal::BestKernelTable(), config, step, master, state_sum,
                                     grad, copy_out);
}

Status AdagradUpdateReference(const AdagradConfig& config, const OptimStep& step,
                              std::span<float> master, std::span<float> state_sum, GradView grad,
                              CopyOut copy_out) {
  STRATA_RETURN_IF_ERROR(internal::Validate(config, step, master, state_sum, grad, copy_out));
  const internal::AdagradScalars s = internal::PrepareAdagrad(config, step);
  for (size_t i = 0; i < master.size(); ++i) {
    float g = internal::ReferenceLoad(grad, i) * s.grad_scale;
    float p = master[i];
    if (s.has_weight_decay) g = g + s.weight_decay * p;
    const float sum = state_sum[i] + g * g;
    const float std_dev = std::sqrt(sum) + s.eps;
    p = p - (s.clr * g) / std_dev;
    master[i] = p;
    state_sum[i] = sum;
    if (copy_out.data != nullptr) internal::ReferenceStore(copy_out, i, p);
  }
  return Status::Ok();
}

}  // namespace strata::cpu_optim
