#include "engine/grad_streamer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/units.h"
#include "engine/device_optimizer.h"

namespace strata::engine {

void GradStreamer::BucketPool::Reset(int n) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.clear();
  for (int i = 0; i < n; ++i) free_.push_back(i);
}

int GradStreamer::BucketPool::Acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !free_.empty(); });
  const int i = free_.front();
  free_.erase(free_.begin());
  return i;
}

void GradStreamer::BucketPool::Release(int i) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(i);
  }
  cv_.notify_one();
}

GradStreamer::GradStreamer(const Model& model, const Plan& plan, gpu::Stream* compute,
                           gpu::Stream* d2h, GradStreamerOptions options)
    : model_(model),
      plan_(plan),
      o_(std::move(options)),
      w_(SizeOf(o_.precision)),
      compute_(compute),
      d2h_(d2h) {}

GradStreamer::~GradStreamer() {
  if (folder_) folder_->Drain().IgnoreError();
  if (reduce_) reduce_->Synchronize().IgnoreError();
}

StatusOr<std::unique_ptr<GradStreamer>> GradStreamer::Create(
    const Model& model, const Plan& plan, gpu::Device* device, gpu::Stream* compute,
    gpu::Stream* d2h, gpu::DeviceSpan dbuckets, gpu::DeviceSpan reduce_region,
    std::span<const gpu::DeviceSpan> device_grads, GradStreamerOptions options,
    gpu::DeviceSpan accumulators) {
  std::unique_ptr<GradStreamer> g(new GradStreamer(model, plan, compute, d2h, std::move(options)));
  g->device_ = device;
  const GradStreamerOptions& o = g->o_;
  const int n = model.num_blocks();
  for (int b = 0; b < n; ++b) {
    g->grad16_.push_back(!o.fp32_host_grads && o.precision != DType::kF32 &&
                         GradInWorkingPrecision(model, b, o.grad_accum_steps, g->dp()));
  }
  auto event = [&]() { return device->CreateEvent(); };
  if (g->dp()) {
    STRATA_ASSIGN_OR_RETURN(g->reduce_, device->CreateStream("reduce-scatter"));
    STRATA_ASSIGN_OR_RETURN(g->grad_comm_, o.comm->Duplicate());
    for (int j = 0; j < 2; ++j) {
      STRATA_ASSIGN_OR_RETURN(g->reduced_[j], event());
      STRATA_ASSIGN_OR_RETURN(g->part_free_[j], event());
    }
  }
  const uint64_t dbucket_bytes = dbuckets.size_bytes / 2;
  for (int j = 0; j < 2; ++j) {
    g->dbucket_[j] = dbuckets.subspan(j * dbucket_bytes, dbucket_bytes);
    STRATA_ASSIGN_OR_RETURN(g->dgrad_ready_[j], event());
    STRATA_ASSIGN_OR_RETURN(g->dbucket_free_[j], event());
  }
  g->acc_slot_.assign(n, 0);
  if (plan.device_grad_accumulators) {
    const uint64_t acc_bytes = accumulators.size_bytes / 2;
    if (acc_bytes < static_cast<uint64_t>(plan.max_block_params) * 4) {
      return InvalidArgumentError(
          fmt::format("GradStreamer: the gradient accumulators region has {} bytes, needs 2 x {}",
                      accumulators.size_bytes, plan.max_block_params * 4));
    }
    for (int s = 0; s < 2; ++s) {
      g->dacc_[s] = accumulators.subspan(s * acc_bytes, acc_bytes);
      STRATA_ASSIGN_OR_RETURN(g->acc_ready_[s], event());
      STRATA_ASSIGN_OR_RETURN(g->acc_free_[s], event());
    }
  }
  if (plan.data_parallel) {
    int64_t max_padded = 0, max_part = 0;
    for (int b = 0; b < n; ++b) {
      max_padded = std::max(max_padded, g->dev_elems(b));
      max_part = std::max(max_part, g->home_elems(b));
    }
    const uint64_t full =
        AlignUp(static_cast<uint64_t>(max_padded) * 4, gpu::DeviceArena::kAlignment);
    const uint64_t partb =
        AlignUp(static_cast<uint64_t>(max_part) * 4, gpu::DeviceArena::kAlignment);
    g->red_full_ = reduce_region.subspan(0, full);
    for (int j = 0; j < 2; ++j) g->red_part_[j] = reduce_region.subspan(full + j * partb, partb);
  }
  for (int i = 0; i < plan.host_grad_buckets; ++i) {
    STRATA_ASSIGN_OR_RETURN(auto bucket,
                            device->AllocatePinned(plan.grad_bucket_bytes, "gradient bucket"));
    g->hbucket_.push_back(std::move(bucket));
    STRATA_ASSIGN_OR_RETURN(auto e, event());
    g->landed_.push_back(std::move(e));
  }
  g->pool_.Reset(plan.host_grad_buckets);
  for (int b = 0; b < n && !o.inference_only; ++b) {
    // A block optimized on the device has no host gradient.
    const uint64_t bytes = plan.blocks[b].optimizer_on_device
                               ? 64
                               : std::max<uint64_t>(64, g->own(b) * SizeOf(g->grad_dtype(b)));
    STRATA_ASSIGN_OR_RETURN(auto acc, AlignedBuffer::Allocate(bytes, 64));
    g->accum_.push_back(std::move(acc));
  }
  // Blocks optimized on the device: the gradient region is [gradient | statistics record].
  g->on_device_.assign(n, false);
  g->dgrad16_.assign(n, false);
  g->dgrad_.resize(n);
  g->dstats_.resize(n);
  g->dstats_ready_.resize(n);
  g->stats_offset_.assign(n, 0);
  uint64_t stats_bytes = 0;
  for (int b = 0; b < n && !o.inference_only; ++b) {
    if (!plan.blocks[b].optimizer_on_device) continue;
    if (static_cast<int>(device_grads.size()) <= b || device_grads[b].size_bytes == 0) {
      return InvalidArgumentError(
          fmt::format("GradStreamer: block {} is optimized on the device but has no gradient "
                      "region",
                      b));
    }
    g->on_device_[b] = true;
    // Data parallel: this rank's reduce-scattered fp32 partition (own(b) == np(b) otherwise).
    g->dgrad16_[b] = GradInWorkingPrecision(model, b, o.grad_accum_steps, g->dp());
    const uint64_t bytes = static_cast<uint64_t>(g->own(b)) * (g->dgrad16_[b] ? g->w_ : 4);
    const uint64_t record = DeviceGradStatsBytes(g->own(b));
    if (device_grads[b].size_bytes < bytes + record) {
      return InvalidArgumentError(
          fmt::format("GradStreamer: block {}'s device gradient region has {} bytes, needs {}", b,
                      device_grads[b].size_bytes, bytes + record));
    }
    g->dgrad_[b] = device_grads[b].subspan(0, bytes);
    g->dstats_[b] = device_grads[b].subspan(device_grads[b].size_bytes - record, record);
    STRATA_ASSIGN_OR_RETURN(g->dstats_ready_[b], event());
    g->stats_offset_[b] = stats_bytes;
    stats_bytes += AlignUp(record, 64);
  }
  if (stats_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(g->stats_pinned_,
                            device->AllocatePinned(stats_bytes, "device gradient statistics"));
  }
  g->folder_ = std::make_unique<WorkQueue>("gradient fold");
  return g;
}

