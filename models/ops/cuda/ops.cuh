// The CUDA ops of models/ops/ (one .cu per op in models/ops/cuda/, the device counterparts of the
// host ops models/ops/*.h with the same rounding points): arithmetic in fp32 from the stored
// values, each output rounded once (round to nearest even). They agree with the host ops up to
// summation order and the GPU's expf/tanhf/sqrtf, not bit for bit. Every model family on CUDA
// (models/cuda/) is a list of calls to these.
//
// Templates on the device storage type D: float, __half or __nv_bfloat16 (instantiated for those
// three; the tensor-core attention for the two 16-bit types). Every entry point takes an explicit
// cudaStream_t, allocates nothing, checks its arguments before launching (kInvalidArgument naming
// the op), and returns the launch error (cudaGetLastError) as a Status; faults of a running kernel
// surface at the stream's next synchronization. Pointers are device memory; sizes in ELEMENTS;
// matrices row-major; N = B T rows. The caller makes the stream's device current. Tokens or
// targets outside [0, V) trap (__trap), except a target of engine::kIgnoreTarget (-1), which the
// loss does not count; so do position ids outside their range (packed sequences: position_ids
// (B, T) int32 in device memory, engine::BlockBuffers, each token's position within its example).
//
// Determinism: no floating-point atomics; every reduction has a fixed order for a given shape,
// so results are bit-identical from run to run on one GPU. Built without --use_fast_math.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "base/dtype.h"
#include "base/status.h"
#include "gpu/cuda/cuda_lt_matmul.h"
#include "gpu/device.h"
#include "models/ops/attention.h"
#include "models/ops/cuda/attention_tiles.h"
#include "models/ops/cuda/partials.h"
#include "models/ops/matmul.h"
#include "models/ops/rope.h"
#include "models/ops/swiglu.h"

