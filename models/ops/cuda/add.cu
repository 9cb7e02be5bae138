// The elementwise sum on CUDA (ops.cuh LaunchAdd; the host op ops/add.h): one thread per element
// (grid-stride), fp32 sum of the stored values, one rounding.
#include <cstdint>

#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::ops::cuda {
namespace {

using namespace internal;  // NOLINT: the shared device helpers

constexpr int kBlock = 256;

// out may equal a or b: element i is read and written by the same thread.
template <typename D>
__global__ void AddKernel(const D* a, const D* b, int64_t n, D* out) {
  STRATA_FOR_EACH_INDEX(i, n) { out[i] = FromF<D>(ToF(a[i]) + ToF(b[i])); }
}

}  // namespace

template <typename D>
Status LaunchAdd(cudaStream_t stream, const D* a, const D* b, int64_t n, D* out) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchAdd", {n}));
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchAdd", {a, b, out}));
  AddKernel<D><<<GridFor(n, kBlock), kBlock, 0, stream>>>(a, b, n, out);
  return Launched("AddKernel");
}

#define STRATA_INSTANTIATE_ADD(D) \
  template Status LaunchAdd<D>(cudaStream_t, const D*, const D*, int64_t, D*);
STRATA_INSTANTIATE_ADD(float)
STRATA_INSTANTIATE_ADD(__half)
STRATA_INSTANTIATE_ADD(__nv_bfloat16)
#undef STRATA_INSTANTIATE_ADD

}  // namespace strata::models::ops::cuda
