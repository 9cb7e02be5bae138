#include "tools/iobench_command.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "base/file.h"
#include "base/logging.h"
#include "base/unique_fd.h"
#include "base/units.h"
#include "io/io_backend.h"
#include "tools/checkpoint_commands.h"
#include "tools/run_destinations.h"

namespace strata::tools {
namespace {

using io::IoBackend;

constexpr uint64_t kAlign = 4096;

struct RunConfig {
  std::vector<std::string> paths;
  uint64_t size_bytes = 0;
  uint64_t block_bytes = 0;
  int queue_depth = 0;
  std::string rw;
  std::string backend;
  int threads = 1;
  double runtime_s = 0;
  int loops = 1;
  bool first_write = false;
};

struct RunResult {
  RunConfig config;
  uint64_t bytes = 0;
  double seconds = 0;
  double cpu_s = 0;
  double lat_mean_us = 0;
  double lat_p99_us = 0;
  bool direct = true;
  uint64_t submissions = 0;
  uint64_t fixed_buffer_submissions = 0;
  uint64_t short_resubmits = 0;
  uint64_t eagain_retries = 0;
  uint64_t unit_bytes_per_call = 0;  // bytes per backend call: the queue drains once per call
  double gb_per_s() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
  double gib_per_s() const { return seconds > 0 ? bytes / seconds / kGiB : 0; }
  double iops() const { return seconds > 0 ? (bytes / config.block_bytes) / seconds : 0; }
  double cpu_s_per_gb() const { return bytes > 0 ? cpu_s / (bytes / 1e9) : 0; }
};

// One benchmark file per directory: "<dir>/strata-iobench.<i>". A file that already exists (a
// regular file, not a link) is reused and left in place; one made here is removed afterwards.
struct BenchFile {
  std::string path;
  UniqueFd fd;
  bool created = false;
  bool direct = true;
  uint64_t size_bytes = 0;  // this file's share
};

// I/O buffers on transparent huge pages where the kernel allows it (MADV_HUGEPAGE): physically
// contiguous 2 MiB pages keep a 1 MiB request within the device's segment limit (virtio-blk
// allows 254 segments: 4 KiB pages would split every 1 MiB request in two). As fio's buffers
// often are; otherwise plain pages. Owned, unmapped at destruction.
class IoBuffer {
 public:
  static StatusOr<IoBuffer> Allocate(size_t size_bytes) {
    constexpr size_t kHuge = 2 * kMiB;
    const size_t map_bytes = AlignUp(size_bytes, kHuge) + kHuge;
    void* p =
        ::mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return ErrnoToStatus(
          errno, fmt::format("iobench: mmap of {} for I/O buffers", FormatBytes(map_bytes)));
    }
    IoBuffer b;
    b.map_ = p;
    b.map_bytes_ = map_bytes;
    b.data_ = reinterpret_cast<std::byte*>(AlignUp(reinterpret_cast<uintptr_t>(p), kHuge));
    b.size_bytes_ = size_bytes;
    ::madvise(b.data_, AlignUp(size_bytes, kHuge), MADV_HUGEPAGE);  // advisory
    for (size_t i = 0; i < size_bytes; i += kAlign) b.data_[i] = std::byte{0x5a};
    return b;
  }
  IoBuffer(IoBuffer&& o) noexcept { *this = std::move(o); }
  IoBuffer& operator=(IoBuffer&& o) noexcept {
    std::swap(map_, o.map_);
    std::swap(map_bytes_, o.map_bytes_);
    std::swap(data_, o.data_);
    std::swap(size_bytes_, o.size_bytes_);
    return *this;
  }
  ~IoBuffer() {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
  }
  std::span<std::byte> span() const { return {data_, size_bytes_}; }

 private:
  IoBuffer() = default;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::byte* data_ = nullptr;
  size_t size_bytes_ = 0;
};

double CpuSeconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  auto sec = [](const timeval& tv) { return tv.tv_sec + tv.tv_usec / 1e6; };
  return sec(ru.ru_utime) + sec(ru.ru_stime);
}

