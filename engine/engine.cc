#include "engine/engine.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>

#include "base/aligned_buffer.h"
#include "base/logging.h"
#include "base/thread_annotations.h"
#include "base/trace.h"
#include "base/units.h"
#include "cpu_optim/grad_stats.h"
#include "engine/optimizer_pipeline.h"
#include "engine/optimizer_state.h"
#include "engine/safetensors.h"
#include "engine/work_queue.h"
#include "io/swap_store.h"

namespace strata::engine {
namespace {

// Where one block's working params sit on the device: a streaming slot (shared by the
// streamed blocks, least recently used first) or a resident block's own region.
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

std::string ParamsExtent(int b) { return fmt::format("block{}.params", b); }
std::string OptimExtent(int b) { return fmt::format("block{}.optim", b); }

// Pinned gradient landing buckets: a bucket returns to the pool only after its D2H copy
// landed and its fold (the consumer) finished reading it.
class BucketPool {
 public:
  void Reset(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.clear();
    for (int i = 0; i < n; ++i) free_.push_back(i);
  }
  int Acquire() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty(); });
    const int i = free_.front();
    free_.erase(free_.begin());
    return i;
  }
  void Release(int i) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(i);
    }
    cv_.notify_one();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> free_ STRATA_GUARDED_BY(mu_);
};

}  // namespace

class Engine::Impl {
 public:
  Impl(Model* model, gpu::Device* device, const EngineOptions& options, Plan plan)
      : model_(model),
        device_(device),
        o_(options),
        plan_(std::move(plan)),
        n_(model->num_blocks()),
        w_(SizeOf(options.precision)),
        scaler_(ScalerOptions(options)) {}

  ~Impl() {
    // Drain the host queues, then every stream, before the memory they use goes away.
    if (loader_) loader_->Drain().IgnoreError();
    if (folder_) folder_->Drain().IgnoreError();
    if (pipeline_) pipeline_->Drain().IgnoreError();
    for (auto* s : {compute_.get(), h2d_.get(), d2h_.get(), reduce_.get(), gather_.get()}) {
      if (s) s->Synchronize().IgnoreError();
    }
  }

  static LossScalerOptions ScalerOptions(const EngineOptions& o) {
    LossScalerOptions s = o.loss_scaler;
    if (o.precision != DType::kF16) {  // bf16/fp32 need no scaling; overflow still skips
      s.dynamic = false;
      s.initial_scale = 1.0f;
    }
    return s;
  }

  Status Init();
  StatusOr<StepResult> Step(std::span<const MicroBatch> mbs);
  Status Flush();
  StatusOr<float> EvaluateLoss(const MicroBatch& batch, MicroBatchShape shape);
  StatusOr<std::vector<float>> NextTokenLogits(std::span<const int32_t> tokens);
  StatusOr<uint64_t> MasterWeightsXxh3();
  StatusOr<std::vector<float>> MasterWeights(int block);
  StatusOr<std::vector<float>> AccumulatedGradient(int block);
  Status SaveCheckpoint(const std::string& save_dir, const TrainerState& trainer,
                        const SaveCheckpointOptions& options, std::string* checkpoint_dir);
  Status LoadCheckpoint(const std::string& path, TrainerState* trainer);

  const Plan& plan() const { return plan_; }
  std::string_view io_backend_name() const { return swap_ ? swap_->backend_name() : ""; }
  EngineCounters counters() const {
    EngineCounters c;
    const auto d = device_->counters();
    c.bytes_h2d = d.bytes_h2d;
    c.bytes_d2h = d.bytes_d2h;
    if (swap_) {
      c.nvme_bytes_read = swap_->bytes_read();
      c.nvme_bytes_written = swap_->bytes_written();
    }
    c.device_peak_bytes = arena_ ? arena_->used_bytes() : 0;
    c.pinned_bytes = device_->pinned_used_bytes();
    c.buckets_poisoned = buckets_poisoned_.load();
    return c;
  }
  int64_t steps_taken() const { return step_; }
  void SetLearningRate(float lr) { cpu_optim::SetLearningRate(o_.optimizer, lr); }
  float loss_scale() const { return scaler_.scale(); }
  int64_t skipped_steps() const { return scaler_.overflows(); }

 private:
  struct Acquired {
    ConstTensorRef params;  // the block's working params where they sit (resident or a slot)
    DeviceCopy* copy;
  };
  // The hyper-parameters of the update round in flight: written by the driving thread before
  // it submits a round (after the previous round drained), read by the pipeline's update stage.
  struct RoundParams {
    cpu_optim::AnyOptimizer optimizer;
    cpu_optim::OptimStep step;
  };

  int64_t np(int b) const { return model_->block_num_params(b); }
  // Data parallelism (EngineOptions::comm). Block b's partition for this rank; with one rank and
  // no communicator the whole chunk: own(b) = home_elems(b) = dev_elems(b) = np(b).
  bool dp() const { return o_.comm != nullptr; }
  int world() const { return dp() ? o_.comm->world_size() : 1; }
  const Partition& part(int b) const { return plan_.blocks[b].partition; }
  int64_t own(int b) const { return part(b).own_elems; }          // master, state, host gradient
  int64_t home_elems(int b) const { return part(b).part_elems; }  // working params at home
  int64_t dev_elems(int b) const { return part(b).padded_elems; }
  // The whole block from every rank's partition (`mine`: own(b) values): collective.
  StatusOr<std::vector<float>> GatherBlock(int b, const float* mine);
  int tied(int b) const { return tied_[b]; }
  // Block b's host gradient: in the working precision (HostGradInWorkingPrecision) or fp32.
  DType grad_dtype(int b) const { return grad16_[b] ? o_.precision : DType::kF32; }
  bool nvme_params() const { return plan_.param_home == ParamHome::kNvme; }
  bool nvme_optim() const { return plan_.optimizer_home == OptimizerHome::kNvme; }
  bool resident(int b) const { return plan_.blocks[b].resident; }

  StatusOr<gpu::DeviceSpan> Carve(uint64_t size, std::string_view label) {
    return arena_->Carve(size, label);
  }
  Status UploadTokens(const MicroBatch& mb, MicroBatchShape shape, bool with_targets);

  // --- Working params on the device (prefetch) ---
  // Returns the device copy that holds (or is loading) block b's current params, starting a
  // load into the least recently used slot outside `protect` when there is none.
  DeviceCopy* Request(int b, std::span<const int> protect);
  void StartLoad(DeviceCopy& c, int b);
  // Makes the compute stream wait for block b's load; the block reads the params in place.
  // Neither the copies of window[0] nor those of `held` (blocks acquired for the same op) are
  // evicted by the load.
  StatusOr<Acquired> AcquireParams(int b, std::span<const int> window,
                                   std::span<const int> held = {});
  // The order blocks use their params in one forward pass (0..n-1) or one backward pass
  // (n-1..0); a block that reads a tied chunk uses that chunk right before its own.
  std::vector<int> UseOrder(bool backward) const;
  // After enqueuing the op at seq[cursor]: record the copy's release and start the loads
  // of the next prefetch_depth blocks of the sequence.
  Status AfterOp(const Acquired& a, std::span<const int> window);

  // --- Gradient streaming ---
  // The device bucket for the gradients of chunk `chunk` that the next backward writes, k = 0
  // for the block's own chunk, k = 1 for its tied chunk (the compute stream waits until the
  // bucket's previous D2H is done); then each bucket's trip to the host after the backward, in
  // the same order. Fold flags: `overwrite` starts the chunk's accumulator (its first
  // contribution of the step), `last` is its last contribution (statistics, eager update).
  StatusOr<TensorRef> NextGradBucket(int chunk, int k = 0);
  Status StreamGradients(int chunk, bool overwrite, bool last);
  void Fold(int b, int bucket, bool overwrite, bool last);

  // --- CPU optimizer pipeline (pipeline_->Submit(b) queues block b's update) ---
  // Block b's state region (optimizer_state.h: [p32 | section 0 | ...]): in host memory, or
  // the pipeline buffer `buffer`; and its parts.
  std::byte* Region(int b, int buffer);
  float* Master(int b, int buffer) { return reinterpret_cast<float*>(Region(b, buffer)); }
  std::span<std::byte> Section(int b, int buffer, size_t k) {
    return {Region(b, buffer) + state_[b].offsets[k], state_[b].sections[k].size_bytes()};
  }
  // Copy-out target of block b's new working params: its pinned home, or the pipeline buffer's
  // copy-out area for streamed blocks whose home is NVMe.
  gpu::PinnedSpan WorkingHome(int b, int buffer);
  Status ReadState(int b, int buffer);
  Status UpdateBlock(int b, int buffer);
  Status WriteBack(int b, int buffer);
  // Block b's state region for reading or restoring (after Flush): in host memory, or read into
  // pipeline buffer 0 (read = false: not read, to be overwritten). Returns Region(b, 0).
  StatusOr<std::byte*> LoadOptimState(int b, bool read = true);

  // save_acts: offloaded activations are copied out for a backward pass to come.
  Status ForwardPass(MicroBatchShape shape, bool with_targets, int loss_index,
                     std::span<const int> seq, size_t* cursor, bool save_acts = false);
  Status WriteCheckpoint(const std::string& save_dir, const std::string& temp_dir,
                         const TrainerState& trainer, const SaveCheckpointOptions& options,
                         std::string* checkpoint_dir);
  Status CheckManifestMatchesModel(const Manifest& m) const;
  // The manifest of this engine's training state (files not listed yet).
  Manifest TrainingManifest(const TrainerState& trainer) const;
  // Data parallel, N > 1: every rank writes its partition of every tensor into the shared files.
  Status WriteCheckpointRanks(const std::string& save_dir, const TrainerState& trainer,
                              const SaveCheckpointOptions& options, std::string* checkpoint_dir);
  // Collective: an error on any rank becomes an error on every rank (its own where it has one).
  Status AgreeAll(Status mine);
  // Collective: rank 0's status and text on every rank.
  StatusOr<std::string> FromRank0(StatusOr<std::string> mine);
  // Working params of block b as they are now (reads the swap store for the NVMe home).
  StatusOr<const std::byte*> WorkingParamsBytes(int b);
  Status FoldError() {
    std::lock_guard<std::mutex> lock(fold_mu_);
    return fold_error_;
  }

