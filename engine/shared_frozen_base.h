// The frozen chunks' pinned homes shared by the data-parallel ranks of one machine.
//
// Under mpirun every rank of a LoRA or QLoRA run holds the whole frozen base (it is never
// partitioned, never written after initialisation, and the same on every rank), so N ranks on
// one workstation would pin N copies of it: 4 x 36.8 GiB for llama-70b in NF4. Instead the ranks
// of a machine map one POSIX shared-memory object (shm_open, under /dev/shm): the machine's first
// rank (Communicator::local_rank 0) creates it, reserves its pages (posix_fallocate, so a full
// /dev/shm is an error now rather than a SIGBUS later) and writes the chunks; every rank pins its
// own mapping for DMA (gpu::Device::RegisterPinned) and reads it after Publish. The object's name
// is unlinked as soon as every rank has opened it, so nothing is left in /dev/shm once the ranks
// exit, however they exit.
//
// When the object cannot be had on some rank (no /dev/shm, too small a /dev/shm: Docker's
// default is 64 MiB; or its mapping cannot be pinned there: the pinned budget, a memlock limit),
// that rank says why in one warning and Create returns nullptr on every rank: each then keeps
// its own copy, as before.
//
// Threads: Create and Publish are collectives over the communicator (every rank calls them in the
// same order as its other collectives), from the engine's driving thread, inside Engine::Create.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "base/status.h"
#include "comm/communicator.h"
#include "gpu/device.h"

namespace strata::engine {

class SharedFrozenBase {
 public:
  // A shared region of size_bytes (a multiple of 4 KiB) pinned on `device`, or nullptr (every
  // rank alike) when it cannot be had, or when no two ranks share a machine (local_size 1).
  // comm and device are not owned and outlive the object. Errors: the communicator's; a failure
  // to create, map or pin the object on any rank is the nullptr fallback on every rank.
  static StatusOr<std::unique_ptr<SharedFrozenBase>> Create(comm::Communicator& comm,
                                                            gpu::Device& device, size_t size_bytes);
  ~SharedFrozenBase();
  SharedFrozenBase(const SharedFrozenBase&) = delete;
  SharedFrozenBase& operator=(const SharedFrozenBase&) = delete;

  // The region: size_bytes, 4 KiB-aligned, pinned; the chunks' homes are carved from it.
  gpu::PinnedSpan span() const { return pinned_.span(); }
  // Whether this rank writes the chunks (local rank 0); the others only read them.
  bool writer() const { return writer_; }
  // The ranks that map it (Communicator::local_size).
  int ranks() const { return ranks_; }
  // After the writer has written every chunk: a barrier, after which every rank may read them.
  Status Publish();

 private:
  SharedFrozenBase(comm::Communicator& comm, std::byte* data, size_t size_bytes, bool writer)
      : comm_(comm), data_(data), size_bytes_(size_bytes), writer_(writer) {}

  comm::Communicator& comm_;
  std::byte* data_;  // the mapping (munmap'd by the destructor, after pinned_ unpins it)
  size_t size_bytes_;
  bool writer_;
  int ranks_ = 1;
  gpu::PinnedBuffer pinned_;
};

}  // namespace strata::engine
