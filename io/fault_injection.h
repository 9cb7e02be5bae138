// FaultInjectingBackend: an IoBackend for tests that makes chosen completions fail, come back
// short, or arrive late (after facebook/rocksdb utilities/fault_injection_fs.h).
//
// Faults are injected at the level of piece completions, inside a real backend ("uring", "posix"
// or "memory") that the wrapper creates with itself as the CompletionHook. So an injected short
// count or EAGAIN goes through that backend's own resubmit/retry logic, exactly as a real one
// would; an injected errno surfaces through the backend's own error path (same Status code and
// message as a real failure). The real transfer has happened when the fault replaces its result:
// for a short count the backend transfers the remainder again; for an error the buffer (read) or
// the file (write) may already hold the data, which the caller must not rely on.
//
// Thread-safety: all methods may be called concurrently with I/O.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "base/thread_annotations.h"
#include "io/io_backend.h"

namespace strata::io {

struct Fault {
  static constexpr uint64_t kForever = UINT64_MAX;

  enum class Kind {
    kErrno,          // the completion reports -errno_value
    kShortTransfer,  // the completion reports transfer_bytes (only if less than it really did)
    kLatency,        // the completion is delayed by `latency`, result unchanged
  };

  Kind kind = Kind::kErrno;
  std::optional<IoOp> op;  // the operation matched; nullopt: reads and writes
  int fd = -1;             // the fd matched; -1: any
  // Matching completions are counted from 1 from the moment the fault is added; the fault applies
  // to completions nth .. nth + times - 1 (kForever: all from nth on).
  uint64_t nth = 1;
  uint64_t times = 1;
  int errno_value = 0;  // kErrno: EIO, ENOSPC, EAGAIN, ...
  // kShortTransfer. 0 on a read is end of file. On a 4096-aligned piece the backend resumes at the
  // aligned point below the bytes done, and a read cut short twice at the same unaligned point is
  // end of file too (as a real O_DIRECT read at end of file would be).
  uint64_t transfer_bytes = 0;
  std::chrono::microseconds latency{0};  // kLatency

  static Fault Errno(std::optional<IoOp> op, int errno_value, uint64_t nth = 1, uint64_t times = 1);
  static Fault ShortTransfer(std::optional<IoOp> op, uint64_t transfer_bytes, uint64_t nth = 1,
                             uint64_t times = 1);
  static Fault Latency(std::optional<IoOp> op, std::chrono::microseconds latency, uint64_t nth = 1,
                       uint64_t times = kForever);
};

class FaultInjectingBackend final : public IoBackend, private CompletionHook {
 public:
  // Creates the inner backend from `inner_options` (its completion_hook is replaced by this
  // object). Errors: those of CreateIoBackend.
  static StatusOr<std::unique_ptr<FaultInjectingBackend>> Create(IoBackendOptions inner_options);

  FaultInjectingBackend(const FaultInjectingBackend&) = delete;
  FaultInjectingBackend& operator=(const FaultInjectingBackend&) = delete;
  ~FaultInjectingBackend() override;

  void AddFault(const Fault& fault) STRATA_EXCLUDES(mu_);
  void ClearFaults() STRATA_EXCLUDES(mu_);
  // Completions whose result was changed (kErrno, kShortTransfer) or delayed (kLatency).
  uint64_t faults_injected() const STRATA_EXCLUDES(mu_);
  // Piece completions seen so far, including resubmissions.
  uint64_t completions(IoOp op) const STRATA_EXCLUDES(mu_);

  // The inner backend's name: "uring", "posix" or "memory".
  std::string_view name() const override { return inner_->name(); }
  Status Read(int fd, uint64_t offset_bytes, std::span<std::byte> buf,
              std::string_view what) override;
  Status Write(int fd, uint64_t offset_bytes, std::span<const std::byte> buf,
               std::string_view what) override;
  Status ReadBatch(std::span<const ReadSegment> segments) override;
  Status WriteBatch(std::span<const WriteSegment> segments) override;
  // Forwarded to the inner backend (its counters include the injected faults' resubmissions).
  Status RegisterBuffers(std::span<const std::span<std::byte>> regions) override {
    return inner_->RegisterBuffers(regions);
  }
  Status RegisterFiles(std::span<const int> fds) override { return inner_->RegisterFiles(fds); }
  void UnregisterFiles(std::span<const int> fds) override { inner_->UnregisterFiles(fds); }
  IoStats stats() const override { return inner_->stats(); }
  void ResetStats() override { inner_->ResetStats(); }

 private:
  struct ActiveFault {
    Fault fault;
    uint64_t seen = 0;
  };

  FaultInjectingBackend() = default;
  void OnCompletion(IoOp op, int fd, uint64_t offset_bytes, size_t length_bytes,
                    int64_t* result) override STRATA_EXCLUDES(mu_);

  std::unique_ptr<IoBackend> inner_;
  mutable std::mutex mu_;
  std::vector<ActiveFault> faults_ STRATA_GUARDED_BY(mu_);
  uint64_t injected_ STRATA_GUARDED_BY(mu_) = 0;
  uint64_t reads_ STRATA_GUARDED_BY(mu_) = 0;
  uint64_t writes_ STRATA_GUARDED_BY(mu_) = 0;
};

}  // namespace strata::io