Status OpenFiles(const RunConfig& c, std::vector<BenchFile>* files) {
  const uint64_t units = c.size_bytes / c.block_bytes;
  const uint64_t n = c.paths.size();
  for (uint64_t i = 0; i < n; ++i) {
    const std::string& dir = c.paths[i];
    STRATA_RETURN_IF_ERROR(CheckDirectory("--path", dir));
    const std::string path = fmt::format("{}/strata-iobench.{}", dir, i);
    const uint64_t size_bytes = (units / n + (i < units % n ? 1 : 0)) * c.block_bytes;
    // The file must fit the drive's free space (what an earlier run left in place counts as
    // free): filling the drive first and failing then would take the space from everything
    // else on it for the length of the run.
    struct statvfs sv;
    if (::statvfs(dir.c_str(), &sv) == 0) {
      uint64_t free_bytes = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
      struct stat existing;
      if (::stat(path.c_str(), &existing) == 0 && S_ISREG(existing.st_mode)) {
        free_bytes += static_cast<uint64_t>(existing.st_blocks) * 512;
      }
      if (size_bytes > free_bytes) {
        return ResourceExhaustedError(fmt::format(
            "--path '{}' has {} free, less than the {} its file '{}' would take: give a smaller "
            "--size (or more --path directories on other drives)",
            dir, FormatBytes(free_bytes), FormatBytes(size_bytes), path));
      }
    }
    BenchFile& f = files->emplace_back();
    f.path = path;
    f.size_bytes = size_bytes;
    const int base = O_RDWR | O_NOFOLLOW | O_CLOEXEC;
    int fd = ::open(f.path.c_str(), base | O_CREAT | O_EXCL | O_DIRECT, 0600);
    f.created = fd >= 0;
    const bool existed = fd < 0 && errno == EEXIST;  // reused and kept, whatever follows
    if (existed) fd = ::open(f.path.c_str(), base | O_DIRECT);
    if (fd < 0 && errno == EINVAL) {  // the file system refuses O_DIRECT (tmpfs)
      fd = ::open(f.path.c_str(), base | O_CREAT, 0600);
      f.created = !existed;
      f.direct = false;
    }
    if (fd < 0) {
      return ErrnoToStatus(errno, fmt::format("--path '{}': cannot open '{}' for reading and "
                                              "writing",
                                              dir, f.path));
    }
    f.fd.reset(fd);
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      return InvalidArgumentError(fmt::format("'{}' exists and is not a regular file", f.path));
    }
    if (!f.direct) {
      STRATA_LOG_WARNING(
          "iobench: the file system of '{}' refuses O_DIRECT; using buffered I/O and dropping "
          "the page cache (posix_fadvise DONTNEED) before each pass",
          dir);
    }
  }
  return Status::Ok();
}

// --first-write: gives the file's blocks back and allocates them again with fallocate, as the swap
// store preallocates its extents, so that the next pass writes into allocated but unwritten
// extents (the swap store's first write of each extent). Errors: kFailedPrecondition when the
// file system cannot (EOPNOTSUPP), else through ErrnoToStatus, naming the file.
Status FreshlyAllocate(const BenchFile& f) {
  const auto len = static_cast<off_t>(f.size_bytes);
  if (::fdatasync(f.fd.get()) != 0) return ErrnoToStatus(errno, "fdatasync '" + f.path + "'");
  if (::fallocate(f.fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, len) != 0 ||
      ::fallocate(f.fd.get(), 0, 0, len) != 0) {
    if (errno == EOPNOTSUPP) {
      return FailedPreconditionError(fmt::format(
          "--first-write: the file system of '{}' cannot punch holes and preallocate", f.path));
    }
    return ErrnoToStatus(errno, fmt::format("--first-write: fallocate of '{}'", f.path));
  }
  return Status::Ok();
}

