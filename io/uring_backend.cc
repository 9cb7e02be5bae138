// The "uring" backend: io_uring through liburing.
//
// Rings. The backend owns a pool of rings. A calling thread takes a ring, uses it alone for its
// whole call (prepare, submit, reap, resubmit) and gives it back, so no io_uring_submit ever
// happens under a lock shared with other threads, and a ring never has another thread's requests
// in it. Where the kernel accepts IORING_SETUP_SINGLE_ISSUER (Linux 6.0+; EINVAL otherwise, then
// rings are made without it, silently), a ring belongs to the thread that made it and only that
// thread takes it again: one ring per I/O thread, which lets the kernel skip its submission
// locking. Idle rings beyond kMaxIdleRings (e.g. of threads that have exited) are closed, oldest
// first. IoBackendOptions::sqpoll adds IORING_SETUP_SQPOLL.
//
// Registration. RegisterBuffers and RegisterFiles update a backend-wide table and bump its
// generation; each ring is brought up to date lazily, by the thread that takes it, before it is
// used (io_uring_register_buffers / io_uring_register_files on a ring that another thread does
// not touch, as SINGLE_ISSUER requires). A piece whose buffer lies inside one registered iovec is
// submitted as READ_FIXED/WRITE_FIXED; a piece on a registered fd carries IOSQE_FIXED_FILE with
// the fd's table index. A ring on which a registration fails later (e.g. memlock) runs with plain
// submissions for that table, after one warning; RegisterBuffers itself reports the error.
//
// Submission and reaping. Up to queue_depth pieces are kept in flight; every round prepares up to
// kMaxSqesPerEnter entries, submits them and, when nothing else is waiting to be prepared, waits
// for at least one completion in the same io_uring_submit_and_wait system call; then it reaps
// every completion that is ready. EntriesTaken (uring_backend.h) turns a submit result into the
// number of entries now in flight.
#include "io/uring_backend.h"

#include <fmt/format.h>
#include <liburing.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "base/logging.h"
#include "base/thread_annotations.h"
#include "io/transfer.h"

namespace strata::io {
namespace internal {

unsigned EntriesTaken(int r, unsigned prepared, bool sqpoll) {
  if (r < 0) return 0;
  return sqpoll ? prepared : std::min(static_cast<unsigned>(r), prepared);
}

namespace {

// More idle rings than this are closed when given back (each holds queue_depth entries).
constexpr size_t kMaxIdleRings = 64;
// The kernel's limits for registered buffers: 1 GiB per iovec, 16384 iovecs.
constexpr size_t kMaxIovecBytes = size_t{1} << 30;
constexpr size_t kMaxIovecs = 16384;
constexpr unsigned kSqThreadIdleMs = 1000;
// SQEs per io_uring_enter. io_uring starts a block plug only when one call submits more than two
// requests (io_uring/io_uring.c io_submit_state_start: need_plug = max_ios > 2), and under a plug
// the block layer merges adjacent pieces into one large request: sequential 1 MiB pieces became
// 4 MiB requests, completions then arrived in groups, were resubmitted as groups and merged again,
// so the drive saw a quarter of the queue depth (measured: 0.75 vs 1.1 GB/s at QD 8 on a virtio
// disk, the same effect as fio --iodepth_batch_submit=8). Submitting at most two per call keeps
// block_size_bytes the unit the drive sees, as fio does, for half of fio's system calls.
constexpr unsigned kMaxSqesPerEnter = 2;

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

// A token unique to each thread for the life of the process (thread ids are reused).
uint64_t ThreadToken() {
  static std::atomic<uint64_t> next{1};
  thread_local const uint64_t token = next.fetch_add(1, std::memory_order_relaxed);
  return token;
}

// The registered buffers: iovecs sorted by address, none longer than 1 GiB.
struct BufferTable {
  std::vector<iovec> iovecs;
  // The index of the iovec holding [data, data + size_bytes) wholly, or -1.
  int Find(const std::byte* data, size_t size_bytes) const {
    auto it = std::upper_bound(iovecs.begin(), iovecs.end(), data,
                               [](const std::byte* p, const iovec& v) {
                                 return p < static_cast<const std::byte*>(v.iov_base);
                               });
    if (it == iovecs.begin()) return -1;
    --it;
    const auto* base = static_cast<const std::byte*>(it->iov_base);
    if (data + size_bytes > base + it->iov_len) return -1;
    return static_cast<int>(it - iovecs.begin());
  }
};

// The registered files: fds in table order, and fd -> index.
struct FileTable {
  std::vector<int> fds;
  std::unordered_map<int, int> index;
  int Find(int fd) const {
    auto it = index.find(fd);
    return it == index.end() ? -1 : it->second;
  }
};

// RAII io_uring plus what is registered on it. Lives behind a unique_ptr (stable address).
class Ring {
 public:
  static StatusOr<std::unique_ptr<Ring>> Create(unsigned entries, unsigned flags) {
    std::unique_ptr<Ring> ring(new Ring);
    io_uring_params params{};
    params.flags = flags;
    if ((flags & IORING_SETUP_SQPOLL) != 0) params.sq_thread_idle = kSqThreadIdleMs;
    const int r = io_uring_queue_init_params(entries, &ring->ring_, &params);
    if (r < 0) {
      return ErrnoToStatus(
          -r, fmt::format("io_uring_queue_init({} entries{}){}", entries,
                          (flags & IORING_SETUP_SQPOLL) != 0 ? ", SQPOLL" : "", UringHint(-r)));
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

  uint64_t owner = 0;  // ThreadToken() of the only thread that may use it; 0: any
  // Registration state, touched only by the thread holding the ring.
  uint64_t buffers_generation = 0;
  std::shared_ptr<const BufferTable> buffers;  // registered on this ring; null: none
  uint64_t files_generation = 0;
  std::shared_ptr<const FileTable> files;

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
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Ring> ring, MakeRing());
    ReleaseRing(std::move(ring));
    return Status::Ok();
  }

