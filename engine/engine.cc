#include "engine/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "base/logging.h"
#include "base/trace.h"
#include "base/units.h"
#include "cpu_optim/grad_stats.h"
#include "engine/engine_impl.h"
#include "engine/plan/optimizer_state.h"

namespace strata::engine {

Status Engine::Impl::Init() {
  STRATA_RETURN_IF_ERROR(CheckBlocks());
  STRATA_RETURN_IF_ERROR(CheckOptions());
  // The update during backward speculates on the CPU-optimized blocks; their backups are sized
  // once the store knows each block's bytes.
  if (o_.update_during_backward && o_.overlap && !o_.inference_only &&
      plan_.device_optimizer_params < model_->num_params()) {
    policy_ =
        std::make_unique<SpeculationPolicy>(n_, o_.grad_clip_norm, o_.test_hooks.always_speculate);
  }
  STRATA_RETURN_IF_ERROR(CreateStateStore());
  STRATA_ASSIGN_OR_RETURN(arena_, device_->CreateArena(plan_.device_total_bytes));
  const TraceTracks tracks = RegisterTraceTracks();
  STRATA_RETURN_IF_ERROR(CreateStreams());
  STRATA_ASSIGN_OR_RETURN(const PartRegions regions, CarveDeviceRegions());
  STRATA_RETURN_IF_ERROR(CreateGradStreamer(regions, tracks.fold));
  STRATA_RETURN_IF_ERROR(CreateParamCache(regions, tracks.load));
  STRATA_RETURN_IF_ERROR(AllocateHostMemory());
  checkpoint_ = std::make_unique<EngineCheckpoint>(*model_, plan_, o_.precision, o_.inference_only,
                                                   o_.optimizer, store_.get(), o_.comm);
  return store_->Initialize(*model_, o_.seed);
}

Status Engine::Impl::CheckBlocks() {
  if (n_ < 2) return InvalidArgumentError("a model needs at least two blocks");
  tied_.assign(n_, -1);
  tied_user_.assign(n_, -1);
  for (int b = 0; b < n_; ++b) {
    const int t = model_->tied_block(b);
    if (t == -1) continue;
    if (t < 0 || t >= b || model_->tied_block(t) != -1 || tied_user_[t] != -1) {
      return InvalidArgumentError(fmt::format(
          "block {} ('{}') ties block {}: a tied chunk must belong to an earlier block that ties "
          "nothing itself, and be tied by one block only",
          b, model_->block_name(b), t));
    }
    if (np(t) == 0 && model_->block_frozen_params(t) == 0) {
      return InvalidArgumentError(
          fmt::format("block {} ties block {}, which has no parameters", b, t));
    }
    tied_[b] = t;
    // The tying block's gradient folds into the tied chunk's accumulator; a frozen chunk has none.
    if (np(t) > 0) tied_user_[t] = b;
  }
  return Status::Ok();
}

Status Engine::Impl::CheckOptions() const {
  if (o_.grad_accum_steps < 1) return InvalidArgumentError("`grad_accum_steps` must be >= 1");
  STRATA_RETURN_IF_ERROR(cpu_optim::Validate(o_.optimizer));
  if (dp()) {
    if (o_.update_during_backward || o_.inference_only) {
      return InvalidArgumentError(
          "data parallelism needs the update after backward (`update_during_backward off`) and a "
          "training engine");
    }
    if (world() > 1 && !PartitionableOptimizer(o_.optimizer)) {
      return InvalidArgumentError(fmt::format(
          "`optimizer {}` keeps state that does not split into per-rank partitions (block-wise "
          "or factored statistics); with more than one rank use adamw, adam, lion, sgd or adagrad",
          OptimizerFlagName(o_.optimizer)));
    }
  }
  if (!o_.inference_only && model_->num_params() == 0) {
    return InvalidArgumentError(
        "every parameter of this model is frozen: nothing to train (an inference-only engine "
        "evaluates it)");
  }
  if (o_.inference_only && (nvme_params() || nvme_optim())) {
    return InvalidArgumentError(
        "inference keeps the working params on the device or in pinned host memory and has no "
        "optimizer state: use `param_home device|host` and no NVMe optimizer");
  }
  return Status::Ok();
}

Status Engine::Impl::CreateStateStore() {
  StateStoreOptions so;
  so.precision = o_.precision;
  so.optimizer = &o_.optimizer;
  so.inference_only = o_.inference_only;
  so.data_parallel = dp();
  so.decay_norms_and_biases = o_.decay_norms_and_biases;
  so.io = o_.io;
  so.nvme_paths = o_.placement.nvme_paths;
  so.io_backend_factory = o_.test_hooks.io_backend_factory;
  so.gradient = [this](int b) { return grads_->HostGradient(b); };
  so.init_progress = o_.init_progress;
  so.cancel_requested = o_.cancel_requested;
  so.speculate = policy_ != nullptr;
  so.finish_speculation_before_verdict = o_.test_hooks.finish_speculation_before_verdict;
  STRATA_ASSIGN_OR_RETURN(store_, StateStore::Create(*model_, plan_, so));
  return Status::Ok();
}

Engine::Impl::TraceTracks Engine::Impl::RegisterTraceTracks() {
  TraceTracks tracks;
  if (o_.trace) {
    tracks.load = o_.trace->RegisterTrack("host: prefetch (nvme read)");
    tracks.fold = o_.trace->RegisterTrack("host: gradient fold");
    tracks.read = o_.trace->RegisterTrack("host: optimizer state read");
    tracks.update = o_.trace->RegisterTrack("host: cpu optimizer");
    tracks.write = o_.trace->RegisterTrack("host: optimizer state write");
  }
  store_->SetTrace(o_.trace, tracks.read, tracks.update, tracks.write);
  return tracks;
}

Status Engine::Impl::CreateStreams() {
  STRATA_ASSIGN_OR_RETURN(compute_, device_->CreateStream("compute"));
  // What the model's kernels need beyond the arena is taken now, never inside a step.
  STRATA_RETURN_IF_ERROR(model_->PrepareComputeStream(*compute_));
  STRATA_ASSIGN_OR_RETURN(h2d_, device_->CreateStream("h2d"));
  STRATA_ASSIGN_OR_RETURN(d2h_, device_->CreateStream("d2h"));
  return Status::Ok();
}

StatusOr<Engine::Impl::PartRegions> Engine::Impl::CarveDeviceRegions() {
  // Carve exactly the planner's regions, in its order.
  const MicroBatchShape shape = o_.micro_batch;
  const uint64_t act_bytes = static_cast<uint64_t>(model_->activation_elems(shape)) * w_;
  size_t r = 0;
  const auto& regions = plan_.device_regions;
  auto next = [&]() {
    const DeviceRegion& region = regions[r++];
    return arena_->Carve(region.size_bytes, region.label);
  };
  STRATA_ASSIGN_OR_RETURN(auto tt, next());
  const uint64_t tb = shape.tokens() * 4;  // one slot's tokens, targets or position ids
  batch_.resize(held());
  for (int i = 0; i < held(); ++i) {
    batch_[i].tokens = tt.subspan(3 * i * tb, tb);
    batch_[i].targets = tt.subspan((3 * i + 1) * tb, tb);
    batch_[i].position_ids = tt.subspan((3 * i + 2) * tb, tb);
  }
  STRATA_ASSIGN_OR_RETURN(loss_, next());
  STRATA_ASSIGN_OR_RETURN(auto acts, next());
  const int num_acts = (plan_.offload_activations ? 2 : n_ - 1) * held();
  for (int b = 0; b < num_acts; ++b) acts_.push_back(acts.subspan(b * act_bytes, act_bytes));
  if (plan_.offload_activations) STRATA_RETURN_IF_ERROR(CreateActivationOffload(act_bytes));
  STRATA_ASSIGN_OR_RETURN(auto dx, next());
  for (int i = 0; i < 2 * held(); ++i) dx_.push_back(dx.subspan(i * act_bytes, act_bytes));
  STRATA_ASSIGN_OR_RETURN(auto logits, next());
  logits_ = logits.subspan(0, static_cast<size_t>(model_->logits_elems(shape)) * w_);
  STRATA_ASSIGN_OR_RETURN(scratch_, next());
  if (plan_.workspace_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(workspace_, next());
  }
  PartRegions parts;
  STRATA_ASSIGN_OR_RETURN(parts.grad_buckets, next());
  if (plan_.device_grad_accumulators) {
    STRATA_ASSIGN_OR_RETURN(parts.grad_accumulators, next());
  }
  if (plan_.data_parallel) {
    STRATA_ASSIGN_OR_RETURN(parts.reduce_region, next());
  }
  // A sequence objective's buffers, carved as the planner lists them (FixedRegions).
  if (plan_.objective.target_weights) {
    objective_slots_.resize(held());
    const uint64_t pt = shape.tokens() * 4;
    STRATA_ASSIGN_OR_RETURN(auto tw, next());
    for (int i = 0; i < held(); ++i) {
      objective_slots_[i].losses = tw.subspan(2 * i * pt, pt);
      objective_slots_[i].weights = tw.subspan((2 * i + 1) * pt, pt);
    }
    if (plan_.objective.reference_forward) {
      STRATA_ASSIGN_OR_RETURN(auto ref, next());
      const uint64_t stride = 2 * act_bytes + pt;
      for (int i = 0; i < held(); ++i) {
        ObjectiveSlot& o = objective_slots_[i];
        o.ref_acts[0] = ref.subspan(i * stride, act_bytes);
        o.ref_acts[1] = ref.subspan(i * stride + act_bytes, act_bytes);
        o.ref_losses = ref.subspan(i * stride + 2 * act_bytes, pt);
      }
    }
  }
  parts.resident.resize(n_);
  parts.frozen.resize(n_);
  parts.slots.resize(plan_.streaming_slots);
  parts.device_grads.resize(n_);
  for (int b = 0; b < n_; ++b) {
    if (plan_.blocks[b].resident && np(b) > 0) {
      STRATA_ASSIGN_OR_RETURN(parts.resident[b], next());
    }
  }
  for (int b = 0; b < n_; ++b) {
    if (plan_.blocks[b].frozen_resident) {
      STRATA_ASSIGN_OR_RETURN(parts.frozen[b], next());
    }
  }
  for (int b = 0; b < n_; ++b) {
    if (!plan_.blocks[b].optimizer_on_device) continue;
    STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan state, next());
    STRATA_ASSIGN_OR_RETURN(parts.device_grads[b], next());
    store_->SetDeviceBlock(b, state, parts.resident[b]);
  }
  for (auto& s : parts.slots) {
    STRATA_ASSIGN_OR_RETURN(s, next());
  }
  act_stores_.assign(static_cast<size_t>(n_) * held(), gpu::DeviceSpan{});
  for (int b = 0; b < n_; ++b) {
    const Plan::Block& blk = plan_.blocks[b];
    if (!blk.keeps_activations) continue;
    STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan stores, next());
    const uint64_t stride = AlignUp(blk.activation_store_bytes, gpu::DeviceArena::kAlignment);
    for (int i = 0; i < held(); ++i) {
      act_stores_[b * held() + i] = stores.subspan(i * stride, blk.activation_store_bytes);
    }
  }
  STRATA_CHECK(r == regions.size());
  return parts;
}

