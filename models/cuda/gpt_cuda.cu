// The GPT's blocks on CUDA (gpt_cuda.h): each a list of op calls (gpt_cuda.cuh) and cuBLASLt
// products (gpu/cuda/cuda_lt_matmul.h) over all N = B T rows at once, with the rounding
// points of models/gpt_kernels.h and the scratch layout of gpt_cuda_layout.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "base/dtype.h"
#include "gpu/cuda/cuda_kernels.cuh"
#include "gpu/cuda/cuda_lt_matmul.h"
#include "gpu/cuda/cuda_native.h"
#include "gpu/cuda/cuda_status.h"
#include "models/cuda/gpt_cuda.cuh"
#include "models/cuda/gpt_cuda.h"
#include "models/cuda/gpt_cuda_common.cuh"
#include "models/cuda/gpt_cuda_layout.h"
#include "models/gpt_layout.h"

namespace strata::models::cuda {
namespace {

using gpu::cuda::RowEpilogue;

using internal::At;
using internal::CheckPointers;
using internal::D;
using internal::Dev;

StatusOr<cudaStream_t> Prepare(const char* what, const GptShape& s, gpu::Stream& stream, int B,
                               int T, const void* scratch) {
  STRATA_RETURN_IF_ERROR(ValidateShape(s));
  if (B < 1 || T < 1 || T > s.max_seq_len) {
    return InvalidArgumentError(
        std::string(what) + ": need B >= 1 and 1 <= T <= max_seq_len, got B=" + std::to_string(B) +
        " T=" + std::to_string(T) + " max_seq_len=" + std::to_string(s.max_seq_len));
  }
  if (reinterpret_cast<uintptr_t>(scratch) % 16 != 0) {
    return InvalidArgumentError(std::string(what) + ": scratch must be 16-byte aligned");
  }
  STRATA_RETURN_IF_ERROR(gpu::CublasHandle(stream).status());  // also cudaSetDevice
  return gpu::NativeStream(stream);
}

// The products of one block call: stream, workspace, dtype and the TF32 choice.
template <typename S>
struct Products {
  cudaStream_t stream;
  gpu::DeviceSpan workspace;  // the stream's cuBLAS workspace (gpu::CublasWorkspace)
  bool allow_tf32;
  float* partials;  // (LnPartials(N), >= cols) fp32, for the unfused bias-gradient path

  // D(M, N) = epilogue(op(A) op(B) (+ residual)), row-major (cuda_lt_matmul.h).
  Status Run(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const S* A, int64_t lda,
             const S* B, int64_t ldb, S* out, int64_t ldd,
             RowEpilogue epilogue = RowEpilogue::kNone, const S* bias = nullptr,
             const S* residual = nullptr, S* aux = nullptr, int64_t aux_ld = 0,
             S* bias_grad = nullptr) const {
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
    a.C = residual;
    a.ldc = ldd;
    a.D = out;
    a.ldd = ldd;
    a.dtype = DTypeOf<S>();
    a.epilogue = epilogue;
    a.bias = bias;
    a.bias_grad = bias_grad;
    a.aux = aux;
    a.aux_ld = aux_ld;
    a.allow_tf32 = allow_tf32;
    return gpu::cuda::LtMatmul(stream, a, workspace.data, workspace.size_bytes);
  }

  // y = D(x W + b (+ residual)): x (rows, in), W (in, out), y (rows, out).
  Status Linear(int64_t rows, int64_t in, int64_t out, const S* x, const S* W, const S* b,
                const S* residual, S* y) const {
    return Run(false, false, rows, out, in, x, in, W, out, y, out, RowEpilogue::kBias, b, residual);
  }

  // dx = D(dy W^T): dy (rows, out), W (in, out), dx (rows, in).
  Status InputGrad(int64_t rows, int64_t in, int64_t out, const S* dy, const S* W, S* dx) const {
    return Run(false, true, rows, in, out, dy, out, W, out, dx, in);
  }