namespace strata::models::ops::cuda {

// ---------------------------------------------------------------------------
// Embedding (ops/embedding.h), embedding.cu.

// The device scratch of one stable counting sort of n int32 keys in [0, K): counts (K), offsets
// (K + 1), cursor (K), order (n) int32, disjoint, 4-byte aligned; contents undefined after.
struct CountingSortScratch {
  int32_t* counts = nullptr;
  int32_t* offsets = nullptr;
  int32_t* cursor = nullptr;
  int32_t* order = nullptr;
};

// x_out[r] = D(wte[tokens[r]] s + wpe[p(r)]), p(r) = position_ids[r] when position_ids ((N)
// int32, packed sequences, each in [0, T); outside traps) is given, else r % T; wte (V, C), wpe
// (>= T, C), x_out (N, C). s = D(scale) (through fp32; Gemma's embed_scale, ops/embedding.h), a
// finite scale (else kInvalidArgument), 1.0 by default: then the kernels of before the scale, bit
// for bit. wpe may be null (no position table, the Llama family): x_out[r] = D(wte[tokens[r]] s),
// an exact copy with scale 1, and position_ids is not read.
template <typename D>
Status LaunchEmbeddingForward(cudaStream_t stream, const D* wte, const D* wpe,
                              const int32_t* tokens, int64_t N, int T, int64_t C, int V, D* x_out,
                              const int32_t* position_ids = nullptr, double scale = 1.0);

// dwte (V, C), dwpe (max_seq_len, C) OVERWRITTEN: a stable counting sort of the N rows by token
// (by_token, K = V), then dwte[v] = D(s * fp32 sum of the dx_out rows of token v in increasing
// row order), s = D(scale) as the forward's (the sum scaled once, complete; scale 1.0 exact),
// 0 for absent tokens. dwpe (null: not computed): without position_ids dwpe[t] = D(fp32
// sum over b of dx_out[b T + t], b in order) for t < T; with position_ids ((N) int32, each in
// [0, T); outside traps) a second stable counting sort of the rows by position (by_position,
// K = T; needed only then) and dwpe[p] = D(fp32 sum of the dx_out rows at position p in
// increasing row order), 0 for a position no row has; rows T .. max_seq_len - 1 are 0.
template <typename D>
Status LaunchEmbeddingBackward(cudaStream_t stream, const int32_t* tokens, const D* dx_out,
                               int64_t N, int T, int64_t C, int V, int max_seq_len, D* dwte,
                               D* dwpe, const CountingSortScratch& by_token,
                               const int32_t* position_ids = nullptr,
                               const CountingSortScratch& by_position = {}, double scale = 1.0);

// ---------------------------------------------------------------------------
// LayerNorm (ops/layer_norm.h) and column sums (the bias gradient of ops/matmul.h), layer_norm.cu.

// LayerNorm (Ba et al. 2016, biased variance, eps 1e-5) of each row of x (rows, C):
// y = D((x - mean) rstd w + b); mean, rstd (rows) fp32. One warp per row, two passes.
template <typename D>
Status LaunchLayerNormForward(cudaStream_t stream, const D* x, const D* w, const D* b, int64_t rows,
                              int64_t C, D* y, float* mean, float* rstd);

// dx = D((residual ? residual : 0) + rstd (g - mean(g) - xhat mean(g xhat))), g = dy w, xhat
// = (x - mean) rstd, all in fp32 from the D inputs (the one rounding after the residual is
// added). dx may equal residual (row-local, read before write); not x or dy.
template <typename D>
Status LaunchLayerNormBackward(cudaStream_t stream, const D* x, const D* w, const D* dy,
                               const float* mean, const float* rstd, const D* residual,
                               int64_t rows, int64_t C, D* dx);

// dw = D(sum_r dy xhat), db = D(sum_r dy), deterministic two-pass column reduction: pass 1
// sums blocks of kLnRowsPerPartial rows into partials ((LnPartials(rows), 2 C) fp32), pass 2
// adds the partials of each column in order.
template <typename D>
Status LaunchLayerNormParamGrads(cudaStream_t stream, const D* x, const D* dy, const float* mean,
                                 const float* rstd, int64_t rows, int64_t C, float* partials, D* dw,
                                 D* db);

// out[c] = D(sum over rows of x[r, c]) (a bias gradient), the same two passes;
// partials: (LnPartials(rows), cols) fp32.
template <typename D>
Status LaunchColumnSums(cudaStream_t stream, const D* x, int64_t rows, int64_t cols,
                        float* partials, D* out);

// ---------------------------------------------------------------------------
// GELU's backward (ops/gelu.h), gelu.cu. The forward is cuBLASLt's GELU_AUX_BIAS epilogue
// (Products::Run), which rounds where the host's MatmulGeluForward does.

// out (n) = D(acc gelu'(pre)) with gelu' of the tanh form (Hendrycks & Gimpel 2016) in fp32: acc
// (n) fp32, pre (n) the stored pre-activation. The host's DGELU epilogue (ops/gelu.cc
// MatmulGeluBackward: one rounding of the fp32 product times gelu'); Products::GeluInputGrad
// feeds it the product. out may not alias acc.
template <typename D>
Status LaunchTimesGeluGrad(cudaStream_t stream, const float* acc, const D* pre, int64_t n, D* out);

// The unfused GELU of a stored pre-activation (ops/gelu.h GeluForward/GeluBackward, where an
// adapter adds to the product first: LoRA on GPT-2's c_fc or MLP c_proj): out (n) = D(gelu(pre));
// dpre (n) = D(dg gelu'(pre)), one rounding, dg (n) the stored gradient of the GELU's output.
// Outputs must not alias the inputs.
template <typename D>
Status LaunchGeluForward(cudaStream_t stream, const D* pre, int64_t n, D* out);
template <typename D>
Status LaunchGeluBackward(cudaStream_t stream, const D* pre, const D* dg, int64_t n, D* dpre);

// ---------------------------------------------------------------------------
// Cross-entropy and the chunked LM head (ops/cross_entropy.h), cross_entropy.cu.

// Per row of logits (N, V): losses[r] = logsumexp - logits[r, targets[r]] in fp32 from the D
// logits; with write_grad the row is then OVERWRITTEN in place with
// D(grad_scale (softmax - onehot(target))). A target of engine::kIgnoreTarget (-1): losses[r] =
// 0 and (write_grad) the row all zeros; any other target outside [0, V) traps. One block per
// row. softcap c > 0 (final-logit soft-capping, ops/cross_entropy.h): the row holds raw logits l
// and the loss is that of the capped logits L = D(c tanh(l / c)) (u = tanh(l / c) in fp32), the
// gradient D(grad_scale (softmax(L) - onehot) (1 - u^2)); 0: none, the kernel of before the
// parameter. softcap must be finite and >= 0 (else kInvalidArgument). row_weights (N) fp32 or
// null (write_grad only): row r's scale is the fp32 product grad_scale * row_weights[r] in place
// of grad_scale (ops/cross_entropy.h, per-row weights); null: the kernel of before the parameter.
template <typename D>
Status LaunchCrossEntropy(cudaStream_t stream, D* logits, const int32_t* targets, int64_t N, int V,
                          float* losses, bool write_grad, float grad_scale, float softcap = 0.0f,
                          const float* row_weights = nullptr);

// *loss = float(sum of losses (N) in double, fixed order, / divisor), 0 when divisor is 0 (every
// target ignored). One block. N >= 1, divisor >= 0: the number of counted targets.
Status LaunchMeanLoss(cudaStream_t stream, const float* losses, int64_t N, int64_t divisor,
                      float* loss);

// ---------------------------------------------------------------------------
// RMSNorm (ops/rms_norm.h). One warp per row.

// unit_offset (Gemma's RMSNorm, ops/rms_norm.h): the multiplier is (1 + w), added in fp32, in
// place of w, in the forward and in g below; false computes bit for bit what the kernels computed
// before the option existed. The weight gradient does not depend on w (d(1 + w)/dw = 1): one
// LaunchRmsNormWeightGrad for both.

// x: (rows, C); w: (C); y: (rows, C) OVERWRITTEN = D((x rstd) w); rstd: (rows) fp32 OVERWRITTEN
// = 1 / sqrt(mean(x^2) + eps). eps > 0, C >= 1. y must not overlap x.
template <typename D>
Status LaunchRmsNormForward(cudaStream_t stream, const D* x, const D* w, float eps, int64_t rows,
                            int64_t C, D* y, float* rstd, bool unit_offset = false);

// dx: (rows, C) OVERWRITTEN = D(dresidual + rstd (g - xhat mean(g xhat))), g = dy w, xhat = x
// rstd, with dresidual (rows, C) or null (0). Row-local, each row read before it is written, so
// dx may equal dy or dresidual (not x).
template <typename D>
Status LaunchRmsNormBackward(cudaStream_t stream, const D* x, const D* w, const float* rstd,
                             const D* dy, const D* dresidual, int64_t rows, int64_t C, D* dx,
                             bool unit_offset = false);

// dw: (C) OVERWRITTEN = D(sum over rows of dy xhat) in fp32, two passes in a fixed order: pass 1
// sums blocks of kRmsRowsPerPartial rows into partials ((RmsPartials(rows), C) fp32 scratch),
// pass 2 adds the partials of each column in order. Must run before a backward that overwrites
// dy in place.
template <typename D>
Status LaunchRmsNormWeightGrad(cudaStream_t stream, const D* x, const float* rstd, const D* dy,
                               int64_t rows, int64_t C, float* partials, D* dw);

// ---------------------------------------------------------------------------
// Per-head RMSNorm of the q and k heads (ops/head_rms_norm.h: Qwen3's q_norm and k_norm),
// head_rms_norm.cu. One warp per (row, head), through the RMSNorm row functions (the rounding of
// LaunchRmsNormForward/Backward). Layout as the host op: qk (rows, ld), ld >= num_heads hs, the
// first num_heads hs columns of each row the heads, heads h < num_q_heads using w[0 : hs], the
// others w[hs : 2 hs]; columns past num_heads hs never read or written. Requirements
// (kInvalidArgument otherwise): rows >= 0, hs >= 1, num_heads >= 1, 0 <= num_q_heads <=
// num_heads, ld >= num_heads hs. unit_offset as for the RMSNorm (Gemma 3's q_norm / k_norm: the
// multiplier 1 + w in fp32; false: bit for bit the kernels without the option).

// qk IN PLACE: each head replaced by D((x rstd) w); raw: (rows, num_heads hs) contiguous
// OVERWRITTEN with the pre-norm heads; rstd: (rows num_heads) fp32 OVERWRITTEN (index r num_heads
// + h). eps > 0. raw and rstd must not overlap qk.
template <typename D>
Status LaunchHeadRmsNormForward(cudaStream_t stream, D* qk, int64_t ld, int64_t rows, int num_heads,
                                int num_q_heads, int64_t hs, const D* w, float eps, D* raw,
                                float* rstd, bool unit_offset = false);

// dqk IN PLACE: the gradient of the normalised heads on entry, D(rstd (g - xhat mean(g xhat)))
// (g = dy w, xhat = raw rstd) on exit. dw: (2, hs) OVERWRITTEN with D(fp32 sum of dy xhat), row 0
// over every row's q heads, row 1 over the k heads, in a fixed order: pass 1 sums blocks of
// kHeadRmsRowsPerPartial rows (rows in order, heads in order) into partials
// (HeadRmsNormWorkspaceBytes(rows, hs) bytes of fp32 scratch, contents undefined after), pass 2
// adds the partials of each column in order; computed from dqk's entry values, before the
// input gradient overwrites them. dw null: not computed, partials not used (may be null).
template <typename D>
Status LaunchHeadRmsNormBackward(cudaStream_t stream, const D* raw, int64_t rows, int num_heads,
                                 int num_q_heads, int64_t hs, const D* w, const float* rstd, D* dqk,
                                 int64_t ld, D* dw, float* partials, bool unit_offset = false);

// ---------------------------------------------------------------------------
// Elementwise sum (ops/add.h), add.cu: Gemma's residual add of a normalised sublayer output.

// out (n) = D(fp32 a + fp32 b), one rounding, one thread per element. out may equal a or b (the
// same pointer; each element is read before it is written by the same thread), no other overlap.
template <typename D>
Status LaunchAdd(cudaStream_t stream, const D* a, const D* b, int64_t n, D* out);

// ---------------------------------------------------------------------------
// Rotary embeddings (ops/rope.h).

// The largest head_dim the table kernel takes (its inverse frequencies travel as a kernel
// argument).
inline constexpr int kRopeMaxHeadDim = 256;

// cos, sin: (seq_len, rotary_dim / 2) fp32 OVERWRITTEN, the table of ops::RopeTable<float>: the
// inverse frequencies come from ops::RopeInverseFrequencies (host, double) and each entry is
// float(a * cos(double(t) * inv_freq[i])) (a = p.attention_factor) evaluated in double on the
// device, so it matches the host table except where the device's double cos/sin (within 2 ulp of
// double) round to the other float. head_dim even, 2 <= head_dim <= kRopeMaxHeadDim, the rotary
// dim (ops::RopeRotaryDim) even in [2, head_dim], ext_factors empty or one positive factor a
// frequency, a positive and finite, the linear factor positive and finite, with p.llama3 its
// factors as ValidateLlamaConfig wants them (factor > 0, high > low > 0, original max > 0), and
// seq_len >= 1; else kInvalidArgument.
Status LaunchRopeTable(cudaStream_t stream, const RopeParams& p, int seq_len, float* cos,
                       float* sin);

// In place on num_heads consecutive heads of head_dim columns at the start of each of `rows`
// rows of row_stride elements; row r is position position_ids[r] when position_ids ((rows)
// int32, packed sequences, each in [0, seq_len); outside traps) is given, else r % seq_len;
// cos/sin from LaunchRopeTable for at least seq_len positions. inverse = false: the forward
// rotation; true: its transpose (the backward on the gradient). Each output rounded once.
// rotary_dim: the columns of each head that turn (partial rotary; even, <= head_dim; 0 =
// head_dim), the others untouched; the table has rotary_dim / 2 entries a position.
template <typename D>
Status LaunchRope(cudaStream_t stream, D* x, int64_t rows, int64_t row_stride, int num_heads,
                  int head_dim, int seq_len, const float* cos, const float* sin, bool inverse,
                  const int32_t* position_ids = nullptr, int rotary_dim = 0);

// ---------------------------------------------------------------------------
// SwiGLU and GeGLU (ops/swiglu.h) on rows of [gate (I) | up (I)], swiglu.cu: act(g) = silu(g)
// (kSilu, the default: the kernels of before the parameter, bit for bit) or the tanh GELU of
// ops/gelu.h (kGeluTanh, Gemma's gelu_pytorch_tanh), in fp32. An act outside the enum is
// kInvalidArgument.

// h: (rows, I) OVERWRITTEN = D(act(g) u); must not overlap gate_up.
template <typename D>
Status LaunchSwigluForward(cudaStream_t stream, const D* gate_up, int64_t rows, int64_t I, D* h,
                           GatedActivation act = GatedActivation::kSilu);

// dgate_up: (rows, 2I) OVERWRITTEN with [D(dh u act'(g)) | D(dh act(g))]; may equal gate_up
// (each pair is read before it is written); dh must not overlap either.
template <typename D>
Status LaunchSwigluBackward(cudaStream_t stream, const D* gate_up, const D* dh, int64_t rows,
                            int64_t I, D* dgate_up, GatedActivation act = GatedActivation::kSilu);

// ---------------------------------------------------------------------------
// Causal grouped-query attention (ops/attention.h), attention.cu, fused in the manner of
// FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
// Partitioning", 2023): no T x T matrix. Query head h reads kv head h / (H / Hkv). The GPT is the
// case Hkv = H with q, k, v the column blocks of its fused qkv (B, T, 3C): q = qkv, k = qkv + C,
// v = qkv + 2C, row_stride 3C.
//
// Two implementations with the same rounding points, chosen by `path` (attention_tiles.h): tensor
// cores (mma.sync m16n8k16) for bf16 and fp16 with head_dim 64 or 128, q, k, v, out (and dout, dq,
// dk, dv) 16-byte aligned and row_stride a multiple of 8; CUDA cores (fp32 FMAs on values
// converted from D) for everything up to head_dim 256, the fallback and the reference (the only
// path for head dims past 128: Gemma 3's 256). kAuto picks the tensor cores where they apply;
// kTensorCores where they do not is kInvalidArgument.
//
// Packed sequences: with AttentionDims::position_ids ((B, T) int32, device memory) query t of
// sequence b sees keys t - position_ids[b, t] .. t only (block-diagonal causal attention), in
// both implementations; an id outside [0, t] traps. Null: keys 0 .. t, and the kernels compute
// what they computed before position_ids existed, bit for bit. Sliding window
// (AttentionDims::window w >= 1): in addition, keys t - w + 1 .. t only; the kernels skip the
// tiles outside every window of their block. 0, or w >= T: no window, bit for bit.
// Soft-capping (AttentionDims::softcap c > 0, Gemma 2's attn_logit_softcapping): each scaled score
// s becomes c tanh(s / c) in fp32 (c rounded to fp32) before the mask and the softmax, in both
// implementations, and the backward's dS = D(D(P) (dP - delta) (1 - tanh^2(s / c))), the host
// op's order; 0: none, the kernels of before the option, bit for bit.

// The largest head_dim of the attention kernels (Gemma 3's 256; past 128 on CUDA cores only).
inline constexpr int kAttentionMaxHeadDim = 256;

// q: (B, T, H, hs) rows of row_stride; k, v: (B, T, Hkv, hs) rows of row_stride; out: (B, T, H hs)
// contiguous, OVERWRITTEN; lse: (B, H, T) fp32 OVERWRITTEN (log-sum-exp of each query's scaled
// scores; the backward recomputes the probabilities from it). Scores scaled in fp32 by
// 1 / sqrt(hs), or by AttentionDims::scale rounded to fp32 where it is not 0; one pass of online
// softmax in fp32 (FlashAttention-2) over key tiles of kAttentionKeyTile, each tile's
// probabilities D(exp(s - m)), m the row's running max, rounded to D before the product with V,
// the accumulator rescaled per tile and divided by the row's sum once (the host op's rounding
// points, models/ops/attention.h), output rounded once. Requirements: all
// dims >= 1, H % Hkv == 0, hs <= kAttentionMaxHeadDim, row_stride >= H hs, B H <= 65535,
// window >= 0, scale finite and >= 0, softcap 0 or finite and > 0 with an fp32 rounding neither
// inf nor 0. out must not overlap q, k, v.
template <typename D>
Status LaunchAttentionForward(cudaStream_t stream, const AttentionDims& d, const D* q, const D* k,
                              const D* v, D* out, float* lse,
                              AttentionPath path = AttentionPath::kAuto);

// dq, dk, dv OVERWRITTEN (strides of q, k, v); delta: (B, H, T) fp32 scratch (rowsum(dout out)).
// P recomputed from lse and rounded to D, dS = D(D(P) (dP - delta)) (soft-capped: times
// 1 - tanh^2(s / c) before the rounding; the host op's rounding points); dq = D(scale sum dS k);
// dk, dv of a kv head accumulated in fp32 over the query heads of its group (in head order) and
// rounded once. No atomics: one block per (sequence, kv head, key tile) owns its dk, dv and loops
// over the query tiles; a separate pass writes dq. dq, dk, dv may be column blocks of one buffer;
// they must not overlap the inputs. `path` as for the forward (the two need not match: both
// recompute from the same lse contract).
template <typename D>
Status LaunchAttentionBackward(cudaStream_t stream, const AttentionDims& d, const D* q, const D* k,
                               const D* v, const D* out, const D* dout, const float* lse,
                               float* delta, D* dq, D* dk, D* dv,
                               AttentionPath path = AttentionPath::kAuto);

// ---------------------------------------------------------------------------
// Matrix products of a linear layer (ops/matmul.h) through cuBLASLt (gpu/cuda/cuda_lt_matmul.h),
// matmul.cu: S (host storage type: float, Bf16, Fp16) inputs and outputs, fp32 accumulation
// (TF32 for fp32 only with allow_tf32), each output rounded once; the algorithm chosen once per
// shape and cached. W in either ops::WeightLayout: kInOut (in, out), y = x W; kOutIn (out, in),
// y = x W^T. Enqueued on `stream` with the stream's cuBLAS workspace, used only by that stream;
// one thread at a time per stream (cuBLAS rule).
// Takes what the products need from `stream` beyond their scratch, once, before any block runs:
// the stream's cuBLAS handle with its workspace (gpu::CublasHandle, which also makes the
// stream's device current) and the device's cuBLASLt handle. kUnavailable when cuBLAS or
// cuBLASLt cannot be loaded, kResourceExhausted for the workspace.
Status PrepareStream(gpu::Stream& stream);

template <typename S>
struct Products {
  cudaStream_t stream = nullptr;
  gpu::DeviceSpan workspace;  // the stream's cuBLAS workspace (gpu::CublasWorkspace)
  bool allow_tf32 = false;
  float* partials = nullptr;  // (LnPartials(rows), >= out) fp32, the unfused bias-gradient path

