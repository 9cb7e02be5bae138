#include "tools/doctor_command.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/utsname.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>

#include "base/aligned_buffer.h"
#include "base/cpu_info.h"
#include "base/unique_fd.h"
#include "base/units.h"
#include "cpu_optim/adamw.h"
#include "engine/plan/machine_profile.h"
#include "io/io_backend.h"
#include "tools/machine_measure.h"
#include "tools/pinned_bandwidth.h"
#include "tools/run_destinations.h"
#ifdef STRATA_HAVE_CUDA
#include "gpu/cuda/cuda_device.h"
#endif

namespace strata::tools {
namespace {

using json = nlohmann::json;

enum class Verdict { kOk, kWarn, kFail };

std::string_view VerdictName(Verdict v) {
  return v == Verdict::kOk ? "OK" : v == Verdict::kWarn ? "WARN" : "FAIL";
}

struct Check {
  std::string name;   // "kernel", "o_direct", ...
  std::string path;   // the --path for per-path checks, else ""
  std::string value;  // what was found, for people
  Verdict verdict = Verdict::kOk;
  std::string advice;         // what to do
  json raw = json::object();  // numbers for scripts
};

Check NewCheck(std::string name, std::string path = "") {
  Check c;
  c.name = std::move(name);
  c.path = std::move(path);
  return c;
}

std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Decimal GB for throughput and disk sizes that people compare with drive specs.
std::string Gbps(double bytes_per_second) {
  return fmt::format("{:.2f} GB/s", bytes_per_second / 1e9);
}

Check KernelCheck() {
  Check c = NewCheck("kernel");
  struct utsname u {};
  if (::uname(&u) != 0) {
    c.value = "unknown";
    c.verdict = Verdict::kWarn;
    c.advice = "uname failed; io_uring needs Linux >= 5.6";
    return c;
  }
  c.value = fmt::format("{} {} {}", u.sysname, u.release, u.machine);
  int major = 0, minor = 0;
  std::sscanf(u.release, "%d.%d", &major, &minor);
  c.raw = {{"release", u.release}, {"major", major}, {"minor", minor}};
  if (major < 5 || (major == 5 && minor < 6)) {
    c.verdict = Verdict::kWarn;
    c.advice = "io_uring reads/writes need Linux >= 5.6; the posix backend will be used";
  } else {
    c.advice = "recent enough for the io_uring backend";
  }
  return c;
}

Check UringCheck() {
  Check c = NewCheck("io_uring");
  const Status probe = io::ProbeUring();
  c.raw = {{"available", probe.ok()}};
  if (probe.ok()) {
    c.value = "available";
    c.advice = "the uring backend will be used (--io-backend auto)";
  } else {
    c.value = "unavailable: " + probe.message();
    c.raw["reason"] = probe.message();
    c.verdict = Verdict::kWarn;
    c.advice =
        "strata falls back to the posix backend; to allow io_uring: sysctl "
        "kernel.io_uring_disabled=0, or a container seccomp profile that permits io_uring_setup";
  }
  return c;
}

// CAP_IPC_LOCK (bit 14 of CapEff) lifts RLIMIT_MEMLOCK.
bool HasIpcLock() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      const uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
      return (caps >> 14) & 1;
    }
  }
  return false;
}

Check MemlockCheck() {
  Check c = NewCheck("memlock");
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) != 0) {
    c.value = "unknown";
    c.verdict = Verdict::kWarn;
    c.advice = "getrlimit(RLIMIT_MEMLOCK) failed";
    return c;
  }
  auto fmt_limit = [](rlim_t v) {
    return v == RLIM_INFINITY ? std::string("unlimited") : FormatBytes(v);
  };
  c.value = fmt::format("{} (hard {})", fmt_limit(rl.rlim_cur), fmt_limit(rl.rlim_max));
  c.raw = {{"soft_bytes", rl.rlim_cur == RLIM_INFINITY ? json() : json(rl.rlim_cur)},
           {"hard_bytes", rl.rlim_max == RLIM_INFINITY ? json() : json(rl.rlim_max)},
           {"cap_ipc_lock", HasIpcLock()}};
  if (rl.rlim_cur == RLIM_INFINITY) {
    c.advice = "io_uring may register all pinned buffers";
  } else if (HasIpcLock()) {
    c.advice = "limit does not apply: this process has CAP_IPC_LOCK";
  } else if (rl.rlim_cur >= 64 * kGiB) {
    c.advice = "large enough for io_uring registered buffers of a typical pinned arena";
  } else {
    c.verdict = Verdict::kWarn;
    c.advice =
        "io_uring registered (fixed) buffers count against it (CUDA pinned memory does not); "
        "raise: ulimit -l unlimited, limits.conf 'memlock unlimited', docker --ulimit memlock=-1";
  }
  return c;
}

