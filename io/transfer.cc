#include "io/transfer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

namespace strata::io::internal {
namespace {

bool IsAligned(uint64_t value) { return value % kDirectIoAlignment == 0; }

std::string Context(IoOp op, const Piece& piece) {
  return fmt::format("{}: {} of {} bytes at offset {}", piece.what, IoOpName(op),
                     piece.next_size_bytes(), piece.next_offset_bytes());
}

Status EndOfFileError(const Piece& piece, size_t end_bytes) {
  return DataLossError(fmt::format(
      "{}: short read: end of file at offset {} with {} of {} bytes still missing", piece.what,
      piece.offset_bytes + end_bytes, piece.size_bytes - end_bytes, piece.size_bytes));
}

Status CheckSegment(int fd, uint64_t offset_bytes, size_t size_bytes, std::string_view what) {
  if (fd < 0) return InvalidArgumentError(fmt::format("{}: invalid file descriptor {}", what, fd));
  constexpr uint64_t kMaxOffset = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  if (offset_bytes > kMaxOffset || size_bytes > kMaxOffset - offset_bytes) {
    return InvalidArgumentError(
        fmt::format("{}: range of {} bytes at offset {} exceeds file size "
                    "limits",
                    what, size_bytes, offset_bytes));
  }
  return Status::Ok();
}

}  // namespace

PieceCursor::PieceCursor(std::span<const Segment> segments, size_t block_size_bytes)
    : segments_(segments), block_size_bytes_(block_size_bytes) {
  SkipEmpty();
}

void PieceCursor::SkipEmpty() {
  while (segment_ < segments_.size() && offset_in_segment_ == segments_[segment_].size_bytes) {
    ++segment_;
    offset_in_segment_ = 0;
  }
}

Piece PieceCursor::Next() {
  STRATA_CHECK(!done());
  const Segment& s = segments_[segment_];
  Piece p;
  p.fd = s.fd;
  p.offset_bytes = s.offset_bytes + offset_in_segment_;
  p.data = s.data + offset_in_segment_;
  p.size_bytes = std::min(block_size_bytes_, s.size_bytes - offset_in_segment_);
  p.what = s.what;
  p.aligned = IsAligned(p.offset_bytes) && IsAligned(reinterpret_cast<uintptr_t>(p.data)) &&
              IsAligned(p.size_bytes);
  offset_in_segment_ += p.size_bytes;
  SkipEmpty();
  return p;
}

Outcome ApplyCompletion(IoOp op, int64_t result, Piece& piece, Status* error) {
  const size_t requested = piece.next_size_bytes();
  if (result < 0) {
    const int err = static_cast<int>(-result);
    if (err == EAGAIN || err == EINTR) {
      if (++piece.retries > kMaxRetries) {
        *error = ErrnoToStatus(
            err, fmt::format("{} (gave up after {} retries)", Context(op, piece), kMaxRetries));
        return Outcome::kFailed;
      }
      return err == EAGAIN ? Outcome::kRetryLater : Outcome::kResubmit;
    }
    *error = ErrnoToStatus(err, Context(op, piece));
    return Outcome::kFailed;
  }
  if (static_cast<uint64_t>(result) > requested) {
    *error = InternalError(fmt::format("{}: completion reports {} bytes, more than requested",
                                       Context(op, piece), result));
    return Outcome::kFailed;
  }
  if (result == 0) {
    if (op == IoOp::kRead) {
      *error = EndOfFileError(piece, piece.resume_bytes);
      return Outcome::kFailed;
    }
    if (++piece.retries > kMaxRetries) {
      *error = DataLossError(fmt::format("{}: short write: no progress after {} attempts",
                                         Context(op, piece), kMaxRetries));
      return Outcome::kFailed;
    }
    return Outcome::kRetryLater;
  }
  const size_t done_bytes = piece.resume_bytes + static_cast<size_t>(result);
  if (done_bytes == piece.size_bytes) return Outcome::kDone;
  // Short transfer: resubmit the remainder (the pattern of axboe/liburing examples/io_uring-cp.c).
  // An aligned piece may be on an O_DIRECT fd, where an unaligned resubmission would fail with
  // EINVAL: resume at the aligned position at or below the bytes done instead.
  const size_t resume_bytes =
      piece.aligned ? done_bytes / kDirectIoAlignment * kDirectIoAlignment : done_bytes;
  const size_t previous_end_bytes = piece.end_bytes;
  piece.end_bytes = std::max(piece.end_bytes, done_bytes);
  if (resume_bytes <= piece.resume_bytes) {
    // No aligned progress. A read that stops at the same point again has hit end of file.
    if (op == IoOp::kRead && done_bytes == previous_end_bytes) {
      *error = EndOfFileError(piece, done_bytes);
      return Outcome::kFailed;
    }
    if (++piece.retries > kMaxRetries) {
      *error = DataLossError(fmt::format(
          "{}: short {}: only {} of {} bytes transferred, no aligned progress after {} attempts",
          Context(op, piece), IoOpName(op), result, requested, kMaxRetries));
      return Outcome::kFailed;
    }
    return Outcome::kResubmit;
  }
  piece.resume_bytes = resume_bytes;
  piece.retries = 0;
  return Outcome::kResubmit;
}

IoStats StatsCollector::Snapshot() const {
  IoStats s;
  s.submissions = submissions_.load(std::memory_order_relaxed);
  s.fixed_buffer_submissions = fixed_buffer_.load(std::memory_order_relaxed);
  s.fixed_file_submissions = fixed_file_.load(std::memory_order_relaxed);
  s.short_transfer_resubmits = short_.load(std::memory_order_relaxed);
  s.eagain_retries = eagain_.load(std::memory_order_relaxed);
  s.bytes_transferred = bytes_.load(std::memory_order_relaxed);
  s.latency = &latency_;
  return s;
}

void StatsCollector::Reset() {
  for (auto* counter : {&submissions_, &fixed_buffer_, &fixed_file_, &short_, &eagain_, &bytes_}) {
    counter->store(0, std::memory_order_relaxed);
  }
  latency_.Reset();
}

void BackoffBeforeRetry(int retries) {
  const int steps = std::min(retries, 20);
  std::this_thread::sleep_for(std::chrono::microseconds(50 * steps));
}

Status SegmentBackend::Read(int fd, uint64_t offset_bytes, std::span<std::byte> buf,
                            std::string_view what) {
  STRATA_RETURN_IF_ERROR(CheckSegment(fd, offset_bytes, buf.size(), what));
  const Segment segment{fd, offset_bytes, buf.data(), buf.size(), what};
  return Transfer(IoOp::kRead, {&segment, 1});
}

Status SegmentBackend::Write(int fd, uint64_t offset_bytes, std::span<const std::byte> buf,
                             std::string_view what) {
  STRATA_RETURN_IF_ERROR(CheckSegment(fd, offset_bytes, buf.size(), what));
  // The data is only read from; Segment is shared by both directions.
  const Segment segment{fd, offset_bytes, const_cast<std::byte*>(buf.data()), buf.size(), what};
  return Transfer(IoOp::kWrite, {&segment, 1});
}

Status SegmentBackend::ReadBatch(std::span<const ReadSegment> segments) {
  std::vector<Segment> converted;
  converted.reserve(segments.size());
  for (const ReadSegment& s : segments) {
    STRATA_RETURN_IF_ERROR(CheckSegment(s.fd, s.offset_bytes, s.buf.size(), s.what));
    converted.push_back({s.fd, s.offset_bytes, s.buf.data(), s.buf.size(), s.what});
  }
  return Transfer(IoOp::kRead, converted);
}

Status SegmentBackend::WriteBatch(std::span<const WriteSegment> segments) {
  std::vector<Segment> converted;
  converted.reserve(segments.size());
  for (const WriteSegment& s : segments) {
    STRATA_RETURN_IF_ERROR(CheckSegment(s.fd, s.offset_bytes, s.buf.size(), s.what));
    converted.push_back(
        {s.fd, s.offset_bytes, const_cast<std::byte*>(s.buf.data()), s.buf.size(), s.what});
  }
  return Transfer(IoOp::kWrite, converted);
}

}  // namespace strata::io::internal
