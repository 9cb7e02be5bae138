// Test helper: a whole Llama held as per-block chunks and run through the block functions of
// models/llama_kernels.h in the order the engine runs them (embedding -> layers -> head, and
// back). Outputs and scratch are poisoned (NaN) before every call and each scratch has a guard
// region, so a block that reads before writing, accumulates instead of overwriting, or writes
// past its scratch size shows up. Templated on the storage type S (float, double, Bf16, Fp16).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "models/llama_config.h"
#include "models/llama_kernels.h"
#include "models/ops/attention.h"
#include "models/ops/matmul.h"
#include "models/ops/rms_norm.h"
#include "models/ops/rope.h"
#include "models/ops/swiglu.h"
#include "tests/models/llama_op_test_util.h"
#include "tests/models/terms_bound.h"

namespace strata::models::llama_test {

using op_test::GuardedScratch;

inline int NumBlocks(const LlamaConfig& c) { return c.num_layers + 2; }

inline std::vector<LlamaTensor> BlockTensors(const LlamaConfig& c, int block) {
  if (block == 0) return LlamaEmbeddingTensors(c);
  if (block == NumBlocks(c) - 1) return LlamaHeadTensors(c);
  return LlamaLayerTensors(c, block - 1);
}

// Random parameters that exercise every nonlinearity: embeddings O(1), norm weights 1 +- 0.3,
// matrices uniform with unit-variance outputs (+-sqrt(3 / in_dim)).
inline std::vector<std::vector<double>> RandomLlama(const LlamaConfig& c, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<std::vector<double>> blocks;
  for (int b = 0; b < NumBlocks(c); ++b) {
    const std::vector<LlamaTensor> tensors = BlockTensors(c, b);
    std::vector<double> chunk(tensors.back().offset + tensors.back().num_elems);
    for (const LlamaTensor& t : tensors) {
      const bool norm = t.name.ends_with("norm.weight");
      const bool embed = t.name == "model.embed_tokens.weight";
      const double scale = std::sqrt(3.0 / static_cast<double>(t.shape.back()));
      for (int64_t i = 0; i < t.num_elems; ++i) {
        chunk[t.offset + i] = norm ? 1.0 + 0.3 * u(gen) : embed ? u(gen) : scale * u(gen);
      }
    }
    blocks.push_back(std::move(chunk));
  }
  return blocks;
}

inline std::vector<int32_t> RandomTokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = d(gen);
  return t;
}

