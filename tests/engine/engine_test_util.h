// Helpers shared by the engine tests: deterministic token data, a training run's outcome, and a
// bit-for-bit comparison of two runs.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/plan/model.h"
#include "engine/plan/planner.h"
#include "gpu/device.h"

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
    const size_t w = SizeOf(buf.grads.dtype);
    const gpu::DeviceSpan g{buf.grads.data + block_num_params(b) / 2 * w, w};
    return s.Convert(g, buf.grads.dtype, g, buf.grads.dtype, 1, INFINITY);
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

// Same losses (bit for bit) and skips, step by step.
inline void ExpectSameSteps(const std::vector<StepResult>& a, const std::vector<StepResult>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t s = 0; s < a.size(); ++s) {
    EXPECT_EQ(std::bit_cast<uint32_t>(a[s].loss), std::bit_cast<uint32_t>(b[s].loss))
        << "step " << s;
    EXPECT_EQ(a[s].skipped, b[s].skipped) << "step " << s;
  }
}

// Same losses and skips step by step, same master weights bit for bit, same hash.
inline void ExpectBitIdentical(const TrainRun& a, const TrainRun& b) {
  ExpectSameSteps(a.results, b.results);
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

// A change of a training run that changes nothing in exact arithmetic, only the order of its
// sums (for tests of tolerances).
struct Reordering {
  // Empty, or a permutation of the grad_accum_steps * batch_size sequences of a step: each
  // step's sequences (tokens and targets alike) are dealt to its micro-batches in this order,
  // micro-batch i, row b taking the step's sequence sequence_order[i * batch_size + b].
  std::vector<int> sequence_order;
  // Empty, or a permutation of the vocabulary: token (and target) t is fed as token_ids[t], for
  // a model whose embedding rows and head columns are permuted to match.
  std::vector<int32_t> token_ids;
};

// Trains `steps` optimizer steps of `model` on `device` from a fixed token stream (seed 99; each
// micro-batch takes two vectors, tokens and targets). `before_step(s)`, when given, runs before
// step s (to arm a fault). `reordering` changes the stream as it says. Returns the losses per
// step, the master weights per block, their xxh3, the counters and the plan; a failing call is a
// test failure and ends the run early (the TrainRun then holds what was done).
inline TrainRun TrainOn(gpu::Device& device, Model& model, const EngineOptions& o, int steps,
                        const std::function<void(int)>& before_step = {},
                        const Reordering& reordering = {}) {
  TrainRun run;
  auto engine = Engine::Create(&model, &device, o);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return run;
  Engine& e = **engine;
  auto tokens = RandomTokenVectors(steps * o.grad_accum_steps * 2, o.micro_batch.tokens(), 99);
  if (const std::vector<int>& order = reordering.sequence_order; !order.empty()) {
    const int B = o.micro_batch.batch_size, A = o.grad_accum_steps;
    const int64_t T = o.micro_batch.seq_len;
    std::vector<int> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int> identity(static_cast<size_t>(A) * B);
    std::iota(identity.begin(), identity.end(), 0);
    EXPECT_EQ(sorted, identity) << "sequence_order is not a permutation of a step's sequences";
    if (sorted != identity) return run;
    const auto dealt = tokens;
    for (int s = 0; s < steps; ++s) {
      for (int j = 0; j < A * B; ++j) {
        for (int half : {0, 1}) {  // tokens, targets
          const auto& src = dealt[(s * A + order[j] / B) * 2 + half];
          std::copy_n(src.begin() + order[j] % B * T, T,
                      tokens[(s * A + j / B) * 2 + half].begin() + j % B * T);
        }
      }
    }
  }
  if (const std::vector<int32_t>& ids = reordering.token_ids; !ids.empty()) {
    EXPECT_EQ(ids.size(), static_cast<size_t>(model.vocab_size()));
    if (ids.size() != static_cast<size_t>(model.vocab_size())) return run;
    for (auto& v : tokens) {
      for (auto& t : v) t = ids[t];
    }
  }
  size_t k = 0;
  for (int s = 0; s < steps; ++s) {
    if (before_step) before_step(s);
    std::vector<MicroBatch> mbs;
    for (int i = 0; i < o.grad_accum_steps; ++i, k += 2) mbs.push_back({tokens[k], tokens[k + 1]});
    auto r = e.Step(mbs);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return run;
    run.results.push_back(*r);
  }
  for (int b = 0; b < model.num_blocks(); ++b) {
    auto w = e.MasterWeights(b);
    EXPECT_TRUE(w.ok()) << w.status().ToString();
    if (!w.ok()) return run;
    run.master.push_back(std::move(*w));
  }
  auto hash = e.MasterWeightsXxh3();
  EXPECT_TRUE(hash.ok()) << hash.status().ToString();
  if (hash.ok()) run.hash = *hash;
  run.counters = e.counters();
  run.plan = e.plan();
  return run;
}

// The optimizers whose state is element-wise (the kinds that also run on the device), with
// hyper-parameters that move a tiny GPT in a few steps.
inline std::vector<cpu_optim::AnyOptimizer> ElementwiseOptimizers() {
  using cpu_optim::OptimizerKind;
  std::vector<cpu_optim::AnyOptimizer> all;
  cpu_optim::AdamWConfig adam{.lr = 1e-2f, .weight_decay = 0.01f};
  all.push_back({OptimizerKind::kAdamW, adam});
  adam.decoupled_weight_decay = false;
  all.push_back({OptimizerKind::kAdam, adam});
  all.push_back({OptimizerKind::kLion, cpu_optim::LionConfig{.lr = 1e-3f, .weight_decay = 0.1f}});
  all.push_back({OptimizerKind::kSgd, cpu_optim::SgdConfig{.lr = 0.1f, .momentum = 0.9f}});
  all.push_back({OptimizerKind::kAdagrad, cpu_optim::AdagradConfig{.lr = 0.05f}});
  return all;
}

// The options the overlap tests train their 8-block model with (AdamW lr 1e-2, weight decay
// 0.01, clipping at 1, micro-batches of 2 x 16 tokens, seed 7): with params on the device
// everything is resident in a 64 MiB budget; otherwise the budget holds 3 streaming slots and
// one resident layer, so resident and streamed blocks mix.
inline EngineOptions MixedPlacementOptions(const Model& model, DType precision, ParamHome params,
                                           OptimizerHome optim, int accum,
                                           const std::string& swap_dir) {
  EngineOptions o;
  o.precision = precision;
  o.micro_batch = {2, 16};
  o.grad_accum_steps = accum;
  o.optimizer.adamw().lr = 1e-2f;
  o.optimizer.adamw().weight_decay = 0.01f;
  o.grad_clip_norm = 1.0f;
  o.seed = 7;
  o.placement.param_home = params;
  o.placement.optimizer_home = optim;
  o.placement.nvme_paths = {swap_dir};
  o.placement.device_budget_bytes =
      params == ParamHome::kDevice ? (64 << 20)
                                   : StreamingMinimumBytes(model, precision, o.micro_batch, 3) +
                                         model.block_num_params(1) * SizeOf(precision) + 1024;
  o.io.kind = io::BackendKind::kAuto;
  return o;
}

}  // namespace strata::engine::testing
