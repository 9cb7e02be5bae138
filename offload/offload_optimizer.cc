#include "offload/offload_optimizer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <span>
#include <utility>

#include "base/aligned_buffer.h"
#include "base/file.h"
#include "base/json_fields.h"
#include "base/logging.h"
#include "base/thread_annotations.h"
#include "base/units.h"
#include "base/untrusted_text.h"
#include "cpu_optim/grad_stats.h"
#include "cpu_optim/threading.h"
#include "engine/checkpoint.h"
#include "engine/optimizer_json.h"
#include "engine/optimizer_pipeline.h"
#include "engine/state_regions.h"
#include "engine/work_queue.h"
#include "formats/safetensors.h"
#include "io/swap_store.h"

namespace strata::engine {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

constexpr const char* kOffloadFormat = "strata-offload-optimizer";
constexpr int kOffloadFormatVersion = 1;
constexpr const char* kOffloadTensorFile = "optimizer.safetensors";
// The most elements of one bucket (4 PiB of fp32 master weights): far past any memory, and low
// enough that no byte count of a bucket's state (at most a few bytes an element) overflows.
constexpr int64_t kMaxBucketElems = int64_t{1} << 50;
// What a directory Save replaces may hold: a save's two files, and the param groups strata.torch
// writes beside them (python/strata/_offload.py).
constexpr std::string_view kSavedEntries[] = {
    "manifest.json", kOffloadTensorFile, "torch_param_groups.json", "torch_param_groups.json.tmp"};

// Save replaces its directory whole, so it may only replace a directory of what it writes (an
// earlier save) or nothing: never a user's file or other files that share the directory.
Status CheckSaveTarget(const std::filesystem::path& target) {
  struct stat st;
  if (::lstat(target.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::Ok();
    return ErrnoToStatus(errno, fmt::format("offload optimizer: Save: '{}'", target.string()));
  }
  if (!S_ISDIR(st.st_mode)) {
    return AlreadyExistsError(fmt::format(
        "offload optimizer: Save: '{}' exists and is {}, not a saved optimizer state (Save "
        "replaces its directory whole): give a new or empty directory",
        target.string(), FileTypeName(st.st_mode)));
  }
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(target, ec)) {
    const std::string name = e.path().filename().string();
    if (std::find(std::begin(kSavedEntries), std::end(kSavedEntries), name) ==
        std::end(kSavedEntries)) {
      return AlreadyExistsError(fmt::format(
          "offload optimizer: Save: '{}' holds '{}', which is not part of a saved optimizer "
          "state (Save replaces the directory whole): give a new or empty directory",
          target.string(), Excerpt(name)));
    }
  }
  if (ec) {
    return ErrnoToStatus(ec.value(),
                         fmt::format("offload optimizer: Save: listing '{}'", target.string()));
  }
  return Status::Ok();
}

// Bytes a tensor of size_bytes takes inside a bucket's state block (4096-aligned, so the block
// is one O_DIRECT extent and each tensor starts on its own page).
uint64_t TensorStride(uint64_t size_bytes) { return io::SwapStore::PaddedSize(size_bytes); }

// A segment's shape: its own, or flat {num_elems}.
std::vector<int64_t> SegmentShape(const OffloadSegment& seg) {
  return seg.shape.empty() ? std::vector<int64_t>{seg.num_elems} : seg.shape;
}

// The state sections of a bucket whose segments have these shapes: per name, the segments'
// sections (cpu_optim::StateLayout of each segment alone) back to back, in the order of
// StateLayout over all the shapes. ranges[s][i] receives segment s's part of section i.
std::vector<cpu_optim::StateSpec> BucketLayout(
    const cpu_optim::AnyOptimizer& optimizer, const std::vector<std::vector<int64_t>>& shapes,
    std::vector<std::vector<OffloadStateRange>>* ranges) {
  std::vector<cpu_optim::StateSpec> sections = cpu_optim::StateLayout(optimizer, shapes);
  for (auto& section : sections) section.num_elems = 0;
  std::vector<std::vector<OffloadStateRange>> r(shapes.size());
  for (size_t s = 0; s < shapes.size(); ++s) {
    const std::vector<cpu_optim::StateSpec> own =
        cpu_optim::StateLayout(optimizer, std::span(&shapes[s], 1));
    for (const cpu_optim::StateSpec& spec : own) {
      auto it = std::find_if(sections.begin(), sections.end(),
                             [&](const cpu_optim::StateSpec& x) { return x.name == spec.name; });
      if (it == sections.end()) {
        sections.push_back(spec);
        it = sections.end() - 1;
        it->num_elems = 0;
      }
      const size_t i = static_cast<size_t>(it - sections.begin());
      r[s].resize(std::max(r[s].size(), i + 1));
      r[s][i] = OffloadStateRange{it->num_elems, spec.num_elems};
      it->num_elems += spec.num_elems;
    }
  }
  for (auto& row : r) row.resize(sections.size());
  if (ranges) *ranges = std::move(r);
  return sections;
}

bool SameLayout(std::span<const cpu_optim::StateSpec> a, std::span<const cpu_optim::StateSpec> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].dtype != b[i].dtype || a[i].num_elems != b[i].num_elems) {
      return false;
    }
  }
  return true;
}

std::string LayoutString(std::span<const cpu_optim::StateSpec> layout) {
  std::vector<std::string> parts;
  for (const auto& spec : layout) {
    parts.push_back(fmt::format("{} {}[{}]", spec.name,
                                spec.dtype == cpu_optim::StateDType::kU8 ? "u8" : "f32",
                                spec.num_elems));
  }
  return parts.empty() ? std::string("no state") : fmt::format("{}", fmt::join(parts, ", "));
}

// The names of a layout's sections ("exp_avg, exp_avg_sq"), or "no state": what a config
// change refused by its layout has and would have, without the probe's sizes.
std::string SectionNames(std::span<const cpu_optim::StateSpec> layout) {
  std::vector<std::string_view> names;
  for (const auto& spec : layout) names.push_back(spec.name);
  return names.empty() ? std::string("no state") : fmt::format("state {}", fmt::join(names, ", "));
}

// Whether `shape` (dimensions > 0) holds exactly `num_elems` elements, its product computed
// without overflow: what AddBucket asks of a caller's shape and Load of a saved one.
bool ShapeHolds(std::span<const int64_t> shape, int64_t num_elems) {
  int64_t product = 1;
  for (int64_t d : shape) {
    if (d <= 0 || __builtin_mul_overflow(product, d, &product)) return false;
  }
  return product == num_elems;
}

std::string StateExtent(int b) { return fmt::format("bucket{}.state", b); }

// Host memory that is page-locked when asked to (and when the memlock limit allows).
class HostBuffer {
 public:
  static StatusOr<HostBuffer> Allocate(size_t size_bytes, bool pin, std::atomic<bool>* warned) {
    HostBuffer h;
    STRATA_ASSIGN_OR_RETURN(h.buf_, AlignedBuffer::Allocate(std::max<size_t>(size_bytes, 1)));
    if (pin) {
      if (::mlock(h.buf_.data(), h.buf_.size_bytes()) == 0) {
        h.locked_ = true;
      } else if (!warned->exchange(true)) {
        STRATA_LOG_WARNING(
            "offload optimizer: could not pin (mlock) {} of staging/pipeline buffers ({}); they "
            "stay pageable. Raise the memlock limit (ulimit -l) to pin them",
            FormatBytes(h.buf_.size_bytes()), std::strerror(errno));
      }
    }
    return h;
  }
  HostBuffer() = default;
  HostBuffer(HostBuffer&& o) noexcept
      : buf_(std::move(o.buf_)), locked_(std::exchange(o.locked_, false)) {}
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    Unlock();
    buf_ = std::move(o.buf_);
    locked_ = std::exchange(o.locked_, false);
    return *this;
  }
  ~HostBuffer() { Unlock(); }
  std::byte* data() const { return buf_.data(); }
  size_t size_bytes() const { return buf_.size_bytes(); }

 private:
  void Unlock() {
    if (locked_) ::munlock(buf_.data(), buf_.size_bytes());
    locked_ = false;
  }
  AlignedBuffer buf_;
  bool locked_ = false;
};

}  // namespace

class OffloadOptimizer::Impl {
 public:
  explicit Impl(OffloadOptimizerOptions o) : o_(std::move(o)) {}
  ~Impl() {
    if (folder_) folder_->Drain().IgnoreError();
    if (pipeline_) pipeline_->Drain().IgnoreError();
  }

  Status Init();

  // --- set-up ---
  StatusOr<int> AddGroup(const cpu_optim::AnyOptimizer& optimizer);
  Status SetGroupOptimizer(int group, const cpu_optim::AnyOptimizer& optimizer);
  StatusOr<int> AddBucket(int group, DType dtype, std::span<const OffloadSegment> segments);

