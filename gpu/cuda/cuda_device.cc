// The CUDA backend of gpu::Device; see cuda_device.h for the contract.
#include "gpu/cuda/cuda_device.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "base/logging.h"
#include "base/thread_annotations.h"
#include "base/units.h"
#include "gpu/cuda/cublas_loader.h"
#include "gpu/cuda/cuda_kernels.cuh"
#include "gpu/cuda/cuda_native.h"
#include "gpu/cuda/cuda_status.h"
#include "gpu/cuda/timed_spans.h"
#include "gpu/pinned_memory.h"

namespace strata::gpu {
namespace {

constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;  // cuBLAS' recommendation for Hopper

// The sticky error of one stream, shared with the events it recorded (an event may
// outlive the stream) and with its in-flight host functions.
struct StickyError {
  std::mutex mu;
  Status error STRATA_GUARDED_BY(mu);

  Status Get() {
    std::lock_guard<std::mutex> lock(mu);
    return error;
  }
  void Set(const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    if (error.ok()) error = s;
  }
};

// Tracing (see cuda_device.h): timing-event pairs per traced stream, clock anchors per device,
// one harvester thread per device.
constexpr int kInitialTimingPairs = 64;  // per traced stream, made when the stream is created
constexpr int kTimingPairGrowth = 32;    // pairs added when more spans than that are in flight
constexpr int kAnchorTries = 3;          // the narrowest of these host windows wins
// The anchor is renewed every second: cudaEventElapsedTime returns float milliseconds (ulp
// ~0.06 us at 1 s, ~0.5 us at 5 s), and the GPU's timer and the host's steady clock drift
// apart by up to tens of ppm (tens of microseconds per second).
constexpr int64_t kAnchorRenewNs = 1'000'000'000;
// A renewal whose window is much wider than the current anchor's (the clock stream was held up,
// or the thread was preempted) is discarded while the current one is younger than this.
constexpr int64_t kAnchorMaxUseNs = 5'000'000'000;
constexpr int64_t kAnchorGoodEnoughNs = 10'000;  // an uncertainty always accepted (10 us)
constexpr auto kPollInterval = std::chrono::milliseconds(1);  // while spans are in flight
constexpr auto kIdleInterval = std::chrono::seconds(1);       // keeps the anchor fresh when idle

struct EventPair {
  cudaEvent_t begin = nullptr;
  cudaEvent_t end = nullptr;
};

// A clock anchor's event (recorded on the device's idle clock stream, completed) and its host
// time. Shared by the spans that began while it was the device's current anchor; its event is
// destroyed with the last of them.
struct GpuAnchor {
  GpuAnchor(int ordinal, cudaEvent_t event, ClockAnchor clock)
      : ordinal(ordinal), event(event), clock(clock) {}
  ~GpuAnchor() {
    if (cudaSetDevice(ordinal) == cudaSuccess) cudaEventDestroy(event);
    cudaGetLastError();
  }
  GpuAnchor(const GpuAnchor&) = delete;
  GpuAnchor& operator=(const GpuAnchor&) = delete;

  const int ordinal;
  const cudaEvent_t event;
  const ClockAnchor clock;
};
using AnchorRef = std::shared_ptr<const GpuAnchor>;

// A timing event: created without cudaEventDisableTiming, so cudaEventElapsedTime can read it.
// Nor with cudaEventBlockingSync: the only host wait on one is the clock anchor's, whose window
// should be as narrow as spinning makes it (a wake-up from a blocking wait adds its latency).
Status CreateTimingEvent(cudaEvent_t* event) {
  return cuda::CudaStatus(cudaEventCreateWithFlags(event, cudaEventDefault),
                          "cudaEventCreateWithFlags");
}

// The timing state of one traced stream, shared by the stream, the device's harvester thread and
// the stream's in-flight host functions. The stream Close()s it when it is destroyed, which
// destroys the events; the object itself may live on (in a host function still queued on a
// failed stream, or in the harvester's current pass) and then makes no CUDA call: host
// callbacks must not, and it may die on one.
class StreamTiming {
 public:
  StreamTiming(int ordinal, trace::TraceRecorder* trace, int track)
      : ordinal_(ordinal), trace_(trace), track_(track) {}
  StreamTiming(const StreamTiming&) = delete;
  StreamTiming& operator=(const StreamTiming&) = delete;

  // Creates `n` event pairs for the pool. The caller made the stream's device current.
  Status Grow(int n) {
    std::vector<EventPair> pairs;
    Status s;
    for (int i = 0; i < n && s.ok(); ++i) {
      EventPair p;
      s = CreateTimingEvent(&p.begin);
      if (s.ok()) {
        s = CreateTimingEvent(&p.end);
        if (!s.ok()) cudaEventDestroy(p.begin);
      }
      if (s.ok()) pairs.push_back(p);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      all_.insert(all_.end(), pairs.begin(), pairs.end());
    }
    queue_.AddPairs(pairs);
    return s.WithContext("creating CUDA timing events for tracing");
  }

