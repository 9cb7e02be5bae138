// The CUDA ops backend of the families' block bodies (models/gpt_block.h, models/llama_block.h):
// CudaOps<S> has the member functions of HostOps<S> (models/ops/host_ops.h), with the same
// signatures, each the launch of ops.cuh (or its cuBLASLt Products<S>, or LoRA's CUDA layer,
// models/cuda/lora_cuda.cuh) that its comment names, enqueued on the adapter's stream in call
// order. Host storage types S (float, Bf16, Fp16) in the signatures; the adapter converts to the
// device types. Errors: the launch's Status (kInvalidArgument from the ops' argument checks,
// launch and cuBLAS errors). Internal to the .cu files (CUDA headers).
#pragma once

#include <string>

#include "base/dtype.h"
#include "base/status.h"
#include "gpu/cuda/cuda_lt_matmul.h"
#include "models/cuda/lora_cuda.cuh"
#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::ops::cuda {

template <typename S>
class CudaOps {
 public:
  using F = float;

  // The products' stream is the ops' stream. partials: (LnPartials(rows), >= 2 C) or
  // (RmsPartials(rows), C) fp32, the two-pass column sums of the norms' parameter gradients (and
  // the products' unfused bias gradient); null where the body takes no such gradient.
  CudaOps(const Products<S>& mm, float* partials) : mm_(mm), cs_(mm.stream), partials_(partials) {}

  const Products<S>& products() const { return mm_; }

  // LaunchLayerNormForward: eps is the kernels' 1e-5 (GptFamily::CudaSupports refuses others).
  Status LayerNormForward(const S* x, const S* w, const S* b, double /*eps*/, int64_t rows,
                          int64_t C, S* y, F* mean, F* rstd) const {
    return LaunchLayerNormForward(cs_, D(x), D(w), D(b), rows, C, D(y), mean, rstd);
  }
  // LaunchLayerNormParamGrads (dw non-null; db with it), then LaunchLayerNormBackward.
  Status LayerNormBackward(const S* x, const S* w, const F* mean, const F* rstd, const S* dy,
                           const S* dresidual, int64_t rows, int64_t C, S* dx, S* dw, S* db) const {
    if (dw != nullptr) {
      STRATA_RETURN_IF_ERROR(LaunchLayerNormParamGrads(cs_, D(x), D(dy), mean, rstd, rows, C,
                                                       partials_, D(dw), D(db)));
    }
    return LaunchLayerNormBackward(cs_, D(x), D(w), D(dy), mean, rstd, D(dresidual), rows, C,
                                   D(dx));
  }

  // LaunchRmsNormForward (eps rounded to fp32; unit_offset: the multiplier 1 + w, Gemma).
  Status RmsNormForward(const S* x, const S* w, double eps, int64_t rows, int64_t C, S* y, F* rstd,
                        bool unit_offset = false) const {
    return LaunchRmsNormForward(cs_, D(x), D(w), static_cast<float>(eps), rows, C, D(y), rstd,
                                unit_offset);
  }
  // LaunchRmsNormWeightGrad (dw non-null; the same with unit_offset), then LaunchRmsNormBackward.
  Status RmsNormBackward(const S* x, const S* w, const F* rstd, const S* dy, const S* dresidual,
                         int64_t rows, int64_t C, S* dx, S* dw, bool unit_offset = false) const {
    if (dw != nullptr) {
      STRATA_RETURN_IF_ERROR(
          LaunchRmsNormWeightGrad(cs_, D(x), rstd, D(dy), rows, C, partials_, D(dw)));
    }
    return LaunchRmsNormBackward(cs_, D(x), D(w), rstd, D(dy), D(dresidual), rows, C, D(dx),
                                 unit_offset);
  }

  // LaunchHeadRmsNormForward (eps rounded to fp32).
  Status HeadRmsNormForward(S* qk, int64_t ld, int64_t rows, int num_heads, int num_q_heads,
                            int64_t hs, const S* w, double eps, S* raw, F* rstd,
                            bool unit_offset = false) const {
    return LaunchHeadRmsNormForward(cs_, D(qk), ld, rows, num_heads, num_q_heads, hs, D(w),
                                    static_cast<float>(eps), D(raw), rstd, unit_offset);
  }
  // LaunchHeadRmsNormBackward, with the ops' partials (HeadRmsNormWorkspaceBytes(rows, hs) bytes
  // at least where dw is non-null).
  Status HeadRmsNormBackward(const S* raw, int64_t rows, int num_heads, int num_q_heads, int64_t hs,
                             const S* w, const F* rstd, S* dqk, int64_t ld, S* dw,
                             bool unit_offset = false) const {
    return LaunchHeadRmsNormBackward(cs_, D(raw), rows, num_heads, num_q_heads, hs, D(w), rstd,
                                     D(dqk), ld, D(dw), partials_, unit_offset);
  }

  // LaunchAdd: out = D(a + b); out may equal a or b.
  Status Add(const S* a, const S* b, int64_t n, S* out) const {
    return LaunchAdd(cs_, D(a), D(b), n, D(out));
  }