Status Engine::Impl::CreateActivationOffload(uint64_t act_bytes) {
  auto event = [&]() { return device_->CreateEvent(); };
  STRATA_ASSIGN_OR_RETURN(act_written_, event());
  for (int i = 0; i < 2; ++i) {
    STRATA_ASSIGN_OR_RETURN(act_saved_[i], event());
    STRATA_ASSIGN_OR_RETURN(act_free_[i], event());
    STRATA_ASSIGN_OR_RETURN(act_ready_[i], event());
  }
  for (int b = 0; b < (n_ - 1) * held(); ++b) {
    STRATA_ASSIGN_OR_RETURN(auto a, device_->AllocatePinned(act_bytes, "boundary activation"));
    host_acts_.push_back(std::move(a));
  }
  return Status::Ok();
}

Status Engine::Impl::CreateGradStreamer(const PartRegions& regions, int fold_track) {
  GradStreamerOptions go;
  go.precision = o_.precision;
  go.grad_accum_steps = o_.grad_accum_steps;
  go.overlap = o_.overlap;
  go.inference_only = o_.inference_only;
  go.comm = o_.comm;
  go.trace = o_.trace;
  go.fold_track = fold_track;
  go.fp32_host_grads = o_.test_hooks.fp32_host_grads;
  go.poison_released_buckets = o_.test_hooks.poison_released_buckets;
  if (policy_) {
    go.on_complete = [this](int b, const cpu_optim::GradStats& block,
                            const cpu_optim::GradStats& step) {
      if (policy_->Speculate(b, block, step)) store_->SubmitSpeculative(b);  // or after backward
    };
  }
  STRATA_ASSIGN_OR_RETURN(
      grads_, GradStreamer::Create(*model_, plan_, device_, compute_.get(), d2h_.get(),
                                   regions.grad_buckets, regions.reduce_region,
                                   regions.device_grads, go, regions.grad_accumulators));
  return Status::Ok();
}