void DropCache(const std::vector<BenchFile>& files) {
  for (const BenchFile& f : files) {
    if (!f.direct) {
      ::fdatasync(f.fd.get());
      ::posix_fadvise(f.fd.get(), 0, 0, POSIX_FADV_DONTNEED);
    }
  }
}

// Blocks per backend call. Within a call the backend keeps queue_depth blocks in flight, as fio
// keeps its queue full; at the end of each call the queue drains (the last blocks complete with
// fewer and fewer in flight), which costs about half a queue's worth of time per call. So a pass
// of --loops is one call (up to kMaxUnitsPerCall blocks, a drain per 64 Ki blocks); --runtime needs
// the stop flag checked now and then: a call per 256 MiB (at least 16 x queue depth blocks).
constexpr size_t kMaxUnitsPerCall = size_t{1} << 16;
size_t UnitsPerCall(const RunConfig& c) {
  if (c.runtime_s <= 0) return kMaxUnitsPerCall;
  return std::max<size_t>(16 * static_cast<size_t>(c.queue_depth),
                          static_cast<size_t>(256 * kMiB / c.block_bytes));
}

// Moves `units` (indices of block-sized stripe units) in calls of UnitsPerCall(c) blocks.
// Buffers: queue_depth blocks per thread, reused round-robin (contents are not checked).
Status RunUnits(IoBackend& backend, const RunConfig& c, const std::vector<BenchFile>& files,
                bool write, std::span<const uint64_t> units, std::span<std::byte> buffers,
                const std::atomic<bool>& stop, std::atomic<uint64_t>& done_bytes) {
  const uint64_t n = files.size();
  const size_t depth = static_cast<size_t>(c.queue_depth);
  const size_t batch_units = UnitsPerCall(c);
  std::vector<io::ReadSegment> reads;
  std::vector<io::WriteSegment> writes;
  for (size_t first = 0; first < units.size() && !stop.load(std::memory_order_relaxed);
       first += batch_units) {
    const size_t count = std::min(batch_units, units.size() - first);
    reads.clear();
    writes.clear();
    for (size_t i = 0; i < count; ++i) {
      const uint64_t k = units[first + i];
      const BenchFile& f = files[k % n];
      const uint64_t offset = (k / n) * c.block_bytes;
      std::span<std::byte> buf = buffers.subspan((i % depth) * c.block_bytes, c.block_bytes);
      if (write) {
        writes.push_back({f.fd.get(), offset, buf, f.path});
      } else {
        reads.push_back({f.fd.get(), offset, buf, f.path});
      }
    }
    STRATA_RETURN_IF_ERROR(write ? backend.WriteBatch(writes) : backend.ReadBatch(reads));
    done_bytes.fetch_add(count * c.block_bytes, std::memory_order_relaxed);
  }
  return Status::Ok();
}

// One measured configuration: its files, backend and buffers, the layout pass, the timed passes
// and the result. One per RunOne call; the files it created are removed when it ends.
class BenchRun {
 public:
  BenchRun(const RunConfig& c, bool progress)
      : c_(c),
        progress_(progress),
        write_(c.rw == "write" || c.rw == "randwrite"),
        random_(c.rw == "randread" || c.rw == "randwrite"),
        total_units_(c.size_bytes / c.block_bytes) {}
  ~BenchRun() {
    for (BenchFile& f : files_) {
      f.fd.reset();
      if (f.created) ::unlink(f.path.c_str());
    }
  }
  BenchRun(const BenchRun&) = delete;
  BenchRun& operator=(const BenchRun&) = delete;

  StatusOr<RunResult> Run() {
    STRATA_RETURN_IF_ERROR(Open());
    STRATA_RETURN_IF_ERROR(AllocateBuffers());
    STRATA_RETURN_IF_ERROR(LayOut());
    STRATA_RETURN_IF_ERROR(Stopped());
    DropCache(files_);
    done_bytes_.store(0);
    backend_->ResetStats();
    STRATA_RETURN_IF_ERROR(Measure());
    STRATA_RETURN_IF_ERROR(Stopped());
    backend_->UnregisterFiles(fds_);
    return Result();
  }
  // kCancelled after SIGINT or SIGTERM (InstallStopSignalHandlers): the run ends, and the
  // destructor removes the files it created.
  static Status Stopped() {
    if (StopSignal() == 0) return Status::Ok();
    return CancelledError(
        fmt::format("iobench stopped by signal {}; its files are removed", StopSignal()));
  }

