// Frozen parameters (Model::block_frozen_params, LoRA's base weights): chunks the engine keeps in
// the working precision, streams and prefetches like any block's params, and never trains.
//
// FreezeBlocks turns chosen blocks of a family into wholly frozen blocks: their chunk becomes the
// block's frozen chunk and they have no own params (a tied head then reads the frozen embedding,
// with no gradient for it). The reference, ZeroGradBlocks, trains the same blocks with their
// gradients (and the tied head's contribution to them) set to zero: with AdamW and no weight
// decay a zero gradient's update is exactly zero (m = v = 0), so those params never change and
// every other block sees the same numbers. The trained blocks' master weights must then match
// the reference bit for bit in every placement of the frozen chunks (resident, streamed from
// pinned host memory, streamed from NVMe), precision and accumulation.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <set>

#include "base/units.h"
#include "engine/engine.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/tiny_families.h"

namespace strata::engine {
namespace {

using testing::TrainOn;
using testing::TrainRun;

// Zeroes `bytes` of device memory in stream order (host backend: device memory is host memory).
Status ZeroOnStream(gpu::Stream& s, std::byte* data, size_t bytes) {
  return s.LaunchHost([data, bytes]() {
    std::memset(data, 0, bytes);
    return Status::Ok();
  });
}

int64_t Aligned64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

class FreezeBlocks final : public ForwardingModel {
 public:
  FreezeBlocks(Model* inner, std::set<int> frozen) : ForwardingModel(inner), frozen_(frozen) {}
  bool is_frozen(int b) const { return frozen_.count(b) > 0; }
  int64_t block_num_params(int b) const override {
    return is_frozen(b) ? 0 : inner()->block_num_params(b);
  }
  std::vector<std::vector<int64_t>> block_tensor_shapes(int b) const override {
    return is_frozen(b) ? std::vector<std::vector<int64_t>>{{0}} : inner()->block_tensor_shapes(b);
  }
  int64_t block_frozen_params(int b) const override {
    return is_frozen(b) ? inner()->block_num_params(b) : 0;
  }
  Status InitFrozenParams(int b, uint64_t seed, std::span<float> out) const override {
    return inner()->InitParams(b, seed, out);
  }
  Status InitParams(int b, uint64_t seed, std::span<float> out) const override {
    return inner()->InitParams(b, seed, out);
  }
  // The inner scratch, then room for the weight gradients the engine does not keep: the block's
  // own (frozen block) and its tied chunk's (frozen tied block).
  int64_t scratch_bytes(int b, MicroBatchShape s, DType p) const override {
    return Aligned64(inner()->scratch_bytes(b, s, p)) + Aligned64(DroppedGradElems(b) * SizeOf(p));
  }
  Status Forward(int b, const BlockBuffers& buf, gpu::Stream& s) override {
    return inner()->Forward(b, Inner(b, buf), s);
  }
  Status Backward(int b, const BlockBuffers& buf, gpu::Stream& s) override {
    STRATA_RETURN_IF_ERROR(CheckBlockBuffers(*this, b, buf, /*backward=*/true));
    return inner()->Backward(b, Inner(b, buf), s);
  }

 private:
  int64_t DroppedGradElems(int b) const {
    const int t = inner()->tied_block(b);
    return (is_frozen(b) ? inner()->block_num_params(b) : 0) +
           (t >= 0 && is_frozen(t) ? inner()->block_num_params(t) : 0);
  }
  // The inner model's buffers: a frozen block's params are its frozen chunk, the gradients the
  // engine does not keep go to the scratch's tail.
  BlockBuffers Inner(int b, const BlockBuffers& buf) const {
    BlockBuffers in = buf;
    const MicroBatchShape shape = buf.shape;
    const int64_t inner_scratch = Aligned64(inner()->scratch_bytes(b, shape, buf.precision));
    in.scratch = buf.scratch.subspan(0, inner_scratch);
    std::byte* tail = buf.scratch.data + inner_scratch;
    const size_t w = SizeOf(buf.precision);
    if (is_frozen(b)) {
      EXPECT_TRUE(buf.params.empty() && !buf.frozen_params.empty()) << "block " << b;
      in.params = buf.frozen_params;
      in.grads = TensorRef(tail, buf.precision, inner()->block_num_params(b));
      tail += inner()->block_num_params(b) * w;
    }
    in.frozen_params = {};
    const int t = inner()->tied_block(b);
    if (t >= 0 && is_frozen(t)) {
      EXPECT_TRUE(buf.tied_grads.empty()) << "block " << b;
      in.tied_grads = TensorRef(tail, buf.precision, inner()->block_num_params(t));
    }
    return in;
  }
  std::set<int> frozen_;
};

class ZeroGradBlocks final : public ForwardingModel {
 public:
  ZeroGradBlocks(Model* inner, std::set<int> zeroed) : ForwardingModel(inner), zeroed_(zeroed) {}
  Status Backward(int b, const BlockBuffers& buf, gpu::Stream& s) override {
    STRATA_RETURN_IF_ERROR(inner()->Backward(b, buf, s));
    if (zeroed_.count(b)) {
      STRATA_RETURN_IF_ERROR(ZeroOnStream(s, buf.grads.data, buf.grads.size_bytes()));
    }
    const int t = tied_block(b);
    if (t >= 0 && zeroed_.count(t)) {
      STRATA_RETURN_IF_ERROR(ZeroOnStream(s, buf.tied_grads.data, buf.tied_grads.size_bytes()));
    }
    return Status::Ok();
  }