  // dW = D(x^T dy) and (db non-null) db = D(column sums of dy), through the bias-gradient
  // epilogue where cuBLASLt has one, else a plain product and the two-pass column sums.
  Status WeightGrad(int64_t rows, int64_t in, int64_t out, const S* x, const S* dy, S* dW,
                    S* db) const {
    if (db == nullptr) return Run(true, false, in, out, rows, x, in, dy, out, dW, out);
    const Status fused = Run(true, false, in, out, rows, x, in, dy, out, dW, out,
                             RowEpilogue::kBiasGradB, nullptr, nullptr, nullptr, 0, db);
    if (fused.code() != StatusCode::kUnimplemented) return fused;
    STRATA_RETURN_IF_ERROR(Run(true, false, in, out, rows, x, in, dy, out, dW, out));
    return LaunchColumnSums(stream, D(dy), rows, out, partials, D(db));
  }
};

template <typename S>
StatusOr<Products<S>> MakeProducts(gpu::Stream& stream, cudaStream_t cs, float* partials,
                                   const GptCudaOptions& o) {
  STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan workspace, gpu::CublasWorkspace(stream));
  return Products<S>{cs, workspace, o.allow_tf32, partials};
}

// The layer scratch (gpt_cuda_layout.h) as typed pointers.
template <typename S>
struct LayerBuffers {
  S *ln1, *qkv, *att, *x2, *ln2, *h, *g, *dln;
  float *mean1, *rstd1, *mean2, *rstd2, *lse, *delta, *partials;
  LayerBuffers(const CudaLayerScratchLayout& l, void* scratch)
      : ln1(At<S>(scratch, l.ln1)),
        qkv(At<S>(scratch, l.qkv)),
        att(At<S>(scratch, l.att)),
        x2(At<S>(scratch, l.x2)),
        ln2(At<S>(scratch, l.ln2)),
        h(At<S>(scratch, l.h)),
        g(At<S>(scratch, l.g)),
        dln(At<S>(scratch, l.dln)),
        mean1(At<float>(scratch, l.mean1)),
        rstd1(At<float>(scratch, l.rstd1)),
        mean2(At<float>(scratch, l.mean2)),
        rstd2(At<float>(scratch, l.rstd2)),
        lse(At<float>(scratch, l.lse)),
        delta(At<float>(scratch, l.delta)),
        partials(At<float>(scratch, l.ln_partials)) {}
};

// The layer forward into the scratch regions: ln1, qkv, att, lse, x2, ln2, h, g; with x_out
// non-null also the layer output.
template <typename S>
Status LayerForwardInto(const GptShape& shape, cudaStream_t cs, const Products<S>& mm,
                        const LayerParams<const S*>& p, const S* x, int B, int T,
                        const LayerBuffers<S>& w, S* x_out) {
  const int64_t C = shape.channels, N = int64_t{B} * T;
  STRATA_RETURN_IF_ERROR(
      LaunchLayerNormForward(cs, D(x), D(p.ln1_w), D(p.ln1_b), N, C, D(w.ln1), w.mean1, w.rstd1));
  STRATA_RETURN_IF_ERROR(mm.Linear(N, C, 3 * C, w.ln1, p.qkv_w, p.qkv_b, nullptr, w.qkv));
  STRATA_RETURN_IF_ERROR(LaunchAttentionForward(cs, D(w.qkv), B, T, static_cast<int>(C),
                                                shape.num_heads, D(w.att), w.lse));
  STRATA_RETURN_IF_ERROR(mm.Linear(N, C, C, w.att, p.attn_proj_w, p.attn_proj_b, x, w.x2));
  STRATA_RETURN_IF_ERROR(LaunchLayerNormForward(cs, D(w.x2), D(p.ln2_w), D(p.ln2_b), N, C, D(w.ln2),
                                                w.mean2, w.rstd2));
  // g = D(gelu(P)), h = D(P), P = ln2 Wfc + bfc in fp32 (the GELU_AUX_BIAS epilogue).
  STRATA_RETURN_IF_ERROR(mm.Run(false, false, N, 4 * C, C, w.ln2, C, p.fc_w, 4 * C, w.g, 4 * C,
                                RowEpilogue::kGeluAuxBias, p.fc_b, nullptr, w.h, 4 * C));
  if (x_out == nullptr) return Status::Ok();
  return mm.Linear(N, 4 * C, C, w.g, p.mlp_proj_w, p.mlp_proj_b, w.x2, x_out);
}

// The head's LayerNorm: lnf = D(LN(x)) with its statistics into the scratch.
template <typename S>
Status HeadLayerNorm(const GptShape& shape, cudaStream_t cs, const S* params, const S* x, int64_t N,
                     const CudaHeadScratchLayout& l, void* scratch) {
  const int64_t C = shape.channels;
  return LaunchLayerNormForward(cs, D(x), D(params), D(params + C), N, C, D(At<S>(scratch, l.lnf)),
                                At<float>(scratch, l.mean), At<float>(scratch, l.rstd));
}

// A tied head (shape.tie_embeddings) needs the embedding chunk (and, backward, its gradient);
// an untied one takes neither.
template <typename S>
Status CheckTied(const char* what, const GptShape& shape, const S* tied_params, const S* tied_grads,
                 bool backward) {
  if (shape.tie_embeddings && (tied_params == nullptr || (backward && tied_grads == nullptr))) {
    return InvalidArgumentError(std::string(what) +
                                ": a tied head needs the embedding chunk and its gradient");
  }
  return Status::Ok();
}

}  // namespace

