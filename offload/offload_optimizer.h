// OffloadOptimizer: ZeRO-Offload for any model (Ren et al., "ZeRO-Offload: Democratizing
// Billion-Scale Model Training", USENIX ATC 2021; state on NVMe as in Rajbhandari et al.,
// "ZeRO-Infinity", SC 2021). The caller owns the model and its working parameters; Strata owns
// the fp32 master weights and the optimizer state, in host memory or the NVMe swap store, and
// runs gradient folding, accumulation, the global-norm statistics and the update on its own
// threads, overlapped with the caller's backward and next forward. The C API's strata_offload
// (include/strata/strata.h) and strata.torch are this class behind a C ABI.
//
// Vocabulary.
//   group   hyper-parameters and an optimizer kind (cpu_optim/any_optimizer.h), with its own
//           step count (t), as torch.optim's param_groups.
//   bucket  the unit of gradient hand-off, update and write-back: an ordered list of segments
//           (the caller's parameter buffers, one dtype per bucket: fp32, fp16 or bf16), all of
//           one group. Bucket b's master weights and gradient accumulator are flat fp32 arrays
//           of the bucket's total length (segment after segment).
//   segment one tensor: the optimizer steps each segment on its own, with its shape (flat {n}
//           unless given), through cpu_optim::UpdateState (any_optimizer.h).
//   state   a bucket's optimizer state is the sections of cpu_optim::StateLayout: for each
//           section name, the segments' sections of that name back to back, segment after
//           segment (SegmentStateRange says where a segment's part lies). For the per-element
//           kinds (AdamW, Adam, Adagrad, Lion, SGD) a section is a flat fp32 array of the
//           bucket's length, as torch keeps it. AdamW8bit: exp_avg and exp_avg_sq are uint8
//           codes (one per element) and exp_avg.absmax, exp_avg_sq.absmax fp32 values, one per
//           quantization block of cpu_optim::kQuantBlockElems elements, blocks counted from
//           each segment's start. Adafactor: exp_avg_sq_row and exp_avg_sq_col hold the rows and
//           columns of the segments of >= 2 dimensions, exp_avg_sq the elements of the others,
//           exp_avg (beta1 > 0) every element.
//   micro-batch  every segment receives one gradient per micro-batch; the first after a step
//           overwrites the accumulator, the others add to it (gradient accumulation: a sum, as
//           torch's .grad; dividing the loss by the number of micro-batches is the caller's).
//
// One step, as the caller sees it:
//   1. backward: for each bucket, as soon as its gradients exist, SubmitGradient (the whole
//      bucket at once, from a staging buffer of AcquireStaging or the caller's own memory, or
//      segment by segment). The call returns at once; a fold thread widens it into the fp32
//      accumulator and computes its statistics (sum of squares, inf/nan) in the same pass.
//   2. Step(options): waits for the folds, checks that every segment received the same number
//      of micro-batches, merges the statistics in bucket order (bit-identical whatever the
//      timing), and, unless a gradient is non-finite (then nothing changes and the step reports
//      skipped: fp16 loss scaling's overflow skip), starts the update of every bucket in bucket
//      order and returns. The update of bucket b multiplies each gradient by
//      clip_coef / loss_scale (clip_coef = min(1, max_norm / (norm + 1e-6)) as
//      torch.nn.utils.clip_grad_norm_), steps the group's optimizer over the masters and state,
//      and writes the new weights, rounded to the bucket's dtype, into the caller's segments.
//      With state on NVMe the update is the pipeline of engine/optimizer_pipeline.h: read the
//      state of bucket b+1, update b, write b-1, over buffer_count pinned buffers. A bucket's
//      masters and state are one unit of engine/state_regions.h (host memory or the extent
//      "bucket{b}.state"), the storage the engine's StateStore keeps its blocks in.
//   3. next forward: WaitBucket(b) before the caller reads bucket b's parameters: the update of
//      later buckets overlaps the caller's compute. A gradient submitted for bucket b is folded
//      only after b's update finished, so the next backward may start at any time.
// No stale update: the numbers are those of a sequential step, bit for bit, whatever the
// thread count, the home of the state or the timing.
//
// Errors. Every method returns a Status; none aborts on anything a caller or the disk can
// cause. Bad use is kInvalidArgument (unknown group or bucket, a dtype or length mismatch) or
// kFailedPrecondition (a step before every segment received its gradients, a bucket added after
// the first step); nothing changes. An error of the asynchronous work (an NVMe write failing, a
// checksum mismatch on a read) is sticky: it comes back from the next call that waits on that
// work (SubmitGradient's fold, WaitBucket, Step, Synchronize, ReadState, Save), and from every
// later call (kFailedPrecondition naming the first error): the state is then unknown; create a
// new optimizer and Load a saved state.
//
// Thread-safety: the methods may be called from any thread but not concurrently, except
// WaitBucket, which may run concurrently with anything but destruction (a framework's forward
// hooks). Buffers handed in (segments, gradients) must stay valid as documented per method.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "base/trace.h"
#include "cpu_optim/any_optimizer.h"
#include "io/io_backend.h"