StatusOr<TensorRef> GradStreamer::NextBucket(int chunk, int /*k*/) {
  // A device-optimized block's only contribution goes straight into its gradient region (the
  // previous step's update, which read it, ran before on the same compute stream).
  if (on_device_[chunk] && dgrad16_[chunk]) {
    return TensorRef(dgrad_[chunk].data, o_.precision, np(chunk));
  }
  // The block's backward writes its gradients into device bucket j once the D2H that last read
  // j is done (buckets are handed out and streamed in the same order).
  const int j = (next_dbucket_ + handed_) % 2;
  ++handed_;
  STRATA_RETURN_IF_ERROR(compute_->Wait(*dbucket_free_[j]));
  return TensorRef(dbucket_[j].data, o_.precision, np(chunk));
}

Status GradStreamer::ReduceScatter(int b, int j) {
  STRATA_RETURN_IF_ERROR(reduce_->Wait(*dgrad_ready_[j]));
  STRATA_RETURN_IF_ERROR(reduce_->Wait(*part_free_[j]));
  STRATA_RETURN_IF_ERROR(
      reduce_->Convert(red_full_, DType::kF32, dbucket_[j], o_.precision, np(b)));
  STRATA_RETURN_IF_ERROR(reduce_->Record(*dbucket_free_[j]));
  return grad_comm_->ReduceScatter(red_full_.subspan(0, dev_elems(b) * 4), red_part_[j],
                                   home_elems(b), DType::kF32, *reduce_);
}

