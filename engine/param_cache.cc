#include "engine/param_cache.h"

#include <algorithm>

#include "base/logging.h"

namespace strata::engine {

ParamCache::ParamCache(const Model& model, const Plan& plan, gpu::Stream* compute, gpu::Stream* h2d,
                       StateStore* store, ParamCacheOptions options)
    : model_(model),
      plan_(plan),
      o_(options),
      n_(model.num_blocks()),
      w_(SizeOf(options.precision)),
      compute_(compute),
      h2d_(h2d),
      store_(store) {}

ParamCache::~ParamCache() {
  if (loader_) loader_->Drain().IgnoreError();
  if (gather_) gather_->Synchronize().IgnoreError();
}

StatusOr<std::unique_ptr<ParamCache>> ParamCache::Create(const Model& model, const Plan& plan,
                                                         gpu::Device* device, gpu::Stream* compute,
                                                         gpu::Stream* h2d, StateStore* store,
                                                         std::span<const gpu::DeviceSpan> resident,
                                                         std::span<const gpu::DeviceSpan> frozen,
                                                         std::span<const gpu::DeviceSpan> slots,
                                                         ParamCacheOptions options) {
  std::unique_ptr<ParamCache> c(new ParamCache(model, plan, compute, h2d, store, options));
  const int n = model.num_blocks();
  auto event = [&]() { return device->CreateEvent(); };
  if (c->dp()) {
    STRATA_ASSIGN_OR_RETURN(c->gather_, device->CreateStream("all-gather"));
    STRATA_ASSIGN_OR_RETURN(c->param_comm_, options.comm->Duplicate());
  }
  c->resident_.resize(2 * n);
  for (int chunk = 0; chunk < 2 * n; ++chunk) {
    if (!c->chunk_resident(chunk)) continue;
    DeviceCopy& r = c->resident_[chunk];
    r.dev = chunk < n ? resident[chunk] : frozen[chunk - n];
    r.block = chunk;
    STRATA_ASSIGN_OR_RETURN(r.ready, event());
    STRATA_ASSIGN_OR_RETURN(r.released, event());
    if (c->dp()) {
      STRATA_ASSIGN_OR_RETURN(r.copied, event());
    }
  }
  c->slots_.resize(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    DeviceCopy& s = c->slots_[i];
    s.dev = slots[i];
    STRATA_ASSIGN_OR_RETURN(s.ready, event());
    STRATA_ASSIGN_OR_RETURN(s.released, event());
    if (c->dp()) {
      STRATA_ASSIGN_OR_RETURN(s.copied, event());
    }
    if (plan.param_home == ParamHome::kNvme) {
      STRATA_ASSIGN_OR_RETURN(s.staging,
                              device->AllocatePinned(plan.partition_bytes, "NVMe staging"));
    }
  }
  c->param_version_.assign(2 * n, 0);
  c->updated_on_device_.assign(n, false);
  c->loader_ = std::make_unique<WorkQueue>("prefetch");
  return c;
}

void ParamCache::StartLoad(DeviceCopy& c, int b) {
  c.block = b;
  c.version = param_version_[b];
  if (b >= n_) {
    StartFrozenLoad(c, b - n_);
    return;
  }
  // This rank's partition of the block (the whole block with one rank): H2D to its offset, then
  // all-gathered in place on the device.
  const Partition& part = plan_.blocks[b].partition;
  const uint64_t bytes = part.part_elems * w_;
  const bool from_nvme = store_->params_on_nvme(b);
  const gpu::DeviceSpan dst = c.dev.subspan(part.offset_elems * w_, bytes);
  const gpu::DeviceSpan whole_dev = c.dev.subspan(0, part.padded_elems * w_);
  const int64_t home_elems = part.part_elems;
  const gpu::PinnedSpan staging = c.staging.span();
  gpu::Event* ready = c.ready.get();
  gpu::Event* released = c.released.get();
  gpu::Event* copied = c.copied.get();
  if (updated_on_device_[b]) {
    // The device update wrote this rank's partition in place (UpdatedOnDevice recorded `copied`
    // on compute after it): only the all-gather.
    c.load_ticket = loader_->Submit([=, this]() -> Status {
      STRATA_RETURN_IF_ERROR(gather_->Wait(*copied));
      STRATA_RETURN_IF_ERROR(
          param_comm_->AllGatherInPlace(whole_dev, home_elems, o_.precision, *gather_));
      return gather_->Record(*ready);
    });
    return;
  }
  c.load_ticket = loader_->Submit([=, this]() -> Status {
    // Block b's update (if one is in flight) must have written its new params.
    STRATA_RETURN_IF_ERROR(store_->WaitBlock(b));
    // The device copy may still be read by compute: order the H2D after it.
    STRATA_RETURN_IF_ERROR(h2d_->Wait(*released));
    gpu::PinnedSpan src;
    if (from_nvme) {
      // The pinned staging may still feed the slot's previous copy.
      STRATA_RETURN_IF_ERROR(ready->Synchronize());
      trace::ScopedTraceEvent t(o_.trace, o_.load_track, "read params", trace::Category::kNvmeRead);
      STRATA_RETURN_IF_ERROR(store_->ReadParams(b, staging));
      src = staging.subspan(0, bytes);
    } else {
      src = store_->PinnedHome(b).subspan(0, bytes);
    }
    STRATA_RETURN_IF_ERROR(h2d_->CopyH2D(dst, src));
    if (!dp()) return h2d_->Record(*ready);
    // The prefetch thread alone issues the all-gathers, in the order the driving thread
    // requested the loads: the same order on every rank.
    STRATA_RETURN_IF_ERROR(h2d_->Record(*copied));
    STRATA_RETURN_IF_ERROR(gather_->Wait(*copied));
    STRATA_RETURN_IF_ERROR(
        param_comm_->AllGatherInPlace(whole_dev, home_elems, o_.precision, *gather_));
    return gather_->Record(*ready);
  });
}

void ParamCache::StartFrozenLoad(DeviceCopy& c, int b) {
  // Never written after Initialize: no update to wait for, no all-gather (no data parallelism).
  const uint64_t bytes = plan_.blocks[b].frozen_bytes;  // encoded chunks: their own size
  const bool from_nvme = store_->frozen_on_nvme(b);
  const gpu::DeviceSpan dst = c.dev.subspan(0, bytes);
  const gpu::PinnedSpan staging = c.staging.span();
  gpu::Event* ready = c.ready.get();
  gpu::Event* released = c.released.get();
  c.load_ticket = loader_->Submit([=, this]() -> Status {
    STRATA_RETURN_IF_ERROR(h2d_->Wait(*released));
    gpu::PinnedSpan src;
    if (from_nvme) {
      STRATA_RETURN_IF_ERROR(ready->Synchronize());
      trace::ScopedTraceEvent t(o_.trace, o_.load_track, "read frozen params",
                                trace::Category::kNvmeRead);
      STRATA_RETURN_IF_ERROR(store_->ReadFrozen(b, staging));
      src = staging.subspan(0, bytes);
    } else {
      src = store_->FrozenPinnedHome(b).subspan(0, bytes);
    }
    STRATA_RETURN_IF_ERROR(h2d_->CopyH2D(dst, src));
    return h2d_->Record(*ready);
  });
}

Status ParamCache::UpdatedOnDevice(int b) {
  STRATA_CHECK(dp() && plan_.blocks[b].resident);
  Invalidate(b);
  updated_on_device_[b] = true;
  return compute_->Record(*resident_[b].copied);
}

ParamCache::DeviceCopy* ParamCache::Request(int b, std::span<const int> protect) {
  if (chunk_resident(b)) {
    DeviceCopy& c = resident_[b];
    if (c.version != param_version_[b]) StartLoad(c, b);
    return &c;
  }
  for (auto& s : slots_) {
    if (s.block == b && s.version == param_version_[b]) return &s;
  }
  // Least recently used among the slots that hold nothing needed soon (stale copies are free).
  DeviceCopy* victim = nullptr;
  for (auto& s : slots_) {
    const bool fresh = s.block >= 0 && s.version == param_version_[s.block];
    if (fresh && std::find(protect.begin(), protect.end(), s.block) != protect.end()) continue;
    if (!victim || s.last_use < victim->last_use) victim = &s;
  }
  STRATA_CHECK_MSG(victim != nullptr, "no streaming slot free outside the prefetch window");
  StartLoad(*victim, b);
  victim->last_use = use_clock_++;
  return victim;
}

StatusOr<ParamCache::Acquired> ParamCache::Acquire(int b, std::span<const int> window,
                                                   std::span<const int> held) {
  // At most two held chunks (a frozen and a tied one) and the window's first: no allocation per
  // block.
  STRATA_CHECK(held.size() <= 2);
  int protect[3];
  std::copy(held.begin(), held.end(), protect);
  protect[held.size()] = window[0];
  DeviceCopy* c = Request(b, std::span<const int>(protect, held.size() + 1));
  c->last_use = use_clock_++;
  STRATA_RETURN_IF_ERROR(loader_->WaitFor(c->load_ticket));
  if (!o_.overlap) STRATA_RETURN_IF_ERROR(h2d_->Synchronize());
  if (!o_.overlap && dp()) STRATA_RETURN_IF_ERROR(gather_->Synchronize());
  STRATA_RETURN_IF_ERROR(compute_->Wait(*c->ready));
  const int64_t elems = b < n_ ? model_.block_num_params(b) : plan_.blocks[b - n_].frozen_params;
  return Acquired{ConstTensorRef(c->dev.data, o_.precision, elems), c};
}

Status ParamCache::Release(const Acquired& a) { return compute_->Record(*a.copy->released); }

Status ParamCache::AfterOp(const Acquired& a, std::span<const int> window) {
  // The block read its params in place: the copy is free once the op is done.
  STRATA_RETURN_IF_ERROR(Release(a));
  if (!o_.overlap) return compute_->Synchronize();
  // Prefetch the next blocks of the sequence; the window (this block and the next ones) is
  // never evicted.
  const size_t depth = static_cast<size_t>(plan_.prefetch_depth);
  const auto protect = window.subspan(0, std::min(depth + 1, window.size()));
  for (size_t i = 1; i < protect.size(); ++i) Request(protect[i], protect);
  return Status::Ok();
}

std::vector<int> ParamCache::UseOrder(bool backward) const {
  std::vector<int> seq;
  for (int i = 0; i < n_; ++i) {
    const int b = backward ? n_ - 1 - i : i;
    const int t = model_.tied_block(b);
    if (model_.block_frozen_params(b) > 0) seq.push_back(n_ + b);
    if (t >= 0) seq.push_back(model_.block_num_params(t) > 0 ? t : n_ + t);
    if (model_.block_num_params(b) > 0) seq.push_back(b);
  }
  return seq;
}

StatusOr<ParamCache::BlockChunks> ParamCache::AcquireBlock(int b, std::span<const int> seq,
                                                           size_t* cursor) {
  BlockChunks c;
  int held[2];
  size_t num_held = 0;
  const auto take = [&](std::optional<Acquired>* slot, int chunk, bool more) -> Status {
    STRATA_CHECK(seq[*cursor] == chunk);
    STRATA_ASSIGN_OR_RETURN(
        *slot, Acquire(chunk, seq.subspan(*cursor), std::span<const int>(held, num_held)));
    if (more) {
      held[num_held++] = chunk;
      ++*cursor;
    }
    return Status::Ok();
  };
  const int t = model_.tied_block(b);
  const bool own = model_.block_num_params(b) > 0, tying = t >= 0;
  if (model_.block_frozen_params(b) > 0) {
    STRATA_RETURN_IF_ERROR(take(&c.frozen, n_ + b, tying || own));
  }
  if (tying) {
    STRATA_RETURN_IF_ERROR(take(&c.tied, model_.block_num_params(t) > 0 ? t : n_ + t, own));
  }
  if (own) STRATA_RETURN_IF_ERROR(take(&c.own, b, false));
  return c;
}

Status ParamCache::DoneBlock(const BlockChunks& c, std::span<const int> seq, size_t cursor) {
  // The other chunks are free once the op is done; recorded before AfterOp's prefetch may reuse
  // their copies.
  const Acquired& last = c.own ? *c.own : (c.tied ? *c.tied : *c.frozen);
  for (const std::optional<Acquired>* a : {&c.frozen, &c.tied, &c.own}) {
    if (*a && &**a != &last) STRATA_RETURN_IF_ERROR(Release(**a));
  }
  return AfterOp(last, seq.subspan(cursor));
}

}  // namespace strata::engine
