// The device layer: memory kinds, a budgeted device arena, pinned host memory,
// in-order streams and events (vocabulary after ggml-backend and CUDA).
//
// Device is the seam that makes the engine testable without a GPU. The host
// backend (gpu/host/) runs each Stream on its own worker thread with an in-order
// queue, so copies and compute really overlap and a missing event wait shows up
// as a wrong answer in CI; it can throttle copy bandwidth to a PCIe-like figure.
// A CUDA backend implements the same interface with cudaStream_t/cudaEvent_t.
//
// Memory kinds are in the types: DeviceSpan is device memory, PinnedSpan is
// page-locked host memory. Async copies take only pinned host memory (a pageable
// source would silently serialize a CUDA copy), so the API has no void* copy.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "base/dtype.h"
#include "base/status.h"
#include "base/trace.h"

namespace strata::gpu {

enum class DeviceKind { kHost, kCuda };
std::string_view DeviceKindName(DeviceKind kind);  // "host", "cuda"

// Non-owning view of device memory. Only kernels on a stream of the owning
// device may dereference it (on the host backend: functions run by LaunchHost).
struct DeviceSpan {
  std::byte* data = nullptr;
  size_t size_bytes = 0;
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data);
  }
  DeviceSpan subspan(size_t offset_bytes, size_t size) const;  // STRATA_CHECKs bounds
};

// Non-owning view of pinned (page-locked, DMA-able) host memory, 4 KiB-aligned
// when it comes from Device::AllocatePinned (so it can also be an O_DIRECT buffer).
struct PinnedSpan {
  std::byte* data = nullptr;
  size_t size_bytes = 0;
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data);
  }
  PinnedSpan subspan(size_t offset_bytes, size_t size) const;
  std::span<std::byte> bytes() const { return {data, size_bytes}; }
};

// Owning pinned host allocation; returns its bytes to the device's pinned budget
// when destroyed. Move-only. Destroy only after every copy and I/O using it has
// completed (wait on the events of the last copies first).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&&) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&&) noexcept;
  ~PinnedBuffer();
  PinnedSpan span() const { return {data_, size_bytes_}; }
  std::byte* data() const { return data_; }
  size_t size_bytes() const { return size_bytes_; }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }

 private:
  friend class Device;
  using Deleter = std::function<void(std::byte*, size_t)>;
  PinnedBuffer(std::byte* data, size_t size_bytes, Deleter deleter);
  std::byte* data_ = nullptr;
  size_t size_bytes_ = 0;
  Deleter deleter_;
};

// Device memory taken once, up front, and carved by a bump allocator: no
// allocation and no fragmentation inside a training step. Carve() is not
// thread-safe (the engine carves during setup on one thread).
class DeviceArena {
 public:
  static constexpr size_t kAlignment = 256;
  virtual ~DeviceArena() = default;
  // kResourceExhausted naming `label`, the request and what is left.
  StatusOr<DeviceSpan> Carve(size_t size_bytes, std::string_view label);
  size_t capacity_bytes() const { return capacity_bytes_; }
  size_t used_bytes() const { return used_bytes_; }  // also the peak: nothing is freed

 protected:
  DeviceArena(std::byte* base, size_t capacity_bytes)
      : base_(base), capacity_bytes_(capacity_bytes) {}

 private:
  std::byte* base_;
  size_t capacity_bytes_;
  size_t used_bytes_ = 0;
};

// Marks a point in a stream's work. Record() on a stream captures all work
// enqueued on that stream so far; Synchronize() blocks the calling host thread
// until that work has completed. Re-recording is allowed (like cudaEventRecord).
class Event {
 public:
  virtual ~Event() = default;
  virtual Status Synchronize() = 0;  // host waits; returns the recording stream's first error
  virtual bool Query() = 0;          // true when completed (or never recorded)
};

