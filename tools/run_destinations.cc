#include "tools/run_destinations.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <system_error>

#include "base/dtype.h"
#include "base/units.h"

namespace strata::tools {

namespace {

// Free bytes for an unprivileged writer on the file system of `dir`; 0 when statvfs fails.
uint64_t FreeBytes(const std::string& dir) {
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return 0;
  return static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
}

}  // namespace

Status MakeWritableDirectory(std::string_view flag, const std::string& dir, mode_t mode) {
  std::error_code ec;
  const bool exists = std::filesystem::exists(dir, ec);
  if (exists && !std::filesystem::is_directory(dir, ec)) {
    return InvalidArgumentError(fmt::format("{} '{}' exists and is not a directory", flag, dir));
  }
  if (!exists) {
    const std::filesystem::path parent = std::filesystem::path(dir).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    if (ec || ::mkdir(dir.c_str(), mode) != 0) {
      const int err = ec ? ec.value() : errno;
      if (err != EEXIST || !std::filesystem::is_directory(dir, ec)) {
        return ErrnoToStatus(err, fmt::format("{} '{}': cannot create the directory", flag, dir));
      }
    }
  }
  std::string probe = (std::filesystem::path(dir) / ".strata-write-check-XXXXXX").string();
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) {
    return ErrnoToStatus(errno, fmt::format("{} '{}': cannot write into the directory", flag, dir));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return Status::Ok();
}

Status CheckWritableFile(std::string_view flag, const std::string& path) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) {
    if (std::filesystem::is_directory(path, ec)) {
      return InvalidArgumentError(fmt::format("{} '{}' is a directory", flag, path));
    }
    if (::access(path.c_str(), W_OK) != 0) {
      return ErrnoToStatus(errno, fmt::format("{} '{}': cannot write the file", flag, path));
    }
    return Status::Ok();
  }
  const std::filesystem::path parent_path = std::filesystem::path(path).parent_path();
  const std::string parent = parent_path.empty() ? "." : parent_path.string();
  // Unlike a directory flag's, a file's directory is not created: a missing one is more likely
  // a typo than a request.
  if (!std::filesystem::exists(parent, ec)) {
    return NotFoundError(
        fmt::format("{} '{}': the directory '{}' does not exist", flag, path, parent));
  }
  return MakeWritableDirectory(fmt::format("{} '{}': directory", flag, path), parent);
}

uint64_t CheckpointBytes(const engine::Plan& plan) {
  const auto params = static_cast<uint64_t>(plan.model_params);
  return params * (4 + SizeOf(plan.precision)) + plan.optimizer_state_bytes;
}

Status PrepareRunDestinations(const TrainFlags& flags, const engine::Plan& plan) {
  const std::string& save_dir = flags.checkpoint.save_dir;
  if (!save_dir.empty()) {
    STRATA_RETURN_IF_ERROR(MakeWritableDirectory("--save-dir", save_dir, S_IRWXU));
    const uint64_t need = CheckpointBytes(plan);
    const uint64_t free = FreeBytes(save_dir);
    if (free > 0 && free < need) {
      return ResourceExhaustedError(fmt::format(
          "--save-dir '{}': one checkpoint needs {} (fp32 master weights, optimizer state, "
          "working params), its file system has {} free",
          save_dir, FormatBytes(need), FormatBytes(free)));
    }
  }
  if (plan.nvme_bytes > 0) {
    if (flags.nvme_paths.empty()) {
      STRATA_RETURN_IF_ERROR(MakeWritableDirectory("--nvme-path", "."));
    }
    for (const std::string& path : flags.nvme_paths) {
      STRATA_RETURN_IF_ERROR(MakeWritableDirectory("--nvme-path", path));
    }
  }
  if (!flags.summary_json.empty()) {
    STRATA_RETURN_IF_ERROR(CheckWritableFile("--summary-json", flags.summary_json));
  }
  if (!flags.trace.empty()) {
    STRATA_RETURN_IF_ERROR(CheckWritableFile("--trace", flags.trace));
  }
  return Status::Ok();
}

}  // namespace strata::tools