Status GradStreamer::StreamOnDevice(int b, bool overwrite, bool last) {
  // The stream the block's gradient is complete on: compute, or with data parallelism the
  // reduce-scatter stream, which adds this rank's reduced fp32 partition into the accumulator.
  gpu::Stream* on = compute_;
  if (dp()) {
    const int j = TakeStreamedBucket();
    on = reduce_.get();
    STRATA_RETURN_IF_ERROR(compute_->Record(*dgrad_ready_[j]));
    STRATA_RETURN_IF_ERROR(ReduceScatter(b, j));
    STRATA_RETURN_IF_ERROR(EnqueueDeviceGradAccumulate(*reduce_, dgrad_[b], red_part_[j],
                                                       DType::kF32, own(b), overwrite));
    STRATA_RETURN_IF_ERROR(reduce_->Record(*part_free_[j]));
  } else if (!dgrad16_[b]) {
    // Add device bucket j into the block's fp32 accumulator on the compute stream; the bucket is
    // free once that is done.
    STRATA_RETURN_IF_ERROR(AddBucketOnCompute(dgrad_[b], own(b), overwrite));
  } else {
    STRATA_CHECK(overwrite && last);
  }
  if (!last) return Status::Ok();
  // The statistics of the complete gradient, computed and copied on that stream, merged by the
  // fold worker in the order of the host blocks' folds.
  STRATA_RETURN_IF_ERROR(
      EnqueueDeviceGradStats(*on, dgrad_[b], device_grad_dtype(b), own(b), 1.0f, dstats_[b]));
  STRATA_RETURN_IF_ERROR(on->CopyD2H(
      stats_pinned_.span().subspan(stats_offset_[b], dstats_[b].size_bytes), dstats_[b]));
  STRATA_RETURN_IF_ERROR(on->Record(*dstats_ready_[b]));
  folder_->Submit([=, this]() -> Status {
    MergeDeviceStats(b);
    return Status::Ok();
  });
  if (!o_.overlap) {
    if (dp()) STRATA_RETURN_IF_ERROR(reduce_->Synchronize());
    STRATA_RETURN_IF_ERROR(folder_->Drain());
    STRATA_RETURN_IF_ERROR(FoldError());
  }
  return Status::Ok();
}

void GradStreamer::MergeDeviceStats(int b) {
  Status s = FoldError();
  if (s.ok()) s = dstats_ready_[b]->Synchronize();
  if (s.ok()) {
    const StatusOr<cpu_optim::GradStats> stats = DecodeDeviceGradStats(
        stats_pinned_.span().bytes().subspan(stats_offset_[b], dstats_[b].size_bytes));
    if (stats.ok()) {
      cpu_optim::Merge(stats_, *stats);
    } else {
      s = stats.status();
    }
  }
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(fold_mu_);
    if (fold_error_.ok()) fold_error_ = std::move(s);
  }
}