  // --- gradients ---
  StatusOr<std::span<std::byte>> AcquireStaging(int bucket, DType dtype);
  Status SubmitGradient(int bucket, int segment, const void* grad, DType dtype, int64_t n,
                        std::function<Status()> ready);
  Status WaitGradients();
  Status DiscardGradients();

  // --- step ---
  Status Step(const OffloadStepOptions& options, OffloadStepResult* result);
  Status WaitBucket(int bucket);
  Status Synchronize();

  // --- state ---
  Status ReadState(int bucket, int tensor, std::span<float> out);
  Status WriteState(int bucket, int tensor, std::span<const float> in);
  Status ReadStateBytes(int bucket, int tensor, std::span<std::byte> out);
  Status WriteStateBytes(int bucket, int tensor, std::span<const std::byte> in);
  Status ReloadMasters(int bucket);
  Status SetGroupStep(int group, int64_t step);
  Status Save(const std::string& dir);
  Status Load(const std::string& dir);

  OffloadCounters counters() const;
  // kInvalidArgument for an unknown bucket or tensor (0 master, 1 + i section i).
  Status CheckTensor(int bucket, int tensor, const char* what) const;

  struct Group {
    cpu_optim::AnyOptimizer optimizer;
    int64_t step = 0;
  };
  struct Bucket {
    int group = 0;
    DType dtype = DType::kF32;
    std::vector<OffloadSegment> segments;
    std::vector<int64_t> offsets;              // element offset of each segment in the flat bucket
    std::vector<std::vector<int64_t>> shapes;  // of each segment (SegmentShape)
    int64_t num_elems = 0;
    int num_tensors = 1;                         // master + the state sections
    std::vector<cpu_optim::StateSpec> sections;  // BucketLayout of the group's optimizer
    // [segment][section]: the segment's part of each section (BucketLayout).
    std::vector<std::vector<OffloadStateRange>> ranges;
    std::vector<uint64_t> tensor_offsets;     // byte offset of tensor t in the state block
    uint64_t state_bytes = 0;                 // the state block: every tensor, padded
    AlignedBuffer accum;                      // fp32 gradient accumulator, num_elems
    std::vector<int64_t> received;            // gradients per segment since the last step
    std::vector<cpu_optim::GradStats> stats;  // of the accumulator after its last fold
  };

  const OffloadOptimizerOptions o_;
  std::vector<Group> groups_;
  std::vector<Bucket> buckets_;
  // Each bucket's state block [master | section 0 | ...], each padded (TensorStride): unit b =
  // bucket b, in host memory or the extent "bucket{b}.state".
  std::unique_ptr<StateRegions> regions_;

 private:
  bool nvme() const { return o_.home == OffloadOptimizerOptions::Home::kNvme; }
  uint64_t StateBytes(const Bucket& b) const { return b.state_bytes; }
  // Tensor t of a bucket: 0 master weights, 1 + i section i.
  static bool TensorIsU8(const Bucket& k, int t) {
    return t > 0 && k.sections[t - 1].dtype == cpu_optim::StateDType::kU8;
  }
  static int64_t TensorElems(const Bucket& k, int t) {
    return t == 0 ? k.num_elems : k.sections[t - 1].num_elems;
  }
  static uint64_t TensorBytes(const Bucket& k, int t) {
    return t == 0 ? static_cast<uint64_t>(k.num_elems) * 4 : k.sections[t - 1].size_bytes();
  }
  // "bucket{b}.master", "bucket{b}.exp_avg", ...: tensor t of bucket b in a saved state.
  std::string TensorName(int b, int t) const {
    const Bucket& k = buckets_[b];
    return fmt::format("bucket{}.{}", b,
                       t == 0 ? std::string_view("master") : k.sections[t - 1].name);
  }
  // Reads tensor `tensor` of a bucket into out (TensorBytes), or writes it from in.
  Status CopyTensor(int bucket, int tensor, std::span<std::byte> out,
                    std::span<const std::byte> in);
  Status CheckUsable() const;
  Status Fail(Status status);
  Status CheckBucket(int bucket, const char* what) const;
  // Allocates the staging pool and the pipeline on first use; fixes the bucket list.
  Status Freeze();
  // Runs fn in the worker arena (or the caller's when num_threads == 0).
  Status InArena(const std::function<Status()>& fn);
  // Stages of the update pipeline (optimizer_pipeline.h); the read stage is regions_->Read.
  Status UpdateStage(int b, int i);
  Status WriteStage(int b, int i);
  Status Fold(int b, int segment, const void* grad, DType dtype, bool overwrite_first);
  // A bucket's state block in host memory: its home, or (NVMe) a temporary buffer read from the
  // drive. `scratch` keeps the temporary alive.
  // read = false: not read (to be overwritten and stored).
  StatusOr<float*> LoadStateBlock(int b, AlignedBuffer* scratch, bool read = true);
  Status StoreStateBlock(int b, float* block);
  Status CopyOutMasters(int b, const float* master);
  Status WidenSegments(int b, float* master);
  void AddWait(Clock::time_point since);

  std::atomic<bool> pin_warned_{false};
  std::unique_ptr<cpu_optim::WorkerArena> arena_;
  bool frozen_ = false;
  Status error_;  // sticky: the first error of asynchronous work
  mutable std::mutex error_mu_;

  // Staging pool: each buffer free, held by the caller (acquired, not yet submitted), or queued
  // (submitted; its fold frees it).
  enum class Staging : uint8_t { kFree, kHeld, kQueued };
  std::mutex staging_mu_;
  std::condition_variable staging_cv_;
  std::vector<HostBuffer> staging_;
  std::vector<Staging> staging_state_ STRATA_GUARDED_BY(staging_mu_);

  // The update of one step, read by the pipeline stages (set by Step after every fold, so after
  // every update of the previous step finished).
  struct Round {
    std::vector<cpu_optim::AnyOptimizer> optimizers;
    std::vector<int64_t> steps;
    float grad_scale = 1.0f;
    Clock::time_point start;
  } round_;
  std::vector<HostBuffer> pipe_buf_;
  std::unique_ptr<WorkQueue> folder_;
  std::unique_ptr<OptimizerPipeline> pipeline_;
  // What WaitBucket, which may run beside any other call, reads: the bucket count and the
  // pipeline, published by AddBucket and Freeze once they are complete.
  std::atomic<int> published_buckets_{0};
  std::atomic<OptimizerPipeline*> published_pipeline_{nullptr};

  int fold_track_ = 0, read_track_ = 0, update_track_ = 0, write_track_ = 0;
  std::atomic<int64_t> steps_{0}, skipped_{0};
  std::atomic<int64_t> update_ns_{0}, wait_ns_{0};
};

Status OffloadOptimizer::Impl::Init() {
  if (o_.buffer_count < 2) {
    return InvalidArgumentError(fmt::format(
        "offload optimizer: buffer_count must be >= 2 (3 keeps read, update and write busy), "
        "got {}",
        o_.buffer_count));
  }
  if (o_.staging_buffers < 1) {
    return InvalidArgumentError(
        fmt::format("offload optimizer: staging_buffers must be >= 1, got {}", o_.staging_buffers));
  }
  if (o_.num_threads < 0) {
    return InvalidArgumentError(fmt::format(
        "offload optimizer: num_threads must be >= 0 (0 = all CPUs), got {}", o_.num_threads));
  }
  if (nvme()) {
    if (o_.nvme_paths.empty()) {
      return InvalidArgumentError(
          "offload optimizer: offload to NVMe needs at least one directory (nvme_path)");
    }
    STRATA_RETURN_IF_ERROR(io::ValidateIoBackendOptions(o_.io));
  }
  StateRegionsOptions ro;
  ro.nvme = nvme();
  ro.nvme_paths = o_.nvme_paths;
  ro.io = o_.io;
  ro.io_backend_factory = o_.io_backend_factory;
  ro.extent_name = StateExtent;
  STRATA_ASSIGN_OR_RETURN(regions_, StateRegions::Create(std::move(ro)));
  if (o_.num_threads > 0) {
    STRATA_ASSIGN_OR_RETURN(
        arena_,
        cpu_optim::WorkerArena::Create(cpu_optim::ThreadingOptions{.num_threads = o_.num_threads}));
  }
  if (o_.trace) {
    fold_track_ = o_.trace->RegisterTrack("offload: gradient fold");
    read_track_ = o_.trace->RegisterTrack("offload: state read");
    update_track_ = o_.trace->RegisterTrack("offload: cpu optimizer");
    write_track_ = o_.trace->RegisterTrack("offload: state write");
  }
  regions_->SetTrace(o_.trace, read_track_);
  folder_ = std::make_unique<WorkQueue>("offload gradient fold");
  return Status::Ok();
}

Status OffloadOptimizer::Impl::CheckUsable() const {
  std::lock_guard lock(error_mu_);
  if (error_.ok()) return Status::Ok();
  return FailedPreconditionError(fmt::format(
      "offload optimizer: unusable after an earlier error ({}); create a new one and load a "
      "saved state",
      error_.ToString()));
}

