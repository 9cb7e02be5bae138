// One micro-batch of training data as the engine takes it, its validation, and how the losses
// of a step's micro-batches combine when some targets do not count (instruction data: the loss
// counts response tokens only; packing: an example's last token predicts nothing).
//
// The step's objective is the mean cross-entropy over every counted target of the step: micro-
// batch i, with c_i counted targets of C = sum c_i, has mean loss L_i and weight c_i / C, so the
// step's loss is sum_i (c_i / C) L_i and the gradient of micro-batch i is scaled by c_i / C
// (Hugging Face transformers' num_items_in_batch for gradient accumulation; the plain mean of
// the micro-batches' means when every target counts). Data parallel ranks each weigh their own
// micro-batches so, and the ranks' means are averaged.
//
// Thread-safety: plain functions of their arguments.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"
#include "engine/plan/model.h"

namespace strata::engine {

// Token ids in host memory, (B, T) int32 each, row-major; the caller keeps them alive for the
// call that takes them.
struct MicroBatch {
  std::span<const int32_t> tokens;
  // Next-token ids, or kIgnoreTarget where the loss does not count that position.
  std::span<const int32_t> targets;
  // Empty, or (B, T) positions of packed examples (BlockBuffers::position_ids: each row starts at
  // 0; each value is 0, where an example starts, or the previous one plus 1).
  std::span<const int32_t> position_ids = {};
};

// Checks `mb` against the shape (B T tokens, targets when with_targets, position ids when given)
// and the vocabulary, and returns the number of counted targets (0 without targets).
// Errors (kInvalidArgument, one line with the offending index): a size other than B T, a token
// outside [0, vocab), a target outside [0, vocab) other than kIgnoreTarget, a position id that
// breaks the rule above.
StatusOr<int64_t> CheckMicroBatch(const MicroBatch& mb, MicroBatchShape shape, int vocab,
                                  bool with_targets);

// CheckMicroBatch (with targets) of each of a step's micro-batches: their counted targets.
StatusOr<std::vector<int64_t>> CheckMicroBatches(std::span<const MicroBatch> mbs,
                                                 MicroBatchShape shape, int vocab);

// BlockBuffers::dropout_seed of micro-batch i of step `step` for the run's seed: SplitMix64
// (Steele et al., "Fast splittable pseudorandom number generators", 2014) mixes, never 0. A
// function of (seed, step, i) only, so that a resumed run draws the same; i is the micro-batch's
// index in the global batch (with data parallelism, rank r's micro-batch j of A is r A + j), so
// that any number of ranks draws the same masks.
uint64_t MicroBatchDropoutSeed(uint64_t seed, int64_t step, size_t i);

// The d(objective)/d(mean loss) of each of this rank's n micro-batches for a step with these
// counted targets c_i, including the loss scale, over `world` ranks whose micro-batches count
// `job_loss_tokens` targets in all (C: the sum of every rank's c_i, all-reduced; sum(c_i) with
// one rank): scale / (n world) each when every micro-batch of every rank counts all of its B T
// targets (C = n world B T: exactly today's weights), else scale c_i / C (in double, rounded
// once to float). The ranks' gradients are summed, so the step's gradient is that of the mean
// over the whole job's counted targets, as one rank accumulating them all computes it, whatever
// the rank count (transformers' num_items_in_batch, gathered across devices); a rank whose
// micro-batches count none contributes nothing.
// Errors: kInvalidArgument when no target of the step counts on any rank (nothing to learn from:
// the data is all prompt or padding), or job_loss_tokens below this rank's own sum.
StatusOr<std::vector<float>> MicroBatchLossWeights(std::span<const int64_t> loss_tokens,
                                                   int64_t tokens_per_micro_batch, float scale,
                                                   int world, int64_t job_loss_tokens);

// The step's loss from the micro-batches' mean losses: their plain mean (float, in order) when
// every target counts, else sum_i c_i L_i / C in double.
float StepLoss(std::span<const float> losses, std::span<const int64_t> loss_tokens,
               int64_t tokens_per_micro_batch);

}  // namespace strata::engine