// The class lives in offload/ (strata::offload, above the engine whose state regions and
// optimizer pipeline it uses) but keeps the namespace it has always had: users of the installed
// C++ package name it strata::engine::OffloadOptimizer.
namespace strata::engine {

struct OffloadOptimizerOptions {
  // Where master weights and optimizer state live.
  enum class Home { kHost, kNvme };
  Home home = Home::kHost;
  // kNvme: parent directories of the swap store (io/swap_store.h: a private 0700 directory in
  // each, extents striped over them, xxh3-checked, removed at destruction). One per drive.
  std::vector<std::string> nvme_paths;
  io::IoBackendOptions io;
  // Threads of the folds and updates (cpu_optim WorkerArena, the calling thread of each stage
  // included): 0 = all CPUs this process may use. Results do not depend on it.
  int num_threads = 0;
  // kNvme: pinned buffers of the read / update / write pipeline, each the size of the largest
  // bucket's masters and state (DeepSpeed's offload_optimizer.buffer_count). >= 2; 3 keeps all
  // three stages busy.
  int buffer_count = 4;
  // Gradient staging buffers (AcquireStaging), each the size of the largest bucket's gradient.
  // >= 1. They return to the pool when their fold finished.
  int staging_buffers = 4;
  // Page-lock (mlock) the staging and pipeline buffers, so a device copy into them is a DMA and
  // they never swap (DeepSpeed's pin_memory). When the memlock limit refuses, one warning is
  // logged and the buffers stay pageable.
  bool pin_memory = true;
  // Not owned, may be null: the fold and pipeline threads record their work on tracks
  // "offload: gradient fold", "offload: state read", "offload: cpu optimizer", "offload: state
  // write".
  trace::TraceRecorder* trace = nullptr;
  // Test seam: makes the swap store's I/O backend instead of io::CreateIoBackend (to inject
  // ENOSPC, EIO, short transfers).
  std::function<StatusOr<std::unique_ptr<io::IoBackend>>(const io::IoBackendOptions&)>
      io_backend_factory;
};

// One of the caller's parameter buffers: num_elems elements of the bucket's dtype at data.
// Strata reads it at AddBucket (the initial master weights) and ReloadMasters, and writes it
// during each update of its bucket. The caller keeps it valid, and does not read it between a
// Step and WaitBucket of its bucket, until the optimizer is destroyed.
struct OffloadSegment {
  void* data = nullptr;
  int64_t num_elems = 0;
  // The tensor's shape (row-major, product num_elems; dimensions > 0); empty = flat {num_elems}.
  // Only Adafactor's state depends on it (tensors of >= 2 dimensions are factored).
  std::vector<int64_t> shape;
};

// Where segment s's part of a state section lies inside the bucket's section, in elements of
// the section's dtype: [offset_elems, offset_elems + num_elems). num_elems is 0 when the segment
// has no part in that section (an Adafactor vector in exp_avg_sq_row).
struct OffloadStateRange {
  int64_t offset_elems = 0;
  int64_t num_elems = 0;
};

struct OffloadStepOptions {
  // Clip the gradient (after unscaling) to this global L2 norm, as
  // torch.nn.utils.clip_grad_norm_(max_norm); 0 = no clipping.
  double max_grad_norm = 0;
  // The gradients are the true ones times loss_scale (fp16 loss scaling); they are divided by
  // it. Finite and > 0.
  float loss_scale = 1.0f;
};

struct OffloadStepResult {
  double grad_norm = 0;   // global L2 norm of the unscaled gradient, before clipping; inf/nan
                          // when skipped
  bool skipped = false;   // a non-finite gradient: nothing changed, the step counts did not move
  int micro_batches = 0;  // gradients each segment received for this step
};

struct OffloadCounters {
  int64_t steps = 0;          // Step calls that updated
  int64_t skipped_steps = 0;  // Step calls skipped for a non-finite gradient
  uint64_t nvme_bytes_read = 0;
  uint64_t nvme_bytes_written = 0;
  // Seconds from each Step's start to the end of its last bucket's update (write-back
  // included), summed over steps: the update's wall time.
  double update_seconds = 0;
  // Seconds the caller spent blocked on the update, summed: in WaitBucket, in Synchronize, in
  // SubmitGradient/AcquireStaging waiting for a bucket's update, and in Step waiting for the
  // previous update. 1 - wait_seconds / update_seconds is the fraction of the update hidden
  // under the caller's work.
  double wait_seconds = 0;
  uint64_t host_state_bytes = 0;  // host memory holding masters, state and accumulators
};

class OffloadOptimizer {
 public:
  // Errors: kInvalidArgument (bad options, home kNvme without nvme_paths); the swap store's
  // errors naming an unusable path (kPermissionDenied, kNotFound, ...); kResourceExhausted.
  static StatusOr<std::unique_ptr<OffloadOptimizer>> Create(OffloadOptimizerOptions options);
  // Waits for the work in flight (its errors are dropped), then frees everything; the swap
  // files are removed.
  ~OffloadOptimizer();
  OffloadOptimizer(const OffloadOptimizer&) = delete;
  OffloadOptimizer& operator=(const OffloadOptimizer&) = delete;