Status GradStreamer::Stream(int b, bool overwrite, bool last) {
  if (on_device_[b]) return StreamOnDevice(b, overwrite, last);
  // The gradients the backward wrote into device bucket j go D2H into a free pinned bucket on
  // the D2H stream, folded by the CPU worker.
  const int j = TakeStreamedBucket();
  STRATA_RETURN_IF_ERROR(compute_->Record(*dgrad_ready_[j]));
  // Blocks this (driving) thread only when every pinned bucket is still being folded.
  const int i = pool_.Acquire();
  if (dp()) {
    // Data parallel: widen the bucket to fp32 and reduce-scatter it on the reduce-scatter stream
    // (the sum over ranks in fp32, overlapped with the next block's backward); only this rank's
    // partition goes D2H. Issued by this thread alone: the same order on every rank. The padding
    // past the block's end holds stale values and reduces into elements nobody reads.
    STRATA_RETURN_IF_ERROR(ReduceScatter(b, j));
    STRATA_RETURN_IF_ERROR(reduce_->Record(*reduced_[j]));
    STRATA_RETURN_IF_ERROR(d2h_->Wait(*reduced_[j]));
    STRATA_RETURN_IF_ERROR(d2h_->CopyD2H(hbucket_[i].span(), red_part_[j].subspan(0, own(b) * 4)));
    grad_bytes_d2h_ += own(b) * 4;
    STRATA_RETURN_IF_ERROR(d2h_->Record(*landed_[i]));
    STRATA_RETURN_IF_ERROR(d2h_->Record(*part_free_[j]));
  } else {
    STRATA_RETURN_IF_ERROR(d2h_->Wait(*dgrad_ready_[j]));
    STRATA_RETURN_IF_ERROR(d2h_->CopyD2H(hbucket_[i].span(), dbucket_[j].subspan(0, np(b) * w_)));
    grad_bytes_d2h_ += np(b) * w_;
    STRATA_RETURN_IF_ERROR(d2h_->Record(*landed_[i]));
    STRATA_RETURN_IF_ERROR(d2h_->Record(*dbucket_free_[j]));
  }
  const DType dtype = dp() ? DType::kF32 : o_.precision;
  return HandToFold(b, i, dtype, overwrite, last);
}

Status GradStreamer::AccumulateOnDevice(int b, bool first) {
  STRATA_CHECK(plan_.device_grad_accumulators && !on_device_[b]);
  if (first) {
    // A free accumulator: its previous sum has been copied out.
    acc_slot_[b] = next_acc_;
    next_acc_ ^= 1;
    STRATA_RETURN_IF_ERROR(compute_->Wait(*acc_free_[acc_slot_[b]]));
  }
  STRATA_RETURN_IF_ERROR(AddBucketOnCompute(dacc_[acc_slot_[b]], np(b), first));
  if (!o_.overlap) return compute_->Synchronize();
  return Status::Ok();
}

Status GradStreamer::StreamAccumulated(int b, bool overwrite, bool last) {
  STRATA_CHECK(plan_.device_grad_accumulators && !on_device_[b]);
  const int s = acc_slot_[b];
  STRATA_RETURN_IF_ERROR(compute_->Record(*acc_ready_[s]));
  const int i = pool_.Acquire();
  STRATA_RETURN_IF_ERROR(d2h_->Wait(*acc_ready_[s]));
  STRATA_RETURN_IF_ERROR(d2h_->CopyD2H(hbucket_[i].span(), dacc_[s].subspan(0, np(b) * 4)));
  grad_bytes_d2h_ += np(b) * 4;
  STRATA_RETURN_IF_ERROR(d2h_->Record(*landed_[i]));
  STRATA_RETURN_IF_ERROR(d2h_->Record(*acc_free_[s]));
  return HandToFold(b, i, DType::kF32, overwrite, last);
}