Status Engine::Impl::CreateParamCache(const PartRegions& regions, int load_track) {
  ParamCacheOptions po;
  po.precision = o_.precision;
  po.overlap = o_.overlap;
  po.comm = o_.comm;
  po.trace = o_.trace;
  po.load_track = load_track;
  STRATA_ASSIGN_OR_RETURN(
      params_, ParamCache::Create(*model_, plan_, device_, compute_.get(), h2d_.get(), store_.get(),
                                  regions.resident, regions.frozen, regions.slots, po));
  return Status::Ok();
}

Status Engine::Impl::AllocateHostMemory() {
  STRATA_ASSIGN_OR_RETURN(io_done_, device_->CreateEvent());
  const uint64_t io_bytes = ObjectiveStagingOffset() +
                            (plan_.objective.target_weights ? 3 * o_.micro_batch.tokens() * 4 : 0);
  STRATA_ASSIGN_OR_RETURN(io_pinned_, device_->AllocatePinned(io_bytes, "token staging"));
  if (dp() && o_.share_frozen_base) {
    // Every rank holds the same frozen base: one copy per machine (collective).
    STRATA_ASSIGN_OR_RETURN(shared_frozen_, SharedFrozenBase::Create(
                                                *o_.comm, *device_, store_->pinned_frozen_bytes()));
    store_->ShareFrozenHomes(shared_frozen_.get());
  }
  return store_->AllocateMemory(device_);
}

Status Engine::Impl::UploadTokens(const MicroBatch& mb, MicroBatchShape shape, bool with_targets,
                                  int64_t loss_tokens, int slot) {
  const size_t count = shape.tokens(), tb = o_.micro_batch.tokens() * 4;
  BatchSlot& d = batch_[slot];
  d.loss_tokens = loss_tokens;
  d.with_position_ids = !mb.position_ids.empty();
  d.max_positions = d.with_position_ids ? *std::ranges::max_element(mb.position_ids) + 1 : 0;
  // The staging may still feed the previous uploads (slot 0 comes first in a step).
  if (slot == 0) STRATA_RETURN_IF_ERROR(io_done_->Synchronize());
  const gpu::PinnedSpan staging = io_pinned_.span().subspan(StagingOffset(slot), 3 * tb);
  compute_->SetWorkLabel(fmt::format("token upload of micro-batch slot {}", slot));
  auto upload = [&](gpu::DeviceSpan dst, std::span<const int32_t> src, int k) {
    std::memcpy(staging.data + k * tb, src.data(), count * 4);
    return compute_->CopyH2D(dst, staging.subspan(k * tb, count * 4));
  };
  STRATA_RETURN_IF_ERROR(upload(d.tokens, mb.tokens, 0));
  if (with_targets) STRATA_RETURN_IF_ERROR(upload(d.targets, mb.targets, 1));
  if (d.with_position_ids) STRATA_RETURN_IF_ERROR(upload(d.position_ids, mb.position_ids, 2));
  return compute_->Record(*io_done_);
}

void Engine::Impl::SetBatchInputs(int b, int slot, BlockBuffers* buf) const {
  const BatchSlot& d = batch_[slot];
  if (b == 0) buf->tokens = d.tokens.as<const int32_t>();
  if (d.with_position_ids) buf->position_ids = d.position_ids.as<const int32_t>();
  buf->max_positions = d.max_positions;
  if (b == n_ - 1) buf->loss_tokens = d.loss_tokens;
}

BlockBuffers Engine::Impl::ForwardBuffers(int b, const ParamCache::BlockChunks& chunks, int slot,
                                          bool with_targets, MicroBatchShape shape,
                                          bool training) const {
  BlockBuffers buf;
  buf.precision = o_.precision;
  buf.dropout_seed = dropout_seed_;
  if (chunks.own) buf.params = chunks.own->params;
  if (chunks.frozen) buf.frozen_params = chunks.frozen->params;
  if (chunks.tied) buf.tied_params = chunks.tied->params;
  buf.shape = shape;
  buf.scratch = scratch_;
  buf.workspace = workspace_;
  if (training && plan_.blocks[b].keeps_activations) buf.scratch = act_stores_[b * held() + slot];
  SetBatchInputs(b, slot, &buf);
  if (b > 0) buf.x_in = Typed(Act(b - 1, slot));
  if (b < n_ - 1) {
    buf.x_out = Typed(Act(b, slot));
  } else {
    buf.targets = with_targets ? batch_[slot].targets.as<const int32_t>() : nullptr;
    buf.logits = Typed(logits_);
    buf.loss = loss_.as<float>();
    if (training && objective_) buf.target_losses = objective_slots_[slot].losses.as<float>();
  }
  return buf;
}

Status Engine::Impl::ReferenceForward(int b, const ParamCache::BlockChunks& chunks, int slot,
                                      MicroBatchShape shape) {
  BlockBuffers buf = ForwardBuffers(b, chunks, slot, /*with_targets=*/true, shape);
  const ObjectiveSlot& o = objective_slots_[slot];
  buf.frozen_reference = true;
  buf.params = {};
  buf.dropout_seed = 0;  // the reference has no adapters, so no dropout
  if (b > 0) buf.x_in = Typed(o.ref_acts[(b - 1) % 2]);
  if (b < n_ - 1) {
    buf.x_out = Typed(o.ref_acts[b % 2]);
  } else {
    buf.target_losses = o.ref_losses.as<float>();
  }
  const std::string label =
      fmt::format("reference forward of block {} ('{}')", b, model_->block_name(b));
  compute_->SetWorkLabel(label);
  const Status s = model_->Forward(b, buf, *compute_);
  if (!s.ok()) return Status(s.code(), fmt::format("{} failed: {}", label, s.message()));
  return Status::Ok();
}

Status Engine::Impl::WeighMicroBatch(size_t i, int slot) {
  const size_t count = o_.micro_batch.tokens();
  const ObjectiveSlot& o = objective_slots_[slot];
  const gpu::PinnedSpan staging =
      io_pinned_.span().subspan(ObjectiveStagingOffset(), 3 * count * 4);
  const bool ref = objective_->wants_reference();
  compute_->SetWorkLabel(fmt::format("per-target losses of micro-batch {}", i));
  STRATA_RETURN_IF_ERROR(compute_->CopyD2H(staging.subspan(0, count * 4), o.losses));
  if (ref) {
    STRATA_RETURN_IF_ERROR(compute_->CopyD2H(staging.subspan(count * 4, count * 4), o.ref_losses));
  }
  STRATA_RETURN_IF_ERROR(compute_->Synchronize());
  const auto* losses = reinterpret_cast<const float*>(staging.data);
  auto* weights = reinterpret_cast<float*>(staging.data + 2 * count * 4);
  STRATA_ASSIGN_OR_RETURN(const double share,
                          objective_->Weigh(i, {losses, count},
                                            ref ? std::span<const float>(losses + count, count)
                                                : std::span<const float>(),
                                            {weights, count}));
  objective_value_ += share;
  return compute_->CopyH2D(o.weights, staging.subspan(2 * count * 4, count * 4));
}