void CpuChecks(std::vector<Check>* checks) {
  auto info = DetectCpuInfo();
  if (!info.ok()) {
    Check c = NewCheck("cpu");
    c.value = "unknown";
    c.verdict = Verdict::kWarn;
    c.advice = info.status().message();
    checks->push_back(std::move(c));
    return;
  }
  const CpuInfo& cpu = *info;
  {
    Check c = NewCheck("cpu");
    c.value = cpu.model.empty() ? cpu.vendor : fmt::format("{} ({})", cpu.model, cpu.vendor);
    c.raw = {{"model", cpu.model}, {"vendor", cpu.vendor}};
    c.advice = "runs the optimizer step: 14 B read + 14 B written per parameter";
    checks->push_back(std::move(c));
  }
  {
    Check c = NewCheck("cpu isa");
    const std::string kernel(cpu_optim::ActiveKernelName());
    c.value = fmt::format("{}; optimizer kernel {}", DescribeIsa(cpu.isa), kernel);
    c.raw = {{"kernel", kernel}};
    for (const auto& [flag, have] : CpuIsaFlags(cpu.isa)) c.raw[std::string(flag)] = have;
    if (kernel == "generic") {
      c.verdict = Verdict::kWarn;
      c.advice = "no AVX2: the CPU optimizer runs its portable kernel, expect a slower step";
    } else if (kernel == "avx2" && cpu.isa.avx512f) {
      c.advice = "AVX-512 present but the avx2 kernel was chosen (not all of F/BW/VL/DQ usable)";
    } else {
      c.advice = cpu.isa.avx512_bf16 ? "vectorized optimizer; native bf16 conversion available"
                                     : "vectorized optimizer kernel";
    }
    checks->push_back(std::move(c));
  }
  {
    Check c = NewCheck("cores");
    c.value = fmt::format("{} logical, {} physical, {} usable by this process", cpu.logical_cores,
                          cpu.physical_cores > 0 ? std::to_string(cpu.physical_cores) : "?",
                          cpu.affinity_cores);
    c.raw = {{"logical", cpu.logical_cores},
             {"physical", cpu.physical_cores},
             {"usable", cpu.affinity_cores}};
    if (cpu.affinity_cores < cpu.logical_cores) {
      c.verdict = Verdict::kWarn;
      c.advice = "CPU affinity (taskset/cgroup) hides cores from the optimizer; widen it";
    } else {
      c.advice = "the optimizer step uses all usable cores (oneTBB)";
    }
    checks->push_back(std::move(c));
  }
  {
    Check c = NewCheck("numa");
    c.value = fmt::format("{} node{}", cpu.numa_nodes, cpu.numa_nodes == 1 ? "" : "s");
    c.raw = {{"nodes", cpu.numa_nodes}};
    c.advice = cpu.numa_nodes == 1
                   ? "one memory node: nothing to bind"
                   : "bind to the GPU's node: numactl --cpunodebind=N --membind=N strata train ...";
    checks->push_back(std::move(c));
  }
  {
    Check c = NewCheck("memory");
    c.value = fmt::format("{} total, {} available", FormatBytes(cpu.mem_total_bytes),
                          FormatBytes(cpu.mem_available_bytes));
    c.raw = {{"total_bytes", cpu.mem_total_bytes}, {"available_bytes", cpu.mem_available_bytes}};
    // --offload-optimizer host --offload-params host: fp32 master weights and AdamW's m and v
    // (12 B/param), the pinned 16-bit working params (2 B) and the host gradients (2 B, fp32
    // for a tied embedding): about 16 B/param before the buckets (gpt2-1.5b plans 15.4).
    const double params_b = static_cast<double>(cpu.mem_available_bytes) / 16 / 1e9;
    c.advice = fmt::format(
        "--offload-optimizer host --offload-params host hold about 16 B/param (12 of master "
        "weights and AdamW state, 2 of working params, 2 of gradients): about {:.1f}B params "
        "fit; nvme beyond (strata estimate gives the exact need)",
        params_b);
    if (cpu.mem_available_bytes < 4 * kGiB) {
      c.verdict = Verdict::kWarn;
      c.advice = "under 4 GiB available: use --offload-optimizer nvme --offload-params nvme";
    }
    checks->push_back(std::move(c));
  }
}