  // A pair from the pool, grown by kTimingPairGrowth when empty (only when more spans than the
  // pool holds are in flight or not yet harvested: not per operation in steady state).
  StatusOr<EventPair> AcquirePair() {
    if (auto p = queue_.AcquirePair()) return *p;
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    STRATA_RETURN_IF_ERROR(Grow(kTimingPairGrowth));
    if (auto p = queue_.AcquirePair()) return *p;
    return InternalError("the tracing event pool is empty right after it grew");
  }

  SpanQueue<EventPair, AnchorRef>& queue() { return queue_; }

  // Records every span at the front of the queue that has completed, in stream order, and
  // stops at the first that has not. wait: claim the queue even if another harvester holds it
  // (waits for it); otherwise return at once in that case.
  void Harvest(bool wait) {
    if (wait) {
      queue_.ClaimHarvest();
    } else if (!queue_.TryClaimHarvest()) {
      return;
    }
    HarvestClaimed();
    queue_.ReleaseHarvest();
  }

  // Once, from the stream's destructor after it synchronized the stream: records every
  // completed span, drops what remains (only after a failure, when some never completed) and
  // destroys the events. Later pushes must not come; later FinishHost calls are ignored.
  void Close() {
    queue_.ClaimHarvest();
    HarvestClaimed();
    queue_.Clear();
    std::vector<EventPair> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      all.swap(all_);
    }
    if (cudaSetDevice(ordinal_) == cudaSuccess) {
      for (const EventPair& p : all) {
        cudaEventDestroy(p.begin);
        cudaEventDestroy(p.end);
      }
    }
    cudaGetLastError();
    queue_.ReleaseHarvest();
  }

  trace::TraceRecorder* trace() const { return trace_; }

 private:
  // The caller holds the queue's harvest claim.
  void HarvestClaimed() {
    for (;;) {
      std::optional<SpanQueue<EventPair, AnchorRef>::Span> span = queue_.Front();
      if (!span) break;
      int64_t begin_ns = span->begin_ns, end_ns = span->end_ns;
      bool record = span->timed;
      if (span->is_gpu && span->timed) {
        // The end event was recorded after the begin event on the same in-order stream: when it
        // has completed, both have.
        const cudaError_t done = cudaEventQuery(span->pair.end);
        if (done == cudaErrorNotReady) break;
        float begin_ms = 0, end_ms = 0;
        record =
            done == cudaSuccess &&
            cudaEventElapsedTime(&begin_ms, span->anchor->event, span->pair.begin) == cudaSuccess &&
            cudaEventElapsedTime(&end_ms, span->anchor->event, span->pair.end) == cudaSuccess;
        if (record) {
          begin_ns = span->anchor->clock.HostNs(begin_ms);
          end_ns = span->anchor->clock.HostNs(end_ms);
        } else {
          // A failed stream (its Synchronize reports why): the span cannot be timed.
          cudaGetLastError();
        }
      }
      if (record) {
        const auto [b, e] = queue_.Serialize(begin_ns, end_ns);
        trace_->Record(track_, span->name, span->category, b, e);
      }
      queue_.PopFront();
    }
  }