StatusOr<BlockBuffers> Engine::Impl::BackwardBuffers(int b, const ParamCache::BlockChunks& chunks,
                                                     int slot, float dloss) {
  BlockBuffers buf =
      ForwardBuffers(b, chunks, slot, /*with_targets=*/true, o_.micro_batch, /*training=*/true);
  buf.forward_kept = plan_.blocks[b].keeps_activations;
  buf.x_out = {};
  buf.logits = {};
  buf.loss = nullptr;
  if (chunks.own) {
    STRATA_ASSIGN_OR_RETURN(buf.grads, grads_->NextBucket(b));
  }
  // A tied chunk with own params gets this block's gradient contribution.
  const int t = tied(b);
  if (chunks.tied && np(t) > 0) {
    STRATA_ASSIGN_OR_RETURN(buf.tied_grads, grads_->NextBucket(t, 1));
  }
  if (b > 0) buf.dx_in = Typed(Dx(b % 2, slot));
  if (b < n_ - 1) {
    buf.dx_out = Typed(Dx((b + 1) % 2, slot));
  } else {
    buf.dloss = dloss;
    buf.target_losses = nullptr;
    if (objective_) buf.target_weights = objective_slots_[slot].weights.as<const float>();
  }
  return buf;
}

void Engine::Impl::OpenSpeculation(float scale) {
  // The exact step's round when nothing clips or overflows (each block's previous update runs
  // with its own round's parameters; the forward waited on it).
  store_->StartSpeculativeRound(o_.optimizer, cpu_optim::OptimStep{adam_t_ + 1, 1.0f / scale});
  policy_->BeginStep(scale);
  speculating_ = true;
}

Status Engine::Impl::SaveActivation(int b, int i) {
  STRATA_RETURN_IF_ERROR(compute_->Record(*act_written_));
  STRATA_RETURN_IF_ERROR(d2h_->Wait(*act_written_));
  const gpu::DeviceSpan act = Act(b, i);
  STRATA_RETURN_IF_ERROR(d2h_->CopyD2H(host_acts_[b * held() + i].span(), act));
  return d2h_->Record(*act_saved_[b % 2]);
}

Status Engine::Impl::LoadActivation(int k) {
  // After the set's last reader (compute) and after the forward's copies out of block k's
  // outputs (d2h, in order: the set's latest save covers them).
  STRATA_RETURN_IF_ERROR(h2d_->Wait(*act_free_[k % 2]));
  STRATA_RETURN_IF_ERROR(h2d_->Wait(*act_saved_[k % 2]));
  for (int i = 0; i < held(); ++i) {
    const gpu::DeviceSpan act = Act(k, i);
    STRATA_RETURN_IF_ERROR(
        h2d_->CopyH2D(act, host_acts_[k * held() + i].span().subspan(0, act.size_bytes)));
  }
  STRATA_RETURN_IF_ERROR(h2d_->Record(*act_ready_[k % 2]));
  if (!o_.overlap) return h2d_->Synchronize();
  return Status::Ok();
}

Status Engine::Impl::RunBlock(bool backward, int b, const BlockBuffers& buf) {
  const std::string label = fmt::format("{} of block {} ('{}')", backward ? "backward" : "forward",
                                        b, model_->block_name(b));
  compute_->SetWorkLabel(label);
  const Status s =
      backward ? model_->Backward(b, buf, *compute_) : model_->Forward(b, buf, *compute_);
  if (!s.ok()) return Status(s.code(), fmt::format("{} failed: {}", label, s.message()));
  return Status::Ok();
}

Status Engine::Impl::ForwardPass(MicroBatchShape shape, bool with_targets, int loss_index,
                                 std::span<const int> seq, size_t* cursor, bool save_acts,
                                 ForwardExtras extras) {
  const bool weigh = save_acts && objective_ != nullptr;
  const bool reference = (weigh && objective_->wants_reference()) || extras.with_reference;
  for (int b = 0; b < n_; ++b, ++*cursor) {
    STRATA_ASSIGN_OR_RETURN(const ParamCache::BlockChunks chunks,
                            params_->AcquireBlock(b, seq, cursor));
    if (reference) STRATA_RETURN_IF_ERROR(ReferenceForward(b, chunks, 0, shape));
    BlockBuffers buf = ForwardBuffers(b, chunks, 0, with_targets, shape, save_acts);
    if (extras.frozen_reference) {
      buf.frozen_reference = true;
      buf.params = {};
    }
    if (extras.target_losses && b == n_ - 1) {
      buf.target_losses = objective_slots_[0].losses.as<float>();
    }
    // Offloaded: the buffer's previous content (block b-2's output) must have been copied out.
    if (plan_.offload_activations && b < n_ - 1) {
      STRATA_RETURN_IF_ERROR(compute_->Wait(*act_saved_[b % 2]));
    }
    STRATA_RETURN_IF_ERROR(RunBlock(/*backward=*/false, b, buf));
    if (plan_.offload_activations && b < n_ - 1 && save_acts) {
      STRATA_RETURN_IF_ERROR(SaveActivation(b));
    }
    STRATA_RETURN_IF_ERROR(params_->DoneBlock(chunks, seq, *cursor));
  }
  if (with_targets && loss_index >= 0) {
    const size_t off = LossesOffset() + loss_index * 4;
    STRATA_RETURN_IF_ERROR(compute_->CopyD2H(io_pinned_.span().subspan(off, 4), loss_));
  }
  if (weigh) STRATA_RETURN_IF_ERROR(WeighMicroBatch(static_cast<size_t>(loss_index), 0));
  return Status::Ok();
}

Status Engine::Impl::Flush() {
  STRATA_RETURN_IF_ERROR(grads_->Drain());
  // The device updates run on the compute stream.
  if (plan_.device_optimizer_params > 0) STRATA_RETURN_IF_ERROR(compute_->Synchronize());
  return store_->Drain();
}

