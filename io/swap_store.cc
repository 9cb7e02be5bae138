#include "io/swap_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/aligned_buffer.h"
#include "base/logging.h"
#include "base/units.h"

namespace strata::io {
namespace {

int OpenRetryingEintr(const char* path, int flags, mode_t mode) {
  int fd;
  do {
    fd = ::open(path, flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// Writes one aligned block at offset 0 with a plain pwrite: proves the file can be written with
// the flags it was opened with. Returns 0 or an errno (ENOSPC for a short write).
int ProbeWrite(int fd) {
  auto block = AlignedBuffer::Allocate(SwapStore::kAlignment);
  if (!block.ok()) return ENOMEM;
  ssize_t w;
  do {
    w = ::pwrite(fd, block->data(), SwapStore::kAlignment, 0);
  } while (w < 0 && errno == EINTR);
  if (w < 0) return errno;
  return static_cast<size_t>(w) == SwapStore::kAlignment ? 0 : ENOSPC;
}

// Whether a backend error is a full drive or quota (ENOSPC, EDQUOT) rather than another cause
// that ErrnoToStatus also maps to kResourceExhausted (ENOMEM, EMFILE, EFBIG).
bool IsOutOfSpace(const Status& status) {
  return status.os_error() == ENOSPC || status.os_error() == EDQUOT;
}

constexpr const char* kPrivatePrefix = "strata-swap-";
constexpr const char* kNewPrefix = ".strata-swap-new-";
constexpr const char* kKeptMarker = "kept";  // in a private directory left by `keep`

bool IsSwapFileName(std::string_view name) {
  if (!name.starts_with("swap.") || name.size() == 5) return false;
  return std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Removes the private directories in `parent_dir` of runs that ended without their destructor
// (SIGKILL, MPI_Abort ending a data-parallel job, a crash): a live store holds a flock on its
// directory, a dead one's lock went with its process. Only directories of this user holding
// nothing but swap.<i> files are removed (not those `keep` left). Best effort: what cannot be
// read or locked is left as it is.
void RemoveStaleSwapDirs(const std::string& parent_dir) {
  UniqueFd parent(::open(parent_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!parent.valid()) return;
  DIR* listing = ::fdopendir(::dup(parent.get()));
  if (listing == nullptr) return;
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(listing)) {
    if (std::string_view(e->d_name).starts_with(kPrivatePrefix)) names.emplace_back(e->d_name);
  }
  ::closedir(listing);
  for (const std::string& name : names) {
    UniqueFd dir(
        ::openat(parent.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    struct stat st {};
    if (!dir.valid() || ::fstat(dir.get(), &st) != 0 || st.st_uid != ::geteuid()) continue;
    if (::flock(dir.get(), LOCK_EX | LOCK_NB) != 0) continue;  // a live run's (or no flock)
    DIR* inside = ::fdopendir(::dup(dir.get()));
    if (inside == nullptr) continue;
    std::vector<std::string> files;
    bool only_swap_files = true;
    while (const dirent* e = ::readdir(inside)) {
      const std::string_view f = e->d_name;
      if (f == "." || f == "..") continue;
      if (!IsSwapFileName(f)) only_swap_files = false;
      files.emplace_back(f);
    }
    ::closedir(inside);
    if (!only_swap_files) continue;
    uint64_t bytes = 0;
    for (const std::string& f : files) {
      struct stat fs {};
      if (::fstatat(dir.get(), f.c_str(), &fs, AT_SYMLINK_NOFOLLOW) == 0) {
        bytes += static_cast<uint64_t>(fs.st_blocks) * 512;
      }
      ::unlinkat(dir.get(), f.c_str(), 0);
    }
    if (::unlinkat(parent.get(), name.c_str(), AT_REMOVEDIR) == 0) {
      STRATA_LOG_WARNING(
          "swap dir '{}': removed '{}' ({} allocated), left by a run that ended without removing "
          "it (killed, or aborted with its data-parallel job)",
          parent_dir, name, FormatBytes(bytes));
    }
  }
}

}  // namespace

uint64_t SwapStore::PaddedSize(uint64_t size_bytes) { return AlignUp(size_bytes, kAlignment); }

SwapStore::SwapStore(IoBackend* backend, SwapStoreOptions options)
    : backend_(backend), options_(std::move(options)), keep_(false) {}

StatusOr<std::unique_ptr<SwapStore>> SwapStore::Create(IoBackend* backend,
                                                       SwapStoreOptions options) {
  if (backend == nullptr) return InvalidArgumentError("swap store: no I/O backend given");
  if (options.dirs.empty()) {
    return InvalidArgumentError("swap store: no swap directories given (SwapStoreOptions.dirs)");
  }
  if (options.stripe_unit_bytes == 0 || options.stripe_unit_bytes % kAlignment != 0) {
    return InvalidArgumentError(
        fmt::format("swap store: stripe unit {} bytes is not a positive multiple of {}",
                    options.stripe_unit_bytes, kAlignment));
  }
  // From here on the destructor removes whatever was made if Create fails (keep_ is false).
  std::unique_ptr<SwapStore> store(new SwapStore(backend, std::move(options)));
  for (size_t i = 0; i < store->options_.dirs.size(); ++i) {
    STRATA_RETURN_IF_ERROR(store->OpenDir(i, store->options_.dirs[i]));
  }
  std::vector<std::string> buffered;
  for (const File& f : store->files_) {
    if (!f.direct) buffered.push_back(f.parent_dir);
  }
  if (!buffered.empty()) {
    STRATA_LOG_WARNING(
        "swap store: the file system of {} refuses O_DIRECT; swapping through the page cache "
        "there (slower, and it competes for host memory)",
        fmt::join(buffered, ", "));
  }
  {
    std::lock_guard<std::mutex> lock(store->mu_);
    store->file_end_bytes_.assign(store->files_.size(), 0);
  }
  if (store->options_.register_files) {
    std::vector<int> fds;
    for (const File& f : store->files_) fds.push_back(f.fd.get());
    STRATA_RETURN_IF_ERROR(store->backend_->RegisterFiles(fds));
    store->files_registered_ = true;
  }
  store->keep_ = store->options_.keep;
  return store;
}

Status SwapStore::OpenDir(size_t index, const std::string& parent_dir) {
  if (parent_dir.empty()) return InvalidArgumentError("swap store: empty swap directory path");
  RemoveStaleSwapDirs(parent_dir);
  std::string prefix = parent_dir;
  if (prefix.back() != '/') prefix += '/';
  // Made under a name no scan considers, locked, then renamed into view: another run's scan
  // never sees it unlocked.
  std::string new_dir = prefix + kNewPrefix + "XXXXXX";
  if (::mkdtemp(new_dir.data()) == nullptr) {  // mode 0700
    return ErrnoToStatus(
        errno, fmt::format("swap dir '{}': cannot create a private directory in it", parent_dir));
  }
  const std::string private_dir = prefix + kPrivatePrefix + new_dir.substr(new_dir.size() - 6);
  File& file = files_.emplace_back();
  file.lock.reset(::open(new_dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (file.lock.valid()) (void)::flock(file.lock.get(), LOCK_EX | LOCK_NB);
  if (::rename(new_dir.c_str(), private_dir.c_str()) != 0) {
    const int err = errno;
    ::rmdir(new_dir.c_str());
    return ErrnoToStatus(
        err, fmt::format("swap dir '{}': cannot create a private directory in it", parent_dir));
  }
  file.parent_dir = parent_dir;
  file.private_dir = private_dir;
  struct stat st;
  if (::stat(private_dir.c_str(), &st) != 0) {
    return ErrnoToStatus(errno, fmt::format("swap dir '{}': stat", private_dir));
  }
  file.device = st.st_dev;

  file.path = fmt::format("{}/swap.{}", private_dir, index);
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  file.fd.reset(OpenRetryingEintr(file.path.c_str(), flags | O_DIRECT, 0600));
  file.direct = file.fd.valid();
  if (!file.fd.valid() && errno == EINVAL) {
    // The file system refuses O_DIRECT at open (it may have created the file first).
    ::unlink(file.path.c_str());
    file.fd.reset(OpenRetryingEintr(file.path.c_str(), flags, 0600));
  }
  if (!file.fd.valid()) {
    return ErrnoToStatus(
        errno, fmt::format("swap dir '{}': cannot create swap file '{}'", parent_dir, file.path));
  }
  if (::fchmod(file.fd.get(), 0600) != 0) {  // exact mode whatever the umask
    return ErrnoToStatus(errno,
                         fmt::format("swap dir '{}': chmod 0600 '{}'", parent_dir, file.path));
  }
  int err = ProbeWrite(file.fd.get());
  if (err == EINVAL && file.direct) {
    // Accepted O_DIRECT at open but not at write: reopen the same file buffered.
    file.fd.reset(OpenRetryingEintr(file.path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0));
    if (!file.fd.valid()) {
      return ErrnoToStatus(
          errno, fmt::format("swap dir '{}': reopen '{}' without O_DIRECT", parent_dir, file.path));
    }
    file.direct = false;
    err = ProbeWrite(file.fd.get());
  }
  if (err != 0) {
    return ErrnoToStatus(
        err, fmt::format("swap dir '{}': cannot write swap file '{}'", parent_dir, file.path));
  }
  if (::ftruncate(file.fd.get(), 0) != 0) {
    return ErrnoToStatus(errno, fmt::format("swap dir '{}': truncate '{}'", parent_dir, file.path));
  }
  return Status::Ok();
}

SwapStore::~SwapStore() {
  if (files_registered_) {  // before closing: a registered file outlives its fd otherwise
    std::vector<int> fds;
    for (const File& f : files_) fds.push_back(f.fd.get());
    backend_->UnregisterFiles(fds);
  }
  for (File& f : files_) {
    f.fd.reset();
    if (!keep_ && !f.path.empty() && ::unlink(f.path.c_str()) != 0 && errno != ENOENT) {
      STRATA_LOG_WARNING("swap store: cannot remove '{}': {}", f.path, std::strerror(errno));
    }
  }
  for (const File& f : files_) {
    if (keep_ && !f.private_dir.empty()) {  // not a dead run's: the next store leaves it
      UniqueFd marker(::open(fmt::format("{}/{}", f.private_dir, kKeptMarker).c_str(),
                             O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
    }
    if (!keep_ && ::rmdir(f.private_dir.c_str()) != 0 && errno != ENOENT) {
      STRATA_LOG_WARNING("swap store: cannot remove '{}': {}", f.private_dir, std::strerror(errno));
    }
  }
}

std::vector<uint64_t> SwapStore::StripeShareBytes(uint64_t padded_bytes, size_t num_files,
                                                  uint64_t stripe_unit_bytes) {
  const uint64_t n = num_files;
  const uint64_t unit = stripe_unit_bytes;
  const uint64_t full_units = padded_bytes / unit;
  const uint64_t tail_bytes = padded_bytes % unit;
  std::vector<uint64_t> share(n);
  for (uint64_t j = 0; j < n; ++j) {
    share[j] = (full_units / n + (j < full_units % n ? 1 : 0)) * unit;
  }
  if (tail_bytes > 0) share[full_units % n] += tail_bytes;
  return share;
}

std::vector<SwapStore::Run> SwapStore::Runs(const std::vector<uint64_t>& file_offset_bytes,
                                            uint64_t padded_bytes) const {
  const uint64_t n = files_.size();
  const uint64_t unit = options_.stripe_unit_bytes;
  std::vector<Run> runs;
  for (uint64_t k = 0, pos = 0; pos < padded_bytes; ++k, pos += unit) {
    const size_t file = static_cast<size_t>(k % n);
    const uint64_t size = std::min(unit, padded_bytes - pos);
    const uint64_t offset = file_offset_bytes[file] + (k / n) * unit;
    if (!runs.empty()) {
      Run& last = runs.back();
      if (last.file == file && last.file_offset_bytes + last.size_bytes == offset &&
          last.buf_offset_bytes + last.size_bytes == pos) {
        last.size_bytes += size;
        continue;
      }
    }
    runs.push_back({file, offset, pos, size});
  }
  return runs;
}

std::vector<std::string> SwapStore::Labels(std::string_view name) const {
  std::vector<std::string> labels;
  labels.reserve(files_.size());
  for (const File& f : files_) labels.push_back(fmt::format("extent '{}' in {}", name, f.path));
  return labels;
}

Status SwapStore::Reserve(std::string_view name, const std::vector<uint64_t>& file_offset_bytes,
                          const std::vector<uint64_t>& share_bytes) {
  // Free space, summed over the dirs that share a file system.
  std::vector<std::pair<size_t, uint64_t>> needs;  // (first file on the device, bytes)
  for (size_t j = 0; j < files_.size(); ++j) {
    if (share_bytes[j] == 0) continue;
    auto it = std::find_if(needs.begin(), needs.end(), [&](const auto& need) {
      return files_[need.first].device == files_[j].device;
    });
    if (it == needs.end()) {
      needs.emplace_back(j, share_bytes[j]);
    } else {
      it->second += share_bytes[j];
    }
  }
  for (const auto& [j, need_bytes] : needs) {
    struct statvfs sv;
    if (::statvfs(files_[j].private_dir.c_str(), &sv) != 0) {
      return ErrnoToStatus(errno, fmt::format("swap dir '{}': statvfs", files_[j].parent_dir));
    }
    const uint64_t free_bytes = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
    if (free_bytes < need_bytes) {
      return ResourceExhaustedError(
          fmt::format("swap dir '{}': extent '{}' needs {} but only {} are free ({} short)",
                      files_[j].parent_dir, name, FormatBytes(need_bytes), FormatBytes(free_bytes),
                      FormatBytes(need_bytes - free_bytes)));
    }
  }
  for (size_t j = 0; j < files_.size(); ++j) {
    if (share_bytes[j] == 0) continue;
    int r;
    do {
      r = ::fallocate(files_[j].fd.get(), 0, static_cast<off_t>(file_offset_bytes[j]),
                      static_cast<off_t>(share_bytes[j]));
    } while (r != 0 && errno == EINTR);
    if (r != 0 && errno != EOPNOTSUPP && errno != ENOSYS) {
      return ErrnoToStatus(errno,
                           fmt::format("extent '{}': preallocating {} bytes at offset {} "
                                       "of {}",
                                       name, share_bytes[j], file_offset_bytes[j], files_[j].path));
    }
  }
  return Status::Ok();
}

Status SwapStore::Allocate(std::string_view name, uint64_t size_bytes) {
  if (name.empty()) return InvalidArgumentError("swap store: extent name is empty");
  if (size_bytes == 0 || size_bytes > UINT64_MAX - kAlignment) {
    return InvalidArgumentError(
        fmt::format("extent '{}': size {} bytes is out of range (> 0 needed)", name, size_bytes));
  }
  const uint64_t padded_bytes = PaddedSize(size_bytes);
  const std::vector<uint64_t> share_bytes = ShareBytes(padded_bytes);
  std::vector<uint64_t> offsets(files_.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (extents_.find(name) != extents_.end()) {
      return AlreadyExistsError(fmt::format("extent '{}' already exists", name));
    }
    for (size_t j = 0; j < files_.size(); ++j) {
      offsets[j] = file_end_bytes_[j];
      file_end_bytes_[j] += share_bytes[j];
    }
    Extent extent;
    extent.size_bytes = size_bytes;
    extent.file_offset_bytes = offsets;
    extents_.emplace(std::string(name), std::move(extent));
  }
  // statvfs and fallocate outside the lock; the extent is kAllocating meanwhile.
  Status status = Reserve(name, offsets, share_bytes);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = extents_.find(name);
  STRATA_CHECK(it != extents_.end());
  if (status.ok()) {
    it->second.state = ExtentState::kEmpty;
    return status;
  }
  extents_.erase(it);
  for (size_t j = 0; j < files_.size(); ++j) {  // give the space back if nothing came after
    if (file_end_bytes_[j] == offsets[j] + share_bytes[j]) file_end_bytes_[j] = offsets[j];
  }
  return status;
}

namespace {

Status CheckBuffer(std::string_view name, const std::byte* data, size_t buf_bytes,
                   uint64_t size_bytes) {
  if (reinterpret_cast<uintptr_t>(data) % SwapStore::kAlignment != 0) {
    return InvalidArgumentError(fmt::format("extent '{}': buffer at {} is not {}-byte aligned",
                                            name, static_cast<const void*>(data),
                                            SwapStore::kAlignment));
  }
  if (buf_bytes < SwapStore::PaddedSize(size_bytes)) {
    return InvalidArgumentError(
        fmt::format("extent '{}': buffer of {} bytes is smaller than the padded extent ({} bytes)",
                    name, buf_bytes, SwapStore::PaddedSize(size_bytes)));
  }
  return Status::Ok();
}

}  // namespace

Status SwapStore::Write(std::string_view name, std::span<const std::byte> buf) {
  uint64_t size_bytes;
  std::vector<uint64_t> offsets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = extents_.find(name);
    if (it == extents_.end()) return NotFoundError(fmt::format("no extent '{}'", name));
    Extent& e = it->second;
    if (e.state == ExtentState::kAllocating) {
      return FailedPreconditionError(fmt::format("extent '{}' is still being allocated", name));
    }
    if (e.writing || e.readers > 0) {
      return FailedPreconditionError(
          fmt::format("extent '{}' is being read or written by another call", name));
    }
    STRATA_RETURN_IF_ERROR(CheckBuffer(name, buf.data(), buf.size(), e.size_bytes));
    e.writing = true;
    size_bytes = e.size_bytes;
    offsets = e.file_offset_bytes;
  }
  const uint64_t checksum = options_.verify_checksums ? XXH3_64bits(buf.data(), size_bytes) : 0;
  const std::vector<std::string> labels = Labels(name);
  std::vector<WriteSegment> segments;
  for (const Run& run : Runs(offsets, PaddedSize(size_bytes))) {
    segments.push_back({files_[run.file].fd.get(), run.file_offset_bytes,
                        buf.subspan(run.buf_offset_bytes, run.size_bytes), labels[run.file]});
  }
  Status status = backend_->WriteBatch(segments);
  status = IsOutOfSpace(status) ? OutOfSpaceError(name, size_bytes, status)
                                : WithExtent(name, size_bytes, status);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Extent& e = extents_.find(name)->second;  // extents are never erased once allocated
    e.writing = false;
    e.state = status.ok() ? ExtentState::kValid : ExtentState::kWriteFailed;
    e.checksum = checksum;
  }
  if (status.ok()) bytes_written_.fetch_add(size_bytes, std::memory_order_relaxed);
  return status;
}

Status SwapStore::OutOfSpaceError(std::string_view name, uint64_t size_bytes,
                                  const Status& cause) const {
  const std::vector<uint64_t> share_bytes = ShareBytes(PaddedSize(size_bytes));
  std::vector<std::string> parts;
  for (size_t j = 0; j < files_.size(); ++j) {
    if (share_bytes[j] == 0) continue;
    struct statvfs sv;
    if (::statvfs(files_[j].private_dir.c_str(), &sv) != 0) continue;
    const uint64_t free_bytes = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
    // The extent's share may be partly written already; what is free now is what is left.
    parts.push_back(
        fmt::format("'{}' needs {} for it, {} free ({} short)", files_[j].path,
                    FormatBytes(share_bytes[j]), FormatBytes(free_bytes),
                    FormatBytes(share_bytes[j] > free_bytes ? share_bytes[j] - free_bytes : 0)));
  }
  return Status(StatusCode::kResourceExhausted,
                fmt::format("swap store out of space writing extent '{}' ({} bytes): {}; free "
                            "space on the swap drive(s) or pass other swap directories ({})",
                            name, size_bytes, fmt::join(parts, "; "), cause.message()),
                cause.os_error());
}

Status SwapStore::WithExtent(std::string_view name, uint64_t size_bytes,
                             const Status& status) const {
  if (status.ok() || status.message().find(fmt::format("extent '{}'", name)) != std::string::npos) {
    return status;
  }
  const std::vector<uint64_t> share_bytes = ShareBytes(PaddedSize(size_bytes));
  std::vector<std::string_view> paths;
  for (size_t j = 0; j < files_.size(); ++j) {
    if (share_bytes[j] > 0) paths.push_back(files_[j].path);
  }
  return status.WithContext(fmt::format("extent '{}' in {}", name, fmt::join(paths, ", ")));
}

Status SwapStore::Read(std::string_view name, std::span<std::byte> buf) {
  uint64_t size_bytes;
  uint64_t checksum;
  std::vector<uint64_t> offsets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = extents_.find(name);
    if (it == extents_.end()) return NotFoundError(fmt::format("no extent '{}'", name));
    Extent& e = it->second;
    if (e.state == ExtentState::kAllocating) {
      return FailedPreconditionError(fmt::format("extent '{}' is still being allocated", name));
    }
    if (e.writing) {
      return FailedPreconditionError(
          fmt::format("extent '{}' is being written by another call", name));
    }
    if (e.state == ExtentState::kEmpty) {
      return FailedPreconditionError(fmt::format("extent '{}' was never written", name));
    }
    if (e.state == ExtentState::kWriteFailed) {
      return FailedPreconditionError(
          fmt::format("extent '{}' holds no valid data: its last write failed", name));
    }
    STRATA_RETURN_IF_ERROR(CheckBuffer(name, buf.data(), buf.size(), e.size_bytes));
    ++e.readers;
    size_bytes = e.size_bytes;
    checksum = e.checksum;
    offsets = e.file_offset_bytes;
  }
  const std::vector<std::string> labels = Labels(name);
  std::vector<ReadSegment> segments;
  for (const Run& run : Runs(offsets, PaddedSize(size_bytes))) {
    segments.push_back({files_[run.file].fd.get(), run.file_offset_bytes,
                        buf.subspan(run.buf_offset_bytes, run.size_bytes), labels[run.file]});
  }
  const Status status = backend_->ReadBatch(segments);
  {
    std::lock_guard<std::mutex> lock(mu_);
    --extents_.find(name)->second.readers;
  }
  STRATA_RETURN_IF_ERROR(WithExtent(name, size_bytes, status));
  if (options_.verify_checksums) {
    const uint64_t actual = XXH3_64bits(buf.data(), size_bytes);
    if (actual != checksum) {
      std::vector<std::string> paths;
      for (const File& f : files_) paths.push_back(f.path);
      return DataLossError(fmt::format(
          "extent '{}': checksum mismatch over {} bytes (xxh3-64 written {:016x}, read {:016x}) "
          "in {}: the swap data is corrupt",
          name, size_bytes, checksum, actual, fmt::join(paths, ", ")));
    }
  }
  bytes_read_.fetch_add(size_bytes, std::memory_order_relaxed);
  return Status::Ok();
}

std::vector<std::string> SwapStore::file_paths() const {
  std::vector<std::string> paths;
  for (const File& f : files_) paths.push_back(f.path);
  return paths;
}

std::vector<std::string> SwapStore::private_dirs() const {
  std::vector<std::string> dirs;
  for (const File& f : files_) dirs.push_back(f.private_dir);
  return dirs;
}

bool SwapStore::direct_io() const {
  return std::all_of(files_.begin(), files_.end(), [](const File& f) { return f.direct; });
}

StatusOr<uint64_t> SwapStore::ExtentSize(std::string_view name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = extents_.find(name);
  if (it == extents_.end()) return NotFoundError(fmt::format("no extent '{}'", name));
  return it->second.size_bytes;
}

StatusOr<std::pair<std::string, uint64_t>> SwapStore::Locate(std::string_view name,
                                                             uint64_t offset_in_extent) const {
  uint64_t size_bytes;
  std::vector<uint64_t> offsets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = extents_.find(name);
    if (it == extents_.end()) return NotFoundError(fmt::format("no extent '{}'", name));
    size_bytes = it->second.size_bytes;
    offsets = it->second.file_offset_bytes;
  }
  if (offset_in_extent >= size_bytes) {
    return OutOfRangeError(fmt::format("extent '{}': offset {} is beyond its {} bytes", name,
                                       offset_in_extent, size_bytes));
  }
  const uint64_t unit = options_.stripe_unit_bytes;
  const uint64_t k = offset_in_extent / unit;
  const size_t file = static_cast<size_t>(k % files_.size());
  return std::make_pair(files_[file].path,
                        offsets[file] + (k / files_.size()) * unit + offset_in_extent % unit);
}

}  // namespace strata::io