// The magnitude of the terms that cancel in a layer's q_proj and k_proj weight gradients
// (terms_bound.h), as a vector over the whole layer chunk (zero outside q_proj and k_proj): the
// layer's forward and its backward down to the attention output gradient dO recomputed in double
// with the host ops (the layer's own op calls, models/llama_kernels.cc), then the attention's
// backward evaluated with absolute values, per (sequence, head, query t, key s):
//   T_dP(t, s) = sum_j |dO_tj v_sj|,  T_dS(t, s) = P_ts (T_dP(t, s) + sum_s' P_ts' T_dP(t, s'))
// (dS = P (dP - D), D = sum_s' P_ts' dP_ts': the softmax backward, whose terms cancel exactly when
// the row has one key), dq_t += scale T_dS |k_s|, dk_s += scale T_dS |q_t|; RoPE's inverse
// rotation mixes the pair (i, i + hs / 2) with |cos|, |sin| <= 1, so a pre-rotation magnitude is
// the sum of the pair's; and the weight gradient dWqkv = dqkv^T xn gives |dqkv|^T |xn|. x_in and
// dy: the layer's input and the gradient of its output, (B T, C).
inline std::vector<double> AttentionProjectionTerms(const LlamaConfig& c,
                                                    const std::vector<double>& params,
                                                    const std::vector<double>& x_in,
                                                    const std::vector<double>& dy, int B, int T) {
  using ops::WeightLayout;
  constexpr WeightLayout kOutIn = WeightLayout::kOutIn;
  const int64_t N = int64_t{B} * T, C = c.hidden_size, I = c.intermediate_size;
  const int64_t H = c.num_heads, Hkv = c.num_kv_heads, hs = c.head_dim;
  const int64_t Dq = H * hs, Dkv = Hkv * hs, Dqkv = Dq + 2 * Dkv;
  // Plain Llama layers only (no biases, q/k norms or window: those terms are not modelled here).
  STRATA_CHECK(!c.qkv_bias && !c.o_bias && !c.qk_norm && c.sliding_window == 0);
  const LlamaLayerOffsets o = LlamaLayerOffsetsOf(c);
  const double* w_in = params.data() + o.w_in;
  const double* wqkv = params.data() + o.wqkv;
  const double* wo = params.data() + o.wo;
  const double* w_post = params.data() + o.w_post;
  const double* wgu = params.data() + o.wgu;
  const double* wd = params.data() + o.wd;
  std::vector<double> rstd1(N), xn(N * C), qkv(N * Dqkv), cos_t(T * hs / 2), sin_t(T * hs / 2);
  std::vector<double> lse(N * H), att(N * Dq), x2(N * C), rstd2(N), xn2(N * C), gu(N * 2 * I);
  std::vector<double> h(N * I), dh(N * I), dgu(N * 2 * I), dxn2(N * C), dx2(N * C), datt(N * Dq);
  ops::RmsNormForward(x_in.data(), w_in, c.rms_norm_eps, N, C, xn.data(), rstd1.data());
  ops::MatmulForward<double>(xn.data(), wqkv, kOutIn, nullptr, qkv.data(), N, C, Dqkv);
  ops::RopeTable(LlamaRopeParams(c), T, cos_t.data(), sin_t.data());
  ops::RopeForward(qkv.data(), N, Dqkv, c.num_heads + c.num_kv_heads, c.head_dim, T, cos_t.data(),
                   sin_t.data());
  const ops::AttentionDims ad{B, T, c.num_heads, c.num_kv_heads, c.head_dim, Dqkv};
  ops::AttentionForward(ad, qkv.data(), qkv.data() + Dq, qkv.data() + Dq + Dkv, att.data(),
                        lse.data());
  ops::MatmulForward<double>(att.data(), wo, kOutIn, nullptr, x2.data(), N, Dq, C, x_in.data());
  ops::RmsNormForward(x2.data(), w_post, c.rms_norm_eps, N, C, xn2.data(), rstd2.data());
  ops::MatmulForward<double>(xn2.data(), wgu, kOutIn, nullptr, gu.data(), N, C, 2 * I);
  ops::SwigluForward(gu.data(), N, I, h.data());
  ops::MatmulBackward<double>(h.data(), wd, kOutIn, dy.data(), dh.data(), nullptr, nullptr, N, I,
                              C);
  ops::SwigluBackward(gu.data(), dh.data(), N, I, dgu.data());
  ops::MatmulBackward<double>(xn2.data(), wgu, kOutIn, dgu.data(), dxn2.data(), nullptr, nullptr, N,
                              C, 2 * I);
  ops::RmsNormBackward(x2.data(), w_post, rstd2.data(), dxn2.data(), dy.data(), N, C, dx2.data(),
                       static_cast<double*>(nullptr));
  ops::MatmulBackward<double>(att.data(), wo, kOutIn, dx2.data(), datt.data(), nullptr, nullptr, N,
                              Dq, C);
  // The attention backward's magnitude, in the rotated frame.
  const std::vector<double> mag = terms_bound::AttentionBackwardTerms(
      B, T, c.num_heads, c.num_kv_heads, c.head_dim, Dqkv, Dq, Dq + Dkv, qkv, datt, lse);
  // RoPE's inverse rotation: each element of a pair at most the sum of the pair's magnitudes.
  std::vector<double> pre(N * Dqkv, 0.0);
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t head = 0; head < H + Hkv; ++head) {
      const double* m = mag.data() + r * Dqkv + head * hs;
      double* out = pre.data() + r * Dqkv + head * hs;
      for (int64_t j = 0; j < hs / 2; ++j) out[j] = out[j + hs / 2] = m[j] + m[j + hs / 2];
    }
  }
  // dWqkv (Dqkv, C) = dqkv^T xn: |dqkv|^T |xn| on the q and k rows.
  const std::vector<double> w_terms = terms_bound::AbsTransposedProduct(pre, xn, N, Dqkv, C);
  std::vector<double> terms(params.size(), 0.0);
  std::copy(w_terms.begin(), w_terms.begin() + (Dq + Dkv) * C, terms.begin() + o.wqkv);
  return terms;
}

template <typename S>
class Runner {
 public:
  using F = ComputeType<S>;
  using Blocks = std::vector<std::vector<S>>;

  Runner(const LlamaConfig& c, int B, int T)
      : c_(c),
        B_(B),
        T_(T),
        N_(int64_t{B} * T),
        embedding_scratch_(LlamaEmbeddingScratchBytes<S>(c, B, T)),
        layer_scratch_(LlamaLayerScratchBytes<S>(c, B, T)),
        head_scratch_(LlamaHeadScratchBytes<S>(c, B, T)) {}

