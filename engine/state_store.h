// The state store: each engine block's fp32 master weights and optimizer state (host memory or
// the NVMe swap store), its working params' home (pinned host memory or NVMe), and the update
// that reads, steps and writes them back (docs/ARCHITECTURE.md, "The CPU optimizer pipeline and
// NVMe swap").
//
// Memory (this rank's partition of each block, planner.h Partition):
//   state region   [p32 | section 0 | section 1 | ...] (optimizer_state.h), one per block, kept
//                  by a StateRegions (state_regions.h, unit b = block b; shared with the
//                  OffloadOptimizer): an aligned host buffer, or the swap-store extent
//                  "block{b}.optim" read into and written from a pipeline buffer
//                  (OptimizerHome::kNvme)
//   working home   the params the device loads: a pinned buffer per block (param home device or
//                  host, and every resident block), or the extent "block{b}.params" for streamed
//                  blocks with ParamHome::kNvme, written from the pipeline buffer's copy-out area
//   frozen home    a block's frozen chunk (Model::block_frozen_params), alike: a pinned buffer, or
//                  the extent "block{b}.frozen" when it streams from NVMe; written by Initialize
//                  only. A block with no own params has no state region and no working home.
//   pipeline buffers  plan.optimizer_buffers pinned buffers of plan.optimizer_buffer_bytes:
//                  [state region (NVMe state only)][copy-out area (NVMe params only)]
//
// Threads. The update runs on the OptimizerPipeline's three work queues (optimizer_pipeline.h):
// read (NVMe -> pipeline buffer, trace track "host: optimizer state read"), update
// (cpu_optim::UpdateState with the block's gradient and the round's optimizer, "host: cpu
// optimizer"), write (pipeline buffer -> NVMe, "host: optimizer state write"). Submit, WaitBlock
// and Drain may be called from any thread (the driving thread, the gradient fold through
// SubmitSpeculative for the update during backward, the prefetch thread); everything else is for
// the driving thread, and the accessors of a block's region (Load, Master, Section, WorkingHome
// with buffer 0) only while no update is in flight (after Drain).
//
// Invariants: block b's update writes its new working params into WorkingHome(b, buffer) and,
// for NVMe homes, to their extents before WaitBlock(b) returns; StartRound changes the
// hyper-parameters only between rounds (the pipeline drained). Nothing here changes the numbers:
// the update is the sequential one, bit for bit.
//
// Blocks whose optimizer runs on the device (Plan::Block::optimizer_on_device): their state region
// is a device region (SetDeviceBlock, the planner's "optimizer state" region, laid out as the host
// one) and their update is EnqueueDeviceUpdate on a device stream (engine/device_optimizer.h),
// which writes the new working params into the block's resident device copy; the pipeline never
// sees them. Their region's accessors (Load, Master, Section, WriteBack) go through one pinned
// staging buffer, copied on the store's own "optimizer state copy" stream and synchronized there:
// Load copies the region D2H into it, WriteBack copies it back H2D, so checkpoints and
// initialization work alike for every home. Their pinned working-params home is refreshed from the
// device copy by WorkingParamsBytes.
//
// Errors: Create returns an unusable swap path's or the I/O backend's Status, allocation
// failures (kResourceExhausted); a failing stage's Status is sticky in the pipeline and comes
// back from WaitBlock and Drain; the synchronous reads and writes return the swap store's
// Status.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/dtype.h"
#include "base/status.h"
#include "base/trace.h"
#include "cpu_optim/any_optimizer.h"
#include "engine/optimizer_pipeline.h"
#include "engine/plan/model.h"
#include "engine/plan/optimizer_state.h"
#include "engine/plan/planner.h"
#include "engine/shared_frozen_base.h"
#include "engine/state_regions.h"
#include "engine/update_speculation.h"
#include "gpu/device.h"
#include "io/io_backend.h"