Check GpuCheck() {
  Check c = NewCheck("gpu");
  const std::string version = ReadFirstLine("/proc/driver/nvidia/version");
  int devices = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev", ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 6 && n.compare(0, 6, "nvidia") == 0 &&
        n.find_first_not_of("0123456789", 6) == std::string::npos) {
      ++devices;
    }
  }
  std::string smi;
  if (!version.empty() || devices > 0) {
    // nvidia-smi only where it is installed; its absence is not an error.
    bool have_smi = false;
    if (const char* path = std::getenv("PATH")) {
      std::stringstream dirs(path);
      for (std::string dir; std::getline(dirs, dir, ':');) {
        if (!dir.empty() && ::access((dir + "/nvidia-smi").c_str(), X_OK) == 0) have_smi = true;
      }
    }
    if (have_smi) {
      if (FILE* p = ::popen(
              "nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null", "r")) {
        char buf[512];
        while (std::fgets(buf, sizeof buf, p)) {
          std::string line(buf);
          while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
          if (!line.empty()) smi += (smi.empty() ? "" : "; ") + line;
        }
        ::pclose(p);
      }
    }
  }
  std::string driver;
  if (const auto pos = version.find("Kernel Module"); pos != std::string::npos) {
    std::istringstream rest(version.substr(pos + 13));
    rest >> driver;
  }
  c.raw = {{"devices", devices}, {"driver", driver}, {"nvidia_smi", smi}};
  if (version.empty() && devices == 0) {
    c.value = "none found";
    c.advice = "no NVIDIA driver: training runs on the host device (CPU emulation of a GPU)";
    return c;
  }
  c.value = fmt::format("{} /dev/nvidiaN device{}, driver {}{}", devices, devices == 1 ? "" : "s",
                        driver.empty() ? "?" : driver, smi.empty() ? "" : "; " + smi);
#ifdef STRATA_HAVE_CUDA
  const StatusOr<int> cuda = gpu::CudaDeviceCount();
  c.raw["cuda_runtime_devices"] = cuda.ok() ? *cuda : -1;
  c.advice = !cuda.ok()   ? "the CUDA runtime failed: " + cuda.status().message()
             : *cuda == 0 ? "the CUDA runtime sees no GPU: training runs on the host device"
                          : fmt::format("CUDA backend built; the CUDA runtime sees {} GPU{}", *cuda,
                                        *cuda == 1 ? "" : "s");
#else
  c.advice =
      "this build has no CUDA backend (no nvcc at build time): training runs on the host "
      "device";
#endif
  return c;
}

// Pinned host <-> GPU copy bandwidth (tools/pinned_bandwidth.h) of GPU 0, when this build has
// the CUDA backend and the runtime sees a GPU; nullopt otherwise (the gpu check says why).
std::optional<Check> PinnedBandwidthCheck() {
#ifdef STRATA_HAVE_CUDA
  const StatusOr<int> n = gpu::CudaDeviceCount();
  if (!n.ok() || *n == 0) return std::nullopt;
  Check c = NewCheck("pinned bandwidth");
  constexpr size_t kBytes = size_t{256} << 20;
  constexpr int kRepetitions = 5;
  gpu::CudaDeviceOptions o;
  o.pinned_budget_bytes = 2 * kBytes;
  StatusOr<PinnedBandwidth> bw = Status::Ok();
  if (auto device = gpu::CreateCudaDevice(o); !device.ok()) {
    bw = device.status();
  } else {
    bw = MeasurePinnedBandwidth(**device, kBytes, kRepetitions);
  }
  if (!bw.ok()) {
    c.verdict = Verdict::kFail;
    c.value = "could not be measured";
    c.advice = bw.status().message();
    return c;
  }
  c.value = fmt::format("H2D {}, D2H {}, both directions {} ({} pinned, median of {})",
                        Gbps(bw->h2d_bytes_per_second), Gbps(bw->d2h_bytes_per_second),
                        Gbps(bw->both_bytes_per_second), FormatBytes(kBytes), kRepetitions);
  c.raw = {{"h2d_bytes_per_second", bw->h2d_bytes_per_second},
           {"d2h_bytes_per_second", bw->d2h_bytes_per_second},
           {"both_bytes_per_second", bw->both_bytes_per_second},
           {"size_bytes", kBytes}};
  // A PCIe Gen3 x16 link moves ~12 GB/s each way, Gen4 ~25, Gen5 ~50.
  if (std::min(bw->h2d_bytes_per_second, bw->d2h_bytes_per_second) < 10e9) {
    c.verdict = Verdict::kWarn;
    c.advice =
        "below a PCIe Gen3 x16 link: streamed params and gradients will wait on the bus; check "
        "the link width and generation (nvidia-smi -q -d PCIE) and that the GPU sits in a CPU-"
        "attached x16 slot";
  } else {
    c.advice = "the rate the engine's prefetch and gradient streaming can count on";
  }
  return c;
#else
  return std::nullopt;
#endif
}

