// I/O backends: positional reads and writes of whole buffers, the layer under the swap store.
//
// Three named backends behind one interface (the choice is logged once by CreateIoBackend and can
// be forced, after scylladb/seastar src/core/reactor_backend.cc):
//   "uring"  - io_uring through liburing; pieces of a request are submitted in batches and kept in
//              flight up to the queue depth. Works with O_DIRECT file descriptors.
//   "posix"  - pread/pwrite, pieces spread over a small thread pool.
//   "memory" - for tests: an in-process map from fd number to a byte vector. The fd is only a key;
//              nothing touches the file system. Reads past the end of what was written hit end of
//              file. Data is lost with the backend.
//
// Contract shared by all backends (io/transfer.h implements it once):
//   - Read/Write transfer exactly buf.size() bytes and block the calling thread until the whole
//     transfer has completed or failed. A request is split into pieces of block_size_bytes.
//   - Every completion is checked for its full length: a short transfer is resubmitted for the
//     remainder, EAGAIN and EINTR are retried (bounded), a read that hits end of file before the
//     full length is kDataLoss. Other errors come back through ErrnoToStatus with a message naming
//     the caller's `what` label, the offset and the errno; the codes are therefore those of
//     ErrnoToStatus: kDataLoss (EIO), kResourceExhausted (ENOSPC, EDQUOT, EFBIG),
//     kInvalidArgument (EBADF, EINVAL: e.g. misaligned O_DIRECT), kPermissionDenied, kUnavailable
//     (EAGAIN that never stopped), ... When a call fails, no piece of it is still in flight:
//     the buffer may be reused or freed at once.
//   - For O_DIRECT fds the caller guarantees buf.data(), buf.size() and offset_bytes are multiples
//     of 4096; block_size_bytes is a multiple of 4096 so every piece stays aligned.
//   - Thread-safe: several threads may call concurrently, on different fds or the same one. Calls
//     that overlap in the same file range race like concurrent pwrite calls do.
//   - A backend must not be destroyed while a call on it is in flight.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "base/status.h"

namespace strata::io {

enum class BackendKind { kAuto, kUring, kPosix, kMemory };

// "auto", "uring", "posix", "memory".
std::string_view BackendKindName(BackendKind kind);
// Inverse of BackendKindName. kInvalidArgument naming the text and the accepted choices.
StatusOr<BackendKind> ParseBackendKind(std::string_view text);

enum class IoOp { kRead, kWrite };
std::string_view IoOpName(IoOp op);  // "read", "write"

// Test seam (used by FaultInjectingBackend, io/fault_injection.h): sees every piece completion of
// a backend before the backend acts on it, so injected faults go through the backend's own
// resubmit and retry logic. Called on the thread that reaps the completion (the caller for
// "uring" and "memory", a pool thread for "posix"), possibly from several threads at once.
class CompletionHook {
 public:
  virtual ~CompletionHook() = default;
  // `*result` is what the kernel reported for a submission of length_bytes at offset_bytes: a
  // byte count or -errno. The hook may replace it with a smaller count or a -errno, and may block.
  virtual void OnCompletion(IoOp op, int fd, uint64_t offset_bytes, size_t length_bytes,
                            int64_t* result) = 0;
};

struct IoBackendOptions {
  // kAuto: "uring" if ProbeUring() succeeds, else "posix"; the choice and the reason are logged.
  BackendKind kind = BackendKind::kAuto;
  int queue_depth = 32;               // pieces in flight per call, 1..4096 ("uring")
  size_t block_size_bytes = 1 << 20;  // pieces of this size; multiple of 4096, at most 1 GiB
  int posix_threads = 4;              // worker threads of "posix", 1..256 (1: caller's thread)
  // "uring" only: rings are set up with IORING_SETUP_SQPOLL (a kernel thread per ring polls the
  // submission queue, idle after 1 s), which saves the submit system call at the price of a
  // polling kernel thread per ring. Needs Linux 5.11+ unprivileged; when the kernel refuses it,
  // CreateIoBackend fails (kPermissionDenied / kInvalidArgument naming SQPOLL) rather than
  // silently running without it.
  bool sqpoll = false;
  CompletionHook* completion_hook = nullptr;  // not owned, must outlive the backend; tests only
};

// kInvalidArgument naming the field when a value is out of range.
Status ValidateIoBackendOptions(const IoBackendOptions& options);

// OK when io_uring can be used here: a ring can be set up, the kernel knows IORING_OP_READ and
// IORING_OP_WRITE, and a no-op round trip completes. Otherwise kUnavailable saying why (kernel
// too old, kernel.io_uring_disabled, a seccomp filter refusing io_uring_setup, memlock limit).
// Cheap (one short-lived ring); not cached.
Status ProbeUring();

// Latency of I/O submissions in nanoseconds, in an HdrHistogram-like fixed array: values below
// 16 ns have a bucket each; above, every power-of-two range [2^k, 2^(k+1)) is split into 16
// equal sub-buckets, so a bucket's width is at most 1/16 (6.25 %) of its lower bound. Recording
// is one relaxed atomic increment (thread-safe, wait-free); reading while others record gives a
// consistent-enough snapshot for reporting (each counter is read atomically, not all at once).
class LatencyHistogram {
 public:
  static constexpr int kSubBuckets = 16;
  static constexpr int kNumBuckets = kSubBuckets + (64 - 4) * kSubBuckets;