  Model* model_;
  gpu::Device* device_;
  EngineOptions o_;
  Plan plan_;
  const int n_;
  const size_t w_;
  std::vector<int> tied_;       // Model::tied_block per block
  std::vector<int> tied_user_;  // the block that ties chunk b, or -1
  DynamicLossScaler scaler_;
  int64_t step_ = 0;    // optimizer steps attempted
  int64_t adam_t_ = 0;  // updates applied (Adam's t)
  // Set while a checkpoint load copies validated data into the stores; stays set if that fails.
  bool partially_loaded_ = false;

  std::unique_ptr<gpu::DeviceArena> arena_;
  std::unique_ptr<gpu::Stream> compute_, h2d_, d2h_;
  // Data parallel: gradients reduce-scatter on reduce_ (grad_comm_, driving thread's order),
  // params all-gather on gather_ (param_comm_, the prefetch thread's order).
  std::unique_ptr<gpu::Stream> reduce_, gather_;
  std::unique_ptr<comm::Communicator> grad_comm_, param_comm_;
  gpu::DeviceSpan red_full_;     // one block's gradients widened to fp32, padded
  gpu::DeviceSpan red_part_[2];  // this rank's reduced fp32 partition
  std::unique_ptr<gpu::Event> reduced_[2], part_free_[2];
  // Trace tracks of the host threads (o_.trace).
  int load_track_ = 0, fold_track_ = 0, read_track_ = 0, update_track_ = 0, write_track_ = 0;
  gpu::DeviceSpan tokens_, targets_, loss_, logits_, scratch_;
  // A (B, T, C) activation-sized buffer, or the logits, as the typed view a block sees.
  TensorRef Typed(gpu::DeviceSpan span) const {
    return TensorRef(span.data, o_.precision, static_cast<int64_t>(span.size_bytes / w_));
  }
  // Boundary activations. Resident: acts_[b] = output of block b, b < n-1. Offloaded: two
  // device buffers, block b's output in acts_[b % 2] and D2H into host_acts_[b]; act_saved_[i]
  // (d2h) after the copy out of buffer i, act_free_[i] (compute) after the last op reading it,
  // act_ready_[i] (h2d) after a load back into it.
  std::vector<gpu::DeviceSpan> acts_;
  std::vector<gpu::PinnedBuffer> host_acts_;
  std::unique_ptr<gpu::Event> act_written_, act_saved_[2], act_free_[2], act_ready_[2];
  gpu::DeviceSpan Act(int b) const { return acts_[plan_.offload_activations ? b % 2 : b]; }
  // Offloaded activations: the forward's copy out of block b's output, and the load of act k
  // back into its device buffer (issued after backward k+3, the buffer's last reader).
  Status SaveActivation(int b);
  Status LoadActivation(int k);
  gpu::DeviceSpan dx_[2];

  // Params on the device. param_version_[b] counts the updates submitted for block b; a copy
  // holding an older version is stale. Driving thread only.
  std::vector<DeviceCopy> resident_;  // per block; dev empty when streamed
  std::vector<DeviceCopy> slots_;
  std::vector<int64_t> param_version_;
  int64_t use_clock_ = 0;

  std::vector<gpu::PinnedBuffer> home_;     // pinned working params: host/device home, resident
  std::vector<gpu::PinnedBuffer> opt_buf_;  // pipeline buffers: [state region][p16 copy-out]
  uint64_t opt_state_bytes_ = 0;            // the state region part (0: state in host memory)

  // Gradients: device bucket j (16-bit) -> D2H -> pinned bucket i -> fold (CPU worker).
  gpu::DeviceSpan dbucket_[2];
  std::unique_ptr<gpu::Event> dgrad_ready_[2], dbucket_free_[2];
  int next_dbucket_ = 0;
  std::vector<gpu::PinnedBuffer> hbucket_;
  std::vector<std::unique_ptr<gpu::Event>> landed_;
  BucketPool pool_;
  std::mutex fold_mu_;
  Status fold_error_ STRATA_GUARDED_BY(fold_mu_);
  cpu_optim::GradStats stats_;  // written by the fold worker; read after folder_->Drain()
  bool eager_ = false;
  bool eager_overflow_ = false;  // fold worker only, reset by the driving thread between steps
  std::atomic<uint64_t> buckets_poisoned_{0};
  RoundParams round_;

  gpu::PinnedBuffer io_pinned_;  // tokens, targets, losses, logits row
  std::unique_ptr<gpu::Event> io_done_;

  std::vector<BlockState> state_;        // the optimizer state layout per block (this rank's)
  std::vector<BlockState> full_state_;   // the whole blocks' layout: the checkpoint's tensors
  std::vector<bool> grad16_;             // HostGradInWorkingPrecision per block
  std::vector<AlignedBuffer> accum_;     // host gradients per block (fp32 or grad_dtype)
  std::vector<AlignedBuffer> opt_home_;  // host optimizer home: each block's state region

  std::unique_ptr<io::IoBackend> io_;
  std::unique_ptr<io::SwapStore> swap_;
  // Host threads; declared last so they are destroyed (joined) first.
  std::unique_ptr<WorkQueue> loader_, folder_;
  std::unique_ptr<OptimizerPipeline> pipeline_;
};

