// The "posix" backend: pread/pwrite. With posix_threads > 1 the pieces of a call are spread over
// a pool of worker threads (the calling thread waits); with 1 they run on the calling thread.
// Concurrency is bounded by the number of threads, not by queue_depth.
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "base/thread_annotations.h"
#include "io/transfer.h"

namespace strata::io::internal {
namespace {

int64_t PosixAttempt(IoOp op, const Piece& p) {
  const ssize_t r = op == IoOp::kRead ? ::pread(p.fd, p.next_data(), p.next_size_bytes(),
                                                static_cast<off_t>(p.next_offset_bytes()))
                                      : ::pwrite(p.fd, p.next_data(), p.next_size_bytes(),
                                                 static_cast<off_t>(p.next_offset_bytes()));
  return r < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(r);
}

// The pieces of one call handed to the pool; lives on the calling thread's stack until every
// piece has been accounted for.
struct Batch {
  std::mutex mu;
  std::condition_variable cv;
  size_t remaining STRATA_GUARDED_BY(mu) = 0;
  Status first_error STRATA_GUARDED_BY(mu);
  std::atomic<bool> failed{false};  // later pieces are skipped once set
};

struct Task {
  Batch* batch = nullptr;
  IoOp op = IoOp::kRead;
  Piece piece;
};

class PosixBackend final : public SegmentBackend {
 public:
  explicit PosixBackend(const IoBackendOptions& options) : options_(options) {
    if (options_.posix_threads > 1) {
      workers_.reserve(static_cast<size_t>(options_.posix_threads));
      for (int i = 0; i < options_.posix_threads; ++i) {
        workers_.emplace_back([this] { WorkerLoop(); });
      }
    }
  }

  ~PosixBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  std::string_view name() const override { return "posix"; }

 protected:
  Status Transfer(IoOp op, std::span<const Segment> segments) override {
    std::vector<Piece> pieces;
    for (PieceCursor cursor(segments, options_.block_size_bytes); !cursor.done();) {
      pieces.push_back(cursor.Next());
    }
    if (workers_.empty() || pieces.size() <= 1) {
      for (const Piece& p : pieces) STRATA_RETURN_IF_ERROR(RunPiece(op, p));
      return Status::Ok();
    }
    Batch batch;
    {
      std::lock_guard<std::mutex> lock(batch.mu);
      batch.remaining = pieces.size();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const Piece& p : pieces) queue_.push_back(Task{&batch, op, p});
    }
    cv_.notify_all();
    std::unique_lock<std::mutex> lock(batch.mu);
    batch.cv.wait(lock, [&] { return batch.remaining == 0; });
    return batch.first_error;
  }

 private:
  Status RunPiece(IoOp op, const Piece& piece) {
    return RunPieceSync(op, piece, options_.completion_hook, stats_,
                        [op](const Piece& p) { return PosixAttempt(op, p); });
  }

  void WorkerLoop() STRATA_EXCLUDES(mu_) {
    while (true) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and drained
        task = queue_.front();
        queue_.pop_front();
      }
      Batch& batch = *task.batch;
      Status s = batch.failed.load(std::memory_order_relaxed) ? Status::Ok()
                                                              : RunPiece(task.op, task.piece);
      std::lock_guard<std::mutex> lock(batch.mu);
      if (!s.ok() && batch.first_error.ok()) {
        batch.first_error = std::move(s);
        batch.failed.store(true, std::memory_order_relaxed);
      }
      // Notify under the lock: the waiter may destroy the batch as soon as it sees 0.
      if (--batch.remaining == 0) batch.cv.notify_all();
    }
  }

  const IoBackendOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_ STRATA_GUARDED_BY(mu_);
  bool stopping_ STRATA_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IoBackend> CreatePosixBackend(const IoBackendOptions& options) {
  return std::make_unique<PosixBackend>(options);
}

}  // namespace strata::io::internal
