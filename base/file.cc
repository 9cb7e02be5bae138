#include "base/file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>  // renameat2, RENAME_EXCHANGE
#include <filesystem>
#include <utility>

namespace strata {
namespace {

std::string ParentOf(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

}  // namespace

std::string_view FileTypeName(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

StatusOr<std::string> ReadSmallFile(const std::string& path, const ReadSmallFileOptions& options) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; the type is
  // checked before anything is read. It changes nothing for a regular file.
  const int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | (options.follow_symlinks ? 0 : O_NOFOLLOW);
  UniqueFd fd(::open(path.c_str(), flags));
  if (!fd.valid()) return ErrnoToStatus(errno, fmt::format("opening '{}'", path));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoToStatus(errno, fmt::format("stat '{}'", path));
  if (!S_ISREG(st.st_mode)) {
    return Status(options.unusable_code,
                  fmt::format("'{}' is {}, not a regular file", path, FileTypeName(st.st_mode)));
  }
  if (static_cast<uint64_t>(st.st_size) > options.max_bytes) {
    return Status(options.unusable_code, fmt::format("'{}' is {} bytes, more than the {} allowed",
                                                     path, st.st_size, options.max_bytes));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t r = ::read(fd.get(), out.data() + done, out.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoToStatus(errno, fmt::format("reading '{}'", path));
    if (r == 0) break;  // the file shrank meanwhile: keep what was there
    done += static_cast<size_t>(r);
  }
  out.resize(done);
  return out;
}

StatusOr<UniqueFd> OpenRegularFile(const std::string& path, std::string_view what, int extra_flags,
                                   struct stat* st) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | extra_flags));
  if (!fd.valid()) return ErrnoToStatus(errno, fmt::format("opening {} '{}'", what, path));
  struct stat own;
  if (st == nullptr) st = &own;
  if (::fstat(fd.get(), st) != 0)
    return ErrnoToStatus(errno, fmt::format("stat {} '{}'", what, path));
  if (!S_ISREG(st->st_mode)) {
    return InvalidArgumentError(
        fmt::format("{} '{}' is {}, not a regular file", what, path, FileTypeName(st->st_mode)));
  }
  // Reads of a regular file never block; clear the flag all the same, for what the caller does.
  const int fl = ::fcntl(fd.get(), F_GETFL);
  if (fl >= 0) ::fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

Status WriteAll(int fd, std::span<const std::byte> bytes, std::string_view path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t r = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoToStatus(errno, fmt::format("writing '{}'", path));
    done += static_cast<size_t>(r);
  }
  return Status::Ok();
}

Status FsyncFile(int fd, std::string_view path) {
  if (::fsync(fd) != 0) return ErrnoToStatus(errno, fmt::format("fsync '{}'", path));
  return Status::Ok();
}

Status FsyncDirectory(const std::string& dir) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoToStatus(errno, fmt::format("opening directory '{}'", dir));
  return FsyncFile(fd.get(), dir);
}

Status WriteNewFile(const std::string& path, std::string_view bytes, mode_t mode) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode));
  if (!fd.valid()) return ErrnoToStatus(errno, fmt::format("creating '{}'", path));
  STRATA_RETURN_IF_ERROR(WriteAll(fd.get(), std::as_bytes(std::span(bytes)), path));
  STRATA_RETURN_IF_ERROR(FsyncFile(fd.get(), path));
  if (::close(fd.release()) != 0) return ErrnoToStatus(errno, fmt::format("close '{}'", path));
  return Status::Ok();
}

Status RenameDurably(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return ErrnoToStatus(errno, fmt::format("renaming '{}' to '{}'", from, to));
  }
  return FsyncDirectory(ParentOf(to));
}

StatusOr<std::string> MakeTempDirectory(std::string path_template) {
  if (::mkdtemp(path_template.data()) == nullptr) {
    return ErrnoToStatus(errno,
                         fmt::format("creating the temporary directory '{}'", path_template));
  }
  return path_template;
}

void RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);  // does not follow symlinks
  // remove_all opens the directory to list it; out of file descriptors (EMFILE, the error that
  // may have ended the save) an empty directory still goes by name.
  if (ec) ::rmdir(path.c_str());
}

Status MoveIntoPlace(const std::string& temp_dir, const std::string& target,
                     std::string* displaced) {
  displaced->clear();
  struct stat st;
  if (::lstat(target.c_str(), &st) != 0) return RenameDurably(temp_dir, target);
  // One step: no moment without a complete directory under target (Linux 3.15; ext4, xfs,
  // btrfs, tmpfs).
  if (::renameat2(AT_FDCWD, temp_dir.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    *displaced = temp_dir;
    return FsyncDirectory(ParentOf(target));
  }
  if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP) {
    return ErrnoToStatus(errno, fmt::format("replacing '{}' by '{}'", target, temp_dir));
  }
  // A file system without the exchange: aside, then into place, and back if that fails.
  const std::string name = std::filesystem::path(target).filename().string();
  STRATA_ASSIGN_OR_RETURN(std::string aside, MakeTempDirectory(fmt::format(
                                                 "{}/.old-{}-XXXXXX", ParentOf(target), name)));
  if (::rename(target.c_str(), aside.c_str()) != 0) {
    const Status moved = ErrnoToStatus(errno, fmt::format("moving aside '{}'", target));
    ::rmdir(aside.c_str());
    return moved;
  }
  if (::rename(temp_dir.c_str(), target.c_str()) != 0) {
    const Status failed =
        ErrnoToStatus(errno, fmt::format("renaming '{}' to '{}'", temp_dir, target));
    ::rename(aside.c_str(), target.c_str());  // best effort: the old directory back in place
    return failed;
  }
  *displaced = aside;
  return FsyncDirectory(ParentOf(target));
}