  const int ordinal_;
  trace::TraceRecorder* const trace_;
  const int track_;
  SpanQueue<EventPair, AnchorRef> queue_;
  std::mutex mu_;
  std::vector<EventPair> all_ STRATA_GUARDED_BY(mu_);  // every pair made, for Close()
};

// One per traced device: keeps the clock anchor fresh and records the completed spans of every
// traced stream, polling every kPollInterval while any are in flight (a CUDA event cannot wake
// a host thread without a host function, and host functions must not call the CUDA API).
class Harvester {
 public:
  static StatusOr<std::unique_ptr<Harvester>> Create(int ordinal, trace::TraceRecorder* trace) {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
    cudaStream_t clock_stream = nullptr;
    STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&clock_stream, cudaStreamNonBlocking));
    std::unique_ptr<Harvester> h(new Harvester(ordinal, trace, clock_stream));
    STRATA_ASSIGN_OR_RETURN(h->anchor_, h->MakeAnchor());
    h->thread_ = std::thread([p = h.get()] { p->Run(); });
    return h;
  }

  ~Harvester() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    if (cudaSetDevice(ordinal_) == cudaSuccess) cudaStreamDestroy(clock_stream_);
    cudaGetLastError();
  }

  // The anchor for a span that begins now.
  AnchorRef anchor() {
    std::lock_guard<std::mutex> lock(mu_);
    return anchor_;
  }

  void Register(std::shared_ptr<StreamTiming> timing) {
    std::lock_guard<std::mutex> lock(mu_);
    streams_.push_back(std::move(timing));
  }
  void Unregister(const StreamTiming* timing) {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(streams_, [&](const auto& s) { return s.get() == timing; });
  }

  // A span was queued: the next wait ends at once, and the thread wakes if it is waiting idle.
  void Notify() {
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      kicked_ = true;
      wake = idle_;
    }
    if (wake) cv_.notify_one();
  }

 private:
  Harvester(int ordinal, trace::TraceRecorder* trace, cudaStream_t clock_stream)
      : ordinal_(ordinal), trace_(trace), clock_stream_(clock_stream) {}

  // Records an event on the idle clock stream, waits for it, and keeps the narrowest host window
  // of kAnchorTries tries (see ClockAnchor).
  StatusOr<AnchorRef> MakeAnchor() {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    AnchorRef best;
    for (int i = 0; i < kAnchorTries; ++i) {
      cudaEvent_t event = nullptr;
      STRATA_RETURN_IF_ERROR(CreateTimingEvent(&event));
      const int64_t before_ns = trace_->NowNs();
      Status s = cuda::CudaStatus(cudaEventRecord(event, clock_stream_), "cudaEventRecord");
      if (s.ok()) s = cuda::CudaStatus(cudaEventSynchronize(event), "cudaEventSynchronize");
      const int64_t after_ns = trace_->NowNs();
      auto anchor = std::make_shared<const GpuAnchor>(ordinal_, event,
                                                      ClockAnchor::FromWindow(before_ns, after_ns));
      STRATA_RETURN_IF_ERROR(s.WithContext("anchoring the GPU clock for tracing"));
      if (!best || anchor->clock.uncertainty_ns < best->clock.uncertainty_ns)
        best = std::move(anchor);
    }
    return best;
  }

  void Run() {
    if (cudaSetDevice(ordinal_) != cudaSuccess) cudaGetLastError();
    bool in_flight = false;
    bool warned = false;
    int64_t last_renewal_ns = trace_->NowNs();
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (in_flight) {  // poll: a CUDA event cannot wake a host thread
        cv_.wait_for(lock, kPollInterval, [&] { return stop_; });
      } else {
        idle_ = true;
        cv_.wait_for(lock, kIdleInterval, [&] { return stop_ || kicked_; });
        idle_ = false;
      }
      kicked_ = false;  // a span queued from here on is seen by this pass or kicks the next wait
      if (stop_) break;
      std::vector<std::shared_ptr<StreamTiming>> streams = streams_;
      const ClockAnchor current = anchor_->clock;
      lock.unlock();
      const int64_t now_ns = trace_->NowNs();
      if (now_ns - last_renewal_ns > kAnchorRenewNs) {
        last_renewal_ns = now_ns;
        StatusOr<AnchorRef> fresh = MakeAnchor();
        if (!fresh.ok()) {
          if (!warned) {  // spans keep the current anchor: less precise, still mapped
            STRATA_LOG_WARNING("tracing: could not renew the GPU clock anchor: {}",
                               fresh.status().ToString());
            warned = true;
          }
        } else if ((*fresh)->clock.uncertainty_ns <=
                       std::max(2 * current.uncertainty_ns, kAnchorGoodEnoughNs) ||
                   now_ns - current.host_ns > kAnchorMaxUseNs) {
          AnchorRef old = std::move(*fresh);  // after the swap: the old anchor, released unlocked
          std::lock_guard<std::mutex> l(mu_);
          anchor_.swap(old);
        }
      }
      in_flight = false;
      for (const auto& s : streams) {
        s->Harvest(/*wait=*/false);
        in_flight = in_flight || s->queue().size() > 0;
      }
      streams.clear();  // a stream's timing state may die here, outside the lock
      lock.lock();
    }
  }

  const int ordinal_;
  trace::TraceRecorder* const trace_;
  const cudaStream_t clock_stream_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ STRATA_GUARDED_BY(mu_) = false;
  bool idle_ STRATA_GUARDED_BY(mu_) = false;    // in the idle wait: Notify must wake it
  bool kicked_ STRATA_GUARDED_BY(mu_) = false;  // a span was queued since the last pass began
  AnchorRef anchor_ STRATA_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<StreamTiming>> streams_ STRATA_GUARDED_BY(mu_);
};

class CudaEvent final : public Event {
 public:
  CudaEvent(int ordinal, cudaEvent_t event) : ordinal_(ordinal), event_(event) {}
  ~CudaEvent() override {
    if (cudaSetDevice(ordinal_) == cudaSuccess) cudaEventDestroy(event_);
    cudaGetLastError();
  }

  Status Synchronize() override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_));
    std::shared_ptr<StickyError> recorder;
    {
      std::lock_guard<std::mutex> lock(mu_);
      recorder = recorder_;
    }
    return recorder ? recorder->Get() : Status::Ok();
  }

  bool Query() override {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    cudaGetLastError();  // any other error: completed as far as waiting goes; Synchronize says why
    return true;
  }

  cudaEvent_t native() const { return event_; }
  void set_recorder(std::shared_ptr<StickyError> recorder) {
    std::lock_guard<std::mutex> lock(mu_);
    recorder_ = std::move(recorder);
  }

 private:
  const int ordinal_;
  const cudaEvent_t event_;
  std::mutex mu_;
  std::shared_ptr<StickyError> recorder_ STRATA_GUARDED_BY(mu_);
};

