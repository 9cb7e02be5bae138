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
#include "tests/models/llama_op_test_util.h"

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
                           layer_scratch_.Poisoned());
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
    for (int l = c_.num_layers - 1; l >= 0; --l) {
      std::vector<S> dx_in = op_test::Poisoned<S>(act);
      LlamaLayerBackward<S>(c_, m[1 + l].data(), xs_[l].data(), dx.data(), dx_in.data(),
                            (*grads)[1 + l].data(), B_, T_, layer_scratch_.Poisoned());
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

 private:
  LlamaConfig c_;
  int B_, T_;
  int64_t N_;
  GuardedScratch embedding_scratch_, layer_scratch_, head_scratch_;
  std::vector<std::vector<S>> xs_;
  std::vector<S> logits_;
};

template <typename S>
std::vector<std::vector<S>> CastBlocks(const std::vector<std::vector<double>>& m) {
  std::vector<std::vector<S>> out;
  for (const auto& b : m) out.push_back(op_test::Cast<S>(b));
  return out;
}

}  // namespace strata::models::llama_test