Status OffloadOptimizer::Impl::Fail(Status status) {
  if (!status.ok()) {
    std::lock_guard lock(error_mu_);
    if (error_.ok()) error_ = status;
  }
  return status;
}

Status OffloadOptimizer::Impl::CheckBucket(int bucket, const char* what) const {
  if (bucket < 0 || bucket >= static_cast<int>(buckets_.size())) {
    return InvalidArgumentError(
        fmt::format("{}: unknown bucket {} (there are {})", what, bucket, buckets_.size()));
  }
  return Status::Ok();
}

Status OffloadOptimizer::Impl::InArena(const std::function<Status()>& fn) {
  if (!arena_) return fn();
  Status s;
  arena_->Execute([&] { s = fn(); });
  return s;
}

void OffloadOptimizer::Impl::AddWait(Clock::time_point since) {
  wait_ns_.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since).count(),
      std::memory_order_relaxed);
}

StatusOr<int> OffloadOptimizer::Impl::AddGroup(const cpu_optim::AnyOptimizer& optimizer) {
  STRATA_RETURN_IF_ERROR(CheckUsable());
  STRATA_RETURN_IF_ERROR(cpu_optim::Validate(optimizer));
  groups_.push_back(Group{optimizer, 0});
  return static_cast<int>(groups_.size()) - 1;
}

Status OffloadOptimizer::Impl::SetGroupOptimizer(int group,
                                                 const cpu_optim::AnyOptimizer& optimizer) {
  if (group < 0 || group >= static_cast<int>(groups_.size())) {
    return InvalidArgumentError(
        fmt::format("offload optimizer: unknown group {} (there are {})", group, groups_.size()));
  }
  STRATA_RETURN_IF_ERROR(cpu_optim::Validate(optimizer));
  const cpu_optim::AnyOptimizer& old = groups_[group].optimizer;
  // The layout of a flat tensor stands for every bucket's, so a config that no bucket would
  // notice yet (no bucket added so far) is refused the same way.
  const std::vector<std::vector<int64_t>> probe = {{2, 3}, {5}};
  const auto old_layout = BucketLayout(old, probe, nullptr);
  const auto new_layout = BucketLayout(optimizer, probe, nullptr);
  if (optimizer.kind != old.kind || !SameLayout(old_layout, new_layout)) {
    return InvalidArgumentError(fmt::format(
        "offload optimizer: group {} is {} with {}; its new config is {} with {}: the kind, "
        "amsgrad, whether SGD has momentum (0 or not) and whether Adafactor has beta1 cannot "
        "change after the group was added",
        group, cpu_optim::OptimizerKindName(old.kind), SectionNames(old_layout),
        cpu_optim::OptimizerKindName(optimizer.kind), SectionNames(new_layout)));
  }
  groups_[group].optimizer = optimizer;
  return Status::Ok();
}

Status OffloadOptimizer::Impl::WidenSegments(int b, float* master) {
  const Bucket& k = buckets_[b];
  for (size_t s = 0; s < k.segments.size(); ++s) {
    STRATA_RETURN_IF_ERROR(cpu_optim::ConvertToF32(k.segments[s].data, k.dtype,
                                                   master + k.offsets[s], k.segments[s].num_elems));
  }
  return Status::Ok();
}

Status OffloadOptimizer::Impl::CopyOutMasters(int b, const float* master) {
  const Bucket& k = buckets_[b];
  for (size_t s = 0; s < k.segments.size(); ++s) {
    STRATA_RETURN_IF_ERROR(cpu_optim::ConvertFromF32(master + k.offsets[s], k.segments[s].data,
                                                     k.dtype, k.segments[s].num_elems));
  }
  return Status::Ok();
}

StatusOr<int> OffloadOptimizer::Impl::AddBucket(int group, DType dtype,
                                                std::span<const OffloadSegment> segments) {
  STRATA_RETURN_IF_ERROR(CheckUsable());
  if (frozen_) {
    return FailedPreconditionError(
        "offload optimizer: add every bucket before the first gradient, state access or step");
  }
  if (group < 0 || group >= static_cast<int>(groups_.size())) {
    return InvalidArgumentError(fmt::format(
        "offload optimizer: AddBucket: unknown group {} (there are {})", group, groups_.size()));
  }
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    return InvalidArgumentError(fmt::format(
        "offload optimizer: AddBucket: parameter dtype must be fp32, fp16 or bf16, got {}",
        DTypeName(dtype)));
  }
  if (segments.empty()) {
    return InvalidArgumentError("offload optimizer: AddBucket: a bucket needs >= 1 segment");
  }
  const size_t elem = SizeOf(dtype);
  Bucket k;
  k.group = group;
  k.dtype = dtype;
  for (size_t s = 0; s < segments.size(); ++s) {
    const OffloadSegment& seg = segments[s];
    if (seg.data == nullptr || seg.num_elems <= 0) {
      return InvalidArgumentError(fmt::format(
          "offload optimizer: AddBucket: segment {} has data {} and {} elements; each needs "
          "memory and > 0 elements",
          s, seg.data, seg.num_elems));
    }
    if (seg.num_elems > kMaxBucketElems - k.num_elems) {
      return InvalidArgumentError(fmt::format(
          "offload optimizer: AddBucket: segment {} has {} elements, which makes the bucket more "
          "than the 2^50 elements a bucket can hold",
          s, seg.num_elems));
    }
    if (reinterpret_cast<uintptr_t>(seg.data) % elem != 0) {
      return InvalidArgumentError(fmt::format(
          "offload optimizer: AddBucket: segment {} at {} is not aligned to its {}-byte elements",
          s, seg.data, elem));
    }
    if (!seg.shape.empty() && !ShapeHolds(seg.shape, seg.num_elems)) {
      return InvalidArgumentError(fmt::format(
          "offload optimizer: AddBucket: segment {} has shape [{}] for {} elements; a shape's "
          "dimensions must be > 0 with product num_elems (or give no shape: flat)",
          s, fmt::join(seg.shape, ", "), seg.num_elems));
    }
    k.segments.push_back(seg);
    k.shapes.push_back(SegmentShape(seg));
    k.offsets.push_back(k.num_elems);
    k.num_elems += seg.num_elems;
  }
  // No segment may overlap another of any bucket: an update would write one with two values.
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  auto add_ranges = [&](const Bucket& bk) {
    for (const OffloadSegment& seg : bk.segments) {
      const auto a = reinterpret_cast<uintptr_t>(seg.data);
      ranges.emplace_back(a, a + seg.num_elems * SizeOf(bk.dtype));
    }
  };
  for (const Bucket& bk : buckets_) add_ranges(bk);
  add_ranges(k);
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return InvalidArgumentError(
          "offload optimizer: AddBucket: a segment overlaps another segment of this optimizer");
    }
  }
  const cpu_optim::AnyOptimizer& opt = groups_[group].optimizer;
  k.sections = BucketLayout(opt, k.shapes, &k.ranges);
  k.num_tensors = 1 + static_cast<int>(k.sections.size());
  for (int t = 0; t < k.num_tensors; ++t) {
    k.tensor_offsets.push_back(k.state_bytes);
    k.state_bytes += TensorStride(TensorBytes(k, t));
  }
  k.received.assign(k.segments.size(), 0);
  k.stats.assign(k.segments.size(), cpu_optim::GradStats{});
  STRATA_ASSIGN_OR_RETURN(k.accum, AlignedBuffer::Allocate(k.num_elems * sizeof(float), 64));

  const int b = static_cast<int>(buckets_.size());
  // The initial block: in its host home, or (NVMe) in a temporary buffer written to the extent.
  AlignedBuffer scratch;
  std::byte* block = nullptr;
  if (nvme()) {
    STRATA_ASSIGN_OR_RETURN(scratch, AlignedBuffer::Allocate(k.state_bytes));
    block = scratch.data();
  }
  buckets_.push_back(std::move(k));
  Bucket& kb = buckets_.back();
  StatusOr<int> unit = regions_->AddUnit(StateBytes(kb));
  Status s = unit.status();
  if (s.ok() && !nvme()) block = regions_->Region(b, 0);
  if (s.ok()) s = WidenSegments(b, reinterpret_cast<float*>(block));
  for (int t = 1; s.ok() && t < kb.num_tensors; ++t) {
    cpu_optim::InitializeState(kb.sections[t - 1],
                               std::span(block + kb.tensor_offsets[t], TensorBytes(kb, t)));
  }
  if (s.ok() && nvme()) s = regions_->WriteFrom(b, std::span(block, StateBytes(kb)));
  if (!s.ok()) {
    // An extent allocated for a bucket that failed stays unused (the store frees nothing), and
    // a retry uses the same name: that is kAlreadyExists, so say how to recover.
    if (unit.ok()) regions_->DropLastUnit();
    buckets_.pop_back();
    if (nvme()) return Fail(s);
    return s;
  }
  published_buckets_.store(b + 1, std::memory_order_release);
  return b;
}