 private:
  Status Open();
  Status AllocateBuffers();
  Status RunThreads(bool measured_write, int pass);
  Status LayOut();
  Status Measure();
  void Report();  // the progress thread: stops --runtime runs, prints every 2 s
  RunResult Result() const;

  const RunConfig& c_;
  const bool progress_;
  const bool write_;
  const bool random_;
  const uint64_t total_units_;
  std::unique_ptr<IoBackend> backend_;
  std::vector<BenchFile> files_;
  std::vector<int> fds_;
  std::vector<IoBuffer> buffers_;  // queue_depth blocks per thread
  // Per-thread unit lists: contiguous shares of the stripe units.
  std::vector<std::vector<uint64_t>> shares_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> finished_{false};
  std::atomic<uint64_t> done_bytes_{0};
  std::chrono::steady_clock::time_point start_;
  double seconds_ = 0;  // measured, --first-write's reallocation excluded
  double cpu_s_ = 0;
};

Status BenchRun::Open() {
  io::IoBackendOptions options;
  STRATA_ASSIGN_OR_RETURN(options.kind, io::ParseBackendKind(c_.backend));
  options.queue_depth = c_.queue_depth;
  options.block_size_bytes = c_.block_bytes;
  // posix: concurrency = worker threads, queue_depth for each submitting thread (one backend
  // serves them all).
  options.posix_threads =
      static_cast<int>(std::min<int64_t>(int64_t{c_.queue_depth} * std::max(1, c_.threads), 256));
  STRATA_ASSIGN_OR_RETURN(backend_, io::CreateIoBackend(options));
  STRATA_RETURN_IF_ERROR(OpenFiles(c_, &files_));
  for (const BenchFile& f : files_) fds_.push_back(f.fd.get());
  return backend_->RegisterFiles(fds_);
}

Status BenchRun::AllocateBuffers() {
  const int threads = c_.threads;
  const size_t per_thread_buf = static_cast<size_t>(c_.queue_depth) * c_.block_bytes;
  std::vector<std::span<std::byte>> regions;
  for (int t = 0; t < threads; ++t) {
    STRATA_ASSIGN_OR_RETURN(IoBuffer b, IoBuffer::Allocate(per_thread_buf));
    regions.push_back(b.span());
    buffers_.push_back(std::move(b));
  }
  if (Status s = backend_->RegisterBuffers(regions); !s.ok()) {
    STRATA_LOG_WARNING("iobench: fixed buffers not registered, plain reads/writes: {}",
                       s.ToString());
  }
  shares_.resize(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    const uint64_t lo = total_units_ * t / threads;
    const uint64_t hi = total_units_ * (t + 1) / threads;
    shares_[t].resize(hi - lo);
    std::iota(shares_[t].begin(), shares_[t].end(), lo);
  }
  return Status::Ok();
}

Status BenchRun::RunThreads(bool measured_write, int pass) {
  const int threads = c_.threads;
  std::vector<Status> statuses(static_cast<size_t>(threads));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::vector<uint64_t> units = shares_[t];
      if (random_) {
        std::mt19937_64 rng(static_cast<uint64_t>(pass) * 1000003 + t);
        std::shuffle(units.begin(), units.end(), rng);
      }
      statuses[t] = RunUnits(*backend_, c_, files_, measured_write, units, buffers_[t].span(),
                             stop_, done_bytes_);
    });
  }
  for (std::thread& th : pool) th.join();
  for (Status& s : statuses) STRATA_RETURN_IF_ERROR(s);
  return Status::Ok();
}