class CudaStream final : public Stream {
 public:
  // timing and harvester: both set when the device traces, both null otherwise. The stream
  // registers `timing` with the harvester.
  CudaStream(std::string name, int ordinal, cudaStream_t stream,
             std::shared_ptr<StreamTiming> timing, Harvester* harvester, std::atomic<uint64_t>* h2d,
             std::atomic<uint64_t>* d2h)
      : name_(std::move(name)),
        ordinal_(ordinal),
        stream_(stream),
        timing_(std::move(timing)),
        harvester_(harvester),
        h2d_(h2d),
        d2h_(d2h) {
    if (timing_) harvester_->Register(timing_);
  }

  ~CudaStream() override {
    if (cudaSetDevice(ordinal_) == cudaSuccess) {
      cudaStreamSynchronize(stream_);  // no copy, kernel or host function outlives it
      if (cublas_) cuda::Cublas().value()->Destroy(cublas_);  // loaded: it made cublas_
      if (cublas_workspace_) cudaFree(cublas_workspace_);
      cudaStreamDestroy(stream_);
    }
    cudaGetLastError();
    if (timing_) {  // every span has completed (events outlive their stream): record them all
      harvester_->Unregister(timing_.get());
      timing_->Close();
    }
  }

  std::string_view name() const override { return name_; }
  DeviceKind device_kind() const override { return DeviceKind::kCuda; }

  Status CopyH2D(DeviceSpan dst, PinnedSpan src) override {
    if (dst.size_bytes < src.size_bytes || (src.size_bytes && (!dst.data || !src.data))) {
      return InvalidArgumentError(fmt::format("{}: H2D copy of {} bytes into a {}-byte device span",
                                              name_, src.size_bytes, dst.size_bytes));
    }
    if (src.size_bytes == 0) return Status::Ok();
    STRATA_RETURN_IF_ERROR(Timed("H2D copy", trace::Category::kH2D, [&] {
      return cuda::CudaStatus(
          cudaMemcpyAsync(dst.data, src.data, src.size_bytes, cudaMemcpyHostToDevice, stream_),
          "cudaMemcpyAsync(host to device)");
    }));
    *h2d_ += src.size_bytes;
    return Status::Ok();
  }

  Status CopyD2H(PinnedSpan dst, DeviceSpan src) override {
    if (dst.size_bytes < src.size_bytes || (src.size_bytes && (!dst.data || !src.data))) {
      return InvalidArgumentError(fmt::format("{}: D2H copy of {} bytes into a {}-byte pinned span",
                                              name_, src.size_bytes, dst.size_bytes));
    }
    if (src.size_bytes == 0) return Status::Ok();
    STRATA_RETURN_IF_ERROR(Timed("D2H copy", trace::Category::kD2H, [&] {
      return cuda::CudaStatus(
          cudaMemcpyAsync(dst.data, src.data, src.size_bytes, cudaMemcpyDeviceToHost, stream_),
          "cudaMemcpyAsync(device to host)");
    }));
    *d2h_ += src.size_bytes;
    return Status::Ok();
  }

  Status Convert(DeviceSpan dst, DType dst_dtype, DeviceSpan src, DType src_dtype, int64_t n,
                 float scale) override;

  Status LaunchHost(std::function<Status()> fn) override {
    auto* task = new HostTask{std::move(fn), sticky_, name_, label(), nullptr, 0};
    const bool timed = timing_ && open_spans_.load(std::memory_order_relaxed) == 0;
    if (timed) {
      task->timing = timing_;
      task->span = timing_->queue().PushHost("kernel", trace::Category::kCompute);
    }
    const cudaError_t e = cudaLaunchHostFunc(stream_, &RunHostTask, task);
    if (e != cudaSuccess) {
      if (task->timing) task->timing->queue().FinishHost(task->span, false, 0, 0);
      delete task;
      return cuda::CudaStatus(e, "cudaLaunchHostFunc");
    }
    if (timed) harvester_->Notify();  // `task` may be gone already: the callback deletes it
    return Status::Ok();
  }