Status OffloadOptimizer::Impl::Freeze() {
  if (frozen_) return Status::Ok();
  if (buckets_.empty()) {
    return FailedPreconditionError("offload optimizer: no bucket was added (AddBucket)");
  }
  uint64_t max_grad_bytes = 0, max_state_bytes = 0;
  for (const Bucket& k : buckets_) {
    max_grad_bytes = std::max<uint64_t>(max_grad_bytes, k.num_elems * sizeof(float));
    max_state_bytes = std::max(max_state_bytes, StateBytes(k));
  }
  std::vector<HostBuffer> staging;
  for (int i = 0; i < o_.staging_buffers; ++i) {
    STRATA_ASSIGN_OR_RETURN(HostBuffer h,
                            HostBuffer::Allocate(max_grad_bytes, o_.pin_memory, &pin_warned_));
    staging.push_back(std::move(h));
  }
  if (nvme()) {
    std::vector<std::span<std::byte>> views;
    for (int i = 0; i < o_.buffer_count; ++i) {
      STRATA_ASSIGN_OR_RETURN(HostBuffer h,
                              HostBuffer::Allocate(max_state_bytes, o_.pin_memory, &pin_warned_));
      views.emplace_back(h.data(), h.size_bytes());
      pipe_buf_.push_back(std::move(h));
    }
    regions_->SetPipelineBuffers(std::move(views));
  }
  {
    std::lock_guard lock(staging_mu_);
    staging_ = std::move(staging);
    staging_state_.assign(staging_.size(), Staging::kFree);
  }
  OptimizerPipeline::Stages stages;
  if (nvme()) {
    stages.read = [this](int b, int i) { return regions_->Read(b, i); };
    stages.write = [this](int b, int i) { return WriteStage(b, i); };
  }
  stages.update = [this](int b, int i) { return UpdateStage(b, i); };
  pipeline_ = std::make_unique<OptimizerPipeline>(static_cast<int>(buckets_.size()),
                                                  nvme() ? o_.buffer_count : 1, std::move(stages));
  published_pipeline_.store(pipeline_.get(), std::memory_order_release);
  frozen_ = true;
  return Status::Ok();
}

StatusOr<std::span<std::byte>> OffloadOptimizer::Impl::AcquireStaging(int bucket, DType dtype) {
  STRATA_RETURN_IF_ERROR(CheckUsable());
  STRATA_RETURN_IF_ERROR(CheckBucket(bucket, "offload optimizer: AcquireStaging"));
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    return InvalidArgumentError(fmt::format(
        "offload optimizer: AcquireStaging: gradient dtype must be fp32, fp16 or bf16, got {}",
        DTypeName(dtype)));
  }
  STRATA_RETURN_IF_ERROR(Freeze());
  const auto t0 = Clock::now();
  std::unique_lock lock(staging_mu_);
  int index = -1;
  for (;;) {
    const auto free = std::find(staging_state_.begin(), staging_state_.end(), Staging::kFree);
    if (free != staging_state_.end()) {
      index = static_cast<int>(free - staging_state_.begin());
      break;
    }
    // Folds return staging buffers; a fold that failed returns its buffer too, so this wakes.
    // With none queued every buffer is the caller's (calls on a handle do not overlap), so no
    // fold would ever return one: say so rather than wait forever.
    if (std::find(staging_state_.begin(), staging_state_.end(), Staging::kQueued) ==
        staging_state_.end()) {
      return FailedPreconditionError(fmt::format(
          "offload optimizer: AcquireStaging: all {} staging buffers are acquired and none was "
          "submitted, so none would come back: submit one (SubmitGradient) first, or create the "
          "optimizer with more staging buffers",
          staging_state_.size()));
    }
    staging_cv_.wait(lock);
  }
  staging_state_[index] = Staging::kHeld;
  lock.unlock();
  AddWait(t0);
  return std::span<std::byte>(staging_[index].data(), buckets_[bucket].num_elems * SizeOf(dtype));
}

Status OffloadOptimizer::Impl::Fold(int b, int segment, const void* grad, DType dtype,
                                    bool overwrite_first) {
  trace::ScopedTraceEvent t(o_.trace, fold_track_, "fold gradient", trace::Category::kCpuOptimizer);
  Bucket& k = buckets_[b];
  const size_t elem = SizeOf(dtype);
  const int first = segment < 0 ? 0 : segment;
  const int last = segment < 0 ? static_cast<int>(k.segments.size()) : segment + 1;
  const auto* src = static_cast<const std::byte*>(grad);
  return InArena([&]() -> Status {
    for (int s = first; s < last; ++s) {
      const int64_t n = k.segments[s].num_elems;
      // Whole-bucket gradients are folded segment by segment, so the statistics (and thus the
      // norm) do not depend on how the gradient was handed in.
      const std::byte* g = segment < 0 ? src + k.offsets[s] * elem : src;
      // received[s] was counted at submission; this is the first gradient since the last step
      // when the submission said so.
      STRATA_ASSIGN_OR_RETURN(
          k.stats[s], cpu_optim::AccumulateGrad(
                          std::span<float>(k.accum.as<float>() + k.offsets[s], n),
                          cpu_optim::GradView{g, dtype}, overwrite_first, /*want_stats=*/true));
    }
    return Status::Ok();
  });
}

Status OffloadOptimizer::Impl::SubmitGradient(int bucket, int segment, const void* grad,
                                              DType dtype, int64_t n,
                                              std::function<Status()> ready) {
  STRATA_RETURN_IF_ERROR(CheckUsable());
  STRATA_RETURN_IF_ERROR(CheckBucket(bucket, "offload optimizer: SubmitGradient"));
  Bucket& k = buckets_[bucket];
  if (segment < -1 || segment >= static_cast<int>(k.segments.size())) {
    return InvalidArgumentError(
        fmt::format("offload optimizer: SubmitGradient: bucket {} has no segment {} (it has {}; "
                    "-1 = the whole bucket)",
                    bucket, segment, k.segments.size()));
  }
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    return InvalidArgumentError(fmt::format(
        "offload optimizer: SubmitGradient: gradient dtype must be fp32, fp16 or bf16, got {}",
        DTypeName(dtype)));
  }
  const int64_t want = segment < 0 ? k.num_elems : k.segments[segment].num_elems;
  if (n != want) {
    return InvalidArgumentError(fmt::format(
        "offload optimizer: SubmitGradient: bucket {} {} has {} elements, the gradient {}", bucket,
        segment < 0 ? std::string("(whole)") : fmt::format("segment {}", segment), want, n));
  }
  if (grad == nullptr) {
    return InvalidArgumentError("offload optimizer: SubmitGradient: grad is NULL");
  }
  STRATA_RETURN_IF_ERROR(Freeze());
  // Each micro-batch hands every segment once: a segment may be at most one gradient ahead of
  // the least-served segment of the optimizer.
  int64_t least = INT64_MAX;
  for (const Bucket& bk : buckets_) {
    for (int64_t r : bk.received) least = std::min(least, r);
  }
  const int first = segment < 0 ? 0 : segment;
  const int last = segment < 0 ? static_cast<int>(k.segments.size()) : segment + 1;
  for (int s = first; s < last; ++s) {
    if (k.received[s] > least) {
      return FailedPreconditionError(fmt::format(
          "offload optimizer: bucket {} segment {} already has {} gradient(s) since the last "
          "step while another segment has {}: each micro-batch hands every segment exactly once",
          bucket, s, k.received[s], least));
    }
  }
  const bool overwrite = k.received[first] == 0;
  for (int s = first; s < last; ++s) ++k.received[s];

  // Is grad one of our staging buffers? Then the fold hands it back.
  int staging_index = -1;
  for (size_t i = 0; i < staging_.size(); ++i) {
    if (staging_[i].data() == grad) staging_index = static_cast<int>(i);
  }
  if (staging_index >= 0) {
    std::lock_guard lock(staging_mu_);
    staging_state_[staging_index] = Staging::kQueued;
  }
  folder_->Submit([=, this, ready = std::move(ready)]() -> Status {
    Status s = Status::Ok();
    if (ready) s = ready();
    // The bucket's previous update reads the accumulator: fold after it finished (its NVMe
    // write-back does not touch the accumulator and may still run).
    if (s.ok()) s = pipeline_->WaitUpdated(bucket);
    if (s.ok()) s = Fold(bucket, segment, grad, dtype, overwrite);
    if (staging_index >= 0) {
      std::lock_guard lock(staging_mu_);
      staging_state_[staging_index] = Staging::kFree;
      staging_cv_.notify_all();
    }
    return s;
  });
  return Status::Ok();
}

Status OffloadOptimizer::Impl::WaitGradients() {
  STRATA_RETURN_IF_ERROR(CheckUsable());
  if (!folder_) return Status::Ok();
  return Fail(folder_->Drain());
}