  // The products of `stream` (a CUDA backend stream; cs its native handle): its workspace, or the
  // error of gpu::CublasWorkspace.
  static StatusOr<Products> Make(gpu::Stream& stream, cudaStream_t cs, bool allow_tf32 = false,
                                 float* partials = nullptr);

  // out (M, N) = epilogue(op(A) op(B) (+ residual)), row-major (cuda_lt_matmul.h).
  Status Run(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const S* A, int64_t lda,
             const S* B, int64_t ldb, S* out, int64_t ldd,
             gpu::cuda::RowEpilogue epilogue = gpu::cuda::RowEpilogue::kNone,
             const S* bias = nullptr, const S* residual = nullptr, S* aux = nullptr,
             int64_t aux_ld = 0, S* bias_grad = nullptr) const;

  // y (rows, out) = S(x W (+ b) (+ residual)): x (rows, in); b (out) and residual nullable (the
  // bias epilogue, beta = 1).
  Status Forward(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* x, const S* W,
                 const S* b, const S* residual, S* y) const;

  // dx (rows, in) = S(dy W^T): dy (rows, out).
  Status InputGrad(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* dy,
                   const S* W, S* dx) const;

  // dpre (rows, in) = S(P gelu'(pre)) with P = dy W^T in fp32: the input gradient through a
  // GELU, rounded once where the host's MatmulGeluBackward rounds (cuBLASLt's DGELU epilogue
  // does not: it moves 1 ulp in a quarter of the outputs, H200, 2026-11-27). dy (rows, out), pre
  // (rows, in). The product runs acc_rows rows at a time into acc (acc_rows, in) fp32, then
  // LaunchTimesGeluGrad; acc is scratch (acc_rows >= 1).
  Status GeluInputGrad(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* dy,
                       const S* W, const S* pre, float* acc, int64_t acc_rows, S* dpre) const;

