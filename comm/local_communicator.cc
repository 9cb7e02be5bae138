// The world of one rank: collectives are copies (or nothing).
#include <fmt/format.h>
#include <xxhash.h>

#include <cstdlib>
#include <cstring>

#include "base/logging.h"
#include "comm/communicator.h"

namespace strata::comm {
namespace {

class LocalCommunicator final : public Communicator {
 public:
  std::string_view backend() const override { return "local"; }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  int local_rank() const override { return 0; }
  int local_size() const override { return 1; }

  Status ReduceScatter(gpu::DeviceSpan send, gpu::DeviceSpan recv, int64_t count, DType dtype,
                       gpu::Stream& stream) override {
    if (count < 0 || send.size_bytes < count * SizeOf(dtype) ||
        recv.size_bytes < count * SizeOf(dtype)) {
      return InvalidArgumentError(
          fmt::format("reduce-scatter of {} elements out of its buffers' bounds", count));
    }
    if (send.data == recv.data || count == 0) return Status::Ok();
    return stream.Convert(recv, dtype, send, dtype, count);  // a device-side copy
  }
  Status AllGatherInPlace(gpu::DeviceSpan buffer, int64_t count, DType dtype,
                          gpu::Stream& stream) override {
    if (count < 0 || buffer.size_bytes < count * SizeOf(dtype)) {
      return InvalidArgumentError(
          fmt::format("all-gather of {} elements out of its buffer's bounds", count));
    }
    return Status::Ok();
  }
  Status AllReduce(std::span<double> values, ReduceOp op) override { return Status::Ok(); }
  Status Broadcast(std::span<std::byte> data, int root) override {
    if (root != 0) return InvalidArgumentError(fmt::format("broadcast from rank {} of 1", root));
    return Status::Ok();
  }
  Status AllGatherBytes(std::span<const std::byte> send, std::span<std::byte> recv) override {
    if (recv.size() != send.size()) {
      return InvalidArgumentError("all-gather: recv must hold world_size() * send.size() bytes");
    }
    if (!send.empty()) std::memmove(recv.data(), send.data(), send.size());
    return Status::Ok();
  }
  Status Barrier() override { return Status::Ok(); }
  StatusOr<std::unique_ptr<Communicator>> Duplicate() override {
    return std::unique_ptr<Communicator>(new LocalCommunicator());
  }
  [[noreturn]] void AbortJob() override { std::_Exit(1); }
};

}  // namespace

std::unique_ptr<Communicator> CreateLocalCommunicator() {
  return std::make_unique<LocalCommunicator>();
}

void Abort(const Communicator& comm, std::string_view why) {
  std::fprintf(stderr, "strata: rank %d: %.*s\n", comm.rank(), static_cast<int>(why.size()),
               why.data());
  std::fflush(stderr);
  const_cast<Communicator&>(comm).AbortJob();
  std::_Exit(1);  // not reached: AbortJob does not return
}

Status CheckSameOnAllRanks(Communicator& comm, std::string_view what, std::string_view text) {
  const std::pair<std::string, std::string> whole{"", std::string(text)};
  return CheckSameOnAllRanks(comm, what, std::span(&whole, 1));
}

Status CheckSameOnAllRanks(Communicator& comm, std::string_view what,
                           std::span<const std::pair<std::string, std::string>> items) {
  const int n = comm.world_size();
  if (n == 1) return Status::Ok();
  // One hash per item, the count first (a rank of another build may list other items).
  std::vector<uint64_t> mine = {items.size()};
  for (const auto& [name, value] : items) {
    mine.push_back(XXH3_64bits(name.data(), name.size()) ^
                   XXH3_64bits(value.data(), value.size()) * 0x9E3779B97F4A7C15ull);
  }
  std::vector<uint64_t> counts(n);
  const uint64_t count = mine.size();
  STRATA_RETURN_IF_ERROR(comm.AllGatherBytes(std::as_bytes(std::span(&count, 1)),
                                             std::as_writable_bytes(std::span(counts))));
  for (int r = 1; r < n; ++r) {
    if (counts[r] != counts[0]) {
      return InvalidArgumentError(fmt::format(
          "the configuration of rank {} differs from rank 0's ({}; another build of strata?): "
          "launch every rank with the same strata, flags and files",
          r, what));
    }
  }
  std::vector<uint64_t> all(static_cast<size_t>(n) * mine.size());
  STRATA_RETURN_IF_ERROR(
      comm.AllGatherBytes(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all))));
  for (int r = 1; r < n; ++r) {
    for (size_t i = 1; i < mine.size(); ++i) {
      if (all[r * mine.size() + i] != all[i]) {
        const std::string& name = items[i - 1].first;
        return InvalidArgumentError(fmt::format(
            "the configuration of rank {} differs from rank 0's ({}{}{}): launch every rank with "
            "the same flags and files",
            r, what, name.empty() ? "" : ": ", name));
      }
    }
  }
  return Status::Ok();
}

}  // namespace strata::comm