std::string FsTypeName(long type) {
  switch (static_cast<unsigned long>(type)) {
    case 0xEF53:
      return "ext2/3/4";
    case 0x58465342:
      return "xfs";
    case 0x9123683E:
      return "btrfs";
    case 0x01021994:
      return "tmpfs";
    case 0x794C7630:
      return "overlayfs";
    case 0x6969:
      return "nfs";
    case 0x2FC12FC1:
      return "zfs";
    case 0xF2F52010:
      return "f2fs";
    case 0x65735546:
      return "fuse";
    default:
      return fmt::format("fs 0x{:x}", static_cast<unsigned long>(type));
  }
}

// One probe call: 32 pieces of the backend's default 1 MiB block size, all in flight.
constexpr size_t kProbeRequestBytes = 32 << 20;

struct ProbeResult {
  double first_write_bytes_per_s = 0;  // into newly allocated blocks
  double write_bytes_per_s = 0;        // overwriting them, as swap does from step 2 on
  double read_bytes_per_s = 0;
  uint64_t write_bytes = 0;
  uint64_t read_bytes = 0;
  uint64_t file_bytes = 0;  // what the first pass laid out
};

// Three timed passes of up to `seconds` each, every write pass ending in fdatasync inside its
// timing: (1) lay the file out sequentially up to max_file_bytes (first writes allocate blocks,
// which is slower on most filesystems), (2) overwrite it, wrapping around, (3) read it back after
// dropping the page cache, wrapping around; the last chunk read is compared with what was
// written. The fd's file is already unlinked.
StatusOr<ProbeResult> Probe(io::IoBackend& io, int fd, bool direct, uint64_t max_file_bytes,
                            double seconds, const std::string& what) {
  constexpr size_t kChunk = kProbeRequestBytes;
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer src, AlignedBuffer::Allocate(kChunk));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer dst, AlignedBuffer::Allocate(kChunk));
  std::mt19937_64 rng(0x5eed);
  for (size_t i = 0; i < kChunk / 8; ++i) src.as<uint64_t>()[i] = rng();  // incompressible
  ProbeResult r;
  using Clock = std::chrono::steady_clock;
  const auto budget = std::chrono::duration<double>(seconds);
  const auto since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };

  auto t0 = Clock::now();
  do {
    STRATA_RETURN_IF_ERROR(io.Write(fd, r.file_bytes, src.span(), what));
    r.file_bytes += kChunk;
  } while (r.file_bytes < max_file_bytes && Clock::now() - t0 < budget);
  if (::fdatasync(fd) != 0) return ErrnoToStatus(errno, "fdatasync " + what);
  r.first_write_bytes_per_s = r.file_bytes / since(t0);

  uint64_t offset = 0;
  t0 = Clock::now();
  do {
    STRATA_RETURN_IF_ERROR(io.Write(fd, offset, src.span(), what));
    r.write_bytes += kChunk;
    offset = (offset + kChunk) % r.file_bytes;
  } while (Clock::now() - t0 < budget);
  if (::fdatasync(fd) != 0) return ErrnoToStatus(errno, "fdatasync " + what);
  r.write_bytes_per_s = r.write_bytes / since(t0);
  if (!direct) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);

  offset = 0;
  t0 = Clock::now();
  do {
    STRATA_RETURN_IF_ERROR(io.Read(fd, offset, dst.span(), what));
    r.read_bytes += kChunk;
    offset = (offset + kChunk) % r.file_bytes;
  } while (Clock::now() - t0 < budget);
  r.read_bytes_per_s = r.read_bytes / since(t0);
  if (std::memcmp(src.data(), dst.data(), kChunk) != 0) {
    return DataLossError(fmt::format("{}: data read back differs from what was written", what));
  }
  return r;
}

