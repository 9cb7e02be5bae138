// The parameter cache: each block's working params on the device, where the forward and backward
// read them in place (docs/ARCHITECTURE.md, "Forward"). A resident block has its own device
// region; the streamed blocks share plan.streaming_slots slots, least recently used first, and
// are loaded (prefetched) ahead of their use from their home in the state store (pinned host
// memory, or NVMe through the slot's pinned staging buffer). Data parallel: the load copies this
// rank's partition to its offset and all-gathers the block in place on the stream "all-gather".
//
// Versions: Invalidate(b) marks every device copy of block b stale (an update of b was
// submitted, or a checkpoint load rewrote its home); the next Acquire of b loads it again, and
// that load first waits for b's update (StateStore::WaitBlock), so no op reads stale params.
//
// Threads and streams. Acquire, Release, AfterOp, Invalidate and Drain are for the driving
// thread only. A load runs on the "prefetch" work queue (trace track "host: prefetch (nvme
// read)"): wait for the block's update, wait on the copy's `released` event (h2d), read NVMe into
// the staging (after synchronizing the copy's previous `ready`), H2D on the h2d stream (not
// owned), record `ready` (h2d; data parallel: record `copied`, all-gather on this cache's own
// stream with the params' communicator, a duplicate of EngineOptions::comm, then record `ready`).
// The compute stream (not owned) waits on `ready` before the op and records `released` after it.
//
// Chunks. Block b's own params are chunk b, its frozen params (Model::block_frozen_params) chunk
// n + b (n = num_blocks): every call below takes a chunk, and a frozen chunk is loaded like a
// block's (resident region or slot, from its pinned or NVMe home: StateStore::FrozenPinnedHome,
// ReadFrozen) except that it is never invalidated, waits for no update and is not all-gathered.
//
// Invariants: the copies of the prefetch window's first block and of blocks held for the same op
// are never evicted by a load; there is always a slot outside the window (the planner gives at
// least prefetch_depth + 2 slots; STRATA_CHECK otherwise).
//
// Errors: Acquire returns the load's Status (NVMe read, copy, all-gather) and the streams'.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "base/trace.h"
#include "comm/communicator.h"
#include "engine/plan/model.h"
#include "engine/plan/planner.h"
#include "engine/state_store.h"
#include "engine/work_queue.h"
#include "gpu/device.h"

namespace strata::engine {

struct ParamCacheOptions {
  DType precision = DType::kBF16;  // of the working params
  bool overlap = true;  // false: every load completes inside Acquire, every op inside AfterOp
  comm::Communicator* comm = nullptr;     // data parallel; not owned
  trace::TraceRecorder* trace = nullptr;  // not owned, may be null
  int load_track = 0;
};

class ParamCache {
 public:
  // Where one block's working params sit on the device: a streaming slot or a resident block's
  // own region.
  struct DeviceCopy {
    gpu::DeviceSpan dev;
    gpu::PinnedBuffer staging;  // streaming slots with the NVMe home: NVMe -> pinned -> device
    int block = -1;
    int64_t version = -1;  // the block's param version the copy holds (or is loading)
    int64_t last_use = -1;
    uint64_t load_ticket = 0;              // loader ticket of the load that fills it
    std::unique_ptr<gpu::Event> ready;     // H2D into dev completed
    std::unique_ptr<gpu::Event> released;  // compute finished reading dev
    std::unique_ptr<gpu::Event> copied;    // data parallel: the H2D of this rank's partition
  };
  struct Acquired {
    ConstTensorRef params;  // the block's working params where they sit (resident or a slot)
    DeviceCopy* copy;
  };

  // `resident[b]`: block b's device region (empty for streamed blocks), `frozen[b]` its frozen
  // chunk's (empty unless Plan::Block::frozen_resident), `slots`: the streaming slots' regions,
  // all carved by the caller in the planner's order. `store` is not owned and
  // must outlive the cache. Creates the events, the staging buffers (NVMe home), and (data
  // parallel) the "all-gather" stream and the params' communicator.
  static StatusOr<std::unique_ptr<ParamCache>> Create(const Model& model, const Plan& plan,
                                                      gpu::Device* device, gpu::Stream* compute,
                                                      gpu::Stream* h2d, StateStore* store,
                                                      std::span<const gpu::DeviceSpan> resident,
                                                      std::span<const gpu::DeviceSpan> frozen,
                                                      std::span<const gpu::DeviceSpan> slots,
                                                      ParamCacheOptions options);
  ~ParamCache();  // drains the prefetch queue and the all-gather stream