Status OffloadOptimizer::Impl::DiscardGradients() {
  STRATA_RETURN_IF_ERROR(CheckUsable());
  if (!frozen_) return Status::Ok();  // no gradient or staging buffer yet
  // A queued fold still writes the accumulator and returns its staging buffer: let it finish,
  // then forget what it folded (received 0: the next fold overwrites).
  STRATA_RETURN_IF_ERROR(Fail(folder_->Drain()));
  for (Bucket& k : buckets_) std::fill(k.received.begin(), k.received.end(), 0);
  std::lock_guard lock(staging_mu_);
  std::replace(staging_state_.begin(), staging_state_.end(), Staging::kHeld, Staging::kFree);
  staging_cv_.notify_all();
  return Status::Ok();
}

Status OffloadOptimizer::Impl::Step(const OffloadStepOptions& options, OffloadStepResult* result) {
  STRATA_RETURN_IF_ERROR(CheckUsable());
  if (!std::isfinite(options.loss_scale) || options.loss_scale <= 0) {
    return InvalidArgumentError(fmt::format(
        "offload optimizer: Step: loss_scale must be finite and > 0, got {}", options.loss_scale));
  }
  if (!std::isfinite(options.max_grad_norm) || options.max_grad_norm < 0) {
    return InvalidArgumentError(fmt::format(
        "offload optimizer: Step: max_grad_norm must be finite and >= 0 (0 = no clipping), got {}",
        options.max_grad_norm));
  }
  if (buckets_.empty()) {
    return FailedPreconditionError("offload optimizer: Step: no bucket was added (AddBucket)");
  }
  const int64_t n = buckets_[0].received[0];
  if (n == 0) {
    return FailedPreconditionError(
        "offload optimizer: Step with no gradient since the last step (bucket 0 segment 0 has "
        "none); hand every segment its gradient for each micro-batch (SubmitGradient) before "
        "stepping");
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (size_t s = 0; s < buckets_[b].received.size(); ++s) {
      if (buckets_[b].received[s] != n) {
        return FailedPreconditionError(fmt::format(
            "offload optimizer: Step before every gradient arrived: bucket {} segment {} has {} "
            "gradient(s) since the last step, bucket 0 segment 0 has {}; hand every segment its "
            "gradient for each micro-batch (SubmitGradient) before stepping",
            b, s, buckets_[b].received[s], n));
      }
    }
  }
  STRATA_RETURN_IF_ERROR(Freeze());
  // Every fold waited for its bucket's previous update, so once the folds are done, the
  // previous step's update is complete too and round_ may be replaced.
  const auto t0 = Clock::now();
  STRATA_RETURN_IF_ERROR(Fail(folder_->Drain()));
  STRATA_RETURN_IF_ERROR(Fail(pipeline_->Drain()));
  AddWait(t0);

  cpu_optim::GradStats total;
  for (const Bucket& k : buckets_) {
    for (const cpu_optim::GradStats& s : k.stats) cpu_optim::Merge(total, s);
  }
  for (Bucket& k : buckets_) std::fill(k.received.begin(), k.received.end(), 0);
  OffloadStepResult r;
  r.micro_batches = static_cast<int>(n);
  r.grad_norm = std::sqrt(total.sum_squares) / options.loss_scale;
  if (total.nonfinite || !std::isfinite(r.grad_norm)) {
    r.skipped = true;
    skipped_.fetch_add(1, std::memory_order_relaxed);
    if (result) *result = r;
    return Status::Ok();
  }
  // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when < 1.
  float clip = 1.0f;
  if (options.max_grad_norm > 0) {
    const double coef = options.max_grad_norm / (r.grad_norm + 1e-6);
    if (coef < 1.0) clip = static_cast<float>(coef);
  }
  round_.optimizers.clear();
  round_.steps.clear();
  for (Group& g : groups_) {
    ++g.step;
    round_.optimizers.push_back(g.optimizer);
    round_.steps.push_back(g.step);
  }
  round_.grad_scale = options.loss_scale == 1.0f ? clip : clip / options.loss_scale;
  round_.start = Clock::now();
  steps_.fetch_add(1, std::memory_order_relaxed);
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) pipeline_->Submit(b);
  if (result) *result = r;
  return Status::Ok();
}

Status OffloadOptimizer::Impl::UpdateStage(int b, int i) {
  Status s;
  {
    trace::ScopedTraceEvent t(o_.trace, update_track_, "optimizer update",
                              trace::Category::kCpuOptimizer);
    Bucket& k = buckets_[b];
    std::byte* block = regions_->Region(b, i);
    const cpu_optim::AnyOptimizer& opt = round_.optimizers[k.group];
    const cpu_optim::OptimStep step{.step = round_.steps[k.group], .grad_scale = round_.grad_scale};
    s = InArena([&]() -> Status {
      std::vector<std::span<std::byte>> state;
      state.reserve(k.sections.size());
      for (size_t seg = 0; seg < k.segments.size(); ++seg) {
        const int64_t off = k.offsets[seg];
        const auto len = static_cast<size_t>(k.segments[seg].num_elems);
        // The segment's parts of the sections it has, in its own layout's order (which is
        // the bucket's order with the sections it has no part in left out).
        state.clear();
        for (size_t x = 0; x < k.sections.size(); ++x) {
          const OffloadStateRange r = k.ranges[seg][x];
          if (r.num_elems == 0) continue;
          const size_t elem = k.sections[x].dtype == cpu_optim::StateDType::kU8 ? 1 : 4;
          state.emplace_back(block + k.tensor_offsets[x + 1] + r.offset_elems * elem,
                             static_cast<size_t>(r.num_elems) * elem);
        }
        // Each segment is one tensor: a per-element optimizer gives the same bits as one call
        // over the flat arrays, and each segment's new weights go straight into it.
        STRATA_RETURN_IF_ERROR(cpu_optim::UpdateState(
            opt, step, std::span(&k.shapes[seg], 1),
            std::span<float>(reinterpret_cast<float*>(block) + off, len), state,
            cpu_optim::GradView{k.accum.as<float>() + off, DType::kF32},
            cpu_optim::CopyOut{k.segments[seg].data, k.dtype}));
      }
      return Status::Ok();
    });
  }
  if (s.ok() && !nvme() && b + 1 == static_cast<int>(buckets_.size())) {
    update_ns_.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - round_.start).count(),
        std::memory_order_relaxed);
  }
  return s;
}

Status OffloadOptimizer::Impl::WriteStage(int b, int i) {
  Status s;
  {
    trace::ScopedTraceEvent t(o_.trace, write_track_, "write optimizer state",
                              trace::Category::kNvmeWrite);
    s = regions_->Write(b, i);
  }
  if (s.ok() && b + 1 == static_cast<int>(buckets_.size())) {
    update_ns_.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - round_.start).count(),
        std::memory_order_relaxed);
  }
  return s;
}

// May run beside any other call but the destructor: reads only what AddBucket and Freeze publish.
Status OffloadOptimizer::Impl::WaitBucket(int bucket) {
  STRATA_RETURN_IF_ERROR(CheckUsable());
  const int num_buckets = published_buckets_.load(std::memory_order_acquire);
  if (bucket < 0 || bucket >= num_buckets) {
    return InvalidArgumentError(fmt::format(
        "offload optimizer: WaitBucket: unknown bucket {} (there are {})", bucket, num_buckets));
  }
  OptimizerPipeline* pipeline = published_pipeline_.load(std::memory_order_acquire);
  if (pipeline == nullptr) return Status::Ok();
  const auto t0 = Clock::now();
  Status s = pipeline->WaitUpdated(bucket);
  AddWait(t0);
  return Fail(s);
}

Status OffloadOptimizer::Impl::Synchronize() {
  STRATA_RETURN_IF_ERROR(CheckUsable());
  const auto t0 = Clock::now();
  Status s = folder_->Drain();
  if (s.ok() && pipeline_) s = pipeline_->Drain();
  AddWait(t0);
  return Fail(s);
}

StatusOr<float*> OffloadOptimizer::Impl::LoadStateBlock(int b, AlignedBuffer* scratch, bool read) {
  if (!nvme()) return reinterpret_cast<float*>(regions_->Region(b, 0));
  STRATA_ASSIGN_OR_RETURN(*scratch, AlignedBuffer::Allocate(StateBytes(buckets_[b])));
  if (read) STRATA_RETURN_IF_ERROR(Fail(regions_->ReadTo(b, scratch->span())));
  return scratch->as<float>();
}

Status OffloadOptimizer::Impl::StoreStateBlock(int b, float* block) {
  if (!nvme()) return Status::Ok();  // the block is the home itself
  return Fail(regions_->WriteFrom(
      b, std::span(reinterpret_cast<const std::byte*>(block), StateBytes(buckets_[b]))));
}

