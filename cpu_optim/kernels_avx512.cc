// The "avx512" kernel variant: kernels_impl.inc compiled for -mavx512f -mavx512bw -mavx512vl
// -mavx512dq (see CMakeLists.txt); run only where CPUID reports them.
#include "cpu_optim/kernels.h"

namespace strata::cpu_optim::internal {
namespace {
#include "cpu_optim/kernels_impl.inc"
}  // namespace

extern const KernelTable kAvx512Kernels;
constinit const KernelTable kAvx512Kernels = MakeKernelTable("avx512");

}  // namespace strata::cpu_optim::internal