// Lay out new or short files before measuring (unless --first-write): reads need data there,
// and writes into written blocks are overwrites, what the swap store does from the second write
// of an extent on and what fio measures on a laid-out file. A write into new space takes another
// path through the file system (ext4: extending writes are serialized under the inode lock and
// completed by io_uring's worker threads; writes into fallocated extents convert them to written
// at completion): on the development VM both ran at about half the overwrite throughput.
Status BenchRun::LayOut() {
  bool need_layout = false;
  for (const BenchFile& f : files_) {
    struct stat st;
    ::fstat(f.fd.get(), &st);
    if (static_cast<uint64_t>(st.st_size) < f.size_bytes) need_layout = true;
  }
  if (c_.first_write || !need_layout) return Status::Ok();
  if (progress_) {
    std::fprintf(stderr, "iobench: laying out %s before measuring\n",
                 FormatBytes(c_.size_bytes).c_str());
  }
  STRATA_RETURN_IF_ERROR(RunThreads(true, -1));
  for (const BenchFile& f : files_) ::fdatasync(f.fd.get());
  return Status::Ok();
}

void BenchRun::Report() {
  auto next = start_ + std::chrono::seconds(2);
  while (!finished_.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const auto now = std::chrono::steady_clock::now();
    if ((c_.runtime_s > 0 && now - start_ >= std::chrono::duration<double>(c_.runtime_s)) ||
        StopSignal() != 0) {
      stop_.store(true);
    }
    if (progress_ && now >= next) {
      const double s = std::chrono::duration<double>(now - start_).count();
      std::fprintf(stderr, "iobench: %s %.1f s, %s moved, %s\n", c_.rw.c_str(), s,
                   FormatBytes(done_bytes_.load()).c_str(),
                   FormatRate(done_bytes_.load() / s).c_str());
      next += std::chrono::seconds(2);
    }
  }
}

// The timed passes: --loops of them, or as many as --runtime allows.
Status BenchRun::Measure() {
  start_ = std::chrono::steady_clock::now();
  std::thread reporter([this] { Report(); });  // progress every 2 s on long runs
  const double cpu0 = CpuSeconds();
  Status status;
  double excluded_s = 0;  // --first-write: deallocating and reallocating between passes
  double excluded_cpu_s = 0;
  for (int pass = 0; status.ok(); ++pass) {
    if (StopSignal() != 0 || (c_.runtime_s > 0 ? stop_.load() : pass >= c_.loops)) break;
    if (pass > 0) DropCache(files_);
    if (c_.first_write) {
      const auto t0 = std::chrono::steady_clock::now();
      const double u0 = CpuSeconds();
      for (const BenchFile& f : files_) {
        status = FreshlyAllocate(f);
        if (!status.ok()) break;
      }
      excluded_cpu_s += CpuSeconds() - u0;
      excluded_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!status.ok()) break;
    }
    status = RunThreads(write_, pass);
  }
  // Buffered writes end on the drive, as fio's end_fsync: the last pass's too (the passes before
  // it were synced by DropCache, inside the timing), so the figure does not depend on --loops.
  if (write_ && status.ok()) {
    for (const BenchFile& f : files_) {
      if (!f.direct) ::fdatasync(f.fd.get());
    }
  }
  const double cpu1 = CpuSeconds() - excluded_cpu_s;
  const auto end = std::chrono::steady_clock::now();
  finished_.store(true);
  reporter.join();
  seconds_ = std::chrono::duration<double>(end - start_).count() - excluded_s;
  cpu_s_ = cpu1 - cpu0;
  return status;
}

RunResult BenchRun::Result() const {
  RunResult r;
  r.config = c_;
  r.config.backend = std::string(backend_->name());
  r.bytes = done_bytes_.load();
  r.seconds = seconds_;
  r.unit_bytes_per_call =
      std::min<uint64_t>(UnitsPerCall(c_), (total_units_ + c_.threads - 1) / c_.threads) *
      c_.block_bytes;
  r.cpu_s = cpu_s_;
  const io::IoStats stats = backend_->stats();
  r.lat_mean_us = stats.latency->MeanNs() / 1e3;
  r.lat_p99_us = static_cast<double>(stats.latency->QuantileNs(0.99)) / 1e3;
  r.short_resubmits = stats.short_transfer_resubmits;
  r.eagain_retries = stats.eagain_retries;
  r.fixed_buffer_submissions = stats.fixed_buffer_submissions;
  r.submissions = stats.submissions;
  r.direct = std::all_of(files_.begin(), files_.end(), [](const BenchFile& f) { return f.direct; });
  return r;
}