// The directory: exists, is writable, and its file system. The file system's name, or nullopt
// (after a failed check) when the path cannot hold swap files.
std::optional<std::string> DirectoryCheck(const std::string& path, std::vector<Check>* checks) {
  Check where = NewCheck("path", path);
  struct stat st {};
  const bool exists = ::stat(path.c_str(), &st) == 0;
  if (!exists || !S_ISDIR(st.st_mode)) {
    where.value = !exists ? std::string(std::strerror(errno)) : "not a directory";
    where.verdict = Verdict::kFail;
    where.advice = "give an existing directory on the drive for swap files (--nvme-path)";
    checks->push_back(std::move(where));
    return std::nullopt;
  }
  if (::access(path.c_str(), W_OK | X_OK) != 0) {
    // A read-only file system refuses every user alike: its owner and mode are not the cause.
    const bool read_only = errno == EROFS;
    where.value = read_only ? "on a read-only file system" : "not writable by this user";
    where.verdict = Verdict::kFail;
    where.advice = read_only ? "remount it read-write or pick another --path"
                             : "chown/chmod the directory or pick another --path";
    checks->push_back(std::move(where));
    return std::nullopt;
  }
  struct statfs sfs {};
  const std::string fs = ::statfs(path.c_str(), &sfs) == 0 ? FsTypeName(sfs.f_type) : "unknown fs";
  where.value = fmt::format("writable directory on {}", fs);
  where.raw = {{"fs", fs}};
  where.advice = "swap files go into a private 0700 subdirectory, removed at exit";
  if (fs == "tmpfs") {
    where.verdict = Verdict::kWarn;
    where.advice = "tmpfs is RAM, not a drive: swap here takes host memory; use an NVMe path";
  }
  checks->push_back(std::move(where));
  return fs;
}

// Free space, in bytes (0 when statvfs fails).
uint64_t FreeSpaceCheck(const std::string& path, std::vector<Check>* checks) {
  Check space = NewCheck("free space", path);
  struct statvfs vfs {};
  uint64_t free_bytes = 0;
  if (::statvfs(path.c_str(), &vfs) == 0) {
    free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    const uint64_t total_bytes = static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize;
    space.value = fmt::format("{} free of {}", FormatBytes(free_bytes), FormatBytes(total_bytes));
    space.raw = {{"free_bytes", free_bytes}, {"total_bytes", total_bytes}};
    // nvme optimizer state (p32, m, v: 12 B) plus nvme params (p16: 2 B).
    space.advice =
        fmt::format("holds optimizer state + params of about {:.1f}B params (14 B/param)",
                    static_cast<double>(free_bytes) / 14 / 1e9);
    if (free_bytes < 14 * 1000000000ull) {
      space.verdict = Verdict::kWarn;
      space.advice = "under 14 GB free: not enough for a 1B-parameter model's state; free space";
    }
  } else {
    space.value = std::strerror(errno);
    space.verdict = Verdict::kWarn;
    space.advice = "statvfs failed; the planner cannot check the space before laying out swap";
  }
  checks->push_back(std::move(space));
  return free_bytes;
}

// The probe file, open, already unlinked; direct: opened with O_DIRECT.
struct ProbeFile {
  UniqueFd fd;
  bool direct = false;
};