Status Engine::Impl::MicroBatchMajorPasses(std::span<const MicroBatch> mbs,
                                           std::span<const int64_t> loss_tokens,
                                           std::span<const float> dloss, float scale) {
  // The order blocks are used in: forward 0..n-1, backward n-1..0, per micro-batch.
  std::vector<int> seq;
  const std::vector<int> fwd = params_->UseOrder(false), bwd = params_->UseOrder(true);
  for (size_t i = 0; i < mbs.size(); ++i) {
    seq.insert(seq.end(), fwd.begin(), fwd.end());
    seq.insert(seq.end(), bwd.begin(), bwd.end());
  }
  size_t cursor = 0;
  for (size_t i = 0; i < mbs.size(); ++i) {
    const bool first_mb = i == 0, last_mb = i + 1 == mbs.size();
    dropout_seed_ = DropoutSeedOf(i, mbs.size());
    STRATA_RETURN_IF_ERROR(
        UploadTokens(mbs[i], o_.micro_batch, /*with_targets=*/true, loss_tokens[i]));
    STRATA_RETURN_IF_ERROR(ForwardPass(o_.micro_batch, true, static_cast<int>(i), seq, &cursor,
                                       /*save_acts=*/true));
    if (policy_ && last_mb) OpenSpeculation(scale);
    for (int b = n_ - 1; b >= 0; --b, ++cursor) {
      const int t = tied(b);
      // A tied chunk with own params gets this block's gradient contribution.
      const bool tied_grads = t >= 0 && np(t) > 0;
      STRATA_ASSIGN_OR_RETURN(const ParamCache::BlockChunks chunks,
                              params_->AcquireBlock(b, seq, &cursor));
      STRATA_ASSIGN_OR_RETURN(const BlockBuffers buf, BackwardBuffers(b, chunks, 0, dloss[i]));
      // Offloaded: acts n-2 and n-3 are still on the device after forward; older ones were
      // loaded back (LoadActivation) one block ahead.
      if (plan_.offload_activations && b > 0 && b - 1 <= n_ - 4) {
        STRATA_RETURN_IF_ERROR(compute_->Wait(*act_ready_[(b - 1) % 2]));
      }
      STRATA_RETURN_IF_ERROR(RunBlock(/*backward=*/true, b, buf));
      if (plan_.offload_activations && b > 0) {
        STRATA_RETURN_IF_ERROR(compute_->Record(*act_free_[(b - 1) % 2]));
        // Backward b was the last reader of buffer (b-1) % 2: bring act b-3 back into it.
        if (b - 3 >= 0) STRATA_RETURN_IF_ERROR(LoadActivation(b - 3));
      }
      // Chunk b's accumulator starts with its first contribution of the step: its tying
      // block's, when it has one (that block's backward runs first).
      // The fold may submit b's update during this backward.
      if (chunks.own) {
        if (policy_ && last_mb && !plan_.blocks[b].optimizer_on_device) params_->Invalidate(b);
        STRATA_RETURN_IF_ERROR(grads_->Stream(b, first_mb && tied_user_[b] < 0, last_mb));
      }
      if (tied_grads) STRATA_RETURN_IF_ERROR(grads_->Stream(t, first_mb, /*last=*/false));
      STRATA_RETURN_IF_ERROR(params_->DoneBlock(chunks, seq, cursor));
    }
  }
  return Status::Ok();
}

StatusOr<StepResult> Engine::Impl::RunStep(std::span<const MicroBatch> mbs) {
  if (o_.inference_only) return FailedPreconditionError("an inference-only engine cannot train");
  if (static_cast<int>(mbs.size()) != o_.grad_accum_steps) {
    return InvalidArgumentError(
        fmt::format("Step got {} micro-batches, expected {}", mbs.size(), o_.grad_accum_steps));
  }
  if (partially_loaded_) {
    return FailedPreconditionError(
        "a checkpoint load failed half-way (see its error); load a checkpoint again before "
        "training");
  }
  const MicroBatchShape shape = o_.micro_batch;
  const float scale = scaler_.scale();
  // The mean over every counted target of the whole job's micro-batches: each rank weights its
  // own by their share of the targets every rank counts (all-reduced), so that instruction data,
  // whose micro-batches count different numbers of targets, trains as on one rank.
  STRATA_ASSIGN_OR_RETURN(const std::vector<int64_t> loss_tokens,
                          CheckMicroBatches(mbs, shape, model_->vocab_size()));
  int64_t job_loss_tokens = std::accumulate(loss_tokens.begin(), loss_tokens.end(), int64_t{0});
  if (dp() && !objective_) {
    // Counts below 2^53 add exactly in double.
    double total = static_cast<double>(job_loss_tokens);
    STRATA_RETURN_IF_ERROR(o_.comm->AllReduce(std::span(&total, 1), comm::ReduceOp::kSum));
    job_loss_tokens = static_cast<int64_t>(total);
  }
  const bool every_target_counts =
      job_loss_tokens == static_cast<int64_t>(mbs.size()) * world() * shape.tokens();
  STRATA_ASSIGN_OR_RETURN(
      std::vector<float> dloss,
      MicroBatchLossWeights(loss_tokens, shape.tokens(), scale, world(), job_loss_tokens));
  if (objective_) {
    STRATA_RETURN_IF_ERROR(CheckObjective());
    // The objective's weights are the step's (the whole job's, with data parallelism: the ranks'
    // gradients are summed): each micro-batch's backward gets the loss scale alone.
    dloss.assign(mbs.size(), scale);
    objective_value_ = 0;
  }
  step_work_started_ = true;
  grads_->BeginStep();
  STRATA_RETURN_IF_ERROR(plan_.layer_major()
                             ? LayerMajorPasses(mbs, loss_tokens, dloss, scale)
                             : MicroBatchMajorPasses(mbs, loss_tokens, dloss, scale));
  dropout_seed_ = 0;
  // When backward ends the folds have the global norm and the overflow flag.
  STRATA_RETURN_IF_ERROR(grads_->Drain());
  STRATA_RETURN_IF_ERROR(compute_->Synchronize());
  cpu_optim::GradStats stats = grads_->stats();

  StepResult result;
  result.loss_scale = scale;
  const auto* losses = reinterpret_cast<const float*>(io_pinned_.data() + LossesOffset());
  result.loss = objective_ ? static_cast<float>(objective_value_)
                           : StepLoss({losses, mbs.size()}, loss_tokens, shape.tokens());
  if (dp()) {
    // Every rank clips, skips and reports alike: the squared norm, the overflow flag and the
    // loss summed over the ranks (in rank order, the same bits everywhere). When every target
    // counts, a rank's mean loss is averaged; else each rank's sum over its counted targets is
    // summed and divided by the job's count. An objective's shares are of the whole job's
    // objective already, so summed.
    double rank_loss = result.loss;
    if (!objective_ && !every_target_counts) {
      rank_loss = 0;
      for (size_t i = 0; i < mbs.size(); ++i) {
        rank_loss += static_cast<double>(losses[i]) * static_cast<double>(loss_tokens[i]);
      }
    }
    double v[3] = {stats.sum_squares, stats.nonfinite ? 1.0 : 0.0,
                   objective_ ? objective_value_ : rank_loss};
    STRATA_RETURN_IF_ERROR(o_.comm->AllReduce(v, comm::ReduceOp::kSum));
    stats.sum_squares = v[0];
    stats.nonfinite = v[1] != 0;
    result.loss = static_cast<float>(objective_            ? v[2]
                                     : every_target_counts ? v[2] / world()
                                                           : v[2] / job_loss_tokens);
  }
  const bool overflow = stats.nonfinite || !std::isfinite(stats.sum_squares);
  result.grad_norm = overflow ? INFINITY : std::sqrt(stats.sum_squares) / scale;
  ++step_;
  // The verdict on the updates that ran during backward: they stand only for the exact step's
  // coefficient, 1 / scale (no clipping, no overflow).
  const bool speculated = speculating_;
  speculating_ = false;
  if (speculated) policy_->EndStep(overflow);
  const bool skip = scaler_.Update(overflow);
  float clip = 1.0f;
  if (!skip && o_.grad_clip_norm > 0 && result.grad_norm > o_.grad_clip_norm) {
    clip = static_cast<float>(o_.grad_clip_norm / (result.grad_norm + 1e-6));
  }
  const bool stands = speculated && !skip && clip == 1.0f;
  if (speculated) {
    STRATA_ASSIGN_OR_RETURN(result.params_updated_during_backward,
                            store_->EndSpeculativeRound(stands, &result.rolled_back));
  }
  if (skip) {
    result.skipped = true;
    STRATA_LOG_WARNING("step {}: non-finite gradient, update skipped; loss scale now {}", step_,
                       scaler_.scale());
    return result;
  }
  // Adam's step count t counts applied updates; skipped steps do not advance it. Speculative
  // updates that stand ran with this round already.
  ++adam_t_;
  if (!stands) store_->StartRound(o_.optimizer, cpu_optim::OptimStep{adam_t_, clip / scale});
  // Exact step, hidden under the next forward: blocks update in forward order, those optimized on
  // the device by its kernels on the compute stream (ahead of the next forward, which reads their
  // resident params in place), the rest on the CPU pipeline while this call returns; the next
  // forward of such a block waits only on its update. Both run at once.
  for (int b = 0; b < n_; ++b) {
    if (!plan_.blocks[b].optimizer_on_device) continue;
    compute_->SetWorkLabel(
        fmt::format("device optimizer update of block {} ('{}')", b, model_->block_name(b)));
    STRATA_RETURN_IF_ERROR(store_->EnqueueDeviceUpdate(b, *compute_, grads_->DeviceGradient(b),
                                                       grads_->device_grad_dtype(b)));
    // Data parallel: each rank updated its partition; the block is all-gathered before its use.
    if (dp()) STRATA_RETURN_IF_ERROR(params_->UpdatedOnDevice(b));
  }
  for (int b = 0; b < n_; ++b) {
    if (plan_.blocks[b].optimizer_on_device || np(b) == 0) continue;
    cpu_params_updated_ += own(b);
    if (stands && store_->speculated(b)) continue;
    params_->Invalidate(b);
    store_->Submit(b);
    if (!o_.overlap) STRATA_RETURN_IF_ERROR(store_->WaitBlock(b));
  }
  if (!o_.overlap && plan_.device_optimizer_params > 0) {
    STRATA_RETURN_IF_ERROR(compute_->Synchronize());
  }
  return result;
}

