// SwapStore: named, checksummed extents striped over one or more swap directories (usually one
// per NVMe drive), the home of tensors that do not fit in host memory.
//
// Layout. Create makes a private directory "strata-swap-XXXXXX" (mode 0700, mkdtemp) in each
// parent directory and one file "swap.<i>" in it (mode 0600, O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC|
// O_DIRECT; when the file system refuses O_DIRECT, e.g. an old tmpfs, the file is reopened
// without it and one warning is logged). An extent of size_bytes occupies PaddedSize(size_bytes)
// bytes, cut into stripe units of stripe_unit_bytes; with N directories, unit k goes to file
// k % N. Each file holds its share of an extent contiguously, appended after the previous extents
// at a 4096-aligned offset, preallocated with fallocate at Allocate. Extents are never freed
// before the store is destroyed. Nothing is durable: the destructor removes the files and private
// directories unless `keep` (durable state goes into checkpoints). A store holds a flock on each
// private directory while it lives; Create removes the private directories in its parent
// directories that nobody holds and that hold only swap files: those of runs killed before their
// destructor ran (SIGKILL, a data-parallel job aborted by MPI), with one warning each.
//
// Integrity. Write records the xxh3-64 (XXH3_64bits) of the first size_bytes of the buffer; Read
// verifies it. A short read or a checksum mismatch is kDataLoss naming the extent: garbage is
// never handed on.
//
// Thread-safety: all methods may be called concurrently, for different extents. Concurrent Write
// and Read/Write of the same extent is a caller bug, reported as kFailedPrecondition.
// Lifetime: the store must not be destroyed while a call on it is in flight.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"
#include "base/thread_annotations.h"
#include "base/unique_fd.h"
#include "io/io_backend.h"

namespace strata::io {

struct SwapStoreOptions {
  // Parent directories, one per drive; a private subdirectory is made in each.
  std::vector<std::string> dirs;
  // Multiple of 4096; extents are striped round-robin over dirs in units of this size.
  uint64_t stripe_unit_bytes = 1 << 20;
  // Record xxh3-64 at Write and verify it at Read.
  bool verify_checksums = true;
  // Leave the files and private directories in place at destruction (for `strata inspect`).
  bool keep = false;
  // Register the swap files with the backend (IoBackend::RegisterFiles; "uring" then submits
  // with IOSQE_FIXED_FILE) for the life of the store.
  bool register_files = true;
};

class SwapStore {
 public:
  static constexpr size_t kAlignment = 4096;

  // `backend` is not owned and must outlive the store. Errors: kInvalidArgument (null backend, no
  // dirs, stripe unit not a positive multiple of 4096, a path component that is not a
  // directory); kNotFound, kPermissionDenied (or another ErrnoToStatus code) naming the directory
  // when the private directory or the swap file cannot be created or written.
  static StatusOr<std::unique_ptr<SwapStore>> Create(IoBackend* backend, SwapStoreOptions options);

  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;
  ~SwapStore();

  // Reserves an extent named `name` (non-empty) of size_bytes (> 0, else kInvalidArgument).
  // Checks free space (statvfs) first: kResourceExhausted naming the directory and the shortfall.
  // kAlreadyExists if the name exists. fallocate errors other than "not supported" come back
  // through ErrnoToStatus (ENOSPC: kResourceExhausted).
  Status Allocate(std::string_view name, uint64_t size_bytes);

  // AlignUp(size_bytes, 4096): the bytes an extent of size_bytes occupies and a buffer must hold.
  static uint64_t PaddedSize(uint64_t size_bytes);

  // The bytes of an extent occupying `padded_bytes` that land in each of `num_files` swap files
  // striped in units of `stripe_unit_bytes` (unit k in file k % num_files; the last, partial unit
  // too): what Allocate preallocates in each. Pure; num_files and stripe_unit_bytes must be > 0.
  static std::vector<uint64_t> StripeShareBytes(uint64_t padded_bytes, size_t num_files,
                                                uint64_t stripe_unit_bytes);

  // Writes / reads a whole extent. buf.data() must be 4096-aligned and buf.size() at least
  // PaddedSize(extent size), else kInvalidArgument; only the first size_bytes are meaningful (the
  // padding is written from / read into the buffer as is). Blocks until the transfer completed.
  // Errors: kNotFound (no such extent); kFailedPrecondition (Read of an extent never written or
  // whose last Write failed, or concurrent use of one extent); kDataLoss naming the extent ("extent
  // 'block3.m' ...") for a short read or a checksum mismatch; backend errors (io_backend.h) with
  // the extent and file(s) in the message, also those that name no piece (a ring that cannot be
  // made, a failed submit). A failed Write leaves the extent unreadable until it is written
  // again. Running out of space during a Write (ENOSPC or EDQUOT; possible where fallocate is
  // unsupported, or on thin-provisioned storage) is kResourceExhausted naming the swap file(s),
  // the bytes the extent needs there, the bytes free and the shortfall; the other
  // kResourceExhausted causes (ENOMEM, EMFILE, EFBIG) keep the backend's message.
  Status Write(std::string_view name, std::span<const std::byte> buf);
  Status Read(std::string_view name, std::span<std::byte> buf);

