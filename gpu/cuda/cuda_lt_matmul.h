// Row-major matrix products through cuBLASLt (cublasLtMatmul) with fused epilogues, for the
// model kernels of models/cuda/.
//
//   D(M, N) = epilogue(op(A) op(B) + (C ? C : 0))
// op(A) is (M, K) (A stored (K, M) when trans_a), op(B) is (K, N); C, when given, is the
// residual (beta = 1) with the same shape as D and row stride ldc (C may equal D). A, B, C, D
// and bias / bias_grad / aux all have dtype `dtype` (fp32, fp16 or bf16) — except C and D
// with fp32_output, which are fp32 (16-bit A and B accumulated into an fp32 D; epilogue kNone
// only; cuda_lt_mapping.h); products
// accumulate in fp32 (CUBLAS_COMPUTE_32F; CUBLAS_COMPUTE_32F_FAST_TF32 for fp32 inputs when
// allow_tf32) and each output is rounded once. Epilogues (gpu/cuda/cuda_lt_mapping.h):
// kBias (bias (N)), kGeluAuxBias (D = gelu(P + bias), aux (M, N) row stride aux_ld gets
// P + bias; aux_ld % 8 == 0), kDGelu (D = P gelu'(aux)), kBiasGradB (bias_grad (N) = column
// sums of B; needs trans_b false).
//
// The algorithm is cuBLASLt's heuristic choice for the problem (shape, dtypes, epilogue,
// pointer alignments), asked once per problem and kept in a process-wide cache (a mutex;
// nothing on the device is allocated: the workspace is the caller's). Same problem, same
// algorithm, same workspace size: bit-identical results from run to run.
//
// Errors: kInvalidArgument for sizes, strides or pointers cuBLASLt would reject (checked
// before anything is enqueued); kUnimplemented when cuBLASLt has no algorithm for the
// problem (callers may then take an unfused path); kUnavailable when libcublasLt cannot be
// loaded; cuBLAS errors as Status. The work is enqueued on `stream`; the caller makes its
// device current. Thread-safe (the Lt handle is per device; calls on one stream from one
// thread at a time).
#pragma once

#include <cuda_runtime_api.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>

#include "base/dtype.h"
#include "base/status.h"
#include "gpu/cuda/cuda_lt_mapping.h"

namespace strata::gpu::cuda {

// The cudaDataType of a DType (CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF), for cuBLAS and cuBLASLt.
cudaDataType_t CudaDataType(DType t);

struct LtMatmulArgs {
  bool trans_a = false, trans_b = false;
  int64_t M = 0, N = 0, K = 0;
  const void* A = nullptr;
  int64_t lda = 0;
  const void* B = nullptr;
  int64_t ldb = 0;
  const void* C = nullptr;  // residual, or null (beta 0)
  int64_t ldc = 0;
  void* D = nullptr;
  int64_t ldd = 0;
  DType dtype = DType::kF32;
  bool fp32_output = false;  // C and D fp32 whatever dtype is (epilogue kNone)
  RowEpilogue epilogue = RowEpilogue::kNone;
  const void* bias = nullptr;  // kBias, kGeluAuxBias: (N)
  void* bias_grad = nullptr;   // kBiasGradB: (N), written
  void* aux = nullptr;         // kGeluAuxBias: written; kDGelu: read
  int64_t aux_ld = 0;
  bool allow_tf32 = false;
};

// Makes sure cuBLASLt is loaded and the current device has its Lt handle (call once before
// a step: it allocates host state). kUnavailable when libcublasLt is absent.
Status PrepareLtForCurrentDevice();

// Enqueues the product on `stream`. workspace: device memory of workspace_bytes (16-byte
// aligned; 0 bytes allowed, fewer algorithms then), used only by this call.
Status LtMatmul(cudaStream_t stream, const LtMatmulArgs& args, void* workspace,
                size_t workspace_bytes);

}  // namespace strata::gpu::cuda
