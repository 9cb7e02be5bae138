// Internal to io/: the completion rules every backend shares (splitting a request into pieces,
// checking each completion for its full length, resubmitting short transfers, retrying EAGAIN),
// and SegmentBackend, the base class that maps the public IoBackend calls onto one Transfer().
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "base/status.h"
#include "io/io_backend.h"

namespace strata::io::internal {

// Granularity of O_DIRECT alignment that the resubmission logic preserves.
inline constexpr size_t kDirectIoAlignment = 4096;
// Consecutive retries of one piece (EAGAIN, EINTR, a write of 0 bytes, a short transfer that
// made no aligned progress) before the call gives up.
inline constexpr int kMaxRetries = 64;

// A contiguous range of one call: `data` is written into for reads and only read for writes.
struct Segment {
  int fd = -1;
  uint64_t offset_bytes = 0;
  std::byte* data = nullptr;
  size_t size_bytes = 0;
  std::string_view what;
};

// One piece in flight (at most block_size_bytes) and how far it has got.
struct Piece {
  int fd = -1;
  uint64_t offset_bytes = 0;
  std::byte* data = nullptr;
  size_t size_bytes = 0;
  std::string_view what;
  // offset_bytes, data and size_bytes all multiples of kDirectIoAlignment: the piece may be on
  // an O_DIRECT fd, so resubmissions must start at aligned positions too.
  bool aligned = false;
  size_t resume_bytes = 0;  // the next submission starts here (relative to the piece)
  size_t end_bytes = 0;     // the furthest point a completion has reached
  int retries = 0;          // consecutive retries without progress
  uint64_t submit_ns = 0;   // MonotonicNs() when the current submission went to the kernel

  uint64_t next_offset_bytes() const { return offset_bytes + resume_bytes; }
  std::byte* next_data() const { return data + resume_bytes; }
  size_t next_size_bytes() const { return size_bytes - resume_bytes; }
};

// Yields the pieces of `segments` in order, each at most block_size_bytes; empty segments are
// skipped. Pieces of an aligned segment are aligned (block_size_bytes is a multiple of 4096).
class PieceCursor {
 public:
  PieceCursor(std::span<const Segment> segments, size_t block_size_bytes);
  bool done() const { return segment_ == segments_.size(); }
  Piece Next();  // requires !done()

 private:
  void SkipEmpty();
  std::span<const Segment> segments_;
  size_t block_size_bytes_;
  size_t segment_ = 0;
  size_t offset_in_segment_ = 0;
};

enum class Outcome {
  kDone,        // the piece is complete
  kResubmit,    // submit piece.next_*() again now
  kRetryLater,  // submit again after BackoffBeforeRetry(piece.retries)
  kFailed,      // *error says why
};

// Applies one completion `result` (byte count or -errno) of a submission of piece.next_*() to
// `piece`. Short transfers advance the piece and ask for a resubmission of the remainder, as in
// axboe/liburing examples/io_uring-cp.c; for an aligned piece the remainder starts at the aligned
// position below the bytes done (rereading or rewriting a few bytes is harmless and O_DIRECT
// needs it). EAGAIN/EINTR and writes of 0 bytes are retried up to kMaxRetries times. End of file
// on a read is kDataLoss: a read of 0 bytes, or, for an aligned piece, a short read that twice
// ends at the same unaligned point (an O_DIRECT read stops at end of file). Other errors:
// ErrnoToStatus naming piece.what, the offset and the errno.
Outcome ApplyCompletion(IoOp op, int64_t result, Piece& piece, Status* error);

// CLOCK_MONOTONIC in nanoseconds (vDSO, tens of nanoseconds).
inline uint64_t MonotonicNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// The counters behind IoBackend::stats(); all updates are relaxed atomics. Thread-safe.
class StatsCollector {
 public:
  // One submission completed with `result` (bytes or -errno) after latency_ns, and
  // ApplyCompletion decided `outcome`.
  void OnCompletion(int64_t result, Outcome outcome, uint64_t latency_ns) {
    submissions_.fetch_add(1, std::memory_order_relaxed);
    latency_.Record(latency_ns);
    if (result > 0) bytes_.fetch_add(static_cast<uint64_t>(result), std::memory_order_relaxed);
    if (outcome == Outcome::kResubmit || outcome == Outcome::kRetryLater) {
      if (result < 0) {
        eagain_.fetch_add(1, std::memory_order_relaxed);
      } else {
        short_.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  void OnFixed(bool fixed_buffer, bool fixed_file) {
    if (fixed_buffer) fixed_buffer_.fetch_add(1, std::memory_order_relaxed);
    if (fixed_file) fixed_file_.fetch_add(1, std::memory_order_relaxed);
  }
  IoStats Snapshot() const;
  void Reset();

 private:
  std::atomic<uint64_t> submissions_{0};
  std::atomic<uint64_t> fixed_buffer_{0};
  std::atomic<uint64_t> fixed_file_{0};
  std::atomic<uint64_t> short_{0};
  std::atomic<uint64_t> eagain_{0};
  std::atomic<uint64_t> bytes_{0};
  LatencyHistogram latency_;
};

// Sleeps a little longer with each retry (tens of microseconds up to about a millisecond).
void BackoffBeforeRetry(int retries);

// Runs one piece to completion on the calling thread. `attempt(piece)` submits piece.next_*()
// once and returns the byte count or -errno.
// Every attempt is counted in `stats` (latency: the duration of attempt() and the hook).
template <typename Attempt>
Status RunPieceSync(IoOp op, Piece piece, CompletionHook* hook, StatsCollector& stats,
                    Attempt&& attempt) {
  while (true) {
    const uint64_t start_ns = MonotonicNs();
    int64_t result = attempt(piece);
    if (hook != nullptr) {
      hook->OnCompletion(op, piece.fd, piece.next_offset_bytes(), piece.next_size_bytes(), &result);
    }
    const uint64_t latency_ns = MonotonicNs() - start_ns;  // a hook's injected delay included
    Status error;
    const Outcome outcome = ApplyCompletion(op, result, piece, &error);
    stats.OnCompletion(result, outcome, latency_ns);
    switch (outcome) {
      case Outcome::kDone:
        return Status::Ok();
      case Outcome::kFailed:
        return error;
      case Outcome::kRetryLater:
        BackoffBeforeRetry(piece.retries);
        break;
      case Outcome::kResubmit:
        break;
    }
  }
}

// Implements Read/Write/ReadBatch/WriteBatch by checking the arguments and calling Transfer once.
class SegmentBackend : public IoBackend {
 public:
  Status Read(int fd, uint64_t offset_bytes, std::span<std::byte> buf, std::string_view what) final;
  Status Write(int fd, uint64_t offset_bytes, std::span<const std::byte> buf,
               std::string_view what) final;
  Status ReadBatch(std::span<const ReadSegment> segments) final;
  Status WriteBatch(std::span<const WriteSegment> segments) final;
  IoStats stats() const override { return stats_.Snapshot(); }
  void ResetStats() override { stats_.Reset(); }

 protected:
  StatsCollector stats_;

  // Transfers all segments (some may be empty) and returns only when no piece of them is in
  // flight any more. Thread-safe.
  virtual Status Transfer(IoOp op, std::span<const Segment> segments) = 0;
};

// Factories of the concrete backends (options already validated).
StatusOr<std::unique_ptr<IoBackend>> CreateUringBackend(const IoBackendOptions& options);
std::unique_ptr<IoBackend> CreatePosixBackend(const IoBackendOptions& options);
std::unique_ptr<IoBackend> CreateMemoryBackend(const IoBackendOptions& options);

}  // namespace strata::io::internal
