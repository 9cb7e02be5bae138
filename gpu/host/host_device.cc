// Host emulation of a device: device memory is aligned host memory, each Stream
// is a worker thread draining an in-order queue, an Event is a counter of
// recorded vs completed work. Copies can be throttled to a PCIe-like bandwidth.
#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "base/cpu_info.h"
#include "base/dtype.h"
#include "base/exceptions.h"
#include "base/thread_annotations.h"
#include "base/trace.h"
#include "base/units.h"
#include "gpu/device.h"
#include "gpu/pinned_memory.h"

namespace strata::gpu {
namespace {

class HostEvent final : public Event {
 public:
  // Called when a stream enqueues a record: returns the ticket the stream
  // completes later.
  uint64_t NextTicket() {
    std::lock_guard<std::mutex> lock(mu_);
    return ++recorded_;
  }
  void Complete(uint64_t ticket, const Status& stream_error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ticket > completed_) completed_ = ticket;
    if (!stream_error.ok() && error_.ok()) error_ = stream_error;
    cv_.notify_all();
  }
  // Waits until everything recorded up to `ticket` completed.
  Status WaitFor(uint64_t ticket) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return completed_ >= ticket; });
    return error_;
  }
  uint64_t recorded() {
    std::lock_guard<std::mutex> lock(mu_);
    return recorded_;
  }
  Status Synchronize() override { return WaitFor(recorded()); }
  bool Query() override {
    std::lock_guard<std::mutex> lock(mu_);
    return completed_ >= recorded_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t recorded_ STRATA_GUARDED_BY(mu_) = 0;
  uint64_t completed_ STRATA_GUARDED_BY(mu_) = 0;
  Status error_ STRATA_GUARDED_BY(mu_);
};

class HostStream final : public Stream {
 public:
  HostStream(std::string name, const HostDeviceOptions& options, uint64_t delay_seed,
             std::atomic<uint64_t>* h2d, std::atomic<uint64_t>* d2h)
      : name_(std::move(name)),
        copy_bps_(options.copy_bytes_per_second),
        max_delay_us_(options.max_random_delay_us),
        delay_rng_(delay_seed),
        trace_(options.trace),
        track_(trace_ ? trace_->RegisterTrack(name_) : 0),
        fault_at_launch_(options.fault_stream == name_ ? options.fault_at_launch : 0),
        h2d_(h2d),
        d2h_(d2h) {
    worker_ = std::thread([this] { Run(); });
  }
  ~HostStream() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  std::string_view name() const override { return name_; }
  DeviceKind device_kind() const override { return DeviceKind::kHost; }

  Status CopyH2D(DeviceSpan dst, PinnedSpan src) override {
    if (dst.size_bytes < src.size_bytes || (src.size_bytes && (!dst.data || !src.data))) {
      return InvalidArgumentError(fmt::format("{}: H2D copy of {} into a {} device span", name_,
                                              src.size_bytes, dst.size_bytes));
    }
    Enqueue({[this, dst, src] { return Copy(dst.data, src.data, src.size_bytes, h2d_); }, false,
             "H2D copy", trace::Category::kH2D});
    return Status::Ok();
  }

  Status CopyD2H(PinnedSpan dst, DeviceSpan src) override {
    if (dst.size_bytes < src.size_bytes || (src.size_bytes && (!dst.data || !src.data))) {
      return InvalidArgumentError(fmt::format("{}: D2H copy of {} into a {} pinned span", name_,
                                              src.size_bytes, dst.size_bytes));
    }
    Enqueue({[this, dst, src] { return Copy(dst.data, src.data, src.size_bytes, d2h_); }, false,
             "D2H copy", trace::Category::kD2H});
    return Status::Ok();
  }

