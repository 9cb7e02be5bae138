// The "memory" backend, for tests: an in-process map from fd number to a byte vector. The fd is
// only a key (no system call is made with it), so tests run without a file system; a write past
// the end grows the vector (zero-filled), a read past the end hits end of file. Pieces go through
// the same completion rules as the real backends, so a CompletionHook sees them.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "base/thread_annotations.h"
#include "io/transfer.h"

namespace strata::io::internal {
namespace {

class MemoryBackend final : public SegmentBackend {
 public:
  explicit MemoryBackend(const IoBackendOptions& options) : options_(options) {}
  std::string_view name() const override { return "memory"; }

 protected:
  Status Transfer(IoOp op, std::span<const Segment> segments) override {
    for (PieceCursor cursor(segments, options_.block_size_bytes); !cursor.done();) {
      STRATA_RETURN_IF_ERROR(RunPieceSync(op, cursor.Next(), options_.completion_hook, stats_,
                                          [&](const Piece& p) { return Attempt(op, p); }));
    }
    return Status::Ok();
  }

 private:
  struct File {
    std::mutex mu;
    std::vector<std::byte> bytes STRATA_GUARDED_BY(mu);
  };

  std::shared_ptr<File> FindFile(int fd, bool create) STRATA_EXCLUDES(mu_) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(fd);
    if (it != files_.end()) return it->second;
    if (!create) return nullptr;
    auto file = std::make_shared<File>();
    files_.emplace(fd, file);
    return file;
  }

  int64_t Attempt(IoOp op, const Piece& p) {
    std::shared_ptr<File> file = FindFile(p.fd, op == IoOp::kWrite);
    const uint64_t offset = p.next_offset_bytes();
    const size_t size = p.next_size_bytes();
    if (file == nullptr) return 0;  // never written: empty file, end of file
    std::lock_guard<std::mutex> lock(file->mu);
    if (op == IoOp::kRead) {
      if (offset >= file->bytes.size()) return 0;
      const size_t n = static_cast<size_t>(std::min<uint64_t>(size, file->bytes.size() - offset));
      std::memcpy(p.next_data(), file->bytes.data() + offset, n);
      return static_cast<int64_t>(n);
    }
    if (offset + size > file->bytes.size()) {
      try {
        file->bytes.resize(offset + size);
      } catch (const std::bad_alloc&) {
        return -ENOMEM;
      } catch (const std::length_error&) {
        return -EFBIG;
      }
    }
    std::memcpy(file->bytes.data() + offset, p.next_data(), size);
    return static_cast<int64_t>(size);
  }

  const IoBackendOptions options_;
  std::mutex mu_;
  std::unordered_map<int, std::shared_ptr<File>> files_ STRATA_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<IoBackend> CreateMemoryBackend(const IoBackendOptions& options) {
  return std::make_unique<MemoryBackend>(options);
}

}  // namespace strata::io::internal
