// The layer-major schedule of a step (Plan::layer_major(), docs/ARCHITECTURE.md "The layer-major
// schedule"), after GreedySnake (Zhang et al., arXiv 2512.17570): every micro-batch passes
// through block b before block b+1 runs, and in backward every micro-batch's backward of block b
// runs before block b-1's. So a block's params are acquired once per pass (loaded once when it
// streams), and its gradient is summed over the micro-batches on the device
// (GradStreamer::AccumulateOnDevice) and crosses PCIe once per step (StreamAccumulated), complete
// as soon as the block's backwards are done: its update during backward can start while the
// earlier blocks' backward still runs.
//
// The same numbers as the micro-batch-major schedule: micro-batch i keeps its dropout seed, its
// d(loss) and its loss slot, and a chunk's contributions are summed in micro-batch order (0
// overwrites, 1.. add, in fp32 as the host fold adds), so an untied model's master weights are
// bit for bit those of MicroBatchMajorPasses. A tied chunk (Model::tied_block) gets its
// contributions in another order: the tying block's of every micro-batch, then its own block's,
// where the micro-batch-major schedule interleaves them; the two sums differ by rounding only
// (tests/engine/layer_major_test.cc bounds it).
#include "engine/engine_impl.h"
#include "engine/micro_batch.h"

namespace strata::engine {

Status Engine::Impl::LayerMajorPasses(std::span<const MicroBatch> mbs,
                                      std::span<const int64_t> loss_tokens,
                                      std::span<const float> dloss, float scale) {
  const int a = static_cast<int>(mbs.size());
  STRATA_CHECK(a == held());
  for (int i = 0; i < a; ++i) {
    STRATA_RETURN_IF_ERROR(
        UploadTokens(mbs[i], o_.micro_batch, /*with_targets=*/true, loss_tokens[i], i));
  }
  // The order blocks are used in: forward 0..n-1 and backward n-1..0, once each.
  std::vector<int> seq = params_->UseOrder(false);
  const std::vector<int> bwd = params_->UseOrder(true);
  seq.insert(seq.end(), bwd.begin(), bwd.end());
  size_t cursor = 0;
  const bool offload = plan_.offload_activations;

  const bool reference = objective_ && objective_->wants_reference();
  for (int b = 0; b < n_; ++b, ++cursor) {
    STRATA_ASSIGN_OR_RETURN(const ParamCache::BlockChunks chunks,
                            params_->AcquireBlock(b, seq, &cursor));
    // Offloaded: the set's previous content (block b-2's outputs) must have been copied out.
    if (offload && b < n_ - 1) STRATA_RETURN_IF_ERROR(compute_->Wait(*act_saved_[b % 2]));
    for (int i = 0; i < a; ++i) {
      if (reference) STRATA_RETURN_IF_ERROR(ReferenceForward(b, chunks, i, o_.micro_batch));
      dropout_seed_ = DropoutSeedOf(i, mbs.size());
      const BlockBuffers buf =
          ForwardBuffers(b, chunks, i, true, o_.micro_batch, /*training=*/true);
      STRATA_RETURN_IF_ERROR(RunBlock(/*backward=*/false, b, buf));
      if (offload && b < n_ - 1) STRATA_RETURN_IF_ERROR(SaveActivation(b, i));
      if (b == n_ - 1) {
        STRATA_RETURN_IF_ERROR(
            compute_->CopyD2H(io_pinned_.span().subspan(LossesOffset() + i * 4, 4), loss_));
        if (objective_) STRATA_RETURN_IF_ERROR(WeighMicroBatch(i, i));
      }
    }
    STRATA_RETURN_IF_ERROR(params_->DoneBlock(chunks, seq, cursor));
  }
  if (policy_) OpenSpeculation(scale);

  for (int b = n_ - 1; b >= 0; --b, ++cursor) {
    const int t = tied(b);
    const bool tied_grads = t >= 0 && np(t) > 0;
    // Chunks whose optimizer is on the CPU sum on the device (with one rank); the others add
    // every contribution into their device gradient (GradStreamer::Stream), and data-parallel
    // ranks reduce-scatter each one as the micro-batch-major schedule does.
    const bool sum_own = plan_.device_grad_accumulators && np(b) > 0 && !grads_->on_device(b);
    const bool sum_tied = plan_.device_grad_accumulators && tied_grads && !grads_->on_device(t);
    STRATA_ASSIGN_OR_RETURN(const ParamCache::BlockChunks chunks,
                            params_->AcquireBlock(b, seq, &cursor));
    // Offloaded: block b-1's outputs were loaded back (LoadActivation) one block ahead, except
    // those of blocks n-2 and n-3, still on the device after forward.
    if (offload && b > 0 && b - 1 <= n_ - 4) {
      STRATA_RETURN_IF_ERROR(compute_->Wait(*act_ready_[(b - 1) % 2]));
    }
    const bool cpu_update = policy_ && !plan_.blocks[b].optimizer_on_device;
    for (int i = 0; i < a; ++i) {
      const bool first = i == 0, last = i + 1 == a;
      dropout_seed_ = DropoutSeedOf(i, mbs.size());
      STRATA_ASSIGN_OR_RETURN(const BlockBuffers buf, BackwardBuffers(b, chunks, i, dloss[i]));
      STRATA_RETURN_IF_ERROR(RunBlock(/*backward=*/true, b, buf));
      // In NextBucket's order: the block's own chunk, then the tied one.
      if (chunks.own) {
        if (sum_own) {
          STRATA_RETURN_IF_ERROR(grads_->AccumulateOnDevice(b, first));
        } else {
          // The fold may submit b's update during this backward.
          if (cpu_update && last) params_->Invalidate(b);
          STRATA_RETURN_IF_ERROR(grads_->Stream(b, first && tied_user_[b] < 0, last));
        }
      }
      if (tied_grads) {
        STRATA_RETURN_IF_ERROR(sum_tied ? grads_->AccumulateOnDevice(t, first)
                                        : grads_->Stream(t, first, /*last=*/false));
      }
    }
    if (offload && b > 0) {
      STRATA_RETURN_IF_ERROR(compute_->Record(*act_free_[(b - 1) % 2]));
      // Block b's backwards were the last readers of set (b-1) % 2: bring block b-3's outputs
      // back into it.
      if (b - 3 >= 0) STRATA_RETURN_IF_ERROR(LoadActivation(b - 3));
    }
    // One D2H per chunk: chunk b's sum starts its accumulator unless its tying block's sum came
    // first; the tied chunk's sum is the first of its two.
    if (sum_own) {
      if (cpu_update) params_->Invalidate(b);
      STRATA_RETURN_IF_ERROR(grads_->StreamAccumulated(b, tied_user_[b] < 0, /*last=*/true));
    }
    if (sum_tied) STRATA_RETURN_IF_ERROR(grads_->StreamAccumulated(t, true, /*last=*/false));
    STRATA_RETURN_IF_ERROR(params_->DoneBlock(chunks, seq, cursor));
  }
  return Status::Ok();
}

}  // namespace strata::engine
