// Test helper: a whole GPT held as per-block chunks and run through the block
// kernels in the order the engine runs them (embedding -> layers -> head, and
// back). Output and scratch buffers are filled with NaN before every call, so
// a kernel that reads before writing, or accumulates instead of overwriting,
// shows up; each scratch has a guard region after its *ScratchBytes that must
// stay untouched. Templated on the storage type S (float, double, Bf16, Fp16).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "models/gpt_kernels.h"
#include "models/gpt_layout.h"
#include "models/ops/attention.h"
#include "models/ops/gelu.h"
#include "models/ops/layer_norm.h"
#include "models/ops/matmul.h"
#include "tests/models/terms_bound.h"

namespace strata::models::test_model {

template <typename Real>
struct Model {
  GptShape shape;
  std::vector<std::vector<Real>> blocks;  // 0 embedding, 1..L layers, L+1 head
};

inline std::vector<TensorInfo> BlockTensors(const GptShape& s, size_t block) {
  if (block == 0) return EmbeddingTensors(s);
  if (block == static_cast<size_t>(s.num_layers) + 1) return HeadTensors(s);
  return LayerTensors(s);
}

inline std::string BlockName(const GptShape& s, size_t block) {
  if (block == 0) return "embedding";
  if (block == static_cast<size_t>(s.num_layers) + 1) return "head";
  return "layer" + std::to_string(block - 1);
}

// Random parameters large enough that every nonlinearity is exercised:
// matrices with unit-variance outputs, LayerNorm weights around 1, nonzero
// biases, O(1) embeddings.
inline Model<double> RandomModel(const GptShape& s, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  Model<double> m{s, {}};
  for (size_t b = 0; b < static_cast<size_t>(s.num_layers) + 2; ++b) {
    const std::vector<TensorInfo> tensors = BlockTensors(s, b);
    std::vector<double> chunk(tensors.back().offset + tensors.back().num_elems);
    for (const TensorInfo& t : tensors) {
      const bool is_ln = t.name.rfind("ln", 0) == 0;
      const bool is_bias = t.name.size() > 2 && t.name.substr(t.name.size() - 2) == "_b";
      for (int64_t i = 0; i < t.num_elems; ++i) {
        double v;
        if (t.name == "wte" || t.name == "wpe") {
          v = u(gen);
        } else if (is_ln && !is_bias) {
          v = 1.0 + 0.3 * u(gen);
        } else if (is_bias) {
          v = 0.2 * u(gen);
        } else {
          v = std::sqrt(3.0 / static_cast<double>(t.shape[0])) * u(gen);
        }
        chunk[t.offset + i] = v;
      }
    }
    m.blocks.push_back(std::move(chunk));
  }
  return m;
}

// A double value stored as S: one rounding (through fp32 for the 16-bit types).
template <typename S>
S FromDouble(double v) {
  if constexpr (std::is_same_v<S, double>) {
    return v;
  } else {
    return FromFloat<S>(static_cast<float>(v));
  }
}

template <typename S>
double ToDouble(S v) {
  return static_cast<double>(ToFloat(v));
}

template <typename S>
std::vector<S> CastVector(const std::vector<double>& v) {
  std::vector<S> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FromDouble<S>(v[i]);
  return out;
}

template <typename S>
std::vector<double> ToDoubles(const std::vector<S>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = ToDouble(v[i]);
  return out;
}

template <typename S>
Model<S> CastModel(const Model<double>& m) {
  Model<S> out{m.shape, {}};
  for (const auto& b : m.blocks) out.blocks.push_back(CastVector<S>(b));
  return out;
}

// The values of a model stored as S, in double: the reference's inputs for an S run.
template <typename S>
Model<double> RoundedModel(const Model<double>& m) {
  Model<double> out{m.shape, {}};
  for (const auto& b : m.blocks) out.blocks.push_back(ToDoubles(CastVector<S>(b)));
  return out;
}

inline std::vector<int32_t> RandomTokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = d(gen);
  return t;
}

// Scratch of `size_bytes` poisoned with all-ones bytes (NaN in every storage type) before each
// call, followed by a guard region that must stay untouched.
class GuardedScratch {
 public:
  static constexpr size_t kGuardBytes = 64;
  static constexpr unsigned char kGuardByte = 0xa5;

  explicit GuardedScratch(int64_t size_bytes)
      : size_bytes_(static_cast<size_t>(size_bytes)),
        words_((size_bytes_ + kGuardBytes + sizeof(double) - 1) / sizeof(double)) {}