  // --- Set-up: groups and buckets, before the first Step -------------------------------------

  // A new group (its index, 0, 1, ...); step count 0. kInvalidArgument for a config that
  // cpu_optim::Validate rejects.
  StatusOr<int> AddGroup(const cpu_optim::AnyOptimizer& optimizer);
  // Replaces a group's hyper-parameters from the next update on (a learning-rate schedule).
  // The kind and the state layout of every bucket of the group must stay (kInvalidArgument
  // otherwise: amsgrad, SGD momentum or Adafactor's beta1 > 0 cannot be switched on or off).
  Status SetGroupOptimizer(int group, const cpu_optim::AnyOptimizer& optimizer);
  const cpu_optim::AnyOptimizer& group_optimizer(int group) const;
  int num_groups() const;

  // A new bucket of `group` over the caller's segments (their index, 0, 1, ... is the update
  // order: put buckets in the order the next forward uses them). param_dtype kF32, kF16 or
  // kBF16. Reads the segments into the master weights (exactly widened) and initializes the
  // state (cpu_optim::InitializeState), in host memory or on NVMe. Every segment has
  // num_elems > 0, a non-null data aligned to its elements and a shape that is empty or whose
  // product is num_elems; segments of one optimizer must not overlap; a bucket holds at most
  // 2^50 elements.
  // kFailedPrecondition after the first gradient, staging buffer or Step. Swap-store errors
  // (kResourceExhausted for a full drive) leave no bucket behind and are sticky (the failed
  // extent keeps its name in the store): make a new optimizer with room on the drive.
  StatusOr<int> AddBucket(int group, DType param_dtype, std::span<const OffloadSegment> segments);
  int num_buckets() const;
  int64_t bucket_num_elems(int bucket) const;
  int bucket_group(int bucket) const;
  DType bucket_dtype(int bucket) const;
  std::span<const OffloadSegment> bucket_segments(int bucket) const;