namespace strata::engine {

struct StateStoreOptions {
  DType precision = DType::kBF16;                      // of the working params
  const cpu_optim::AnyOptimizer* optimizer = nullptr;  // the run's (layouts only); not owned
  bool inference_only = false;                         // working homes only: no state, no update
  bool data_parallel = false;  // zero the homes' padding past a partition's end
  // EngineOptions::decay_norms_and_biases: false steps each block's BlockState::no_decay
  // elements with weight_decay 0 (cpu_optim::UpdateState's weight decay groups).
  bool decay_norms_and_biases = false;
  io::IoBackendOptions io;
  std::vector<std::string> nvme_paths;
  // EngineTestHooks::io_backend_factory: when set, makes the swap store's I/O backend.
  std::function<StatusOr<std::unique_ptr<io::IoBackend>>(const io::IoBackendOptions&)>
      io_backend_factory;
  // Block b's gradient as the update reads it (the gradient streamer's host gradient); called on
  // the update stage's thread.
  std::function<cpu_optim::GradView(int block)> gradient;
  // EngineOptions::init_progress, called by Initialize on its calling thread.
  std::function<void(int blocks_done, int num_blocks, int64_t params_done, int64_t num_params)>
      init_progress;
  // EngineOptions::cancel_requested, polled by Initialize on its calling thread between blocks.
  std::function<bool()> cancel_requested;
  // EngineOptions::update_during_backward (the engine decides); the backup area is the plan's
  // (Plan::speculation_backup_bytes).
  bool speculate = false;
  bool finish_speculation_before_verdict = false;  // EngineTestHooks
};

class StateStore {
 public:
  // Lays out every block's state (this rank's and the whole blocks'), makes the swap store and
  // its extents when anything lives on NVMe. No pinned memory yet (AllocateMemory).
  static StatusOr<std::unique_ptr<StateStore>> Create(const Model& model, const Plan& plan,
                                                      StateStoreOptions options);
  ~StateStore();  // drains the pipeline

  // The trace tracks of the pipeline's stages (recorder not owned, may be null); before
  // AllocateMemory.
  void SetTrace(trace::TraceRecorder* trace, int read_track, int update_track, int write_track) {
    trace_ = trace;
    read_track_ = read_track;
    update_track_ = update_track;
    write_track_ = write_track;
  }
  // Block b's optimizer runs on the device: its state region (layout(b).region_bytes, the
  // planner's "optimizer state" region) and its resident working params there. Before
  // AllocateMemory; every such block must have one.
  void SetDeviceBlock(int b, gpu::DeviceSpan state_region, gpu::DeviceSpan working_params) {
    device_state_[b] = state_region;
    device_working_[b] = working_params;
  }
  bool on_device(int b) const { return plan_.blocks[b].optimizer_on_device; }
  // Pinned homes and pipeline buffers, host state regions; starts the pipeline.
  Status AllocateMemory(gpu::Device* device);
  // Fills every block from model.InitParams(seed): master weights and the optimizer's initial
  // state (training), or the working params only (inference), and writes them to their homes.
  Status Initialize(Model& model, uint64_t seed);

  const BlockState& layout(int b) const { return state_[b]; }  // this rank's partition
  const std::vector<BlockState>& full_layouts() const { return full_state_; }  // whole blocks
  std::string_view io_backend_name() const { return regions_->io_backend_name(); }
  uint64_t nvme_bytes_read() const { return regions_->nvme_bytes_read(); }
  uint64_t nvme_bytes_written() const { return regions_->nvme_bytes_written(); }