Status OffloadOptimizer::Impl::CheckTensor(int bucket, int tensor, const char* what) const {
  STRATA_RETURN_IF_ERROR(CheckBucket(bucket, what));
  const Bucket& k = buckets_[bucket];
  if (tensor < 0 || tensor >= k.num_tensors) {
    return InvalidArgumentError(
        fmt::format("{}: bucket {} has tensors 0..{} (0 = master weights, then {}), not {}", what,
                    bucket, k.num_tensors - 1, LayoutString(k.sections), tensor));
  }
  return Status::Ok();
}

Status OffloadOptimizer::Impl::CopyTensor(int bucket, int tensor, std::span<std::byte> out,
                                          std::span<const std::byte> in) {
  STRATA_RETURN_IF_ERROR(Synchronize());
  const Bucket& k = buckets_[bucket];
  AlignedBuffer scratch;
  STRATA_ASSIGN_OR_RETURN(float* block, LoadStateBlock(bucket, &scratch));
  std::byte* at = reinterpret_cast<std::byte*>(block) + k.tensor_offsets[tensor];
  if (!out.empty()) {
    std::memcpy(out.data(), at, out.size());
    return Status::Ok();
  }
  std::memcpy(at, in.data(), in.size());
  STRATA_RETURN_IF_ERROR(StoreStateBlock(bucket, block));
  if (tensor == 0) STRATA_RETURN_IF_ERROR(CopyOutMasters(bucket, block));
  return Status::Ok();
}

Status OffloadOptimizer::Impl::ReadStateBytes(int bucket, int tensor, std::span<std::byte> out) {
  const char* what = "offload optimizer: ReadStateBytes";
  STRATA_RETURN_IF_ERROR(CheckTensor(bucket, tensor, what));
  const uint64_t want = TensorBytes(buckets_[bucket], tensor);
  if (out.size() != want) {
    return InvalidArgumentError(fmt::format("{}: {} has {} bytes, the buffer {}", what,
                                            TensorName(bucket, tensor), want, out.size()));
  }
  if (want == 0) return Synchronize();
  return CopyTensor(bucket, tensor, out, {});
}

Status OffloadOptimizer::Impl::WriteStateBytes(int bucket, int tensor,
                                               std::span<const std::byte> in) {
  const char* what = "offload optimizer: WriteStateBytes";
  STRATA_RETURN_IF_ERROR(CheckTensor(bucket, tensor, what));
  const uint64_t want = TensorBytes(buckets_[bucket], tensor);
  if (in.size() != want) {
    return InvalidArgumentError(fmt::format("{}: {} has {} bytes, the buffer {}", what,
                                            TensorName(bucket, tensor), want, in.size()));
  }
  if (want == 0) return Synchronize();
  return CopyTensor(bucket, tensor, {}, in);
}

Status OffloadOptimizer::Impl::ReadState(int bucket, int tensor, std::span<float> out) {
  const char* what = "offload optimizer: ReadState";
  STRATA_RETURN_IF_ERROR(CheckTensor(bucket, tensor, what));
  const Bucket& k = buckets_[bucket];
  if (TensorIsU8(k, tensor)) {
    return InvalidArgumentError(
        fmt::format("{}: {} holds 8-bit codes, not fp32 values: read it with ReadStateBytes", what,
                    TensorName(bucket, tensor)));
  }
  if (static_cast<int64_t>(out.size()) != TensorElems(k, tensor)) {
    return InvalidArgumentError(fmt::format("{}: {} has {} elements, the buffer {}", what,
                                            TensorName(bucket, tensor), TensorElems(k, tensor),
                                            out.size()));
  }
  return CopyTensor(bucket, tensor, std::as_writable_bytes(out), {});
}

Status OffloadOptimizer::Impl::WriteState(int bucket, int tensor, std::span<const float> in) {
  const char* what = "offload optimizer: WriteState";
  STRATA_RETURN_IF_ERROR(CheckTensor(bucket, tensor, what));
  const Bucket& k = buckets_[bucket];
  if (TensorIsU8(k, tensor)) {
    return InvalidArgumentError(
        fmt::format("{}: {} holds 8-bit codes, not fp32 values: write it with WriteStateBytes",
                    what, TensorName(bucket, tensor)));
  }
  if (static_cast<int64_t>(in.size()) != TensorElems(k, tensor)) {
    return InvalidArgumentError(fmt::format("{}: {} has {} elements, the buffer {}", what,
                                            TensorName(bucket, tensor), TensorElems(k, tensor),
                                            in.size()));
  }
  return CopyTensor(bucket, tensor, {}, std::as_bytes(in));
}

Status OffloadOptimizer::Impl::ReloadMasters(int bucket) {
  STRATA_RETURN_IF_ERROR(CheckBucket(bucket, "offload optimizer: ReloadMasters"));
  STRATA_RETURN_IF_ERROR(Synchronize());
  AlignedBuffer scratch;
  STRATA_ASSIGN_OR_RETURN(float* block, LoadStateBlock(bucket, &scratch));
  STRATA_RETURN_IF_ERROR(WidenSegments(bucket, block));
  return StoreStateBlock(bucket, block);
}

Status OffloadOptimizer::Impl::SetGroupStep(int group, int64_t step) {
  if (group < 0 || group >= static_cast<int>(groups_.size())) {
    return InvalidArgumentError(
        fmt::format("offload optimizer: unknown group {} (there are {})", group, groups_.size()));
  }
  if (step < 0) {
    return InvalidArgumentError(
        fmt::format("offload optimizer: a step count must be >= 0, got {}", step));
  }
  STRATA_RETURN_IF_ERROR(Synchronize());
  groups_[group].step = step;
  return Status::Ok();
}

Status OffloadOptimizer::Impl::Save(const std::string& dir) {
  STRATA_RETURN_IF_ERROR(Synchronize());
  if (dir.empty()) return InvalidArgumentError("offload optimizer: Save: empty directory name");
  std::filesystem::path target = std::filesystem::absolute(dir).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();
  STRATA_RETURN_IF_ERROR(CheckSaveTarget(target));
  const std::string parent = target.parent_path().string();
  auto made =
      MakeTempDirectory(fmt::format("{}/.{}.tmp-XXXXXX", parent, target.filename().string()));
  if (!made.ok()) return made.status().WithContext("offload optimizer: Save");
  const std::string temp = *made;
  Status s = [&]() -> Status {
    std::vector<formats::SafetensorsWriter::TensorSpec> specs;
    Json buckets = Json::array();
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Bucket& k = buckets_[b];
      for (int t = 0; t < k.num_tensors; ++t) {
        specs.push_back(
            {TensorName(static_cast<int>(b), t),
             TensorIsU8(k, t) ? formats::TensorDType::U8() : formats::TensorDType(DType::kF32),
             {TensorElems(k, t)}});
      }
      Json segs = Json::array();
      for (const OffloadSegment& seg : k.segments) segs.push_back(seg.num_elems);
      buckets.push_back({{"group", k.group},
                         {"dtype", std::string(DTypeName(k.dtype))},
                         {"segments", segs},
                         {"shapes", k.shapes}});
    }
    const std::string file = temp + "/" + kOffloadTensorFile;
    STRATA_ASSIGN_OR_RETURN(
        formats::SafetensorsWriter w,
        formats::SafetensorsWriter::Create(file, specs, {{"format", kOffloadFormat}}));
    for (size_t b = 0; b < buckets_.size(); ++b) {
      AlignedBuffer scratch;
      STRATA_ASSIGN_OR_RETURN(float* block, LoadStateBlock(static_cast<int>(b), &scratch));
      const Bucket& k = buckets_[b];
      for (int t = 0; t < k.num_tensors; ++t) {
        STRATA_RETURN_IF_ERROR(w.Append(std::span(
            reinterpret_cast<const std::byte*>(block) + k.tensor_offsets[t], TensorBytes(k, t))));
      }
    }
    STRATA_ASSIGN_OR_RETURN(formats::SafetensorsWriter::Result written, w.Finish());
    Json groups = Json::array();
    for (const Group& g : groups_) {
      groups.push_back({{"optimizer", OptimizerToJson(g.optimizer)}, {"step", g.step}});
    }
    Json manifest = {{"format", kOffloadFormat},
                     {"format_version", kOffloadFormatVersion},
                     {"groups", groups},
                     {"buckets", buckets},
                     {"files", Json::array({{{"name", kOffloadTensorFile},
                                             {"size_bytes", written.size_bytes},
                                             {"xxh3", fmt::format("{:016x}", written.xxh3)}}})}};
    STRATA_RETURN_IF_ERROR(
        WriteNewFile(temp + "/" + kManifestFileName, manifest.dump(2) + "\n", 0600));
    STRATA_RETURN_IF_ERROR(FsyncDirectory(temp));
    // The old state (if any) is exchanged with the new one in one step (MoveIntoPlace): `dir`
    // always holds a complete state.
    std::string displaced;
    STRATA_RETURN_IF_ERROR(MoveIntoPlace(temp, target.string(), &displaced));
    if (!displaced.empty()) RemoveTree(displaced);
    return Status::Ok();
  }();
  if (!s.ok()) RemoveTree(temp);
  return s;
}

