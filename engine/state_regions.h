// State regions: the storage half of a CPU optimizer, shared by the engine's StateStore (one unit
// per block) and the OffloadOptimizer (one unit per bucket). A unit is one byte region holding its
// fp32 master weights and optimizer state, laid out by its owner; this class only says where it
// lives and moves it (docs/ARCHITECTURE.md, "The CPU optimizer pipeline and NVMe swap").
//
// Homes (one for every unit of a StateRegions, StateRegionsOptions::nvme):
//   host memory  each unit's region is its own 4 KiB-aligned AlignedBuffer (pageable), updated in
//                place: Region(u, any buffer) is the home.
//   NVMe         each unit's region is the swap-store extent extent_name(u) (io/swap_store.h:
//                xxh3-checked, striped over the directories, removed at destruction). The update
//                works on one of the owner's pipeline buffers: Read(u, i) fills buffer i from the
//                extent, Write(u, i) writes it back; Region(u, i) is buffer i.
//   elsewhere    AddUnit(bytes, /*here=*/false): the owner keeps the unit (the engine's blocks
//   whose
//                optimizer runs on the device); it has no region here and every accessor but
//                region_bytes must not be called for it.
//
// The swap store is made here (when options.nvme or options.swap) and may hold the owner's own
// extents too (swap(): the engine's NVMe working params).
//
// Ownership: the host regions, the swap store and its I/O backend are owned here. The pipeline
// buffers are the owner's (pinned the owner's way: gpu::Device::AllocatePinned for the engine,
// mlock for the offload optimizer); SetPipelineBuffers keeps views, which must outlive every call
// that touches a buffer.
//
// Threads. Read and Write are the read and write-back stages of the owner's OptimizerPipeline
// (optimizer_pipeline.h) and run on its stage threads: calls for distinct buffers may run
// concurrently (the swap store is thread-safe); the pipeline orders a buffer's uses. AddUnit,
// DropLastUnit, SetPipelineBuffers and SetTrace are for the owner's driving thread while no stage
// runs; Load, ReadTo and WriteFrom while no update touches the unit (the pipeline drained). Read
// records "read optimizer state" on the trace's read track; Write records nothing (the owner's
// write stage records its own event around it and any extents of its own).
//
// Errors: Create returns the I/O backend's or the swap store's Status (an unusable directory);
// AddUnit returns kResourceExhausted for host memory, the swap store's Status for an extent
// (kResourceExhausted for a full drive); Read, Write, Load, ReadTo and WriteFrom return the swap
// store's Status (kDataLoss for a checksum mismatch, the I/O error). Nothing here is sticky: the
// owner's pipeline and error handling are.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/status.h"
#include "base/trace.h"
#include "io/io_backend.h"
#include "io/swap_store.h"

namespace strata::engine {

struct StateRegionsOptions {
  bool nvme = false;  // the units' regions live in swap-store extents (else in host memory)
  bool swap = false;  // make the swap store even when the regions are in host memory
  std::vector<std::string> nvme_paths;  // the swap store's parent directories
  io::IoBackendOptions io;
  // Test seam: makes the swap store's I/O backend instead of io::CreateIoBackend. Null result:
  // kInvalidArgument.
  std::function<StatusOr<std::unique_ptr<io::IoBackend>>(const io::IoBackendOptions&)>
      io_backend_factory;
  // Unit u's extent name ("block{u}.optim", "bucket{u}.state"); required when nvme.
  std::function<std::string(int unit)> extent_name;
};

class StateRegions {
 public:
  static StatusOr<std::unique_ptr<StateRegions>> Create(StateRegionsOptions options);

  // The trace track of the read stage (recorder not owned, may be null).
  void SetTrace(trace::TraceRecorder* trace, int read_track) {
    trace_ = trace;
    read_track_ = read_track;
  }
  // The owner's pipeline buffers (views; 4096-aligned, each at least the largest unit's
  // io::SwapStore::PaddedSize(region_bytes) from offset 0; needed only for NVMe homes).
  void SetPipelineBuffers(std::vector<std::span<std::byte>> buffers) {
    buffers_ = std::move(buffers);
  }

  // Adds unit num_units() of region_bytes: its zero-filled host region, or its extent (nothing
  // added on error). here = false: kept elsewhere by the owner (nothing allocated).
  StatusOr<int> AddUnit(uint64_t region_bytes, bool here = true);
  // Forgets the last unit (an owner's failed set-up of it): frees its host region; an extent
  // stays allocated in the swap store under its name.
  void DropLastUnit();
  int num_units() const { return static_cast<int>(bytes_.size()); }
  uint64_t region_bytes(int u) const { return bytes_[u]; }
  bool nvme() const { return o_.nvme; }
  // Host memory of unit u's home region (0 on NVMe or elsewhere).
  uint64_t host_bytes(int u) const { return host_[u].size_bytes(); }

  // Unit u's region as the update sees it: its host home, or pipeline buffer `buffer` (NVMe).
  std::byte* Region(int u, int buffer) const {
    return o_.nvme ? buffers_[buffer].data() : host_[u].data();
  }
  // The read stage: NVMe -> pipeline buffer `buffer` (NVMe homes only).
  Status Read(int u, int buffer);
  // The state part of the write-back stage: pipeline buffer `buffer` -> NVMe; nothing for host
  // homes.
  Status Write(int u, int buffer);
  // Unit u's region for reading or restoring between updates: its host home, or pipeline buffer
  // 0 read from the extent (read = false: not read, to be overwritten and written back with
  // Write(u, 0)). Returns Region(u, 0).
  StatusOr<std::byte*> Load(int u, bool read = true);
  // Synchronous copies of an NVMe unit's extent into / from the caller's memory (4096-aligned,
  // at least PaddedSize(region_bytes); for owners that touch a unit outside the pipeline
  // buffers). A span shorter than that: kInvalidArgument, nothing copied.
  Status ReadTo(int u, std::span<std::byte> dst);
  Status WriteFrom(int u, std::span<const std::byte> src);

  io::SwapStore* swap() const { return swap_.get(); }
  std::string_view io_backend_name() const { return swap_ ? swap_->backend_name() : ""; }
  uint64_t nvme_bytes_read() const { return swap_ ? swap_->bytes_read() : 0; }
  uint64_t nvme_bytes_written() const { return swap_ ? swap_->bytes_written() : 0; }

 private:
  explicit StateRegions(StateRegionsOptions options) : o_(std::move(options)) {}
  // kInvalidArgument when size_bytes is short of unit u's padded extent.
  Status CheckSpan(int u, size_t size_bytes) const;

  const StateRegionsOptions o_;
  std::vector<uint64_t> bytes_;      // region_bytes per unit
  std::vector<AlignedBuffer> host_;  // host homes (empty on NVMe or elsewhere)
  std::vector<std::span<std::byte>> buffers_;
  trace::TraceRecorder* trace_ = nullptr;
  int read_track_ = 0;
  std::unique_ptr<io::IoBackend> io_;
  std::unique_ptr<io::SwapStore> swap_;
};

}  // namespace strata::engine
