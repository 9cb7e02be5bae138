// Small files and the crash-safe write: reading a whole small file, writing every byte, fsync of
// a file and of a directory, a new file written and synced, a file or a directory moved into
// place atomically (a temporary name in the same directory, fsync, rename, fsync of the
// directory), and private temporary directories.
//
// Every function returns its failure as a Status whose message names the path; errno values go
// through ErrnoToStatus (ENOENT -> kNotFound, ENOSPC -> kResourceExhausted, EIO -> kDataLoss,
// ELOOP (a symlink under O_NOFOLLOW) and EISDIR -> kInvalidArgument, ...). Files are opened with
// O_CLOEXEC. The functions keep no state: they may run concurrently on different paths.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "base/status.h"
#include "base/unique_fd.h"

namespace strata {

struct ReadSmallFileOptions {
  // The largest file accepted, in bytes; a larger one is an error before anything is read.
  uint64_t max_bytes = 0;
  // false: open with O_NOFOLLOW, so a symlink at `path` is an error (kInvalidArgument, ELOOP).
  bool follow_symlinks = true;
  // The code of the error for a path that is not a regular file (a directory, a FIFO) or is
  // larger than max_bytes: kInvalidArgument for a file the user names (a config, a tokenizer),
  // kDataLoss for one Strata wrote itself and finds damaged (a checkpoint's manifest).
  StatusCode unusable_code = StatusCode::kInvalidArgument;
};

// "a FIFO", "a directory", "a character device", ... for a stat(2) st_mode, for messages that
// refuse a path that is not a regular file.
std::string_view FileTypeName(mode_t mode);

// The whole content of the regular file at `path`, of at most options.max_bytes bytes. A file
// that shrinks while it is read gives what was there. The file is opened non-blocking and its
// type checked before anything is read, so a FIFO or a device is refused at once, never waited
// on. Errors: ErrnoToStatus codes of open, fstat and read ("opening 'PATH'", ...);
// options.unusable_code for "'PATH' is a FIFO, not a regular file" and "'PATH' is N bytes, more
// than the M allowed".
StatusOr<std::string> ReadSmallFile(const std::string& path, const ReadSmallFileOptions& options);

// Opens the regular file at `path` for reading (O_RDONLY | O_CLOEXEC | extra_flags), without
// waiting on a FIFO or a device: it is opened non-blocking and its type checked first. *st, when
// given, receives its fstat. Errors: ErrnoToStatus codes of open and fstat ("opening WHAT
// 'PATH'"); kInvalidArgument "WHAT 'PATH' is a FIFO, not a regular file" for anything else.
StatusOr<UniqueFd> OpenRegularFile(const std::string& path, std::string_view what,
                                   int extra_flags = 0, struct stat* st = nullptr);

// Writes all of `bytes` at fd's file position, retrying short writes and EINTR. `path` names
// the file in errors ("writing 'PATH'").
Status WriteAll(int fd, std::span<const std::byte> bytes, std::string_view path);

// fsync(fd): the file's data and metadata are on stable storage when it returns OK.
Status FsyncFile(int fd, std::string_view path);

// fsync of the directory `dir`, after creating, renaming or removing entries in it.
Status FsyncDirectory(const std::string& dir);

// Creates `path` (O_CREAT | O_EXCL | O_NOFOLLOW: an existing file or a symlink is an error,
// kAlreadyExists), writes `bytes`, fsyncs and closes it. The directory is not synced: the caller
// syncs it once after its last new file. A failure leaves a partial file for the caller's
// cleanup of its temporary directory.
Status WriteNewFile(const std::string& path, std::string_view bytes, mode_t mode);

// rename(from, to), then fsync of to's parent directory ("." for a bare name): when it returns
// OK the new name is durable. `to` is replaced atomically if it exists (a file, or an empty
// directory when `from` is one).
Status RenameDurably(const std::string& from, const std::string& to);

// Makes a private directory (mode 0700) from `path_template`, whose name ends in "XXXXXX"
// (mkdtemp), and returns its path.
StatusOr<std::string> MakeTempDirectory(std::string path_template);

// Best-effort recursive removal, for a failed save's temporary directory; does not follow
// symlinks; errors are ignored.
void RemoveTree(const std::string& path);

// Renames the complete directory temp_dir to target and fsyncs target's parent. An existing
// target is exchanged with temp_dir in one step (renameat2 RENAME_EXCHANGE): target names the
// old directory, then the new one, never nothing, and temp_dir holds the old one, returned in
// *displaced ("" when there was none) for the caller to remove once the new state is committed.
// Where the file system cannot exchange, the old target is renamed aside to
// PARENT/.old-<name>-XXXXXX (returned in *displaced) and moved back if the rename into place
// fails. On an error target is as it was, unless only the final fsync failed.
Status MoveIntoPlace(const std::string& temp_dir, const std::string& target,
                     std::string* displaced);

// A command's small output file (--summary-json, iobench --config-out): `bytes` replace `path`
// through an AtomicFileWriter (below) when path is a regular file or does not exist, so a crash
// or a full disk leaves the old file or none, never a part of the new one; anything else that
// exists (/dev/stdout, a FIFO, a terminal) is opened and written directly. A symlink is
// followed to its target: the link stays and the target is replaced. Errors name `path`, prefixed
// with `what` ("--summary-json").
Status WriteOutputFile(const std::string& path, std::string_view bytes, std::string_view what);

// A file written under a temporary name beside its final path and renamed over it when
// complete, so a reader (or a crash) sees the old file or the whole new one, never a part:
//   Create  opens PATH.tmp-<pid>-<nanoseconds> (O_CREAT | O_EXCL | O_NOFOLLOW, `mode`);
//   Append  writes bytes at the end;
//   Commit  fsyncs and closes it, renames it over PATH and fsyncs PATH's directory.
// Destroying a writer that was not committed, or whose Commit failed before the rename, removes
// the temporary file. Move-only; one thread at a time.
class AtomicFileWriter {
 public:
  // Errors: those of open(2) on the temporary name, e.g. kNotFound for a missing directory.
  static StatusOr<AtomicFileWriter> Create(const std::string& path, mode_t mode);

  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& other) noexcept;
  ~AtomicFileWriter();

