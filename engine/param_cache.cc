#include "engine/param_cache.h"

#include <algorithm>

#include "base/logging.h"

namespace strata::engine {

ParamCache::ParamCache(const Model& model, const Plan& plan, gpu::Stream* compute, gpu::Stream* h2d,
                       StateStore* store, ParamCacheOptions options)
    : model_(model),
      plan_(plan),
      o_(options),
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
                                                         std::span<const gpu::DeviceSpan> slots,
                                                         ParamCacheOptions options) {
  std::unique_ptr<ParamCache> c(new ParamCache(model, plan, compute, h2d, store, options));
  const int n = model.num_blocks();
  auto event = [&]() { return device->CreateEvent(); };
  if (c->dp()) {
    STRATA_ASSIGN_OR_RETURN(c->gather_, device->CreateStream("all-gather"));
    STRATA_ASSIGN_OR_RETURN(c->param_comm_, options.comm->Duplicate());
  }
  c->resident_.resize(n);
  for (int b = 0; b < n; ++b) {
    if (!plan.blocks[b].resident) continue;
    DeviceCopy& r = c->resident_[b];
    r.dev = resident[b];
    r.block = b;
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
  c->param_version_.assign(n, 0);
  c->updated_on_device_.assign(n, false);
  c->loader_ = std::make_unique<WorkQueue>("prefetch");
  return c;
}

void ParamCache::StartLoad(DeviceCopy& c, int b) {
  c.block = b;
  c.version = param_version_[b];
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

Status ParamCache::UpdatedOnDevice(int b) {
  STRATA_CHECK(dp() && plan_.blocks[b].resident);
  Invalidate(b);
  updated_on_device_[b] = true;
  return compute_->Record(*resident_[b].copied);
}

ParamCache::DeviceCopy* ParamCache::Request(int b, std::span<const int> protect) {
  if (plan_.blocks[b].resident) {
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
  // At most one held block (a tied chunk) and the window's first: no allocation per block.
  STRATA_CHECK(held.size() <= 1);
  int protect[2];
  std::copy(held.begin(), held.end(), protect);
  protect[held.size()] = window[0];
  DeviceCopy* c = Request(b, std::span<const int>(protect, held.size() + 1));
  c->last_use = use_clock_++;
  STRATA_RETURN_IF_ERROR(loader_->WaitFor(c->load_ticket));
  if (!o_.overlap) STRATA_RETURN_IF_ERROR(h2d_->Synchronize());
  if (!o_.overlap && dp()) STRATA_RETURN_IF_ERROR(gather_->Synchronize());
  STRATA_RETURN_IF_ERROR(compute_->Wait(*c->ready));
  return Acquired{ConstTensorRef(c->dev.data, o_.precision, model_.block_num_params(b)), c};
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

}  // namespace strata::engine