  void* Poisoned() {
    auto* p = reinterpret_cast<unsigned char*>(words_.data());
    std::memset(p, 0xff, size_bytes_);
    std::memset(p + size_bytes_, kGuardByte, kGuardBytes);
    return p;
  }
  void CheckGuard(const char* what) const {
    const auto* p = reinterpret_cast<const unsigned char*>(words_.data());
    for (size_t i = 0; i < kGuardBytes; ++i) {
      ASSERT_EQ(p[size_bytes_ + i], kGuardByte) << what << " wrote past its scratch size";
    }
  }

 private:
  size_t size_bytes_;
  std::vector<double> words_;  // 8-byte aligned
};

// n values of S with all bits set (NaN in every storage type).
template <typename S>
std::vector<S> PoisonedVector(size_t n) {
  std::vector<S> v(n);
  std::memset(v.data(), 0xff, n * sizeof(S));
  return v;
}

template <typename S>
class Runner {
 public:
  using F = ComputeType<S>;

  Runner(const GptShape& s, int B, int T)
      : s_(s),
        B_(B),
        T_(T),
        N_(int64_t{B} * T),
        embedding_scratch_(GptEmbeddingScratchBytes<S>(s, B, T)),
        layer_scratch_(GptLayerScratchBytes<S>(s, B, T)),
        head_scratch_(GptHeadScratchBytes<S>(s, B, T)) {
    logits_.resize(int64_t{B} * s.vocab_size);
  }

  // Loss from the embedding output x0: (B, T, C). Keeps the last-position logits (B, V).
  F LossFromX0(const Model<S>& m, const std::vector<S>& x0, const int32_t* targets) {
    xs_.assign(1, x0);
    for (int l = 0; l < s_.num_layers; ++l) {
      std::vector<S> out = PoisonedVector<S>(N_ * s_.channels);
      GptLayerForward<S>(s_, m.blocks[1 + l].data(), xs_.back().data(), out.data(), B_, T_,
                         layer_scratch_.Poisoned());
      layer_scratch_.CheckGuard("GptLayerForward");
      xs_.push_back(std::move(out));
    }
    logits_ = PoisonedVector<S>(logits_.size());
    const F loss = GptHeadForward<S>(s_, m.blocks.back().data(), xs_.back().data(), targets, B_, T_,
                                     logits_.data(), head_scratch_.Poisoned(), Tied(m));
    head_scratch_.CheckGuard("GptHeadForward");
    return loss;
  }

  F Loss(const Model<S>& m, const std::vector<int32_t>& tokens, const int32_t* targets) {
    return LossFromX0(m, Embed(m, tokens), targets);
  }

  std::vector<S> Embed(const Model<S>& m, const std::vector<int32_t>& tokens) {
    std::vector<S> x0 = PoisonedVector<S>(N_ * s_.channels);
    GptEmbeddingForward<S>(s_, m.blocks[0].data(), tokens.data(), B_, T_, x0.data());
    return x0;
  }

  // Gradients of the mean loss (dloss = 1) for every block, and of the
  // embedding output; returns the loss.
  F Backward(const Model<S>& m, const std::vector<int32_t>& tokens,
             const std::vector<int32_t>& targets, std::vector<std::vector<S>>* grads,
             std::vector<S>* dx0) {
    const F loss = Loss(m, tokens, targets.data());
    grads->clear();
    for (const auto& b : m.blocks) grads->push_back(PoisonedVector<S>(b.size()));
    std::vector<S> dx = PoisonedVector<S>(N_ * s_.channels);
    head_tied_grads_.clear();
    if (s_.tie_embeddings) head_tied_grads_ = PoisonedVector<S>(m.blocks[0].size());
    GptHeadBackward<S>(s_, m.blocks.back().data(), xs_.back().data(), targets.data(), F(1), B_, T_,
                       dx.data(), grads->back().data(), head_scratch_.Poisoned(), Tied(m),
                       s_.tie_embeddings ? head_tied_grads_.data() : nullptr);
    head_scratch_.CheckGuard("GptHeadBackward");
    douts_.assign(s_.num_layers, {});
    for (int l = s_.num_layers - 1; l >= 0; --l) {
      douts_[l] = dx;
      std::vector<S> dx_in = PoisonedVector<S>(N_ * s_.channels);
      GptLayerBackward<S>(s_, m.blocks[1 + l].data(), xs_[l].data(), dx.data(), dx_in.data(),
                          (*grads)[1 + l].data(), B_, T_, layer_scratch_.Poisoned());
      layer_scratch_.CheckGuard("GptLayerBackward");
      dx = std::move(dx_in);
    }
    GptEmbeddingBackward<S>(s_, tokens.data(), dx.data(), B_, T_, (*grads)[0].data(),
                            embedding_scratch_.Poisoned());
    embedding_scratch_.CheckGuard("GptEmbeddingBackward");
    *dx0 = std::move(dx);
    return loss;
  }

