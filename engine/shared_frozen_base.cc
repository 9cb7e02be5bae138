#include "engine/shared_frozen_base.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <random>
#include <span>

#include "base/logging.h"
#include "base/unique_fd.h"
#include "base/units.h"

namespace strata::engine {
namespace {

// The object this machine's ranks map: opened (created by the writer, whose pages it reserves)
// and mapped; its name stays until the writer's shm_unlink (on failure, at once).
StatusOr<std::byte*> OpenAndMap(const std::string& name, size_t size_bytes, bool writer) {
  const int flags = writer ? O_RDWR | O_CREAT | O_EXCL : O_RDWR;
  UniqueFd fd(shm_open(name.c_str(), flags, 0600));
  if (fd.get() < 0) return ErrnoToStatus(errno, fmt::format("shm_open '{}'", name));
  if (writer) {
    // Reserved now: a /dev/shm too small for it fails here, not with a SIGBUS at the first write.
    const int e = posix_fallocate(fd.get(), 0, static_cast<off_t>(size_bytes));
    if (e != 0) {
      shm_unlink(name.c_str());
      return ErrnoToStatus(e, fmt::format("reserving {} in /dev/shm", FormatBytes(size_bytes)));
    }
  }
  void* p = mmap(nullptr, size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    if (writer) shm_unlink(name.c_str());
    return ErrnoToStatus(e, fmt::format("mapping '{}'", name));
  }
  return static_cast<std::byte*>(p);
}

// Every rank's outcome: true when all ranks succeeded.
StatusOr<bool> AllSucceeded(comm::Communicator& comm, bool ok) {
  std::array<double, 1> failed = {ok ? 0.0 : 1.0};
  STRATA_RETURN_IF_ERROR(comm.AllReduce(failed, comm::ReduceOp::kMax));
  return failed[0] == 0.0;
}

}  // namespace

StatusOr<std::unique_ptr<SharedFrozenBase>> SharedFrozenBase::Create(comm::Communicator& comm,
                                                                     gpu::Device& device,
                                                                     size_t size_bytes) {
  // Every rank takes the same path: local_size is the same on a machine, but machines may differ,
  // so the choice is everyone's.
  std::array<double, 1> most = {static_cast<double>(comm.local_size())};
  STRATA_RETURN_IF_ERROR(comm.AllReduce(most, comm::ReduceOp::kMax));
  if (most[0] < 2 || size_bytes == 0) return std::unique_ptr<SharedFrozenBase>();
  // One name for the job, rank 0's (each machine has its own /dev/shm).
  std::array<uint64_t, 2> token = {std::random_device{}(), std::random_device{}()};
  STRATA_RETURN_IF_ERROR(comm.Broadcast(std::as_writable_bytes(std::span(token)), 0));
  const std::string name = fmt::format("/strata-frozen-{:08x}{:08x}", token[0], token[1]);
  const bool writer = comm.local_rank() == 0;

  // The writer creates it; then the others open it; then the name goes; then each rank pins its
  // mapping. Each stage is voted on, so a failure on one rank is every rank's fallback, never a
  // rank left waiting in a collective the others skipped.
  StatusOr<std::byte*> data = InvalidArgumentError("not mapped");
  // The mapping goes with this scope unless the object below takes it (also on a
  // communicator's error).
  auto unmap = [&](std::byte* p) { munmap(p, size_bytes); };
  std::unique_ptr<std::byte, decltype(unmap)> mapping(nullptr, unmap);
  Status why = Status::Ok();
  if (writer) {
    data = OpenAndMap(name, size_bytes, /*writer=*/true);
    if (data.ok()) {
      mapping.reset(*data);
    } else {
      why = data.status();
    }
  }
  STRATA_ASSIGN_OR_RETURN(const bool created, AllSucceeded(comm, !writer || data.ok()));
  if (created && !writer) {
    data = OpenAndMap(name, size_bytes, /*writer=*/false);
    if (data.ok()) {
      mapping.reset(*data);
    } else {
      why = data.status();
    }
  }
  STRATA_ASSIGN_OR_RETURN(const bool opened, AllSucceeded(comm, !created || data.ok()));
  if (writer && data.ok()) shm_unlink(name.c_str());
  gpu::PinnedBuffer pinned;
  if (created && opened) {
    auto p = device.RegisterPinned(mapping.get(), size_bytes, "frozen params");
    if (p.ok()) {
      pinned = std::move(*p);
    } else {
      why = p.status();
    }
  }
  STRATA_ASSIGN_OR_RETURN(const bool registered,
                          AllSucceeded(comm, !(created && opened) || pinned.size_bytes() > 0));
  if (!created || !opened || !registered) {
    pinned = gpu::PinnedBuffer();  // unpinned before the mapping goes
    if (!why.ok()) {
      STRATA_LOG_WARNING(
          "rank {}: the frozen base cannot be shared by this machine's ranks ({}); each rank "
          "keeps its own copy of {}",
          comm.rank(), why.message(), FormatBytes(size_bytes));
    }
    return std::unique_ptr<SharedFrozenBase>();
  }
  std::unique_ptr<SharedFrozenBase> s(
      new SharedFrozenBase(comm, mapping.release(), size_bytes, writer));
  s->ranks_ = comm.local_size();
  s->pinned_ = std::move(pinned);
  return s;
}

SharedFrozenBase::~SharedFrozenBase() {
  pinned_ = gpu::PinnedBuffer();  // unpinned before the mapping goes
  munmap(data_, size_bytes_);
}

Status SharedFrozenBase::Publish() { return comm_.Barrier(); }

}  // namespace strata::engine
