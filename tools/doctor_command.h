// `strata doctor`: one screen on what this host offers for offloaded training. Every check is a
// line `<check>  <value>  <OK|WARN|FAIL>  <what to do>`:
//   kernel, io_uring (io::ProbeUring and its reason), memlock (RLIMIT_MEMLOCK), cpu (model),
//   cpu isa (base/cpu_info.h, and the cpu_optim kernel variant that will run), cores, numa,
//   memory, gpu (driver files and nvidia-smi only; no CUDA is linked), and per --path: path,
//   o_direct, free space, probe (through io::CreateIoBackend, in GB/s = 1e9 B/s: a first write
//   that lays the file out, an overwrite and a read, up to probe_seconds each; see below).
//
// The probe file is created in the path with O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600, and
// unlinked as soon as it is open, so nothing is left behind even if doctor is killed. It grows
// to at most 1 GiB and a quarter of the free space, in 32 MiB requests (1 MiB pieces, queue
// depth 32). "first" is the rate of writes that allocate blocks; "write" overwrites allocated
// blocks, as the swap store does after its first step; each write pass ends with fdatasync,
// inside its timing. Reads drop the page cache first (O_DIRECT, or fdatasync +
// POSIX_FADV_DONTNEED where O_DIRECT is refused) so they measure the drive.
//
// --json prints one object instead: {"strata_doctor": 1, "ok": bool, "checks": [{"name",
// "value", "verdict", "advice", ...raw numbers such as "free_bytes", "read_gb_per_s"}]}.
// Only checks of a --path can FAIL (missing or unwritable directory, failing I/O); then RunDoctor
// returns kFailedPrecondition naming them and the process exits 1. Everything else is OK or WARN.
//
// --machine-profile FILE measures instead, each part for about --profile-seconds, and writes a
// machine profile (engine/plan/machine_profile.h) that `strata estimate --machine` reads: the host
// (cores this process may use, memory, the CPU optimizer's params/s for adamw, adam, lion, sgd
// and adagrad at the engine's thread count: tools/machine_measure.h), NVMe (the probe above on
// the first --path / --nvme-path, else the temporary directory), and on a CUDA GPU the device
// (name, memory, bf16 rate, memory bandwidth) and PCIe both ways. Without a GPU the file has no
// "device" and no "pcie" section and stdout says so; a failing NVMe probe leaves "nvme" out
// and says why. Errors: the CPU measurement's and writing FILE's.
//
// Thread-safety: RunDoctor prints to stdout; one call at a time.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "base/status.h"

namespace strata::tools {

struct DoctorFlags {
  std::vector<std::string> paths;  // default: "."
  bool json = false;
  double probe_seconds = 1.0;  // per direction and path; 0 skips the probe
  // --machine-profile FILE: instead of the checks, measure this machine for the cost model and
  // write its profile (engine/plan/machine_profile.h) to FILE; see RunDoctor.
  std::string machine_profile;
  double profile_seconds = 2.0;  // per measurement (each CPU optimizer kind, GEMM, ...)
};

void AddDoctorFlags(CLI::App& cmd, DoctorFlags& f);

// Runs every check and prints the report (text or JSON) to stdout. OK unless a path check
// FAILs: kFailedPrecondition "doctor: N check(s) failed: ...".
Status RunDoctor(const DoctorFlags& f);

}  // namespace strata::tools