Status CudaPrepareStream(gpu::Stream& stream) {
  STRATA_RETURN_IF_ERROR(gpu::CublasHandle(stream).status());  // makes the device current
  return gpu::cuda::PrepareLtForCurrentDevice();
}

template <typename S>
Status CudaEmbeddingForward(const GptShape& shape, gpu::Stream& stream, const S* params,
                            const int32_t* tokens, int B, int T, S* x_out) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("CudaEmbeddingForward", shape, stream, B, T, nullptr));
  STRATA_RETURN_IF_ERROR(CheckPointers("CudaEmbeddingForward", {params, tokens, x_out}));
  const int64_t C = shape.channels;
  return LaunchEmbeddingForward(cs, D(params), D(params + int64_t{shape.vocab_size} * C), tokens,
                                int64_t{B} * T, T, C, shape.vocab_size, D(x_out));
}

template <typename S>
Status CudaEmbeddingBackward(const GptShape& shape, gpu::Stream& stream, const int32_t* tokens,
                             const S* dx_out, int B, int T, S* dparams, void* scratch) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("CudaEmbeddingBackward", shape, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("CudaEmbeddingBackward", {tokens, dx_out, dparams, scratch}));
  const CudaEmbeddingScratchLayout l = CudaEmbeddingScratchLayoutFor(shape, B, T);
  const int64_t C = shape.channels;
  return LaunchEmbeddingBackward(cs, tokens, D(dx_out), int64_t{B} * T, T, C, shape.vocab_size,
                                 shape.max_seq_len, D(dparams),
                                 D(dparams + int64_t{shape.vocab_size} * C),
                                 At<int32_t>(scratch, l.counts), At<int32_t>(scratch, l.offsets),
                                 At<int32_t>(scratch, l.cursor), At<int32_t>(scratch, l.order));
}

template <typename S>
Status CudaLayerForward(const GptShape& shape, gpu::Stream& stream, const S* params, const S* x_in,
                        S* x_out, int B, int T, void* scratch, const GptCudaOptions& options) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("CudaLayerForward", shape, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(CheckPointers("CudaLayerForward", {params, x_in, x_out, scratch}));
  const LayerBuffers<S> w(CudaLayerScratchLayoutFor<S>(shape, B, T), scratch);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs, w.partials, options));
  const LayerParams<const S*> p(params, shape.channels);
  return LayerForwardInto<S>(shape, cs, mm, p, x_in, B, T, w, x_out);
}