  Status Record(Event& event) override {
    auto& e = static_cast<CudaEvent&>(event);
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventRecord(e.native(), stream_));
    e.set_recorder(sticky_);
    return Status::Ok();
  }

  Status Wait(Event& event) override {
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaStreamWaitEvent(stream_, static_cast<CudaEvent&>(event).native(), 0));
    return Status::Ok();
  }

  void SetWorkLabel(std::string label) override {
    std::lock_guard<std::mutex> lock(label_mu_);
    label_ = label.empty() ? nullptr : std::make_shared<const std::string>(std::move(label));
  }

  Status Synchronize() override {
    // A kernel's fault surfaces here, after the op that ran it: name the latest labelled work.
    const std::shared_ptr<const std::string> work = label();
    const Status s =
        cuda::CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")
            .WithContext(work ? fmt::format("{} (or work enqueued before it) failed on stream '{}'",
                                            *work, name_)
                              : fmt::format("stream '{}'", name_));
    if (timing_) timing_->Harvest(/*wait=*/true);  // all spans enqueued so far are recorded
    STRATA_RETURN_IF_ERROR(s);
    return sticky_->Get();
  }

  // ScopedComputeSpan (cuda_device.h). Returns the span's id, or nullopt when nothing is timed
  // (no tracing, inside another span, or the begin event could not be recorded).
  std::optional<uint64_t> BeginComputeSpan(const char* name) {
    if (!timing_ || open_spans_.fetch_add(1, std::memory_order_relaxed) > 0) return std::nullopt;
    StatusOr<EventPair> pair = timing_->AcquirePair();
    if (!pair.ok()) return std::nullopt;  // tracing is best effort; the stream still works
    AnchorRef anchor = harvester_->anchor();
    if (cudaEventRecord(pair->begin, stream_) != cudaSuccess) {
      cudaGetLastError();
      timing_->queue().ReleasePair(*pair);
      return std::nullopt;
    }
    return timing_->queue().PushGpu(name, trace::Category::kCompute, *pair, anchor,
                                    /*closed=*/false);
  }
  void EndComputeSpan(std::optional<uint64_t> id) {
    if (!timing_) return;
    open_spans_.fetch_sub(1, std::memory_order_relaxed);
    if (!id) return;
    const EventPair pair = timing_->queue().OpenGpuPair(*id);
    const bool timed = cudaEventRecord(pair.end, stream_) == cudaSuccess;
    if (!timed) cudaGetLastError();  // the span is dropped; the stream's Synchronize says why
    timing_->queue().CloseGpu(*id, timed);
    harvester_->Notify();
  }

  cudaStream_t native() const { return stream_; }

  // The workspace installed with the handle; call cublas() first.
  DeviceSpan cublas_workspace() {
    std::lock_guard<std::mutex> lock(cublas_mu_);
    return DeviceSpan{static_cast<std::byte*>(cublas_workspace_),
                      cublas_workspace_ ? kCublasWorkspaceBytes : 0};
  }

  // Creates the handle on first use; no CUDA call runs under the lock (a racing
  // second creator destroys its own handle and uses the first). cuBLAS itself is
  // loaded here, on the first handle of the process (cublas_loader.h).
  StatusOr<cublasHandle_t> cublas() {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));  // cuBLAS calls follow on this thread
    {
      std::lock_guard<std::mutex> lock(cublas_mu_);
      if (cublas_) return cublas_;
    }
    STRATA_ASSIGN_OR_RETURN(const cuda::CublasApi* blas, cuda::Cublas());
    void* workspace = nullptr;
    const cudaError_t e = cudaMalloc(&workspace, kCublasWorkspaceBytes);
    if (e != cudaSuccess) {
      return cuda::CudaStatus(e, "cudaMalloc")
          .WithContext(fmt::format("stream '{}': the {} cuBLAS workspace", name_,
                                   FormatBytes(kCublasWorkspaceBytes)));
    }
    cublasHandle_t handle = nullptr;
    Status s = cuda::CublasStatus(blas->Create(&handle), "cublasCreate");
    if (s.ok()) s = cuda::CublasStatus(blas->SetStream(handle, stream_), "cublasSetStream");
    if (s.ok()) {
      s = cuda::CublasStatus(blas->SetWorkspace(handle, workspace, kCublasWorkspaceBytes),
                             "cublasSetWorkspace");
    }
    if (s.ok()) {
      s = cuda::CublasStatus(blas->SetPointerMode(handle, CUBLAS_POINTER_MODE_HOST),
                             "cublasSetPointerMode");
    }
    if (s.ok()) {
      s = cuda::CublasStatus(blas->SetMathMode(handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    }
    bool installed = false;
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(cublas_mu_);
      if (!cublas_) {
        cublas_ = handle;
        cublas_workspace_ = workspace;
        installed = true;
      }
    }
    if (!installed) {
      if (handle) blas->Destroy(handle);
      cudaFree(workspace);
      if (!s.ok()) return s;
    }
    std::lock_guard<std::mutex> lock(cublas_mu_);
    return cublas_;
  }

 private:
  struct HostTask {
    std::function<Status()> fn;
    std::shared_ptr<StickyError> sticky;
    std::string stream_name;
    std::shared_ptr<const std::string> label;  // SetWorkLabel's when enqueued; null: none
    std::shared_ptr<StreamTiming> timing;      // null: not traced
    uint64_t span;                             // its host span in timing's queue
  };

  // Runs on a CUDA runtime thread, in stream order. Must not call the CUDA API (so the span goes
  // to the queue, and the harvester records it in stream order).
  static void CUDART_CB RunHostTask(void* arg) {
    std::unique_ptr<HostTask> task(static_cast<HostTask*>(arg));
    if (!task->sticky->Get().ok()) {  // an earlier host function failed: skip
      if (task->timing) task->timing->queue().FinishHost(task->span, false, 0, 0);
      return;
    }
    trace::TraceRecorder* trace = task->timing ? task->timing->trace() : nullptr;
    const int64_t begin_ns = trace ? trace->NowNs() : 0;
    Status s = task->fn();
    if (trace) task->timing->queue().FinishHost(task->span, true, begin_ns, trace->NowNs());
    if (!s.ok()) {
      task->sticky->Set(
          task->label ? Status(s.code(), fmt::format("{} failed on stream '{}': {}", *task->label,
                                                     task->stream_name, s.message()))
                      : s.WithContext(fmt::format("stream '{}'", task->stream_name)));
    }
  }

  // Brackets `enqueue` (which puts one operation on the stream and returns its Status) with a
  // timing-event pair when the stream is traced and no compute span is open. Tracing is best
  // effort: when an event cannot be recorded the operation still runs, untimed.
  template <typename Enqueue>
  Status Timed(const char* name, trace::Category category, Enqueue&& enqueue) {
    if (!timing_ || open_spans_.load(std::memory_order_relaxed) > 0) return enqueue();
    StatusOr<EventPair> pair = timing_->AcquirePair();
    if (!pair.ok()) return enqueue();
    AnchorRef anchor = harvester_->anchor();
    if (cudaEventRecord(pair->begin, stream_) != cudaSuccess) {
      cudaGetLastError();
      timing_->queue().ReleasePair(*pair);
      return enqueue();
    }
    const Status s = enqueue();
    if (!s.ok() || cudaEventRecord(pair->end, stream_) != cudaSuccess) {
      cudaGetLastError();
      timing_->queue().ReleasePair(*pair);
      return s;
    }
    timing_->queue().PushGpu(name, category, *pair, anchor, /*closed=*/true);
    harvester_->Notify();
    return Status::Ok();
  }

  const std::string name_;
  const int ordinal_;
  const cudaStream_t stream_;
  const std::shared_ptr<StreamTiming> timing_;  // null: not traced
  Harvester* const harvester_;                  // the device's; null: not traced
  std::atomic<int> open_spans_{0};              // ScopedComputeSpans open on this stream
  std::atomic<uint64_t>* h2d_;
  std::atomic<uint64_t>* d2h_;
  const std::shared_ptr<StickyError> sticky_ = std::make_shared<StickyError>();
  std::shared_ptr<const std::string> label() {
    std::lock_guard<std::mutex> lock(label_mu_);
    return label_;
  }
  std::mutex label_mu_;
  std::shared_ptr<const std::string> label_ STRATA_GUARDED_BY(label_mu_);  // SetWorkLabel's
  std::mutex cublas_mu_;
  cublasHandle_t cublas_ STRATA_GUARDED_BY(cublas_mu_) = nullptr;
  void* cublas_workspace_ STRATA_GUARDED_BY(cublas_mu_) = nullptr;
};