  Status Convert(DeviceSpan dst, DType dst_dtype, DeviceSpan src, DType src_dtype, int64_t n,
                 float scale) override {
    if (n < 0 || src.size_bytes < n * SizeOf(src_dtype) || dst.size_bytes < n * SizeOf(dst_dtype)) {
      return InvalidArgumentError(
          fmt::format("{}: convert of {} elements out of bounds", name_, n));
    }
    if (dst.data == src.data && SizeOf(dst_dtype) > SizeOf(src_dtype)) {
      return InvalidArgumentError("in-place widening conversion is not supported");
    }
    Enqueue({[=] {
               ConvertElems(dst.data, dst_dtype, src.data, src_dtype, n, scale);
               return Status::Ok();
             },
             false, "convert", trace::Category::kCompute});
    return Status::Ok();
  }

  Status LaunchHost(std::function<Status()> fn) override {
    Enqueue({Injected(std::move(fn)), false, "kernel", trace::Category::kCompute});
    return Status::Ok();
  }
  Status LaunchHostAs(trace::Category category, std::function<Status()> fn) override {
    Enqueue({Injected(std::move(fn)), false,
             category == trace::Category::kComm ? "collective" : "host function", category});
    return Status::Ok();
  }

  void SetWorkLabel(std::string label) override {
    auto l = label.empty() ? nullptr : std::make_shared<const std::string>(std::move(label));
    std::lock_guard<std::mutex> lock(mu_);
    label_ = std::move(l);
  }

  Status Record(Event& event) override {
    auto& e = static_cast<HostEvent&>(event);
    const uint64_t ticket = e.NextTicket();
    Enqueue({[this, &e, ticket] {
               e.Complete(ticket, error_snapshot());
               return Status::Ok();
             },
             true});
    return Status::Ok();
  }

  Status Wait(Event& event) override {
    auto& e = static_cast<HostEvent&>(event);
    const uint64_t ticket = e.recorded();
    Enqueue({[&e, ticket] { return e.WaitFor(ticket); }, true});
    return Status::Ok();
  }

  Status Synchronize() override {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
    return error_;
  }

 private:
  struct Work {
    std::function<Status()> fn;
    bool always_run;             // event bookkeeping runs even after an error
    const char* name = nullptr;  // traced work; nullptr: bookkeeping, not traced or delayed
    trace::Category category = trace::Category::kOther;
    std::shared_ptr<const std::string> label = nullptr;  // set by Enqueue: the stream's label then
  };

  // HostDeviceOptions::fault_at_launch: the chosen launch fails instead of running.
  std::function<Status()> Injected(std::function<Status()> fn) {
    const int64_t n = launches_.fetch_add(1) + 1;
    if (n != fault_at_launch_) return fn;
    return [n, stream = name_] {
      return InternalError(fmt::format("injected fault (launch {} on stream '{}')", n, stream));
    };
  }

  Status error_snapshot() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

