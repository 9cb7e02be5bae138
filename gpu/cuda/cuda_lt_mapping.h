// The argument choices of a cuBLASLt matrix product (gpu/cuda/cuda_lt_matmul.cc) for a
// row-major product with an epilogue. Plain C++ (no CUDA headers), so
// tests/models/gpt_cuda_layout_test.cc checks it on any machine against an emulation of
// cuBLASLt's documented column-major semantics.
//
// The row-major D(M, N) = op(A) op(B) (+ C) is the column-major D^T(N, M) = op(B)^T op(A)^T
// (+ C^T), exactly as gpu/cuda/cuda_gemm_mapping.h maps it: Lt's A is our B, Lt's B is our
// A, (m, n, k) = (N, M, K), leading dimensions unchanged. The epilogues then change names:
//   kBias         row-major: D[i][j] += bias[j], bias (N)    -> Lt BIAS (one value per row
//                 of the column-major D, m = N rows)
//   kGeluAuxBias  D = gelu(P + bias), aux = P + bias, aux row-major (M, N) with row stride
//                 aux_ld                                      -> Lt GELU_AUX_BIAS, AUX_LD = aux_ld
//   kDGelu        D = P * gelu'(aux)                          -> Lt DGELU, AUX_LD = aux_ld
//   kBiasGradB    bias_grad[j] = sum over the K rows of op(B) = B (trans_b false) of B[k][j]:
//                 the column sums of the row-major B          -> Lt BGRADA (Lt's A is our B; the
//                 reduction runs over Lt's k, giving m = N values)
// where P is the fp32 product (plus beta C when a residual C is given).
//
// Storage types: A and B are in the product's dtype; C and D too, or fp32 with fp32_output
// (16-bit A and B, fp32 C and D, fp32 compute and scale: the head's weight gradient
// accumulated over chunks with beta = 1 on an fp32 accumulator, C == D). fp32_output only with
// the plain epilogue (kNone).
#pragma once

#include <cstdint>

#include "base/dtype.h"
#include "gpu/cuda/cuda_gemm_mapping.h"

namespace strata::gpu::cuda {

// A row-major epilogue (what the model asks for).
enum class RowEpilogue : uint8_t { kNone, kBias, kGeluAuxBias, kDGelu, kBiasGradB };

// The cuBLASLt epilogue it becomes (values of cublasLtEpilogue_t, so cuda_lt_matmul.cc
// static_asserts them against cublasLt.h).
enum class LtEpilogue : uint32_t {
  kDefault = 1,        // CUBLASLT_EPILOGUE_DEFAULT
  kBias = 4,           // CUBLASLT_EPILOGUE_BIAS
  kGeluAuxBias = 164,  // CUBLASLT_EPILOGUE_GELU_AUX_BIAS (32 | 128 | 4)
  kDGelu = 192,        // CUBLASLT_EPILOGUE_DGELU (64 | 128)
  kBgradA = 256,       // CUBLASLT_EPILOGUE_BGRADA
};

struct LtMatmulMapping {
  ColumnMajorGemm gemm;  // transa/transb, m, n, k, lda, ldb, ldc (ldd = ldc)
  LtEpilogue epilogue = LtEpilogue::kDefault;
  int64_t aux_ld = 0;      // kGeluAuxBias, kDGelu: column-major leading dimension of aux
  int64_t vector_len = 0;  // bias or bias-gradient length (m); 0 without one
};

// kBiasGradB needs B untransposed (its rows are the reduced dimension); fp32_output needs
// kNone. Callers check LtMappingSupported first. Pure.
constexpr bool LtMappingSupported(RowEpilogue e, bool trans_b, bool fp32_output = false) {
  return (e != RowEpilogue::kBiasGradB || !trans_b) && (!fp32_output || e == RowEpilogue::kNone);
}

// The storage types of a product's operands (see above).
struct LtOperandTypes {
  DType a_b = DType::kF32;  // A and B (Lt's B and A)
  DType c_d = DType::kF32;  // C and D
};
constexpr LtOperandTypes LtTypesFor(DType dtype, bool fp32_output) {
  return {dtype, fp32_output ? DType::kF32 : dtype};
}

constexpr LtMatmulMapping RowMajorAsLt(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                                       int64_t lda, int64_t ldb, int64_t ldc, RowEpilogue e,
                                       int64_t aux_ld) {
  LtMatmulMapping m;
  m.gemm = RowMajorAsColumnMajor(trans_a, trans_b, M, N, K, lda, ldb, ldc);
  switch (e) {
    case RowEpilogue::kNone:
      m.epilogue = LtEpilogue::kDefault;
      break;
    case RowEpilogue::kBias:
      m.epilogue = LtEpilogue::kBias;
      m.vector_len = N;
      break;
    case RowEpilogue::kGeluAuxBias:
      m.epilogue = LtEpilogue::kGeluAuxBias;
      m.vector_len = N;
      m.aux_ld = aux_ld;
      break;
    case RowEpilogue::kDGelu:
      m.epilogue = LtEpilogue::kDGelu;
      m.aux_ld = aux_ld;
      break;
    case RowEpilogue::kBiasGradB:
      m.epilogue = LtEpilogue::kBgradA;
      m.vector_len = N;
      break;
  }
  return m;
}

// Largest power of two (<= 256) dividing an address: the alignment cuBLASLt's heuristic is
// told about (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES). 256 for null.
constexpr uint32_t LtAlignmentBytes(uintptr_t address) {
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

}  // namespace strata::gpu::cuda