Status CudaStream::Convert(DeviceSpan dst, DType dst_dtype, DeviceSpan src, DType src_dtype,
                           int64_t n, float scale) {
  if (n < 0 || src.size_bytes < static_cast<uint64_t>(n) * SizeOf(src_dtype) ||
      dst.size_bytes < static_cast<uint64_t>(n) * SizeOf(dst_dtype)) {
    return InvalidArgumentError(fmt::format(
        "{}: convert of {} elements ({} -> {}) out of the bounds of a {}-byte source or "
        "{}-byte destination",
        name_, n, DTypeName(src_dtype), DTypeName(dst_dtype), src.size_bytes, dst.size_bytes));
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
  return Timed("convert", trace::Category::kCompute, [&] {
    return cuda::LaunchConvert(stream_, dst.data, dst_dtype, src.data, src_dtype, n, scale)
        .WithContext(fmt::format("stream '{}'", name_));
  });
}

class CudaArena final : public DeviceArena {
 public:
  CudaArena(int ordinal, std::byte* base, size_t size)
      : DeviceArena(base, size), ordinal_(ordinal), base_(base) {}
  ~CudaArena() override {
    if (cudaSetDevice(ordinal_) == cudaSuccess) cudaFree(base_);
    cudaGetLastError();
  }

 private:
  const int ordinal_;
  std::byte* const base_;
};

std::string VersionString(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

class CudaDevice final : public Device {
 public:
  // harvester: non-null exactly when o.trace is set.
  CudaDevice(const CudaDeviceOptions& o, std::string description,
             std::unique_ptr<Harvester> harvester)
      : Device(o.pinned_budget_bytes),
        options_(o),
        description_(std::move(description)),
        harvester_(std::move(harvester)) {}

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string description() const override { return description_; }

  StatusOr<std::unique_ptr<DeviceArena>> CreateArena(size_t size_bytes) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_ordinal));
    const size_t size = AlignUp(std::max<size_t>(size_bytes, 1), DeviceArena::kAlignment);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, size);
    if (e != cudaSuccess) {
      const Status why = cuda::CudaStatus(e, "cudaMalloc");
      size_t free_bytes = 0, total_bytes = 0;
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) cudaGetLastError();
      return ResourceExhaustedError(fmt::format(
          "could not take {} of GPU memory for the device arena ({} of {} is free on GPU {}; "
          "another process may hold the rest): {}; lower the device memory budget or free the GPU",
          FormatBytes(size), FormatBytes(free_bytes), FormatBytes(total_bytes),
          options_.device_ordinal, why.message()));
    }
    Status s = cuda::CudaStatus(cudaMemset(p, 0, size), "cudaMemset");
    if (s.ok()) s = cuda::CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (!s.ok()) {
      cudaFree(p);
      return s.WithContext("zero-filling the device arena");
    }
    return std::unique_ptr<DeviceArena>(
        new CudaArena(options_.device_ordinal, static_cast<std::byte*>(p), size_bytes));
  }

  StatusOr<DeviceMemoryInfo> MemoryInfo() override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_ordinal));
    DeviceMemoryInfo m;
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&m.free_bytes, &m.total_bytes));
    m.outside_arena_bytes = kCublasWorkspaceBytes;  // the compute stream's (CudaStream::cublas)
    return m;
  }

  StatusOr<std::unique_ptr<Stream>> CreateStream(std::string name) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_ordinal));
    std::shared_ptr<StreamTiming> timing;
    if (harvester_) {
      timing = std::make_shared<StreamTiming>(options_.device_ordinal, options_.trace,
                                              options_.trace->RegisterTrack(name));
      if (Status s = timing->Grow(kInitialTimingPairs); !s.ok()) {
        timing->Close();  // destroys the events it did create
        return s.WithContext(fmt::format("stream '{}'", name));
      }
    }
    cudaStream_t stream = nullptr;
    if (Status s = cuda::CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                    "cudaStreamCreateWithFlags");
        !s.ok()) {
      if (timing) timing->Close();
      return s;
    }
    return std::unique_ptr<Stream>(new CudaStream(std::move(name), options_.device_ordinal, stream,
                                                  std::move(timing), harvester_.get(), &bytes_h2d_,
                                                  &bytes_d2h_));
  }

  StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_ordinal));
    cudaEvent_t event = nullptr;
    // Host threads wait on these (Event::Synchronize): blocking sync, not a spinning core.
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&event, cudaEventBlockingSync | cudaEventDisableTiming));
    return std::unique_ptr<Event>(new CudaEvent(options_.device_ordinal, event));
  }

 protected:
  // Pinned memory aligned by construction: an anonymous mapping (page-aligned and zero-filled by
  // the kernel) of PinnedMappingBytes(size_bytes), 2 MiB-aligned with transparent huge pages asked
  // for when it is at least 2 MiB, then page-locked and mapped for the GPU with cudaHostRegister.
  // cudaHostAlloc promises no alignment (on driver 580 a 4 KiB request came back not 4
  // KiB-aligned), and pinned buffers double as O_DIRECT buffers, so its result cannot be used as it
  // is.
  StatusOr<std::byte*> PinnedAlloc(size_t size_bytes) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_ordinal));
    const auto cannot_pin = [&](std::string_view why) {
      return ResourceExhaustedError(fmt::format(
          "could not pin {} of host memory: {}; free host memory or the locked-memory limit "
          "(ulimit -l) is too small: lower the pinned budget or raise the limit",
          FormatBytes(size_bytes), why));
    };
    StatusOr<std::byte*> mapped = MapAlignedHostMemory(size_bytes);
    if (!mapped.ok()) return cannot_pin(mapped.status().message());
    std::byte* p = *mapped;
    const cudaError_t e =
        cudaHostRegister(p, PinnedMappingBytes(size_bytes), cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      UnmapAlignedHostMemory(p, size_bytes);
      return cannot_pin(cuda::CudaStatus(e, "cudaHostRegister").message());
    }
    return p;
  }

  Status PinnedRegister(std::byte* data, size_t size_bytes) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device_ordinal));
    const cudaError_t e = cudaHostRegister(data, size_bytes, cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      // Only an allocation failure is the locked-memory limit's; say what the others are.
      return ResourceExhaustedError(fmt::format(
          "could not pin {} of mapped host memory: {}{}", FormatBytes(size_bytes),
          cuda::CudaStatus(e, "cudaHostRegister").message(),
          e == cudaErrorMemoryAllocation ? "; the locked-memory limit (ulimit -l) may be too small"
                                         : ""));
    }
    return Status::Ok();
  }
  void PinnedUnregister(std::byte* data, size_t size_bytes) override {
    // The deleter may run on a thread with no current device: without this the runtime would
    // make a context on device 0 for it. Portable registrations unregister from any device.
    if (cudaSetDevice(options_.device_ordinal) != cudaSuccess) cudaGetLastError();
    const cudaError_t e = cudaHostUnregister(data);
    if (e != cudaSuccess) {
      STRATA_LOG_WARNING("cudaHostUnregister failed: {}", cudaGetErrorName(e));
      cudaGetLastError();
    }
  }
  void PinnedFree(std::byte* data, size_t size_bytes) override {
    PinnedUnregister(data, size_bytes);
    UnmapAlignedHostMemory(data, size_bytes);
  }

 private:
  const CudaDeviceOptions options_;
  const std::string description_;
  const std::unique_ptr<Harvester> harvester_;  // null: not traced
};