  void Enqueue(Work w) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (w.name) w.label = label_;  // bookkeeping (event records and waits) is never labelled
      queue_.push_back(std::move(w));
    }
    cv_.notify_one();
  }

  Status Copy(std::byte* dst, const std::byte* src, size_t n, std::atomic<uint64_t>* counter) {
    const auto start = std::chrono::steady_clock::now();
    if (n) std::memcpy(dst, src, n);
    *counter += n;
    if (copy_bps_ > 0) {  // pretend the link is this fast
      const auto target = start + std::chrono::duration<double>(static_cast<double>(n) / copy_bps_);
      std::this_thread::sleep_until(target);
    }
    return Status::Ok();
  }

  static void ConvertElems(std::byte* dst, DType dt, const std::byte* src, DType st, int64_t n,
                           float scale) {
    auto load = [&](int64_t i) -> float {
      switch (st) {
        case DType::kF32:
          return reinterpret_cast<const float*>(src)[i];
        case DType::kF16:
          return HalfToFloat(reinterpret_cast<const uint16_t*>(src)[i]);
        case DType::kBF16:
          return Bf16ToFloat(reinterpret_cast<const uint16_t*>(src)[i]);
      }
      return 0;
    };
    // Ascending order makes narrowing in place safe: element i is read at
    // i*sizeof(src) before anything at or after it is written.
    for (int64_t i = 0; i < n; ++i) {
      const float x = scale == 1.0f ? load(i) : load(i) * scale;
      switch (dt) {
        case DType::kF32:
          reinterpret_cast<float*>(dst)[i] = x;
          break;
        case DType::kF16:
          reinterpret_cast<uint16_t*>(dst)[i] = FloatToHalf(x);
          break;
        case DType::kBF16:
          reinterpret_cast<uint16_t*>(dst)[i] = FloatToBf16(x);
          break;
      }
    }
  }

  void Run() {
    for (;;) {
      Work w;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        w = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
        if (!error_.ok() && !w.always_run) {
          busy_ = false;
          if (queue_.empty()) idle_cv_.notify_all();
          continue;
        }
      }
      if (w.name && max_delay_us_ > 0) {  // delaying mode: work starts late, at random
        std::uniform_int_distribution<int64_t> us(0, max_delay_us_);
        std::this_thread::sleep_for(std::chrono::microseconds(us(delay_rng_)));
      }
      const int64_t begin_ns = trace_ && w.name ? trace_->NowNs() : 0;
      // A throw (std::bad_alloc in a kernel's scratch) fails the stream as an error would.
      Status s = CallCatchingExceptions("", w.fn);
      if (trace_ && w.name) trace_->Record(track_, w.name, w.category, begin_ns, trace_->NowNs());
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!s.ok() && error_.ok()) {
          error_ = w.label ? Status(s.code(), fmt::format("{} failed on stream '{}': {}", *w.label,
                                                          name_, s.message()))
                           : s.WithContext(fmt::format("stream '{}'", name_));
        }
        busy_ = false;
        if (queue_.empty()) idle_cv_.notify_all();
      }
    }
  }

  const std::string name_;
  const double copy_bps_;
  const int64_t max_delay_us_;
  std::mt19937_64 delay_rng_;  // worker thread only
  trace::TraceRecorder* const trace_;
  const int track_;
  const int64_t fault_at_launch_;  // 0: no injected fault
  std::atomic<int64_t> launches_{0};
  std::atomic<uint64_t>* h2d_;
  std::atomic<uint64_t>* d2h_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<Work> queue_ STRATA_GUARDED_BY(mu_);
  bool busy_ STRATA_GUARDED_BY(mu_) = false;
  bool stop_ STRATA_GUARDED_BY(mu_) = false;
  Status error_ STRATA_GUARDED_BY(mu_);
  std::shared_ptr<const std::string> label_ STRATA_GUARDED_BY(mu_);  // SetWorkLabel's
  std::thread worker_;
};

class HostArena final : public DeviceArena {
 public:
  // `taken` (the device's count of arena bytes alive) gets `charged` back when the arena goes.
  HostArena(std::byte* base, size_t size, std::shared_ptr<std::atomic<size_t>> taken,
            size_t charged)
      : DeviceArena(base, size), base_(base), taken_(std::move(taken)), charged_(charged) {}
  ~HostArena() override {
    std::free(base_);
    *taken_ -= charged_;
  }

 private:
  std::byte* base_;
  std::shared_ptr<std::atomic<size_t>> taken_;
  size_t charged_;
};

StatusOr<MemInfo> HostMemInfo() {
  std::ifstream in("/proc/meminfo");
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return UnavailableError("could not read /proc/meminfo");
  return ParseMeminfo(text.str());
}

class HostDevice final : public Device {
 public:
  explicit HostDevice(const HostDeviceOptions& o) : Device(o.pinned_budget_bytes), options_(o) {}

  DeviceKind kind() const override { return DeviceKind::kHost; }
  std::string description() const override {
    return fmt::format(
        "host (emulated device, {} hardware threads{})", std::thread::hardware_concurrency(),
        options_.copy_bytes_per_second > 0
            ? fmt::format(", copies throttled to {}", FormatRate(options_.copy_bytes_per_second))
            : "");
  }

