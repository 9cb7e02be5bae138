// CUDA runtime and cuBLAS return codes as strata::Status, at the edge of gpu/.
//
// Every CUDA or cuBLAS call in gpu/cuda/ goes through one of the macros below, so
// that a failure comes back as a Status naming the call and the error name
// (cudaGetErrorName / the cublasStatus_t enumerator), e.g.
//   "cudaMemcpyAsync(...) failed: cudaErrorInvalidValue (invalid argument)".
// Nothing here aborts or exits: the driver, the GPU's memory and the caller's
// arguments are the outside world.
//
// Status codes, chosen by what the caller should do:
//   cudaErrorMemoryAllocation, CUBLAS_STATUS_ALLOC_FAILED -> kResourceExhausted
//   cudaErrorInvalidValue and friends, CUBLAS_STATUS_INVALID_VALUE,
//     CUBLAS_STATUS_NOT_SUPPORTED                          -> kInvalidArgument
//   cudaErrorNoDevice, cudaErrorInsufficientDriver, other driver/device
//     availability errors, CUBLAS_STATUS_NOT_INITIALIZED   -> kUnavailable
//   everything else (kernel faults, ECC errors, ...)       -> kInternal
//
// Thread-safety: all functions are thread-safe.
#pragma once

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include "base/status.h"

namespace strata::gpu::cuda {

// OK for cudaSuccess; otherwise a Status "<call> failed: <name> (<description>)".
// Also clears the calling thread's last-error slot (cudaGetLastError) so that a
// handled error does not reappear at the next kernel-launch check.
Status CudaStatus(cudaError_t error, const char* call);

// Whether `error` is one of the faults of a running kernel that leave the CUDA context unusable
// (an illegal or misaligned address, an illegal instruction, a trap or assert, a stack overflow,
// a timeout, an uncorrectable ECC error: the CUDA Runtime API's "sticky" errors). Every later
// runtime call in the process returns the same error, whoever made it.
bool IsStickyKernelFault(cudaError_t error);

// The check after a kernel launch (cudaGetLastError()): OK for cudaSuccess. A launch error of its
// own (a bad configuration, too many resources) is CudaStatus's "<kernel> failed: ...". A sticky
// fault found at this launch was almost always an earlier kernel's (an asynchronous fault shows
// at the next call), so the message does not blame `kernel`: "<kernel> was not launched: an
// earlier kernel on this device faulted: <name> (<description>); rerun with
// CUDA_LAUNCH_BLOCKING=1 to stop at the kernel that faulted" (kInternal).
Status LaunchStatus(cudaError_t error, const char* kernel);

// OK for CUBLAS_STATUS_SUCCESS; otherwise "<call> failed: <CUBLAS_STATUS_...>".
Status CublasStatus(cublasStatus_t status, const char* call);

// "CUBLAS_STATUS_ALLOC_FAILED" etc.; "CUBLAS_STATUS_UNKNOWN" for codes it does not know.
const char* CublasStatusName(cublasStatus_t status);

}  // namespace strata::gpu::cuda

// Returns from the enclosing function (which returns Status or StatusOr<T>) when
// the CUDA runtime call `expr` does not return cudaSuccess.
#define STRATA_CUDA_RETURN_IF_ERROR(expr) \
  STRATA_RETURN_IF_ERROR(::strata::gpu::cuda::CudaStatus((expr), #expr))

// The same for a cuBLAS call.
#define STRATA_CUBLAS_RETURN_IF_ERROR(expr) \
  STRATA_RETURN_IF_ERROR(::strata::gpu::cuda::CublasStatus((expr), #expr))