  // dW (the layout's shape) = S(x^T dy) and (db non-null) db = S(column sums of dy), through the
  // bias-gradient epilogue where cuBLASLt has one, else a plain product and LaunchColumnSums
  // (which needs `partials`).
  Status WeightGrad(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* x,
                    const S* dy, S* dW, S* db = nullptr) const;
};

// ---------------------------------------------------------------------------
// The chunked LM head (ops/cross_entropy.h), cross_entropy.cu: logits of R = chunk_rows rows at
// a time, never all (N, V). xn (N, C): the normalised final hidden states; W the (V, C) head
// weight in `layout` (kInOut: (C, V), y = xn W; kOutIn: (V, C), y = xn W^T, the tied embedding).

// The head's scratch: chunk (chunk_rows, V) S; losses (N) fp32; xn_last (B, C) S; dw_acc (the
// weight's shape) fp32 for 16-bit S (the weight gradient accumulates in place for float).
template <typename S>
struct HeadScratch {
  int64_t chunk_rows = 0;
  S* chunk = nullptr;
  float* losses = nullptr;
  S* xn_last = nullptr;
  void* dw_acc = nullptr;
};

// Final-logit soft-capping (softcap c > 0, Gemma 2's final_logit_softcapping; the host op's
// semantics, ops/cross_entropy.h): every logit the head gives out or takes the loss of is
// S(c tanh(l / c)) of the product's S logit l, u = tanh(l / c) in fp32; the backward multiplies
// each dlogit by 1 - u^2, u recomputed from the raw S logit of the recomputed chunk, before its
// rounding to S. 0: none, the results of before the parameter bit for bit. softcap must be finite
// and >= 0 (else kInvalidArgument, before anything is enqueued).

// logits (B, V) = the last position (t = T - 1) of each sequence (soft-capped: S(c tanh(l / c)));
// with targets (B T) and loss non-null, *loss (one fp32, device) = sum of the rows' cross-entropy
// (of the capped logits; summed in double, fixed order; 0 for a target of
// engine::kIgnoreTarget) / loss_tokens, the number of counted targets (0: N = B T, the mean over
// every row; the loss is 0 when every target is ignored). row_losses (N) fp32 device memory or
// null: with targets, each row's cross-entropy (0 for an ignored target), the values the mean
// sums (the kernel writes them there instead of scratch.losses); the chunks are computed when
// loss or row_losses is non-null.
template <typename S>
Status ChunkedHeadForward(const Products<S>& mm, const S* xn, const S* W, WeightLayout layout,
                          int B, int T, int64_t C, int64_t V, const HeadScratch<S>& scratch,
                          S* logits, const int32_t* targets, float* loss, int64_t loss_tokens = 0,
                          float softcap = 0.0f, float* row_losses = nullptr);

// Gradient of dloss * (mean cross-entropy over loss_tokens counted targets; 0: N): per chunk
// dlogits = S(dloss / loss_tokens (softmax - onehot)) in place (zero rows for ignored targets;
// soft-capped: S(dloss / loss_tokens (softmax(capped) - onehot) (1 - u^2))), dW (+)= xn^T dlogits
// in fp32 (beta 0 on the first chunk, 1 after; rounded to S once at the end) and dxn rows =
// S(dlogits W^T). dW (the weight's shape) and dxn (N, C) OVERWRITTEN; dW null: dxn only (a frozen
// head, LoRA). row_weights (N) fp32 device memory or null: the gradient of dloss * sum_t
// row_weights[t] CE_t, each counted row's dlogits D((dloss * row_weights[t]) (softmax - onehot))
// with the product rounded to fp32 once (ops/cross_entropy.h); loss_tokens is not read.
template <typename S>
Status ChunkedHeadBackward(const Products<S>& mm, const S* xn, const S* W, WeightLayout layout,
                           const int32_t* targets, float dloss, int64_t N, int64_t C, int64_t V,
                           const HeadScratch<S>& scratch, S* dW, S* dxn, int64_t loss_tokens = 0,
                           float softcap = 0.0f, const float* row_weights = nullptr);

}  // namespace strata::models::ops::cuda