  // The order blocks use their chunks in one forward pass (0..n-1) or one backward pass
  // (n-1..0): a block's frozen chunk, then the tied chunk it reads (Model::tied_block: that
  // block's own chunk, or its frozen one when it has no own params), then its own (each when it
  // has one). Pure.
  std::vector<int> UseOrder(bool backward) const;
  // The chunks of block b for one op, in UseOrder's order.
  struct BlockChunks {
    std::optional<Acquired> frozen, tied, own;
  };
  // Acquires block b's chunks from seq[*cursor] on (each one held while the next loads) and
  // leaves *cursor on the block's last chunk. DoneBlock, once the op is enqueued on compute,
  // releases them and prefetches from there (AfterOp on the last). Errors: Acquire's.
  StatusOr<BlockChunks> AcquireBlock(int b, std::span<const int> seq, size_t* cursor);
  Status DoneBlock(const BlockChunks& c, std::span<const int> seq, size_t cursor);
  // Makes the compute stream wait for chunk b's load; the block reads the params in place.
  // Neither the copies of window[0] nor those of `held` (chunks acquired for the same op, at most
  // two) are evicted by the load.
  StatusOr<Acquired> Acquire(int b, std::span<const int> window, std::span<const int> held = {});
  // The op that read `a` is enqueued on compute: its copy is free once that op is done.
  Status Release(const Acquired& a);
  // Release, then (overlap) start the loads of the next prefetch_depth blocks of the sequence
  // `window` (window[0] is a's block), or (no overlap) wait for the op.
  Status AfterOp(const Acquired& a, std::span<const int> window);
  void Invalidate(int b) {
    ++param_version_[b];
    updated_on_device_[b] = false;
  }
  // Data parallel: the compute stream has just been given the device update of block b, which
  // writes this rank's partition of its resident copy; the next Acquire all-gathers the block in
  // place (after that update) instead of loading it from its home. Driving thread.
  Status UpdatedOnDevice(int b);
  // Waits for every load task (NVMe reads done, H2D copies enqueued).
  Status Drain() { return loader_->Drain(); }

 private:
  ParamCache(const Model& model, const Plan& plan, gpu::Stream* compute, gpu::Stream* h2d,
             StateStore* store, ParamCacheOptions options);
  bool dp() const { return o_.comm != nullptr; }
  bool chunk_resident(int c) const {
    return c < n_ ? plan_.blocks[c].resident : plan_.blocks[c - n_].frozen_resident;
  }
  void StartFrozenLoad(DeviceCopy& c, int b);  // chunk n + b
  // Returns the device copy that holds (or is loading) block b's current params, starting a
  // load into the least recently used slot outside `protect` when there is none.
  DeviceCopy* Request(int b, std::span<const int> protect);
  void StartLoad(DeviceCopy& c, int b);

  const Model& model_;
  const Plan& plan_;
  const ParamCacheOptions o_;
  const int n_;  // blocks; chunks are 2 n
  const size_t w_;
  gpu::Stream* compute_;
  gpu::Stream* h2d_;
  StateStore* store_;
  // Driving thread only. param_version_[b] counts the invalidations of block b; a copy holding
  // an older version is stale.
  std::vector<DeviceCopy> resident_;  // per block; dev empty when streamed
  std::vector<DeviceCopy> slots_;
  std::vector<int64_t> param_version_;
  std::vector<bool> updated_on_device_;  // UpdatedOnDevice since the last Invalidate
  int64_t use_clock_ = 0;
  // Data parallel: params all-gather on gather_ (param_comm_, the prefetch thread's order).
  std::unique_ptr<gpu::Stream> gather_;
  std::unique_ptr<comm::Communicator> param_comm_;
  // Declared last: destroyed (joined) first.
  std::unique_ptr<WorkQueue> loader_;
};

}  // namespace strata::engine