StatusOr<RunResult> RunOne(const RunConfig& c, bool progress) {
  BenchRun run(c, progress);
  return run.Run();
}

nlohmann::json ToJson(const RunResult& r) {
  return {{"rw", r.config.rw},
          {"backend", r.config.backend},
          {"block_size_bytes", r.config.block_bytes},
          {"queue_depth", r.config.queue_depth},
          {"threads", r.config.threads},
          {"paths", r.config.paths},
          {"direct", r.direct},
          {"first_write", r.config.first_write},
          {"bytes_per_call", r.unit_bytes_per_call},
          {"bytes", r.bytes},
          {"seconds", r.seconds},
          {"gb_per_s", r.gb_per_s()},
          {"gib_per_s", r.gib_per_s()},
          {"iops", r.iops()},
          {"lat_mean_us", r.lat_mean_us},
          {"lat_p99_us", r.lat_p99_us},
          {"cpu_s_per_gb", r.cpu_s_per_gb()},
          {"submissions", r.submissions},
          {"fixed_buffer_submissions", r.fixed_buffer_submissions},
          {"short_transfer_resubmits", r.short_resubmits},
          {"eagain_retries", r.eagain_retries}};
}

std::string ToLine(const RunResult& r) {
  return fmt::format(
      "{:<9} {:<5} bs={:<9} qd={:<3} threads={} {}: {} in {:.2f} s: {:.3f} GB/s ({:.3f} GiB/s), "
      "{:.0f} IOPS, lat mean {:.1f} us p99 {:.1f} us, CPU {:.4f} s/GB{}",
      r.config.rw, r.config.backend, FormatBytes(r.config.block_bytes), r.config.queue_depth,
      r.config.threads, r.direct ? "O_DIRECT" : "buffered", FormatBytes(r.bytes), r.seconds,
      r.gb_per_s(), r.gib_per_s(), r.iops(), r.lat_mean_us, r.lat_p99_us, r.cpu_s_per_gb(),
      r.config.first_write ? ", first write into fallocated blocks" : "");
}

nlohmann::json ConfigBlock(const RunResult& best) {
  // A complete training config: the placement the sweep was measured for (state and working
  // params on NVMe, under the swept paths), bf16, clipping at 1, and the best I/O settings in
  // Strata's own terms (DeepSpeed's aio keys scale the queue depth by the thread count).
  const nlohmann::json nvme = {{"device", "nvme"}, {"nvme_path", best.config.paths}};
  // Training's io_threads are the posix backend's worker threads: as many as the measured run
  // kept I/Os in flight (BenchRun::Open), not its submitting threads.
  const int io_threads =
      best.config.backend == "posix"
          ? static_cast<int>(std::min<int64_t>(
                int64_t{best.config.queue_depth} * std::max(1, best.config.threads), 256))
          : best.config.threads;
  return {
      {"bf16", {{"enabled", true}}},
      // Strata's default clipping, written out: a DeepSpeed file without the key does not clip.
      {"gradient_clipping", 1.0},
      {"zero_optimization", {{"stage", 3}, {"offload_optimizer", nvme}, {"offload_param", nvme}}},
      {"strata",
       {{"io_backend", best.config.backend},
        {"io_block_size", best.config.block_bytes},
        {"io_queue_depth", best.config.queue_depth},
        {"io_threads", io_threads}}}};
}