  // --- The update (pipeline) ---
  // The optimizer and step of the updates submitted from now on (driving thread). Each submission
  // takes the round's parameters with it, so a round may start while the previous one's updates
  // still run.
  void StartRound(const cpu_optim::AnyOptimizer& optimizer, cpu_optim::OptimStep step) {
    round_ = {optimizer, step};
  }
  void Submit(int b) {
    block_round_[b] = round_;  // the update stage reads it after the queue hands it b
    pipeline_->Submit(b);
  }
  // --- The update during backward (StateStoreOptions::speculate; update_speculation.h) ---
  // The update stage backs up what a speculative update of block b overwrites in memory
  // (SpeculationBackupBytes) and the write stage holds a speculative block's write-back until
  // the verdict. Driving thread: opens a round whose updates may be submitted before the verdict
  // (SubmitSpeculative, from any thread), without waiting for the previous round's updates.
  void StartSpeculativeRound(const cpu_optim::AnyOptimizer& optimizer, cpu_optim::OptimStep step);
  // Submits b unless UpdateSpeculation::kQueueDepth submissions are still waiting to start;
  // whether it did.
  bool SubmitSpeculative(int b) {
    if (!speculation_->HasRoom()) return false;
    speculation_->Submitted(b);
    Submit(b);
    return true;
  }
  // Whether b was submitted in this round before the verdict.
  bool speculated(int b) { return speculation_->WasSubmitted(b); }
  // The verdict (driving thread). Stands: the speculative updates go on as submitted. Else they
  // finish or skip, their NVMe writes are dropped, the pipeline drains and every block updated
  // speculatively gets its backed-up bytes back. Returns the parameters whose update ran before
  // the verdict and stood (of this rank's partitions; 0 on a rollback), sets *rolled_back when
  // updates that ran were rolled back; the pipeline's sticky error.
  StatusOr<int64_t> EndSpeculativeRound(bool stands, bool* rolled_back);
  // Over all rounds: the parameters updated before the verdict that stood, and the rounds rolled
  // back (driving thread).
  uint64_t params_updated_during_backward() const { return params_during_backward_; }
  uint64_t rollback_steps() const { return rollback_steps_; }
  // A step that failed with the round open: the verdict is "roll back", so no stage waits for
  // one (the engine's state is unknown after an error anyway).
  void AbandonSpeculativeRound() {
    if (speculation_) speculation_->Resolve(false);
  }
  // What a speculative update of block b overwrites in memory: its state region when in host
  // memory, and its working params when their home is a pinned buffer.
  uint64_t SpeculationBackupBytes(int b) const;
  // The elements of block b's state buffer its update steps with weight_decay 0: the block's
  // BlockState::no_decay, or none with StateStoreOptions::decay_norms_and_biases.
  std::span<const cpu_optim::ElemRange> NoDecay(int b) const;
  // Those bytes of block b, in backup order: its state region (in pipeline buffer `buffer`), or
  // empty on NVMe, then its working params in their pinned home, or empty for an NVMe home.
  std::array<std::span<std::byte>, 2> SpeculatedBytes(int b, int buffer);
  // Enqueues the round's update of device-optimized block b on `stream` from its device gradient
  // (grad, grad_dtype: the gradient streamer's DeviceGradient), writing its new working params
  // into its resident device copy. Complete when `stream` has run it.
  Status EnqueueDeviceUpdate(int b, gpu::Stream& stream, gpu::DeviceSpan grad, DType grad_dtype);
  Status WaitBlock(int b) { return pipeline_->WaitBlock(b); }
  Status Drain() { return pipeline_ ? pipeline_->Drain() : Status::Ok(); }

  // --- A block's region, between rounds ---
  // Block b's state region for reading or restoring: in host memory, or read into pipeline
  // buffer 0 (read = false: not read, to be overwritten). Returns Region(b, 0).
  StatusOr<std::byte*> Load(int b, bool read = true);
  float* Master(int b, int buffer) { return reinterpret_cast<float*>(Region(b, buffer)); }
  std::span<std::byte> Section(int b, int buffer, size_t k) {
    return {Region(b, buffer) + state_[b].offsets[k], state_[b].sections[k].size_bytes()};
  }
  // Copy-out target of block b's new working params: its pinned home, or the pipeline buffer's
  // copy-out area for streamed blocks whose home is NVMe.
  gpu::PinnedSpan WorkingHome(int b, int buffer);
  // Writes buffer `buffer`'s state region and working params of block b to their NVMe extents
  // (nothing for homes in memory; nothing at all, and no trace event, without a swap store).
  Status WriteBack(int b, int buffer);
  // Working params of block b as they are now (reads the swap store for the NVMe home into
  // WorkingHome(b, 0)).
  StatusOr<const std::byte*> WorkingParamsBytes(int b);

  // --- For the parameter cache (prefetch thread) ---
  // Whether block b's params load from NVMe (through a staging buffer) or from PinnedHome(b).
  bool params_on_nvme(int b) const { return nvme_params() && !plan_.blocks[b].resident; }
  gpu::PinnedSpan PinnedHome(int b) { return home_[b].span(); }
  // Reads block b's working params from their extent into `staging` (padded size).
  Status ReadParams(int b, gpu::PinnedSpan staging);
  // Block b's frozen chunk (Model::block_frozen_params): streamed from its NVMe extent
  // "block{b}.frozen" (through a staging buffer, ReadFrozen) or loaded from its pinned home
  // (FrozenPinnedHome). Written once by Initialize, never again.
  bool frozen_on_nvme(int b) const { return frozen_streamed_from_nvme(b); }
  gpu::PinnedSpan FrozenPinnedHome(int b) { return frozen_home_[b]; }
  // The bytes of every pinned frozen home, each 4 KiB-aligned: what a region shared by this
  // machine's ranks must hold (ShareFrozenHomes).
  uint64_t pinned_frozen_bytes() const;
  // The pinned frozen homes are carved from `shared` (not owned; outlives this; size
  // pinned_frozen_bytes) instead of each being this rank's own allocation; only its writer()
  // writes them in Initialize, which Publishes them before returning. Before AllocateMemory.
  void ShareFrozenHomes(SharedFrozenBase* shared) { shared_frozen_ = shared; }
  Status ReadFrozen(int b, gpu::PinnedSpan staging);