int GradStreamer::TakeStreamedBucket() {
  const int j = next_dbucket_;
  next_dbucket_ ^= 1;
  --handed_;
  return j;
}

Status GradStreamer::AddBucketOnCompute(gpu::DeviceSpan acc, int64_t elems, bool overwrite) {
  const int j = TakeStreamedBucket();
  STRATA_RETURN_IF_ERROR(EnqueueDeviceGradAccumulate(*compute_, acc.subspan(0, elems * 4),
                                                     dbucket_[j], o_.precision, elems, overwrite));
  return compute_->Record(*dbucket_free_[j]);
}

Status GradStreamer::HandToFold(int b, int bucket, DType dtype, bool overwrite, bool last) {
  folder_->Submit([=, this]() -> Status {
    Fold(b, bucket, dtype, overwrite, last);
    return Status::Ok();
  });
  if (o_.overlap) return Status::Ok();
  if (dp()) STRATA_RETURN_IF_ERROR(reduce_->Synchronize());
  STRATA_RETURN_IF_ERROR(d2h_->Synchronize());
  STRATA_RETURN_IF_ERROR(folder_->Drain());
  return FoldError();
}

Status GradStreamer::FoldError() {
  std::lock_guard<std::mutex> lock(fold_mu_);
  return fold_error_;
}

// Every bucket still goes back to the pool after an error, so the driving thread cannot wait
// forever for one.
void GradStreamer::Fold(int b, int bucket, DType dtype, bool overwrite, bool last) {
  Status s = FoldError();
  if (s.ok()) s = landed_[bucket]->Synchronize();
  if (s.ok()) {
    trace::ScopedTraceEvent t(o_.trace, o_.fold_track, "fold gradient bucket",
                              trace::Category::kCpuOptimizer);
    // The bucket holds this rank's reduced fp32 partition (data parallel), a block's fp32 sum
    // over the micro-batches (layer-major) or its gradients in the working precision.
    const cpu_optim::GradView g{hbucket_[bucket].data(), dtype};
    StatusOr<cpu_optim::GradStats> stats = cpu_optim::GradStats{};
    if (grad16_[b]) {
      // The chunk's only contribution: kept as it landed (the same statistics, bit for bit, as
      // widening it into an fp32 accumulator would give).
      STRATA_CHECK(overwrite && last);
      stats = cpu_optim::CopyGradWithStats(g, accum_[b].data(), np(b));
    } else {
      stats = cpu_optim::AccumulateGrad(std::span<float>(accum_[b].as<float>(), own(b)), g,
                                        overwrite, last);
    }
    if (!stats.ok()) {
      s = stats.status();
    } else if (last) {
      cpu_optim::Merge(stats_, *stats);
      if (o_.on_complete) o_.on_complete(b, *stats, stats_);
    }
  }
  if (o_.poison_released_buckets) {
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

Status GradStreamer::ReadGradient(int b, std::span<float> out) {
  if (static_cast<int64_t>(out.size()) < own(b)) {
    return InvalidArgumentError("GradStreamer::ReadGradient: the output is shorter than the block");
  }
  if (!on_device_[b]) {
    return cpu_optim::ConvertToF32(accum_[b].data(), grad_dtype(b), out.data(), own(b));
  }
  // The gradient stays on the device: copy it to host memory.
  STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer staging,
                          device_->AllocatePinned(dgrad_[b].size_bytes, "gradient read-back"));
  STRATA_RETURN_IF_ERROR(compute_->CopyD2H(staging.span(), dgrad_[b]));
  STRATA_RETURN_IF_ERROR(compute_->Synchronize());
  return cpu_optim::ConvertToF32(staging.data(), device_grad_dtype(b), out.data(), own(b));
}

void GradStreamer::BeginStep() {
  stats_ = {};
  handed_ = 0;
}

Status GradStreamer::Drain() {
  STRATA_RETURN_IF_ERROR(folder_->Drain());
  return FoldError();
}

}  // namespace strata::engine