Status Engine::Impl::Init() {
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
    tied_[b] = t;
    tied_user_[t] = b;
  }
  if (o_.grad_accum_steps < 1) return InvalidArgumentError("--grad-accum-steps must be >= 1");
  STRATA_RETURN_IF_ERROR(cpu_optim::Validate(o_.optimizer));
  if (dp()) {
    if (o_.eager_update || o_.inference_only) {
      return InvalidArgumentError(
          "data parallelism needs the exact step (no --eager-update) and a training engine");
    }
    if (world() > 1 && !PartitionableOptimizer(o_.optimizer)) {
      return InvalidArgumentError(fmt::format(
          "--optimizer {} keeps state that does not split into per-rank partitions (block-wise "
          "or factored statistics); with more than one rank use adamw, adam, lion, sgd or adagrad",
          OptimizerFlagName(o_.optimizer)));
    }
  }
  for (int b = 0; b < n_; ++b) {
    state_.push_back(LayoutBlockState(*model_, b, o_.optimizer, &part(b)));
    full_state_.push_back(LayoutBlockState(*model_, b, o_.optimizer));
    grad16_.push_back(!o_.test_hooks.fp32_host_grads && !dp() && o_.precision != DType::kF32 &&
                      HostGradInWorkingPrecision(*model_, b, o_.grad_accum_steps));
  }
  if (o_.eager_update) {
    if (o_.precision == DType::kF16 || o_.grad_clip_norm > 0) {
      return InvalidArgumentError(
          "eager updates need bf16 or fp32 and no gradient clipping (--grad-clip 0): with fp16 "
          "loss scaling or clipping a block's update depends on the whole gradient");
    }
    eager_ = o_.overlap;
  }
  const MicroBatchShape shape = o_.micro_batch;
  if (o_.inference_only && (nvme_params() || nvme_optim())) {
    return InvalidArgumentError(
        "inference keeps the working params on the device or in pinned host memory and has no "
        "optimizer state: use --offload-params device|host and no NVMe optimizer");
  }

  if (plan_.param_home == ParamHome::kNvme || plan_.optimizer_home == OptimizerHome::kNvme) {
    if (o_.test_hooks.io_backend_factory) {
      STRATA_ASSIGN_OR_RETURN(io_, o_.test_hooks.io_backend_factory(o_.io));
      if (!io_) return InvalidArgumentError("EngineTestHooks::io_backend_factory returned null");
    } else {
      STRATA_ASSIGN_OR_RETURN(io_, io::CreateIoBackend(o_.io));
    }
    io::SwapStoreOptions so;
    so.dirs = o_.placement.nvme_paths;
    STRATA_ASSIGN_OR_RETURN(swap_, io::SwapStore::Create(io_.get(), so));
    for (int b = 0; b < n_; ++b) {
      if (nvme_params()) {
        STRATA_RETURN_IF_ERROR(swap_->Allocate(ParamsExtent(b), home_elems(b) * w_));
      }
      if (nvme_optim()) {
        STRATA_RETURN_IF_ERROR(swap_->Allocate(OptimExtent(b), state_[b].region_bytes));
      }
    }
  }

  STRATA_ASSIGN_OR_RETURN(arena_, device_->CreateArena(plan_.device_total_bytes));
  if (o_.trace) {
    load_track_ = o_.trace->RegisterTrack("host: prefetch (nvme read)");
    fold_track_ = o_.trace->RegisterTrack("host: gradient fold");
    read_track_ = o_.trace->RegisterTrack("host: optimizer state read");
    update_track_ = o_.trace->RegisterTrack("host: cpu optimizer");
    write_track_ = o_.trace->RegisterTrack("host: optimizer state write");
  }
  STRATA_ASSIGN_OR_RETURN(compute_, device_->CreateStream("compute"));
  // What the model's kernels need beyond the arena is taken now, never inside a step.
  STRATA_RETURN_IF_ERROR(model_->PrepareComputeStream(*compute_));
  STRATA_ASSIGN_OR_RETURN(h2d_, device_->CreateStream("h2d"));
  STRATA_ASSIGN_OR_RETURN(d2h_, device_->CreateStream("d2h"));
  auto event = [&]() { return device_->CreateEvent(); };
  if (dp()) {
    STRATA_ASSIGN_OR_RETURN(reduce_, device_->CreateStream("reduce-scatter"));
    STRATA_ASSIGN_OR_RETURN(gather_, device_->CreateStream("all-gather"));
    STRATA_ASSIGN_OR_RETURN(grad_comm_, o_.comm->Duplicate());
    STRATA_ASSIGN_OR_RETURN(param_comm_, o_.comm->Duplicate());
    for (int j = 0; j < 2; ++j) {
      STRATA_ASSIGN_OR_RETURN(reduced_[j], event());
      STRATA_ASSIGN_OR_RETURN(part_free_[j], event());
    }
  }

  // Carve exactly the planner's regions, in its order.
  const uint64_t act_bytes = static_cast<uint64_t>(model_->activation_elems(shape)) * w_;
  size_t r = 0;
  const auto& regions = plan_.device_regions;
  auto next = [&]() {
    const DeviceRegion& region = regions[r++];
    return Carve(region.size_bytes, region.label);
  };
  STRATA_ASSIGN_OR_RETURN(auto tt, next());
  tokens_ = tt.subspan(0, shape.tokens() * 4);
  targets_ = tt.subspan(shape.tokens() * 4, shape.tokens() * 4);
  STRATA_ASSIGN_OR_RETURN(loss_, next());
  STRATA_ASSIGN_OR_RETURN(auto acts, next());
  const int num_acts = plan_.offload_activations ? 2 : n_ - 1;
  for (int b = 0; b < num_acts; ++b) acts_.push_back(acts.subspan(b * act_bytes, act_bytes));
  if (plan_.offload_activations) {
    STRATA_ASSIGN_OR_RETURN(act_written_, event());
    for (int i = 0; i < 2; ++i) {
      STRATA_ASSIGN_OR_RETURN(act_saved_[i], event());
      STRATA_ASSIGN_OR_RETURN(act_free_[i], event());
      STRATA_ASSIGN_OR_RETURN(act_ready_[i], event());
    }
    for (int b = 0; b < n_ - 1; ++b) {
      STRATA_ASSIGN_OR_RETURN(auto a, device_->AllocatePinned(act_bytes, "boundary activation"));
      host_acts_.push_back(std::move(a));
    }
  }
  STRATA_ASSIGN_OR_RETURN(auto dx, next());
  dx_[0] = dx.subspan(0, act_bytes);
  dx_[1] = dx.subspan(act_bytes, act_bytes);
  STRATA_ASSIGN_OR_RETURN(auto logits, next());
  logits_ = logits.subspan(0, static_cast<size_t>(model_->logits_elems(shape)) * w_);
  STRATA_ASSIGN_OR_RETURN(scratch_, next());
  STRATA_ASSIGN_OR_RETURN(auto dbuckets, next());
  const uint64_t dbucket_bytes = dbuckets.size_bytes / 2;
  for (int j = 0; j < 2; ++j) {
    dbucket_[j] = dbuckets.subspan(j * dbucket_bytes, dbucket_bytes);
    STRATA_ASSIGN_OR_RETURN(dgrad_ready_[j], event());
    STRATA_ASSIGN_OR_RETURN(dbucket_free_[j], event());
  }
  if (plan_.data_parallel) {
    int64_t max_padded = 0, max_part = 0;
    for (int b = 0; b < n_; ++b) {
      max_padded = std::max(max_padded, dev_elems(b));
      max_part = std::max(max_part, home_elems(b));
    }
    STRATA_ASSIGN_OR_RETURN(auto red, next());
    const uint64_t full =
        AlignUp(static_cast<uint64_t>(max_padded) * 4, gpu::DeviceArena::kAlignment);
    const uint64_t partb =
        AlignUp(static_cast<uint64_t>(max_part) * 4, gpu::DeviceArena::kAlignment);
    red_full_ = red.subspan(0, full);
    for (int j = 0; j < 2; ++j) red_part_[j] = red.subspan(full + j * partb, partb);
  }
  resident_.resize(n_);
  for (int b = 0; b < n_; ++b) {
    if (!resident(b)) continue;
    STRATA_ASSIGN_OR_RETURN(resident_[b].dev, next());
    resident_[b].block = b;
    STRATA_ASSIGN_OR_RETURN(resident_[b].ready, event());
    STRATA_ASSIGN_OR_RETURN(resident_[b].released, event());
    if (dp()) {
      STRATA_ASSIGN_OR_RETURN(resident_[b].copied, event());
    }
  }
  slots_.resize(plan_.streaming_slots);
  for (auto& s : slots_) {
    STRATA_ASSIGN_OR_RETURN(s.dev, next());
    STRATA_ASSIGN_OR_RETURN(s.ready, event());
    STRATA_ASSIGN_OR_RETURN(s.released, event());
    if (dp()) {
      STRATA_ASSIGN_OR_RETURN(s.copied, event());
    }
    if (nvme_params()) {
      STRATA_ASSIGN_OR_RETURN(s.staging,
                              device_->AllocatePinned(plan_.partition_bytes, "NVMe staging"));
    }
  }
  STRATA_CHECK(r == regions.size());
  param_version_.assign(n_, 0);

  // Pinned and host memory.
  for (int i = 0; i < plan_.host_grad_buckets; ++i) {
    STRATA_ASSIGN_OR_RETURN(auto bucket,
                            device_->AllocatePinned(plan_.grad_bucket_bytes, "gradient bucket"));
    hbucket_.push_back(std::move(bucket));
    STRATA_ASSIGN_OR_RETURN(auto e, event());
    landed_.push_back(std::move(e));
  }
  pool_.Reset(plan_.host_grad_buckets);
  STRATA_ASSIGN_OR_RETURN(io_done_, event());
  const uint64_t io_bytes = shape.tokens() * 8 + o_.grad_accum_steps * 4 + 4 +
                            static_cast<uint64_t>(model_->vocab_size()) * 4;
  STRATA_ASSIGN_OR_RETURN(io_pinned_, device_->AllocatePinned(io_bytes, "token staging"));
  home_.resize(n_);
  for (int b = 0; b < n_; ++b) {
    if (!nvme_params() || resident(b)) {
      STRATA_ASSIGN_OR_RETURN(
          home_[b],
          device_->AllocatePinned(io::SwapStore::PaddedSize(home_elems(b) * w_), "working params"));
      // A partition's padding past the block's end goes to the device as zeros.
      if (dp()) std::memset(home_[b].data(), 0, home_[b].span().size_bytes);
    }
  }
  opt_state_bytes_ = 0;
  if (nvme_optim()) {
    for (int b = 0; b < n_; ++b) {
      opt_state_bytes_ = std::max(opt_state_bytes_, state_[b].region_bytes);
    }
  }
  if (plan_.optimizer_buffer_bytes > 0) {
    for (int i = 0; i < plan_.optimizer_buffers; ++i) {
      STRATA_ASSIGN_OR_RETURN(auto buf, device_->AllocatePinned(plan_.optimizer_buffer_bytes,
                                                                "optimizer pipeline buffer"));
      opt_buf_.push_back(std::move(buf));
    }
  }
  for (int b = 0; b < n_ && !o_.inference_only; ++b) {
    STRATA_ASSIGN_OR_RETURN(
        auto acc,
        AlignedBuffer::Allocate(std::max<uint64_t>(64, own(b) * SizeOf(grad_dtype(b))), 64));
    accum_.push_back(std::move(acc));
    if (!nvme_optim()) {
      STRATA_ASSIGN_OR_RETURN(auto home, AlignedBuffer::Allocate(state_[b].region_bytes, 4096));
      opt_home_.push_back(std::move(home));
    }
  }

  loader_ = std::make_unique<WorkQueue>("prefetch");
  folder_ = std::make_unique<WorkQueue>("gradient fold");
  OptimizerPipeline::Stages stages;
  if (nvme_optim()) stages.read = [this](int b, int i) { return ReadState(b, i); };
  stages.update = [this](int b, int i) { return UpdateBlock(b, i); };
  if (swap_) stages.write = [this](int b, int i) { return WriteBack(b, i); };
  pipeline_ = std::make_unique<OptimizerPipeline>(
      n_, std::max<int>(1, static_cast<int>(opt_buf_.size())), std::move(stages));

  if (o_.inference_only) {
    // Working params only, through one block-sized fp32 buffer.
    STRATA_ASSIGN_OR_RETURN(auto f32, AlignedBuffer::Allocate(plan_.max_block_params * 4, 64));
    for (int b = 0; b < n_; ++b) {
      const std::span<float> p32(f32.as<float>(), np(b));
      STRATA_RETURN_IF_ERROR(model_->InitParams(b, o_.seed, p32));
      STRATA_RETURN_IF_ERROR(
          cpu_optim::ConvertFromF32(p32.data(), WorkingHome(b, 0).data, o_.precision, np(b)));
    }
    return Status::Ok();
  }
  // Initial master weights, the optimizer's initial state, working params in their homes. A
  // rank initialises each whole block (the same on every rank) and keeps its partition.
  AlignedBuffer whole;
  if (dp()) {
    STRATA_ASSIGN_OR_RETURN(whole, AlignedBuffer::Allocate(plan_.max_block_params * 4, 64));
  }
  for (int b = 0; b < n_; ++b) {
    STRATA_ASSIGN_OR_RETURN(std::byte * region, LoadOptimState(b, /*read=*/false));
    std::memset(region, 0, state_[b].region_bytes);  // padding included: no stale bytes on NVMe
    for (size_t k = 0; k < state_[b].sections.size(); ++k) {
      cpu_optim::InitializeState(state_[b].sections[k], Section(b, 0, k));
    }
    float* p32 = Master(b, 0);
    if (dp()) {
      STRATA_RETURN_IF_ERROR(
          model_->InitParams(b, o_.seed, std::span<float>(whole.as<float>(), np(b))));
      std::memcpy(p32, whole.as<float>() + part(b).offset_elems, own(b) * 4);
    } else {
      STRATA_RETURN_IF_ERROR(model_->InitParams(b, o_.seed, std::span<float>(p32, np(b))));
    }
    STRATA_RETURN_IF_ERROR(
        cpu_optim::ConvertFromF32(p32, WorkingHome(b, 0).data, o_.precision, own(b)));
    if (swap_) STRATA_RETURN_IF_ERROR(WriteBack(b, 0));
  }
  return Status::Ok();
}

std::byte* Engine::Impl::Region(int b, int i) {
  return nvme_optim() ? opt_buf_[i].data() : opt_home_[b].data();
}

gpu::PinnedSpan Engine::Impl::WorkingHome(int b, int i) {
  if (!nvme_params() || resident(b)) return home_[b].span();
  return opt_buf_[i].span().subspan(opt_state_bytes_, plan_.partition_bytes);
}

