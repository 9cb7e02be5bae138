// The host ops backend of the families' block bodies (models/gpt_block.h, models/llama_block.h):
// HostOps<S> has the member functions of CudaOps<S> (models/ops/cuda/cuda_ops.cuh), with the
// same signatures, each a call to the host op of models/ops/ that its comment names (rounding
// points as stated there). The arguments only the CUDA ops need (the attention backward's
// delta, the fp32 accumulator of the GELU input gradient, the per-head RMSNorm's weight-gradient
// partials) are accepted and not used. Every function returns Status::Ok(): the host ops
// STRATA_CHECK their arguments instead.
//
// S in {float, double, Bf16, Fp16}; F = ComputeType<S> is the type of the statistics (LayerNorm
// mean and rstd, RMSNorm rstd, attention log-sum-exp, rotary table). Pointers are host memory;
// sizes in elements; matrices row-major. Thread-safety: as the ops (reentrant, oneTBB inside).
#pragma once

#include <cstdint>

#include "base/dtype.h"
#include "base/status.h"
#include "models/lora.h"
#include "models/ops/add.h"
#include "models/ops/attention.h"
#include "models/ops/gelu.h"
#include "models/ops/head_rms_norm.h"
#include "models/ops/layer_norm.h"
#include "models/ops/matmul.h"
#include "models/ops/rms_norm.h"
#include "models/ops/rope.h"
#include "models/ops/swiglu.h"

namespace strata::models::ops {

template <typename S>
class HostOps {
 public:
  using F = ComputeType<S>;

  // ops::LayerNormForward.
  Status LayerNormForward(const S* x, const S* w, const S* b, double eps, int64_t rows, int64_t C,
                          S* y, F* mean, F* rstd) const {
    ops::LayerNormForward(x, w, b, eps, rows, C, y, mean, rstd);
    return Status::Ok();
  }
  // ops::LayerNormBackward: dx = S(dresidual + LN'(dy)); dw, db (nullable) the parameter
  // gradients. dx may equal dresidual.
  Status LayerNormBackward(const S* x, const S* w, const F* mean, const F* rstd, const S* dy,
                           const S* dresidual, int64_t rows, int64_t C, S* dx, S* dw, S* db) const {
    ops::LayerNormBackward(x, w, mean, rstd, dy, dresidual, rows, C, dx, dw, db);
    return Status::Ok();
  }

  // ops::RmsNormForward (unit_offset: the multiplier 1 + w, Gemma).
  Status RmsNormForward(const S* x, const S* w, double eps, int64_t rows, int64_t C, S* y, F* rstd,
                        bool unit_offset = false) const {
    ops::RmsNormForward(x, w, eps, rows, C, y, rstd, unit_offset);
    return Status::Ok();
  }
  // ops::RmsNormBackward: dx = S(dresidual + RMS'(dy)); dw nullable. dx may equal dresidual.
  Status RmsNormBackward(const S* x, const S* w, const F* rstd, const S* dy, const S* dresidual,
                         int64_t rows, int64_t C, S* dx, S* dw, bool unit_offset = false) const {
    ops::RmsNormBackward(x, w, rstd, dy, dresidual, rows, C, dx, dw, unit_offset);
    return Status::Ok();
  }

  // ops::HeadRmsNormForward: the q and k heads of qk (rows, ld) normalised in place per head
  // (Qwen3's q_norm, k_norm); raw (rows, num_heads hs) and rstd (rows num_heads) kept.
  Status HeadRmsNormForward(S* qk, int64_t ld, int64_t rows, int num_heads, int num_q_heads,
                            int64_t hs, const S* w, double eps, S* raw, F* rstd,
                            bool unit_offset = false) const {
    ops::HeadRmsNormForward(qk, ld, rows, num_heads, num_q_heads, hs, w, eps, raw, rstd,
                            unit_offset);
    return Status::Ok();
  }
  // ops::HeadRmsNormBackward: dqk in place; dw (2, hs) nullable.
  Status HeadRmsNormBackward(const S* raw, int64_t rows, int num_heads, int num_q_heads, int64_t hs,
                             const S* w, const F* rstd, S* dqk, int64_t ld, S* dw,
                             bool unit_offset = false) const {
    ops::HeadRmsNormBackward(raw, rows, num_heads, num_q_heads, hs, w, rstd, dqk, ld, dw,
                             unit_offset);
    return Status::Ok();
  }

  // ops::AddForward: out = S(a + b); out may equal a or b.
  Status Add(const S* a, const S* b, int64_t n, S* out) const {
    ops::AddForward(a, b, n, out);
    return Status::Ok();
  }

