// Model FLOPs of a training step and the utilisation they give (MFU), after Chowdhery et al.
// 2022, "PaLM: Scaling Language Modeling with Pathways", appendix B: per token, 6 FLOPs per
// parameter (forward 2: a multiply and an add per weight; backward 4: the activation gradient 2
// and the weight gradient 2) plus attention's score and value products, 12 L T C (forward
// Q K^T and A V, 2 T C each per layer, times 3 for forward and backward).
//
// What is counted: the forward and backward the model needs, once. The recomputed forward of
// activation checkpointing is NOT counted (it is work the engine chose to do, not work the model
// needs), so MFU is comparable across checkpointing choices and with other trainers. P counts
// every parameter the step computes with, embeddings included (the existing benchmarks' and the
// PyTorch baseline's convention; a tied embedding counts once). Frozen parameters (LoRA's base)
// need the forward and the activation gradient but no weight gradient: 4 each, so a LoRA step is
// counted as the model's forward + backward without the base's weight gradients; the adapters
// are trained parameters (6 each). Attention counts the full T x T products (PaLM's count), not
// the causal half. Exact integers: every factor is a whole number.
//
// The single source of these numbers: the cost model (engine/plan/cost_model.h), `strata train`'s
// progress line and --summary-json, and bench/gpu/bench_train_step.cc call ModelFlopsPerToken.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>

namespace strata::engine {

struct ModelFlopsShape {
  int64_t trained_params = 0;   // P: parameters that get a gradient (LoRA: the adapters)
  int64_t frozen_params = 0;    // parameters without a gradient (LoRA's frozen base)
  int64_t num_layers = 0;       // L: transformer layers
  int64_t attention_width = 0;  // C: heads x head size (the width of Q, K and V per token)
  int64_t seq_len = 0;          // T: tokens per sequence
};

// 6 trained_params + 4 frozen_params + 12 num_layers seq_len attention_width, FLOPs per token.
// nullopt when a field is negative or the count does not fit in 63 bits.
std::optional<int64_t> ModelFlopsPerToken(const ModelFlopsShape& shape);

// Model FLOP utilisation: flops_per_token * tokens_per_second / (peak_TFLOPs * 1e12), a fraction
// (0.41 = 41 %). tokens_per_second: of one device (divide a data-parallel job's by its ranks);
// peak_TFLOPs: the device's dense bf16 peak (MachineProfile::Device::peak_bf16_TFLOPs).
// nullopt when the peak is not positive (unknown: no MFU) or the rate is not finite.
std::optional<double> ModelFlopsUtilisation(int64_t flops_per_token, double tokens_per_second,
                                            double peak_TFLOPs);

}  // namespace strata::engine