Status OffloadOptimizer::Impl::Load(const std::string& dir) {
  STRATA_RETURN_IF_ERROR(Synchronize());
  const std::string where = fmt::format("offload optimizer: Load '{}'", dir);
  STRATA_ASSIGN_OR_RETURN(
      std::string text,
      ReadSmallFile(dir + "/" + kManifestFileName, {.max_bytes = 64 << 20,
                                                    .follow_symlinks = false,
                                                    .unusable_code = StatusCode::kDataLoss}));
  // Everything is checked before anything changes. The manifest may be damaged or made by hand:
  // every field is read with its type and range (JsonFields), and text from it is quoted escaped.
  const std::string manifest = fmt::format("{}: {}", where, kManifestFileName);
  StatusOr<Json> parsed = ParseJsonBounded(text);
  if (!parsed.ok()) {
    return DataLossError(fmt::format("{}: {}", manifest, parsed.status().message()));
  }
  const Json& m = *parsed;
  const JsonFields top(m, manifest, "");
  STRATA_ASSIGN_OR_RETURN(const std::string format, top.String("format"));
  if (format != kOffloadFormat) {
    return InvalidArgumentError(fmt::format("{}: not an offload optimizer state (format '{}')",
                                            where, Excerpt(format, 40)));
  }
  STRATA_ASSIGN_OR_RETURN(const int64_t version, top.Int("format_version", 0, INT32_MAX));
  if (version != kOffloadFormatVersion) {
    return FailedPreconditionError(fmt::format("{}: format version {}, this build reads version {}",
                                               where, version, kOffloadFormatVersion));
  }
  STRATA_ASSIGN_OR_RETURN(const Json* groups, top.Get("groups", Json::value_t::array));
  if (groups->size() != groups_.size()) {
    return InvalidArgumentError(fmt::format("{}: the saved state has {} groups, this optimizer {}",
                                            where, groups->size(), groups_.size()));
  }
  std::vector<cpu_optim::AnyOptimizer> new_optimizers;
  std::vector<int64_t> new_steps;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const JsonFields jg((*groups)[g], manifest, fmt::format("groups[{}]", g));
    STRATA_ASSIGN_OR_RETURN(const Json* opt, jg.Get("optimizer", Json::value_t::object));
    STRATA_ASSIGN_OR_RETURN(
        const std::string kind,
        JsonFields(*opt, manifest, fmt::format("groups[{}].optimizer", g)).String("kind"));
    const std::string_view mine = cpu_optim::OptimizerKindName(groups_[g].optimizer.kind);
    if (kind != mine) {
      return InvalidArgumentError(
          fmt::format("{}: group {} was {}, here it is {}", where, g, Excerpt(kind, 40), mine));
    }
    STRATA_ASSIGN_OR_RETURN(cpu_optim::AnyOptimizer o,
                            OptimizerFromJson(*opt, fmt::format("{}: group {}", where, g)));
    if (Status v = cpu_optim::Validate(o); !v.ok()) {
      return DataLossError(fmt::format("{}: group {}: {}", where, g, v.message()));
    }
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Bucket& k = buckets_[b];
      if (k.group != static_cast<int>(g)) continue;
      const auto saved = BucketLayout(o, k.shapes, nullptr);
      if (!SameLayout(saved, k.sections)) {
        return InvalidArgumentError(fmt::format(
            "{}: group {}'s saved config gives bucket {} the state ({}), here it has ({}) "
            "(amsgrad, SGD momentum or Adafactor's beta1 differ)",
            where, g, b, LayoutString(saved), LayoutString(k.sections)));
      }
    }
    STRATA_ASSIGN_OR_RETURN(const int64_t step, jg.Int("step", 0, INT64_MAX));
    new_optimizers.push_back(o);
    new_steps.push_back(step);
  }
  STRATA_ASSIGN_OR_RETURN(const Json* buckets, top.Get("buckets", Json::value_t::array));
  if (buckets->size() != buckets_.size()) {
    return InvalidArgumentError(fmt::format("{}: the saved state has {} buckets, this optimizer {}",
                                            where, buckets->size(), buckets_.size()));
  }
  constexpr size_t kMaxSavedSegments = 1 << 20, kMaxSavedDims = 8;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& k = buckets_[b];
    const JsonFields jb((*buckets)[b], manifest, fmt::format("buckets[{}]", b));
    STRATA_ASSIGN_OR_RETURN(const int64_t group, jb.Int("group", 0, INT32_MAX));
    STRATA_ASSIGN_OR_RETURN(const std::string dtype, jb.String("dtype"));
    STRATA_ASSIGN_OR_RETURN(const std::vector<int64_t> segs,
                            jb.Ints("segments", 1, INT64_MAX, kMaxSavedSegments));
    std::vector<int64_t> mine;
    for (const OffloadSegment& seg : k.segments) mine.push_back(seg.num_elems);
    if (group != k.group || dtype != DTypeName(k.dtype) || segs != mine) {
      return InvalidArgumentError(fmt::format(
          "{}: bucket {} differs: saved group {}, dtype {}, {} segments of {} elements; here "
          "group {}, dtype {}, {} segments of {} elements",
          where, b, group, Excerpt(dtype, 20), segs.size(), fmt::join(segs, "+"), k.group,
          DTypeName(k.dtype), mine.size(), fmt::join(mine, "+")));
    }
    // Saves before segment shapes existed hold flat segments. Saved shapes hold their
    // segment's elements (checked without overflow before any layout is computed from them).
    std::vector<std::vector<int64_t>> shapes;
    if ((*buckets)[b].contains("shapes")) {
      STRATA_ASSIGN_OR_RETURN(const Json* js, jb.Get("shapes", Json::value_t::array));
      if (js->size() != segs.size()) {
        return DataLossError(fmt::format("{} lists {} shapes for {} segments", jb.Name("shapes"),
                                         js->size(), segs.size()));
      }
      for (size_t s = 0; s < segs.size(); ++s) {
        const std::string name = fmt::format("{}[{}]", jb.Name("shapes"), s);
        STRATA_ASSIGN_OR_RETURN(std::vector<int64_t> shape,
                                JsonInts((*js)[s], name, 1, INT64_MAX, kMaxSavedDims));
        if (!ShapeHolds(shape, segs[s])) {
          return DataLossError(fmt::format("{} [{}] does not hold the segment's {} elements", name,
                                           fmt::join(shape, ", "), segs[s]));
        }
        shapes.push_back(std::move(shape));
      }
    } else {
      for (int64_t n : segs) shapes.push_back({n});
    }
    // Shapes matter where they change the state layout (Adafactor): the saved shapes must give
    // this bucket's sections and per-segment parts.
    std::vector<std::vector<OffloadStateRange>> saved_ranges;
    const auto saved =
        BucketLayout(new_optimizers[static_cast<size_t>(k.group)], shapes, &saved_ranges);
    bool same = SameLayout(saved, k.sections);
    for (size_t s = 0; same && s < saved_ranges.size(); ++s) {
      for (size_t x = 0; same && x < saved_ranges[s].size(); ++x) {
        same = saved_ranges[s][x].offset_elems == k.ranges[s][x].offset_elems &&
               saved_ranges[s][x].num_elems == k.ranges[s][x].num_elems;
      }
    }
    if (!same) {
      std::vector<std::string> a, h;
      for (const auto& x : shapes) a.push_back(fmt::format("[{}]", fmt::join(x, ", ")));
      for (const auto& x : k.shapes) h.push_back(fmt::format("[{}]", fmt::join(x, ", ")));
      return InvalidArgumentError(fmt::format(
          "{}: bucket {} differs: saved segment shapes {} give the state ({}); here shapes "
          "{} give ({})",
          where, b, fmt::join(a, " "), LayoutString(saved), fmt::join(h, " "),
          LayoutString(k.sections)));
    }
  }
  STRATA_ASSIGN_OR_RETURN(const Json* files, top.Get("files", Json::value_t::array));
  const Json no_file;  // null: "files[0] is not an object"
  const JsonFields jf(files->empty() ? no_file : (*files)[0], manifest, "files[0]");
  STRATA_ASSIGN_OR_RETURN(const std::string listed, jf.String("name"));
  if (files->size() != 1 || listed != kOffloadTensorFile) {
    return DataLossError(
        fmt::format("{}: the manifest must list exactly '{}'", where, kOffloadTensorFile));
  }
  const std::string file_name = kOffloadTensorFile;
  STRATA_ASSIGN_OR_RETURN(const int64_t file_size, jf.Int("size_bytes", 0, INT64_MAX));
  STRATA_ASSIGN_OR_RETURN(const uint64_t file_xxh3, jf.Hex64("xxh3"));
  const std::string path = dir + "/" + file_name;
  uint64_t size = 0;
  STRATA_ASSIGN_OR_RETURN(uint64_t xxh3, formats::FileXxh3(path, &size));
  if (size != static_cast<uint64_t>(file_size) || xxh3 != file_xxh3) {
    return DataLossError(fmt::format(
        "{}: '{}' is damaged: {} bytes with xxh3 {:016x}, the manifest says {} bytes, {:016x}",
        where, file_name, size, xxh3, file_size, file_xxh3));
  }
  STRATA_ASSIGN_OR_RETURN(formats::OpenSafetensors file, formats::OpenSafetensorsFile(path));
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& k = buckets_[b];
    for (int t = 0; t < k.num_tensors; ++t) {
      const std::string name = TensorName(static_cast<int>(b), t);
      const formats::SafetensorsTensor* st = file.header.Find(name);
      const formats::TensorDType dtype =
          TensorIsU8(k, t) ? formats::TensorDType::U8() : formats::TensorDType(DType::kF32);
      if (st == nullptr || !(st->dtype == dtype) ||
          st->shape != std::vector<int64_t>{TensorElems(k, t)}) {
        return DataLossError(fmt::format("{}: tensor '{}' is missing or not {} [{}]", where, name,
                                         formats::SafetensorsDTypeName(dtype), TensorElems(k, t)));
      }
    }
  }
  // With state on NVMe each bucket passes through one host buffer, taken now: a memory failure
  // changes nothing.
  AlignedBuffer scratch;
  if (nvme()) {
    uint64_t most = 0;
    for (const Bucket& k : buckets_) most = std::max(most, StateBytes(k));
    STRATA_ASSIGN_OR_RETURN(scratch, AlignedBuffer::Allocate(most));
  }
  // Validated: now change state. Any error from here on leaves the optimizer unusable (Fail):
  // its buckets would hold parts of two states.
  for (size_t g = 0; g < groups_.size(); ++g) {
    groups_[g].optimizer = new_optimizers[g];
    groups_[g].step = new_steps[g];
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& k = buckets_[b];
    float* block = nvme() ? scratch.as<float>()
                          : reinterpret_cast<float*>(regions_->Region(static_cast<int>(b), 0));
    for (int t = 0; t < k.num_tensors; ++t) {
      const std::string name = TensorName(static_cast<int>(b), t);
      const formats::SafetensorsTensor* st = file.header.Find(name);
      STRATA_RETURN_IF_ERROR(Fail(formats::ReadTensorBytes(
          file, *st, 0,
          std::span(reinterpret_cast<std::byte*>(block) + k.tensor_offsets[t],
                    TensorBytes(k, t)))));
    }
    STRATA_RETURN_IF_ERROR(StoreStateBlock(static_cast<int>(b), block));
    STRATA_RETURN_IF_ERROR(Fail(CopyOutMasters(static_cast<int>(b), block)));
  }
  return Status::Ok();
}

