// Collectives between the data-parallel ranks of a training run (ZeRO, Rajbhandari et al.,
// "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020; its offload
// form: Ren et al., "ZeRO-Offload", USENIX ATC 2021).
//
// One process per device; the ranks, local ranks and the world come from the launcher
// (`mpirun`: OMPI_COMM_WORLD_* and the MPI library itself). Backends:
//   - "local": one rank, no launcher (every collective is a copy or nothing); whether a
//              launcher started the process is the caller's question (tools/mpi_launch.h);
//   - "mpi":   OpenMPI (Debian's libopenmpi-dev), for the host backend of gpu/ (its device
//              memory is host memory) and to bootstrap NCCL;
//   - "nccl":  NCCL for CUDA devices, loaded with dlopen on first use (like cuBLAS), its unique
//              id broadcast over MPI.
//
// Two kinds of calls:
//   - stream-ordered device collectives (ReduceScatter, AllGatherInPlace): enqueued on a
//     gpu::Stream and complete in that stream's order (a NCCL kernel on the CUDA stream; on the
//     host backend a LaunchHost function that runs the MPI call on the stream's thread);
//   - blocking host collectives (AllReduce, Broadcast, AllGatherBytes, Barrier) on the calling
//     thread.
// Every rank must issue the collectives of one communicator in the same order. A communicator
// is used by one thread (or one stream) at a time; collectives issued from two threads need two
// communicators (Duplicate), each ordered on its own. A communicator must outlive the stream
// work it enqueued: destroy it only after its streams have passed its collectives.
//
// Errors: kInvalidArgument for shapes or dtypes a backend cannot take, kUnavailable when the
// library is missing or a peer is gone, kDeadlineExceeded when a collective waited longer than
// CommOptions::timeout_seconds for the other ranks (the watchdog then aborts the whole job, see
// Abort). A failure inside a stream-ordered collective is the stream's sticky error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "base/dtype.h"
#include "base/status.h"
#include "gpu/device.h"

namespace strata::comm {

enum class ReduceOp { kSum, kMax };

struct CommOptions {
  // A collective that waits longer than this for the other ranks makes the watchdog print one
  // line naming it and abort every rank (a rank died or hangs). 0 = no watchdog.
  double timeout_seconds = 300;
  // NCCL only: the GPU this rank's communicator runs on, as cudaSetDevice counts (after
  // CUDA_VISIBLE_DEVICES); the streams given to its collectives must be of that GPU's device.
  // -1 = the device current on the thread that creates the communicator.
  int cuda_device_ordinal = -1;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual std::string_view backend() const = 0;  // "local", "mpi", "nccl"
  virtual int rank() const = 0;                  // 0 .. world_size() - 1
  virtual int world_size() const = 0;
  virtual int local_rank() const = 0;  // rank among the processes of this machine
  virtual int local_size() const = 0;

  // Stream-ordered. send holds world_size() * count elements of `dtype` (device memory), recv
  // count elements: recv = sum over ranks of send[rank() * count, (rank() + 1) * count). dtype
  // kF32 (sums in fp32), or the 16-bit types where the backend has them (NCCL). send and recv
  // must not overlap and must stay valid until the stream passes the call.
  virtual Status ReduceScatter(gpu::DeviceSpan send, gpu::DeviceSpan recv, int64_t count,
                               DType dtype, gpu::Stream& stream) = 0;
  // Stream-ordered. buffer holds world_size() * count elements of `dtype`; this rank's part
  // [rank() * count, (rank() + 1) * count) goes to every rank, whose parts land at their offsets.
  virtual Status AllGatherInPlace(gpu::DeviceSpan buffer, int64_t count, DType dtype,
                                  gpu::Stream& stream) = 0;

  // Blocking, host memory. values are reduced element-wise over the ranks, in place; the result
  // is the same bits on every rank (a fixed reduction order).
  virtual Status AllReduce(std::span<double> values, ReduceOp op) = 0;
  // data (the same size on every rank) becomes root's on every rank.
  virtual Status Broadcast(std::span<std::byte> data, int root) = 0;
  // recv (world_size() * send.size() bytes) receives every rank's send, in rank order.
  virtual Status AllGatherBytes(std::span<const std::byte> send, std::span<std::byte> recv) = 0;
  virtual Status Barrier() = 0;

  // A communicator over the same ranks whose collectives are ordered apart from this one's
  // (MPI_Comm_dup, a new NCCL communicator). Collective: every rank calls it, in the same order.
  virtual StatusOr<std::unique_ptr<Communicator>> Duplicate() = 0;

  // Ends the process of every rank with exit code 1 (MPI_Abort; the local backend exits).
  // Never returns. Use Abort() below, which says why first.
  [[noreturn]] virtual void AbortJob() = 0;
};

// A world of one rank. Thread-compatible; never fails once made.
std::unique_ptr<Communicator> CreateLocalCommunicator();

// The world of the MPI launcher that started this process: initialises MPI once per process
// (MPI_THREAD_MULTIPLE; kUnavailable when the library gives less) and finalises it at exit.
// Collective over MPI_COMM_WORLD. Needs a host-backend device for the stream-ordered calls
// (kInvalidArgument from them for CUDA streams: use NCCL there).
StatusOr<std::unique_ptr<Communicator>> CreateMpiCommunicator(const CommOptions& options = {});

// NCCL for a CUDA device, bootstrapped over `bootstrap` (an MPI communicator of the same world:
// rank 0 makes the unique id and broadcasts it; a local communicator gives a world of one GPU).
// kUnavailable when libnccl.so.2 cannot be loaded, naming what to install, or when this build
// has no CUDA. Collective. The host collectives (AllReduce, Broadcast, AllGatherBytes, Barrier)
// run on a Duplicate of `bootstrap` (host memory, MPI); the stream-ordered ones take CUDA streams
// of the device CommOptions::cuda_device_ordinal (kInvalidArgument for host-backend streams) and
// kF32, kF16 or kBF16. With a watchdog, each stream-ordered collective is timed from when its
// stream reaches it to when it completes (two host functions around the NCCL kernel).
StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap,
                                                               const CommOptions& options = {});

// Ends the whole job after an unrecoverable error on this rank: prints
// "strata: rank R: <why>" to stderr as one line and aborts every rank (MPI_Abort with exit code
// 1; with the local backend, exits with 1). Never returns. For the error paths of tools/ only.
[[noreturn]] void Abort(const Communicator& comm, std::string_view why);

// Fails on every rank when `text` (a description of this rank's configuration) is not the same
// on every rank: kInvalidArgument "the configuration of rank R differs from rank 0's (WHAT):
// launch every rank with the same flags and files". Collective.
Status CheckSameOnAllRanks(Communicator& comm, std::string_view what, std::string_view text);
// As above for named items (a flag and its value each, the same names in the same order on every
// rank): the message names the first item that differs, "(WHAT: --lr)" (an item named "" is not
// named). A rank listing another number of items (another build) is refused as such.
// Collective: two AllGatherBytes; their errors come back.
Status CheckSameOnAllRanks(Communicator& comm, std::string_view what,
                           std::span<const std::pair<std::string, std::string>> items);

}  // namespace strata::comm
