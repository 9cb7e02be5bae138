// The "avx2" kernel variant: kernels_impl.inc compiled for -mavx2 -mf16c, no FMA (see
// CMakeLists.txt); run only where CPUID reports AVX2 and F16C.
#include "cpu_optim/kernels.h"

namespace strata::cpu_optim::internal {
namespace {
#include "cpu_optim/kernels_impl.inc"
}  // namespace

extern const KernelTable kAvx2Kernels;
constinit const KernelTable kAvx2Kernels = MakeKernelTable("avx2");

}  // namespace strata::cpu_optim::internal
