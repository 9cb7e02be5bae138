// Objectives over whole sequences (preference training: DPO, IPO, SimPO) on the engine's
// next-token head.
//
// Such an objective is a function of each completion's summed log-probability
// log p(y | x) = -sum_t CE_t over the completion's targets t, so its gradient reaches the logits
// as a weighted cross-entropy: d(objective)/d(logits_t) = w_t d(CE_t)/d(logits_t) with
// w_t = d(objective)/d(CE_t), the same for every target of one completion. The engine runs each
// micro-batch's forward as usual, hands the head's per-target cross-entropy (and the frozen
// reference's, when asked) to the objective, which returns the weights, and runs the backward
// of sum_t w_t CE_t (BlockBuffers::target_losses, target_weights). With every completion of a
// pair in one micro-batch the weights of a micro-batch depend on it alone, so nothing else of
// the step needs to wait.
//
// The reference (Rafailov et al. 2023, "Direct Preference Optimization", section 4): with a
// model whose frozen parameters alone are the reference (Model::has_frozen_reference: LoRA's
// base, adapters off) and PlacementOptions::objective.reference_forward, the engine computes the
// reference's per-target cross-entropy in the same pass over each block: while a block's chunks
// are on the device its reference forward (BlockBuffers::frozen_reference, on the reference's own
// boundary activations) runs just before its training forward, so a streamed base is read once
// per step for both.
//
// Thread-safety: an objective is called from the thread driving Engine::Step only.
#pragma once

#include <cstddef>
#include <span>

#include "base/status.h"

namespace strata::engine {

class SequenceObjective {
 public:
  virtual ~SequenceObjective() = default;

  // Whether Weigh needs the frozen reference's per-target cross-entropy (the plan must then have
  // PlacementOptions::objective.reference_forward; Step returns kFailedPrecondition otherwise).
  virtual bool wants_reference() const = 0;

  // Called by Engine::Step on its driving thread once per micro-batch, in micro-batch order
  // (index `micro_batch` of the step's span), after the head's forward of it and before its
  // backward. policy: (B, T) fp32, the cross-entropy -log p(target) of each position under the
  // trained model (0 where the target is kIgnoreTarget); reference: (B, T) fp32 likewise under
  // the frozen reference, or empty when !wants_reference(). Fills weights (B, T, OVERWRITTEN):
  // d(step objective)/d(CE_t) for each position (0 where the target is ignored), without the loss
  // scale (the engine multiplies it in). Returns this micro-batch's share of the step's objective
  // (Step sums the shares, in micro-batch order, into StepResult::loss). The spans live for the
  // call only. An error fails the step before its backward (the step then updates nothing) and
  // comes back from Step as it is.
  virtual StatusOr<double> Weigh(size_t micro_batch, std::span<const float> policy,
                                 std::span<const float> reference, std::span<float> weights) = 0;
};

}  // namespace strata::engine
