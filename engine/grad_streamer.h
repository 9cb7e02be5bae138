// The gradient streamer: each block's gradients from the device to this rank's host gradient
// (docs/ARCHITECTURE.md, "Backward and gradient streaming" and "Data parallelism").
//
// A block's backward writes its 16-bit (or fp32) gradients into one of two device buckets
// (NextBucket); Stream sends the bucket D2H into a free pinned landing bucket and hands the fold
// thread a task, which waits for the copy to land and folds the bucket into the block's host
// gradient (fp32 accumulator, or the 16-bit gradient kept as it landed where
// GradInWorkingPrecision says so) and the step's statistics (sum of squares, inf/nan). Data
// parallel: the bucket is first widened to fp32 and reduce-scattered over the ranks on the
// stream "reduce-scatter", and only this rank's partition goes D2H.
//
// Threads and streams. NextBucket, Stream, BeginStep, Drain and stats are called by the driving
// thread only, which enqueues on the compute and D2H streams (not owned) and on its own
// "reduce-scatter" stream (grad communicator, a duplicate of EngineOptions::comm: the driving
// thread's order, the same on every rank). The fold runs on the "gradient fold" work queue (trace
// track "host: gradient fold"). The update during backward (engine/update_speculation.h): the
// fold calls options.on_complete(b) when block b's gradient is complete (its last contribution
// folded), with b's statistics and the step's so far, which the speculation policy judges.
//
// Invariants (the orderings table of docs/ARCHITECTURE.md): compute waits on dbucket_free[j]
// before a backward writes device bucket j; d2h (or reduce-scatter) waits on dgrad_ready[j]
// before reading it; the fold synchronizes landed[i] before reading pinned bucket i; a pinned
// bucket returns to its pool only after its fold finished, and every bucket returns even after
// an error, so Stream never waits forever. HostGradient(b) and stats() are complete after
// Drain.
//
// Blocks whose optimizer runs on the device (Plan::Block::optimizer_on_device) keep their gradient
// there, in their own device region: the backward writes it in place when it is the block's only
// contribution in the working precision (GradInWorkingPrecision), else into a device bucket
// that the compute stream adds into the region's fp32 accumulator (EnqueueDeviceGradAccumulate).
// At its last contribution the compute stream computes its statistics into the record at the
// region's end (EnqueueDeviceGradStats) and copies the record (DeviceGradStatsBytes) D2H; the
// fold worker merges it into the step's statistics in the same order as the host blocks' folds.
// Nothing else of such a block crosses PCIe.
//
// The layer-major schedule (Plan::device_grad_accumulators): a block's backward runs for every
// micro-batch before the next block's, so its gradient is summed on the device first.
// AccumulateOnDevice adds the device bucket the backward wrote into one of two fp32 device
// accumulators (cpu_optim::AccumulateGrad's order and rounding: micro-batch 0 overwrites, later
// ones add, so the sum is bit for bit the host fold's of the micro-batch-major schedule), and
// StreamAccumulated sends the accumulator D2H once, folded on the host as one fp32 contribution.
// Orderings: compute waits on acc_free[s] (d2h, after the accumulator's copy out) before the
// first add into accumulator s; d2h waits on acc_ready[s] (compute, after the last add).
//
// Errors: Stream returns the streams' Status; a fold's error is kept (the first one) and comes
// back from Drain.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/dtype.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "base/trace.h"
#include "comm/communicator.h"
#include "cpu_optim/grad_stats.h"
#include "engine/plan/model.h"
#include "engine/plan/planner.h"
#include "engine/work_queue.h"
#include "gpu/device.h"