  // Forward through every block; keeps the boundary activations and the (B, V) logits.
  F Loss(const Blocks& m, const std::vector<int32_t>& tokens, const int32_t* targets) {
    std::vector<S> x0 = op_test::Poisoned<S>(N_ * c_.hidden_size);
    LlamaEmbeddingForward<S>(c_, m[0].data(), tokens.data(), B_, T_, x0.data());
    return LossFromX0(m, x0, targets);
  }

  F LossFromX0(const Blocks& m, const std::vector<S>& x0, const int32_t* targets) {
    xs_.assign(1, x0);
    for (int l = 0; l < c_.num_layers; ++l) {
      std::vector<S> out = op_test::Poisoned<S>(N_ * c_.hidden_size);
      LlamaLayerForward<S>(c_, m[1 + l].data(), xs_.back().data(), out.data(), B_, T_,
                           layer_scratch_.Poisoned(), {}, nullptr, l);
      layer_scratch_.CheckGuard("LlamaLayerForward");
      xs_.push_back(std::move(out));
    }
    logits_ = op_test::Poisoned<S>(int64_t{B_} * c_.vocab_size);
    const F loss = LlamaHeadForward<S>(c_, m.back().data(), m[0].data(), xs_.back().data(), targets,
                                       B_, T_, logits_.data(), head_scratch_.Poisoned());
    head_scratch_.CheckGuard("LlamaHeadForward");
    return loss;
  }

  // Forward and backward (dloss = 1): grads per block, each block's own contribution; the head's
  // contribution to embed_tokens when tied in *tied_grad (else left empty).
  F Backward(const Blocks& m, const std::vector<int32_t>& tokens,
             const std::vector<int32_t>& targets, Blocks* grads, std::vector<S>* tied_grad,
             std::vector<S>* dx0 = nullptr) {
    const F loss = Loss(m, tokens, targets.data());
    const int64_t act = N_ * c_.hidden_size;
    grads->assign(m.size(), {});
    for (size_t b = 0; b < m.size(); ++b) (*grads)[b] = op_test::Poisoned<S>(m[b].size());
    tied_grad->clear();
    if (c_.tie_embeddings) *tied_grad = op_test::Poisoned<S>(m[0].size());
    std::vector<S> dx = op_test::Poisoned<S>(act);
    LlamaHeadBackward<S>(c_, m.back().data(), m[0].data(), xs_.back().data(), targets.data(), F(1),
                         B_, T_, dx.data(), grads->back().data(),
                         c_.tie_embeddings ? tied_grad->data() : nullptr, head_scratch_.Poisoned());
    head_scratch_.CheckGuard("LlamaHeadBackward");
    douts_.assign(c_.num_layers, {});
    for (int l = c_.num_layers - 1; l >= 0; --l) {
      douts_[l] = dx;
      std::vector<S> dx_in = op_test::Poisoned<S>(act);
      LlamaLayerBackward<S>(c_, m[1 + l].data(), xs_[l].data(), dx.data(), dx_in.data(),
                            (*grads)[1 + l].data(), B_, T_, layer_scratch_.Poisoned(), {}, nullptr,
                            false, l);
      layer_scratch_.CheckGuard("LlamaLayerBackward");
      dx = std::move(dx_in);
    }
    LlamaEmbeddingBackward<S>(c_, tokens.data(), dx.data(), B_, T_, (*grads)[0].data(),
                              embedding_scratch_.Poisoned());
    embedding_scratch_.CheckGuard("LlamaEmbeddingBackward");
    if (dx0 != nullptr) *dx0 = dx;
    return loss;
  }

  const std::vector<S>& logits() const { return logits_; }
  const std::vector<S>& head_input() const { return xs_.back(); }
  // After Backward: layer l's input and the gradient of its output, (B T, C).
  const std::vector<S>& layer_input(int l) const { return xs_[l]; }
  const std::vector<S>& layer_output_grad(int l) const { return douts_[l]; }

 private:
  LlamaConfig c_;
  int B_, T_;
  int64_t N_;
  GuardedScratch embedding_scratch_, layer_scratch_, head_scratch_;
  std::vector<std::vector<S>> xs_, douts_;
  std::vector<S> logits_;
};

template <typename S>
std::vector<std::vector<S>> CastBlocks(const std::vector<std::vector<double>>& m) {
  std::vector<std::vector<S>> out;
  for (const auto& b : m) out.push_back(op_test::Cast<S>(b));
  return out;
}

}  // namespace strata::models::llama_test