// Asks for cudaDeviceScheduleBlockingSync on the primary context of GPU `ordinal`: as the context
// is created (cudaInitDevice with the flags), or, where it already exists (created earlier in the
// process, by another device object or another library), by changing its flags
// (cudaSetDeviceFlags, which CUDA 12 and later allow on an initialized device). A runtime that
// refuses the change because the context is active (cudaErrorSetOnActiveProcess) keeps its
// flags; that is not an error. Leaves the device current on the calling thread. Returns whether
// the context's flags (cudaGetDeviceFlags) now say blocking sync.
StatusOr<bool> RequestBlockingSync(int ordinal) {
  cudaError_t e =
      cudaInitDevice(ordinal, cudaDeviceScheduleBlockingSync, cudaInitDeviceFlagsAreValid);
  if (e == cudaErrorSetOnActiveProcess) {
    cudaGetLastError();
    e = cudaSuccess;
  }
  STRATA_CUDA_RETURN_IF_ERROR(e);
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  unsigned flags = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetDeviceFlags(&flags));
  if ((flags & cudaDeviceScheduleMask) != cudaDeviceScheduleBlockingSync) {
    e = cudaSetDeviceFlags((flags & ~cudaDeviceScheduleMask) | cudaDeviceScheduleBlockingSync);
    if (e == cudaErrorSetOnActiveProcess) {
      cudaGetLastError();
    } else {
      STRATA_CUDA_RETURN_IF_ERROR(e);
    }
    STRATA_CUDA_RETURN_IF_ERROR(cudaGetDeviceFlags(&flags));
  }
  return (flags & cudaDeviceScheduleMask) == cudaDeviceScheduleBlockingSync;
}