  // Registers the caller's long-lived buffers, typically the pinned host arena, with the backend
  // (IoBackend::RegisterBuffers: "uring" then reads and writes extents from/to them with
  // READ_FIXED/WRITE_FIXED). Same contract and errors as IoBackend::RegisterBuffers; the memory
  // must outlive the store or be replaced by another call. Not while I/O is in flight.
  Status RegisterBuffers(std::span<const std::span<std::byte>> regions) {
    return backend_->RegisterBuffers(regions);
  }

  // Payload bytes (extent sizes, not padded) moved by successful calls.
  uint64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }
  uint64_t bytes_written() const { return bytes_written_.load(std::memory_order_relaxed); }

  std::vector<std::string> file_paths() const;    // the swap files, one per dir, in dirs order
  std::vector<std::string> private_dirs() const;  // the private directories, in dirs order
  std::string_view backend_name() const { return backend_->name(); }
  // Whether every swap file is open with O_DIRECT.
  bool direct_io() const;

  // Size in bytes of extent `name`, or kNotFound.
  StatusOr<uint64_t> ExtentSize(std::string_view name) const;

  // Where byte `offset_in_extent` of extent `name` lives: {swap file path, offset in that file}.
  // kNotFound for an unknown name, kOutOfRange for an offset >= the extent's size.
  StatusOr<std::pair<std::string, uint64_t>> Locate(std::string_view name,
                                                    uint64_t offset_in_extent) const;

 private:
  struct File {
    std::string parent_dir;   // as given in options.dirs
    std::string private_dir;  // parent_dir/strata-swap-XXXXXX
    std::string path;         // private_dir/swap.<i>
    UniqueFd fd;
    // private_dir, open and flock'ed for the store's life: a directory nobody holds is a dead
    // run's, removed by the next store made in parent_dir.
    UniqueFd lock;
    dev_t device = 0;  // for summing space needs of dirs on one file system
    bool direct = false;
  };
  enum class ExtentState { kAllocating, kEmpty, kValid, kWriteFailed };
  struct Extent {
    uint64_t size_bytes = 0;
    std::vector<uint64_t> file_offset_bytes;  // start of this extent's share in each file
    ExtentState state = ExtentState::kAllocating;
    bool writing = false;
    int readers = 0;
    uint64_t checksum = 0;
  };
  // A contiguous run of an extent within one file.
  struct Run {
    size_t file = 0;
    uint64_t file_offset_bytes = 0;
    uint64_t buf_offset_bytes = 0;
    uint64_t size_bytes = 0;
  };

  SwapStore(IoBackend* backend, SwapStoreOptions options);
  Status OpenDir(size_t index, const std::string& parent_dir);
  // Bytes of a padded extent that land in each file (StripeShareBytes with this store's files).
  std::vector<uint64_t> ShareBytes(uint64_t padded_bytes) const {
    return StripeShareBytes(padded_bytes, files_.size(), options_.stripe_unit_bytes);
  }
  std::vector<Run> Runs(const std::vector<uint64_t>& file_offset_bytes,
                        uint64_t padded_bytes) const;
  Status Reserve(std::string_view name, const std::vector<uint64_t>& file_offset_bytes,
                 const std::vector<uint64_t>& share_bytes);
  std::vector<std::string> Labels(std::string_view name) const;
  Status OutOfSpaceError(std::string_view name, uint64_t size_bytes, const Status& cause) const;
  // `status` as is when it names extent `name` already (the backends' piece errors carry Labels()),
  // else with "extent '<name>' in <the files it spans>" as context.
  Status WithExtent(std::string_view name, uint64_t size_bytes, const Status& status) const;

  IoBackend* const backend_;
  const SwapStoreOptions options_;
  bool keep_;  // false while Create has not succeeded
  bool files_registered_ = false;
  std::vector<File> files_;  // fixed after Create

  mutable std::mutex mu_;
  std::map<std::string, Extent, std::less<>> extents_ STRATA_GUARDED_BY(mu_);
  std::vector<uint64_t> file_end_bytes_ STRATA_GUARDED_BY(mu_);  // append position per file

  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> bytes_written_{0};
};

}  // namespace strata::io