template <typename S>
Status CudaLayerBackward(const GptShape& shape, gpu::Stream& stream, const S* params, const S* x_in,
                         const S* dx_out, S* dx_in, S* dparams, int B, int T, void* scratch,
                         const GptCudaOptions& options) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("CudaLayerBackward", shape, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("CudaLayerBackward", {params, x_in, dx_out, dx_in, dparams, scratch}));
  const int64_t C = shape.channels, N = int64_t{B} * T;
  const int H = shape.num_heads;
  const LayerBuffers<S> w(CudaLayerScratchLayoutFor<S>(shape, B, T), scratch);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs, w.partials, options));
  const LayerParams<const S*> p(params, C);
  const LayerParams<S*> dp(dparams, C);
  STRATA_RETURN_IF_ERROR(LayerForwardInto<S>(shape, cs, mm, p, x_in, B, T, w, nullptr));
  const S* dy = dx_out;
  S *ln1 = w.ln1, *qkv = w.qkv, *att = w.att, *x2 = w.x2, *ln2 = w.ln2, *h = w.h, *g = w.g;
  S* dh = g;    // over g, dead after the mlp_proj_w gradient
  S* dqkv = h;  // over h, dead after the DGELU product
  S* dln = w.dln;
  float* partials = w.partials;
  const float *mean1 = w.mean1, *rstd1 = w.rstd1, *mean2 = w.mean2, *rstd2 = w.rstd2;

  // MLP: y = x2 + g Wp + bp, g = gelu(h).
  STRATA_RETURN_IF_ERROR(mm.WeightGrad(N, 4 * C, C, g, dy, dp.mlp_proj_w, dp.mlp_proj_b));
  STRATA_RETURN_IF_ERROR(mm.Run(false, true, N, 4 * C, C, dy, C, p.mlp_proj_w, C, dh, 4 * C,
                                RowEpilogue::kDGelu, nullptr, nullptr, h, 4 * C));
  STRATA_RETURN_IF_ERROR(mm.WeightGrad(N, C, 4 * C, ln2, dh, dp.fc_w, dp.fc_b));
  STRATA_RETURN_IF_ERROR(mm.InputGrad(N, C, 4 * C, dh, p.fc_w, dln));  // dln2
  STRATA_RETURN_IF_ERROR(LaunchLayerNormParamGrads(cs, D(x2), D(dln), mean2, rstd2, N, C, partials,
                                                   D(dp.ln2_w), D(dp.ln2_b)));
  // dx2 = D(dy + LN2'(dln2)), kept in dx_in.
  STRATA_RETURN_IF_ERROR(
      LaunchLayerNormBackward(cs, D(x2), D(p.ln2_w), D(dln), mean2, rstd2, D(dy), N, C, D(dx_in)));
  const S* dx2 = dx_in;

  // Attention: x2 = x + att Wo + bo.
  STRATA_RETURN_IF_ERROR(mm.WeightGrad(N, C, C, att, dx2, dp.attn_proj_w, dp.attn_proj_b));
  STRATA_RETURN_IF_ERROR(mm.InputGrad(N, C, C, dx2, p.attn_proj_w, dln));  // datt
  STRATA_RETURN_IF_ERROR(LaunchAttentionBackward(cs, D(qkv), D(att), D(dln), w.lse, B, T,
                                                 static_cast<int>(C), H, w.delta, D(dqkv)));
  STRATA_RETURN_IF_ERROR(mm.WeightGrad(N, C, 3 * C, ln1, dqkv, dp.qkv_w, dp.qkv_b));
  STRATA_RETURN_IF_ERROR(mm.InputGrad(N, C, 3 * C, dqkv, p.qkv_w, dln));  // dln1
  STRATA_RETURN_IF_ERROR(LaunchLayerNormParamGrads(cs, D(x_in), D(dln), mean1, rstd1, N, C,
                                                   partials, D(dp.ln1_w), D(dp.ln1_b)));
  // dx = D(dx2 + LN1'(dln1)), in place over dx2.
  return LaunchLayerNormBackward(cs, D(x_in), D(p.ln1_w), D(dln), mean1, rstd1, D(dx2), N, C,
                                 D(dx_in));
}