Status Engine::Impl::EvaluationForward(const MicroBatch& batch, MicroBatchShape shape,
                                       int loss_index, ForwardExtras extras) {
  if (shape.batch_size < 1 || shape.seq_len < 1 || shape.tokens() > o_.micro_batch.tokens() ||
      shape.seq_len > model_->max_seq_len()) {
    return InvalidArgumentError("evaluation batch is larger than the training micro-batch");
  }
  dropout_seed_ = 0;  // evaluation: no dropout
  STRATA_ASSIGN_OR_RETURN(const int64_t loss_tokens,
                          CheckMicroBatch(batch, shape, model_->vocab_size(), true));
  STRATA_RETURN_IF_ERROR(UploadTokens(batch, shape, /*with_targets=*/true, loss_tokens));
  const std::vector<int> seq = params_->UseOrder(false);
  size_t cursor = 0;
  return ForwardPass(shape, true, loss_index, seq, &cursor, /*save_acts=*/false, extras);
}

StatusOr<float> Engine::Impl::EvaluateLoss(const MicroBatch& batch, MicroBatchShape shape) {
  STRATA_RETURN_IF_ERROR(EvaluationForward(batch, shape, 0, {}));
  STRATA_RETURN_IF_ERROR(compute_->Synchronize());
  return *reinterpret_cast<const float*>(io_pinned_.data() + LossesOffset());
}

Status Engine::Impl::CheckObjective() const {
  if (!plan_.objective.target_weights) {
    return FailedPreconditionError(
        "a sequence objective needs a plan with its buffers (PlacementOptions::objective)");
  }
  if (objective_ && objective_->wants_reference() && !plan_.objective.reference_forward) {
    return FailedPreconditionError(
        "the objective wants the frozen reference; the plan has no reference forward "
        "(PlacementOptions::objective.reference_forward)");
  }
  return Status::Ok();
}

StatusOr<std::vector<float>> Engine::Impl::EvaluateTargetLosses(const MicroBatch& batch,
                                                                MicroBatchShape shape,
                                                                bool reference) {
  STRATA_RETURN_IF_ERROR(CheckObjective());
  if (reference && !model_->has_frozen_reference()) {
    return InvalidArgumentError("the model has no frozen reference (LoRA's base)");
  }
  STRATA_RETURN_IF_ERROR(EvaluationForward(
      batch, shape, -1,
      {.frozen_reference = reference, .target_losses = true, .with_reference = false}));
  const size_t count = shape.tokens();
  const gpu::PinnedSpan staging = io_pinned_.span().subspan(ObjectiveStagingOffset(), count * 4);
  STRATA_RETURN_IF_ERROR(
      compute_->CopyD2H(staging, objective_slots_[0].losses.subspan(0, count * 4)));
  STRATA_RETURN_IF_ERROR(compute_->Synchronize());
  const auto* p = reinterpret_cast<const float*>(staging.data);
  return std::vector<float>(p, p + count);
}

