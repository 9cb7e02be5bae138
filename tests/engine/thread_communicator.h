// A communicator whose ranks are threads of one process (for engine tests without a launcher):
// a ThreadWorld of N ranks hands each rank its Communicator; every collective is a rendezvous of
// the N ranks' calls on one channel (a communicator and its duplicates each have their own),
// and reductions sum in rank order, as the MPI backend does. Stream-ordered collectives run as
// LaunchHost functions on the host backend's stream threads.
#pragma once

#include <barrier>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/communicator.h"

namespace strata::engine::testing {

class ThreadWorld {
 public:
  explicit ThreadWorld(int ranks) : ranks_(ranks) {}
  int ranks() const { return ranks_; }
  // Rank r's communicator (channel 0). Each rank's k-th Duplicate gets channel k + 1.
  std::unique_ptr<comm::Communicator> Rank(int r);

  struct Channel {
    explicit Channel(int n) : barrier(n), ptrs(n) {}
    std::barrier<> barrier;
    std::vector<const std::byte*> ptrs;  // each rank's buffer for the collective in progress
  };
  Channel& channel(int id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& c = channels_[id];
    if (!c) c = std::make_unique<Channel>(ranks_);
    return *c;
  }

 private:
  const int ranks_;
  std::mutex mu_;
  std::map<int, std::unique_ptr<Channel>> channels_;
};

class ThreadCommunicator final : public comm::Communicator {
 public:
  ThreadCommunicator(ThreadWorld* world, int rank, int channel)
      : world_(world), rank_(rank), channel_(channel), c_(&world->channel(channel)) {}

  std::string_view backend() const override { return "threads"; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_->ranks(); }
  int local_rank() const override { return rank_; }
  int local_size() const override { return world_->ranks(); }

  Status ReduceScatter(gpu::DeviceSpan send, gpu::DeviceSpan recv, int64_t count, DType dtype,
                       gpu::Stream& stream) override {
    if (dtype != DType::kF32) return InvalidArgumentError("threads: fp32 reduce-scatter only");
    return stream.LaunchHostAs(trace::Category::kComm, [=, this] {
      Exchange(send.data, [&] {
        auto* out = recv.as<float>();
        for (int64_t i = 0; i < count; ++i) {
          float sum = Part<float>(0)[rank_ * count + i];
          for (int r = 1; r < world_size(); ++r) sum += Part<float>(r)[rank_ * count + i];
          out[i] = sum;
        }
      });
      return Status::Ok();
    });
  }
  Status AllGatherInPlace(gpu::DeviceSpan buffer, int64_t count, DType dtype,
                          gpu::Stream& stream) override {
    const size_t bytes = count * SizeOf(dtype);
    return stream.LaunchHostAs(trace::Category::kComm, [=, this] {
      Exchange(buffer.data, [&] {
        for (int r = 0; r < world_size(); ++r) {
          if (r != rank_)
            std::memcpy(buffer.data + r * bytes, Part<std::byte>(r) + r * bytes, bytes);
        }
      });
      return Status::Ok();
    });
  }
  Status AllReduce(std::span<double> values, comm::ReduceOp op) override {
    std::vector<double> mine(values.begin(), values.end());
    Exchange(reinterpret_cast<const std::byte*>(mine.data()), [&] {
      for (size_t i = 0; i < values.size(); ++i) {
        double acc = Part<double>(0)[i];
        for (int r = 1; r < world_size(); ++r) {
          const double x = Part<double>(r)[i];
          acc = op == comm::ReduceOp::kSum ? acc + x : std::max(acc, x);
        }
        values[i] = acc;
      }
    });
    return Status::Ok();
  }
  Status Broadcast(std::span<std::byte> data, int root) override {
    std::vector<std::byte> mine(data.begin(), data.end());
    Exchange(mine.data(), [&] {
      if (!data.empty()) std::memcpy(data.data(), Part<std::byte>(root), data.size());
    });
    return Status::Ok();
  }
  Status AllGatherBytes(std::span<const std::byte> send, std::span<std::byte> recv) override {
    Exchange(send.data(), [&] {
      for (int r = 0; r < world_size() && !send.empty(); ++r) {
        std::memcpy(recv.data() + r * send.size(), Part<std::byte>(r), send.size());
      }
    });
    return Status::Ok();
  }
  Status Barrier() override {
    Exchange(nullptr, [] {});
    return Status::Ok();
  }
  StatusOr<std::unique_ptr<comm::Communicator>> Duplicate() override {
    return std::unique_ptr<comm::Communicator>(
        new ThreadCommunicator(world_, rank_, channel_ * 16 + (++dups_)));
  }
  [[noreturn]] void AbortJob() override { std::abort(); }

 private:
  template <typename T>
  const T* Part(int r) const {
    return reinterpret_cast<const T*>(c_->ptrs[r]);
  }
  // Publishes `mine`, waits for every rank, runs `read` (others' buffers stay valid), waits again.
  template <typename F>
  void Exchange(const std::byte* mine, F&& read) {
    c_->ptrs[rank_] = mine;
    c_->barrier.arrive_and_wait();
    read();
    c_->barrier.arrive_and_wait();
  }

  ThreadWorld* world_;
  const int rank_;
  const int channel_;
  ThreadWorld::Channel* c_;
  int dups_ = 0;
};

inline std::unique_ptr<comm::Communicator> ThreadWorld::Rank(int r) {
  return std::make_unique<ThreadCommunicator>(this, r, 1);
}

}  // namespace strata::engine::testing