  // y (rows, out) = S(x W (+ b) (+ residual)): ops::MatmulForward.
  Status Matmul(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* x, const S* W,
                const S* b, const S* residual, S* y) const {
    ops::MatmulForward(x, W, layout, b, y, rows, in, out, residual);
    return Status::Ok();
  }
  // pre = S(x W + b), g = S(gelu(fp32 pre)): ops::MatmulGeluForward.
  Status MatmulGelu(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* x,
                    const S* W, const S* b, S* pre, S* g) const {
    ops::MatmulGeluForward(x, W, layout, b, pre, g, rows, in, out);
    return Status::Ok();
  }
  // dx (rows, in) = S(dy W^T): ops::MatmulBackward's input gradient.
  Status MatmulInputGrad(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* dy,
                         const S* W, S* dx) const {
    ops::MatmulBackward<S>(nullptr, W, layout, dy, dx, nullptr, nullptr, rows, in, out);
    return Status::Ok();
  }
  // dW = S(x^T dy), db (nullable) = S(column sums of dy): ops::MatmulBackward's weight
  // gradients. dW null: nothing (a frozen base weight).
  Status MatmulWeightGrad(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* x,
                          const S* dy, S* dW, S* db) const {
    if (dW == nullptr) return Status::Ok();
    ops::MatmulBackward<S>(x, nullptr, layout, dy, nullptr, dW, db, rows, in, out);
    return Status::Ok();
  }
  // dpre (rows, in) = S((dy W^T) gelu'(pre)): ops::MatmulGeluBackward's input gradient (acc and
  // acc_rows are the CUDA ops'). dpre may be the product's input (dead by then).
  Status MatmulGeluInputGrad(WeightLayout layout, int64_t rows, int64_t in, int64_t out,
                             const S* dy, const S* W, const S* pre, float* /*acc*/,
                             int64_t /*acc_rows*/, S* dpre) const {
    ops::MatmulGeluBackward<S>(nullptr, W, layout, dy, pre, dpre, nullptr, nullptr, rows, in, out);
    return Status::Ok();
  }

  // ops::GeluForward / ops::GeluBackward on a stored pre-activation.
  Status Gelu(const S* pre, int64_t n, S* g) const {
    ops::GeluForward(pre, n, g);
    return Status::Ok();
  }
  Status GeluBackward(const S* pre, const S* dg, int64_t n, S* dpre) const {
    ops::GeluBackward(pre, dg, n, dpre);
    return Status::Ok();
  }

  // ops::SwigluForward / ops::SwigluBackward (dgate_up may equal gate_up; act: SwiGLU or GeGLU).
  Status Swiglu(const S* gate_up, int64_t rows, int64_t I, S* h,
                GatedActivation act = GatedActivation::kSilu) const {
    ops::SwigluForward(gate_up, rows, I, h, act);
    return Status::Ok();
  }
  Status SwigluBackward(const S* gate_up, const S* dh, int64_t rows, int64_t I, S* dgate_up,
                        GatedActivation act = GatedActivation::kSilu) const {
    ops::SwigluBackward(gate_up, dh, rows, I, dgate_up, act);
    return Status::Ok();
  }

  // ops::RopeTable, and ops::RopeForward (inverse false) or ops::RopeBackward (true), in place.
  Status RopeTable(const RopeParams& p, int seq_len, F* cos, F* sin) const {
    ops::RopeTable(p, seq_len, cos, sin);
    return Status::Ok();
  }
  Status Rope(S* x, int64_t rows, int64_t row_stride, int num_heads, int head_dim, int seq_len,
              const F* cos, const F* sin, bool inverse, const int32_t* position_ids,
              int rotary_dim) const {
    if (inverse) {
      ops::RopeBackward(x, rows, row_stride, num_heads, head_dim, seq_len, cos, sin, position_ids,
                        rotary_dim);
    } else {
      ops::RopeForward(x, rows, row_stride, num_heads, head_dim, seq_len, cos, sin, position_ids,
                       rotary_dim);
    }
    return Status::Ok();
  }

  // ops::AttentionForward / ops::AttentionBackward (delta is the CUDA ops').
  Status Attention(const AttentionDims& d, const S* q, const S* k, const S* v, S* out,
                   F* lse) const {
    ops::AttentionForward(d, q, k, v, out, lse);
    return Status::Ok();
  }
  Status AttentionBackward(const AttentionDims& d, const S* q, const S* k, const S* v, const S* out,
                           const S* dout, const F* lse, F* /*delta*/, S* dq, S* dk, S* dv) const {
    ops::AttentionBackward(d, q, k, v, out, dout, lse, dq, dk, dv);
    return Status::Ok();
  }

  // LoRA's adapters on a product (models/lora.h LoraForward / LoraBackward).
  Status LoraForward(const LoraLayerArgs<S>& a, int product, const S* x, int64_t rows, S* y,
                     int64_t ld) const {
    models::LoraForward(a, product, x, rows, y, ld);
    return Status::Ok();
  }
  Status LoraBackward(const LoraLayerArgs<S>& a, int product, const S* x, const S* dy, int64_t rows,
                      int64_t ld, S* dx) const {
    models::LoraBackward(a, product, x, dy, rows, ld, dx);
    return Status::Ok();
  }
};

}  // namespace strata::models::ops