StatusOr<Engine::PolicyAndReferenceLosses> Engine::Impl::EvaluatePolicyAndReference(
    const MicroBatch& batch, MicroBatchShape shape) {
  STRATA_RETURN_IF_ERROR(CheckObjective());
  if (!model_->has_frozen_reference()) {
    return InvalidArgumentError("the model has no frozen reference (LoRA's base)");
  }
  if (!plan_.objective.reference_forward) {
    return FailedPreconditionError(
        "one pass of the policy and its reference needs a plan with the reference forward "
        "(PlacementOptions::objective.reference_forward)");
  }
  STRATA_RETURN_IF_ERROR(EvaluationForward(
      batch, shape, -1,
      {.frozen_reference = false, .target_losses = true, .with_reference = true}));
  const size_t count = shape.tokens();
  const gpu::PinnedSpan staging =
      io_pinned_.span().subspan(ObjectiveStagingOffset(), 2 * count * 4);
  const ObjectiveSlot& o = objective_slots_[0];
  STRATA_RETURN_IF_ERROR(
      compute_->CopyD2H(staging.subspan(0, count * 4), o.losses.subspan(0, count * 4)));
  STRATA_RETURN_IF_ERROR(
      compute_->CopyD2H(staging.subspan(count * 4, count * 4), o.ref_losses.subspan(0, count * 4)));
  STRATA_RETURN_IF_ERROR(compute_->Synchronize());
  const auto* p = reinterpret_cast<const float*>(staging.data);
  return Engine::PolicyAndReferenceLosses{std::vector<float>(p, p + count),
                                          std::vector<float>(p + count, p + 2 * count)};
}

StatusOr<std::vector<float>> Engine::Impl::NextTokenLogits(std::span<const int32_t> tokens) {
  const MicroBatchShape shape{1, static_cast<int>(tokens.size())};
  if (tokens.empty() || shape.tokens() > o_.micro_batch.tokens() ||
      shape.seq_len > model_->max_seq_len()) {
    return InvalidArgumentError(
        fmt::format("context of {} tokens is empty or too long", tokens.size()));
  }
  dropout_seed_ = 0;
  const MicroBatch mb{tokens, {}};
  STRATA_RETURN_IF_ERROR(CheckMicroBatch(mb, shape, model_->vocab_size(), false).status());
  STRATA_RETURN_IF_ERROR(UploadTokens(mb, shape, /*with_targets=*/false, 0));
  const std::vector<int> seq = params_->UseOrder(false);
  size_t cursor = 0;
  STRATA_RETURN_IF_ERROR(ForwardPass(shape, false, -1, seq, &cursor));
  const int vocab = model_->vocab_size();
  const size_t off = LogitsRowOffset();
  const auto dst = io_pinned_.span().subspan(off, vocab * w_);
  // Shape {1, T}: row 0 of the (B, V) last-position logits is position T - 1.
  STRATA_RETURN_IF_ERROR(compute_->CopyD2H(dst, logits_.subspan(0, vocab * w_)));
  STRATA_RETURN_IF_ERROR(compute_->Synchronize());
  // The logits are in the working precision; widen them on the host (exact).
  return DispatchDType(o_.precision, [&]<typename S>() {
    const auto* p = dst.as<const S>();
    std::vector<float> out(vocab);
    for (int v = 0; v < vocab; ++v) out[v] = ToFloat(p[v]);
    return out;
  });
}

StatusOr<std::vector<float>> Engine::Impl::MasterWeights(int block) {
  if (block < 0 || block >= n_) return OutOfRangeError(fmt::format("no block {}", block));
  if (o_.inference_only)
    return FailedPreconditionError("an inference-only engine has no master weights");
  STRATA_RETURN_IF_ERROR(SettleUpdates());
  return checkpoint_->MasterWeights(block);
}

StatusOr<std::vector<float>> Engine::Impl::AccumulatedGradient(int block) {
  if (block < 0 || block >= n_) return OutOfRangeError(fmt::format("no block {}", block));
  if (o_.inference_only || step_ == 0) {
    return FailedPreconditionError("no gradient: the engine has not taken a step");
  }
  STRATA_RETURN_IF_ERROR(Flush());
  std::vector<float> g(own(block));
  STRATA_RETURN_IF_ERROR(grads_->ReadGradient(block, g));
  return checkpoint_->GatherBlock(block, g.data());
}

StatusOr<uint64_t> Engine::Impl::MasterWeightsXxh3() {
  if (o_.inference_only)
    return FailedPreconditionError("an inference-only engine has no master weights");
  STRATA_RETURN_IF_ERROR(SettleUpdates());
  return checkpoint_->MasterWeightsXxh3();
}

Status Engine::Impl::SaveCheckpoint(const std::string& save_dir, const TrainerState& trainer,
                                    const SaveCheckpointOptions& options,
                                    std::string* checkpoint_dir) {
  if (partially_loaded_) {
    return FailedPreconditionError("the engine holds a half-loaded checkpoint; nothing to save");
  }
  if (o_.inference_only)
    return FailedPreconditionError("an inference-only engine has no training state to save");
  // The last step's update must have been applied.
  STRATA_RETURN_IF_ERROR(Flush());
  return checkpoint_->Save(save_dir, TrainingManifest(trainer), options.keep_last, checkpoint_dir);
}

Manifest Engine::Impl::TrainingManifest(const TrainerState& trainer) const {
  Manifest manifest = checkpoint_->ModelManifest();
  manifest.engine_steps = step_;
  manifest.adam_steps = adam_t_;
  manifest.loss_scaler = {scaler_.scale(), scaler_.clean_steps(), scaler_.overflows(),
                          scaler_.hysteresis_left()};
  manifest.grad_clip_norm = o_.grad_clip_norm;
  manifest.decay_norms_and_biases = o_.decay_norms_and_biases;
  manifest.trainer = trainer;
  return manifest;
}