 private:
  std::set<int> zeroed_;
};

std::vector<testing::Family> Families() { return testing::TinyFamilies(false); }

class FrozenParamsTest : public ::testing::TestWithParam<testing::Family> {
 protected:
  void SetUp() override {
    model_ = GetParam().make();
    swap_dir_ = std::filesystem::temp_directory_path() /
                fmt::format("strata_frozen_test_{}_{}", GetParam().name, ::getpid());
    std::filesystem::create_directories(swap_dir_);
  }
  void TearDown() override { std::filesystem::remove_all(swap_dir_); }

  EngineOptions Options(const Model& m, DType precision, ParamHome params, int accum,
                        uint64_t budget) const {
    EngineOptions o;
    o.precision = precision;
    o.micro_batch = {2, 16};
    o.grad_accum_steps = accum;
    o.optimizer.adamw().lr = 1e-2f;
    o.optimizer.adamw().weight_decay = 0.0f;  // a zero gradient's update is then exactly zero
    o.grad_clip_norm = 1.0f;
    o.seed = 7;
    o.placement.param_home = params;
    o.placement.optimizer_home = OptimizerHome::kHost;
    o.placement.nvme_paths = {swap_dir_.string()};
    o.placement.device_budget_bytes = budget;
    return o;
  }
  TrainRun Train(Model& m, const EngineOptions& o, int steps) {
    gpu::HostDeviceOptions d;
    d.max_random_delay_us = 100;  // late copies must not change a bit
    d.random_delay_seed = 5;
    auto device = gpu::CreateHostDevice(d);
    EXPECT_TRUE(device.ok());
    if (!device.ok()) return {};
    return TrainOn(**device, m, o, steps);
  }

