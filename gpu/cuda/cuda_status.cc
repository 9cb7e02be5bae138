#include "gpu/cuda/cuda_status.h"

#include <fmt/format.h>

#include "gpu/cuda/cublas_loader.h"

namespace strata::gpu::cuda {
namespace {

Status MakeStatus(StatusCode code, std::string message) {
  switch (code) {
    case StatusCode::kResourceExhausted:
      return ResourceExhaustedError(std::move(message));
    case StatusCode::kInvalidArgument:
      return InvalidArgumentError(std::move(message));
    case StatusCode::kUnavailable:
      return UnavailableError(std::move(message));
    default:
      return InternalError(std::move(message));
  }
}

StatusCode CudaCode(cudaError_t error) {
  switch (error) {
    case cudaErrorMemoryAllocation:
      return StatusCode::kResourceExhausted;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidPitchValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevice:
      return StatusCode::kInvalidArgument;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorNoKernelImageForDevice:
      return StatusCode::kUnavailable;
    default:
      return StatusCode::kInternal;
  }
}

}  // namespace

Status CudaStatus(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // consumed here; sticky (context-wide) errors stay sticky in the driver
  return MakeStatus(
      CudaCode(error),
      fmt::format("{} failed: {} ({})", call, cudaGetErrorName(error), cudaGetErrorString(error)));
}

bool IsStickyKernelFault(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorIllegalInstruction:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

Status LaunchStatus(cudaError_t error, const char* kernel) {
  if (!IsStickyKernelFault(error)) return CudaStatus(error, kernel);
  cudaGetLastError();
  return InternalError(fmt::format(
      "{} was not launched: an earlier kernel on this device faulted: {} ({}); rerun with "
      "CUDA_LAUNCH_BLOCKING=1 to stop at the kernel that faulted",
      kernel, cudaGetErrorName(error), cudaGetErrorString(error)));
}

const char* CublasStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

Status CublasStatus(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  StatusCode code = StatusCode::kInternal;
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      code = StatusCode::kResourceExhausted;
      break;
    case CUBLAS_STATUS_INVALID_VALUE:
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      code = StatusCode::kInvalidArgument;
      break;
    case CUBLAS_STATUS_NOT_INITIALIZED:
      code = StatusCode::kUnavailable;
      break;
    default:
      break;
  }
  // cuBLAS is loaded when one of its calls returned `status`; the description is left out
  // only for a status that came from elsewhere while the library cannot be loaded.
  const StatusOr<const CublasApi*> blas = Cublas();
  if (!blas.ok())
    return MakeStatus(code, fmt::format("{} failed: {}", call, CublasStatusName(status)));
  return MakeStatus(code, fmt::format("{} failed: {} ({})", call, CublasStatusName(status),
                                      (*blas)->GetStatusString(status)));
}

}  // namespace strata::gpu::cuda