// O_DIRECT: create the probe file with it; a filesystem that refuses it gets a buffered file.
// nullopt (after a failed check) when no file can be created.
std::optional<ProbeFile> DirectIoCheck(const std::string& path, const std::string& fs,
                                       std::vector<Check>* checks) {
  Check direct = NewCheck("o_direct", path);
  std::random_device rd;
  const std::string file = fmt::format("{}/.strata-doctor-{}-{:08x}", path, ::getpid(), rd());
  const int base_flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW;
  UniqueFd fd(::open(file.c_str(), base_flags | O_DIRECT, 0600));
  bool is_direct = fd.valid();
  int open_errno = is_direct ? 0 : errno;
  if (is_direct) {
    // Some filesystems accept the flag at open and refuse the I/O: try one aligned write.
    auto block = AlignedBuffer::Allocate(4096);
    if (block.ok() && ::pwrite(fd.get(), block->data(), 4096, 0) != 4096) {
      open_errno = errno;
      is_direct = false;
      ::unlink(file.c_str());
      fd.reset();
    }
  }
  const int direct_errno = open_errno;  // why O_DIRECT was refused
  if (!is_direct && (open_errno == EINVAL || open_errno == EOPNOTSUPP)) {
    fd.reset(::open(file.c_str(), base_flags, 0600));
    if (!fd.valid()) open_errno = errno;
  }
  if (!fd.valid()) {
    direct.value = fmt::format("cannot create a file: {}", std::strerror(open_errno));
    direct.verdict = Verdict::kFail;
    direct.advice = "check permissions and quota of the directory";
    checks->push_back(std::move(direct));
    return std::nullopt;
  }
  ::unlink(file.c_str());  // removed now; the open fd keeps it until closed
  direct.raw = {{"supported", is_direct}};
  if (is_direct) {
    direct.value = "supported";
    direct.advice = "swap I/O bypasses the page cache";
  } else {
    direct.value = fmt::format("refused by {} ({})", fs, std::strerror(direct_errno));
    direct.verdict = Verdict::kWarn;
    direct.advice = "buffered I/O fallback (page cache, extra copies); use ext4/xfs on NVMe";
  }
  checks->push_back(std::move(direct));
  return ProbeFile{std::move(fd), is_direct};
}

// The drive's write and read speed through `io`, on the probe file.
void ProbeCheck(const std::string& path, io::IoBackend* io, double seconds, uint64_t free_bytes,
                const ProbeFile& file, std::vector<Check>* checks) {
  Check probe = NewCheck("probe", path);
  if (seconds <= 0) {
    probe.value = "skipped (--probe-seconds 0)";
    probe.advice = "";
    checks->push_back(std::move(probe));
    return;
  }
  if (io == nullptr) {
    probe.value = "no I/O backend";
    probe.verdict = Verdict::kFail;
    probe.advice = "see the io_uring line; the posix backend could not be created either";
    checks->push_back(std::move(probe));
    return;
  }
  const uint64_t file_bytes = std::min<uint64_t>(kGiB, free_bytes / 4) / (32 << 20) * (32 << 20);
  if (file_bytes == 0) {
    probe.value = "skipped: under 128 MiB free";
    probe.verdict = Verdict::kWarn;
    probe.advice = "free some space to measure the drive";
    checks->push_back(std::move(probe));
    return;
  }
  auto r =
      Probe(*io, file.fd.get(), file.direct, file_bytes, seconds, "doctor probe file in " + path);
  if (!r.ok()) {
    probe.value = r.status().ToString();
    probe.verdict = Verdict::kFail;
    probe.advice = "I/O on this path fails: check the drive (dmesg) and the filesystem";
    checks->push_back(std::move(probe));
    return;
  }
  probe.value = fmt::format("write {} (first {}), read {} ({}, {} file)",
                            Gbps(r->write_bytes_per_s), Gbps(r->first_write_bytes_per_s),
                            Gbps(r->read_bytes_per_s), io->name(), FormatBytes(r->file_bytes));
  probe.raw = {{"write_gb_per_s", r->write_bytes_per_s / 1e9},
               {"first_write_gb_per_s", r->first_write_bytes_per_s / 1e9},
               {"read_gb_per_s", r->read_bytes_per_s / 1e9},
               {"write_bytes", r->write_bytes},
               {"read_bytes", r->read_bytes},
               {"file_bytes", r->file_bytes},
               {"request_bytes", kProbeRequestBytes},
               {"backend", std::string(io->name())},
               {"direct", file.direct}};
  const double slower = std::min(r->write_bytes_per_s, r->read_bytes_per_s);
  if (!file.direct) {
    probe.verdict = Verdict::kWarn;
    probe.advice = "buffered: figures include the page cache; 'strata iobench' for the drive";
  } else if (slower < 1e9) {
    probe.verdict = Verdict::kWarn;
    probe.advice = "under 1 GB/s (NVMe gives 2-7 GB/s); stripe drives with one --nvme-path each";
  } else {
    probe.advice = "'strata iobench --sweep' tunes block size and queue depth";
  }
  checks->push_back(std::move(probe));
}