  Status RegisterBuffers(std::span<const std::span<std::byte>> regions) override {
    auto table = std::make_shared<BufferTable>();
    for (const std::span<std::byte>& region : regions) {
      if (region.empty()) {
        return InvalidArgumentError("RegisterBuffers: an empty region cannot be registered");
      }
      for (size_t off = 0; off < region.size(); off += kMaxIovecBytes) {
        table->iovecs.push_back(
            {region.data() + off, std::min(kMaxIovecBytes, region.size() - off)});
      }
    }
    std::sort(table->iovecs.begin(), table->iovecs.end(),
              [](const iovec& a, const iovec& b) { return a.iov_base < b.iov_base; });
    for (size_t i = 1; i < table->iovecs.size(); ++i) {
      const iovec& prev = table->iovecs[i - 1];
      if (static_cast<const std::byte*>(prev.iov_base) + prev.iov_len >
          static_cast<const std::byte*>(table->iovecs[i].iov_base)) {
        return InvalidArgumentError("RegisterBuffers: regions overlap");
      }
    }
    if (table->iovecs.size() > kMaxIovecs) {
      return InvalidArgumentError(fmt::format(
          "RegisterBuffers: {} iovecs (1 GiB each at most) exceed the kernel's limit of {}",
          table->iovecs.size(), kMaxIovecs));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      buffers_ = table->iovecs.empty() ? nullptr : std::move(table);
      ++buffers_generation_;
    }
    // Register on a ring now so that errors (memlock) come back to the caller.
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Ring> ring, AcquireRing());
    Status status = SyncBuffers(*ring, /*warn=*/false);
    ReleaseRing(std::move(ring));
    if (!status.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      buffers_ = nullptr;
      ++buffers_generation_;
    }
    return status;
  }

  Status RegisterFiles(std::span<const int> fds) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto table = std::make_shared<FileTable>(files_ != nullptr ? *files_ : FileTable{});
    for (int fd : fds) {
      if (fd < 0) {
        return InvalidArgumentError(fmt::format("cannot register file descriptor {}", fd));
      }
      if (table->index.emplace(fd, static_cast<int>(table->fds.size())).second) {
        table->fds.push_back(fd);
      }
    }
    files_ = std::move(table);
    ++files_generation_;
    return Status::Ok();
  }

  void UnregisterFiles(std::span<const int> fds) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (files_ == nullptr) return;
    auto table = std::make_shared<FileTable>();
    for (int fd : files_->fds) {
      if (std::find(fds.begin(), fds.end(), fd) != fds.end()) continue;
      table->index.emplace(fd, static_cast<int>(table->fds.size()));
      table->fds.push_back(fd);
    }
    files_ = table->fds.empty() ? nullptr : std::move(table);
    ++files_generation_;
    // Idle rings still hold references to the removed files: bring them up to date now, so that
    // closing the fds really closes the files. A ring owned by another thread cannot be touched
    // from here (SINGLE_ISSUER), so it is closed instead. Rings in use are synced when next taken.
    std::vector<std::unique_ptr<Ring>> idle = std::move(idle_rings_);
    idle_rings_.clear();
    for (auto& ring : idle) {
      if (ring->files == nullptr) {
        idle_rings_.push_back(std::move(ring));
      } else if (ring->owner == 0 || ring->owner == ThreadToken()) {
        io_uring_unregister_files(ring->get());
        ring->files = nullptr;
        ring->files_generation = 0;
        idle_rings_.push_back(std::move(ring));
      }
      // else: destroyed at the end of this scope
    }
  }