  // --- Gradients (during backward) -----------------------------------------------------------

  // A staging buffer for one whole-bucket gradient of grad_dtype (kF32, kF16, kBF16):
  // bucket_num_elems(bucket) elements, 64-byte aligned, pinned when pin_memory. Blocks until a
  // buffer is free. The caller fills it (segment after segment) and hands it back by
  // SubmitGradient(bucket, -1, its data, grad_dtype, ...); it returns to the pool when that
  // fold finished. A buffer acquired and never submitted stays taken; when every buffer is taken
  // so and none is submitted (waiting would never end), kFailedPrecondition saying so.
  StatusOr<std::span<std::byte>> AcquireStaging(int bucket, DType grad_dtype);

  // One micro-batch's gradient for segment `segment` of `bucket` (-1 = the whole bucket: every
  // segment at once), num_elems elements of dtype (kF32, kF16, kBF16) at grad. Returns at once;
  // the fold runs on the fold thread, after `ready` (when set) returned OK — e.g. the wait for a
  // CUDA event recorded after the device-to-host copy that fills grad — and after the bucket's
  // previous update finished. grad must stay valid and unchanged until the fold finished:
  // WaitGradients, Step and Synchronize wait for it. Errors (nothing queued): kInvalidArgument
  // for an unknown bucket or segment, a null grad, num_elems different from the segment's (or
  // the bucket's), an unknown dtype; kFailedPrecondition for a segment that already received
  // one more gradient than some other segment of any bucket (two gradients for one micro-batch:
  // each micro-batch hands every segment once), or after an error.
  Status SubmitGradient(int bucket, int segment, const void* grad, DType dtype, int64_t num_elems,
                        std::function<Status()> ready = nullptr);

  // Waits until every gradient submitted so far is folded; the fold error, if any.
  Status WaitGradients();

  // Drops every gradient since the last Step (torch's zero_grad between backward and step, or
  // after a backward that failed halfway): waits for the folds in flight, sets every segment's
  // gradient count to 0 (the next gradient overwrites the accumulator) and returns the staging
  // buffers acquired and not submitted to the pool (the caller must not touch them again).
  // Master weights, state and step counts do not change; an update in flight goes on. Errors:
  // a fold's error (sticky, as every error of the asynchronous work); kFailedPrecondition after
  // an earlier error.
  Status DiscardGradients();

  // --- Step and write-back ------------------------------------------------------------------

  // Starts the update of every bucket (see the top of this file) and returns once it is queued;
  // *result says whether it was skipped. Every segment must have received the same number n >= 1
  // of gradients since the last step (kFailedPrecondition naming the first segment that did not,
  // nothing changes). The group step counts advance by one unless skipped.
  Status Step(const OffloadStepOptions& options, OffloadStepResult* result);

  // Waits until bucket b's last update has written its new weights into the caller's segments.
  // On NVMe the bucket's state may still be on its way to the drive (Synchronize waits for that;
  // a failed write comes back from a later call). OK at once when no update is in flight.
  Status WaitBucket(int bucket);
  // Waits for every fold and every update.
  Status Synchronize();

  // --- State access (waits for the work in flight first) -------------------------------------

