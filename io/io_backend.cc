#include "io/io_backend.h"

#include <fmt/format.h>

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