StatusOr<std::byte*> Engine::Impl::LoadOptimState(int b, bool read) {
  if (nvme_optim() && read) STRATA_RETURN_IF_ERROR(ReadState(b, 0));
  return Region(b, 0);
}

Status Engine::Impl::ReadState(int b, int i) {
  trace::ScopedTraceEvent t(o_.trace, read_track_, "read optimizer state",
                            trace::Category::kNvmeRead);
  return swap_->Read(OptimExtent(b), opt_buf_[i].span().bytes().subspan(0, state_[b].region_bytes));
}

Status Engine::Impl::UpdateBlock(int b, int i) {
  trace::ScopedTraceEvent t(o_.trace, update_track_, "optimizer update",
                            trace::Category::kCpuOptimizer);
  if (own(b) == 0) return Status::Ok();  // a tiny block's padding-only partition
  std::vector<std::span<std::byte>> sections;
  for (size_t k = 0; k < state_[b].sections.size(); ++k) sections.push_back(Section(b, i, k));
  return cpu_optim::UpdateState(BlockOptimizer(round_.optimizer, state_[b]), round_.step,
                                state_[b].shapes, std::span<float>(Master(b, i), own(b)), sections,
                                cpu_optim::GradView{accum_[b].data(), grad_dtype(b)},
                                cpu_optim::CopyOut{WorkingHome(b, i).data, o_.precision});
}

Status Engine::Impl::WriteBack(int b, int i) {
  trace::ScopedTraceEvent t(o_.trace, write_track_, "write optimizer state + params",
                            trace::Category::kNvmeWrite);
  if (nvme_optim()) {
    STRATA_RETURN_IF_ERROR(swap_->Write(
        OptimExtent(b), opt_buf_[i].span().bytes().subspan(0, state_[b].region_bytes)));
  }
  if (nvme_params()) {
    STRATA_RETURN_IF_ERROR(swap_->Write(
        ParamsExtent(b),
        WorkingHome(b, i).bytes().subspan(0, io::SwapStore::PaddedSize(home_elems(b) * w_))));
  }
  return Status::Ok();
}

void Engine::Impl::StartLoad(DeviceCopy& c, int b) {
  c.block = b;
  c.version = param_version_[b];
  // This rank's partition of the block (the whole block with one rank): H2D to its offset, then
  // all-gathered in place on the device.
  const uint64_t bytes = home_elems(b) * w_;
  const bool from_nvme = nvme_params() && !resident(b);
  const gpu::DeviceSpan dst = c.dev.subspan(part(b).offset_elems * w_, bytes);
  const gpu::DeviceSpan whole_dev = c.dev.subspan(0, dev_elems(b) * w_);
  const gpu::PinnedSpan staging = c.staging.span();
  gpu::Event* ready = c.ready.get();
  gpu::Event* released = c.released.get();
  gpu::Event* copied = c.copied.get();
  c.load_ticket = loader_->Submit([=, this]() -> Status {
    // Block b's update (if one is in flight) must have written its new params.
    STRATA_RETURN_IF_ERROR(pipeline_->WaitBlock(b));
    // The device copy may still be read by compute: order the H2D after it.
    STRATA_RETURN_IF_ERROR(h2d_->Wait(*released));
    gpu::PinnedSpan src;
    if (from_nvme) {
      // The pinned staging may still feed the slot's previous copy.
      STRATA_RETURN_IF_ERROR(ready->Synchronize());
      trace::ScopedTraceEvent t(o_.trace, load_track_, "read params", trace::Category::kNvmeRead);
      STRATA_RETURN_IF_ERROR(swap_->Read(
          ParamsExtent(b), staging.bytes().subspan(0, io::SwapStore::PaddedSize(bytes))));
      src = staging.subspan(0, bytes);
    } else {
      src = home_[b].span().subspan(0, bytes);
    }
    STRATA_RETURN_IF_ERROR(h2d_->CopyH2D(dst, src));
    if (!dp()) return h2d_->Record(*ready);
    // The prefetch thread alone issues the all-gathers, in the order the driving thread
    // requested the loads: the same order on every rank.
    STRATA_RETURN_IF_ERROR(h2d_->Record(*copied));
    STRATA_RETURN_IF_ERROR(gather_->Wait(*copied));
    STRATA_RETURN_IF_ERROR(
        param_comm_->AllGatherInPlace(whole_dev, home_elems(b), o_.precision, *gather_));
    return gather_->Record(*ready);
  });
}