  // With tied embeddings: the head's gradient contribution to the embedding chunk (dwte, zero
  // wpe) of the last Backward; grads[0] is the embedding block's own. Empty when untied.
  const std::vector<S>& head_tied_grads() const { return head_tied_grads_; }
  const std::vector<S>& logits() const { return logits_; }         // (B, V) last positions
  const std::vector<S>& head_input() const { return xs_.back(); }  // (B, T, C)
  // After Backward: layer l's input and the gradient of its output, (B, T, C).
  const std::vector<S>& layer_input(int l) const { return xs_[l]; }
  const std::vector<S>& layer_output_grad(int l) const { return douts_[l]; }

 private:
  GptShape s_;
  int B_, T_;
  int64_t N_;
  GuardedScratch embedding_scratch_, layer_scratch_, head_scratch_;
  const S* Tied(const Model<S>& m) const {
    return s_.tie_embeddings ? m.blocks[0].data() : nullptr;
  }

  std::vector<S> logits_;
  std::vector<S> head_tied_grads_;
  std::vector<std::vector<S>> xs_;     // inputs of layer 0..L-1, then of the head
  std::vector<std::vector<S>> douts_;  // gradients of the layers' outputs (last Backward)
};

// The magnitude of the terms that cancel in a layer's attn_qkv_w and attn_qkv_b gradients
// (terms_bound.h), as a vector over the layer chunk (zero elsewhere): the layer's forward and its
// backward down to the attention output gradient dO recomputed in double with the host ops (the
// layer's own op calls, models/gpt_kernels.cc), the attention backward with absolute values
// (terms_bound::AttentionBackwardTerms: dS = P (dP - D) cancels exactly with one key, and the key
// bias's gradient is zero for every T), then dWqkv = ln1^T dqkv gives |ln1|^T |dqkv| and dbqkv
// the column sums of |dqkv|. x_in and dy: the layer's input and its output's gradient, (B T, C).
inline std::vector<double> AttentionQkvTerms(const GptShape& s, const std::vector<double>& params,
                                             const std::vector<double>& x_in,
                                             const std::vector<double>& dy, int B, int T) {
  using ops::WeightLayout;
  constexpr WeightLayout kInOut = WeightLayout::kInOut;
  const int64_t N = int64_t{B} * T, C = s.channels, H = s.num_heads, hs = C / H;
  const LayerParams<const double*> p(params.data(), C);
  std::vector<double> mean1(N), rstd1(N), ln1(N * C), qkv(N * 3 * C), lse(N * H), att(N * C);
  std::vector<double> x2(N * C), mean2(N), rstd2(N), ln2(N * C), h(N * 4 * C), g(N * 4 * C);
  std::vector<double> dh(N * 4 * C), dln2(N * C), dx2(N * C), datt(N * C);
  const double eps = s.layer_norm_eps;
  ops::LayerNormForward(x_in.data(), p.ln1_w, p.ln1_b, eps, N, C, ln1.data(), mean1.data(),
                        rstd1.data());
  ops::MatmulForward<double>(ln1.data(), p.qkv_w, kInOut, p.qkv_b, qkv.data(), N, C, 3 * C);
  const ops::AttentionDims ad{B, T, s.num_heads, s.num_heads, static_cast<int>(hs), 3 * C};
  ops::AttentionForward(ad, qkv.data(), qkv.data() + C, qkv.data() + 2 * C, att.data(), lse.data());
  ops::MatmulForward<double>(att.data(), p.attn_proj_w, kInOut, p.attn_proj_b, x2.data(), N, C, C,
                             x_in.data());
  ops::LayerNormForward(x2.data(), p.ln2_w, p.ln2_b, eps, N, C, ln2.data(), mean2.data(),
                        rstd2.data());
  ops::MatmulGeluForward<double>(ln2.data(), p.fc_w, kInOut, p.fc_b, h.data(), g.data(), N, C,
                                 4 * C);
  ops::MatmulGeluBackward<double>(g.data(), p.mlp_proj_w, kInOut, dy.data(), h.data(), dh.data(),
                                  nullptr, nullptr, N, 4 * C, C);
  ops::MatmulBackward<double>(ln2.data(), p.fc_w, kInOut, dh.data(), dln2.data(), nullptr, nullptr,
                              N, C, 4 * C);
  ops::LayerNormBackward<double>(x2.data(), p.ln2_w, mean2.data(), rstd2.data(), dln2.data(),
                                 dy.data(), N, C, dx2.data(), nullptr, nullptr);
  ops::MatmulBackward<double>(att.data(), p.attn_proj_w, kInOut, dx2.data(), datt.data(), nullptr,
                              nullptr, N, C, C);
  const std::vector<double> mag = terms_bound::AttentionBackwardTerms(
      B, T, s.num_heads, s.num_heads, static_cast<int>(hs), 3 * C, C, 2 * C, qkv, datt, lse);
  const std::vector<double> w_terms = terms_bound::AbsTransposedProduct(ln1, mag, N, C, 3 * C);
  const std::vector<double> b_terms =
      terms_bound::AbsTransposedProduct(std::vector<double>(N, 1.0), mag, N, 1, 3 * C);
  std::vector<double> terms(params.size(), 0.0);
  std::copy(w_terms.begin(), w_terms.end(), terms.begin() + (p.qkv_w - params.data()));
  std::copy(b_terms.begin(), b_terms.end(), terms.begin() + (p.qkv_b - params.data()));
  return terms;
}