Status CheckConfig(const RunConfig& c) {
  if (c.paths.empty()) return InvalidArgumentError("iobench needs at least one --path DIR");
  if (c.block_bytes == 0 || c.block_bytes % kAlign != 0) {
    return InvalidArgumentError(fmt::format(
        "--block-size {} bytes: use a positive multiple of 4096 (O_DIRECT)", c.block_bytes));
  }
  if (c.queue_depth < 1 || c.queue_depth > 4096) {
    return InvalidArgumentError(fmt::format("--queue-depth {}: use 1..4096", c.queue_depth));
  }
  if (c.threads < 1 || c.threads > 256) {
    return InvalidArgumentError(fmt::format("--threads {}: use 1..256", c.threads));
  }
  const uint64_t min_bytes = c.block_bytes * static_cast<uint64_t>(c.threads);
  if (c.size_bytes < min_bytes) {
    return InvalidArgumentError(
        fmt::format("--size {} is too small: at least block size x threads ({}) is needed",
                    FormatBytes(c.size_bytes), FormatBytes(min_bytes)));
  }
  if (c.rw != "read" && c.rw != "write" && c.rw != "randread" && c.rw != "randwrite") {
    return InvalidArgumentError(
        fmt::format("--rw '{}': use read, write, randread or randwrite", c.rw));
  }
  if (c.backend != "uring" && c.backend != "posix") {
    return InvalidArgumentError(fmt::format("--backend '{}': use uring or posix", c.backend));
  }
  if (c.loops < 1) return InvalidArgumentError(fmt::format("--loops {}: use >= 1", c.loops));
  if (!(c.runtime_s >= 0) || c.runtime_s > 1e6) {
    return InvalidArgumentError(
        fmt::format("--runtime {}: use 0 (--loops passes) or a number of seconds", c.runtime_s));
  }
  if (c.first_write && c.rw != "write" && c.rw != "randwrite") {
    return InvalidArgumentError(fmt::format(
        "--first-write measures writes: use it with --rw write or randwrite, not '{}'", c.rw));
  }
  return Status::Ok();
}

}  // namespace

void AddIobenchFlags(CLI::App& cmd, IobenchFlags& f) {
  cmd.add_option("--path", f.paths,
                 "Directory for a benchmark file (repeatable: striped over all, like the swap "
                 "store); an existing strata-iobench.<i> file there is reused and kept")
      ->required();
  cmd.add_option("--size", f.size, "Total bytes over all files, e.g. 4GiB")->capture_default_str();
  cmd.add_option("--block-size", f.block_size, "Bytes per I/O, multiple of 4096, e.g. 1MiB")
      ->capture_default_str();
  cmd.add_option("--queue-depth", f.queue_depth, "I/Os in flight per thread")
      ->capture_default_str();
  cmd.add_option("--rw", f.rw, "read|write|randread|randwrite")->capture_default_str();
  cmd.add_option("--backend", f.backend, "uring|posix")->capture_default_str();
  cmd.add_option("--threads", f.threads, "Submitting threads, each with its own queue")
      ->capture_default_str();
  auto* runtime =
      cmd.add_option("--runtime", f.runtime_s, "Seconds to run (passes repeat); else --loops");
  cmd.add_option("--loops", f.loops, "Passes over the file")
      ->capture_default_str()
      ->excludes(runtime);
  cmd.add_flag("--first-write", f.first_write,
               "Measure writes into freshly fallocated blocks (the swap store's first write of an "
               "extent; deallocates and reallocates the file before each pass) instead of "
               "overwrites of a laid-out file");
  cmd.add_flag("--json", f.json, "One JSON object per run on stdout");
  cmd.add_flag("--sweep", f.sweep,
               "Grid of block sizes (128KiB,1MiB,4MiB) x queue depths (8,32,64) x threads (1,2) "
               "x backends (uring,posix); prints the best settings as a train --config block");
  cmd.add_option("--config-out", f.config_out,
                 "With --sweep: also write the best-settings config block (alone) to this file");
}

