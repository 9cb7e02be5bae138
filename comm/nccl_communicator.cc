// The NCCL backend: stream-ordered collectives on CUDA streams (NCCL kernels), host collectives on
// a duplicate of the bootstrap communicator. CUDA builds only (no_nccl_communicator.cc otherwise).
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "comm/communicator.h"
#include "comm/nccl_loader.h"
#include "comm/watchdog.h"
#include "gpu/cuda/cuda_native.h"
#include "gpu/cuda/cuda_status.h"

namespace strata::comm {
namespace {

StatusOr<nccl::DataType> NcclDataType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return nccl::kFloat32;
    case DType::kF16:
      return nccl::kFloat16;
    case DType::kBF16:
      return nccl::kBfloat16;
  }
  return InvalidArgumentError("NCCL: unknown dtype");
}

class NcclCommunicator final : public Communicator {
 public:
  // Collective over bootstrap.
  static StatusOr<std::unique_ptr<Communicator>> Create(Communicator& bootstrap,
                                                        const CommOptions& options) {
    STRATA_ASSIGN_OR_RETURN(const nccl::NcclApi* api, nccl::Nccl());
    int device = options.cuda_device_ordinal;
    if (device < 0) STRATA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> host, bootstrap.Duplicate());

    // Rank 0 makes the unique id and sends it with its outcome, so that a failure there fails
    // every rank instead of leaving them waiting in ncclCommInitRank.
    struct {
      int32_t ok;
      nccl::UniqueId id;
    } hello{};
    Status made = Status::Ok();
    if (host->rank() == 0) {
      made = nccl::NcclStatus(api, api->GetUniqueId(&hello.id), "ncclGetUniqueId");
      hello.ok = made.ok() ? 1 : 0;
    }
    STRATA_RETURN_IF_ERROR(host->Broadcast(std::as_writable_bytes(std::span(&hello, 1)), 0));
    if (!made.ok()) return made;
    if (!hello.ok) return UnavailableError("NCCL: rank 0 could not make the unique id");