void PathChecks(const std::string& path, io::IoBackend* io, double seconds,
                std::vector<Check>* checks) {
  const std::optional<std::string> fs = DirectoryCheck(path, checks);
  if (!fs) return;
  const uint64_t free_bytes = FreeSpaceCheck(path, checks);
  const std::optional<ProbeFile> file = DirectIoCheck(path, *fs, checks);
  if (!file) return;
  ProbeCheck(path, io, seconds, free_bytes, *file, checks);
}

void PrintText(const std::vector<Check>& checks) {
  std::vector<std::string> names;
  size_t name_w = 0, value_w = 0;
  for (const auto& c : checks) {
    names.push_back(c.path.empty() ? c.name : fmt::format("{} {}", c.name, c.path));
    name_w = std::max(name_w, names.back().size());
    value_w = std::max(value_w, c.value.size());
  }
  value_w = std::min<size_t>(value_w, 60);
  std::printf("strata doctor: what this host offers for offloaded training\n");
  for (size_t i = 0; i < checks.size(); ++i) {
    const auto& c = checks[i];
    std::printf("%s\n", fmt::format("{:<{}}  {:<{}}  {:<4}  {}", names[i], name_w, c.value, value_w,
                                    VerdictName(c.verdict), c.advice)
                            .c_str());
  }
}

// Parameters each CPU optimizer pass updates while measuring: 16 Mi (256 MiB with state,
// gradient and copy-out), far beyond the caches, as a block of a large model is.
constexpr int64_t kProfileParams = int64_t{16} << 20;

// --machine-profile: measure, print what was measured, write the file.
Status RunMachineProfile(const DoctorFlags& f) {
  // Before a minute of measurements, not after.
  STRATA_RETURN_IF_ERROR(CheckWritableFile("--machine-profile", f.machine_profile));
  // A --path that is no directory would leave the profile without its NVMe section, quietly.
  if (!f.paths.empty()) STRATA_RETURN_IF_ERROR(CheckDirectory("--path", f.paths.front()));
  engine::MachineProfile profile;
  STRATA_ASSIGN_OR_RETURN(CpuInfo cpu, DetectCpuInfo());
  engine::MachineProfile::Host host;
  host.cores = cpu.affinity_cores > 0 ? cpu.affinity_cores : cpu.logical_cores;
  host.memory_GiB = static_cast<double>(cpu.mem_total_bytes) / static_cast<double>(kGiB);
  STRATA_ASSIGN_OR_RETURN(host.optimizer_params_per_s,
                          MeasureCpuOptimizers(f.profile_seconds, kProfileParams));
  for (const auto& [kind, rate] : host.optimizer_params_per_s) {
    std::printf("cpu optimizer  %-8s %.3g params/s (%d cores)\n", kind.c_str(), rate, host.cores);
  }
  profile.host = host;

  const std::string path =
      f.paths.empty() ? std::filesystem::temp_directory_path().string() : f.paths.front();
  io::IoBackendOptions io_options;
  auto io = io::CreateIoBackend(io_options);
  std::vector<Check> checks;
  PathChecks(path, io.ok() ? io->get() : nullptr, f.profile_seconds, &checks);
  const Check* probe = nullptr;
  for (const Check& c : checks) {
    if (c.name == "probe" && c.raw.contains("read_gb_per_s")) probe = &c;
  }
  if (probe) {
    profile.nvme = engine::MachineProfile::Nvme{probe->raw["read_gb_per_s"].get<double>(),
                                                probe->raw["write_gb_per_s"].get<double>()};
    std::printf("nvme           read %.2f GB/s, write %.2f GB/s in %s%s\n", profile.nvme->read_GBps,
                profile.nvme->write_GBps, path.c_str(),
                probe->raw["direct"].get<bool>() ? "" : " (buffered: includes the page cache)");
  } else {
    std::string why = "the probe did not run";
    for (const Check& c : checks) {
      if (c.verdict != Verdict::kOk) why = c.name + ": " + c.value;
    }
    std::printf("nvme           not measured in %s (%s): no \"nvme\" section\n", path.c_str(),
                why.c_str());
  }

  const GpuMeasurement gpu = MeasureGpu(f.profile_seconds);
  profile.device = gpu.device;
  profile.pcie = gpu.pcie;
  if (profile.device) {
    // Not measured: the datasheet's dense peak, for MFU; left out for a device the table lacks.
    profile.device->peak_bf16_TFLOPs = engine::DatasheetPeakBf16Tflops(profile.device->name);
    std::printf("device         %s, %.1f GiB, bf16 %.0f model TFLOP/s, memory %.0f GB/s\n",
                gpu.device->name.c_str(), gpu.device->memory_GiB, gpu.device->bf16_TFLOPs,
                gpu.device->memory_GBps);
    if (profile.device->peak_bf16_TFLOPs > 0) {
      std::printf(
          "device peak    bf16 %.0f TFLOP/s dense (datasheet, by name; MFU is against it)\n",
          profile.device->peak_bf16_TFLOPs);
    } else {
      std::printf(
          "device peak    not known for '%s': no \"peak_bf16_TFLOPs\", so no MFU (add the "
          "datasheet's dense bf16 TFLOP/s to the file by hand)\n",
          profile.device->name.c_str());
    }
    std::printf("pcie           H2D %.1f GB/s, D2H %.1f GB/s\n", gpu.pcie->h2d_GBps,
                gpu.pcie->d2h_GBps);
  } else {
    std::printf("device         none (%s): no \"device\" and no \"pcie\" section\n",
                gpu.why_not.c_str());
  }
  STRATA_RETURN_IF_ERROR(engine::WriteMachineProfile(profile, f.machine_profile));
  std::printf("wrote %s\n", f.machine_profile.c_str());
  std::fflush(stdout);
  return Status::Ok();
}

}  // namespace