// An in-order queue of work. Enqueue calls return at once; errors in the work
// itself (a failed kernel) are sticky and returned by Synchronize(). Methods may
// be called from any host thread, but one thread per stream keeps order obvious.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual std::string_view name() const = 0;
  // The backend this stream belongs to (the owning Device's kind()), so that code
  // launching its own kernels (models/) can pick the host or the CUDA path.
  virtual DeviceKind device_kind() const = 0;
  // Host-to-device copy of src.size_bytes bytes; dst.size_bytes >= src.size_bytes.
  virtual Status CopyH2D(DeviceSpan dst, PinnedSpan src) = 0;
  // Device-to-host copy of src.size_bytes bytes; dst.size_bytes >= src.size_bytes.
  virtual Status CopyD2H(PinnedSpan dst, DeviceSpan src) = 0;
  // Converts num_elems elements src (src_dtype) to dst (dst_dtype), multiplying by
  // `scale` in fp32 first; round to nearest even, NaN kept, fp16 overflow -> inf.
  // In place is allowed when dst.data == src.data (narrowing or same width).
  virtual Status Convert(DeviceSpan dst, DType dst_dtype, DeviceSpan src, DType src_dtype,
                         int64_t num_elems, float scale = 1.0f) = 0;
  // Runs fn in stream order on the stream's own thread (host backend) or as a
  // host callback in stream order (CUDA). A non-OK result makes the stream's
  // error sticky; later work is skipped, events still complete.
  // CUDA backend: fn runs on a CUDA runtime thread (cudaLaunchHostFunc), must not call
  // the CUDA API, and blocks its stream while it runs; the runtime may run the host
  // functions of all streams on one thread, so long CPU work belongs on its own thread,
  // ordered by events. Only host functions are skipped after an error there: copies and
  // kernels already enqueued still run.
  virtual Status LaunchHost(std::function<Status()> fn) = 0;
  // LaunchHost whose time counts as `category` in a trace (the host backend's breakdown): a
  // collective's host function is kComm. Backends without per-op categories ignore it.
  virtual Status LaunchHostAs(trace::Category category, std::function<Status()> fn) {
    return LaunchHost(std::move(fn));
  }
  // Names the work enqueued on this stream from now on, until the next call, for its errors
  // ("backward of block 3 ('layer 2')"; "" = no name): when a copy, conversion or host function
  // of that work fails, the stream's sticky error reads "<label> failed: <error>", so whoever
  // meets the error later (Synchronize, an event, another stream waiting on one) learns which op
  // it was. CUDA: names the host functions and what the stream's synchronizations report; a
  // kernel's fault surfaces at the next synchronization and is named by the label current then
  // (a launch error is the launching call's return value, which its caller names). Call from the
  // one thread that enqueues on the stream. Default: labels are ignored.
  virtual void SetWorkLabel(std::string label) { (void)label; }
  virtual Status Record(Event& event) = 0;
  // Later work on this stream waits until `event`'s recorded work completed.
  virtual Status Wait(Event& event) = 0;
  // Blocks the host until all enqueued work completed; returns the sticky error.
  virtual Status Synchronize() = 0;
};

// Device memory, bytes, as the device reports it when asked.
struct DeviceMemoryInfo {
  size_t free_bytes = 0;   // what an arena could take now
  size_t total_bytes = 0;  // the device's memory
  // What the backend itself takes beside the arena once a compute stream runs its first matrix
  // product (CUDA: that stream's 32 MiB cuBLAS workspace; host: 0): an arena of more than
  // free_bytes - outside_arena_bytes leaves the workspace's allocation to fail.
  size_t outside_arena_bytes = 0;
};