AtomicFileWriter::AtomicFileWriter(std::string path, std::string temp_path, UniqueFd fd)
    : path_(std::move(path)), temp_path_(std::move(temp_path)), fd_(std::move(fd)) {}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)),
      temp_path_(std::exchange(other.temp_path_, std::string())),
      fd_(std::move(other.fd_)) {}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& other) noexcept {
  if (this != &other) {
    Abandon();
    path_ = std::move(other.path_);
    temp_path_ = std::exchange(other.temp_path_, std::string());
    fd_ = std::move(other.fd_);
  }
  return *this;
}

AtomicFileWriter::~AtomicFileWriter() { Abandon(); }

void AtomicFileWriter::Abandon() {
  fd_.reset();
  if (!temp_path_.empty()) ::unlink(temp_path_.c_str());
  temp_path_.clear();
}

StatusOr<AtomicFileWriter> AtomicFileWriter::Create(const std::string& path, mode_t mode) {
  const auto nanos = std::chrono::steady_clock::now().time_since_epoch().count();
  std::string temp = fmt::format("{}.tmp-{}-{}", path, ::getpid(), nanos);
  UniqueFd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode));
  if (!fd.valid()) {
    return ErrnoToStatus(errno, fmt::format("creating '{}' (as '{}' first)", path, temp));
  }
  return AtomicFileWriter(path, std::move(temp), std::move(fd));
}

Status AtomicFileWriter::Append(std::span<const std::byte> bytes) {
  if (!fd_.valid()) return FailedPreconditionError(fmt::format("'{}': Append after Commit", path_));
  return WriteAll(fd_.get(), bytes, temp_path_);
}

Status AtomicFileWriter::Commit() {
  if (!fd_.valid()) return FailedPreconditionError(fmt::format("'{}': Commit called twice", path_));
  STRATA_RETURN_IF_ERROR(FsyncFile(fd_.get(), temp_path_));
  if (::close(fd_.release()) != 0) {
    return ErrnoToStatus(errno, fmt::format("closing '{}'", temp_path_));
  }
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    return ErrnoToStatus(errno, fmt::format("renaming '{}' to '{}'", temp_path_, path_));
  }
  temp_path_.clear();
  return FsyncDirectory(ParentOf(path_));
}

StatusOr<OutputFileWriter> OutputFileWriter::Create(const std::string& path,
                                                    std::string_view what) {
  OutputFileWriter w(path, std::string(what));
  std::string target = path;
  std::error_code ec;
  if (std::filesystem::is_symlink(path, ec)) {
    const std::filesystem::path resolved = std::filesystem::canonical(path, ec);
    if (!ec) target = resolved.string();
  }
  struct stat st;
  if (::stat(target.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    w.direct_ = UniqueFd(::open(target.c_str(), O_WRONLY | O_CLOEXEC));
    if (!w.direct_.valid())
      return ErrnoToStatus(errno, fmt::format("{} '{}': opening", what, path));
    return w;
  }
  StatusOr<AtomicFileWriter> atomic = AtomicFileWriter::Create(target, 0644);
  if (!atomic.ok()) return atomic.status().WithContext(what);
  w.atomic_.emplace(std::move(*atomic));
  return w;
}

Status OutputFileWriter::Append(std::span<const std::byte> bytes) {
  if (atomic_) return atomic_->Append(bytes).WithContext(what_);
  if (!direct_.valid()) {
    return FailedPreconditionError(fmt::format("{} '{}': Append after Commit", what_, path_));
  }
  return WriteAll(direct_.get(), bytes, path_).WithContext(what_);
}

Status OutputFileWriter::Commit() {
  if (atomic_) return atomic_->Commit().WithContext(what_);
  if (!direct_.valid()) {
    return FailedPreconditionError(fmt::format("{} '{}': Commit called twice", what_, path_));
  }
  if (::close(direct_.release()) != 0) {
    return ErrnoToStatus(errno, fmt::format("{} '{}': closing", what_, path_));
  }
  return Status::Ok();
}

Status WriteOutputFile(const std::string& path, std::string_view bytes, std::string_view what) {
  STRATA_ASSIGN_OR_RETURN(OutputFileWriter w, OutputFileWriter::Create(path, what));
  STRATA_RETURN_IF_ERROR(w.Append(std::as_bytes(std::span(bytes.data(), bytes.size()))));
  return w.Commit();
}

}  // namespace strata