Status RunIobench(const IobenchFlags& f) {
  RunConfig base;
  base.paths = f.paths;
  STRATA_ASSIGN_OR_RETURN(base.size_bytes, ParseSize(f.size));
  STRATA_ASSIGN_OR_RETURN(base.block_bytes, ParseSize(f.block_size));
  base.queue_depth = f.queue_depth;
  base.rw = f.rw;
  base.backend = f.backend;
  base.threads = f.threads;
  base.runtime_s = f.runtime_s;
  base.loops = f.loops;
  base.first_write = f.first_write;
  if (!f.config_out.empty() && !f.sweep) {
    return InvalidArgumentError("--config-out needs --sweep");
  }
  // Before minutes of measurements, not after.
  if (!f.config_out.empty()) {
    STRATA_RETURN_IF_ERROR(CheckWritableFile("--config-out", f.config_out));
  }
  // SIGINT or SIGTERM ends the run and removes the files it made (exit code 130 or 143).
  InstallStopSignalHandlers();
  if (!f.sweep) {
    STRATA_RETURN_IF_ERROR(CheckConfig(base));
    STRATA_ASSIGN_OR_RETURN(RunResult r, RunOne(base, /*progress=*/true));
    std::printf("%s\n", f.json ? ToJson(r).dump().c_str() : ToLine(r).c_str());
    return Status::Ok();
  }

  std::vector<RunResult> results;
  std::vector<std::string> backends = {"uring", "posix"};
  if (Status probe = io::ProbeUring(); !probe.ok()) {
    std::fprintf(stderr, "iobench: skipping uring in the sweep: %s\n", probe.ToString().c_str());
    backends = {"posix"};
  }
  // The grid, every configuration checked before the first runs (a --size too small for the
  // largest is refused at once, not after the others ran).
  std::vector<RunConfig> grid;
  for (uint64_t bs : {128 * kKiB, kMiB, 4 * kMiB}) {
    for (int qd : {8, 32, 64}) {
      for (int threads : {1, 2}) {
        for (const std::string& backend : backends) {
          RunConfig c = base;
          c.block_bytes = bs;
          c.queue_depth = qd;
          c.threads = threads;
          c.backend = backend;
          STRATA_RETURN_IF_ERROR(CheckConfig(c).WithContext("--sweep"));
          grid.push_back(std::move(c));
        }
      }
    }
  }
  const IobenchFlags defaults;
  if (f.block_size != defaults.block_size || f.queue_depth != defaults.queue_depth ||
      f.threads != defaults.threads || f.backend != defaults.backend) {
    std::fprintf(stderr,
                 "iobench: note: --sweep tries its own block sizes, queue depths, threads and "
                 "backends; --block-size, --queue-depth, --threads and --backend are not used\n");
  }
  for (const RunConfig& c : grid) {
    std::fprintf(stderr, "iobench: sweep %zu/%zu: %s bs=%s qd=%d threads=%d\n", results.size() + 1,
                 grid.size(), c.backend.c_str(), FormatBytes(c.block_bytes).c_str(), c.queue_depth,
                 c.threads);
    STRATA_ASSIGN_OR_RETURN(RunResult r, RunOne(c, /*progress=*/false));
    if (f.json) std::printf("%s\n", ToJson(r).dump().c_str());
    std::fflush(stdout);
    results.push_back(std::move(r));
  }
  std::sort(results.begin(), results.end(),
            [](const RunResult& a, const RunResult& b) { return a.gb_per_s() > b.gb_per_s(); });
  if (!f.json) {
    std::printf("# sweep, sorted by throughput\n");
    for (const RunResult& r : results) std::printf("%s\n", ToLine(r).c_str());
  }
  const std::string block = ConfigBlock(results.front()).dump(2);
  std::fprintf(stderr, "# best settings: save as a file and pass to strata train --config FILE\n");
  std::fflush(stderr);
  std::printf("%s\n", block.c_str());
  if (!f.config_out.empty()) {
    STRATA_RETURN_IF_ERROR(WriteOutputFile(f.config_out, block + "\n", "--config-out"));
  }
  return Status::Ok();
}

}  // namespace strata::tools