  void Record(uint64_t latency_ns);
  void Reset();
  // Adds other's counts to this one (not atomic as a whole).
  void Merge(const LatencyHistogram& other);

  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  uint64_t sum_ns() const { return sum_ns_.load(std::memory_order_relaxed); }
  uint64_t max_ns() const { return max_ns_.load(std::memory_order_relaxed); }
  double MeanNs() const;  // 0 when empty
  // The value at or below which `quantile` (0..1) of the recorded latencies lie: the upper bound
  // of the bucket holding that rank, capped at max_ns() (so within 6.25 % above the exact value).
  // 0 when empty.
  uint64_t QuantileNs(double quantile) const;

  static int BucketOf(uint64_t value_ns);
  static uint64_t BucketUpperNs(int bucket);  // largest value that lands in `bucket`

 private:
  std::array<std::atomic<uint64_t>, kNumBuckets> counts_{};
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_ns_{0};
  std::atomic<uint64_t> max_ns_{0};
};

// What a backend did since creation or the last ResetStats(). Counts are of submissions: one
// piece may be submitted several times (short transfers, retries).
struct IoStats {
  uint64_t submissions = 0;               // every submission (io_uring SQE, pread/pwrite call)
  uint64_t fixed_buffer_submissions = 0;  // IORING_OP_READ_FIXED / WRITE_FIXED ("uring")
  uint64_t fixed_file_submissions = 0;    // with IOSQE_FIXED_FILE ("uring")
  uint64_t short_transfer_resubmits = 0;  // completions with fewer bytes than asked, resubmitted
  uint64_t eagain_retries = 0;            // completions with -EAGAIN or -EINTR, retried
  uint64_t bytes_transferred = 0;         // sum of successful completion byte counts
  // Submit -> completion time of each submission, in nanoseconds. For "uring" the clock starts
  // just before the io_uring_enter that submits it and stops when its completion is reaped; for
  // "posix" and "memory" it is the duration of the pread/pwrite call.
  const LatencyHistogram* latency = nullptr;  // owned by the backend, valid while it lives
};

// One piece of a batched call. `what` labels errors ("extent 'block3.m' in /nvme0/.../swap.0").
struct ReadSegment {
  int fd = -1;
  uint64_t offset_bytes = 0;
  std::span<std::byte> buf;
  std::string_view what;
};
struct WriteSegment {
  int fd = -1;
  uint64_t offset_bytes = 0;
  std::span<const std::byte> buf;
  std::string_view what;
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;

  // "uring", "posix" or "memory".
  virtual std::string_view name() const = 0;

  // Reads/writes exactly buf.size() bytes at offset_bytes of fd (see the contract above). `what`
  // names the file in error messages. buf is not retained after the call returns.
  virtual Status Read(int fd, uint64_t offset_bytes, std::span<std::byte> buf,
                      std::string_view what) = 0;
  virtual Status Write(int fd, uint64_t offset_bytes, std::span<const std::byte> buf,
                       std::string_view what) = 0;

  // Several segments (possibly on different fds, e.g. one per drive) as one call: the backends
  // keep pieces of all segments in flight together. Returns the first error; on error, other
  // segments may or may not have been transferred. The default runs the segments one by one.
  virtual Status ReadBatch(std::span<const ReadSegment> segments);
  virtual Status WriteBatch(std::span<const WriteSegment> segments);

  // Registers long-lived buffers (typically the pinned host arena) for zero-setup I/O. "uring"
  // registers them with io_uring_register_buffers on every ring it has and every ring it makes
  // later, and submits any piece whose buffer lies wholly inside one registered region with
  // IORING_OP_READ_FIXED / IORING_OP_WRITE_FIXED (plain READ/WRITE otherwise, so passing other
  // buffers stays correct). Regions larger than 1 GiB are registered as several 1 GiB iovecs
  // (the kernel's limit); a piece straddling such a boundary goes the plain way. A call replaces
  // the previous set; an empty span unregisters everything. The memory is not owned: it must stay
  // valid until it is replaced or the backend is destroyed (the kernel pins its pages, counted
  // against RLIMIT_MEMLOCK on most kernels). Must not be called while I/O on this backend is in
  // flight from other threads. Errors: kResourceExhausted (ENOMEM: raise `ulimit -l`),
  // kInvalidArgument (empty or overlapping regions, more than 16384 iovecs), other
  // io_uring_register errors through ErrnoToStatus; on error no region is registered. Default
  // ("posix", "memory"): OK, nothing to do.
  virtual Status RegisterBuffers(std::span<const std::span<std::byte>> regions);

  // Adds / removes file descriptors to / from the registered-file table ("uring": each ring's
  // table is brought up to date with io_uring_register_files the next time a thread takes it, and
  // submissions on a registered fd carry IOSQE_FIXED_FILE, which skips the per-request fget/fput).
  // A registered fd must be unregistered before it is closed (a ring's table holds a reference to
  // the open file, and the fd number could be reused for another file). Registering an fd twice is
  // a no-op; unregistering an unknown one too. Must not overlap with I/O on the same fds from
  // other threads. Errors: kInvalidArgument for a negative fd. Default: OK, nothing to do.
  virtual Status RegisterFiles(std::span<const int> fds);
  virtual void UnregisterFiles(std::span<const int> fds);

  // Counters and the latency histogram (see IoStats). Thread-safe.
  virtual IoStats stats() const;
  virtual void ResetStats();
};

// Creates the backend named by options.kind (kAuto: see IoBackendOptions::kind). Errors:
// kInvalidArgument for bad options; kUnavailable (with ProbeUring's reason) when kUring is forced
// and io_uring is unusable; ring setup errors via ErrnoToStatus.
StatusOr<std::unique_ptr<IoBackend>> CreateIoBackend(const IoBackendOptions& options);

}  // namespace strata::io