OffloadCounters OffloadOptimizer::Impl::counters() const {
  OffloadCounters c;
  c.steps = steps_.load(std::memory_order_relaxed);
  c.skipped_steps = skipped_.load(std::memory_order_relaxed);
  c.nvme_bytes_read = regions_->nvme_bytes_read();
  c.nvme_bytes_written = regions_->nvme_bytes_written();
  c.update_seconds = update_ns_.load(std::memory_order_relaxed) * 1e-9;
  c.wait_seconds = wait_ns_.load(std::memory_order_relaxed) * 1e-9;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    c.host_state_bytes +=
        regions_->host_bytes(static_cast<int>(b)) + buckets_[b].accum.size_bytes();
  }
  for (const HostBuffer& h : pipe_buf_) c.host_state_bytes += h.size_bytes();
  for (const HostBuffer& h : staging_) c.host_state_bytes += h.size_bytes();
  return c;
}

// --- OffloadOptimizer -------------------------------------------------------------------------

StatusOr<std::unique_ptr<OffloadOptimizer>> OffloadOptimizer::Create(
    OffloadOptimizerOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  STRATA_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<OffloadOptimizer>(new OffloadOptimizer(std::move(impl)));
}

OffloadOptimizer::OffloadOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OffloadOptimizer::~OffloadOptimizer() = default;

StatusOr<int> OffloadOptimizer::AddGroup(const cpu_optim::AnyOptimizer& optimizer) {
  return impl_->AddGroup(optimizer);
}
Status OffloadOptimizer::SetGroupOptimizer(int group, const cpu_optim::AnyOptimizer& optimizer) {
  return impl_->SetGroupOptimizer(group, optimizer);
}
const cpu_optim::AnyOptimizer& OffloadOptimizer::group_optimizer(int group) const {
  return impl_->groups_.at(group).optimizer;
}
int OffloadOptimizer::num_groups() const { return static_cast<int>(impl_->groups_.size()); }
StatusOr<int> OffloadOptimizer::AddBucket(int group, DType param_dtype,
                                          std::span<const OffloadSegment> segments) {
  return impl_->AddBucket(group, param_dtype, segments);
}
int OffloadOptimizer::num_buckets() const { return static_cast<int>(impl_->buckets_.size()); }
int64_t OffloadOptimizer::bucket_num_elems(int bucket) const {
  return impl_->buckets_.at(bucket).num_elems;
}
int OffloadOptimizer::bucket_group(int bucket) const { return impl_->buckets_.at(bucket).group; }
DType OffloadOptimizer::bucket_dtype(int bucket) const { return impl_->buckets_.at(bucket).dtype; }
std::span<const OffloadSegment> OffloadOptimizer::bucket_segments(int bucket) const {
  return impl_->buckets_.at(bucket).segments;
}
StatusOr<std::span<std::byte>> OffloadOptimizer::AcquireStaging(int bucket, DType grad_dtype) {
  return impl_->AcquireStaging(bucket, grad_dtype);
}
Status OffloadOptimizer::SubmitGradient(int bucket, int segment, const void* grad, DType dtype,
                                        int64_t num_elems, std::function<Status()> ready) {
  return impl_->SubmitGradient(bucket, segment, grad, dtype, num_elems, std::move(ready));
}
Status OffloadOptimizer::WaitGradients() { return impl_->WaitGradients(); }
Status OffloadOptimizer::DiscardGradients() { return impl_->DiscardGradients(); }
Status OffloadOptimizer::Step(const OffloadStepOptions& options, OffloadStepResult* result) {
  return impl_->Step(options, result);
}
Status OffloadOptimizer::WaitBucket(int bucket) { return impl_->WaitBucket(bucket); }
Status OffloadOptimizer::Synchronize() { return impl_->Synchronize(); }
Status OffloadOptimizer::ReadState(int bucket, int tensor, std::span<float> out) {
  return impl_->ReadState(bucket, tensor, out);
}
Status OffloadOptimizer::WriteState(int bucket, int tensor, std::span<const float> in) {
  return impl_->WriteState(bucket, tensor, in);
}
Status OffloadOptimizer::ReadStateBytes(int bucket, int tensor, std::span<std::byte> out) {
  return impl_->ReadStateBytes(bucket, tensor, out);
}
Status OffloadOptimizer::WriteStateBytes(int bucket, int tensor, std::span<const std::byte> in) {
  return impl_->WriteStateBytes(bucket, tensor, in);
}
std::span<const cpu_optim::StateSpec> OffloadOptimizer::bucket_state_layout(int bucket) const {
  return impl_->buckets_.at(bucket).sections;
}
StatusOr<OffloadStateRange> OffloadOptimizer::SegmentStateRange(int bucket, int segment,
                                                                int tensor) const {
  const char* what = "offload optimizer: SegmentStateRange";
  STRATA_RETURN_IF_ERROR(impl_->CheckTensor(bucket, tensor, what));
  const Impl::Bucket& k = impl_->buckets_[bucket];
  if (segment < 0 || segment >= static_cast<int>(k.segments.size())) {
    return InvalidArgumentError(fmt::format("{}: bucket {} has {} segments, not segment {}", what,
                                            bucket, k.segments.size(), segment));
  }
  if (tensor == 0) return OffloadStateRange{k.offsets[segment], k.segments[segment].num_elems};
  return k.ranges[segment][tensor - 1];
}
Status OffloadOptimizer::ReloadMasters(int bucket) { return impl_->ReloadMasters(bucket); }
int64_t OffloadOptimizer::group_step(int group) const { return impl_->groups_.at(group).step; }
Status OffloadOptimizer::SetGroupStep(int group, int64_t step) {
  return impl_->SetGroupStep(group, step);
}
Status OffloadOptimizer::Save(const std::string& dir) { return impl_->Save(dir); }
Status OffloadOptimizer::Load(const std::string& dir) { return impl_->Load(dir); }
OffloadCounters OffloadOptimizer::counters() const { return impl_->counters(); }
std::string_view OffloadOptimizer::io_backend_name() const {
  return impl_->regions_->io_backend_name();
}

}  // namespace strata::engine
