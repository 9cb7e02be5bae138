#include "cpu_optim/adamw.h"

#include "cpu_optim/kernels.h"
#include "cpu_optim/parallel.h"

namespace strata::cpu_optim {
namespace internal {

Status AdamWUpdateWith(const KernelTable& kernels, const AdamWConfig& config, const AdamWStep& step,
                       std::span<float> master, std::span<float> m, std::span<float> v,
                       GradView grad, CopyOut copy_out) {
  STRATA_RETURN_IF_ERROR(ValidateAdamWParams(config, step));
  STRATA_RETURN_IF_ERROR(ValidateAdamWBuffers(master, m, v, grad, copy_out));
  const AdamWScalars s = PrepareAdamW(config, step);
  const AdamWBuffers b{.master = master.data(),
                       .m = m.data(),
                       .v = v.data(),
                       .grad = grad.data,
                       .grad_dtype = grad.dtype,
                       .out = copy_out.data,
                       .out_dtype = copy_out.dtype};
  return ParallelForTiles(static_cast<int64_t>(master.size()), kAdamWTileElems,
                          [&](int64_t begin, int64_t end) { kernels.adamw(s, b, begin, end); });
}

}  // namespace internal

Status AdamWUpdate(const AdamWConfig& config, const AdamWStep& step, std::span<float> master,
                   std::span<float> m, std::span<float> v, GradView grad, CopyOut copy_out) {
  return internal::AdamWUpdateWith(internal::BestKernelTable(), config, step, master, m, v, grad,
                                   copy_out);
}

std::string_view ActiveKernelName() { return internal::BestKernelTable().name; }

}  // namespace strata::cpu_optim