void AddDoctorFlags(CLI::App& cmd, DoctorFlags& f) {
  cmd.add_option("--path,--nvme-path", f.paths,
                 "Directory to check for swap files: O_DIRECT, free space and a read/write probe "
                 "(repeat for several drives). Default: .");
  cmd.add_flag("--json", f.json, "Print one JSON object instead of the table");
  cmd.add_option("--probe-seconds", f.probe_seconds,
                 "Seconds of writing, then of reading, per path (0 = no probe)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 60.0));
  cmd.add_option("--machine-profile", f.machine_profile,
                 "Measure this machine (CPU optimizer per kind, NVMe on the first --path or the "
                 "temporary directory, and a CUDA GPU's bf16 rate, memory bandwidth and PCIe) "
                 "and write its profile for `strata estimate --machine FILE`");
  cmd.add_option("--profile-seconds", f.profile_seconds,
                 "With --machine-profile: seconds per measurement")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 60.0));
}

Status RunDoctor(const DoctorFlags& f) {
  if (!f.machine_profile.empty()) return RunMachineProfile(f);
  std::vector<Check> checks;
  checks.push_back(KernelCheck());
  checks.push_back(UringCheck());
  checks.push_back(MemlockCheck());
  CpuChecks(&checks);
  checks.push_back(GpuCheck());
  if (auto bw = PinnedBandwidthCheck()) checks.push_back(std::move(*bw));

  io::IoBackendOptions io_options;  // kAuto: uring where the probe allows it, else posix
  auto io = io::CreateIoBackend(io_options);
  const std::vector<std::string> paths = f.paths.empty() ? std::vector<std::string>{"."} : f.paths;
  for (const auto& path : paths) {
    PathChecks(path, io.ok() ? io->get() : nullptr, f.probe_seconds, &checks);
  }

  std::vector<std::string> failed;
  for (const auto& c : checks) {
    if (c.verdict == Verdict::kFail) failed.push_back(fmt::format("{} {}", c.name, c.path));
  }
  if (f.json) {
    // Fixed fields first, then the check's raw numbers, for people reading the JSON.
    nlohmann::ordered_json out = {
        {"strata_doctor", 1}, {"ok", failed.empty()}, {"checks", nlohmann::ordered_json::array()}};
    for (const auto& c : checks) {
      nlohmann::ordered_json j = {{"name", c.name}};
      if (!c.path.empty()) j["path"] = c.path;
      j["value"] = c.value;
      j["verdict"] = VerdictName(c.verdict);
      j["advice"] = c.advice;
      for (const auto& [key, value] : c.raw.items()) j[key] = value;
      out["checks"].push_back(std::move(j));
    }
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    PrintText(checks);
  }
  std::fflush(stdout);
  if (!failed.empty()) {
    return FailedPreconditionError(
        fmt::format("doctor: {} check(s) failed: {}", failed.size(), fmt::join(failed, ", ")));
  }
  return Status::Ok();
}

}  // namespace strata::tools
