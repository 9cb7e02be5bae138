// The native CUDA handles behind a gpu::Stream of the CUDA backend, for code that
// launches its own kernels or cuBLAS calls (models/, gpu/cuda/cuda_gemm).
//
// Work launched on NativeStream(s) is ordered with the Stream's own copies,
// conversions, host functions and event records, exactly as if the Stream had
// enqueued it. Both handles are owned by the Stream and live as long as it does;
// do not destroy them and do not rebind the cuBLAS handle to another stream.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "base/status.h"
#include "gpu/device.h"

namespace strata::gpu {

// The stream's cudaStream_t. STRATA_CHECKs that `stream` comes from a CUDA device
// (passing a host-backend stream is a programming error). Thread-safe.
cudaStream_t NativeStream(Stream& stream);

// The stream's cuBLAS handle, created on first use and bound to NativeStream(stream)
// (cublasSetStream) with a 32 MiB workspace owned by the stream (cublasSetWorkspace),
// so cuBLAS allocates nothing during a step. Pointer mode host (alpha and beta are
// host scalars); math mode CUBLAS_DEFAULT_MATH (no TF32 unless a GEMM option asks).
// The first handle of the process loads cuBLAS (gpu/cuda/cublas_loader.h); a missing
// libcublas is kUnavailable, naming the library. Errors of cublasCreate or of the
// workspace cudaMalloc come back as Status (the first call may fail with
// kResourceExhausted; the next call retries). Each call also makes
// the stream's device current on the calling thread. STRATA_CHECKs as
// NativeStream does. Thread-safe; calls on one handle must still come from one thread
// at a time (cuBLAS rule), which "one thread per stream" gives.
StatusOr<cublasHandle_t> CublasHandle(Stream& stream);

// The stream's cuBLAS workspace (the 32 MiB of CublasHandle, created with the handle if it does
// not exist yet): device memory owned by the stream, for cuBLASLt products enqueued on the same
// stream (they run in stream order with the handle's own calls, so sharing it is safe). Not part
// of the device arena, like the handle. Errors and thread-safety as CublasHandle's.
StatusOr<DeviceSpan> CublasWorkspace(Stream& stream);

}  // namespace strata::gpu