struct DeviceCounters {
  uint64_t bytes_h2d = 0;
  uint64_t bytes_d2h = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual DeviceKind kind() const = 0;
  virtual std::string description() const = 0;  // "host (emulated device, 2 threads)"
  // Takes device memory once. kResourceExhausted when it cannot be had (another process holds
  // the GPU's memory, or the request is above what is free), one line naming the request, what
  // is free and the device's total.
  virtual StatusOr<std::unique_ptr<DeviceArena>> CreateArena(size_t size_bytes) = 0;
  // Device memory free now and in total: CUDA cudaMemGetInfo (what other processes hold is not
  // free); host HostDeviceOptions::memory_bytes less the arenas taken, or the host's memory
  // (MemAvailable, MemTotal of /proc/meminfo) when that is 0. Errors: the query's (kUnavailable,
  // kInternal). Thread-safe.
  virtual StatusOr<DeviceMemoryInfo> MemoryInfo() = 0;
  // Pinned host memory, 4 KiB-aligned, zero-filled, counted against the pinned
  // budget: kResourceExhausted naming the request, the budget and what is used.
  StatusOr<PinnedBuffer> AllocatePinned(size_t size_bytes, std::string_view label);
  // Pins host memory the caller maps and keeps alive (a shared-memory mapping:
  // engine/shared_frozen_base.h): page-locks [data, data + size_bytes) for DMA (CUDA:
  // cudaHostRegister; the host backend has nothing to do), counted against the pinned budget as
  // AllocatePinned's memory is. The buffer unpins when destroyed and never frees: the mapping
  // must outlive it. data 4 KiB-aligned and size_bytes a multiple of 4 KiB (kInvalidArgument
  // otherwise). Errors: kResourceExhausted as AllocatePinned's, the registration's. Thread-safe.
  StatusOr<PinnedBuffer> RegisterPinned(std::byte* data, size_t size_bytes, std::string_view label);
  virtual StatusOr<std::unique_ptr<Stream>> CreateStream(std::string name) = 0;
  virtual StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;
  DeviceCounters counters() const;
  size_t pinned_used_bytes() const { return pinned_used_.load(); }
  size_t pinned_budget_bytes() const { return pinned_budget_bytes_; }

 protected:
  explicit Device(size_t pinned_budget_bytes) : pinned_budget_bytes_(pinned_budget_bytes) {}
  virtual StatusOr<std::byte*> PinnedAlloc(size_t size_bytes) = 0;
  virtual void PinnedFree(std::byte* data, size_t size_bytes) = 0;
  // RegisterPinned's page-locking and its undoing (default: nothing, memory is already DMA-able).
  virtual Status PinnedRegister(std::byte* data, size_t size_bytes) { return Status::Ok(); }
  virtual void PinnedUnregister(std::byte* data, size_t size_bytes) {}
  std::atomic<uint64_t> bytes_h2d_{0};
  std::atomic<uint64_t> bytes_d2h_{0};

 private:
  // size_bytes more of the pinned budget, or kResourceExhausted naming `label`. Thread-safe.
  Status ReservePinned(size_t size_bytes, std::string_view label);
  size_t pinned_budget_bytes_;
  std::atomic<size_t> pinned_used_{0};
};

struct HostDeviceOptions {
  // Copy bandwidth of H2D and D2H each, bytes/s; 0 = as fast as memcpy. Lets CI
  // see PCIe-like costs and overlap.
  double copy_bytes_per_second = 0;
  size_t pinned_budget_bytes = size_t{1} << 40;
  // Delaying mode, for tests of stream ordering: each copy, conversion and kernel starts after a
  // random delay of 0..max_random_delay_us microseconds (uniform, per stream seeded from
  // random_delay_seed), so work whose event wait is missing runs too early and is caught.
  int64_t max_random_delay_us = 0;
  uint64_t random_delay_seed = 1;
  // Not owned; must outlive the device. Each stream records its copies (h2d/d2h), conversions and
  // kernels (compute) on a track named after the stream. nullptr: no tracing.
  trace::TraceRecorder* trace = nullptr;
  // Emulated device memory, bytes: MemoryInfo reports it (less the arenas alive), and an arena
  // above what is free is refused with kResourceExhausted, as a GPU another process holds would
  // refuse it. 0: the host's memory (MemAvailable / MemTotal), nothing refused beyond malloc.
  size_t memory_bytes = 0;
  // Fault injection, for tests of how errors travel (a failing kernel): the
  // fault_at_launch-th host function (LaunchHost / LaunchHostAs, counted from 1 per stream) on
  // each stream named fault_stream fails with kInternal "injected fault (launch N on stream
  // 'S')" instead of running; it becomes that stream's sticky error like a real one. 0: none.
  std::string fault_stream;
  int64_t fault_at_launch = 0;
};

// The host emulation backend: device memory is host memory, streams are
// worker threads. Thread-safe to create streams/events from any thread.
StatusOr<std::unique_ptr<Device>> CreateHostDevice(const HostDeviceOptions& options);

}  // namespace strata::gpu