  // Products::Forward.
  Status Matmul(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* x, const S* W,
                const S* b, const S* residual, S* y) const {
    return mm_.Forward(layout, rows, in, out, x, W, b, residual, y);
  }
  // The GELU_AUX_BIAS epilogue: g = D(gelu(P)), pre = D(P), P = x W + b in fp32. b required.
  Status MatmulGelu(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* x,
                    const S* W, const S* b, S* pre, S* g) const {
    if (b == nullptr) return InvalidArgumentError("CudaOps::MatmulGelu: the epilogue needs a bias");
    const bool trans_b = layout == WeightLayout::kOutIn;
    return mm_.Run(false, trans_b, rows, out, in, x, in, W, trans_b ? in : out, g, out,
                   gpu::cuda::RowEpilogue::kGeluAuxBias, b, nullptr, pre, out);
  }
  // Products::InputGrad.
  Status MatmulInputGrad(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* dy,
                         const S* W, S* dx) const {
    return mm_.InputGrad(layout, rows, in, out, dy, W, dx);
  }
  // Products::WeightGrad; dW null: nothing (a frozen base weight).
  Status MatmulWeightGrad(WeightLayout layout, int64_t rows, int64_t in, int64_t out, const S* x,
                          const S* dy, S* dW, S* db) const {
    if (dW == nullptr) return Status::Ok();
    return mm_.WeightGrad(layout, rows, in, out, x, dy, dW, db);
  }
  // Products::GeluInputGrad: the product acc_rows rows at a time into acc (acc_rows, in) fp32.
  Status MatmulGeluInputGrad(WeightLayout layout, int64_t rows, int64_t in, int64_t out,
                             const S* dy, const S* W, const S* pre, float* acc, int64_t acc_rows,
                             S* dpre) const {
    return mm_.GeluInputGrad(layout, rows, in, out, dy, W, pre, acc, acc_rows, dpre);
  }

  // LaunchGeluForward / LaunchGeluBackward.
  Status Gelu(const S* pre, int64_t n, S* g) const {
    return LaunchGeluForward(cs_, D(pre), n, D(g));
  }
  Status GeluBackward(const S* pre, const S* dg, int64_t n, S* dpre) const {
    return LaunchGeluBackward(cs_, D(pre), D(dg), n, D(dpre));
  }

  // LaunchSwigluForward / LaunchSwigluBackward (act: SwiGLU or GeGLU, ops/swiglu.h).
  Status Swiglu(const S* gate_up, int64_t rows, int64_t I, S* h,
                GatedActivation act = GatedActivation::kSilu) const {
    return LaunchSwigluForward(cs_, D(gate_up), rows, I, D(h), act);
  }
  Status SwigluBackward(const S* gate_up, const S* dh, int64_t rows, int64_t I, S* dgate_up,
                        GatedActivation act = GatedActivation::kSilu) const {
    return LaunchSwigluBackward(cs_, D(gate_up), D(dh), rows, I, D(dgate_up), act);
  }

  // LaunchRopeTable, LaunchRope.
  Status RopeTable(const RopeParams& p, int seq_len, F* cos, F* sin) const {
    return LaunchRopeTable(cs_, p, seq_len, cos, sin);
  }
  Status Rope(S* x, int64_t rows, int64_t row_stride, int num_heads, int head_dim, int seq_len,
              const F* cos, const F* sin, bool inverse, const int32_t* position_ids,
              int rotary_dim) const {
    return LaunchRope(cs_, D(x), rows, row_stride, num_heads, head_dim, seq_len, cos, sin, inverse,
                      position_ids, rotary_dim);
  }

  // LaunchAttentionForward / LaunchAttentionBackward.
  Status Attention(const AttentionDims& d, const S* q, const S* k, const S* v, S* out,
                   F* lse) const {
    return LaunchAttentionForward(cs_, d, D(q), D(k), D(v), D(out), lse);
  }
  Status AttentionBackward(const AttentionDims& d, const S* q, const S* k, const S* v, const S* out,
                           const S* dout, const F* lse, F* delta, S* dq, S* dk, S* dv) const {
    return LaunchAttentionBackward(cs_, d, D(q), D(k), D(v), D(out), D(dout), lse, delta, D(dq),
                                   D(dk), D(dv));
  }

  // LoRA's adapters on a product (models/cuda/lora_cuda.cuh).
  Status LoraForward(const LoraLayerArgs<S>& a, int product, const S* x, int64_t rows, S* y,
                     int64_t ld) const {
    return models::cuda::LoraCudaForward(mm_, a, product, x, rows, y, ld);
  }
  Status LoraBackward(const LoraLayerArgs<S>& a, int product, const S* x, const S* dy, int64_t rows,
                      int64_t ld, S* dx) const {
    return models::cuda::LoraCudaBackward(mm_, a, product, x, dy, rows, ld, dx);
  }

 private:
  template <typename T>
  static const internal::Dev<T>* D(const T* p) {
    return internal::D(p);
  }
  template <typename T>
  static internal::Dev<T>* D(T* p) {
    return internal::D(p);
  }

  const Products<S>& mm_;
  cudaStream_t cs_;
  float* partials_;
};

}  // namespace strata::models::ops::cuda
