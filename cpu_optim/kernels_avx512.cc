// The "avx512" kernel variant: kernels_impl.inc compiled for -mavx512f -mavx512bw -mavx512vl
// -mavx512dq (see CMakeLists.txt); run only where CPUID reports them. Its fp16 conversions are
// AVX-512F's 512-bit vcvtph2ps/vcvtps2ph (kernels_impl.inc), so it needs no F16C.
#include "cpu_optim/kernels.h"

namespace strata::cpu_optim::internal {
namespace {
#include "cpu_optim/kernels_impl.inc"
}  // namespace

extern const KernelTable kAvx512Kernels;
constinit const KernelTable kAvx512Kernels = MakeKernelTable("avx512");

}  // namespace strata::cpu_optim::internal