Status Engine::Impl::LoadCheckpoint(const std::string& path, TrainerState* trainer) {
  // Phase 1: validate everything; no engine state changes.
  STRATA_ASSIGN_OR_RETURN(EngineCheckpoint::Validated checkpoint,
                          checkpoint_->Validate(path, o_.cancel_requested));
  // Phase 2: stream the validated tensors into the stores, block by block, once nothing reads
  // them any more (the last update applied, no H2D copy from a pinned home in flight).
  STRATA_RETURN_IF_ERROR(Flush());
  STRATA_RETURN_IF_ERROR(params_->Drain());
  STRATA_RETURN_IF_ERROR(h2d_->Synchronize());
  partially_loaded_ = true;
  STRATA_RETURN_IF_ERROR(checkpoint_->Read(
      checkpoint, [this](int b) { params_->Invalidate(b); }, o_.cancel_requested));
  const Manifest& m = checkpoint.manifest;
  if (!o_.inference_only) {
    step_ = m.engine_steps;
    adam_t_ = m.adam_steps;
    scaler_.Restore(m.loss_scaler.scale, m.loss_scaler.clean_steps, m.loss_scaler.overflows,
                    m.loss_scaler.hysteresis_left);
    cpu_optim::SetLearningRate(o_.optimizer, cpu_optim::LearningRate(m.optimizer));
  }
  partially_loaded_ = false;
  *trainer = m.trainer;
  return Status::Ok();
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

namespace {

// The options Engine::Create gets with the plan it runs: the placement's ranks as the
// communicator says.
PlacementOptions PlacementWithRanks(const EngineOptions& options) {
  PlacementOptions placement = options.placement;
  if (options.comm) {
    placement.ranks = options.comm->world_size();
    placement.rank = options.comm->rank();
    placement.data_parallel = true;
  }
  // The update during backward as Impl::Init turns it on (given a CPU-optimized block).
  placement.update_during_backward =
      options.update_during_backward && options.overlap && !options.inference_only;
  placement.speculation_backup_bytes = options.speculation_backup_bytes;
  return placement;
}

// kInvalidArgument when `plan` was not made for this model and these options.
Status CheckPlanFits(const Model& model, const EngineOptions& options, const Plan& plan) {
  const PlacementOptions placement = PlacementWithRanks(options);
  std::string why;
  if (plan.precision != options.precision) {
    why = fmt::format("precision {} (options: {})", DTypeName(plan.precision),
                      DTypeName(options.precision));
  } else if (plan.shape.batch_size != options.micro_batch.batch_size ||
             plan.shape.seq_len != options.micro_batch.seq_len) {
    why =
        fmt::format("micro-batch {}x{} (options: {}x{})", plan.shape.batch_size, plan.shape.seq_len,
                    options.micro_batch.batch_size, options.micro_batch.seq_len);
  } else if (plan.ranks != placement.ranks || plan.rank != placement.rank ||
             plan.data_parallel != placement.data_parallel) {
    why = fmt::format("rank {} of {} (options: rank {} of {})", plan.rank, plan.ranks,
                      placement.rank, placement.ranks);
  } else if (static_cast<int>(plan.blocks.size()) != model.num_blocks()) {
    why = fmt::format("{} blocks (the model has {})", plan.blocks.size(), model.num_blocks());
  } else if (plan.schedule != placement.schedule || plan.param_home != placement.param_home ||
             plan.device_budget_bytes != placement.device_budget_bytes ||
             plan.activation_checkpointing != placement.activation_checkpointing) {
    why =
        "other placement options (schedule, params home, device budget or activation "
        "checkpointing)";
  } else if (plan.update_during_backward != placement.update_during_backward) {
    why = fmt::format("update_during_backward {} (options: {}, with overlap and training)",
                      plan.update_during_backward ? "on" : "off",
                      placement.update_during_backward ? "on" : "off");
  }
  if (why.empty()) return Status::Ok();
  return InvalidArgumentError(
      fmt::format("Engine::Create: the plan was made for {}; pass the placement the plan "
                  "choice returned (PlanChoice::placement)",
                  why));
}

}  // namespace

StatusOr<std::unique_ptr<Engine>> Engine::Create(Model* model, gpu::Device* device,
                                                 const EngineOptions& options, Plan plan) {
  if (!model || !device) return InvalidArgumentError("Engine::Create needs a model and a device");
  STRATA_RETURN_IF_ERROR(CheckPlanFits(*model, options, plan));
  auto impl = std::make_unique<Impl>(model, device, options, std::move(plan));
  STRATA_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(Model* model, gpu::Device* device,
                                                 const EngineOptions& options) {
  if (!model || !device) return InvalidArgumentError("Engine::Create needs a model and a device");
  STRATA_ASSIGN_OR_RETURN(
      Plan plan,
      MakePlan(*model, options.precision, options.micro_batch, PlacementWithRanks(options),
               PlanOptimizer{options.optimizer, std::max(1, options.grad_accum_steps)}));
  return Create(model, device, options, std::move(plan));
}

const Plan& Engine::plan() const { return impl_->plan(); }
int Engine::frozen_base_shared_by() const { return impl_->frozen_base_shared_by(); }
uint64_t Engine::frozen_base_shared_bytes() const { return impl_->frozen_base_shared_bytes(); }
std::string_view Engine::io_backend_name() const { return impl_->io_backend_name(); }
StatusOr<StepResult> Engine::Step(std::span<const MicroBatch> mbs, SequenceObjective* objective) {
  return impl_->Step(mbs, objective);
}

StatusOr<Engine::PolicyAndReferenceLosses> Engine::EvaluatePolicyAndReference(
    const MicroBatch& batch, MicroBatchShape shape) {
  return impl_->EvaluatePolicyAndReference(batch, shape);
}

StatusOr<std::vector<float>> Engine::EvaluateTargetLosses(const MicroBatch& batch,
                                                          MicroBatchShape shape, bool reference) {
  return impl_->EvaluateTargetLosses(batch, shape, reference);
}
Status Engine::Flush() { return impl_->Flush(); }
StatusOr<float> Engine::EvaluateLoss(const MicroBatch& batch, MicroBatchShape shape) {
  return impl_->EvaluateLoss(batch, shape);
}
StatusOr<std::vector<float>> Engine::NextTokenLogits(std::span<const int32_t> tokens) {
  return impl_->NextTokenLogits(tokens);
}
StatusOr<uint64_t> Engine::MasterWeightsXxh3() { return impl_->MasterWeightsXxh3(); }
StatusOr<std::vector<float>> Engine::AccumulatedGradient(int block) {
  return impl_->AccumulatedGradient(block);
}
StatusOr<std::vector<float>> Engine::MasterWeights(int block) {
  return impl_->MasterWeights(block);
}
void Engine::SetLearningRate(float lr) { impl_->SetLearningRate(lr); }
Status Engine::SaveCheckpoint(const std::string& save_dir, const TrainerState& trainer,
                              const SaveCheckpointOptions& options, std::string* checkpoint_dir) {
  return impl_->SaveCheckpoint(save_dir, trainer, options, checkpoint_dir);
}
Status Engine::LoadCheckpoint(const std::string& path, TrainerState* trainer) {
  if (!trainer) return InvalidArgumentError("LoadCheckpoint needs a TrainerState to fill");
  return impl_->LoadCheckpoint(path, trainer);
}
EngineCounters Engine::counters() const { return impl_->counters(); }
int64_t Engine::steps_taken() const { return impl_->steps_taken(); }
float Engine::loss_scale() const { return impl_->loss_scale(); }
int64_t Engine::skipped_steps() const { return impl_->skipped_steps(); }

}  // namespace strata::engine
