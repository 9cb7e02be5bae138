// Helpers shared by the engine tests: deterministic token data, a training run's outcome, and a
// bit-for-bit comparison of two runs.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "engine/engine.h"
#include "engine/model.h"

namespace strata::engine::testing {

// `num_vectors` vectors of `count` byte-valued token ids (0..255), deterministic from `seed`.
inline std::vector<std::vector<int32_t>> RandomTokenVectors(int num_vectors, int64_t count,
                                                            uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> v(num_vectors, std::vector<int32_t>(count));
  for (auto& t : v) {
    for (auto& x : t) x = static_cast<int32_t>(rng() % 256);
  }
  return v;
}

// Forwards to a model and, when armed, makes one element of one block's gradient non-finite
// right after that block's backward, in stream order (like a real overflow), through
// Stream::Convert: x * inf is +-inf (NaN for x == 0) on either backend, with no host access to
// device memory.
class OverflowInjector final : public ForwardingModel {
 public:
  using ForwardingModel::ForwardingModel;
  void Arm(int block) { armed_block_ = block; }
  void Disarm() { armed_block_ = -1; }
  Status Backward(int b, const BlockBuffers& buf, gpu::Stream& s) override {
    STRATA_RETURN_IF_ERROR(inner()->Backward(b, buf, s));
    if (b != armed_block_) return Status::Ok();
    const gpu::DeviceSpan g{reinterpret_cast<std::byte*>(buf.grads + block_num_params(b) / 2), 4};
    return s.Convert(g, DType::kF32, g, DType::kF32, 1, INFINITY);
  }

 private:
  int armed_block_ = -1;
};

struct TrainRun {
  std::vector<std::vector<float>> master;  // per block, after the last step
  uint64_t hash = 0;                       // MasterWeightsXxh3 (0 when not taken)
  EngineCounters counters;
  Plan plan;
  std::vector<StepResult> results;
};

// Same losses and skips step by step, same master weights bit for bit, same hash.
inline void ExpectBitIdentical(const TrainRun& a, const TrainRun& b) {
  ASSERT_EQ(a.results.size(), b.results.size());
  for (size_t s = 0; s < a.results.size(); ++s) {
    EXPECT_EQ(std::bit_cast<uint32_t>(a.results[s].loss),
              std::bit_cast<uint32_t>(b.results[s].loss))
        << "step " << s;
    EXPECT_EQ(a.results[s].skipped, b.results[s].skipped) << "step " << s;
  }
  ASSERT_EQ(a.master.size(), b.master.size());
  for (size_t blk = 0; blk < a.master.size(); ++blk) {
    ASSERT_EQ(a.master[blk].size(), b.master[blk].size());
    for (size_t i = 0; i < a.master[blk].size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(a.master[blk][i]),
                std::bit_cast<uint32_t>(b.master[blk][i]))
          << "block " << blk << " element " << i;
    }
  }
  EXPECT_EQ(a.hash, b.hash);
}

}  // namespace strata::engine::testing
