// CreateNcclCommunicator in a build without CUDA (nccl_communicator.cc is the CUDA one).
#include "comm/communicator.h"

namespace strata::comm {

StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap,
                                                               const CommOptions& options) {
  return UnavailableError(
      "NCCL communicator: this build has no CUDA (rebuild with nvcc found, -DSTRATA_CUDA=ON)");
}

}  // namespace strata::comm
