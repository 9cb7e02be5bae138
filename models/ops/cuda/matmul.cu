// Matrix products of a linear layer through cuBLASLt (ops.cuh Products): the one wrapper every
// family's CUDA blocks call, for both weight layouts.
#include <algorithm>

#include "base/dtype.h"
#include "gpu/cuda/cuda_lt_matmul.h"
#include "gpu/cuda/cuda_native.h"
#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::ops::cuda {

using gpu::cuda::RowEpilogue;
using internal::D;

Status PrepareStream(gpu::Stream& stream) {
  STRATA_RETURN_IF_ERROR(gpu::CublasHandle(stream).status());  // makes the device current
  return gpu::cuda::PrepareLtForCurrentDevice();
}

template <typename S>
StatusOr<Products<S>> Products<S>::Make(gpu::Stream& stream, cudaStream_t cs, bool allow_tf32,
                                        float* partials) {
  STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan workspace, gpu::CublasWorkspace(stream));
  return Products<S>{cs, workspace, allow_tf32, partials};
}

namespace {

gpu::cuda::LtMatmulArgs ProductArgs(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                                    const void* A, int64_t lda, const void* B, int64_t ldb,
                                    void* out, int64_t ldd, DType dtype, bool allow_tf32) {
  gpu::cuda::LtMatmulArgs a;
  a.trans_a = trans_a;
  a.trans_b = trans_b;
  a.M = M;
  a.N = N;
  a.K = K;
  a.A = A;
  a.lda = lda;
  a.B = B;
  a.ldb = ldb;
  a.ldc = ldd;
  a.D = out;
  a.ldd = ldd;
  a.dtype = dtype;
  a.allow_tf32 = allow_tf32;
  return a;
}

}  // namespace

template <typename S>
Status Products<S>::Run(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const S* A,
                        int64_t lda, const S* B, int64_t ldb, S* out, int64_t ldd,
                        RowEpilogue epilogue, const S* bias, const S* residual, S* aux,
                        int64_t aux_ld, S* bias_grad) const {
  gpu::cuda::LtMatmulArgs a =
      ProductArgs(trans_a, trans_b, M, N, K, A, lda, B, ldb, out, ldd, DTypeOf<S>(), allow_tf32);
  a.C = residual;
  a.epilogue = epilogue;
  a.bias = bias;
  a.bias_grad = bias_grad;
  a.aux = aux;
  a.aux_ld = aux_ld;
  return gpu::cuda::LtMatmul(stream, a, workspace.data, workspace.size_bytes);
}

template <typename S>
Status Products<S>::Forward(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* x,
                            const S* W, const S* b, const S* residual, S* y) const {
  const RowEpilogue epilogue = b != nullptr ? RowEpilogue::kBias : RowEpilogue::kNone;
  if (layout == WeightLayout::kInOut) {
    return Run(false, false, rows, out, in, x, in, W, out, y, out, epilogue, b, residual);
  }
  return Run(false, true, rows, out, in, x, in, W, in, y, out, epilogue, b, residual);
}

template <typename S>
Status Products<S>::InputGrad(WeightLayout layout, int64_t rows, int64_t in, int64_t out,
                              const S* dy, const S* W, S* dx) const {
  if (layout == WeightLayout::kInOut)
    return Run(false, true, rows, in, out, dy, out, W, out, dx, in);
  return Run(false, false, rows, in, out, dy, out, W, in, dx, in);
}

template <typename S>
Status Products<S>::GeluInputGrad(WeightLayout layout, int64_t rows, int64_t in, int64_t out,
                                  const S* dy, const S* W, const S* pre, float* acc,
                                  int64_t acc_rows, S* dpre) const {
  if (acc_rows < 1) return InvalidArgumentError("Products::GeluInputGrad: need acc_rows >= 1");
  const bool in_out = layout == WeightLayout::kInOut;
  for (int64_t r0 = 0; r0 < rows; r0 += acc_rows) {
    const int64_t m = std::min(acc_rows, rows - r0);
    gpu::cuda::LtMatmulArgs a = ProductArgs(false, in_out, m, in, out, dy + r0 * out, out, W,
                                            in_out ? out : in, acc, in, DTypeOf<S>(), allow_tf32);
    a.fp32_output = true;
    STRATA_RETURN_IF_ERROR(gpu::cuda::LtMatmul(stream, a, workspace.data, workspace.size_bytes));
    STRATA_RETURN_IF_ERROR(
        LaunchTimesGeluGrad(stream, acc, D(pre + r0 * in), m * in, D(dpre + r0 * in)));
  }
  return Status::Ok();
}

template <typename S>
Status Products<S>::WeightGrad(WeightLayout layout, int64_t rows, int64_t in, int64_t out,
                               const S* x, const S* dy, S* dW, S* db) const {
  if (layout == WeightLayout::kOutIn) {
    // (out, in) weights (Qwen2's q/k/v biases): the product, then the column sums of dy.
    STRATA_RETURN_IF_ERROR(Run(true, false, out, in, rows, dy, out, x, in, dW, in));
    if (db == nullptr) return Status::Ok();
    return LaunchColumnSums(stream, D(dy), rows, out, partials, D(db));
  }
  if (db == nullptr) return Run(true, false, in, out, rows, x, in, dy, out, dW, out);
  const Status fused = Run(true, false, in, out, rows, x, in, dy, out, dW, out,
                           RowEpilogue::kBiasGradB, nullptr, nullptr, nullptr, 0, db);
  if (fused.code() != StatusCode::kUnimplemented) return fused;
  STRATA_RETURN_IF_ERROR(Run(true, false, in, out, rows, x, in, dy, out, dW, out));
  return LaunchColumnSums(stream, D(dy), rows, out, partials, D(db));
}

template struct Products<float>;
template struct Products<Bf16>;
template struct Products<Fp16>;

}  // namespace strata::models::ops::cuda