// The magnitude of the terms that cancel in each head parameter gradient (terms_bound.h), in
// double from the S-rounded inputs: lnf = LN(x) (xhat its normalized rows), dlogits = (softmax -
// onehot) / N, dlnf = dlogits Wlm^T whose terms are T_dlnf(r, c) = sum_v |dlogit_rv W_cv|; then
//   dlnf_w[c]: sum_r T_dlnf(r, c) |xhat_rc|,  dlnf_b[c]: sum_r T_dlnf(r, c),
//   dWlm[c, v]: sum_r |lnf_rc dlogit_rv|.
// dlnf_w and dlnf_b are sums over the N rows of dlnf values of both signs (about 1e-3 each here,
// their sums about 1e-2): the few that cancel to a small value (a few 1e-4) keep the rounding
// error of their 128 terms, which k u (|ref| + rms) alone does not cover.
inline std::vector<double> HeadParamTerms(const GptShape& s, const std::vector<double>& ph,
                                          const std::vector<double>& x,
                                          const std::vector<int32_t>& tgt, int64_t N) {
  const int64_t C = s.channels, V = s.vocab_size;
  std::vector<double> terms(2 * C + C * V, 0.0), xhat(C), lnf(C), dlogit(V), t_dlnf(C);
  const double* w = ph.data() + 2 * C;  // Wlm (C, V)
  for (int64_t r = 0; r < N; ++r) {
    double mean = 0, var = 0;
    for (int64_t c = 0; c < C; ++c) mean += x[r * C + c] / static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) var += (x[r * C + c] - mean) * (x[r * C + c] - mean);
    const double rstd = 1.0 / std::sqrt(var / static_cast<double>(C) + s.layer_norm_eps);
    for (int64_t c = 0; c < C; ++c) {
      xhat[c] = (x[r * C + c] - mean) * rstd;
      lnf[c] = xhat[c] * ph[c] + ph[C + c];
    }
    double mx = -INFINITY;
    for (int64_t v = 0; v < V; ++v) {
      double z = 0;
      for (int64_t c = 0; c < C; ++c) z += lnf[c] * w[c * V + v];
      dlogit[v] = z;
      mx = std::max(mx, z);
    }
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(dlogit[v] - mx);
    for (int64_t v = 0; v < V; ++v) {
      dlogit[v] =
          (std::exp(dlogit[v] - mx) / sum - (v == tgt[r] ? 1.0 : 0.0)) / static_cast<double>(N);
    }
    for (int64_t c = 0; c < C; ++c) {
      double t = 0;
      for (int64_t v = 0; v < V; ++v) {
        t += std::abs(dlogit[v] * w[c * V + v]);
        terms[2 * C + c * V + v] += std::abs(lnf[c] * dlogit[v]);
      }
      terms[c] += t * std::abs(xhat[c]);
      terms[C + c] += t;
    }
  }
  return terms;
}

}  // namespace strata::models::test_model
