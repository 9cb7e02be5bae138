// The MPI backend (OpenMPI): the world of the launcher that started this process.
//
// Process-wide state, by the nature of MPI: MPI is initialised once (MPI_THREAD_MULTIPLE, since
// stream threads and the host thread run collectives of different communicators at once) and
// finalised by an atexit handler unless the job was aborted; one watchdog thread serves every
// communicator that has a timeout. Each communicator owns an MPI_Comm duplicated from
// MPI_COMM_WORLD (or from the communicator it was duplicated from) whose error handler returns
// codes instead of aborting, so that MPI failures come back as Status.
#include <fmt/format.h>
// The C API only: OpenMPI's and MPICH's mpi.h otherwise pull in the deprecated C++ bindings,
// which need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "comm/communicator.h"
#include "comm/watchdog.h"

namespace strata::comm {
namespace {

// Set before MPI_Abort: the atexit handler must not finalise a job that is being aborted.
std::atomic<bool> g_aborting{false};

// The process's watchdog, made with the first communicator that has a timeout; never destroyed
// (the atexit handler stops its thread before MPI_Finalize).
std::mutex g_watchdog_mu;
internal::Watchdog* g_watchdog = nullptr;

[[noreturn]] void AbortWorld() {
  g_aborting = true;
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);  // MPI_Abort does not return; should it, end this process at least
}

void FinalizeAtExit() {
  {
    std::lock_guard<std::mutex> lock(g_watchdog_mu);
    if (g_watchdog != nullptr) g_watchdog->Stop();
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !g_aborting) MPI_Finalize();
}

}  // namespace

internal::Watchdog* internal::JobWatchdog(double timeout_seconds) {
  if (!(timeout_seconds > 0)) return nullptr;
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return nullptr;
  std::lock_guard<std::mutex> lock(g_watchdog_mu);
  if (g_watchdog == nullptr) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    g_watchdog = new internal::Watchdog(rank, [](const std::string& line) {
      std::fprintf(stderr, "%s\n", line.c_str());
      std::fflush(stderr);
      AbortWorld();
    });
  }
  return g_watchdog;
}

namespace {

// "MPI_Allgather failed: MPI_ERR_TRUNCATE: message truncated", with the code chosen by what the
// caller should do: fix the arguments, or give up on a transport or peer that failed.
Status MpiStatus(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return Status::Ok();
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) {
    std::snprintf(text, sizeof(text), "MPI error %d", rc);
  }
  int error_class = rc;
  MPI_Error_class(rc, &error_class);
  std::string message = fmt::format("{} failed: {}", call, text);
  switch (error_class) {
    case MPI_ERR_BUFFER:
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_ROOT:
    case MPI_ERR_OP:
    case MPI_ERR_ARG:
    case MPI_ERR_TRUNCATE:
      return InvalidArgumentError(std::move(message));
    case MPI_ERR_NO_MEM:
      return ResourceExhaustedError(std::move(message));
    default:
      return UnavailableError(std::move(message));
  }
}