  std::unique_ptr<Model> model_;
  std::filesystem::path swap_dir_;
};

TEST_P(FrozenParamsTest, TrainedBlocksMatchZeroGradientReferenceInEveryPlacement) {
  const int n = model_->num_blocks();
  // The embedding (tied by the head, which stays trained) and every layer but the first: more
  // frozen bytes than two streaming slots hold, so that they really stream.
  std::set<int> frozen_set = {0};
  for (int b = 2; b < n - 1; ++b) frozen_set.insert(b);
  const int frozen_chunks = static_cast<int>(frozen_set.size());
  ZeroGradBlocks reference_model(model_.get(), frozen_set);
  FreezeBlocks frozen_model(model_.get(), frozen_set);
  ASSERT_EQ(frozen_model.num_params() + frozen_model.frozen_params(), model_->num_params());
  for (DType precision : {DType::kBF16, DType::kF32}) {
    for (int accum : {1, 2}) {
      SCOPED_TRACE(fmt::format("{} accum {}", DTypeName(precision), accum));
      const TrainRun reference =
          Train(reference_model,
                Options(reference_model, precision, ParamHome::kDevice, accum, 64 << 20), 3);
      ASSERT_EQ(reference.results.size(), 3u);
      // The frozen blocks' params never moved in the reference.
      for (int b : frozen_set) {
        std::vector<float> init(model_->block_num_params(b));
        ASSERT_TRUE(model_->InitParams(b, 7, init).ok());
        EXPECT_EQ(reference.master[b], init) << "block " << b;
      }
      const uint64_t streaming = StreamingMinimumBytes(frozen_model, precision, {2, 16}, 2) + 1024;
      struct Placement {
        const char* name;
        ParamHome home;
        uint64_t budget;
      };
      for (const Placement& p : {Placement{"resident", ParamHome::kDevice, 64 << 20},
                                 Placement{"host", ParamHome::kHost, streaming},
                                 Placement{"nvme", ParamHome::kNvme, streaming}}) {
        SCOPED_TRACE(p.name);
        const TrainRun run =
            Train(frozen_model, Options(frozen_model, precision, p.home, accum, p.budget), 3);
        ASSERT_EQ(run.results.size(), 3u);
        testing::ExpectSameSteps(reference.results, run.results);
        for (int b = 0; b < n; ++b) {
          if (frozen_set.count(b)) {
            EXPECT_TRUE(run.master[b].empty()) << "block " << b;
            continue;
          }
          ASSERT_EQ(run.master[b].size(), reference.master[b].size());
          EXPECT_EQ(std::memcmp(run.master[b].data(), reference.master[b].data(),
                                run.master[b].size() * 4),
                    0)
              << "block " << b;
        }
        EXPECT_EQ(run.plan.frozen_params, frozen_model.frozen_params());
        if (p.home == ParamHome::kDevice) {
          EXPECT_EQ(run.plan.num_frozen_resident(), frozen_chunks);
        } else {
          // The frozen chunks stream through two slots; the trained ones are resident.
          EXPECT_EQ(run.plan.streaming_slots, 2);
          EXPECT_LT(run.plan.num_frozen_resident(), frozen_chunks);
          EXPECT_EQ(run.plan.num_resident(), n);
        }
        if (p.home == ParamHome::kNvme) {
          // Only the streamed frozen chunks live on NVMe: read at every use, written once by
          // Engine::Create and never by a step (the trained blocks are resident, their state in
          // host memory).
          uint64_t init_bytes = 0;
          for (const Plan::Block& blk : run.plan.blocks) {
            if (blk.frozen_params > 0 && !blk.frozen_resident) {
              init_bytes += blk.frozen_params * SizeOf(precision);
            }
          }
          EXPECT_GT(init_bytes, 0u);
          EXPECT_GE(run.counters.nvme_bytes_read, init_bytes * 3);
          EXPECT_EQ(run.counters.nvme_bytes_written, init_bytes);
        }
      }
    }
  }
}

TEST_P(FrozenParamsTest, CheckpointOfTheTrainedBlocksResumesBitIdentically) {
  // Frozen chunks and optimizer state on NVMe: the checkpoint holds the trained blocks only (a
  // frozen chunk comes from the model again); n steps, save, a fresh engine loads and runs m more
  // == n + m straight.
  const int n = 2, m = 2;
  FreezeBlocks frozen_model(model_.get(), {0, 2});
  EngineOptions o = Options(frozen_model, DType::kBF16, ParamHome::kNvme, 1,
                            StreamingMinimumBytes(frozen_model, DType::kBF16, {2, 16}, 2) + 1024);
  o.placement.optimizer_home = OptimizerHome::kNvme;
  auto device = gpu::CreateHostDevice({});
  ASSERT_TRUE(device.ok());
  const auto tokens = testing::RandomTokenVectors(2 * (n + m), o.micro_batch.tokens(), 5);
  auto run = [&](Engine& e, int from, int to) {
    for (int s = from; s < to; ++s) {
      const std::vector<MicroBatch> mbs = {{tokens[2 * s], tokens[2 * s + 1]}};
      auto r = e.Step(mbs);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
  };
  uint64_t straight = 0;
  {
    auto e = Engine::Create(&frozen_model, device->get(), o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    run(**e, 0, n + m);
    straight = *(*e)->MasterWeightsXxh3();
  }
  const std::string save_dir = (swap_dir_ / "ckpt").string();
  {
    auto e = Engine::Create(&frozen_model, device->get(), o);
    ASSERT_TRUE(e.ok());
    run(**e, 0, n);
    TrainerState state;
    state.step = n;
    const Status saved = (*e)->SaveCheckpoint(save_dir, state);
    ASSERT_TRUE(saved.ok()) << saved.ToString();
  }
  auto e = Engine::Create(&frozen_model, device->get(), o);
  ASSERT_TRUE(e.ok());
  TrainerState state;
  const Status loaded = (*e)->LoadCheckpoint(save_dir, &state);
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  EXPECT_EQ(state.step, n);
  run(**e, n, n + m);
  EXPECT_EQ(*(*e)->MasterWeightsXxh3(), straight);
}

INSTANTIATE_TEST_SUITE_P(Families, FrozenParamsTest, ::testing::ValuesIn(Families()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace strata::engine
