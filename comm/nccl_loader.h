// NCCL, loaded on first use (dlopen) instead of linked. CUDA builds only; internal to comm/.
//
// NCCL is not part of every CUDA toolkit (it comes with NVIDIA's libnccl2 package, some toolkit
// images, or the PyTorch wheels' nvidia-nccl), and it is 200 MiB: a strata process that trains
// on one device must neither need it to start nor map it. So nothing links NCCL; Nccl() dlopens
// libnccl.so.2 (RTLD_NOW | RTLD_LOCAL, found the dynamic linker's way: LD_LIBRARY_PATH, the
// ld.so cache) the first time a NCCL communicator is made, resolves the few entry points below
// with dlsym, and keeps the library for the life of the process (never dlclosed), as
// gpu/cuda/cublas_loader.h does for cuBLAS.
//
// The NCCL types are declared here (nccl.h's ABI: a 128-byte unique id passed by value, C enums
// passed as int), so the build does not need nccl.h; where nccl.h is at hand, nccl_loader.cc
// checks each declaration against it at compile time.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "base/status.h"

namespace strata::comm::nccl {

struct UniqueId {  // ncclUniqueId
  char internal[128];
};
struct OpaqueComm;               // struct ncclComm
using CommHandle = OpaqueComm*;  // ncclComm_t

enum Result : int {  // ncclResult_t
  kSuccess = 0,
  kUnhandledCudaError = 1,
  kSystemError = 2,
  kInternalError = 3,
  kInvalidArgument = 4,
  kInvalidUsage = 5,
  kRemoteError = 6,
  kInProgress = 7,
};
enum DataType : int { kFloat16 = 6, kFloat32 = 7, kBfloat16 = 9 };  // ncclDataType_t
enum RedOp : int { kSum = 0 };                                      // ncclRedOp_t

// The NCCL entry points Strata uses; every member is non-null in a table Nccl() returned.
// Calling them follows NCCL's own rules (a communicator's calls from one thread at a time, its
// CUDA device current on the calling thread).
struct NcclApi {
  Result (*GetVersion)(int* version);
  Result (*GetUniqueId)(UniqueId* id);
  Result (*CommInitRank)(CommHandle* comm, int nranks, UniqueId id, int rank);
  Result (*CommDestroy)(CommHandle comm);
  Result (*CommAbort)(CommHandle comm);
  Result (*ReduceScatter)(const void* send, void* recv, size_t recv_count, DataType dtype, RedOp op,
                          CommHandle comm, cudaStream_t stream);
  Result (*AllGather)(const void* send, void* recv, size_t send_count, DataType dtype,
                      CommHandle comm, cudaStream_t stream);
  const char* (*GetErrorString)(Result result);
  std::string path;  // where the dynamic linker found the library
  int version = 0;   // ncclGetVersion: 22803 for 2.28.3
};

// "libnccl.so.2".
const char* NcclLibraryName();

// The process-wide table: the first call loads the library (the outcome is kept: a failed load
// is not retried). Thread-safe. kUnavailable when the library or an entry point is missing,
// naming what to install.
StatusOr<const NcclApi*> Nccl();

// OK for kSuccess; otherwise "<call> failed: <ncclGetErrorString>", with the code chosen by what
// the caller should do (kInvalidArgument for argument and usage errors, kUnavailable for system
// and remote errors: a peer or the network is gone, kInternal for the rest). api may be null
// (then the message has the number only).
Status NcclStatus(const NcclApi* api, Result result, const char* call);

namespace internal {
// What Nccl() does once, for one library name (tests: a name that does not exist). Not cached.
StatusOr<NcclApi> LoadNccl(const std::string& library_name);
}  // namespace internal

}  // namespace strata::comm::nccl
