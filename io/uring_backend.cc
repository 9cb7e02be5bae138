// The "uring" backend: io_uring through liburing.
//
// Rings come from a small pool owned by the backend: a calling thread takes a ring, uses it alone
// for its whole call (prepare, submit, reap, resubmit) and gives it back, so no io_uring_submit
// ever happens under a lock shared with other threads, and a ring never has another thread's
// requests in it. Rings are therefore not IORING_SETUP_SINGLE_ISSUER (a ring may serve different
// threads over time). Registered buffers and files would be registered per ring when it is made.
#include <fmt/format.h>
#include <liburing.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "base/thread_annotations.h"
#include "io/transfer.h"

namespace strata::io {
namespace internal {
namespace {

// More idle rings than this are closed when given back (each holds queue_depth entries).
constexpr size_t kMaxIdleRings = 64;

std::string UringHint(int err) {
  switch (err) {
    case ENOSYS:
      return " (the kernel has no io_uring, or a seccomp filter hides it)";
    case EPERM:
    case EACCES:
      return " (refused by sysctl kernel.io_uring_disabled or a seccomp filter)";
    case ENOMEM:
      return " (RLIMIT_MEMLOCK too low for the ring on this kernel)";
    default:
      return "";
  }
}

// RAII io_uring. Move-free: lives behind a unique_ptr so its address is stable.
class Ring {
 public:
  static StatusOr<std::unique_ptr<Ring>> Create(unsigned entries) {
    std::unique_ptr<Ring> ring(new Ring);
    const int r = io_uring_queue_init(entries, &ring->ring_, 0);
    if (r < 0) {
      return ErrnoToStatus(
          -r, fmt::format("io_uring_queue_init({} entries){}", entries, UringHint(-r)));
    }
    ring->initialized_ = true;
    return ring;
  }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() {
    if (initialized_) io_uring_queue_exit(&ring_);
  }
  io_uring* get() { return &ring_; }

 private:
  Ring() = default;
  io_uring ring_{};
  bool initialized_ = false;
};

class UringBackend final : public SegmentBackend {
 public:
  explicit UringBackend(const IoBackendOptions& options) : options_(options) {}
  std::string_view name() const override { return "uring"; }

  // Makes the first ring now, so that setup errors surface at creation.
  Status Init() {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Ring> ring, Ring::Create(RingEntries()));
    ReleaseRing(std::move(ring));
    return Status::Ok();
  }

 protected:
  Status Transfer(IoOp op, std::span<const Segment> segments) override {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Ring> ring, AcquireRing());
    bool healthy = true;
    Status status = RunOnRing(op, segments, ring->get(), &healthy);
    // A ring that failed to submit may hold prepared entries: close it rather than reuse it.
    if (healthy) ReleaseRing(std::move(ring));
    return status;
  }

 private:
  unsigned RingEntries() const { return static_cast<unsigned>(options_.queue_depth); }

