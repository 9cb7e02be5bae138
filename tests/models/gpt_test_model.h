// Test helper: a whole GPT held as per-block chunks and run through the block
// kernels in the order the engine runs them (embedding -> layers -> head, and
// back). Output and scratch buffers are filled with NaN before every call, so
// a kernel that reads before writing, or accumulates instead of overwriting,
// shows up; the scratch has a guard region after LayerScratchElems /
// HeadScratchElems elements that must stay untouched.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "models/gpt_kernels.h"

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

template <typename Real>
Model<Real> CastModel(const Model<double>& m) {
  Model<Real> out{m.shape, {}};
  for (const auto& b : m.blocks) out.blocks.emplace_back(b.begin(), b.end());
  return out;
}

inline std::vector<int32_t> RandomTokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = d(gen);
  return t;
}

template <typename Real>
class Runner {
 public:
  static constexpr int64_t kGuard = 64;

  Runner(const GptShape& s, int B, int T) : s_(s), B_(B), T_(T), N_(int64_t{B} * T) {
    layer_scratch_.resize(LayerScratchElems(s, B, T) + kGuard);
    head_scratch_.resize(HeadScratchElems(s, B, T) + kGuard);
    logits_.resize(N_ * s.vocab_size);
  }

  // Loss from the embedding output x0: (B, T, C). Keeps the logits.
  Real LossFromX0(const Model<Real>& m, const std::vector<Real>& x0, const int32_t* targets) {
    xs_.assign(1, x0);
    for (int l = 0; l < s_.num_layers; ++l) {
      std::vector<Real> out = Poisoned(N_ * s_.channels);
      LayerForward<Real>(s_, m.blocks[1 + l].data(), xs_.back().data(), out.data(), B_, T_,
                         PoisonScratch(layer_scratch_));
      CheckGuard(layer_scratch_, "LayerForward");
      xs_.push_back(std::move(out));
    }
    std::fill(logits_.begin(), logits_.end(), NaN());
    const Real loss = HeadForward<Real>(s_, m.blocks.back().data(), xs_.back().data(), targets, B_,
                                        T_, logits_.data(), PoisonScratch(head_scratch_));
    CheckGuard(head_scratch_, "HeadForward");
    return loss;
  }

  Real Loss(const Model<Real>& m, const std::vector<int32_t>& tokens, const int32_t* targets) {
    return LossFromX0(m, Embed(m, tokens), targets);
  }

  std::vector<Real> Embed(const Model<Real>& m, const std::vector<int32_t>& tokens) {
    std::vector<Real> x0 = Poisoned(N_ * s_.channels);
    EmbeddingForward<Real>(s_, m.blocks[0].data(), tokens.data(), B_, T_, x0.data());
    return x0;
  }

  // Gradients of the mean loss (dloss = 1) for every block, and of the
  // embedding output; returns the loss.
  Real Backward(const Model<Real>& m, const std::vector<int32_t>& tokens,
                const std::vector<int32_t>& targets, std::vector<std::vector<Real>>* grads,
                std::vector<Real>* dx0) {
    const Real loss = Loss(m, tokens, targets.data());
    grads->clear();
    for (const auto& b : m.blocks) grads->push_back(Poisoned(b.size()));
    std::vector<Real> dx = Poisoned(N_ * s_.channels);
    HeadBackward<Real>(s_, m.blocks.back().data(), xs_.back().data(), targets.data(), Real(1), B_,
                       T_, dx.data(), grads->back().data(), logits_.data(),
                       PoisonScratch(head_scratch_));
    CheckGuard(head_scratch_, "HeadBackward");
    for (int l = s_.num_layers - 1; l >= 0; --l) {
      std::vector<Real> dx_in = Poisoned(N_ * s_.channels);
      LayerBackward<Real>(s_, m.blocks[1 + l].data(), xs_[l].data(), dx.data(), dx_in.data(),
                          (*grads)[1 + l].data(), B_, T_, PoisonScratch(layer_scratch_));
      CheckGuard(layer_scratch_, "LayerBackward");
      dx = std::move(dx_in);
    }
    EmbeddingBackward<Real>(s_, tokens.data(), dx.data(), B_, T_, (*grads)[0].data());
    *dx0 = std::move(dx);
    return loss;
  }

  const std::vector<Real>& logits() const { return logits_; }

 private:
  static Real NaN() { return std::numeric_limits<Real>::quiet_NaN(); }
  static std::vector<Real> Poisoned(size_t n) { return std::vector<Real>(n, NaN()); }

  static Real* PoisonScratch(std::vector<Real>& scratch) {
    std::fill(scratch.begin(), scratch.end() - kGuard, NaN());
    std::fill(scratch.end() - kGuard, scratch.end(), Real(12345));
    return scratch.data();
  }
  static void CheckGuard(const std::vector<Real>& scratch, const char* what) {
    for (auto it = scratch.end() - kGuard; it != scratch.end(); ++it) {
      ASSERT_EQ(*it, Real(12345)) << what << " wrote past its scratch size";
    }
  }

  GptShape s_;
  int B_, T_;
  int64_t N_;
  std::vector<Real> layer_scratch_, head_scratch_, logits_;
  std::vector<std::vector<Real>> xs_;  // inputs of layer 0..L-1, then of the head
};

}  // namespace strata::models::test_model