template <typename S>
Status CudaHeadForward(const GptShape& shape, gpu::Stream& stream, const S* params, const S* x_in,
                       const int32_t* targets, int B, int T, S* logits, void* scratch, float* loss,
                       const GptCudaOptions& options, const S* tied_params) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("CudaHeadForward", shape, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(CheckPointers("CudaHeadForward", {params, x_in, logits, scratch}));
  const int64_t C = shape.channels, V = shape.vocab_size, N = int64_t{B} * T;
  const CudaHeadScratchLayout l = CudaHeadScratchLayoutFor<S>(shape, B, T);
  STRATA_ASSIGN_OR_RETURN(const auto mm,
                          MakeProducts<S>(stream, cs, At<float>(scratch, l.ln_partials), options));
  STRATA_RETURN_IF_ERROR(CheckTied<S>("CudaHeadForward", shape, tied_params, nullptr, false));
  // Untied: Wlm (C, V) from the chunk; tied: wte (V, C), read transposed.
  const bool tied = shape.tie_embeddings;
  const S* wlm = tied ? tied_params : params + 2 * C;
  const int64_t ldw = tied ? C : V;
  S* lnf = At<S>(scratch, l.lnf);
  STRATA_RETURN_IF_ERROR(HeadLayerNorm<S>(shape, cs, params, x_in, N, l, scratch));
  // The last position of each sequence: rows T-1, 2T-1, ... of lnf, gathered into (B, C).
  S* lnf_last = At<S>(scratch, l.lnf_last);
  const size_t row_bytes = static_cast<size_t>(C) * sizeof(S);
  STRATA_RETURN_IF_ERROR(gpu::cuda::CudaStatus(
      cudaMemcpy2DAsync(lnf_last, row_bytes, lnf + (T - 1) * C, static_cast<size_t>(T) * row_bytes,
                        row_bytes, static_cast<size_t>(B), cudaMemcpyDeviceToDevice, cs),
      "cudaMemcpy2DAsync"));
  STRATA_RETURN_IF_ERROR(mm.Run(false, tied, B, V, C, lnf_last, C, wlm, ldw, logits, V));
  if (targets == nullptr || loss == nullptr) return Status::Ok();
  float* losses = At<float>(scratch, l.losses);
  S* chunk = At<S>(scratch, l.chunk);
  for (int64_t r0 = 0; r0 < N; r0 += l.chunk_rows) {
    const int64_t rows = std::min(l.chunk_rows, N - r0);
    STRATA_RETURN_IF_ERROR(mm.Run(false, tied, rows, V, C, lnf + r0 * C, C, wlm, ldw, chunk, V));
    STRATA_RETURN_IF_ERROR(LaunchCrossEntropy(cs, D(chunk), targets + r0, rows, static_cast<int>(V),
                                              losses + r0, false, 0.0f));
  }
  return LaunchMeanLoss(cs, losses, N, loss);
}