DeviceCopy* Engine::Impl::Request(int b, std::span<const int> protect) {
  if (resident(b)) {
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

std::vector<int> Engine::Impl::UseOrder(bool backward) const {
  std::vector<int> seq;
  for (int i = 0; i < n_; ++i) {
    const int b = backward ? n_ - 1 - i : i;
    if (tied(b) >= 0) seq.push_back(tied(b));
    seq.push_back(b);
  }
  return seq;
}

StatusOr<Engine::Impl::Acquired> Engine::Impl::AcquireParams(int b, std::span<const int> window,
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
  return Acquired{ConstTensorRef(c->dev.data, o_.precision, np(b)), c};
}

Status Engine::Impl::AfterOp(const Acquired& a, std::span<const int> window) {
  // The block read its params in place: the copy is free once the op is done.
  STRATA_RETURN_IF_ERROR(compute_->Record(*a.copy->released));
  if (!o_.overlap) return compute_->Synchronize();
  // Prefetch the next blocks of the sequence; the window (this block and the next ones) is
  // never evicted.
  const size_t depth = static_cast<size_t>(plan_.prefetch_depth);
  const auto protect = window.subspan(0, std::min(depth + 1, window.size()));
  for (size_t i = 1; i < protect.size(); ++i) Request(protect[i], protect);
  return Status::Ok();
}

Status Engine::Impl::UploadTokens(const MicroBatch& mb, MicroBatchShape shape, bool with_targets) {
  const size_t count = shape.tokens();
  if (mb.tokens.size() != count || (with_targets && mb.targets.size() != count)) {
    return InvalidArgumentError(fmt::format("micro-batch has {} tokens, expected {}x{} = {}",
                                            mb.tokens.size(), shape.batch_size, shape.seq_len,
                                            count));
  }
  const int vocab = model_->vocab_size();
  for (size_t i = 0; i < count; ++i) {
    if (mb.tokens[i] < 0 || mb.tokens[i] >= vocab ||
        (with_targets && (mb.targets[i] < 0 || mb.targets[i] >= vocab))) {
      return InvalidArgumentError(fmt::format("token id at {} is outside [0, {})", i, vocab));
    }
  }
  // The staging may still feed the previous upload.
  STRATA_RETURN_IF_ERROR(io_done_->Synchronize());
  auto* pinned = io_pinned_.as<int32_t>();
  std::memcpy(pinned, mb.tokens.data(), count * 4);
  STRATA_RETURN_IF_ERROR(compute_->CopyH2D(tokens_, io_pinned_.span().subspan(0, count * 4)));
  if (with_targets) {
    std::memcpy(pinned + o_.micro_batch.tokens(), mb.targets.data(), count * 4);
    STRATA_RETURN_IF_ERROR(compute_->CopyH2D(
        targets_, io_pinned_.span().subspan(o_.micro_batch.tokens() * 4, count * 4)));
  }
  return compute_->Record(*io_done_);
}

Status Engine::Impl::SaveActivation(int b) {
  STRATA_RETURN_IF_ERROR(compute_->Record(*act_written_));
  STRATA_RETURN_IF_ERROR(d2h_->Wait(*act_written_));
  const gpu::DeviceSpan act = Act(b);
  STRATA_RETURN_IF_ERROR(d2h_->CopyD2H(host_acts_[b].span(), act));
  return d2h_->Record(*act_saved_[b % 2]);
}

Status Engine::Impl::LoadActivation(int k) {
  // After the buffer's last reader (compute) and after the forward's copy out of act k (d2h,
  // in order: the buffer's latest save covers it).
  STRATA_RETURN_IF_ERROR(h2d_->Wait(*act_free_[k % 2]));
  STRATA_RETURN_IF_ERROR(h2d_->Wait(*act_saved_[k % 2]));
  const gpu::DeviceSpan act = Act(k);
  STRATA_RETURN_IF_ERROR(h2d_->CopyH2D(act, host_acts_[k].span().subspan(0, act.size_bytes)));
  STRATA_RETURN_IF_ERROR(h2d_->Record(*act_ready_[k % 2]));
  if (!o_.overlap) return h2d_->Synchronize();
  return Status::Ok();
}

Status Engine::Impl::ForwardPass(MicroBatchShape shape, bool with_targets, int loss_index,
                                 std::span<const int> seq, size_t* cursor, bool save_acts) {
  for (int b = 0; b < n_; ++b, ++*cursor) {
    std::optional<Acquired> tied_copy;
    if (tied(b) >= 0) {
      STRATA_CHECK(seq[*cursor] == tied(b));
      STRATA_ASSIGN_OR_RETURN(tied_copy, AcquireParams(tied(b), seq.subspan(*cursor)));
      ++*cursor;
    }
    STRATA_CHECK(seq[*cursor] == b);
    const auto window = seq.subspan(*cursor);
    const int held[1] = {tied(b)};
    STRATA_ASSIGN_OR_RETURN(
        const Acquired a,
        AcquireParams(b, window, tied_copy ? std::span<const int>(held) : std::span<const int>()));
    BlockBuffers buf;
    buf.precision = o_.precision;
    buf.params = a.params;
    if (tied_copy) buf.tied_params = tied_copy->params;
    buf.shape = shape;
    buf.scratch = scratch_;
    if (b == 0) buf.tokens = tokens_.as<const int32_t>();
    if (b > 0) buf.x_in = Typed(Act(b - 1));
    if (b < n_ - 1) {
      buf.x_out = Typed(Act(b));
      // Offloaded: the buffer's previous content (block b-2's output) must have been copied out.
      if (plan_.offload_activations) STRATA_RETURN_IF_ERROR(compute_->Wait(*act_saved_[b % 2]));
    } else {
      buf.targets = with_targets ? targets_.as<const int32_t>() : nullptr;
      buf.logits = Typed(logits_);
      buf.loss = loss_.as<float>();
    }
    STRATA_RETURN_IF_ERROR(model_->Forward(b, buf, *compute_));
    if (plan_.offload_activations && b < n_ - 1 && save_acts) {
      STRATA_RETURN_IF_ERROR(SaveActivation(b));
    }
    // The tied copy is free once the op is done; recorded before AfterOp's prefetch may reuse it.
    if (tied_copy) STRATA_RETURN_IF_ERROR(compute_->Record(*tied_copy->copy->released));
    STRATA_RETURN_IF_ERROR(AfterOp(a, window));
  }
  if (with_targets && loss_index >= 0) {
    const size_t off = o_.micro_batch.tokens() * 8 + loss_index * 4;
    STRATA_RETURN_IF_ERROR(compute_->CopyD2H(io_pinned_.span().subspan(off, 4), loss_));
  }
  return Status::Ok();
}

StatusOr<TensorRef> Engine::Impl::NextGradBucket(int chunk, int k) {
  // The block's backward writes its gradients into device bucket j once the D2H that last read
  // j is done.
  const int j = (next_dbucket_ + k) % 2;
  STRATA_RETURN_IF_ERROR(compute_->Wait(*dbucket_free_[j]));
  return TensorRef(dbucket_[j].data, o_.precision, np(chunk));
}

Status Engine::Impl::StreamGradients(int b, bool overwrite, bool last) {
  // The gradients the backward wrote into device bucket j go D2H into a free pinned bucket on
  // the D2H stream, folded by the CPU worker.
  const int j = next_dbucket_;
  next_dbucket_ ^= 1;
  STRATA_RETURN_IF_ERROR(compute_->Record(*dgrad_ready_[j]));
  // Blocks this (driving) thread only when every pinned bucket is still being folded.
  const int i = pool_.Acquire();
  if (dp()) {
    // Data parallel: widen the bucket to fp32 and reduce-scatter it on the reduce-scatter stream
    // (the sum over ranks in fp32, overlapped with the next block's backward); only this rank's
    // partition goes D2H. Issued by this thread alone: the same order on every rank. The padding
    // past the block's end holds stale values and reduces into elements nobody reads.
    const int64_t count = home_elems(b);
    STRATA_RETURN_IF_ERROR(reduce_->Wait(*dgrad_ready_[j]));
    STRATA_RETURN_IF_ERROR(reduce_->Wait(*part_free_[j]));
    STRATA_RETURN_IF_ERROR(
        reduce_->Convert(red_full_, DType::kF32, dbucket_[j], o_.precision, np(b)));
    STRATA_RETURN_IF_ERROR(reduce_->Record(*dbucket_free_[j]));
    STRATA_RETURN_IF_ERROR(grad_comm_->ReduceScatter(red_full_.subspan(0, dev_elems(b) * 4),
                                                     red_part_[j], count, DType::kF32, *reduce_));
    STRATA_RETURN_IF_ERROR(reduce_->Record(*reduced_[j]));
    STRATA_RETURN_IF_ERROR(d2h_->Wait(*reduced_[j]));
    STRATA_RETURN_IF_ERROR(d2h_->CopyD2H(hbucket_[i].span(), red_part_[j].subspan(0, own(b) * 4)));
    STRATA_RETURN_IF_ERROR(d2h_->Record(*landed_[i]));
    STRATA_RETURN_IF_ERROR(d2h_->Record(*part_free_[j]));
  } else {
    STRATA_RETURN_IF_ERROR(d2h_->Wait(*dgrad_ready_[j]));
    STRATA_RETURN_IF_ERROR(d2h_->CopyD2H(hbucket_[i].span(), dbucket_[j].subspan(0, np(b) * w_)));
    STRATA_RETURN_IF_ERROR(d2h_->Record(*landed_[i]));
    STRATA_RETURN_IF_ERROR(d2h_->Record(*dbucket_free_[j]));
  }
  if (eager_ && last) ++param_version_[b];  // the fold submits b's update
  folder_->Submit([=, this]() -> Status {
    Fold(b, i, overwrite, last);
    return Status::Ok();
  });
  if (!o_.overlap) {
    if (dp()) STRATA_RETURN_IF_ERROR(reduce_->Synchronize());
    STRATA_RETURN_IF_ERROR(d2h_->Synchronize());
    STRATA_RETURN_IF_ERROR(folder_->Drain());
    STRATA_RETURN_IF_ERROR(FoldError());
  }
  return Status::Ok();
}

// Runs on the fold worker. Never fails the queue: an error is kept in fold_error_ and every
// bucket still goes back to the pool, so the driving thread cannot wait forever for one.
void Engine::Impl::Fold(int b, int bucket, bool overwrite, bool last) {
  Status s = FoldError();
  if (s.ok()) s = landed_[bucket]->Synchronize();
  if (s.ok()) {
    trace::ScopedTraceEvent t(o_.trace, fold_track_, "fold gradient bucket",
                              trace::Category::kCpuOptimizer);
    // The bucket holds this rank's reduced fp32 partition (data parallel) or the block's
    // gradients in the working precision.
    const cpu_optim::GradView g{hbucket_[bucket].data(), dp() ? DType::kF32 : o_.precision};
    StatusOr<cpu_optim::GradStats> stats = cpu_optim::GradStats{};
    if (grad16_[b]) {
      // The chunk's only contribution: kept as it landed (the same statistics, bit for bit, as
      // widening it into an fp32 accumulator would give).
      STRATA_CHECK(overwrite && last);
      std::memcpy(accum_[b].data(), hbucket_[bucket].data(), np(b) * w_);
      stats = cpu_optim::ComputeGradStats(g, np(b));
    } else {
      stats = cpu_optim::AccumulateGrad(std::span<float>(accum_[b].as<float>(), own(b)), g,
                                        overwrite, last);
    }
    if (!stats.ok()) {
      s = stats.status();
    } else if (last) {
      cpu_optim::Merge(stats_, *stats);
      if (eager_) {
        // Eager mode: b's gradient is complete; update it now unless a gradient of this step
        // was non-finite (then this and every later block keep their weights).
        if (stats->nonfinite || !std::isfinite(stats->sum_squares)) eager_overflow_ = true;
        if (!eager_overflow_) pipeline_->Submit(b);
      }
    }
  }
  if (o_.test_hooks.poison_released_buckets) {
    // NaN in every dtype: a fold that read a bucket before its copy landed, or a copy into a
    // bucket still being folded, shows up as a non-finite gradient.
    std::memset(hbucket_[bucket].data(), 0xFF, hbucket_[bucket].size_bytes());
    buckets_poisoned_.fetch_add(1, std::memory_order_relaxed);
  }
  pool_.Release(bucket);
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(fold_mu_);
    if (fold_error_.ok()) fold_error_ = std::move(s);
  }
}

Status Engine::Impl::Flush() {
  STRATA_RETURN_IF_ERROR(folder_->Drain());
  STRATA_RETURN_IF_ERROR(FoldError());
  return pipeline_->Drain();
}

StatusOr<StepResult> Engine::Impl::Step(std::span<const MicroBatch> mbs) {
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
  // The order blocks are used in: forward 0..n-1, backward n-1..0, per micro-batch.
  std::vector<int> seq;
  const std::vector<int> fwd = UseOrder(false), bwd = UseOrder(true);
  for (size_t i = 0; i < mbs.size(); ++i) {
    seq.insert(seq.end(), fwd.begin(), fwd.end());
    seq.insert(seq.end(), bwd.begin(), bwd.end());
  }
  size_t cursor = 0;
  stats_ = {};
  eager_overflow_ = false;
  const float scale = scaler_.scale();
  // The mean over every micro-batch of every rank.
  const float dloss = scale / static_cast<float>(mbs.size() * world());
  for (size_t i = 0; i < mbs.size(); ++i) {
    const bool first_mb = i == 0, last_mb = i + 1 == mbs.size();
    STRATA_RETURN_IF_ERROR(UploadTokens(mbs[i], shape, /*with_targets=*/true));
    STRATA_RETURN_IF_ERROR(
        ForwardPass(shape, true, static_cast<int>(i), seq, &cursor, /*save_acts=*/true));
    if (eager_ && last_mb) {
      // Every block's previous update is done (this forward waited on each); the round's
      // hyper-parameters can be set for the updates the folds will submit. No clipping and
      // scale 1 in eager mode: the gradient scale is exactly that of an exact step.
      STRATA_RETURN_IF_ERROR(pipeline_->Drain());
      round_ = {o_.optimizer, cpu_optim::OptimStep{adam_t_ + 1, 1.0f / scale}};
    }
    for (int b = n_ - 1; b >= 0; --b, ++cursor) {
      const int t = tied(b);
      std::optional<Acquired> tied_copy;
      if (t >= 0) {
        STRATA_CHECK(seq[cursor] == t);
        STRATA_ASSIGN_OR_RETURN(tied_copy,
                                AcquireParams(t, std::span<const int>(seq).subspan(cursor)));
        ++cursor;
      }
      STRATA_CHECK(seq[cursor] == b);
      const auto window = std::span<const int>(seq).subspan(cursor);
      const int held[1] = {t};
      STRATA_ASSIGN_OR_RETURN(const Acquired a, AcquireParams(b, window,
                                                              tied_copy ? std::span<const int>(held)
                                                                        : std::span<const int>()));
      BlockBuffers buf;
      buf.precision = o_.precision;
      buf.params = a.params;
      STRATA_ASSIGN_OR_RETURN(buf.grads, NextGradBucket(b));
      if (tied_copy) {
        buf.tied_params = tied_copy->params;
        STRATA_ASSIGN_OR_RETURN(buf.tied_grads, NextGradBucket(t, 1));
      }
      buf.shape = shape;
      buf.scratch = scratch_;
      if (b == 0) buf.tokens = tokens_.as<const int32_t>();
      if (b > 0) {
        buf.x_in = Typed(Act(b - 1));
        buf.dx_in = Typed(dx_[b % 2]);
        // Offloaded: acts n-2 and n-3 are still on the device after forward; older ones were
        // loaded back (LoadActivation) one block ahead.
        if (plan_.offload_activations && b - 1 <= n_ - 4) {
          STRATA_RETURN_IF_ERROR(compute_->Wait(*act_ready_[(b - 1) % 2]));
        }
      }
      if (b < n_ - 1) {
        buf.dx_out = Typed(dx_[(b + 1) % 2]);
      } else {
        buf.targets = targets_.as<const int32_t>();
        buf.dloss = dloss;
      }
      STRATA_RETURN_IF_ERROR(model_->Backward(b, buf, *compute_));
      if (plan_.offload_activations && b > 0) {
        STRATA_RETURN_IF_ERROR(compute_->Record(*act_free_[(b - 1) % 2]));
        // Backward b was the last reader of buffer (b-1) % 2: bring act b-3 back into it.
        if (b - 3 >= 0) STRATA_RETURN_IF_ERROR(LoadActivation(b - 3));
      }
      // Chunk b's accumulator starts with its first contribution of the step: its tying
      // block's, when it has one (that block's backward runs first).
      STRATA_RETURN_IF_ERROR(StreamGradients(b, first_mb && tied_user_[b] < 0, last_mb));
      if (tied_copy) {
        STRATA_RETURN_IF_ERROR(StreamGradients(t, first_mb, /*last=*/false));
        STRATA_RETURN_IF_ERROR(compute_->Record(*tied_copy->copy->released));
      }
      STRATA_RETURN_IF_ERROR(AfterOp(a, window));
    }
  }
  // When backward ends the folds have the global norm and the overflow flag.
  STRATA_RETURN_IF_ERROR(folder_->Drain());
  STRATA_RETURN_IF_ERROR(FoldError());
  STRATA_RETURN_IF_ERROR(compute_->Synchronize());

  StepResult result;
  result.loss_scale = scale;
  float loss_sum = 0;
  const auto* losses =
      reinterpret_cast<const float*>(io_pinned_.data() + o_.micro_batch.tokens() * 8);
  for (size_t i = 0; i < mbs.size(); ++i) loss_sum += losses[i];
  result.loss = loss_sum / static_cast<float>(mbs.size());
  if (dp()) {
    // Every rank clips, skips and reports alike: the squared norm, the overflow flag and the
    // loss summed over the ranks (in rank order, the same bits everywhere).
    double v[3] = {stats_.sum_squares, stats_.nonfinite ? 1.0 : 0.0, result.loss};
    STRATA_RETURN_IF_ERROR(o_.comm->AllReduce(v, comm::ReduceOp::kSum));
    stats_.sum_squares = v[0];
    stats_.nonfinite = v[1] != 0;
    result.loss = static_cast<float>(v[2] / world());
  }
  const bool overflow = stats_.nonfinite || !std::isfinite(stats_.sum_squares);
  result.grad_norm = overflow ? INFINITY : std::sqrt(stats_.sum_squares) / scale;
  ++step_;
  if (eager_) {
    // The updates were submitted as gradients landed.
    ++adam_t_;
    if (overflow) {
      result.skipped = true;
      scaler_.Update(true);
      STRATA_LOG_WARNING(
          "step {}: non-finite gradient in eager mode; blocks whose gradients landed before it "
          "were updated, the rest kept their weights",
          step_);
    }
    if (!o_.overlap) STRATA_RETURN_IF_ERROR(pipeline_->Drain());
    return result;
  }
  if (scaler_.Update(overflow)) {
    result.skipped = true;
    STRATA_LOG_WARNING("step {}: non-finite gradient, update skipped; loss scale now {}", step_,
                       scaler_.scale());
    return result;
  }
  float clip = 1.0f;
  if (o_.grad_clip_norm > 0 && result.grad_norm > o_.grad_clip_norm) {
    clip = static_cast<float>(o_.grad_clip_norm / (result.grad_norm + 1e-6));
  }
  // Adam's step count t counts applied updates; skipped steps do not advance it.
  ++adam_t_;
  STRATA_RETURN_IF_ERROR(pipeline_->Drain());
  round_ = {o_.optimizer, cpu_optim::OptimStep{adam_t_, clip / scale}};
  // Exact step, hidden under the next forward: blocks update in forward order on the CPU
  // pipeline while this call returns; the next forward of block b waits only on b's update.
  for (int b = 0; b < n_; ++b) {
    ++param_version_[b];
    pipeline_->Submit(b);
    if (!o_.overlap) STRATA_RETURN_IF_ERROR(pipeline_->WaitBlock(b));
  }
  return result;
}

StatusOr<float> Engine::Impl::EvaluateLoss(const MicroBatch& batch, MicroBatchShape shape) {
  if (shape.batch_size < 1 || shape.seq_len < 1 || shape.tokens() > o_.micro_batch.tokens() ||
      shape.seq_len > model_->max_seq_len()) {
    return InvalidArgumentError("evaluation batch is larger than the training micro-batch");
  }
  STRATA_RETURN_IF_ERROR(UploadTokens(batch, shape, /*with_targets=*/true));
  const std::vector<int> seq = UseOrder(false);
  size_t cursor = 0;
  STRATA_RETURN_IF_ERROR(ForwardPass(shape, true, 0, seq, &cursor));
  STRATA_RETURN_IF_ERROR(compute_->Synchronize());
  return *reinterpret_cast<const float*>(io_pinned_.data() + o_.micro_batch.tokens() * 8);
}

StatusOr<std::vector<float>> Engine::Impl::NextTokenLogits(std::span<const int32_t> tokens) {
  const MicroBatchShape shape{1, static_cast<int>(tokens.size())};
  if (tokens.empty() || shape.tokens() > o_.micro_batch.tokens() ||
      shape.seq_len > model_->max_seq_len()) {
    return InvalidArgumentError(
        fmt::format("context of {} tokens is empty or too long", tokens.size()));
  }
  STRATA_RETURN_IF_ERROR(UploadTokens(MicroBatch{tokens, {}}, shape, /*with_targets=*/false));
  const std::vector<int> seq = UseOrder(false);
  size_t cursor = 0;
  STRATA_RETURN_IF_ERROR(ForwardPass(shape, false, -1, seq, &cursor));
  const int vocab = model_->vocab_size();
  const size_t off = o_.micro_batch.tokens() * 8 + o_.grad_accum_steps * 4 + 4;
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
  STRATA_RETURN_IF_ERROR(Flush());
  STRATA_RETURN_IF_ERROR(LoadOptimState(block).status());
  return GatherBlock(block, Master(block, 0));
}

StatusOr<std::vector<float>> Engine::Impl::GatherBlock(int b, const float* mine) {
  if (!dp()) return std::vector<float>(mine, mine + np(b));
  // Every rank sends its partition padded to part_elems; partitions land in rank order.
  const int64_t pe = home_elems(b);
  std::vector<float> send(pe, 0.0f), all(pe * world());
  std::copy(mine, mine + own(b), send.begin());
  STRATA_RETURN_IF_ERROR(o_.comm->AllGatherBytes(std::as_bytes(std::span(send)),
                                                 std::as_writable_bytes(std::span(all))));
  all.resize(np(b));
  return all;
}

StatusOr<std::vector<float>> Engine::Impl::AccumulatedGradient(int block) {
  if (block < 0 || block >= n_) return OutOfRangeError(fmt::format("no block {}", block));
  if (o_.inference_only || step_ == 0) {
    return FailedPreconditionError("no gradient: the engine has not taken a step");
  }
  STRATA_RETURN_IF_ERROR(Flush());
  std::vector<float> g(own(block));
  STRATA_RETURN_IF_ERROR(
      cpu_optim::ConvertToF32(accum_[block].data(), grad_dtype(block), g.data(), own(block)));
  return GatherBlock(block, g.data());
}

StatusOr<uint64_t> Engine::Impl::MasterWeightsXxh3() {
  if (o_.inference_only)
    return FailedPreconditionError("an inference-only engine has no master weights");
  STRATA_RETURN_IF_ERROR(Flush());
  XXH3_state_t* state = XXH3_createState();
  if (!state) return ResourceExhaustedError("could not allocate an xxh3 state");
  XXH3_64bits_reset(state);
  Status status;
  for (int b = 0; b < n_ && status.ok(); ++b) {
    status = LoadOptimState(b).status();
    if (!status.ok()) break;
    StatusOr<std::vector<float>> p32 = GatherBlock(b, Master(b, 0));
    status = p32.status();
    if (status.ok()) XXH3_64bits_update(state, p32->data(), np(b) * 4);
  }
  const uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  if (!status.ok()) return status;
  return h;
}

StatusOr<const std::byte*> Engine::Impl::WorkingParamsBytes(int b) {
  const gpu::PinnedSpan home = WorkingHome(b, 0);
  if (!nvme_params() || resident(b)) return home.data;
  STRATA_RETURN_IF_ERROR(swap_->Read(
      ParamsExtent(b), home.bytes().subspan(0, io::SwapStore::PaddedSize(home_elems(b) * w_))));
  return home.data;
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
  if (world() > 1) {
    return WriteCheckpointRanks(save_dir, trainer, options, checkpoint_dir)
        .WithContext(fmt::format("saving checkpoint step-{} in '{}'", trainer.step, save_dir));
  }
  STRATA_ASSIGN_OR_RETURN(std::string temp_dir, CreateCheckpointTempDir(save_dir, trainer.step));
  Status s = WriteCheckpoint(save_dir, temp_dir, trainer, options, checkpoint_dir);
  if (!s.ok()) {
    RemoveTree(temp_dir);
    return s.WithContext(fmt::format("saving checkpoint step-{} in '{}'", trainer.step, save_dir));
  }
  return Status::Ok();
}

namespace {

// The checkpoint files of the optimizer's state: one per section name, in order of first use,
// holding that section of every block that has it (optimizer_state.h).
struct StateFile {
  std::string name;  // "exp_avg", ...; the file is name + ".safetensors"
  std::vector<SafetensorsWriter::TensorSpec> tensors;
  std::vector<std::pair<int, size_t>> blocks;  // (block, section index), in tensor order
};

std::vector<StateFile> StateFiles(const Model& model, const std::vector<BlockState>& states) {
  std::vector<StateFile> files;
  for (int b = 0; b < static_cast<int>(states.size()); ++b) {
    for (size_t k = 0; k < states[b].sections.size(); ++k) {
      const cpu_optim::StateSpec& spec = states[b].sections[k];
      auto it = std::find_if(files.begin(), files.end(),
                             [&](const StateFile& f) { return f.name == spec.name; });
      if (it == files.end()) it = files.insert(files.end(), StateFile{spec.name, {}, {}});
      it->tensors.push_back(
          {model.block_name(b),
           spec.dtype == cpu_optim::StateDType::kU8 ? TensorDType::U8() : TensorDType(DType::kF32),
           {spec.num_elems}});
      it->blocks.emplace_back(b, k);
    }
  }
  return files;
}

// One tensor file of a checkpoint: its name, its `content` metadata and its tensors.
struct CheckpointFile {
  std::string name;
  std::string content;
  std::vector<SafetensorsWriter::TensorSpec> tensors;
};

// The tensor files of a checkpoint, in the manifest's order: the fp32 master weights, the
// optimizer's state files (`state`), the working weights in `working`. `optimizer` names the
// state in its files' metadata.
std::vector<CheckpointFile> CheckpointFiles(const Model& model, const std::vector<StateFile>& state,
                                            std::string_view optimizer, DType working) {
  std::vector<SafetensorsWriter::TensorSpec> f32, work;
  for (int b = 0; b < model.num_blocks(); ++b) {
    f32.push_back({model.block_name(b), DType::kF32, {model.block_num_params(b)}});
    work.push_back({model.block_name(b), working, {model.block_num_params(b)}});
  }
  std::vector<CheckpointFile> files = {{kMasterFile, "fp32 master weights", std::move(f32)}};
  for (const StateFile& f : state) {
    files.push_back(
        {f.name + ".safetensors", fmt::format("{} state {}", optimizer, f.name), f.tensors});
  }
  files.push_back({kWorkingFile, "working weights", std::move(work)});
  return files;
}

}  // namespace

Status Engine::Impl::WriteCheckpoint(const std::string& save_dir, const std::string& temp_dir,
                                     const TrainerState& trainer,
                                     const SaveCheckpointOptions& options,
                                     std::string* checkpoint_dir) {
  const std::vector<StateFile> state_files = StateFiles(*model_, full_state_);
  const std::vector<CheckpointFile> files =
      CheckpointFiles(*model_, state_files, OptimizerFlagName(o_.optimizer), o_.precision);
  std::vector<SafetensorsWriter> writers;
  for (const CheckpointFile& f : files) {
    STRATA_ASSIGN_OR_RETURN(
        auto w, SafetensorsWriter::Create(temp_dir + "/" + f.name, f.tensors,
                                          {{"format", "strata"}, {"content", f.content}}));
    writers.push_back(std::move(w));
  }
  // Block by block: one block's state in memory at a time. Each writer takes its tensors in
  // block order, so every file is appended to in order.
  for (int b = 0; b < n_; ++b) {
    STRATA_RETURN_IF_ERROR(LoadOptimState(b).status());
    STRATA_RETURN_IF_ERROR(
        writers[0].Append(std::as_bytes(std::span(Master(b, 0), static_cast<size_t>(np(b))))));
    for (size_t f = 0; f < state_files.size(); ++f) {
      for (const auto& [block, k] : state_files[f].blocks) {
        if (block == b) STRATA_RETURN_IF_ERROR(writers[1 + f].Append(Section(b, 0, k)));
      }
    }
    STRATA_ASSIGN_OR_RETURN(const std::byte* w, WorkingParamsBytes(b));
    STRATA_RETURN_IF_ERROR(writers.back().Append(std::span(w, np(b) * w_)));
  }
  Manifest manifest = TrainingManifest(trainer);
  for (size_t i = 0; i < writers.size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(auto r, writers[i].Finish());
    manifest.files.push_back({files[i].name, r.size_bytes, r.xxh3});
  }
  return CommitCheckpoint(save_dir, temp_dir, manifest, options.keep_last, checkpoint_dir);
}

Manifest Engine::Impl::TrainingManifest(const TrainerState& trainer) const {
  Manifest manifest;
  manifest.precision = std::string(DTypeName(o_.precision));
  manifest.model_description = model_->description();
  for (int b = 0; b < n_; ++b) {
    manifest.block_names.push_back(model_->block_name(b));
    manifest.block_num_params.push_back(np(b));
  }
  manifest.vocab_size = model_->vocab_size();
  manifest.max_seq_len = model_->max_seq_len();
  manifest.engine_steps = step_;
  manifest.adam_steps = adam_t_;
  manifest.loss_scaler = {scaler_.scale(), scaler_.clean_steps(), scaler_.overflows(),
                          scaler_.hysteresis_left()};
  manifest.optimizer = o_.optimizer;
  manifest.grad_clip_norm = o_.grad_clip_norm;
  manifest.trainer = trainer;
  manifest.ranks = world();
  return manifest;
}

Status Engine::Impl::AgreeAll(Status mine) {
  double failed = mine.ok() ? 0.0 : 1.0;
  STRATA_RETURN_IF_ERROR(o_.comm->AllReduce(std::span(&failed, 1), comm::ReduceOp::kSum));
  if (!mine.ok()) return mine;
  if (failed > 0) {
    return AbortedError(fmt::format("{} other rank{} failed (see {} error)", failed,
                                    failed == 1 ? "" : "s", failed == 1 ? "its" : "their"));
  }
  return Status::Ok();
}

StatusOr<std::string> Engine::Impl::FromRank0(StatusOr<std::string> mine) {
  // [code (8 bytes)][length (8 bytes)] then the text or the error message.
  uint64_t head[2] = {0, 0};
  std::string text;
  if (o_.comm->rank() == 0) {
    head[0] = static_cast<uint64_t>(mine.status().code());
    text = mine.ok() ? *mine : mine.status().message();
    head[1] = text.size();
  }
  STRATA_RETURN_IF_ERROR(o_.comm->Broadcast(std::as_writable_bytes(std::span(head)), 0));
  text.resize(head[1]);
  STRATA_RETURN_IF_ERROR(o_.comm->Broadcast(std::as_writable_bytes(std::span(text)), 0));
  if (head[0] != 0) {
    return Status(static_cast<StatusCode>(head[0]),
                  o_.comm->rank() == 0 ? text : fmt::format("rank 0: {}", text));
  }
  return text;
}

Status Engine::Impl::WriteCheckpointRanks(const std::string& save_dir, const TrainerState& trainer,
                                          const SaveCheckpointOptions& options,
                                          std::string* checkpoint_dir) {
  const bool root = o_.comm->rank() == 0;
  // Rank 0 makes the temporary directory (a shared file system across machines).
  STRATA_ASSIGN_OR_RETURN(
      const std::string temp_dir,
      FromRank0(root ? CreateCheckpointTempDir(save_dir, trainer.step) : std::string()));
  const std::vector<StateFile> state_files = StateFiles(*model_, full_state_);
  const std::vector<CheckpointFile> files =
      CheckpointFiles(*model_, state_files, OptimizerFlagName(o_.optimizer), o_.precision);
  auto metadata = [](const CheckpointFile& f) {
    return std::map<std::string, std::string>{{"format", "strata"}, {"content", f.content}};
  };
  // Rank 0 lays every file out at its full size; then each rank writes its partitions.
  Status created;
  if (root) {
    for (const CheckpointFile& f : files) {
      created =
          SafetensorsPartWriter::Create(temp_dir + "/" + f.name, f.tensors, metadata(f)).status();
      if (!created.ok()) break;
    }
  }
  Status s = AgreeAll(created);
  std::vector<SafetensorsPartWriter> writers;
  for (size_t i = 0; s.ok() && i < files.size(); ++i) {
    auto w = SafetensorsPartWriter::Open(temp_dir + "/" + files[i].name, files[i].tensors,
                                         metadata(files[i]));
    if (!w.ok()) {
      s = w.status();
    } else {
      writers.push_back(std::move(*w));
    }
  }
  // Block by block: this rank's part of block b is tensor b of the master and working files,
  // and tensor j of a state file, at the partition's offset.
  for (int b = 0; b < n_ && s.ok(); ++b) {
    const uint64_t off = part(b).offset_elems, n = own(b);
    if (n == 0) continue;
    s = LoadOptimState(b).status();
    if (s.ok()) s = writers[0].WriteAt(b, off * 4, std::as_bytes(std::span(Master(b, 0), n)));
    for (size_t f = 0; f < state_files.size() && s.ok(); ++f) {
      for (size_t j = 0; j < state_files[f].blocks.size() && s.ok(); ++j) {
        const auto [block, k] = state_files[f].blocks[j];
        if (block == b) s = writers[1 + f].WriteAt(j, off * 4, Section(b, 0, k).subspan(0, n * 4));
      }
    }
    if (!s.ok()) break;
    StatusOr<const std::byte*> w = WorkingParamsBytes(b);
    s = w.status();
    if (s.ok()) s = writers.back().WriteAt(b, off * w_, std::span(*w, n * w_));
  }
  for (size_t i = 0; i < writers.size() && s.ok(); ++i) s = writers[i].Sync();
  writers.clear();
  // Every rank's bytes are durable before rank 0 hashes the files and commits.
  s = AgreeAll(std::move(s));
  Status committed;
  if (root) {
    if (s.ok()) {
      Manifest manifest = TrainingManifest(trainer);
      for (const CheckpointFile& f : files) {
        uint64_t size = 0;
        StatusOr<uint64_t> hash = FileXxh3(temp_dir + "/" + f.name, &size);
        if (!hash.ok()) {
          committed = hash.status();
          break;
        }
        manifest.files.push_back({f.name, size, *hash});
      }
      if (committed.ok()) {
        committed =
            CommitCheckpoint(save_dir, temp_dir, manifest, options.keep_last, checkpoint_dir);
      }
    }
    if (!s.ok() || !committed.ok()) RemoveTree(temp_dir);
  }
  if (!s.ok()) return s;
  // Rank 0's commit decides for everyone.
  STRATA_ASSIGN_OR_RETURN(
      std::string dir,
      FromRank0(committed.ok() ? StatusOr<std::string>(checkpoint_dir ? *checkpoint_dir : "")
                               : StatusOr<std::string>(committed)));
  if (checkpoint_dir) *checkpoint_dir = dir;
  return Status::Ok();
}

Status Engine::Impl::CheckManifestMatchesModel(const Manifest& m) const {
  if (m.precision != DTypeName(o_.precision) && !o_.inference_only) {
    return InvalidArgumentError(
        fmt::format("the checkpoint was trained with --precision {}, this run uses {}", m.precision,
                    DTypeName(o_.precision)));
  }
  if (static_cast<int>(m.block_names.size()) != n_ || m.vocab_size != model_->vocab_size() ||
      m.max_seq_len != model_->max_seq_len()) {
    return InvalidArgumentError(fmt::format(
        "the checkpoint's model ({}: {} blocks, vocabulary {}, context {}) is not this run's "
        "({}: {} blocks, vocabulary {}, context {})",
        m.model_description, m.block_names.size(), m.vocab_size, m.max_seq_len,
        model_->description(), n_, model_->vocab_size(), model_->max_seq_len()));
  }
  for (int b = 0; b < n_; ++b) {
    if (m.block_names[b] != model_->block_name(b) || m.block_num_params[b] != np(b)) {
      return InvalidArgumentError(fmt::format(
          "checkpoint block {} is '{}' with {} parameters, this model's is '{}' with {}", b,
          m.block_names[b].substr(0, 80), m.block_num_params[b], model_->block_name(b), np(b)));
    }
  }
  return Status::Ok();
}

Status Engine::Impl::LoadCheckpoint(const std::string& path, TrainerState* trainer) {
  // Phase 1: validate everything; no engine state changes.
  STRATA_ASSIGN_OR_RETURN(std::string dir, ResolveCheckpointDir(path));
  STRATA_ASSIGN_OR_RETURN(Manifest m, ReadManifest(dir));
  STRATA_RETURN_IF_ERROR(CheckManifestMatchesModel(m).WithContext(dir));
  // The optimizer's state is read only by the same kind (inference reads the master weights).
  const std::vector<StateFile> state_files =
      o_.inference_only ? std::vector<StateFile>() : StateFiles(*model_, full_state_);
  if (!o_.inference_only && m.optimizer.kind != o_.optimizer.kind) {
    return InvalidArgumentError(fmt::format(
        "{}: the checkpoint holds {} optimizer state, this run uses {}; resume with --optimizer "
        "{} (or start a new run)",
        dir, OptimizerFlagName(m.optimizer), OptimizerFlagName(o_.optimizer),
        OptimizerFlagName(m.optimizer)));
  }
  // Files: master, the state sections, working (WriteCheckpoint's order).
  DType working_dtype = o_.precision;
  if (o_.inference_only) {
    STRATA_ASSIGN_OR_RETURN(working_dtype, ParseDType(m.precision));
  }
  const std::vector<CheckpointFile> expected =
      CheckpointFiles(*model_, state_files, OptimizerFlagName(o_.optimizer), working_dtype);
  for (const CheckpointFile& e : expected) {
    const bool listed = std::any_of(m.files.begin(), m.files.end(),
                                    [&](const ManifestFile& f) { return f.name == e.name; });
    if (!listed) {
      return (e.name == kMasterFile || e.name == kWorkingFile)
                 ? DataLossError(fmt::format("{}: the manifest lists no '{}'", dir, e.name))
                 : InvalidArgumentError(fmt::format(
                       "{}: the checkpoint's {} state has no '{}', which this run's {} state "
                       "needs (amsgrad, momentum or beta1 differ from the saved run's?)",
                       dir, OptimizerFlagName(m.optimizer), e.name,
                       OptimizerFlagName(o_.optimizer)));
    }
  }
  if (!o_.inference_only) {
    for (const ManifestFile& f : m.files) {
      const bool known = std::any_of(expected.begin(), expected.end(),
                                     [&](const CheckpointFile& e) { return e.name == f.name; });
      if (!known) {
        return InvalidArgumentError(fmt::format(
            "{}: the checkpoint's {} state has '{}', which this run's {} state does not use "
            "(amsgrad, momentum or beta1 differ from the saved run's?)",
            dir, OptimizerFlagName(m.optimizer), f.name, OptimizerFlagName(o_.optimizer)));
      }
    }
  }
  // Every listed file, whole, against its manifest size and xxh3; the tensor files are checked
  // through the same descriptors phase 2 reads from, so what is loaded is what was verified.
  STRATA_RETURN_IF_ERROR(VerifyCheckpointFiles(dir, m));
  std::vector<OpenSafetensors> files;
  std::vector<std::vector<const SafetensorsTensor*>> tensors(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const std::string file = dir + "/" + expected[i].name;
    STRATA_ASSIGN_OR_RETURN(auto f, OpenSafetensorsFile(file));
    uint64_t size = 0;
    STRATA_ASSIGN_OR_RETURN(uint64_t hash, FdXxh3(f.fd.get(), file, &size));
    const auto listed = std::find_if(m.files.begin(), m.files.end(), [&](const ManifestFile& mf) {
      return mf.name == expected[i].name;
    });
    if (size != listed->size_bytes || hash != listed->xxh3) {
      return DataLossError(fmt::format("'{}' changed while it was being verified", file));
    }
    if (f.header.tensors.size() != expected[i].tensors.size()) {
      return DataLossError(fmt::format("'{}' holds {} tensors, expected {}", file,
                                       f.header.tensors.size(), expected[i].tensors.size()));
    }
    for (const auto& want : expected[i].tensors) {
      const SafetensorsTensor* t = f.header.Find(want.name);
      if (!t || t->dtype != want.dtype || t->shape != want.shape) {
        return DataLossError(fmt::format("'{}': tensor '{}' is missing or not {} [{}]", file,
                                         want.name, SafetensorsDTypeName(want.dtype),
                                         want.shape[0]));
      }
      tensors[i].push_back(t);
    }
    files.push_back(std::move(f));
  }
  const size_t working_file = expected.size() - 1;

  // Phase 2: stream the validated tensors into the stores, block by block, once nothing reads
  // them any more (the last update applied, no H2D copy from a pinned home in flight).
  STRATA_RETURN_IF_ERROR(Flush());
  STRATA_RETURN_IF_ERROR(loader_->Drain());
  STRATA_RETURN_IF_ERROR(h2d_->Synchronize());
  partially_loaded_ = true;
  if (o_.inference_only) {
    // The master weights, converted to this engine's precision.
    STRATA_ASSIGN_OR_RETURN(auto f32, AlignedBuffer::Allocate(plan_.max_block_params * 4, 64));
    for (int b = 0; b < n_; ++b) {
      const std::span<float> p32(f32.as<float>(), np(b));
      STRATA_RETURN_IF_ERROR(
          ReadTensorBytes(files[0], *tensors[0][b], 0, std::as_writable_bytes(p32)));
      STRATA_RETURN_IF_ERROR(
          cpu_optim::ConvertFromF32(p32.data(), WorkingHome(b, 0).data, o_.precision, np(b)));
      ++param_version_[b];
    }
    partially_loaded_ = false;
    *trainer = m.trainer;
    return Status::Ok();
  }
  // Each rank reads its partition of every tensor, whatever the number of ranks that saved them
  // (element-wise state when ranks > 1); one rank reads whole tensors.
  for (int b = 0; b < n_; ++b) {
    const size_t n = static_cast<size_t>(own(b));
    const uint64_t off = part(b).offset_elems;
    STRATA_RETURN_IF_ERROR(LoadOptimState(b, /*read=*/false).status());
    STRATA_RETURN_IF_ERROR(ReadTensorBytes(files[0], *tensors[0][b], off * 4,
                                           std::as_writable_bytes(std::span(Master(b, 0), n))));
    for (size_t f = 0; f < state_files.size(); ++f) {
      for (size_t j = 0; j < state_files[f].blocks.size(); ++j) {
        const auto [block, k] = state_files[f].blocks[j];
        if (block != b) continue;
        const std::span<std::byte> section =
            world() > 1 ? Section(b, 0, k).subspan(0, n * 4) : Section(b, 0, k);
        STRATA_RETURN_IF_ERROR(ReadTensorBytes(files[1 + f], *tensors[1 + f][j], off * 4, section));
      }
    }
    STRATA_RETURN_IF_ERROR(ReadTensorBytes(files[working_file], *tensors[working_file][b], off * w_,
                                           WorkingHome(b, 0).bytes().subspan(0, n * w_)));
    if (swap_) STRATA_RETURN_IF_ERROR(WriteBack(b, 0));
    ++param_version_[b];  // every device copy is stale
  }
  step_ = m.engine_steps;
  adam_t_ = m.adam_steps;
  scaler_.Restore(m.loss_scaler.scale, m.loss_scaler.clean_steps, m.loss_scaler.overflows,
                  m.loss_scaler.hysteresis_left);
  cpu_optim::SetLearningRate(o_.optimizer, cpu_optim::LearningRate(m.optimizer));
  partially_loaded_ = false;
  *trainer = m.trainer;
  return Status::Ok();
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

StatusOr<std::unique_ptr<Engine>> Engine::Create(Model* model, gpu::Device* device,
                                                 const EngineOptions& options) {
  if (!model || !device) return InvalidArgumentError("Engine::Create needs a model and a device");
  PlacementOptions placement = options.placement;
  if (options.comm) {
    placement.ranks = options.comm->world_size();
    placement.rank = options.comm->rank();
    placement.data_parallel = true;
  }
  STRATA_ASSIGN_OR_RETURN(
      Plan plan, MakePlan(*model, options.precision, options.micro_batch, placement,
                          PlanOptimizer{options.optimizer, std::max(1, options.grad_accum_steps)}));
  auto impl = std::make_unique<Impl>(model, device, options, std::move(plan));
  STRATA_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

const Plan& Engine::plan() const { return impl_->plan(); }
std::string_view Engine::io_backend_name() const { return impl_->io_backend_name(); }
StatusOr<StepResult> Engine::Step(std::span<const MicroBatch> mbs) { return impl_->Step(mbs); }
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