Status InitializeMpiOnce() {
  static const Status status = []() -> Status {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (!initialized) {
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Init_thread");
      std::atexit(FinalizeAtExit);
    } else {
      MPI_Query_thread(&provided);  // the host program initialised MPI itself
    }
    if (provided < MPI_THREAD_MULTIPLE) {
      return UnavailableError(fmt::format(
          "the MPI library gives thread support level {} but strata needs MPI_THREAD_MULTIPLE "
          "({}): collectives run on stream threads and the host thread at once; use an MPI "
          "built with thread support (Debian's OpenMPI has it)",
          provided, MPI_THREAD_MULTIPLE));
    }
    return MpiStatus(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN),
                     "MPI_Comm_set_errhandler");
  }();
  return status;
}

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (already duplicated, error handler set).
  MpiCommunicator(MPI_Comm comm, int rank, int world_size, int local_rank, int local_size,
                  const CommOptions& options, internal::Watchdog* watchdog)
      : comm_(comm),
        rank_(rank),
        world_size_(world_size),
        local_rank_(local_rank),
        local_size_(local_size),
        options_(options),
        watchdog_(watchdog) {}

  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  // Collective over `parent`: a duplicate of it with this process's ranks.
  static StatusOr<std::unique_ptr<Communicator>> Create(MPI_Comm parent,
                                                        const CommOptions& options) {
    MPI_Comm comm = MPI_COMM_NULL;
    STRATA_RETURN_IF_ERROR(MpiStatus(MPI_Comm_dup(parent, &comm), "MPI_Comm_dup"));
    // From here on the duplicate is freed on every path.
    std::unique_ptr<MpiCommunicator> result(new MpiCommunicator(
        comm, 0, 1, 0, 1, options, internal::JobWatchdog(options.timeout_seconds)));
    STRATA_RETURN_IF_ERROR(
        MpiStatus(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler"));
    STRATA_RETURN_IF_ERROR(MpiStatus(MPI_Comm_rank(comm, &result->rank_), "MPI_Comm_rank"));
    STRATA_RETURN_IF_ERROR(MpiStatus(MPI_Comm_size(comm, &result->world_size_), "MPI_Comm_size"));
    // The ranks on this machine: those that share memory with this one.
    MPI_Comm local = MPI_COMM_NULL;
    STRATA_RETURN_IF_ERROR(MpiStatus(
        MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, result->rank_, MPI_INFO_NULL, &local),
        "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)"));
    Status s = MpiStatus(MPI_Comm_rank(local, &result->local_rank_), "MPI_Comm_rank");
    if (s.ok()) s = MpiStatus(MPI_Comm_size(local, &result->local_size_), "MPI_Comm_size");
    MPI_Comm_free(&local);
    STRATA_RETURN_IF_ERROR(s);
    return std::unique_ptr<Communicator>(std::move(result));
  }

  std::string_view backend() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }

  Status ReduceScatter(gpu::DeviceSpan send, gpu::DeviceSpan recv, int64_t count, DType dtype,
                       gpu::Stream& stream) override {
    STRATA_RETURN_IF_ERROR(CheckStreamAndDtype("reduce-scatter", dtype, stream));
    STRATA_RETURN_IF_ERROR(CheckCount("reduce-scatter", count));
    const size_t part_bytes = static_cast<size_t>(count) * SizeOf(dtype);
    const size_t send_bytes = part_bytes * static_cast<size_t>(world_size_);
    if (send.size_bytes < send_bytes || recv.size_bytes < part_bytes) {
      return InvalidArgumentError(fmt::format(
          "reduce-scatter of {} elements per rank over {} ranks needs {} bytes to send and {} to "
          "receive; the buffers hold {} and {}",
          count, world_size_, send_bytes, part_bytes, send.size_bytes, recv.size_bytes));
    }
    if (count == 0) return Status::Ok();
    if (send.data < recv.data + part_bytes && recv.data < send.data + send_bytes) {
      return InvalidArgumentError("reduce-scatter: send and recv overlap");
    }
    MPI_Comm comm = comm_;
    internal::Watchdog* watchdog = watchdog_;
    const double timeout = options_.timeout_seconds;
    return stream.LaunchHostAs(trace::Category::kComm, [=] {
      internal::Watchdog::Scope watch(watchdog, "reduce-scatter", timeout);
      return MpiStatus(MPI_Reduce_scatter_block(send.data, recv.data, static_cast<int>(count),
                                                MPI_FLOAT, MPI_SUM, comm),
                       "MPI_Reduce_scatter_block");
    });
  }

  // A copy, so any dtype: the parts travel as bytes.
  Status AllGatherInPlace(gpu::DeviceSpan buffer, int64_t count, DType dtype,
                          gpu::Stream& stream) override {
    STRATA_RETURN_IF_ERROR(CheckStreamAndDtype("all-gather", DType::kF32, stream));
    STRATA_RETURN_IF_ERROR(CheckCount("all-gather", count * static_cast<int64_t>(SizeOf(dtype))));
    const size_t part_bytes = static_cast<size_t>(count) * SizeOf(dtype);
    const size_t bytes = part_bytes * world_size_;
    if (buffer.size_bytes < bytes) {
      return InvalidArgumentError(fmt::format(
          "all-gather of {} elements per rank over {} ranks needs {} bytes; the buffer holds {}",
          count, world_size_, bytes, buffer.size_bytes));
    }
    if (count == 0) return Status::Ok();
    MPI_Comm comm = comm_;
    internal::Watchdog* watchdog = watchdog_;
    const double timeout = options_.timeout_seconds;
    return stream.LaunchHostAs(trace::Category::kComm, [=] {
      internal::Watchdog::Scope watch(watchdog, "all-gather", timeout);
      return MpiStatus(MPI_Allgather(MPI_IN_PLACE, 0, MPI_BYTE, buffer.data,
                                     static_cast<int>(part_bytes), MPI_BYTE, comm),
                       "MPI_Allgather");
    });
  }

  // The values of every rank are gathered and reduced on every rank in rank order, so every rank
  // computes the same bits (MPI_Allreduce leaves the order, and so the rounding, unspecified).
  Status AllReduce(std::span<double> values, ReduceOp op) override {
    if (values.empty()) return Status::Ok();
    if (values.size() > static_cast<size_t>(INT_MAX)) {
      return InvalidArgumentError(
          fmt::format("all-reduce of {} values: at most {}", values.size(), INT_MAX));
    }
    const size_t n = values.size();
    std::vector<double> all(n * world_size_);
    {
      internal::Watchdog::Scope watch(watchdog_, "all-reduce", options_.timeout_seconds);
      STRATA_RETURN_IF_ERROR(
          MpiStatus(MPI_Allgather(values.data(), static_cast<int>(n), MPI_DOUBLE, all.data(),
                                  static_cast<int>(n), MPI_DOUBLE, comm_),
                    "MPI_Allgather"));
    }
    for (size_t i = 0; i < n; ++i) {
      double acc = all[i];
      for (int r = 1; r < world_size_; ++r) {
        const double v = all[r * n + i];
        if (op == ReduceOp::kSum) {
          acc += v;
        } else if (std::isnan(acc) || std::isnan(v)) {
          acc = std::isnan(acc) ? acc : v;  // a NaN anywhere is the maximum
        } else {
          acc = std::max(acc, v);
        }
      }
      values[i] = acc;
    }
    return Status::Ok();
  }

  Status Broadcast(std::span<std::byte> data, int root) override {
    if (root < 0 || root >= world_size_) {
      return InvalidArgumentError(fmt::format("broadcast from rank {} of {}", root, world_size_));
    }
    internal::Watchdog::Scope watch(watchdog_, "broadcast", options_.timeout_seconds);
    // MPI counts are int: large data goes in pieces, the same pieces on every rank.
    for (size_t offset = 0; offset < data.size();) {
      const size_t piece = std::min<size_t>(data.size() - offset, INT_MAX);
      STRATA_RETURN_IF_ERROR(
          MpiStatus(MPI_Bcast(data.data() + offset, static_cast<int>(piece), MPI_BYTE, root, comm_),
                    "MPI_Bcast"));
      offset += piece;
    }
    return Status::Ok();
  }

  Status AllGatherBytes(std::span<const std::byte> send, std::span<std::byte> recv) override {
    if (recv.size() != send.size() * world_size_) {
      return InvalidArgumentError(fmt::format(
          "all-gather of {} bytes per rank over {} ranks: recv must hold {} bytes, not {}",
          send.size(), world_size_, send.size() * world_size_, recv.size()));
    }
    if (send.size() > static_cast<size_t>(INT_MAX)) {
      return InvalidArgumentError(
          fmt::format("all-gather of {} bytes per rank: at most {}", send.size(), INT_MAX));
    }
    if (send.empty()) return Status::Ok();
    internal::Watchdog::Scope watch(watchdog_, "all-gather", options_.timeout_seconds);
    const int n = static_cast<int>(send.size());
    return MpiStatus(MPI_Allgather(send.data(), n, MPI_BYTE, recv.data(), n, MPI_BYTE, comm_),
                     "MPI_Allgather");
  }

  Status Barrier() override {
    internal::Watchdog::Scope watch(watchdog_, "barrier", options_.timeout_seconds);
    return MpiStatus(MPI_Barrier(comm_), "MPI_Barrier");
  }

  StatusOr<std::unique_ptr<Communicator>> Duplicate() override {
    internal::Watchdog::Scope watch(watchdog_, "duplicate", options_.timeout_seconds);
    MPI_Comm comm = MPI_COMM_NULL;
    STRATA_RETURN_IF_ERROR(MpiStatus(MPI_Comm_dup(comm_, &comm), "MPI_Comm_dup"));
    auto result = std::make_unique<MpiCommunicator>(comm, rank_, world_size_, local_rank_,
                                                    local_size_, options_, watchdog_);
    STRATA_RETURN_IF_ERROR(
        MpiStatus(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler"));
    return std::unique_ptr<Communicator>(std::move(result));
  }

  [[noreturn]] void AbortJob() override { AbortWorld(); }

 private:
  Status CheckStreamAndDtype(const char* what, DType dtype, gpu::Stream& stream) const {
    if (stream.device_kind() == gpu::DeviceKind::kCuda) {
      return InvalidArgumentError(fmt::format(
          "{} on the CUDA stream '{}' with the MPI communicator: use NCCL for CUDA devices "
          "(CreateNcclCommunicator)",
          what, stream.name()));
    }
    if (dtype != DType::kF32) {
      return InvalidArgumentError(fmt::format(
          "{} of {} with the MPI communicator: it takes fp32 only", what, DTypeName(dtype)));
    }
    return Status::Ok();
  }
  static Status CheckCount(const char* what, int64_t count) {
    if (count < 0 || count > INT_MAX) {
      return InvalidArgumentError(
          fmt::format("{} of {} elements per rank: must be 0 .. {}", what, count, INT_MAX));
    }
    return Status::Ok();
  }

  MPI_Comm comm_;
  int rank_;
  int world_size_;
  int local_rank_;
  int local_size_;
  CommOptions options_;
  internal::Watchdog* watchdog_;  // the process's, or null without a timeout
};

}  // namespace

StatusOr<std::unique_ptr<Communicator>> CreateMpiCommunicator(const CommOptions& options) {
  STRATA_RETURN_IF_ERROR(InitializeMpiOnce());
  return MpiCommunicator::Create(MPI_COMM_WORLD, options);
}

}  // namespace strata::comm