 private:
  // The hyper-parameters of an update round: written by the driving thread before it submits the
  // round, copied per submission (block_round_) and read from there by the update stage.
  struct RoundParams {
    cpu_optim::AnyOptimizer optimizer;
    cpu_optim::OptimStep step;
  };

  StateStore(const Model& model, const Plan& plan, StateStoreOptions options);
  int64_t own(int b) const { return plan_.blocks[b].partition.own_elems; }
  // Whether block b has own (trained) params: a wholly frozen block has no state and no home.
  bool trained(int b) const { return plan_.blocks[b].num_params > 0; }
  int64_t frozen_elems(int b) const { return plan_.blocks[b].frozen_params; }
  // Its bytes (Plan::Block::frozen_bytes: the working precision's, or an encoded chunk's).
  uint64_t frozen_bytes(int b) const { return plan_.blocks[b].frozen_bytes; }
  bool frozen_streamed_from_nvme(int b) const {
    return nvme_params() && frozen_elems(b) > 0 && !plan_.blocks[b].frozen_resident;
  }
  // The frozen chunks into their homes (pinned, or NVMe through one staging buffer).
  Status InitializeFrozen(Model& model, uint64_t seed);
  // kCancelled "cancelled while initialising <what>, block b+1 of n" once
  // o_.cancel_requested says so; OK otherwise.
  Status InitCancelPoint(std::string_view what, int b) const;
  int64_t home_elems(int b) const { return plan_.blocks[b].partition.part_elems; }
  bool nvme_params() const { return plan_.param_home == ParamHome::kNvme; }
  bool nvme_optim() const { return plan_.optimizer_home == OptimizerHome::kNvme; }
  std::byte* Region(int b, int buffer);
  // The pipeline's update stage (the read stage is regions_->Read, the write stage WriteBack).
  Status UpdateBlock(int b, int buffer);
  Status InitBlock(Model& model, uint64_t seed, int b, int buffer, AlignedBuffer* whole);

  const Plan& plan_;
  const StateStoreOptions o_;
  const int n_;
  const size_t w_;
  std::vector<BlockState> state_;         // the optimizer state layout per block (this rank's)
  std::vector<BlockState> full_state_;    // the whole blocks' layout: the checkpoint's tensors
  RoundParams round_;                     // the round being submitted
  std::vector<RoundParams> block_round_;  // each block's last submission's round
  trace::TraceRecorder* trace_ = nullptr;
  int read_track_ = 0, update_track_ = 0, write_track_ = 0;
  std::vector<gpu::PinnedBuffer> home_;       // pinned working params: host/device home, resident
  std::vector<gpu::PinnedSpan> frozen_home_;  // pinned frozen chunks (not streamed from NVMe)
  std::vector<gpu::PinnedBuffer> frozen_owned_;  // their memory, unless shared_frozen_'s
  SharedFrozenBase* shared_frozen_ = nullptr;
  std::vector<gpu::PinnedBuffer> opt_buf_;  // pipeline buffers: [state region][p16 copy-out]
  uint64_t opt_state_bytes_ = 0;            // the state region part (0: state in host memory)
  // Device-optimized blocks: state regions, resident working params, the staging buffer and the
  // stream their copies run on.
  std::vector<gpu::DeviceSpan> device_state_, device_working_;
  gpu::PinnedBuffer device_staging_;
  std::unique_ptr<gpu::Stream> copy_;
  // Every host-side block's state region (unit b = block b; host memory or the extents
  // "block{b}.optim") and the swap store, which also holds the extents "block{b}.params".
  std::unique_ptr<StateRegions> regions_;
  std::unique_ptr<UpdateSpeculation> speculation_;  // StateStoreOptions::speculate
  uint64_t params_during_backward_ = 0, rollback_steps_ = 0;
  // Declared last: destroyed (joined) first.
  std::unique_ptr<OptimizerPipeline> pipeline_;
};

}  // namespace strata::engine