  StatusOr<std::unique_ptr<Ring>> AcquireRing() STRATA_EXCLUDES(mu_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_rings_.empty()) {
        std::unique_ptr<Ring> ring = std::move(idle_rings_.back());
        idle_rings_.pop_back();
        return ring;
      }
    }
    return Ring::Create(RingEntries());  // a syscall: outside the lock
  }

  void ReleaseRing(std::unique_ptr<Ring> ring) STRATA_EXCLUDES(mu_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (idle_rings_.size() < kMaxIdleRings) {
        idle_rings_.push_back(std::move(ring));
        return;
      }
    }
    ring.reset();  // closes the ring outside the lock
  }

  // Keeps up to queue_depth pieces in flight on `ring` until every piece is done or, after the
  // first error, until nothing is in flight any more. Sets *healthy = false when the ring must
  // not be reused.
  Status RunOnRing(IoOp op, std::span<const Segment> segments, io_uring* ring, bool* healthy) {
    PieceCursor cursor(segments, options_.block_size_bytes);
    const size_t depth = static_cast<size_t>(options_.queue_depth);
    std::vector<Piece> slots(depth);
    std::vector<uint32_t> free_slots;
    free_slots.reserve(depth);
    for (size_t i = depth; i > 0; --i) free_slots.push_back(static_cast<uint32_t>(i - 1));
    std::vector<uint32_t> ready;  // slots holding a piece to (re)submit
    ready.reserve(depth);
    unsigned prepared = 0;   // in the submission queue, not yet submitted
    unsigned in_kernel = 0;  // submitted, completion not reaped
    int submit_retries = 0;
    bool failed = false;
    Status first_error;
    auto fail = [&](Status s) {
      if (!failed) first_error = std::move(s);
      failed = true;
      for (uint32_t idx : ready) free_slots.push_back(idx);
      ready.clear();
    };

    while (true) {
      // Prepare: resubmissions first, then new pieces, up to queue_depth in flight.
      while (*healthy) {
        uint32_t idx;
        if (!ready.empty()) {
          idx = ready.back();
          ready.pop_back();
        } else if (!failed && !cursor.done() && !free_slots.empty()) {
          idx = free_slots.back();
          free_slots.pop_back();
          slots[idx] = cursor.Next();
        } else {
          break;
        }
        io_uring_sqe* sqe = io_uring_get_sqe(ring);
        if (sqe == nullptr) {  // the queue is full; keep the piece for the next round
          ready.push_back(idx);
          break;
        }
        const Piece& p = slots[idx];
        if (op == IoOp::kRead) {
          io_uring_prep_read(sqe, p.fd, p.next_data(), static_cast<unsigned>(p.next_size_bytes()),
                             p.next_offset_bytes());
        } else {
          io_uring_prep_write(sqe, p.fd, p.next_data(), static_cast<unsigned>(p.next_size_bytes()),
                              p.next_offset_bytes());
        }
        io_uring_sqe_set_data64(sqe, idx);
        ++prepared;
      }

      // Submit the whole batch with one system call.
      if (prepared > 0 && *healthy) {
        const int r = io_uring_submit(ring);
        if (r > 0) {
          prepared -= static_cast<unsigned>(r);
          in_kernel += static_cast<unsigned>(r);
          submit_retries = 0;
        } else if (r == 0 || r == -EINTR || r == -EAGAIN || r == -EBUSY) {
          // Transient; with requests in flight, reaping one frees resources. Otherwise back off.
          if (in_kernel == 0) {
            if (++submit_retries > kMaxRetries) {
              fail(ErrnoToStatus(r == 0 ? EAGAIN : -r, "io_uring_submit made no progress"));
              *healthy = false;
            } else {
              BackoffBeforeRetry(submit_retries);
            }
          }
        } else {
          fail(ErrnoToStatus(-r, "io_uring_submit"));
          *healthy = false;
        }
      }

      if (in_kernel == 0) {
        if (!*healthy) break;  // prepared entries die with the ring
        if (prepared == 0 && ready.empty() && (failed || cursor.done())) break;
        continue;
      }

      // Reap: wait for one completion, then take every completion that is ready.
      io_uring_cqe* cqe = nullptr;
      const int w = io_uring_wait_cqe(ring, &cqe);
      if (w == -EINTR || w == -EAGAIN || w == -ETIME) continue;
      // Requests in flight still write into the caller's buffers: returning now would hand the
      // kernel freed memory. The CQ is twice the SQ and in flight <= queue_depth, so no overflow.
      STRATA_CHECK_MSG(w == 0, fmt::format("io_uring_wait_cqe failed with errno {} while {} "
                                           "requests were in flight",
                                           -w, in_kernel));
      unsigned head;
      unsigned reaped = 0;
      int backoff_retries = 0;
      io_uring_for_each_cqe(ring, head, cqe) {
        ++reaped;
        --in_kernel;
        const uint32_t idx = static_cast<uint32_t>(io_uring_cqe_get_data64(cqe));
        Piece& p = slots[idx];
        int64_t result = cqe->res;
        if (options_.completion_hook != nullptr) {
          options_.completion_hook->OnCompletion(op, p.fd, p.next_offset_bytes(),
                                                 p.next_size_bytes(), &result);
        }
        Status error;
        switch (ApplyCompletion(op, result, p, &error)) {
          case Outcome::kDone:
            free_slots.push_back(idx);
            break;
          case Outcome::kFailed:
            free_slots.push_back(idx);
            fail(std::move(error));
            break;
          case Outcome::kRetryLater:
            backoff_retries = std::max(backoff_retries, p.retries);
            [[fallthrough]];
          case Outcome::kResubmit:
            if (failed) {
              free_slots.push_back(idx);
            } else {
              ready.push_back(idx);
            }
            break;
        }
      }
      io_uring_cq_advance(ring, reaped);
      if (backoff_retries > 0 && !failed) BackoffBeforeRetry(backoff_retries);
    }
    return failed ? first_error : Status::Ok();
  }

  const IoBackendOptions options_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Ring>> idle_rings_ STRATA_GUARDED_BY(mu_);
};

}  // namespace

StatusOr<std::unique_ptr<IoBackend>> CreateUringBackend(const IoBackendOptions& options) {
  auto backend = std::make_unique<UringBackend>(options);
  STRATA_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<IoBackend>(std::move(backend));
}

}  // namespace internal

Status ProbeUring() {
  io_uring ring{};
  const int r = io_uring_queue_init(4, &ring, 0);
  if (r < 0) {
    return UnavailableError(
        ErrnoToStatus(-r, fmt::format("io_uring_setup{}", internal::UringHint(-r))).message());
  }
  Status status;
  io_uring_probe* probe = io_uring_get_probe_ring(&ring);
  if (probe == nullptr) {
    status =
        UnavailableError("io_uring has no opcode probe (IORING_REGISTER_PROBE needs Linux 5.6+)");
  } else {
    if (!io_uring_opcode_supported(probe, IORING_OP_READ) ||
        !io_uring_opcode_supported(probe, IORING_OP_WRITE)) {
      status = UnavailableError("io_uring lacks IORING_OP_READ/IORING_OP_WRITE (needs Linux 5.6+)");
    }
    io_uring_free_probe(probe);
  }
  if (status.ok()) {
    // A no-op round trip: some sandboxes allow setup but never complete requests.
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    io_uring_prep_nop(sqe);
    int s = io_uring_submit(&ring);
    io_uring_cqe* cqe = nullptr;
    int w = s == 1 ? io_uring_wait_cqe(&ring, &cqe) : 0;
    while (w == -EINTR) w = io_uring_wait_cqe(&ring, &cqe);
    if (s != 1) {
      status = UnavailableError(
          ErrnoToStatus(s < 0 ? -s : EAGAIN, "io_uring no-op submission").message());
    } else if (w < 0) {
      status = UnavailableError(ErrnoToStatus(-w, "io_uring no-op completion").message());
    } else if (cqe->res < 0) {
      status = UnavailableError(ErrnoToStatus(-cqe->res, "io_uring no-op request").message());
    }
  }
  io_uring_queue_exit(&ring);
  return status;
}

}  // namespace strata::io
