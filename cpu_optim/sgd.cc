// SgdUpdate (ISA variants over oneTBB tiles) and its scalar reference.
#include "cpu_optim/sgd.h"

#include "cpu_optim/kernels.h"
#include "cpu_optim/parallel.h"

namespace strata::cpu_optim {
namespace internal {
namespace {

Status Validate(const SgdConfig& config, const OptimStep& step, std::span<float> master,
                std::span<float> momentum_buffer, GradView grad, CopyOut copy_out) {
  STRATA_RETURN_IF_ERROR(ValidateSgdParams(config, step));
  const NamedState states[] = {{momentum_buffer, "momentum_buffer"}};
  return ValidateBuffers("SGD", master, std::span(states, config.momentum != 0.0f ? 1 : 0), grad,
                         copy_out);
}

}  // namespace

Status SgdUpdateWith(const KernelTable& kernels, const SgdConfig& config, const OptimStep& step,
                     std::span<float> master, std::span<float> momentum_buffer, GradView grad,
                     CopyOut copy_out) {
  STRATA_RETURN_IF_ERROR(Validate(config, step, master, momentum_buffer, grad, copy_out));
  const SgdScalars s = PrepareSgd(config, step);
  const StateBuffers b{
      .master = master.data(),
      .state = s.momentum_mode == SgdMomentumMode::kNone ? nullptr : momentum_buffer.data(),
      .grad = grad.data,
      .grad_dtype = grad.dtype,
      .out = copy_out.data,
      .out_dtype = copy_out.dtype};
  return ParallelForTiles(static_cast<int64_t>(master.size()), kOptimTileElems,
                          [&](int64_t begin, int64_t end) { kernels.sgd(s, b, begin, end); });
}

}  // namespace internal

Status SgdUpdate(const SgdConfig& config, const OptimStep& step, std::span<float> master,
                 std::span<float> momentum_buffer, GradView grad, CopyOut copy_out) {
  return internal::SgdUpdateWith(internal::BestKernelTable(), config, step, master, momentum_buffer,
                                 grad, copy_out);
}

Status SgdUpdateReference(const SgdConfig& config, const OptimStep& step, std::span<float> master,
                          std::span<float> momentum_buffer, GradView grad, CopyOut copy_out) {
  using internal::SgdMomentumMode;
  STRATA_RETURN_IF_ERROR(internal::Validate(config, step, master, momentum_buffer, grad, copy_out));
  const internal::SgdScalars s = internal::PrepareSgd(config, step);
  for (size_t i = 0; i < master.size(); ++i) {
    float g = internal::ReferenceLoad(grad, i) * s.grad_scale;
    float p = master[i];
    if (s.has_weight_decay) g = g + s.weight_decay * p;
    if (s.momentum_mode != SgdMomentumMode::kNone) {
      const float buf = s.momentum_mode == SgdMomentumMode::kInit
                            ? g
                            : s.momentum * momentum_buffer[i] + s.one_minus_dampening * g;
      momentum_buffer[i] = buf;
      g = s.nesterov ? g + s.momentum * buf : buf;
    }
    p = p - s.lr * g;
    master[i] = p;
    if (copy_out.data != nullptr) internal::ReferenceStore(copy_out, i, p);
  }
  return Status::Ok();
}

}  // namespace strata::cpu_optim
