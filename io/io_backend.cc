#include "io/io_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>

#include "base/logging.h"
#include "io/transfer.h"

namespace strata::io {
namespace {

constexpr BackendKind kAllKinds[] = {BackendKind::kAuto, BackendKind::kUring, BackendKind::kPosix,
                                     BackendKind::kMemory};

}  // namespace

std::string_view BackendKindName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kAuto:
      return "auto";
    case BackendKind::kUring:
      return "uring";
    case BackendKind::kPosix:
      return "posix";
    case BackendKind::kMemory:
      return "memory";
  }
  return "unknown";
}

StatusOr<BackendKind> ParseBackendKind(std::string_view text) {
  for (BackendKind kind : kAllKinds) {
    if (text == BackendKindName(kind)) return kind;
  }
  return InvalidArgumentError(
      fmt::format("unknown I/O backend '{}': choose one of auto, uring, posix, memory", text));
}

std::string_view IoOpName(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

Status ValidateIoBackendOptions(const IoBackendOptions& options) {
  if (options.queue_depth < 1 || options.queue_depth > 4096) {
    return InvalidArgumentError(
        fmt::format("I/O queue depth {} is out of range: use 1..4096", options.queue_depth));
  }
  if (options.block_size_bytes == 0 ||
      options.block_size_bytes % internal::kDirectIoAlignment != 0 ||
      options.block_size_bytes > (size_t{1} << 30)) {
    return InvalidArgumentError(fmt::format(
        "I/O block size {} bytes is invalid: use a multiple of 4096 bytes, at most 1 GiB",
        options.block_size_bytes));
  }
  if (options.posix_threads < 1 || options.posix_threads > 256) {
    return InvalidArgumentError(fmt::format("posix I/O thread count {} is out of range: use 1..256",
                                            options.posix_threads));
  }
  return Status::Ok();
}

int LatencyHistogram::BucketOf(uint64_t value_ns) {
  if (value_ns < kSubBuckets) return static_cast<int>(value_ns);
  const int msb = 63 - std::countl_zero(value_ns);  // >= 4
  const int shift = msb - 4;
  const int sub = static_cast<int>((value_ns >> shift) & (kSubBuckets - 1));
  return kSubBuckets + shift * kSubBuckets + sub;
}

uint64_t LatencyHistogram::BucketUpperNs(int bucket) {
  if (bucket < kSubBuckets) return static_cast<uint64_t>(bucket);
  const int shift = (bucket - kSubBuckets) / kSubBuckets;
  const uint64_t sub = static_cast<uint64_t>((bucket - kSubBuckets) % kSubBuckets);
  const uint64_t lower = (uint64_t{kSubBuckets} + sub) << shift;
  return lower + ((uint64_t{1} << shift) - 1);
}

void LatencyHistogram::Record(uint64_t latency_ns) {
  counts_[static_cast<size_t>(BucketOf(latency_ns))].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(latency_ns, std::memory_order_relaxed);
  uint64_t seen = max_ns_.load(std::memory_order_relaxed);
  while (latency_ns > seen &&
         !max_ns_.compare_exchange_weak(seen, latency_ns, std::memory_order_relaxed)) {
  }
}

void LatencyHistogram::Reset() {
  for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
  count_.store(0, std::memory_order_relaxed);
  sum_ns_.store(0, std::memory_order_relaxed);
  max_ns_.store(0, std::memory_order_relaxed);
}

void LatencyHistogram::Merge(const LatencyHistogram& other) {
  for (size_t i = 0; i < counts_.size(); ++i) {
    counts_[i].fetch_add(other.counts_[i].load(std::memory_order_relaxed),
                         std::memory_order_relaxed);
  }
  count_.fetch_add(other.count(), std::memory_order_relaxed);
  sum_ns_.fetch_add(other.sum_ns(), std::memory_order_relaxed);
  uint64_t seen = max_ns_.load(std::memory_order_relaxed);
  const uint64_t m = other.max_ns();
  while (m > seen && !max_ns_.compare_exchange_weak(seen, m, std::memory_order_relaxed)) {
  }
}

double LatencyHistogram::MeanNs() const {
  const uint64_t n = count();
  return n == 0 ? 0.0 : static_cast<double>(sum_ns()) / static_cast<double>(n);
}

uint64_t LatencyHistogram::QuantileNs(double quantile) const {
  uint64_t total = 0;
  for (const auto& c : counts_) total += c.load(std::memory_order_relaxed);
  if (total == 0) return 0;
  const double q = std::clamp(quantile, 0.0, 1.0);
  // The rank (1-based) of the sample at this quantile: ceil(q * total), at least 1.
  const uint64_t rank =
      std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(q * static_cast<double>(total))));
  uint64_t seen = 0;
  for (int b = 0; b < kNumBuckets; ++b) {
    seen += counts_[static_cast<size_t>(b)].load(std::memory_order_relaxed);
    if (seen >= rank) return std::min(BucketUpperNs(b), max_ns());
  }
  return max_ns();
}

Status IoBackend::RegisterBuffers(std::span<const std::span<std::byte>> /*regions*/) {
  return Status::Ok();
}

Status IoBackend::RegisterFiles(std::span<const int> fds) {
  for (int fd : fds) {
    if (fd < 0) return InvalidArgumentError(fmt::format("cannot register file descriptor {}", fd));
  }
  return Status::Ok();
}

void IoBackend::UnregisterFiles(std::span<const int> /*fds*/) {}

IoStats IoBackend::stats() const {
  static const LatencyHistogram kEmpty;
  IoStats s;
  s.latency = &kEmpty;
  return s;
}

void IoBackend::ResetStats() {}

Status IoBackend::ReadBatch(std::span<const ReadSegment> segments) {
  for (const ReadSegment& s : segments) {
    STRATA_RETURN_IF_ERROR(Read(s.fd, s.offset_bytes, s.buf, s.what));
  }
  return Status::Ok();
}

Status IoBackend::WriteBatch(std::span<const WriteSegment> segments) {
  for (const WriteSegment& s : segments) {
    STRATA_RETURN_IF_ERROR(Write(s.fd, s.offset_bytes, s.buf, s.what));
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<IoBackend>> CreateIoBackend(const IoBackendOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateIoBackendOptions(options));
  switch (options.kind) {
    case BackendKind::kUring: {
      Status probe = ProbeUring();
      if (!probe.ok()) {
        return probe.WithContext("I/O backend 'uring' was requested but cannot be used");
      }
      return internal::CreateUringBackend(options);
    }
    case BackendKind::kPosix:
      return internal::CreatePosixBackend(options);
    case BackendKind::kMemory:
      return internal::CreateMemoryBackend(options);
    case BackendKind::kAuto:
      break;
  }
  Status probe = ProbeUring();
  if (probe.ok()) {
    auto backend = internal::CreateUringBackend(options);
    if (backend.ok()) {
      STRATA_LOG_INFO(
          "I/O backend: uring (io_uring probe succeeded; queue depth {}, block size {} "
          "bytes)",
          options.queue_depth, options.block_size_bytes);
      return backend;
    }
    probe = backend.status();
  }
  STRATA_LOG_WARNING("I/O backend: posix (io_uring unusable: {}); {} threads, block size {} bytes",
                     probe.ToString(), options.posix_threads, options.block_size_bytes);
  return internal::CreatePosixBackend(options);
}

}  // namespace strata::io