 protected:
  Status Transfer(IoOp op, std::span<const Segment> segments) override {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Ring> ring, AcquireRing());
    SyncBuffers(*ring, /*warn=*/true).IgnoreError();
    SyncFiles(*ring);
    bool healthy = true;
    Status status = RunOnRing(op, segments, *ring, &healthy);
    // A ring that failed to submit may hold prepared entries: close it rather than reuse it.
    if (healthy) ReleaseRing(std::move(ring));
    return status;
  }

 private:
  unsigned RingEntries() const { return static_cast<unsigned>(options_.queue_depth); }

  // A new ring owned by the calling thread (SINGLE_ISSUER) where the kernel supports it.
  StatusOr<std::unique_ptr<Ring>> MakeRing() {
    const unsigned base = options_.sqpoll ? IORING_SETUP_SQPOLL : 0u;
    if (single_issuer_.load(std::memory_order_relaxed)) {
      auto ring = Ring::Create(RingEntries(), base | IORING_SETUP_SINGLE_ISSUER);
      if (ring.ok()) {
        (*ring)->owner = ThreadToken();
        return ring;
      }
      if (ring.status().code() != StatusCode::kInvalidArgument) return ring.status();
      single_issuer_.store(false, std::memory_order_relaxed);  // kernel older than 6.0
    }
    return Ring::Create(RingEntries(), base);
  }

  StatusOr<std::unique_ptr<Ring>> AcquireRing() STRATA_EXCLUDES(mu_) {
    const uint64_t me = ThreadToken();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = idle_rings_.size(); i > 0; --i) {
        if (idle_rings_[i - 1]->owner == 0 || idle_rings_[i - 1]->owner == me) {
          std::unique_ptr<Ring> ring = std::move(idle_rings_[i - 1]);
          idle_rings_.erase(idle_rings_.begin() + static_cast<std::ptrdiff_t>(i - 1));
          return ring;
        }
      }
    }
    return MakeRing();  // a syscall: outside the lock
  }

  void ReleaseRing(std::unique_ptr<Ring> ring) STRATA_EXCLUDES(mu_) {
    std::unique_ptr<Ring> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle_rings_.push_back(std::move(ring));
      if (idle_rings_.size() > kMaxIdleRings) {
        evicted = std::move(idle_rings_.front());
        idle_rings_.erase(idle_rings_.begin());
      }
    }
    evicted.reset();  // closes the ring outside the lock
  }

  // Brings the ring's registered buffers up to the backend's table.
  Status SyncBuffers(Ring& ring, bool warn) STRATA_EXCLUDES(mu_) {
    std::shared_ptr<const BufferTable> table;
    uint64_t generation;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ring.buffers_generation == buffers_generation_) return Status::Ok();
      table = buffers_;
      generation = buffers_generation_;
    }
    if (ring.buffers != nullptr) io_uring_unregister_buffers(ring.get());
    ring.buffers = nullptr;
    ring.buffers_generation = generation;
    if (table == nullptr) return Status::Ok();
    const int r = io_uring_register_buffers(ring.get(), table->iovecs.data(),
                                            static_cast<unsigned>(table->iovecs.size()));
    if (r < 0) {
      Status status = ErrnoToStatus(
          -r, fmt::format("io_uring_register_buffers ({} iovecs){}", table->iovecs.size(),
                          -r == ENOMEM ? ": raise the locked-memory limit (ulimit -l)" : ""));
      if (warn) {
        STRATA_LOG_WARNING(
            "uring: registering buffers on a new ring failed, using plain reads "
            "and writes on it: {}",
            status.ToString());
      }
      return status;
    }
    ring.buffers = std::move(table);
    return Status::Ok();
  }

  // Brings the ring's registered files up to the backend's table.
  void SyncFiles(Ring& ring) STRATA_EXCLUDES(mu_) {
    std::shared_ptr<const FileTable> table;
    uint64_t generation;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ring.files_generation == files_generation_) return;
      table = files_;
      generation = files_generation_;
    }
    if (ring.files != nullptr) io_uring_unregister_files(ring.get());
    ring.files = nullptr;
    ring.files_generation = generation;
    if (table == nullptr) return;
    const int r = io_uring_register_files(ring.get(), table->fds.data(),
                                          static_cast<unsigned>(table->fds.size()));
    if (r < 0) {
      STRATA_LOG_WARNING("uring: io_uring_register_files ({} files) failed ({}); using plain fds",
                         table->fds.size(), ErrnoToStatus(-r, "register").ToString());
      return;
    }
    ring.files = std::move(table);
  }

  // Keeps up to queue_depth pieces in flight on `ring` until every piece is done or, after the
  // first error, until nothing is in flight any more. Sets *healthy = false when the ring must
  // not be reused.
  Status RunOnRing(IoOp op, std::span<const Segment> segments, Ring& owned_ring, bool* healthy) {
    io_uring* ring = owned_ring.get();
    const BufferTable* buffers = owned_ring.buffers.get();
    const FileTable* files = owned_ring.files.get();
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
      const uint64_t prepare_ns = MonotonicNs();
      bool more = false;  // stopped at kMaxSqesPerEnter with pieces left to prepare
      while (*healthy) {
        if (prepared >= kMaxSqesPerEnter) {
          more = !ready.empty() || (!failed && !cursor.done() && !free_slots.empty());
          break;
        }
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
        Piece& p = slots[idx];
        p.submit_ns = prepare_ns;
        const unsigned length = static_cast<unsigned>(p.next_size_bytes());
        const int buf_index = buffers != nullptr ? buffers->Find(p.next_data(), length) : -1;
        const int file_index = files != nullptr ? files->Find(p.fd) : -1;
        const int fd = file_index >= 0 ? file_index : p.fd;
        if (buf_index >= 0) {
          if (op == IoOp::kRead) {
            io_uring_prep_read_fixed(sqe, fd, p.next_data(), length, p.next_offset_bytes(),
                                     buf_index);
          } else {
            io_uring_prep_write_fixed(sqe, fd, p.next_data(), length, p.next_offset_bytes(),
                                      buf_index);
          }
        } else if (op == IoOp::kRead) {
          io_uring_prep_read(sqe, fd, p.next_data(), length, p.next_offset_bytes());
        } else {
          io_uring_prep_write(sqe, fd, p.next_data(), length, p.next_offset_bytes());
        }
        if (file_index >= 0) sqe->flags |= IOSQE_FIXED_FILE;
        stats_.OnFixed(buf_index >= 0, file_index >= 0);
        io_uring_sqe_set_data64(sqe, idx);
        ++prepared;
      }

      // Submit and wait for a completion with one system call (only submit while more pieces
      // are waiting to be prepared).
      if (prepared > 0 && *healthy) {
        const int r = more ? io_uring_submit(ring) : io_uring_submit_and_wait(ring, 1);
        // Every entry counted in flight completes once: in_kernel never wraps, and the wait below
        // never waits for a completion that will not come.
        const unsigned taken = EntriesTaken(r, prepared, options_.sqpoll);
        if (taken > 0) {
          prepared -= taken;
          in_kernel += taken;
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
      if (more && io_uring_peek_cqe(ring, &cqe) != 0) continue;  // none yet: keep filling
      const int w = more ? 0 : io_uring_wait_cqe(ring, &cqe);
      if (w == -EINTR || w == -EAGAIN || w == -ETIME) continue;
      // Requests in flight still write into the caller's buffers: returning now would hand the
      // kernel freed memory. The CQ is twice the SQ and in flight <= queue_depth, so no overflow.
      STRATA_CHECK_MSG(w == 0, fmt::format("io_uring_wait_cqe failed with errno {} while {} "
                                           "requests were in flight",
                                           -w, in_kernel));
      unsigned head;
      unsigned reaped = 0;
      const uint64_t reap_ns = MonotonicNs();
      int backoff_retries = 0;
      io_uring_for_each_cqe(ring, head, cqe) {
        ++reaped;
        --in_kernel;
        const uint32_t idx = static_cast<uint32_t>(io_uring_cqe_get_data64(cqe));
        Piece& p = slots[idx];
        int64_t result = cqe->res;
        uint64_t done_ns = reap_ns;
        if (options_.completion_hook != nullptr) {
          options_.completion_hook->OnCompletion(op, p.fd, p.next_offset_bytes(),
                                                 p.next_size_bytes(), &result);
          done_ns = MonotonicNs();  // an injected delay counts as latency
        }
        Status error;
        const Outcome outcome = ApplyCompletion(op, result, p, &error);
        stats_.OnCompletion(result, outcome, done_ns - p.submit_ns);
        switch (outcome) {
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
  std::atomic<bool> single_issuer_{true};  // false once the kernel refused it
  std::mutex mu_;
  std::vector<std::unique_ptr<Ring>> idle_rings_ STRATA_GUARDED_BY(mu_);  // oldest first
  std::shared_ptr<const BufferTable> buffers_ STRATA_GUARDED_BY(mu_);
  uint64_t buffers_generation_ STRATA_GUARDED_BY(mu_) = 0;
  std::shared_ptr<const FileTable> files_ STRATA_GUARDED_BY(mu_);
  uint64_t files_generation_ STRATA_GUARDED_BY(mu_) = 0;
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