namespace strata::engine {

struct GradStreamerOptions {
  DType precision = DType::kBF16;  // of the device gradients
  int grad_accum_steps = 1;
  bool overlap = true;                    // false: every copy and fold completes inside Stream
  bool inference_only = false;            // no host gradients
  comm::Communicator* comm = nullptr;     // data parallel; not owned
  trace::TraceRecorder* trace = nullptr;  // not owned, may be null
  int fold_track = 0;
  // EngineTestHooks.
  bool fp32_host_grads = false;
  bool poison_released_buckets = false;
  // The update during backward, else null: called on the fold thread when block b's gradient is
  // complete (its last contribution folded), with b's statistics and the step's so far (b's
  // merged in, in fold order).
  std::function<void(int block, const cpu_optim::GradStats& block_stats,
                     const cpu_optim::GradStats& step_stats)>
      on_complete;
};

class GradStreamer {
 public:
  // `dbuckets`: the planner's device gradient buckets region (two buckets); `reduce_region`: its
  // data-parallel reduce-scatter region (empty with one rank and no communicator);
  // `device_grads[b]`: the "gradient" region of a block whose optimizer runs on the device (empty
  // for the others, or an empty span for none). Creates the events, the pinned landing buckets,
  // the host gradients and (data parallel) the "reduce-scatter" stream and the gradients'
  // communicator.
  // `accumulators`: the planner's "gradient accumulators" region (two fp32 blocks; empty
  // without Plan::device_grad_accumulators).
  static StatusOr<std::unique_ptr<GradStreamer>> Create(
      const Model& model, const Plan& plan, gpu::Device* device, gpu::Stream* compute,
      gpu::Stream* d2h, gpu::DeviceSpan dbuckets, gpu::DeviceSpan reduce_region,
      std::span<const gpu::DeviceSpan> device_grads, GradStreamerOptions options,
      gpu::DeviceSpan accumulators = {});
  ~GradStreamer();  // drains the fold queue and the reduce-scatter stream

  // The device bucket for the gradients of chunk `chunk` that the next backward writes, k = 0
  // for the block's own chunk, k = 1 for its tied chunk (the compute stream waits until the
  // bucket's previous D2H is done).
  StatusOr<TensorRef> NextBucket(int chunk, int k = 0);
  // Each bucket's trip to the host after the backward, in NextBucket's order. Fold flags:
  // `overwrite` starts the chunk's accumulator (its first contribution of the step), `last` is
  // its last contribution (statistics, on_complete).
  Status Stream(int chunk, bool overwrite, bool last);
  // Layer-major (Plan::device_grad_accumulators; chunks whose optimizer is not on the device):
  // instead of Stream, the bucket the backward wrote (NextBucket's order) is added into the
  // chunk's fp32 device accumulator on the compute stream; `first` (micro-batch 0) takes a free
  // accumulator and overwrites it. StreamAccumulated then sends the sum D2H and folds it as one
  // contribution with Stream's flags; the accumulator is free once the copy is done.
  Status AccumulateOnDevice(int chunk, bool first);
  Status StreamAccumulated(int chunk, bool overwrite, bool last);
  // Whether chunk b's gradient stays on the device (its optimizer runs there).
  bool on_device(int b) const { return on_device_[b]; }
  // Resets the step's statistics (between steps).
  void BeginStep();
  // Waits for every fold; the first fold error.
  Status Drain();
  // The step's statistics, merged at each chunk's last contribution.
  const cpu_optim::GradStats& stats() const { return stats_; }
  // Block b's host gradient (this rank's partition): the working precision or fp32.
  cpu_optim::GradView HostGradient(int b) const { return {accum_[b].data(), grad_dtype(b)}; }
  DType grad_dtype(int b) const { return grad16_[b] ? o_.precision : DType::kF32; }
  // A device-optimized block's gradient on the device (complete once the compute stream has run
  // its last contribution) and its dtype: the working precision or fp32.
  gpu::DeviceSpan DeviceGradient(int b) const { return dgrad_[b]; }
  DType device_grad_dtype(int b) const { return dgrad16_[b] ? o_.precision : DType::kF32; }
  // Block b's gradient (this rank's partition, own_elems values) widened to fp32 into `out`,
  // from the host or, for a device-optimized block, copied from the device on the compute stream
  // (synchronized). After Drain and the compute stream's step; driving thread. Errors: the
  // copy's, kResourceExhausted for the pinned staging, kInvalidArgument for a short `out`.
  Status ReadGradient(int b, std::span<float> out);
  uint64_t buckets_poisoned() const { return buckets_poisoned_.load(); }
  // Gradient bytes sent D2H so far (driving thread).
  uint64_t grad_bytes_d2h() const { return grad_bytes_d2h_; }

 private:
  // Pinned landing buckets: a bucket returns to the pool only after its D2H copy landed and its
  // fold (the consumer) finished reading it.
  class BucketPool {
   public:
    void Reset(int n);
    int Acquire();
    void Release(int i);

   private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<int> free_ STRATA_GUARDED_BY(mu_);
  };

