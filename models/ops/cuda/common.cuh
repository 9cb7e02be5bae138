// Device helpers shared by the CUDA ops of models/ops/cuda/ and the CUDA blocks of models/cuda/
// (internal: included only by .cu files).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <initializer_list>
#include <string>

#include "base/dtype.h"
#include "base/status.h"
#include "gpu/cuda/cuda_native.h"
#include "gpu/cuda/cuda_status.h"
#include "gpu/device.h"

namespace strata::models::ops::cuda::internal {

constexpr int kWarp = 32;
constexpr int64_t kMaxGrid = 65535;

inline int GridFor(int64_t n, int64_t per_block) {
  return static_cast<int>(std::clamp<int64_t>((n + per_block - 1) / per_block, 1, kMaxGrid));
}

// The check after each launch (gpu::cuda::LaunchStatus: a sticky fault found here is named as an
// earlier kernel's, not `kernel`'s).
inline Status Launched(const char* kernel) {
  return gpu::cuda::LaunchStatus(cudaGetLastError(), kernel);
}

// The checks every CUDA block call of models/cuda/ makes after its family's configuration check:
// B >= 1, 1 <= T <= max_seq_len and scratch 16-byte aligned (kInvalidArgument naming `what`);
// then the stream's cuBLAS handle (which makes the stream's device current; its errors). Returns
// the native stream.
inline StatusOr<cudaStream_t> PrepareBlockCall(const char* what, gpu::Stream& stream, int B, int T,
                                               int max_seq_len, const void* scratch) {
  if (B < 1 || T < 1 || T > max_seq_len) {
    return InvalidArgumentError(
        std::string(what) + ": need B >= 1 and 1 <= T <= max_seq_len, got B=" + std::to_string(B) +
        " T=" + std::to_string(T) + " max_seq_len=" + std::to_string(max_seq_len));
  }
  if (reinterpret_cast<uintptr_t>(scratch) % 16 != 0) {
    return InvalidArgumentError(std::string(what) + ": scratch must be 16-byte aligned");
  }
  STRATA_RETURN_IF_ERROR(gpu::CublasHandle(stream).status());
  return gpu::NativeStream(stream);
}

// A tied head (its weight the embedding chunk) needs tied_params and, backward, tied_grads.
inline Status CheckTied(const char* what, bool tied, const void* tied_params,
                        const void* tied_grads, bool backward) {
  if (tied && (tied_params == nullptr || (backward && tied_grads == nullptr))) {
    return InvalidArgumentError(std::string(what) +
                                ": a tied head needs the embedding chunk (and, backward, its "
                                "gradient)");
  }
  return Status::Ok();
}

inline Status CheckPointers(const char* op, std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs) {
    if (p == nullptr) {
      return InvalidArgumentError(std::string(op) + ": a required device pointer is null");
    }
  }
  return Status::Ok();
}

// The device type of host storage type S (same size and bits): float, __nv_bfloat16, __half.
template <typename S>
struct DeviceOf;
template <>
struct DeviceOf<float> {
  using type = float;
};
template <>
struct DeviceOf<Bf16> {
  using type = __nv_bfloat16;
};
template <>
struct DeviceOf<Fp16> {
  using type = __half;
};
template <typename S>
using Dev = typename DeviceOf<S>::type;
static_assert(sizeof(Dev<Bf16>) == sizeof(Bf16) && sizeof(Dev<Fp16>) == sizeof(Fp16));

// A host-typed device pointer as its device type.
template <typename S>
const Dev<S>* D(const S* p) {
  return reinterpret_cast<const Dev<S>*>(p);
}
template <typename S>
Dev<S>* D(S* p) {
  return reinterpret_cast<Dev<S>*>(p);
}

// The region r (a layout Region: offset in bytes) of a block's scratch, as T*.
template <typename T, typename Region>
T* At(void* scratch, const Region& r) {
  return reinterpret_cast<T*>(static_cast<char*>(scratch) + r.offset);
}

// rows >= 0 and a row width C >= 1.
inline Status CheckRows(const char* op, int64_t rows, int64_t C) {
  if (rows < 0 || C < 1) {
    return InvalidArgumentError(std::string(op) + ": need rows >= 0 and C >= 1");
  }
  return Status::Ok();
}

// Grid-stride loops: one warp per row (kWarp lanes each), one thread per index.
#define STRATA_FOR_EACH_WARP_ROW(row, rows)                                                  \
  for (int64_t row = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / kWarp; row < (rows); \
       row += int64_t{gridDim.x} * blockDim.x / kWarp)
#define STRATA_FOR_EACH_INDEX(i, n)                                         \
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

inline Status CheckSizes(const char* op, std::initializer_list<int64_t> sizes) {
  for (int64_t s : sizes) {
    if (s < 0) return InvalidArgumentError(std::string(op) + ": a size is negative");
  }
  return Status::Ok();
}

// fp32 <-> storage, round to nearest even.
__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename D>
__device__ __forceinline__ D FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromF<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
// x rounded to D and back (where the contract rounds a value that stays in registers).
template <typename D>
__device__ __forceinline__ float RoundTo(float x) {
  return ToF(FromF<D>(x));
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ void CheckTokenOnDevice(int32_t token, int V) {
  if (token < 0 || token >= V) __trap();
}

}  // namespace strata::models::ops::cuda::internal
