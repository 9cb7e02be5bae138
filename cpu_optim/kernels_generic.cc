// The "generic" kernel variant: kernels_impl.inc compiled for the build's baseline ISA (x86-64:
// SSE2), no extra flags.
#include "cpu_optim/kernels.h"

namespace strata::cpu_optim::internal {
namespace {
#include "cpu_optim/kernels_impl.inc"
}  // namespace

extern const KernelTable kGenericKernels;
constinit const KernelTable kGenericKernels = MakeKernelTable("generic");

}  // namespace strata::cpu_optim::internal