  // A bucket's tensors: 0 = the master weights (fp32, bucket_num_elems), 1 + i = state section
  // i of bucket_state_layout(bucket) (name, dtype, element count; initial_value/initial_code
  // are what AddBucket wrote). The span stays valid until the optimizer is destroyed.
  std::span<const cpu_optim::StateSpec> bucket_state_layout(int bucket) const;
  // Segment `segment`'s part of tensor `tensor` of a bucket (tensor 0: the segment's elements).
  // kInvalidArgument for unknown indices.
  StatusOr<OffloadStateRange> SegmentStateRange(int bucket, int segment, int tensor) const;

  // Tensor `tensor` of a bucket as fp32 values: the master weights, or an fp32 section (its
  // num_elems values). kInvalidArgument for an unknown tensor, a size mismatch or a uint8
  // section (use ReadStateBytes). Read from host memory or the swap store (checksum verified).
  Status ReadState(int bucket, int tensor, std::span<float> out);
  // Replaces tensor `tensor` of a bucket (e.g. torch's load_state_dict); same checks. Writing
  // the master weights (tensor 0) also writes them, rounded, into the caller's segments.
  Status WriteState(int bucket, int tensor, std::span<const float> in);
  // The same for any tensor as raw bytes: num_elems * 4 bytes of fp32 (host byte order) or
  // num_elems bytes of uint8 codes; kInvalidArgument for another size. A uint8 code may be any
  // value (each indexes the 256-value map); an absmax written with a non-finite or negative
  // value makes the dequantized state non-finite, as in any fp32 state.
  Status ReadStateBytes(int bucket, int tensor, std::span<std::byte> out);
  Status WriteStateBytes(int bucket, int tensor, std::span<const std::byte> in);
  // Reads the caller's segments into the master weights again (after the caller loaded new
  // weights into its model).
  Status ReloadMasters(int bucket);
  int64_t group_step(int group) const;           // t: updates applied to the group
  Status SetGroupStep(int group, int64_t step);  // >= 0

  // --- Checkpoints ----------------------------------------------------------------------------

  // Writes the whole optimizer state to directory `dir` (created; replaced when it exists) as
  //   optimizer.safetensors  per bucket b: "bucket{b}.master" (F32) and "bucket{b}.<section
  //                          name>" (F32, or U8 for 8-bit codes), one dimension each,
  //                          streamed bucket by bucket (host memory use: one bucket)
  //   manifest.json          format "strata-offload-optimizer", version, groups (kind, every
  //                          hyper-parameter, step count), buckets (group, dtype, segment
  //                          lengths and shapes), and the size and xxh3 of
  //                          optimizer.safetensors
  // into a temporary sibling directory that is fsynced and exchanged with `dir`: a crash leaves
  // either the old or the new state. The caller's parameters are not saved (the model's).
  // `dir` may be new, empty, or an earlier save (what it holds is replaced whole); anything else
  // that exists there (a file, a directory holding other files) is kAlreadyExists naming it,
  // with nothing written.
  Status Save(const std::string& dir);
  // Restores a state written by Save into an optimizer with the same groups (kinds, state
  // layouts) and buckets (dtypes, segment lengths and shapes; a save without shapes is flat):
  // masters, state, hyper-parameters and step counts; the caller's
  // segments receive the loaded master weights. Everything is checked (manifest, sizes, xxh3,
  // tensor names and shapes) before anything changes: kInvalidArgument naming the first
  // difference in structure, kDataLoss for a damaged file (a manifest field of the wrong type
  // or range is named by its place, "manifest.json: buckets[1].segments[0] = 2.5 is not an
  // integer in [1, ...]"; text quoted from the file is escaped), kFailedPrecondition for another
  // format version. Every message is one line starting "offload optimizer: Load '<dir>'".
  Status Load(const std::string& dir);

  OffloadCounters counters() const;
  std::string_view io_backend_name() const;  // "uring", "posix"; "" for home kHost

 private:
  class Impl;
  explicit OffloadOptimizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::engine
