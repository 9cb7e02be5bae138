#include "tools/run_destinations.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <system_error>

#include "base/dtype.h"
#include "base/file.h"
#include "base/units.h"
#include "engine/checkpoint.h"
#include "io/swap_store.h"

namespace strata::tools {

namespace {

// Free bytes for an unprivileged writer on the file system of `dir`; 0 when statvfs fails.
uint64_t FreeBytes(const std::string& dir) {
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return 0;
  return static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
}

// The step `<save_dir>/latest` names, or -1 when it is missing, unreadable or names no step-N.
int64_t LatestStep(const std::string& save_dir) {
  const std::string path = (std::filesystem::path(save_dir) / engine::kLatestFileName).string();
  StatusOr<std::string> name = ReadSmallFile(path, {.max_bytes = 4096, .follow_symlinks = false});
  if (!name.ok()) return -1;
  while (!name->empty() && (name->back() == '\n' || name->back() == ' ')) name->pop_back();
  return engine::CheckpointStepOfName(*name);
}

// Refuses a save directory that holds a run (a `latest` file or a step-N entry): a new run would
// replace its checkpoints of the same steps and its `latest`, and --keep-last would count its
// later steps as the newest. Leftovers of killed saves (.tmp-step-*, .old-step-*) are no run.
Status CheckSaveDirHoldsNoRun(const std::string& save_dir) {
  bool has_latest = false;
  int64_t newest = -1;
  int64_t checkpoints = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(save_dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name == engine::kLatestFileName) {
      has_latest = true;
    } else if (const int64_t step = engine::CheckpointStepOfName(name); step >= 0) {
      newest = std::max(newest, step);
      ++checkpoints;
    }
  }
  if (ec) {
    return ErrnoToStatus(ec.value(),
                         fmt::format("--save-dir '{}': cannot list the directory", save_dir));
  }
  if (!has_latest && checkpoints == 0) return Status::Ok();
  const std::string head = fmt::format("--save-dir '{}' already holds a run", save_dir);
  const int64_t latest = has_latest ? LatestStep(save_dir) : -1;
  // `latest` counts only when the checkpoint it names is there (removed by hand, or by a
  // --keep-last of another run, it is not).
  const bool latest_there =
      latest >= 0 && std::filesystem::is_directory(
                         std::filesystem::path(save_dir) / fmt::format("step-{}", latest), ec);
  if (latest_there) {
    return AlreadyExistsError(fmt::format(
        "{} (latest: step-{}): resume it with --resume latest, or give another --save-dir", head,
        latest));
  }
  const std::string latest_state = latest >= 0
                                       ? fmt::format("a '{}' naming step-{}, which is not there",
                                                     engine::kLatestFileName, latest)
                                       : fmt::format("no readable '{}'", engine::kLatestFileName);
  if (checkpoints == 0) {
    return AlreadyExistsError(fmt::format(
        "{} ({}): remove it, or give another --save-dir", head,
        latest >= 0 ? latest_state
                    : fmt::format("a '{}' that names no checkpoint", engine::kLatestFileName)));
  }
  const std::string older =
      checkpoints > 1 ? fmt::format(" and {} older", checkpoints - 1) : std::string();
  return AlreadyExistsError(
      fmt::format("{} (step-{}{}, {}): resume it with --resume {}, or give another --save-dir",
                  head, newest, older, latest_state,
                  (std::filesystem::path(save_dir) / fmt::format("step-{}", newest)).string()));
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

Status CheckDirectory(std::string_view flag, const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return ErrnoToStatus(errno, fmt::format("{} '{}'", flag, path));
  }
  if (!S_ISDIR(st.st_mode)) {
    return InvalidArgumentError(fmt::format("{} '{}' is not a directory", flag, path));
  }
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

Status CheckNvmePathsHoldThePlan(const std::vector<std::string>& paths, const engine::Plan& plan) {
  if (paths.empty() || plan.nvme_bytes == 0) return Status::Ok();
  const io::SwapStoreOptions defaults;  // the engine's stripe unit
  std::vector<uint64_t> per_path(paths.size(), 0);
  for (uint64_t extent : plan.nvme_extent_bytes) {
    const std::vector<uint64_t> share =
        io::SwapStore::StripeShareBytes(extent, paths.size(), defaults.stripe_unit_bytes);
    for (size_t j = 0; j < paths.size(); ++j) per_path[j] += share[j];
  }
  struct FileSystem {
    dev_t device;
    std::vector<std::string> paths;
    uint64_t need_bytes = 0;
    uint64_t free_bytes = 0;
  };
  std::vector<FileSystem> systems;
  for (size_t j = 0; j < paths.size(); ++j) {
    struct stat st {};
    struct statvfs vfs {};
    if (::stat(paths[j].c_str(), &st) != 0 || ::statvfs(paths[j].c_str(), &vfs) != 0) {
      return ErrnoToStatus(errno, fmt::format("--nvme-path '{}'", paths[j]));
    }
    auto it = std::find_if(systems.begin(), systems.end(),
                           [&](const FileSystem& f) { return f.device == st.st_dev; });
    if (it == systems.end()) {
      systems.push_back(
          {st.st_dev,
           {},
           0,
           static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize)});
      it = systems.end() - 1;
    }
    it->paths.push_back(paths[j]);
    it->need_bytes += per_path[j];
  }
  for (const FileSystem& f : systems) {
    if (f.need_bytes <= f.free_bytes) continue;
    std::string names;
    for (const std::string& p : f.paths)
      names += fmt::format("{}'{}'", names.empty() ? "" : ", ", p);
    const std::string where = f.paths.size() == 1 ? "--nvme-path " + names
                                                  : "--nvme-path " + names + " (one file system)";
    const std::string what =
        paths.size() == 1
            ? fmt::format("the plan swaps {} there", FormatBytes(f.need_bytes))
            : fmt::format("{} of the {} the plan swaps, striped over {} paths, land there",
                          FormatBytes(f.need_bytes), FormatBytes(plan.nvme_bytes), paths.size());
    return ResourceExhaustedError(fmt::format(
        "{}: {}, but its file system has {} free ({} short): free space there{}", where, what,
        FormatBytes(f.free_bytes), FormatBytesUp(f.need_bytes - f.free_bytes),
        paths.size() == systems.size() ? " or add a --nvme-path on another drive" : ""));
  }
  return Status::Ok();
}

Status PrepareRunDestinations(const TrainFlags& flags, const engine::Plan& plan) {
  const std::string& save_dir = flags.checkpoint.save_dir;
  if (!save_dir.empty()) {
    STRATA_RETURN_IF_ERROR(MakeWritableDirectory("--save-dir", save_dir, S_IRWXU));
    // Rank 0 commits every checkpoint and writes `latest`: it decides alone, and the job ends
    // with its one line (the other ranks end when it aborts the job).
    if (flags.checkpoint.resume.empty() && plan.rank == 0) {
      STRATA_RETURN_IF_ERROR(CheckSaveDirHoldsNoRun(save_dir));
    }
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
    STRATA_RETURN_IF_ERROR(CheckNvmePathsHoldThePlan(
        flags.nvme_paths.empty() ? std::vector<std::string>{"."} : flags.nvme_paths, plan));
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