template <typename S>
Status CudaHeadBackward(const GptShape& shape, gpu::Stream& stream, const S* params, const S* x_in,
                        const int32_t* targets, float dloss, int B, int T, S* dx_in, S* dparams,
                        void* scratch, const GptCudaOptions& options, const S* tied_params,
                        S* tied_grads) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("CudaHeadBackward", shape, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("CudaHeadBackward", {params, x_in, targets, dx_in, dparams, scratch}));
  const int64_t C = shape.channels, V = shape.vocab_size, N = int64_t{B} * T;
  const CudaHeadScratchLayout l = CudaHeadScratchLayoutFor<S>(shape, B, T);
  float* partials = At<float>(scratch, l.ln_partials);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs, partials, options));
  const float* mean = At<float>(scratch, l.mean);
  const float* rstd = At<float>(scratch, l.rstd);
  S* lnf = At<S>(scratch, l.lnf);
  S* dlnf = At<S>(scratch, l.dlnf);
  S* chunk = At<S>(scratch, l.chunk);
  STRATA_RETURN_IF_ERROR(CheckTied<S>("CudaHeadBackward", shape, tied_params, tied_grads, true));
  // Untied: Wlm (C, V) and dWlm in the chunk; tied: wte (V, C) read transposed, dwte (V, C) into
  // the first V C elements of tied_grads, whose wpe part gets zeros.
  const bool tied = shape.tie_embeddings;
  const S* wlm = tied ? tied_params : params + 2 * C;
  S* dwlm = tied ? tied_grads : dparams + 2 * C;
  const int64_t ldw = tied ? C : V;
  if (tied) {
    STRATA_RETURN_IF_ERROR(gpu::cuda::CudaStatus(
        cudaMemsetAsync(tied_grads + V * C, 0,
                        static_cast<size_t>(shape.max_seq_len) * C * sizeof(S), cs),
        "cudaMemsetAsync"));
  }
  constexpr bool kFp32 = std::is_same_v<S, float>;
  // dWlm accumulates in fp32: in place for float, else in the scratch's accumulator.
  void* acc = kFp32 ? static_cast<void*>(dwlm) : At<void>(scratch, l.dwlm_acc);
  STRATA_RETURN_IF_ERROR(HeadLayerNorm<S>(shape, cs, params, x_in, N, l, scratch));
  for (int64_t r0 = 0; r0 < N; r0 += l.chunk_rows) {
    const int64_t rows = std::min(l.chunk_rows, N - r0);
    STRATA_RETURN_IF_ERROR(mm.Run(false, tied, rows, V, C, lnf + r0 * C, C, wlm, ldw, chunk, V));
    // dlogits = D(dloss / N (softmax - onehot)), in place in the chunk.
    STRATA_RETURN_IF_ERROR(LaunchCrossEntropy(cs, D(chunk), targets + r0, rows, static_cast<int>(V),
                                              At<float>(scratch, l.losses) + r0, true,
                                              dloss / static_cast<float>(N)));
    // acc (+)= lnf_chunk^T dlogits (C, V), tied dlogits^T lnf_chunk (V, C): beta 0 on the first
    // chunk, 1 after (C == D), fp32 C and D.
    gpu::cuda::LtMatmulArgs a;
    a.trans_a = true;
    a.M = tied ? V : C;
    a.N = tied ? C : V;
    a.K = rows;
    a.A = tied ? chunk : lnf + r0 * C;
    a.lda = tied ? V : C;
    a.B = tied ? lnf + r0 * C : chunk;
    a.ldb = tied ? C : V;
    a.C = r0 == 0 ? nullptr : acc;
    a.ldc = a.N;
    a.D = acc;
    a.ldd = a.N;
    a.dtype = DTypeOf<S>();
    a.fp32_output = !kFp32;
    a.allow_tf32 = mm.allow_tf32;
    STRATA_RETURN_IF_ERROR(gpu::cuda::LtMatmul(cs, a, mm.workspace.data, mm.workspace.size_bytes));
    // dlnf rows = D(dlogits Wlm^T), tied D(dlogits wte).
    if (tied) {
      STRATA_RETURN_IF_ERROR(mm.Run(false, false, rows, C, V, chunk, V, wlm, C, dlnf + r0 * C, C));
    } else {
      STRATA_RETURN_IF_ERROR(mm.InputGrad(rows, C, V, chunk, wlm, dlnf + r0 * C));
    }
  }
  if constexpr (!kFp32) {  // dWlm = S(acc), one rounding
    STRATA_RETURN_IF_ERROR(
        gpu::cuda::LaunchConvert(cs, dwlm, DTypeOf<S>(), acc, DType::kF32, C * V, 1.0f));
  }
  STRATA_RETURN_IF_ERROR(LaunchLayerNormParamGrads(cs, D(x_in), D(dlnf), mean, rstd, N, C, partials,
                                                   D(dparams), D(dparams + C)));
  return LaunchLayerNormBackward(cs, D(x_in), D(params), D(dlnf), mean, rstd,
                                 static_cast<const Dev<S>*>(nullptr), N, C, D(dx_in));
}

#define STRATA_INSTANTIATE_GPT_CUDA(S)                                                             \
  template Status CudaEmbeddingForward<S>(const GptShape&, gpu::Stream&, const S*, const int32_t*, \
                                          int, int, S*);                                           \
  template Status CudaEmbeddingBackward<S>(const GptShape&, gpu::Stream&, const int32_t*,          \
                                           const S*, int, int, S*, void*);                         \
  template Status CudaLayerForward<S>(const GptShape&, gpu::Stream&, const S*, const S*, S*, int,  \
                                      int, void*, const GptCudaOptions&);                          \
  template Status CudaLayerBackward<S>(const GptShape&, gpu::Stream&, const S*, const S*,          \
                                       const S*, S*, S*, int, int, void*, const GptCudaOptions&);  \
  template Status CudaHeadForward<S>(const GptShape&, gpu::Stream&, const S*, const S*,            \
                                     const int32_t*, int, int, S*, void*, float*,                  \
                                     const GptCudaOptions&, const S*);                             \
  template Status CudaHeadBackward<S>(const GptShape&, gpu::Stream&, const S*, const S*,           \
                                      const int32_t*, float, int, int, S*, S*, void*,              \
                                      const GptCudaOptions&, const S*, S*);
STRATA_INSTANTIATE_GPT_CUDA(float)
STRATA_INSTANTIATE_GPT_CUDA(Bf16)
STRATA_INSTANTIATE_GPT_CUDA(Fp16)
#undef STRATA_INSTANTIATE_GPT_CUDA

}  // namespace strata::models::cuda
