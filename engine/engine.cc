#include "engine/engine.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>

#include "base/aligned_buffer.h"
#include "base/logging.h"
#include "base/trace.h"
#include "base/units.h"
#include "cpu_optim/grad_stats.h"
#include "engine/safetensors.h"
#include "io/swap_store.h"

namespace strata::engine {
namespace {

// A device slot that holds one streamed block's working params at a time.
struct Slot {
  gpu::DeviceSpan dev;
  gpu::PinnedBuffer staging;  // NVMe -> pinned -> device (NVMe home only)
  int block = -1;
  int64_t last_use = -1;
  std::unique_ptr<gpu::Event> ready;     // H2D into dev completed
  std::unique_ptr<gpu::Event> released;  // compute finished reading dev
};

std::string ParamsExtent(int b) { return fmt::format("block{}.params", b); }
std::string OptimExtent(int b) { return fmt::format("block{}.optim", b); }

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
    // Drain every stream before the memory they use goes away.
    for (auto* s : {compute_.get(), h2d_.get(), d2h_.get()}) {
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
  StatusOr<float> EvaluateLoss(const MicroBatch& batch, MicroBatchShape shape);
  StatusOr<std::vector<float>> NextTokenLogits(std::span<const int32_t> tokens);
  StatusOr<uint64_t> MasterWeightsXxh3();
  StatusOr<std::vector<float>> MasterWeights(int block);
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
    return c;
  }
  int64_t steps_taken() const { return step_; }
  void SetLearningRate(float lr) { o_.adamw.lr = lr; }
  float loss_scale() const { return scaler_.scale(); }

 private:
  int64_t np(int b) const { return model_->block_num_params(b); }
  uint64_t padded_f32(int b) const { return AlignUp(static_cast<uint64_t>(np(b)) * 4, 4096); }
  bool nvme_params() const { return plan_.param_home == ParamHome::kNvme; }
  bool nvme_optim() const { return plan_.optimizer_home == OptimizerHome::kNvme; }

  StatusOr<gpu::DeviceSpan> Carve(uint64_t size, std::string_view label) {
    return arena_->Carve(size, label);
  }
  Status UploadTokens(const MicroBatch& mb, MicroBatchShape shape, bool with_targets);
  Status EnsureLoaded(int b, std::span<const int> protect);
  // Makes block b's fp32 params available to compute; returns the pointer.
  StatusOr<const float*> AcquireParams(int b, std::span<const int> window);
  Status ProcessLanding(bool first_mb, bool last_mb);
  Status OptimizerStep(float grad_scale);
  // Copy-out target for block b's new working params (pinned).
  gpu::PinnedSpan WorkingHome(int b) { return nvme_params() ? copy_out_.span() : home_[b].span(); }
  Status PublishWorkingParams(int b);  // working home -> NVMe and/or resident slot
  Status LoadOptimState(int b, float** p32, float** m, float** v);
  Status StoreOptimState(int b);
  Status ForwardPass(MicroBatchShape shape, bool with_targets, int loss_index,
                     std::span<const int> seq, size_t* cursor);
  Status WriteCheckpoint(const std::string& save_dir, const std::string& temp_dir,
                         const TrainerState& trainer, const SaveCheckpointOptions& options,
                         std::string* checkpoint_dir);
  Status CheckManifestMatchesModel(const Manifest& m) const;
  // Working params of block b as they are now (reads the swap store for the NVMe home).
  StatusOr<const std::byte*> WorkingParamsBytes(int b);

  Model* model_;
  gpu::Device* device_;
  EngineOptions o_;
  Plan plan_;
  const int n_;
  const size_t w_;
  DynamicLossScaler scaler_;
  int64_t step_ = 0;    // optimizer steps attempted
  int64_t adam_t_ = 0;  // updates applied (Adam's t)
  // Set while a checkpoint load copies validated data into the stores; stays set if that fails.
  bool partially_loaded_ = false;

  std::unique_ptr<gpu::DeviceArena> arena_;
  std::unique_ptr<gpu::Stream> compute_, h2d_, d2h_;
  int host_track_ = 0;  // o_.trace track of the driving thread's CPU optimizer and NVMe work
  gpu::DeviceSpan tokens_, targets_, loss_, logits_, scratch_, grads_, staging_;
  std::vector<gpu::DeviceSpan> acts_;  // acts_[b] = output of block b, b < n-1
  gpu::DeviceSpan dx_[2];

  std::vector<gpu::DeviceSpan> resident_;  // empty span when streamed
  std::vector<std::unique_ptr<gpu::Event>> resident_ready_;
  std::vector<Slot> slots_;
  int64_t use_clock_ = 0;

  std::vector<gpu::PinnedBuffer> home_;  // working params, host/device home
  gpu::PinnedBuffer copy_out_;           // NVMe home: new working params before the write
  gpu::PinnedBuffer bucket_[2];          // gradient landing buckets
  std::unique_ptr<gpu::Event> landed_[2];
  std::unique_ptr<gpu::Event> grad_ready_;
  int next_bucket_ = 0;
  struct Landing {
    int block;
    int bucket;
  };
  std::deque<Landing> pending_;
  cpu_optim::GradStats stats_;