  StatusOr<std::unique_ptr<DeviceArena>> CreateArena(size_t size_bytes) override {
    const size_t size = AlignUp(std::max<size_t>(size_bytes, 1), 4096);
    if (options_.memory_bytes > 0) {
      size_t taken = taken_->load();
      do {
        if (size > options_.memory_bytes - taken) return ArenaRefused(size);
      } while (!taken_->compare_exchange_weak(taken, taken + size));
    } else {
      *taken_ += size;
    }
    void* p = std::aligned_alloc(4096, size);
    if (!p) {
      *taken_ -= size;
      return ArenaRefused(size);
    }
    std::memset(p, 0, size);
    return std::unique_ptr<DeviceArena>(
        new HostArena(static_cast<std::byte*>(p), size_bytes, taken_, size));
  }

  StatusOr<DeviceMemoryInfo> MemoryInfo() override {
    if (options_.memory_bytes > 0) {
      return DeviceMemoryInfo{
          options_.memory_bytes - std::min(taken_->load(), options_.memory_bytes),
          options_.memory_bytes};
    }
    STRATA_ASSIGN_OR_RETURN(const MemInfo m, HostMemInfo());
    return DeviceMemoryInfo{m.available_bytes, m.total_bytes};
  }

  StatusOr<std::unique_ptr<Stream>> CreateStream(std::string name) override {
    const uint64_t delay_seed = options_.random_delay_seed + streams_created_.fetch_add(1);
    return std::unique_ptr<Stream>(
        new HostStream(std::move(name), options_, delay_seed, &bytes_h2d_, &bytes_d2h_));
  }

  StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return std::unique_ptr<Event>(new HostEvent());
  }

 protected:
  // The same aligned mapping the CUDA backend page-locks (gpu/pinned_memory.h), so both backends
  // hand out pinned buffers of the same alignment for every size.
  StatusOr<std::byte*> PinnedAlloc(size_t size_bytes) override {
    return MapAlignedHostMemory(size_bytes);
  }
  void PinnedFree(std::byte* data, size_t size_bytes) override {
    UnmapAlignedHostMemory(data, size_bytes);
  }

 private:
  // The same one line as the CUDA backend's (gpu/cuda/cuda_device.cc).
  Status ArenaRefused(size_t size) {
    const StatusOr<DeviceMemoryInfo> m = MemoryInfo();
    return ResourceExhaustedError(fmt::format(
        "could not take {} of device memory for the device arena ({} of {} is free on the host "
        "device; another user may hold the rest); lower the device memory budget or free the "
        "device",
        FormatBytes(size), m.ok() ? FormatBytes(m->free_bytes) : std::string("?"),
        m.ok() ? FormatBytes(m->total_bytes) : std::string("?")));
  }

  HostDeviceOptions options_;
  std::atomic<uint64_t> streams_created_{0};
  // Bytes of the arenas alive, shared with them (an arena may outlive nothing, but is counted
  // back when it goes).
  std::shared_ptr<std::atomic<size_t>> taken_ = std::make_shared<std::atomic<size_t>>(0);
};

}  // namespace

StatusOr<std::unique_ptr<Device>> CreateHostDevice(const HostDeviceOptions& options) {
  if (options.copy_bytes_per_second < 0) {
    return InvalidArgumentError("copy bandwidth must be >= 0 (0 = unthrottled)");
  }
  if (options.max_random_delay_us < 0) {
    return InvalidArgumentError("max_random_delay_us must be >= 0 (0 = no delays)");
  }
  if (options.fault_at_launch < 0) {
    return InvalidArgumentError(
        fmt::format("fault_at_launch {} must be >= 0 (0 = no fault)", options.fault_at_launch));
  }
  return std::unique_ptr<Device>(new HostDevice(options));
}

}  // namespace strata::gpu
