#include "engine/state_regions.h"

#include <fmt/format.h>

namespace strata::engine {

StatusOr<std::unique_ptr<StateRegions>> StateRegions::Create(StateRegionsOptions options) {
  std::unique_ptr<StateRegions> r(new StateRegions(std::move(options)));
  if (!r->o_.nvme && !r->o_.swap) return r;
  if (r->o_.nvme && !r->o_.extent_name) {
    return InvalidArgumentError("StateRegions: NVMe homes need StateRegionsOptions::extent_name");
  }
  if (r->o_.io_backend_factory) {
    STRATA_ASSIGN_OR_RETURN(r->io_, r->o_.io_backend_factory(r->o_.io));
    if (!r->io_) return InvalidArgumentError("EngineTestHooks::io_backend_factory returned null");
  } else {
    STRATA_ASSIGN_OR_RETURN(r->io_, io::CreateIoBackend(r->o_.io));
  }
  io::SwapStoreOptions so;
  so.dirs = r->o_.nvme_paths;
  STRATA_ASSIGN_OR_RETURN(r->swap_, io::SwapStore::Create(r->io_.get(), so));
  return r;
}

StatusOr<int> StateRegions::AddUnit(uint64_t region_bytes, bool here) {
  const int u = num_units();
  AlignedBuffer host;
  if (here && o_.nvme) {
    STRATA_RETURN_IF_ERROR(swap_->Allocate(o_.extent_name(u), region_bytes));
  } else if (here) {
    STRATA_ASSIGN_OR_RETURN(host, AlignedBuffer::Allocate(region_bytes, kDirectIoAlignment));
  }
  bytes_.push_back(region_bytes);
  host_.push_back(std::move(host));
  return u;
}

void StateRegions::DropLastUnit() {
  bytes_.pop_back();
  host_.pop_back();
}

Status StateRegions::Read(int u, int buffer) {
  trace::ScopedTraceEvent t(trace_, read_track_, "read optimizer state",
                            trace::Category::kNvmeRead);
  return ReadTo(u, buffers_[buffer]);
}

Status StateRegions::Write(int u, int buffer) {
  if (!o_.nvme) return Status::Ok();
  return WriteFrom(u, buffers_[buffer]);
}

StatusOr<std::byte*> StateRegions::Load(int u, bool read) {
  if (o_.nvme && read) STRATA_RETURN_IF_ERROR(Read(u, 0));
  return Region(u, 0);
}

Status StateRegions::CheckSpan(int u, size_t size_bytes) const {
  if (size_bytes < io::SwapStore::PaddedSize(bytes_[u])) {
    return InvalidArgumentError(
        fmt::format("StateRegions: unit {} ({}) needs a buffer of {} bytes, got {}", u,
                    o_.extent_name(u), io::SwapStore::PaddedSize(bytes_[u]), size_bytes));
  }
  return Status::Ok();
}

Status StateRegions::ReadTo(int u, std::span<std::byte> dst) {
  STRATA_RETURN_IF_ERROR(CheckSpan(u, dst.size()));
  return swap_->Read(o_.extent_name(u), dst.first(io::SwapStore::PaddedSize(bytes_[u])));
}

Status StateRegions::WriteFrom(int u, std::span<const std::byte> src) {
  STRATA_RETURN_IF_ERROR(CheckSpan(u, src.size()));
  return swap_->Write(o_.extent_name(u), src.first(io::SwapStore::PaddedSize(bytes_[u])));
}

}  // namespace strata::engine