  gpu::PinnedBuffer io_pinned_;  // tokens, targets, losses, logits row
  std::unique_ptr<gpu::Event> io_done_;
  gpu::PinnedBuffer optim_staging_;  // NVMe optimizer: [p32 | m | v] of one block

  std::vector<AlignedBuffer> accum_;        // fp32 gradient accumulators per block
  std::vector<AlignedBuffer> p32_, m_, v_;  // host optimizer home

  std::unique_ptr<io::IoBackend> io_;
  std::unique_ptr<io::SwapStore> swap_;
};

Status Engine::Impl::Init() {
  if (n_ < 2) return InvalidArgumentError("a model needs at least two blocks");
  if (o_.grad_accum_steps < 1) return InvalidArgumentError("--grad-accum-steps must be >= 1");
  const MicroBatchShape shape = o_.micro_batch;

  if (plan_.param_home == ParamHome::kNvme || plan_.optimizer_home == OptimizerHome::kNvme) {
    if (o_.io_backend_factory) {
      STRATA_ASSIGN_OR_RETURN(io_, o_.io_backend_factory(o_.io));
      if (!io_) return InvalidArgumentError("EngineOptions::io_backend_factory returned null");
    } else {
      STRATA_ASSIGN_OR_RETURN(io_, io::CreateIoBackend(o_.io));
    }
    io::SwapStoreOptions so;
    so.dirs = o_.placement.nvme_paths;
    STRATA_ASSIGN_OR_RETURN(swap_, io::SwapStore::Create(io_.get(), so));
    for (int b = 0; b < n_; ++b) {
      if (nvme_params()) STRATA_RETURN_IF_ERROR(swap_->Allocate(ParamsExtent(b), np(b) * w_));
      if (nvme_optim()) STRATA_RETURN_IF_ERROR(swap_->Allocate(OptimExtent(b), 3 * padded_f32(b)));
    }
  }

  STRATA_ASSIGN_OR_RETURN(arena_, device_->CreateArena(plan_.device_total_bytes));
  if (o_.trace) host_track_ = o_.trace->RegisterTrack("host: optimizer + nvme");
  STRATA_ASSIGN_OR_RETURN(compute_, device_->CreateStream("compute"));
  STRATA_ASSIGN_OR_RETURN(h2d_, device_->CreateStream("h2d"));
  STRATA_ASSIGN_OR_RETURN(d2h_, device_->CreateStream("d2h"));
  auto event = [&]() { return device_->CreateEvent(); };

  // Carve exactly the planner's regions, in its order.
  const uint64_t act_bytes = static_cast<uint64_t>(model_->activation_elems(shape)) * 4;
  size_t r = 0;
  const auto& regions = plan_.device_regions;
  STRATA_ASSIGN_OR_RETURN(auto tt, Carve(regions[r].size_bytes, regions[r].label));
  ++r;
  tokens_ = tt.subspan(0, shape.tokens() * 4);
  targets_ = tt.subspan(shape.tokens() * 4, shape.tokens() * 4);
  STRATA_ASSIGN_OR_RETURN(loss_, Carve(regions[r].size_bytes, regions[r].label));
  ++r;
  STRATA_ASSIGN_OR_RETURN(auto acts, Carve(regions[r].size_bytes, regions[r].label));
  ++r;
  for (int b = 0; b < n_ - 1; ++b) acts_.push_back(acts.subspan(b * act_bytes, act_bytes));
  STRATA_ASSIGN_OR_RETURN(auto dx, Carve(regions[r].size_bytes, regions[r].label));
  ++r;
  dx_[0] = dx.subspan(0, act_bytes);
  dx_[1] = dx.subspan(act_bytes, act_bytes);
  STRATA_ASSIGN_OR_RETURN(logits_, Carve(regions[r].size_bytes, regions[r].label));
  ++r;
  STRATA_ASSIGN_OR_RETURN(scratch_, Carve(regions[r].size_bytes, regions[r].label));
  ++r;
  STRATA_ASSIGN_OR_RETURN(grads_, Carve(regions[r].size_bytes, regions[r].label));
  ++r;
  if (o_.precision != DType::kF32) {
    STRATA_ASSIGN_OR_RETURN(staging_, Carve(regions[r].size_bytes, regions[r].label));
    ++r;
  }
  resident_.resize(n_);
  resident_ready_.resize(n_);
  for (int b = 0; b < n_; ++b) {
    if (!plan_.blocks[b].resident) continue;
    STRATA_ASSIGN_OR_RETURN(resident_[b], Carve(regions[r].size_bytes, regions[r].label));
    ++r;
    STRATA_ASSIGN_OR_RETURN(resident_ready_[b], event());
  }
  slots_.resize(plan_.streaming_slots);
  for (auto& s : slots_) {
    STRATA_ASSIGN_OR_RETURN(s.dev, Carve(regions[r].size_bytes, regions[r].label));
    ++r;
    STRATA_ASSIGN_OR_RETURN(s.ready, event());
    STRATA_ASSIGN_OR_RETURN(s.released, event());
    if (nvme_params()) {
      STRATA_ASSIGN_OR_RETURN(s.staging, device_->AllocatePinned(plan_.slot_bytes, "NVMe staging"));
    }
  }
  STRATA_CHECK(r == regions.size());

  // Pinned and host memory.
  for (int i = 0; i < 2; ++i) {
    STRATA_ASSIGN_OR_RETURN(bucket_[i],
                            device_->AllocatePinned(plan_.slot_bytes, "gradient bucket"));
    STRATA_ASSIGN_OR_RETURN(landed_[i], event());
  }
  STRATA_ASSIGN_OR_RETURN(grad_ready_, event());
  STRATA_ASSIGN_OR_RETURN(io_done_, event());
  const uint64_t io_bytes = shape.tokens() * 8 + o_.grad_accum_steps * 4 + 4 +
                            static_cast<uint64_t>(model_->vocab_size()) * 4;
  STRATA_ASSIGN_OR_RETURN(io_pinned_, device_->AllocatePinned(io_bytes, "token staging"));
  if (nvme_params()) {
    STRATA_ASSIGN_OR_RETURN(copy_out_, device_->AllocatePinned(plan_.slot_bytes, "copy-out"));
  } else {
    home_.resize(n_);
    for (int b = 0; b < n_; ++b) {
      STRATA_ASSIGN_OR_RETURN(home_[b], device_->AllocatePinned(np(b) * w_, "working params"));
    }
  }
  uint64_t max_padded = 0;
  for (int b = 0; b < n_; ++b) max_padded = std::max(max_padded, padded_f32(b));
  if (nvme_optim()) {
    STRATA_ASSIGN_OR_RETURN(optim_staging_,
                            device_->AllocatePinned(3 * max_padded, "optimizer staging"));
  }
  for (int b = 0; b < n_; ++b) {
    STRATA_ASSIGN_OR_RETURN(auto acc, AlignedBuffer::Allocate(np(b) * 4, 64));
    accum_.push_back(std::move(acc));
    if (!nvme_optim()) {
      for (auto* vec : {&p32_, &m_, &v_}) {
        STRATA_ASSIGN_OR_RETURN(auto buf, AlignedBuffer::Allocate(np(b) * 4, 64));
        vec->push_back(std::move(buf));
      }
    }
  }

  // Initial master weights, zero Adam state, working params in their homes.
  for (int b = 0; b < n_; ++b) {
    float *p32, *m, *v;
    if (nvme_optim()) {
      std::memset(optim_staging_.data(), 0, optim_staging_.size_bytes());
      p32 = optim_staging_.as<float>();
      m = reinterpret_cast<float*>(optim_staging_.data() + padded_f32(b));
      v = reinterpret_cast<float*>(optim_staging_.data() + 2 * padded_f32(b));
    } else {
      p32 = p32_[b].as<float>();
      m = m_[b].as<float>();
      v = v_[b].as<float>();
    }
    (void)m;
    (void)v;
    model_->InitParams(b, o_.seed, std::span<float>(p32, np(b)));
    STRATA_RETURN_IF_ERROR(
        cpu_optim::ConvertFromF32(p32, WorkingHome(b).data, o_.precision, np(b)));
    if (nvme_optim()) STRATA_RETURN_IF_ERROR(StoreOptimState(b));
    STRATA_RETURN_IF_ERROR(PublishWorkingParams(b));
  }
  return Status::Ok();
}

Status Engine::Impl::LoadOptimState(int b, float** p32, float** m, float** v) {
  if (nvme_optim()) {
    trace::ScopedTraceEvent t(o_.trace, host_track_, "read optimizer state",
                              trace::Category::kNvmeRead);
    STRATA_RETURN_IF_ERROR(
        swap_->Read(OptimExtent(b), optim_staging_.span().bytes().subspan(0, 3 * padded_f32(b))));
    *p32 = optim_staging_.as<float>();
    *m = reinterpret_cast<float*>(optim_staging_.data() + padded_f32(b));
    *v = reinterpret_cast<float*>(optim_staging_.data() + 2 * padded_f32(b));
  } else {
    *p32 = p32_[b].as<float>();
    *m = m_[b].as<float>();
    *v = v_[b].as<float>();
  }
  return Status::Ok();
}

Status Engine::Impl::StoreOptimState(int b) {
  trace::ScopedTraceEvent t(o_.trace, host_track_, "write optimizer state",
                            trace::Category::kNvmeWrite);
  return swap_->Write(OptimExtent(b), optim_staging_.span().bytes().subspan(0, 3 * padded_f32(b)));
}

Status Engine::Impl::PublishWorkingParams(int b) {
  const gpu::PinnedSpan src = WorkingHome(b);
  if (nvme_params()) {
    trace::ScopedTraceEvent t(o_.trace, host_track_, "write params", trace::Category::kNvmeWrite);
    STRATA_RETURN_IF_ERROR(swap_->Write(
        ParamsExtent(b), src.bytes().subspan(0, io::SwapStore::PaddedSize(np(b) * w_))));
  }
  if (plan_.blocks[b].resident) {
    STRATA_RETURN_IF_ERROR(h2d_->CopyH2D(resident_[b], src.subspan(0, np(b) * w_)));
    STRATA_RETURN_IF_ERROR(h2d_->Record(*resident_ready_[b]));
    // The copy-out buffer is reused for the next block: wait for this copy.
    if (nvme_params()) STRATA_RETURN_IF_ERROR(resident_ready_[b]->Synchronize());
  }
  return Status::Ok();
}

Status Engine::Impl::EnsureLoaded(int b, std::span<const int> protect) {
  if (plan_.blocks[b].resident) return Status::Ok();
  for (auto& s : slots_) {
    if (s.block == b) return Status::Ok();
  }
  Slot* victim = nullptr;
  for (auto& s : slots_) {
    if (std::find(protect.begin(), protect.end(), s.block) != protect.end()) continue;
    if (!victim || s.last_use < victim->last_use) victim = &s;
  }
  STRATA_CHECK_MSG(victim != nullptr, "no streaming slot free outside the prefetch window");
  const uint64_t bytes = np(b) * w_;
  // The device slot may still be read by compute: order the copy after it.
  STRATA_RETURN_IF_ERROR(h2d_->Wait(*victim->released));
  if (nvme_params()) {
    // The pinned staging may still feed the slot's previous copy.
    STRATA_RETURN_IF_ERROR(victim->ready->Synchronize());
    trace::ScopedTraceEvent t(o_.trace, host_track_, "read params", trace::Category::kNvmeRead);
    STRATA_RETURN_IF_ERROR(swap_->Read(ParamsExtent(b), victim->staging.span().bytes().subspan(
                                                            0, io::SwapStore::PaddedSize(bytes))));
    STRATA_RETURN_IF_ERROR(h2d_->CopyH2D(victim->dev, victim->staging.span().subspan(0, bytes)));
  } else {
    STRATA_RETURN_IF_ERROR(h2d_->CopyH2D(victim->dev, home_[b].span().subspan(0, bytes)));
  }
  STRATA_RETURN_IF_ERROR(h2d_->Record(*victim->ready));
  victim->block = b;
  victim->last_use = use_clock_++;
  return Status::Ok();
}

StatusOr<const float*> Engine::Impl::AcquireParams(int b, std::span<const int> window) {
  gpu::DeviceSpan src;
  gpu::Event* ready;
  Slot* slot = nullptr;
  if (plan_.blocks[b].resident) {
    src = resident_[b];
    ready = resident_ready_[b].get();
  } else {
    STRATA_RETURN_IF_ERROR(EnsureLoaded(b, window.subspan(0, 1)));
    for (auto& s : slots_) {
      if (s.block == b) slot = &s;
    }
    slot->last_use = use_clock_++;
    src = slot->dev;
    ready = slot->ready.get();
  }
  STRATA_RETURN_IF_ERROR(compute_->Wait(*ready));
  const float* params;
  if (o_.precision == DType::kF32) {
    params = src.as<const float>();
  } else {
    STRATA_RETURN_IF_ERROR(compute_->Convert(staging_, DType::kF32, src, o_.precision, np(b)));
    params = staging_.as<const float>();
  }
  // Once the params are staged (or, for fp32, after this block's op) the slot
  // is free; record the release after the op for fp32, here otherwise.
  if (slot && o_.precision != DType::kF32)
    STRATA_RETURN_IF_ERROR(compute_->Record(*slot->released));
  // Prefetch the next blocks of the sequence into the other slots; the window
  // (this block and the next ones) is never evicted.
  const size_t depth = slots_.empty() ? 0 : slots_.size() - 1;
  const auto protect = window.subspan(0, std::min(depth + 1, window.size()));
  for (size_t i = 1; i < protect.size(); ++i) {
    STRATA_RETURN_IF_ERROR(EnsureLoaded(protect[i], protect));
  }
  return params;
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

Status Engine::Impl::ForwardPass(MicroBatchShape shape, bool with_targets, int loss_index,
                                 std::span<const int> seq, size_t* cursor) {
  for (int b = 0; b < n_; ++b, ++*cursor) {
    STRATA_CHECK(seq[*cursor] == b);
    STRATA_ASSIGN_OR_RETURN(const float* params, AcquireParams(b, seq.subspan(*cursor)));
    BlockBuffers buf;
    buf.params = params;
    buf.shape = shape;
    buf.scratch = scratch_.as<float>();
    if (b == 0) buf.tokens = tokens_.as<const int32_t>();
    if (b > 0) buf.x_in = acts_[b - 1].as<const float>();
    if (b < n_ - 1) {
      buf.x_out = acts_[b].as<float>();
    } else {
      buf.targets = with_targets ? targets_.as<const int32_t>() : nullptr;
      buf.logits = logits_.as<float>();
      buf.loss = loss_.as<float>();
    }
    STRATA_RETURN_IF_ERROR(model_->Forward(b, buf, *compute_));
    if (!plan_.blocks[b].resident && o_.precision == DType::kF32) {
      for (auto& s : slots_) {
        if (s.block == b) STRATA_RETURN_IF_ERROR(compute_->Record(*s.released));
      }
    }
  }
  if (with_targets && loss_index >= 0) {
    const size_t off = o_.micro_batch.tokens() * 8 + loss_index * 4;
    STRATA_RETURN_IF_ERROR(compute_->CopyD2H(io_pinned_.span().subspan(off, 4), loss_));
  }
  return Status::Ok();
}

Status Engine::Impl::ProcessLanding(bool first_mb, bool last_mb) {
  const Landing l = pending_.front();
  pending_.pop_front();
  STRATA_RETURN_IF_ERROR(landed_[l.bucket]->Synchronize());
  trace::ScopedTraceEvent t(o_.trace, host_track_, "fold gradient bucket",
                            trace::Category::kCpuOptimizer);
  const cpu_optim::GradView g{bucket_[l.bucket].data(), o_.precision};
  STRATA_ASSIGN_OR_RETURN(
      auto stats,
      cpu_optim::AccumulateGrad(std::span<float>(accum_[l.block].as<float>(), np(l.block)), g,
                                first_mb, last_mb));
  if (last_mb) cpu_optim::Merge(stats_, stats);
  return Status::Ok();
}

StatusOr<StepResult> Engine::Impl::Step(std::span<const MicroBatch> mbs) {
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
  for (size_t i = 0; i < mbs.size(); ++i) {
    for (int b = 0; b < n_; ++b) seq.push_back(b);
    for (int b = n_ - 1; b >= 0; --b) seq.push_back(b);
  }
  size_t cursor = 0;
  stats_ = {};
  const float scale = scaler_.scale();
  const float dloss = scale / static_cast<float>(mbs.size());
  for (size_t i = 0; i < mbs.size(); ++i) {
    const bool first_mb = i == 0, last_mb = i + 1 == mbs.size();
    STRATA_RETURN_IF_ERROR(UploadTokens(mbs[i], shape, /*with_targets=*/true));
    STRATA_RETURN_IF_ERROR(ForwardPass(shape, true, static_cast<int>(i), seq, &cursor));
    for (int b = n_ - 1; b >= 0; --b, ++cursor) {
      STRATA_CHECK(seq[cursor] == b);
      STRATA_ASSIGN_OR_RETURN(const float* params,
                              AcquireParams(b, std::span(seq).subspan(cursor)));
      BlockBuffers buf;
      buf.params = params;
      buf.grads = grads_.as<float>();
      buf.shape = shape;
      buf.scratch = scratch_.as<float>();
      if (b == 0) buf.tokens = tokens_.as<const int32_t>();
      if (b > 0) {
        buf.x_in = acts_[b - 1].as<const float>();
        buf.dx_in = dx_[b % 2].as<float>();
      }
      if (b < n_ - 1) {
        buf.dx_out = dx_[(b + 1) % 2].as<const float>();
      } else {
        buf.targets = targets_.as<const int32_t>();
        buf.logits = logits_.as<float>();
        buf.dloss = dloss;
      }
      STRATA_RETURN_IF_ERROR(model_->Backward(b, buf, *compute_));
      if (!plan_.blocks[b].resident && o_.precision == DType::kF32) {
        for (auto& s : slots_) {
          if (s.block == b) STRATA_RETURN_IF_ERROR(compute_->Record(*s.released));
        }
      }
      // Gradients: fp32 -> working precision in place, then D2H into a landing bucket.
      if (o_.precision != DType::kF32) {
        STRATA_RETURN_IF_ERROR(compute_->Convert(grads_, o_.precision, grads_, DType::kF32, np(b)));
      }
      STRATA_RETURN_IF_ERROR(compute_->Record(*grad_ready_));
      const int k = next_bucket_;
      next_bucket_ ^= 1;
      STRATA_RETURN_IF_ERROR(d2h_->Wait(*grad_ready_));
      STRATA_RETURN_IF_ERROR(d2h_->CopyD2H(bucket_[k].span(), grads_.subspan(0, np(b) * w_)));
      STRATA_RETURN_IF_ERROR(d2h_->Record(*landed_[k]));
      // The next backward overwrites grads_: only after the copy has read it.
      STRATA_RETURN_IF_ERROR(compute_->Wait(*landed_[k]));
      pending_.push_back({b, k});
      // Fold the previous block's landed bucket while this one computes.
      if (pending_.size() > 1) STRATA_RETURN_IF_ERROR(ProcessLanding(first_mb, last_mb));
    }
    while (!pending_.empty()) STRATA_RETURN_IF_ERROR(ProcessLanding(first_mb, last_mb));
  }
  STRATA_RETURN_IF_ERROR(compute_->Synchronize());

  StepResult result;
  result.loss_scale = scale;
  float loss_sum = 0;
  const auto* losses =
      reinterpret_cast<const float*>(io_pinned_.data() + o_.micro_batch.tokens() * 8);
  for (size_t i = 0; i < mbs.size(); ++i) loss_sum += losses[i];
  result.loss = loss_sum / static_cast<float>(mbs.size());
  const bool overflow = stats_.nonfinite || !std::isfinite(stats_.sum_squares);
  result.grad_norm = overflow ? INFINITY : std::sqrt(stats_.sum_squares) / scale;
  if (scaler_.Update(overflow)) {
    result.skipped = true;
    STRATA_LOG_WARNING("step {}: non-finite gradient, update skipped; loss scale now {}", step_ + 1,
                       scaler_.scale());
    ++step_;
    return result;
  }
  float clip = 1.0f;
  if (o_.grad_clip_norm > 0 && result.grad_norm > o_.grad_clip_norm) {
    clip = static_cast<float>(o_.grad_clip_norm / (result.grad_norm + 1e-6));
  }
  ++step_;
  STRATA_RETURN_IF_ERROR(OptimizerStep(clip / scale));
  return result;
}

Status Engine::Impl::OptimizerStep(float grad_scale) {
  // Adam's step count t counts applied updates; skipped steps do not advance it.
  adam_t_ += 1;
  for (int b = 0; b < n_; ++b) {
    float *p32, *m, *v;
    STRATA_RETURN_IF_ERROR(LoadOptimState(b, &p32, &m, &v));
    const auto n = static_cast<size_t>(np(b));
    {
      trace::ScopedTraceEvent t(o_.trace, host_track_, "adamw", trace::Category::kCpuOptimizer);
      STRATA_RETURN_IF_ERROR(cpu_optim::AdamWUpdate(
          o_.adamw, cpu_optim::AdamWStep{adam_t_, grad_scale}, std::span<float>(p32, n),
          std::span<float>(m, n), std::span<float>(v, n),
          cpu_optim::GradView{accum_[b].data(), DType::kF32},
          cpu_optim::CopyOut{WorkingHome(b).data, o_.precision}));
    }
    if (nvme_optim()) STRATA_RETURN_IF_ERROR(StoreOptimState(b));
    STRATA_RETURN_IF_ERROR(PublishWorkingParams(b));
  }
  // Streamed blocks changed: every slot's copy is stale.
  for (auto& s : slots_) s.block = -1;
  return h2d_->Synchronize();
}

StatusOr<float> Engine::Impl::EvaluateLoss(const MicroBatch& batch, MicroBatchShape shape) {
  if (shape.batch_size < 1 || shape.seq_len < 1 || shape.tokens() > o_.micro_batch.tokens() ||
      shape.seq_len > model_->max_seq_len()) {
    return InvalidArgumentError("evaluation batch is larger than the training micro-batch");
  }
  STRATA_RETURN_IF_ERROR(UploadTokens(batch, shape, /*with_targets=*/true));
  std::vector<int> seq(n_);
  for (int b = 0; b < n_; ++b) seq[b] = b;
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
  std::vector<int> seq(n_);
  for (int b = 0; b < n_; ++b) seq[b] = b;
  size_t cursor = 0;
  STRATA_RETURN_IF_ERROR(ForwardPass(shape, false, -1, seq, &cursor));
  const int vocab = model_->vocab_size();
  const size_t off = o_.micro_batch.tokens() * 8 + o_.grad_accum_steps * 4 + 4;
  const auto dst = io_pinned_.span().subspan(off, vocab * 4);
  STRATA_RETURN_IF_ERROR(
      compute_->CopyD2H(dst, logits_.subspan((tokens.size() - 1) * vocab * 4, vocab * 4)));
  STRATA_RETURN_IF_ERROR(compute_->Synchronize());
  const auto* p = dst.as<const float>();
  return std::vector<float>(p, p + vocab);
}

StatusOr<std::vector<float>> Engine::Impl::MasterWeights(int block) {
  if (block < 0 || block >= n_) return OutOfRangeError(fmt::format("no block {}", block));
  float *p32, *m, *v;
  STRATA_RETURN_IF_ERROR(LoadOptimState(block, &p32, &m, &v));
  return std::vector<float>(p32, p32 + np(block));
}

StatusOr<uint64_t> Engine::Impl::MasterWeightsXxh3() {
  XXH3_state_t* state = XXH3_createState();
  if (!state) return ResourceExhaustedError("could not allocate an xxh3 state");
  XXH3_64bits_reset(state);
  Status status;
  for (int b = 0; b < n_ && status.ok(); ++b) {
    float *p32, *m, *v;
    status = LoadOptimState(b, &p32, &m, &v);
    if (status.ok()) XXH3_64bits_update(state, p32, np(b) * 4);
  }
  const uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  if (!status.ok()) return status;
  return h;
}

StatusOr<const std::byte*> Engine::Impl::WorkingParamsBytes(int b) {
  if (!nvme_params()) return home_[b].data();
  STRATA_RETURN_IF_ERROR(swap_->Read(
      ParamsExtent(b), copy_out_.span().bytes().subspan(0, io::SwapStore::PaddedSize(np(b) * w_))));
  return copy_out_.data();
}

Status Engine::Impl::SaveCheckpoint(const std::string& save_dir, const TrainerState& trainer,
                                    const SaveCheckpointOptions& options,
                                    std::string* checkpoint_dir) {
  if (partially_loaded_) {
    return FailedPreconditionError("the engine holds a half-loaded checkpoint; nothing to save");
  }
  // The working-params copies of the last step must have landed.
  STRATA_RETURN_IF_ERROR(h2d_->Synchronize());
  STRATA_ASSIGN_OR_RETURN(std::string temp_dir, CreateCheckpointTempDir(save_dir, trainer.step));
  Status s = WriteCheckpoint(save_dir, temp_dir, trainer, options, checkpoint_dir);
  if (!s.ok()) {
    RemoveTree(temp_dir);
    return s.WithContext(fmt::format("saving checkpoint step-{} in '{}'", trainer.step, save_dir));
  }
  return Status::Ok();
}

Status Engine::Impl::WriteCheckpoint(const std::string& save_dir, const std::string& temp_dir,
                                     const TrainerState& trainer,
                                     const SaveCheckpointOptions& options,
                                     std::string* checkpoint_dir) {
  std::vector<SafetensorsWriter::TensorSpec> f32_specs, working_specs;
  for (int b = 0; b < n_; ++b) {
    f32_specs.push_back({model_->block_name(b), DType::kF32, {np(b)}});
    working_specs.push_back({model_->block_name(b), o_.precision, {np(b)}});
  }
  const char* names[4] = {kMasterFile, kExpAvgFile, kExpAvgSqFile, kWorkingFile};
  const char* contents[4] = {"fp32 master weights", "AdamW exp_avg (m)", "AdamW exp_avg_sq (v)",
                             "working weights"};
  std::vector<SafetensorsWriter> writers;
  for (int i = 0; i < 4; ++i) {
    STRATA_ASSIGN_OR_RETURN(
        auto w,
        SafetensorsWriter::Create(temp_dir + "/" + names[i], i < 3 ? f32_specs : working_specs,
                                  {{"format", "strata"}, {"content", contents[i]}}));
    writers.push_back(std::move(w));
  }
  // Block by block: one block's state in memory at a time.
  for (int b = 0; b < n_; ++b) {
    float *p32, *m, *v;
    STRATA_RETURN_IF_ERROR(LoadOptimState(b, &p32, &m, &v));
    const size_t n = static_cast<size_t>(np(b));
    STRATA_RETURN_IF_ERROR(writers[0].Append(std::as_bytes(std::span(p32, n))));
    STRATA_RETURN_IF_ERROR(writers[1].Append(std::as_bytes(std::span(m, n))));
    STRATA_RETURN_IF_ERROR(writers[2].Append(std::as_bytes(std::span(v, n))));
    STRATA_ASSIGN_OR_RETURN(const std::byte* working, WorkingParamsBytes(b));
    STRATA_RETURN_IF_ERROR(writers[3].Append(std::span(working, n * w_)));
  }
  Manifest manifest;
  for (int i = 0; i < 4; ++i) {
    STRATA_ASSIGN_OR_RETURN(auto r, writers[i].Finish());
    manifest.files.push_back({names[i], r.size_bytes, r.xxh3});
  }
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
  manifest.loss_scaler = {scaler_.scale(), scaler_.clean_steps(), scaler_.overflows()};
  manifest.adamw = o_.adamw;
  manifest.grad_clip_norm = o_.grad_clip_norm;
  manifest.trainer = trainer;
  return CommitCheckpoint(save_dir, temp_dir, manifest, options.keep_last, checkpoint_dir);
}

Status Engine::Impl::CheckManifestMatchesModel(const Manifest& m) const {
  if (m.precision != DTypeName(o_.precision)) {
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
  const char* names[4] = {kMasterFile, kExpAvgFile, kExpAvgSqFile, kWorkingFile};
  for (const char* name : names) {
    const bool listed = std::any_of(m.files.begin(), m.files.end(),
                                    [&](const ManifestFile& f) { return f.name == name; });
    if (!listed) return DataLossError(fmt::format("{}: the manifest lists no '{}'", dir, name));
  }
  // Every listed file, whole, against its manifest size and xxh3; the tensor files are checked
  // through the same descriptors phase 2 reads from, so what is loaded is what was verified.
  STRATA_RETURN_IF_ERROR(VerifyCheckpointFiles(dir, m));
  std::vector<OpenSafetensors> files;
  std::vector<std::vector<const SafetensorsTensor*>> tensors(4);
  for (int i = 0; i < 4; ++i) {
    const std::string file = dir + "/" + names[i];
    STRATA_ASSIGN_OR_RETURN(auto f, OpenSafetensorsFile(file));
    uint64_t size = 0;
    STRATA_ASSIGN_OR_RETURN(uint64_t hash, FdXxh3(f.fd.get(), file, &size));
    const auto listed = std::find_if(m.files.begin(), m.files.end(),
                                     [&](const ManifestFile& mf) { return mf.name == names[i]; });
    if (size != listed->size_bytes || hash != listed->xxh3) {
      return DataLossError(fmt::format("'{}' changed while it was being verified", file));
    }
    const DType want = i < 3 ? DType::kF32 : o_.precision;
    if (static_cast<int>(f.header.tensors.size()) != n_) {
      return DataLossError(fmt::format("'{}' holds {} tensors, the model has {} blocks", file,
                                       f.header.tensors.size(), n_));
    }
    for (int b = 0; b < n_; ++b) {
      const SafetensorsTensor* t = f.header.Find(model_->block_name(b));
      if (!t || t->dtype != want || t->shape != std::vector<int64_t>{np(b)}) {
        return DataLossError(fmt::format("'{}': tensor '{}' is missing or not {} [{}]", file,
                                         model_->block_name(b), SafetensorsDTypeName(want), np(b)));
      }
      tensors[i].push_back(t);
    }
    files.push_back(std::move(f));
  }

  // Phase 2: stream the validated tensors into the stores, block by block.
  partially_loaded_ = true;
  for (int b = 0; b < n_; ++b) {
    const size_t n = static_cast<size_t>(np(b));
    float *p32, *mm, *vv;
    if (nvme_optim()) {
      p32 = optim_staging_.as<float>();
      mm = reinterpret_cast<float*>(optim_staging_.data() + padded_f32(b));
      vv = reinterpret_cast<float*>(optim_staging_.data() + 2 * padded_f32(b));
    } else {
      p32 = p32_[b].as<float>();
      mm = m_[b].as<float>();
      vv = v_[b].as<float>();
    }
    STRATA_RETURN_IF_ERROR(
        ReadTensorBytes(files[0], *tensors[0][b], 0, std::as_writable_bytes(std::span(p32, n))));
    STRATA_RETURN_IF_ERROR(
        ReadTensorBytes(files[1], *tensors[1][b], 0, std::as_writable_bytes(std::span(mm, n))));
    STRATA_RETURN_IF_ERROR(
        ReadTensorBytes(files[2], *tensors[2][b], 0, std::as_writable_bytes(std::span(vv, n))));
    if (nvme_optim()) STRATA_RETURN_IF_ERROR(StoreOptimState(b));
    STRATA_RETURN_IF_ERROR(h2d_->Synchronize());  // the working home may feed a copy
    STRATA_RETURN_IF_ERROR(
        ReadTensorBytes(files[3], *tensors[3][b], 0, WorkingHome(b).bytes().subspan(0, n * w_)));
    STRATA_RETURN_IF_ERROR(PublishWorkingParams(b));
  }
  STRATA_RETURN_IF_ERROR(h2d_->Synchronize());
  for (auto& s : slots_) s.block = -1;
  step_ = m.engine_steps;
  adam_t_ = m.adam_steps;
  scaler_.Restore(m.loss_scaler.scale, m.loss_scaler.clean_steps, m.loss_scaler.overflows);
  o_.adamw.lr = m.adamw.lr;
  partially_loaded_ = false;
  *trainer = m.trainer;
  return Status::Ok();
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

StatusOr<std::unique_ptr<Engine>> Engine::Create(Model* model, gpu::Device* device,
                                                 const EngineOptions& options) {
  if (!model || !device) return InvalidArgumentError("Engine::Create needs a model and a device");
  STRATA_ASSIGN_OR_RETURN(
      Plan plan, MakePlan(*model, options.precision, options.micro_batch, options.placement));
  auto impl = std::make_unique<Impl>(model, device, options, std::move(plan));
  STRATA_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

const Plan& Engine::plan() const { return impl_->plan(); }
std::string_view Engine::io_backend_name() const { return impl_->io_backend_name(); }
StatusOr<StepResult> Engine::Step(std::span<const MicroBatch> mbs) { return impl_->Step(mbs); }
StatusOr<float> Engine::EvaluateLoss(const MicroBatch& batch, MicroBatchShape shape) {
  return impl_->EvaluateLoss(batch, shape);
}
StatusOr<std::vector<float>> Engine::NextTokenLogits(std::span<const int32_t> tokens) {
  return impl_->NextTokenLogits(tokens);
}
StatusOr<uint64_t> Engine::MasterWeightsXxh3() { return impl_->MasterWeightsXxh3(); }
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

}  // namespace strata::engine