  // kFailedPrecondition after Commit; else WriteAll's errors, naming the temporary file.
  Status Append(std::span<const std::byte> bytes);
  // kFailedPrecondition when called twice; else the errors of fsync, close, rename and the
  // directory's fsync. After an error of the directory's fsync the file is in place but its name
  // may not be durable.
  Status Commit();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }

 private:
  AtomicFileWriter(std::string path, std::string temp_path, UniqueFd fd);

  // Removes the temporary file unless it was renamed (temp_path_ empty).
  void Abandon();

  std::string path_;
  std::string temp_path_;  // empty once renamed over path_, or moved from
  UniqueFd fd_;
};

// WriteOutputFile streamed, for an output too large to hold whole (strata tokenize's token
// file): Create decides as WriteOutputFile does (a regular file, or nothing, is written through
// an AtomicFileWriter on the symlink's target; /dev/stdout, a FIFO or a terminal is opened and
// written directly), Append writes, Commit puts the file in place (or, written directly,
// returns OK). Destroyed without Commit, a file written atomically is left as it was. Errors
// name the path, prefixed with `what`. Move-only; one thread at a time.
class OutputFileWriter {
 public:
  static StatusOr<OutputFileWriter> Create(const std::string& path, std::string_view what);

  Status Append(std::span<const std::byte> bytes);
  Status Commit();

  // False when the output is written directly (not a regular file): what a failed command
  // wrote there stays written.
  bool atomic() const { return atomic_.has_value(); }

 private:
  OutputFileWriter(std::string path, std::string what) : path_(std::move(path)), what_(what) {}

  std::string path_;
  std::string what_;
  std::optional<AtomicFileWriter> atomic_;
  UniqueFd direct_;
};

}  // namespace strata