CudaStream& AsCudaStream(Stream& stream) {
  auto* s = dynamic_cast<CudaStream*>(&stream);
  STRATA_CHECK_MSG(s != nullptr, "a stream of the CUDA device is needed here, not " +
                                     std::string(stream.name()) + " of another backend");
  return *s;
}

}  // namespace

StatusOr<int> CudaDeviceCount() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    cudaGetLastError();
    return 0;
  }
  STRATA_CUDA_RETURN_IF_ERROR(e);
  return count;
}

StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions& options) {
  if (options.device_ordinal < 0) {
    return InvalidArgumentError(
        fmt::format("CUDA device ordinal {} is negative", options.device_ordinal));
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    return UnavailableError(
        fmt::format("no usable CUDA GPU: {} ({}); check nvidia-smi, the driver version and "
                    "CUDA_VISIBLE_DEVICES, or use the host device",
                    cudaGetErrorName(e), cudaGetErrorString(e)));
  }
  STRATA_CUDA_RETURN_IF_ERROR(e);
  if (count == 0) {
    return UnavailableError(
        "no CUDA GPU is visible; check nvidia-smi and CUDA_VISIBLE_DEVICES, or use the host "
        "device");
  }
  if (options.device_ordinal >= count) {
    return InvalidArgumentError(fmt::format("CUDA device {} does not exist: {} GPU{} visible",
                                            options.device_ordinal, count,
                                            count == 1 ? " is" : "s are"));
  }
  STRATA_ASSIGN_OR_RETURN(const bool blocking_sync, RequestBlockingSync(options.device_ordinal));
  if (!blocking_sync) {
    STRATA_LOG_WARNING(
        "cuda:{}: the CUDA context existed with other scheduling flags and the runtime kept them "
        "(cudaErrorSetOnActiveProcess): stream and device synchronizes may spin a core; event "
        "waits still block (cudaEventBlockingSync)",
        options.device_ordinal);
  }
  cudaDeviceProp prop{};
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options.device_ordinal));
  int driver = 0, runtime = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaDriverGetVersion(&driver));
  STRATA_CUDA_RETURN_IF_ERROR(cudaRuntimeGetVersion(&runtime));
  std::string description = fmt::format(
      "cuda:{} {} (compute capability {}.{}, {} memory, {} SMs, driver {}, runtime {}, host "
      "waits {})",
      options.device_ordinal, prop.name, prop.major, prop.minor, FormatBytes(prop.totalGlobalMem),
      prop.multiProcessorCount, VersionString(driver), VersionString(runtime),
      blocking_sync ? "block" : "spin on stream syncs (context flags kept)");
  std::unique_ptr<Harvester> harvester;
  if (options.trace) {
    STRATA_ASSIGN_OR_RETURN(harvester, Harvester::Create(options.device_ordinal, options.trace));
  }
  return std::unique_ptr<Device>(
      new CudaDevice(options, std::move(description), std::move(harvester)));
}

cudaStream_t NativeStream(Stream& stream) { return AsCudaStream(stream).native(); }

StatusOr<cublasHandle_t> CublasHandle(Stream& stream) { return AsCudaStream(stream).cublas(); }

StatusOr<DeviceSpan> CublasWorkspace(Stream& stream) {
  STRATA_RETURN_IF_ERROR(AsCudaStream(stream).cublas().status());
  return AsCudaStream(stream).cublas_workspace();
}

ScopedComputeSpan::ScopedComputeSpan(Stream& stream, const char* name) : stream_(&stream) {
  std::optional<uint64_t> id = AsCudaStream(stream).BeginComputeSpan(name);
  open_ = id.has_value();
  id_ = id.value_or(0);
}

ScopedComputeSpan::~ScopedComputeSpan() {
  AsCudaStream(*stream_).EndComputeSpan(open_ ? std::optional<uint64_t>(id_) : std::nullopt);
}

}  // namespace strata::gpu
