#include "cpu_optim/adamw.h"

#include "cpu_optim/kernels.h"
#include "cpu_optim/parallel.h"

namespace strata::cpu_optim {
namespace internal {

Status AdamWUpdateWith(const KernelTable& kernels, const AdamWConfig& config, const OptimStep& step,
                       std::span<float> master, std::span<float> m, std::span<float> v,
                       GradView grad, CopyOut copy_out, std::span<float> max_exp_avg_sq) {
  STRATA_RETURN_IF_ERROR(ValidateAdamWParams(config, step));
  STRATA_RETURN_IF_ERROR(
      ValidateAdamWBuffers(config, master, m, v, max_exp_avg_sq, grad, copy_out));
  const AdamWScalars s = PrepareAdamW(config, step);
  const AdamWBuffers b{.master = master.data(),
                       .m = m.data(),
                       .v = v.data(),
                       .grad = grad.data,
                       .grad_dtype = grad.dtype,
                       .out = copy_out.data,
                       .out_dtype = copy_out.dtype,
                       .max_v = config.amsgrad ? max_exp_avg_sq.data() : nullptr};
  return ParallelForTiles(static_cast<int64_t>(master.size()), kOptimTileElems,
                          [&](int64_t begin, int64_t end) { kernels.adamw(s, b, begin, end); });
}

}  // namespace internal

Status AdamWUpdate(const AdamWConfig& config, const OptimStep& step, std::span<float> master,
                   std::span<float> m, std::span<float> v, GradView grad, CopyOut copy_out,
                   std::span<float> max_exp_avg_sq) {
  return internal::AdamWUpdateWith(internal::BestKernelTable(), config, step, master, m, v, grad,
                                   copy_out, max_exp_avg_sq);
}

std::string_view ActiveKernelName() { return internal::BestKernelTable().name; }

}  // namespace strata::cpu_optim
