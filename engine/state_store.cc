#include "engine/state_store.h"

#include <fmt/format.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstring>

#include "base/units.h"
#include "cpu_optim/grad_stats.h"
#include "engine/device_optimizer.h"

namespace strata::engine {
namespace {

std::string ParamsExtent(int b) { return fmt::format("block{}.params", b); }
std::string OptimExtent(int b) { return fmt::format("block{}.optim", b); }
std::string FrozenExtent(int b) { return fmt::format("block{}.frozen", b); }

}  // namespace

StateStore::StateStore(const Model& model, const Plan& plan, StateStoreOptions options)
    : plan_(plan), o_(std::move(options)), n_(model.num_blocks()), w_(SizeOf(o_.precision)) {}

StateStore::~StateStore() {
  if (pipeline_) pipeline_->Drain().IgnoreError();
}

StatusOr<std::unique_ptr<StateStore>> StateStore::Create(const Model& model, const Plan& plan,
                                                         StateStoreOptions options) {
  std::unique_ptr<StateStore> s(new StateStore(model, plan, std::move(options)));
  s->device_state_.resize(s->n_);
  s->block_round_.resize(s->n_);
  s->device_working_.resize(s->n_);
  for (int b = 0; b < s->n_; ++b) {
    s->state_.push_back(LayoutBlockState(model, b, *s->o_.optimizer, &plan.blocks[b].partition));
    s->full_state_.push_back(LayoutBlockState(model, b, *s->o_.optimizer));
  }
  StateRegionsOptions ro;
  ro.nvme = s->nvme_optim();
  ro.swap = s->nvme_params();
  ro.nvme_paths = s->o_.nvme_paths;
  ro.io = s->o_.io;
  ro.io_backend_factory = s->o_.io_backend_factory;
  ro.extent_name = OptimExtent;
  STRATA_ASSIGN_OR_RETURN(s->regions_, StateRegions::Create(std::move(ro)));
  if (s->nvme_params() || s->nvme_optim()) {
    for (int b = 0; b < s->n_; ++b) {
      // A resident block's params load from its pinned home: no extent.
      if (s->nvme_params() && s->trained(b) && !plan.blocks[b].resident) {
        STRATA_RETURN_IF_ERROR(
            s->regions_->swap()->Allocate(ParamsExtent(b), s->home_elems(b) * s->w_));
      }
      if (s->nvme_params() && s->frozen_streamed_from_nvme(b)) {
        STRATA_RETURN_IF_ERROR(s->regions_->swap()->Allocate(FrozenExtent(b), s->frozen_bytes(b)));
      }
      if (s->nvme_optim()) {
        STRATA_RETURN_IF_ERROR(s->regions_
                                   ->AddUnit(s->state_[b].region_bytes,
                                             !plan.blocks[b].optimizer_on_device && s->trained(b))
                                   .status());
      }
    }
  }
  return s;
}

uint64_t StateStore::pinned_frozen_bytes() const {
  uint64_t total = 0;
  for (int b = 0; b < n_; ++b) {
    if (frozen_elems(b) > 0 && !frozen_streamed_from_nvme(b)) {
      total += AlignUp(io::SwapStore::PaddedSize(frozen_bytes(b)), 4096);
    }
  }
  return total;
}

Status StateStore::AllocateMemory(gpu::Device* device) {
  home_.resize(n_);
  frozen_home_.resize(n_);
  frozen_owned_.resize(n_);
  uint64_t shared_offset = 0;
  for (int b = 0; b < n_; ++b) {
    if (frozen_elems(b) > 0 && !frozen_streamed_from_nvme(b)) {
      const uint64_t bytes = io::SwapStore::PaddedSize(frozen_bytes(b));
      if (shared_frozen_ != nullptr) {
        frozen_home_[b] = shared_frozen_->span().subspan(shared_offset, bytes);
        shared_offset += AlignUp(bytes, 4096);
      } else {
        STRATA_ASSIGN_OR_RETURN(frozen_owned_[b], device->AllocatePinned(bytes, "frozen params"));
        frozen_home_[b] = frozen_owned_[b].span();
      }
    }
    if (!trained(b)) continue;
    if (!nvme_params() || plan_.blocks[b].resident) {
      STRATA_ASSIGN_OR_RETURN(
          home_[b],
          device->AllocatePinned(io::SwapStore::PaddedSize(home_elems(b) * w_), "working params"));
      // A partition's padding past the block's end goes to the device as zeros.
      if (o_.data_parallel) std::memset(home_[b].data(), 0, home_[b].span().size_bytes);
    }
  }
  opt_state_bytes_ = 0;
  if (nvme_optim()) {
    for (int b = 0; b < n_; ++b) {
      if (!on_device(b)) opt_state_bytes_ = std::max(opt_state_bytes_, state_[b].region_bytes);
    }
  }
  uint64_t device_region = 0;
  for (int b = 0; b < n_ && !o_.inference_only; ++b) {
    if (!on_device(b)) continue;
    if (device_state_[b].size_bytes < state_[b].region_bytes ||
        device_working_[b].size_bytes < static_cast<uint64_t>(own(b)) * w_) {
      return InvalidArgumentError(fmt::format(
          "StateStore: block {} is optimized on the device but its device regions are missing or "
          "short",
          b));
    }
    device_region = std::max(device_region, state_[b].region_bytes);
  }
  if (device_region > 0) {
    STRATA_ASSIGN_OR_RETURN(
        device_staging_, device->AllocatePinned(device_region, "device optimizer state staging"));
    STRATA_ASSIGN_OR_RETURN(copy_, device->CreateStream("optimizer state copy"));
  }
  std::vector<std::span<std::byte>> views;
  if (plan_.optimizer_buffer_bytes > 0) {
    for (int i = 0; i < plan_.optimizer_buffers; ++i) {
      STRATA_ASSIGN_OR_RETURN(auto buf, device->AllocatePinned(plan_.optimizer_buffer_bytes,
                                                               "optimizer pipeline buffer"));
      views.push_back(buf.span().bytes());
      opt_buf_.push_back(std::move(buf));
    }
  }
  regions_->SetPipelineBuffers(std::move(views));
  regions_->SetTrace(trace_, read_track_);
  // Host homes: each block's state region (none for device-optimized blocks: their state lives
  // on the device).
  for (int b = 0; b < n_ && !o_.inference_only && !nvme_optim(); ++b) {
    STRATA_RETURN_IF_ERROR(
        regions_->AddUnit(state_[b].region_bytes, !on_device(b) && trained(b)).status());
  }
  if (o_.speculate) {
    // The backup area, as the plan sized it (updates that do not fit wait for the verdict).
    speculation_ = std::make_unique<UpdateSpeculation>(n_, plan_.speculation_backup_bytes);
    STRATA_RETURN_IF_ERROR(speculation_->Allocate());
  }
  OptimizerPipeline::Stages stages;
  if (nvme_optim()) stages.read = [this](int b, int i) { return regions_->Read(b, i); };
  stages.update = [this](int b, int i) { return UpdateBlock(b, i); };
  if (regions_->swap()) {
    stages.write = [this](int b, int i) {
      // A speculative block's write waits for the verdict, and a rolled-back one is dropped:
      // the extents keep the old state.
      if (speculation_ && !speculation_->BeforeWrite(b)) return Status::Ok();
      return WriteBack(b, i);
    };
  }
  pipeline_ = std::make_unique<OptimizerPipeline>(
      n_, std::max<int>(1, static_cast<int>(opt_buf_.size())), std::move(stages));
  return Status::Ok();
}

Status StateStore::InitializeFrozen(Model& model, uint64_t seed) {
  int64_t max_frozen = 0;
  uint64_t max_bytes = 0;
  for (int b = 0; b < n_; ++b) {
    max_frozen = std::max(max_frozen, frozen_elems(b));
    max_bytes = std::max(max_bytes, frozen_bytes(b));
  }
  if (max_frozen == 0) return Status::Ok();
  // Through one fp32 buffer (not for encoded chunks: the model writes their bytes), and for an
  // NVMe home one pinned buffer of the largest chunk.
  const bool encoded = model.frozen_chunk_encoded();
  AlignedBuffer f32, staging;
  if (!encoded) {
    STRATA_ASSIGN_OR_RETURN(f32, AlignedBuffer::Allocate(max_frozen * 4, 64));
  }
  for (int b = 0; b < n_; ++b) {
    const int64_t elems = frozen_elems(b);
    if (elems == 0) continue;
    STRATA_RETURN_IF_ERROR(InitCancelPoint("the frozen base", b));
    const uint64_t bytes = frozen_bytes(b);
    const auto fill = [&](std::byte* out) -> Status {
      if (encoded) return model.InitFrozenChunk(b, seed, o_.precision, {out, bytes});
      const std::span<float> p32(f32.as<float>(), elems);
      STRATA_RETURN_IF_ERROR(model.InitFrozenParams(b, seed, p32));
      return cpu_optim::ConvertFromF32(p32.data(), out, o_.precision, elems);
    };
    if (!frozen_streamed_from_nvme(b)) {
      // A home shared by this machine's ranks is written by one of them.
      if (shared_frozen_ == nullptr || shared_frozen_->writer()) {
        STRATA_RETURN_IF_ERROR(fill(frozen_home_[b].data));
      }
      continue;
    }
    const uint64_t padded = io::SwapStore::PaddedSize(bytes);
    if (staging.size_bytes() < padded) {
      STRATA_ASSIGN_OR_RETURN(staging, AlignedBuffer::Allocate(io::SwapStore::PaddedSize(max_bytes),
                                                               io::SwapStore::kAlignment));
    }
    std::memset(staging.data(), 0, padded);
    STRATA_RETURN_IF_ERROR(fill(staging.data()));
    STRATA_RETURN_IF_ERROR(regions_->swap()->Write(
        FrozenExtent(b), std::span<const std::byte>(staging.data(), padded)));
  }
  return shared_frozen_ != nullptr ? shared_frozen_->Publish() : Status::Ok();
}

Status StateStore::ReadFrozen(int b, gpu::PinnedSpan staging) {
  return regions_->swap()->Read(
      FrozenExtent(b), staging.bytes().subspan(0, io::SwapStore::PaddedSize(frozen_bytes(b))));
}

Status StateStore::InitCancelPoint(std::string_view what, int b) const {
  if (!o_.cancel_requested || !o_.cancel_requested()) return Status::Ok();
  return CancelledError(
      fmt::format("cancelled while initialising {}, block {} of {}", what, b + 1, n_));
}

Status StateStore::Initialize(Model& model, uint64_t seed) {
  STRATA_RETURN_IF_ERROR(InitializeFrozen(model, seed));
  const auto np = [&](int b) { return model.block_num_params(b); };
  if (o_.inference_only) {
    // Working params only, through one block-sized fp32 buffer.
    STRATA_ASSIGN_OR_RETURN(auto f32, AlignedBuffer::Allocate(plan_.max_block_params * 4, 64));
    for (int b = 0; b < n_; ++b) {
      if (!trained(b)) continue;
      STRATA_RETURN_IF_ERROR(InitCancelPoint("the working params", b));
      const std::span<float> p32(f32.as<float>(), np(b));
      STRATA_RETURN_IF_ERROR(model.InitParams(b, seed, p32));
      STRATA_RETURN_IF_ERROR(
          cpu_optim::ConvertFromF32(p32.data(), WorkingHome(b, 0).data, o_.precision, np(b)));
    }
    return Status::Ok();
  }
  // Initial master weights, the optimizer's initial state, working params in their homes, in
  // waves of blocks initialised in parallel: every block has its own sampler (seed, block), so
  // the values do not depend on the order or the thread count. With a home on NVMe a wave is as
  // many blocks as there are pipeline buffers (block w of a wave goes through buffer w) and the
  // writes follow the wave; in host memory every block has its own region. A rank initialises
  // each whole block (the same on every rank) and keeps its partition.
  const bool buffered = nvme_optim() || nvme_params();
  const int threads = std::max(1, tbb::this_task_arena::max_concurrency());
  const int wave = buffered ? std::max<int>(1, static_cast<int>(opt_buf_.size()))
                            : (o_.data_parallel ? threads : n_);
  std::vector<AlignedBuffer> whole(o_.data_parallel ? wave : 0);
  for (AlignedBuffer& w : whole) {
    STRATA_ASSIGN_OR_RETURN(w, AlignedBuffer::Allocate(plan_.max_block_params * 4, 64));
  }
  const int64_t total_params = model.num_params();
  int64_t done_params = 0;
  int done_blocks = 0;
  if (o_.init_progress) o_.init_progress(0, n_, 0, total_params);  // allocated and pinned
  for (int first = 0; first < n_; first += wave) {
    STRATA_RETURN_IF_ERROR(InitCancelPoint("the master weights and optimizer state", first));
    const int last = std::min(n_, first + wave);
    std::vector<Status> status(static_cast<size_t>(last - first));
    tbb::parallel_for(first, last, [&](int b) {
      const int slot = b - first;
      const int buffer = buffered ? slot : 0;
      if (on_device(b) || !trained(b)) return;  // device: after the waves, through the staging
      status[static_cast<size_t>(slot)] =
          InitBlock(model, seed, b, buffer, o_.data_parallel ? &whole[slot] : nullptr);
    });
    for (int b = first; b < last; ++b) {
      if (on_device(b) || !trained(b)) continue;
      STRATA_RETURN_IF_ERROR(status[static_cast<size_t>(b - first)]);
      STRATA_RETURN_IF_ERROR(WriteBack(b, buffered ? b - first : 0));
      done_params += np(b);
      if (o_.init_progress) o_.init_progress(++done_blocks, n_, done_params, total_params);
    }
  }
  for (int b = 0; b < n_; ++b) {
    if (!on_device(b)) continue;
    STRATA_RETURN_IF_ERROR(InitCancelPoint("the master weights and optimizer state", b));
    STRATA_RETURN_IF_ERROR(InitBlock(model, seed, b, 0, o_.data_parallel ? &whole[0] : nullptr));
    STRATA_RETURN_IF_ERROR(WriteBack(b, 0));
    done_params += np(b);
    if (o_.init_progress) o_.init_progress(++done_blocks, n_, done_params, total_params);
  }
  return Status::Ok();
}

// Block b's initial master weights (this rank's partition of the whole block, sampled into
// `whole` when data parallel), optimizer state and working params, into Region(b, buffer) and
// WorkingHome(b, buffer).
Status StateStore::InitBlock(Model& model, uint64_t seed, int b, int buffer, AlignedBuffer* whole) {
  std::byte* region = Region(b, buffer);
  std::memset(region, 0, state_[b].region_bytes);  // padding included: no stale bytes on NVMe
  for (size_t k = 0; k < state_[b].sections.size(); ++k) {
    cpu_optim::InitializeState(state_[b].sections[k], Section(b, buffer, k));
  }
  float* p32 = Master(b, buffer);
  const int64_t np = model.block_num_params(b);
  if (whole != nullptr) {
    STRATA_RETURN_IF_ERROR(model.InitParams(b, seed, std::span<float>(whole->as<float>(), np)));
    std::memcpy(p32, whole->as<float>() + plan_.blocks[b].partition.offset_elems, own(b) * 4);
  } else {
    STRATA_RETURN_IF_ERROR(model.InitParams(b, seed, std::span<float>(p32, np)));
  }
  return cpu_optim::ConvertFromF32(p32, WorkingHome(b, buffer).data, o_.precision, own(b));
}

std::byte* StateStore::Region(int b, int i) {
  if (on_device(b)) return device_staging_.data();
  return regions_->Region(b, i);
}

gpu::PinnedSpan StateStore::WorkingHome(int b, int i) {
  if (!nvme_params() || plan_.blocks[b].resident) return home_[b].span();
  return opt_buf_[i].span().subspan(opt_state_bytes_,
                                    plan_.optimizer_buffer_bytes - opt_state_bytes_);
}

StatusOr<std::byte*> StateStore::Load(int b, bool read) {
  if (!trained(b)) return Region(b, 0);  // a wholly frozen block: nothing to read
  if (on_device(b)) {
    if (read) {
      const gpu::PinnedSpan staging = device_staging_.span().subspan(0, state_[b].region_bytes);
      STRATA_RETURN_IF_ERROR(copy_->CopyD2H(staging, device_state_[b]));
      STRATA_RETURN_IF_ERROR(copy_->Synchronize());
    }
    return Region(b, 0);
  }
  return regions_->Load(b, read);
}

Status StateStore::EnqueueDeviceUpdate(int b, gpu::Stream& stream, gpu::DeviceSpan grad,
                                       DType grad_dtype) {
  if (!on_device(b)) {
    return FailedPreconditionError(
        fmt::format("StateStore: block {}'s optimizer does not run on the device", b));
  }
  if (own(b) == 0) return Status::Ok();
  const BlockState& st = state_[b];
  DeviceUpdateBuffers u;
  u.num_elems = own(b);
  u.master = device_state_[b].subspan(0, static_cast<size_t>(own(b)) * 4);
  for (size_t k = 0; k < st.sections.size(); ++k) {
    u.state.push_back(device_state_[b].subspan(st.offsets[k], st.sections[k].size_bytes()));
  }
  u.grad = grad;
  u.grad_dtype = grad_dtype;
  // This rank's partition of the resident copy (the whole block with one rank); with data
  // parallelism the parameter cache then all-gathers the block in place.
  u.working =
      device_working_[b].subspan(static_cast<size_t>(plan_.blocks[b].partition.offset_elems) * w_,
                                 static_cast<size_t>(own(b)) * w_);
  u.working_dtype = o_.precision;
  const std::span<const cpu_optim::ElemRange> no_decay = NoDecay(b);
  u.no_decay.assign(no_decay.begin(), no_decay.end());
  return engine::EnqueueDeviceUpdate(stream, BlockOptimizer(round_.optimizer, st), round_.step, u);
}

std::array<std::span<std::byte>, 2> StateStore::SpeculatedBytes(int b, int buffer) {
  std::array<std::span<std::byte>, 2> parts;
  if (!nvme_optim()) parts[0] = {Region(b, buffer), state_[b].region_bytes};
  if (!nvme_params() || plan_.blocks[b].resident) {
    parts[1] = home_[b].span().bytes().subspan(0, static_cast<size_t>(own(b)) * w_);
  }
  return parts;
}

std::span<const cpu_optim::ElemRange> StateStore::NoDecay(int b) const {
  if (o_.decay_norms_and_biases) return {};
  return state_[b].no_decay;
}

uint64_t StateStore::SpeculationBackupBytes(int b) const {
  return engine::SpeculationBackupBytes(plan_, b, state_[b].region_bytes);
}

namespace {

// A large memcpy on the caller's oneTBB arena, in 1 MiB pieces.
void ParallelCopy(std::byte* dst, const std::byte* src, uint64_t bytes) {
  constexpr uint64_t kPiece = 1 << 20;
  tbb::parallel_for(uint64_t{0}, (bytes + kPiece - 1) / kPiece, [&](uint64_t k) {
    const uint64_t begin = k * kPiece;
    std::memcpy(dst + begin, src + begin, std::min(kPiece, bytes - begin));
  });
}

}  // namespace

void StateStore::StartSpeculativeRound(const cpu_optim::AnyOptimizer& optimizer,
                                       cpu_optim::OptimStep step) {
  StartRound(optimizer, step);
  speculation_->Begin();
}

StatusOr<int64_t> StateStore::EndSpeculativeRound(bool stands, bool* rolled_back) {
  if (o_.finish_speculation_before_verdict) {
    // With a write stage the first num_buffers submissions only can run: the next one's read waits
    // for a buffer whose write waits for the verdict.
    std::vector<int> order = speculation_->SubmissionOrder();
    if (regions_->swap()) order.resize(std::min<size_t>(order.size(), pipeline_->num_buffers()));
    for (int b : order) STRATA_RETURN_IF_ERROR(pipeline_->WaitUpdated(b));
  }
  speculation_->Resolve(stands);
  int64_t ran = 0;
  for (int b : speculation_->UpdatedBeforeVerdict()) ran += own(b);
  *rolled_back = !stands && ran > 0;
  if (stands) {
    params_during_backward_ += ran;
    return ran;
  }
  rollback_steps_ += *rolled_back ? 1 : 0;
  STRATA_RETURN_IF_ERROR(Drain());
  speculation_->ForEachBackup([this](int b, const std::byte* backup) {
    trace::ScopedTraceEvent t(trace_, update_track_, "restore (rollback)",
                              trace::Category::kCpuOptimizer);
    for (const std::span<std::byte> part : SpeculatedBytes(b, 0)) {
      ParallelCopy(part.data(), backup, part.size());
      backup += part.size();
    }
  });
  return int64_t{0};
}

Status StateStore::UpdateBlock(int b, int i) {
  if (speculation_) {
    std::byte* backup = nullptr;
    switch (speculation_->BeforeUpdate(b, SpeculationBackupBytes(b), &backup)) {
      case UpdateSpeculation::Action::kSkip:
        return Status::Ok();  // rolled back before it ran: redone in the next round
      case UpdateSpeculation::Action::kUpdateWithBackup: {
        trace::ScopedTraceEvent t(trace_, update_track_, "backup (speculative update)",
                                  trace::Category::kCpuOptimizer);
        for (const std::span<std::byte> part : SpeculatedBytes(b, i)) {
          ParallelCopy(backup, part.data(), part.size());
          backup += part.size();
        }
        break;
      }
      case UpdateSpeculation::Action::kUpdate:
        break;
    }
  }
  trace::ScopedTraceEvent t(trace_, update_track_, "optimizer update",
                            trace::Category::kCpuOptimizer);
  if (own(b) == 0) return Status::Ok();  // a tiny block's padding-only partition
  std::vector<std::span<std::byte>> sections;
  for (size_t k = 0; k < state_[b].sections.size(); ++k) sections.push_back(Section(b, i, k));
  const RoundParams& round = block_round_[b];
  return cpu_optim::UpdateState(
      BlockOptimizer(round.optimizer, state_[b]), round.step, state_[b].shapes,
      std::span<float>(Master(b, i), own(b)), sections, o_.gradient(b),
      cpu_optim::CopyOut{WorkingHome(b, i).data, o_.precision}, NoDecay(b));
}

Status StateStore::WriteBack(int b, int i) {
  if (!trained(b)) return Status::Ok();  // a wholly frozen block has no state
  if (on_device(b)) {
    // The staging buffer's region to the device (Initialize, a checkpoint's restore); the block
    // is resident, so its working params have no NVMe extent.
    STRATA_RETURN_IF_ERROR(copy_->CopyH2D(
        device_state_[b], device_staging_.span().subspan(0, state_[b].region_bytes)));
    return copy_->Synchronize();
  }
  if (!regions_->swap()) return Status::Ok();
  trace::ScopedTraceEvent t(trace_, write_track_, "write optimizer state + params",
                            trace::Category::kNvmeWrite);
  STRATA_RETURN_IF_ERROR(regions_->Write(b, i));
  if (nvme_params() && !plan_.blocks[b].resident) {
    STRATA_RETURN_IF_ERROR(regions_->swap()->Write(
        ParamsExtent(b),
        WorkingHome(b, i).bytes().subspan(0, io::SwapStore::PaddedSize(home_elems(b) * w_))));
  }
  return Status::Ok();
}

StatusOr<const std::byte*> StateStore::WorkingParamsBytes(int b) {
  const gpu::PinnedSpan home = WorkingHome(b, 0);
  if (on_device(b) && !o_.inference_only) {
    // The device updates the resident copy only: refresh the home from it.
    const size_t bytes = static_cast<size_t>(own(b)) * w_;
    if (bytes == 0) return home.data;
    STRATA_RETURN_IF_ERROR(copy_->CopyD2H(
        home.subspan(0, bytes),
        device_working_[b].subspan(static_cast<size_t>(plan_.blocks[b].partition.offset_elems) * w_,
                                   bytes)));
    STRATA_RETURN_IF_ERROR(copy_->Synchronize());
    return home.data;
  }
  if (!nvme_params() || plan_.blocks[b].resident) return home.data;
  STRATA_RETURN_IF_ERROR(regions_->swap()->Read(
      ParamsExtent(b), home.bytes().subspan(0, io::SwapStore::PaddedSize(home_elems(b) * w_))));
  return home.data;
}

Status StateStore::ReadParams(int b, gpu::PinnedSpan staging) {
  return regions_->swap()->Read(
      ParamsExtent(b), staging.bytes().subspan(0, io::SwapStore::PaddedSize(home_elems(b) * w_)));
}

}  // namespace strata::engine