    nccl::CommHandle comm = nullptr;
    {
      internal::Watchdog::Scope watch(WatchdogFor(*host, options), "NCCL communicator setup",
                                      options.timeout_seconds);
      STRATA_RETURN_IF_ERROR(nccl::NcclStatus(
          api, api->CommInitRank(&comm, host->world_size(), hello.id, host->rank()),
          "ncclCommInitRank"));
    }
    CommOptions resolved = options;
    resolved.cuda_device_ordinal = device;
    return std::unique_ptr<Communicator>(
        new NcclCommunicator(api, comm, device, std::move(host), resolved));
  }

  ~NcclCommunicator() override {
    if (cudaSetDevice(device_) == cudaSuccess) {
      (failed_ ? api_->CommAbort(comm_) : api_->CommDestroy(comm_));
    }
  }

  std::string_view backend() const override { return "nccl"; }
  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }
  int local_rank() const override { return host_->local_rank(); }
  int local_size() const override { return host_->local_size(); }

  Status ReduceScatter(gpu::DeviceSpan send, gpu::DeviceSpan recv, int64_t count, DType dtype,
                       gpu::Stream& stream) override {
    STRATA_RETURN_IF_ERROR(CheckStream("reduce-scatter", stream));
    STRATA_ASSIGN_OR_RETURN(const nccl::DataType type, NcclDataType(dtype));
    const size_t part_bytes = static_cast<size_t>(count) * SizeOf(dtype);
    const size_t send_bytes = part_bytes * static_cast<size_t>(world_size());
    if (count < 0 || send.size_bytes < send_bytes || recv.size_bytes < part_bytes) {
      return InvalidArgumentError(fmt::format(
          "reduce-scatter of {} elements per rank over {} ranks out of its buffers' bounds "
          "({} and {} bytes)",
          count, world_size(), send.size_bytes, recv.size_bytes));
    }
    if (count == 0) return Status::Ok();
    if (send.data < recv.data + part_bytes && recv.data < send.data + send_bytes) {
      return InvalidArgumentError("reduce-scatter: send and recv overlap");
    }
    return Watched("reduce-scatter", stream, [&](cudaStream_t s) {
      return nccl::NcclStatus(api_,
                              api_->ReduceScatter(send.data, recv.data, static_cast<size_t>(count),
                                                  type, nccl::kSum, comm_, s),
                              "ncclReduceScatter");
    });
  }

  Status AllGatherInPlace(gpu::DeviceSpan buffer, int64_t count, DType dtype,
                          gpu::Stream& stream) override {
    STRATA_RETURN_IF_ERROR(CheckStream("all-gather", stream));
    STRATA_ASSIGN_OR_RETURN(const nccl::DataType type, NcclDataType(dtype));
    const size_t part_bytes = static_cast<size_t>(count) * SizeOf(dtype);
    if (count < 0 || buffer.size_bytes < part_bytes * static_cast<size_t>(world_size())) {
      return InvalidArgumentError(fmt::format(
          "all-gather of {} elements per rank over {} ranks out of its buffer's bounds ({} bytes)",
          count, world_size(), buffer.size_bytes));
    }
    if (count == 0) return Status::Ok();
    // In place: this rank's part is already at its offset of the receive buffer.
    const std::byte* mine = buffer.data + part_bytes * static_cast<size_t>(rank());
    return Watched("all-gather", stream, [&](cudaStream_t s) {
      return nccl::NcclStatus(
          api_, api_->AllGather(mine, buffer.data, static_cast<size_t>(count), type, comm_, s),
          "ncclAllGather");
    });
  }

  Status AllReduce(std::span<double> values, ReduceOp op) override {
    return host_->AllReduce(values, op);
  }
  Status Broadcast(std::span<std::byte> data, int root) override {
    return host_->Broadcast(data, root);
  }
  Status AllGatherBytes(std::span<const std::byte> send, std::span<std::byte> recv) override {
    return host_->AllGatherBytes(send, recv);
  }
  Status Barrier() override { return host_->Barrier(); }

  StatusOr<std::unique_ptr<Communicator>> Duplicate() override {
    return NcclCommunicator::Create(*host_, options_);
  }

  [[noreturn]] void AbortJob() override {
    host_->AbortJob();
    std::_Exit(1);  // not reached: AbortJob does not return
  }

 private:
  NcclCommunicator(const nccl::NcclApi* api, nccl::CommHandle comm, int device,
                   std::unique_ptr<Communicator> host, const CommOptions& options)
      : api_(api),
        comm_(comm),
        device_(device),
        host_(std::move(host)),
        options_(options),
        watchdog_(WatchdogFor(*host_, options)) {}

  // One rank has no one to wait for; otherwise the MPI job's watchdog.
  static internal::Watchdog* WatchdogFor(const Communicator& host, const CommOptions& options) {
    if (host.world_size() == 1) return nullptr;
    return internal::JobWatchdog(options.timeout_seconds);
  }

  static Status CheckStream(const char* what, gpu::Stream& stream) {
    if (stream.device_kind() != gpu::DeviceKind::kCuda) {
      return InvalidArgumentError(fmt::format(
          "{} on the {} stream '{}' with the NCCL communicator: NCCL takes CUDA streams (use the "
          "MPI communicator for the host backend)",
          what, gpu::DeviceKindName(stream.device_kind()), stream.name()));
    }
    return Status::Ok();
  }

  // Enqueues `launch` on the stream's CUDA stream, with this GPU current; with a watchdog, host
  // functions before and after it time the collective from when the stream reaches it.
  template <typename Launch>
  Status Watched(const char* what, gpu::Stream& stream, Launch&& launch) {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    internal::Watchdog* const watchdog = watchdog_;
    const double timeout = options_.timeout_seconds;
    std::shared_ptr<std::atomic<uint64_t>> id;
    if (watchdog != nullptr && timeout > 0) {
      id = std::make_shared<std::atomic<uint64_t>>(0);
      STRATA_RETURN_IF_ERROR(stream.LaunchHost([=] {
        id->store(watchdog->Begin(what, timeout));
        return Status::Ok();
      }));
    }
    Status launched = launch(gpu::NativeStream(stream));
    if (!launched.ok()) failed_ = true;
    if (id != nullptr) {
      STRATA_RETURN_IF_ERROR(stream.LaunchHost([=] {
        watchdog->End(id->load());
        return Status::Ok();
      }));
    }
    return launched;
  }

  const nccl::NcclApi* api_;
  nccl::CommHandle comm_;
  int device_;
  std::unique_ptr<Communicator> host_;  // a duplicate of the bootstrap: host collectives
  CommOptions options_;
  internal::Watchdog* watchdog_;  // the job's, or null
  bool failed_ = false;           // an NCCL call failed: abort the communicator, not destroy it
};

}  // namespace

StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap,
                                                               const CommOptions& options) {
  return NcclCommunicator::Create(bootstrap, options);
}

}  // namespace strata::comm
