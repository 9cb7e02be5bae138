// `strata train`'s destinations made ready before the work: every directory and file a run
// writes to later (checkpoints, swap files, the summary, the trace) is created or checked once,
// after the plan is made and before the engine allocates, so that a bad path fails in a second
// with a line naming its flag, not after the first checkpoint's hundred steps.
//
// The metrics destinations (--tensorboard-dir, --metrics-jsonl, --metrics-csv-dir) are opened
// even earlier, by MetricsWriter::Create (tools/metrics.h); this file does the rest.
//
// Thread-safety: plain functions; they touch the file system only.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"
#include "engine/plan/planner.h"
#include "tools/train_command.h"

namespace strata::tools {

// Creates `dir` and its missing parents (as `mkdir -p`: the parents with mode 0777, `dir` itself
// with `mode`, both less the umask), then checks that a file can be created in it (a temporary
// file, removed at once). `flag` names the option
// in every error. Errors: kInvalidArgument when `dir` exists and is not a directory; the
// ErrnoToStatus code of mkdir or of the file's creation (kPermissionDenied, kNotFound, ...),
// "FLAG 'DIR': cannot create the directory" / "cannot write into the directory".
Status MakeWritableDirectory(std::string_view flag, const std::string& dir, mode_t mode = 0777);

// An existing directory at `path`, which the command reads or writes in (it is not created).
// Errors name `flag`: ErrnoToStatus's code of stat ("FLAG 'PATH': ..."), kInvalidArgument "FLAG
// 'PATH' is not a directory". Thread-safe.
Status CheckDirectory(std::string_view flag, const std::string& path);

// A file the run writes at its end (replaced if it exists): an existing `path` must be a
// writable non-directory; otherwise its directory must exist (it is not created) and take a new
// file. Nothing is written at `path` itself. Errors: kNotFound for a missing directory,
// kInvalidArgument for a directory at `path`, and MakeWritableDirectory's.
Status CheckWritableFile(std::string_view flag, const std::string& path);

// The bytes of one checkpoint of `plan` (engine/checkpoint.h: fp32 master weights, the
// optimizer's state, the working params), before the manifest's few KiB.
uint64_t CheckpointBytes(const engine::Plan& plan);

// The swap store's bytes on each NVMe path (`paths`: existing directories, in --nvme-path order)
// against its file system's free space: the plan's extents (Plan::nvme_extent_bytes) striped
// over the paths as the swap store stripes them (io::SwapStore::StripeShareBytes, 1 MiB units:
// an extent smaller than one lands whole on the first path), the shares of paths on one file
// system summed. Errors: kResourceExhausted, one line naming the path(s), what the plan swaps
// there, the free space and the shortfall; ErrnoToStatus of stat/statvfs naming the path.
Status CheckNvmePathsHoldThePlan(const std::vector<std::string>& paths, const engine::Plan& plan);

// Everything `flags` (after TrainOptionsFromFlags: {rank} replaced, the outputs of ranks other
// than 0 cleared) will write to, checked before the engine is created:
//   --save-dir: MakeWritableDirectory (the directory itself 0700, as the checkpoint writer made
//     it); without --resume, on rank 0 (plan.rank: it commits every checkpoint and decides
//     alone, so that a job ends with its one line), it must hold no run: a `latest` or a step-N
//     entry is kAlreadyExists, "--save-dir 'DIR' already holds a run (latest: step-N): resume
//     it with --resume latest, or give another --save-dir" (the newest step-N named for
//     --resume when `latest` is missing or names none), since the new run would replace its
//     checkpoints, `latest` and DPO reference; leftovers of killed saves (.tmp-step-*,
//     .old-step-*) and other files are no run (a directory it cannot list: ErrnoToStatus,
//     "cannot list the directory"); and its file system has room for one checkpoint
//     (CheckpointBytes; kResourceExhausted naming both sizes otherwise);
//   --nvme-path (each; "." when none is given), when the plan keeps anything on NVMe:
//     MakeWritableDirectory, then CheckNvmePathsHoldThePlan;
//   --summary-json, --trace: CheckWritableFile (their directories are not created).
// Returns the first problem.
Status PrepareRunDestinations(const TrainFlags& flags, const engine::Plan& plan);

}  // namespace strata::tools