  GradStreamer(const Model& model, const Plan& plan, gpu::Stream* compute, gpu::Stream* d2h,
               GradStreamerOptions options);
  int64_t np(int b) const { return model_.block_num_params(b); }
  bool dp() const { return o_.comm != nullptr; }
  int64_t own(int b) const { return plan_.blocks[b].partition.own_elems; }
  int64_t home_elems(int b) const { return plan_.blocks[b].partition.part_elems; }
  int64_t dev_elems(int b) const { return plan_.blocks[b].partition.padded_elems; }
  // Runs on the fold worker. Never fails the queue: an error is kept in fold_error_.
  // `dtype`: the pinned bucket's (fp32 for a reduce-scattered partition or a device sum).
  void Fold(int b, int bucket, DType dtype, bool overwrite, bool last);
  // Driving thread. The device bucket the next streamed contribution reads (NextBucket's order).
  int TakeStreamedBucket();
  // That bucket added into fp32 `acc` (elems values; overwrite: replaced) on the compute stream,
  // the bucket free after it.
  Status AddBucketOnCompute(gpu::DeviceSpan acc, int64_t elems, bool overwrite);
  // Pinned bucket `bucket` (its D2H enqueued) to the fold worker; without overlap, waits for it.
  Status HandToFold(int b, int bucket, DType dtype, bool overwrite, bool last);
  // Stream for a block whose gradient stays on the device; MergeDeviceStats runs on the fold
  // worker.
  Status StreamOnDevice(int b, bool overwrite, bool last);
  // Data parallel, on the reduce-scatter stream: device bucket j (block b's gradients, once
  // dgrad_ready_[j]) widened to fp32 and reduce-scattered into red_part_[j] (once part_free_[j]);
  // records dbucket_free_[j].
  Status ReduceScatter(int b, int j);
  void MergeDeviceStats(int b);

  Status FoldError();

  const Model& model_;
  const Plan& plan_;
  const GradStreamerOptions o_;
  const size_t w_;
  gpu::Device* device_ = nullptr;  // the pinned staging of ReadGradient
  gpu::Stream* compute_;
  gpu::Stream* d2h_;
  std::vector<bool> grad16_;  // GradInWorkingPrecision per block
  // Blocks optimized on the device: their gradient region (data, then the statistics record at
  // its end), whether the backward writes it in place in the working precision, the record's
  // pinned landing slot (DeviceGradStatsBytes) and its event (compute stream).
  std::vector<bool> on_device_, dgrad16_;
  std::vector<gpu::DeviceSpan> dgrad_, dstats_;
  gpu::PinnedBuffer stats_pinned_;
  std::vector<uint64_t> stats_offset_;  // of each block's record in stats_pinned_
  std::vector<std::unique_ptr<gpu::Event>> dstats_ready_;
  std::vector<AlignedBuffer> accum_;  // host gradients per block (fp32 or grad_dtype)

  // Device bucket j (16-bit) -> D2H -> pinned bucket i -> fold.
  gpu::DeviceSpan dbucket_[2];
  std::unique_ptr<gpu::Event> dgrad_ready_[2], dbucket_free_[2];
  int next_dbucket_ = 0;  // the bucket the next Stream sends
  int handed_ = 0;        // buckets handed out by NextBucket and not yet streamed
  uint64_t grad_bytes_d2h_ = 0;
  std::vector<gpu::PinnedBuffer> hbucket_;
  std::vector<std::unique_ptr<gpu::Event>> landed_;
  BucketPool pool_;
  // Data parallel: gradients reduce-scatter on reduce_ (grad_comm_, driving thread's order).
  std::unique_ptr<gpu::Stream> reduce_;
  std::unique_ptr<comm::Communicator> grad_comm_;
  gpu::DeviceSpan red_full_;     // one block's gradients widened to fp32, padded
  gpu::DeviceSpan red_part_[2];  // this rank's reduced fp32 partition
  std::unique_ptr<gpu::Event> reduced_[2], part_free_[2];
  // Layer-major: the fp32 device accumulators, their events, the one each chunk sums into.
  gpu::DeviceSpan dacc_[2];
  std::unique_ptr<gpu::Event> acc_ready_[2], acc_free_[2];
  std::vector<int> acc_slot_;
  int next_acc_ = 0;

  std::mutex fold_mu_;
  Status fold_error_ STRATA_GUARDED_BY(fold_mu_);
  cpu_optim::GradStats stats_;  // written by the fold worker; read after Drain()
  std::atomic<uint64_t> buckets_poisoned_{0};
  // Declared last: destroyed (joined) first.
  std::unique_ptr<WorkQueue> folder_;
};

}  // namespace strata::engine
