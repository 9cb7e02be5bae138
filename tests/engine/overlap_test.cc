// The overlapped engine computes exactly what the sequential one does: for every placement,
// precision and accumulation, with copies and events completing late at random, with the update
// during backward (speculated, validated, rolled back), and with gradient buckets poisoned when
// they return to their pool.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>

#include "engine/engine.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "tests/engine/engine_test_util.h"

namespace strata::engine {
namespace {

using testing::ExpectBitIdentical;
using testing::MixedPlacementOptions;
using testing::OverflowInjector;
using testing::RandomTokenVectors;
using testing::TrainOn;
using testing::TrainRun;

// Every master-weight and optimizer-state tensor of a checkpoint, file by file (name -> bytes),
// and the run's step results and counters.
struct StateSnapshot {
  std::map<std::string, std::string> files;
  std::vector<StepResult> results;
  EngineCounters counters;
};

class OverlapTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // 8 blocks of ~13k params: with 3 streaming slots most of them stream.
    auto model = models::GptModel::Create({256, 16, 6, 2, 32});
    ASSERT_TRUE(model.ok());
    model_ = std::move(*model);
    swap_dir_ = std::filesystem::temp_directory_path() /
                ("strata_overlap_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(swap_dir_);
  }
  void TearDown() override { std::filesystem::remove_all(swap_dir_); }

  EngineOptions Options(DType precision, ParamHome params, OptimizerHome optim, int accum) {
    return MixedPlacementOptions(*model_, precision, params, optim, accum, swap_dir_.string());
  }

  // Trains `steps` steps on a fixed token stream; the device delays every operation by up to
  // max_delay_us (0: no delay) and throttles copies when copy_bps > 0.
  TrainRun Train(const EngineOptions& o, int steps, int64_t max_delay_us = 0, double copy_bps = 0,
                 Model* model = nullptr) {
    gpu::HostDeviceOptions d;
    d.max_random_delay_us = max_delay_us;
    d.random_delay_seed = 12345;
    d.copy_bytes_per_second = copy_bps;
    auto device = gpu::CreateHostDevice(d);
    EXPECT_TRUE(device.ok());
    if (!device.ok()) return {};
    return TrainOn(**device, model ? *model : *model_, o, steps);
  }

  // Trains `steps` steps of o (on `model` when given, before_step(s) before step s) and saves a
  // checkpoint: its tensor files, the step results and the counters.
  StateSnapshot Snapshot(const EngineOptions& o, int steps, int64_t max_delay_us = 0,
                         Model* model = nullptr, const std::function<void(int)>& before_step = {}) {
    StateSnapshot snap;
    gpu::HostDeviceOptions d;
    d.max_random_delay_us = max_delay_us;
    d.random_delay_seed = 12345;
    auto device = gpu::CreateHostDevice(d);
    auto engine = Engine::Create(model ? model : model_.get(), device->get(), o);
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    if (!engine.ok()) return snap;
    Engine& e = **engine;
    const auto tokens =
        RandomTokenVectors(steps * o.grad_accum_steps * 2, o.micro_batch.tokens(), 99);
    size_t k = 0;
    for (int s = 0; s < steps; ++s) {
      if (before_step) before_step(s);
      std::vector<MicroBatch> mbs;
      for (int i = 0; i < o.grad_accum_steps; ++i, k += 2)
        mbs.push_back({tokens[k], tokens[k + 1]});
      auto r = e.Step(mbs);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (!r.ok()) return snap;
      snap.results.push_back(*r);
    }
    const auto save = swap_dir_ / ("checkpoints" + std::to_string(saves_++));
    std::string dir;
    const Status saved = e.SaveCheckpoint(save.string(), {}, {}, &dir);
    EXPECT_TRUE(saved.ok()) << saved.ToString();
    for (const auto& f : std::filesystem::directory_iterator(dir)) {
      if (f.path().extension() != ".safetensors") continue;
      std::ifstream in(f.path(), std::ios::binary);
      snap.files[f.path().filename().string()] = {std::istreambuf_iterator<char>(in), {}};
    }
    EXPECT_GE(snap.files.size(), 2u) << "master weights and optimizer state";
    snap.counters = e.counters();
    return snap;
  }

  // Same losses and skips step by step, and the same tensor files, byte for byte.
  static void ExpectSameState(const StateSnapshot& a, const StateSnapshot& b) {
    testing::ExpectSameSteps(a.results, b.results);
    ASSERT_EQ(a.files.size(), b.files.size());
    for (const auto& [name, bytes] : a.files) {
      ASSERT_TRUE(b.files.contains(name)) << name;
      EXPECT_TRUE(bytes == b.files.at(name)) << name << " differs";
    }
  }

  int saves_ = 0;

  std::unique_ptr<models::GptModel> model_;
  std::filesystem::path swap_dir_;
};

TEST_F(OverlapTest, EveryPlacementPrecisionAndAccumulationMatchesTheSequentialResidentRun) {
  for (DType precision : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (int accum : {1, 2}) {
      auto ref_options = Options(precision, ParamHome::kDevice, OptimizerHome::kHost, accum);
      ref_options.overlap = false;
      const TrainRun reference = Train(ref_options, 6);
      ASSERT_EQ(reference.plan.num_resident(), model_->num_blocks());
      // Training did something.
      ASSERT_NE(reference.results.front().loss, reference.results.back().loss);
      for (ParamHome params : {ParamHome::kDevice, ParamHome::kHost, ParamHome::kNvme}) {
        for (OptimizerHome optim : {OptimizerHome::kHost, OptimizerHome::kNvme}) {
          SCOPED_TRACE(fmt::format("{} accum {} params {} optimizer {}", DTypeName(precision),
                                   accum, ParamHomeName(params), OptimizerHomeName(optim)));
          const TrainRun run = Train(Options(precision, params, optim, accum), 6);
          if (params != ParamHome::kDevice) {
            EXPECT_GE(run.plan.num_resident(), 1);
            EXPECT_LT(run.plan.num_resident(), model_->num_blocks() - 2);
            EXPECT_EQ(run.plan.prefetch_depth, 2);
          }
          EXPECT_LE(run.counters.device_peak_bytes, run.plan.device_budget_bytes);
          ExpectBitIdentical(reference, run);
        }
      }
    }
  }
}

TEST_F(OverlapTest, LateCopiesAndEventsStillGiveBitIdenticalResults) {
  // Every copy, conversion and kernel starts up to 300 us late, at random, and copies run at a
  // PCIe-like pace for this size: work whose event wait is missing would run too early.
  for (DType precision : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(std::string(DTypeName(precision)));
    auto ref_options = Options(precision, ParamHome::kDevice, OptimizerHome::kHost, 2);
    ref_options.overlap = false;
    const TrainRun reference = Train(ref_options, 4);
    for (ParamHome params : {ParamHome::kHost, ParamHome::kNvme}) {
      auto o = Options(precision, params, OptimizerHome::kNvme, 2);
      o.test_hooks.poison_released_buckets = true;
      const TrainRun delayed = Train(o, 4, /*max_delay_us=*/300, /*copy_bps=*/2e8);
      ExpectBitIdentical(reference, delayed);
      for (const auto& r : delayed.results) EXPECT_FALSE(r.skipped);
    }
  }
}

TEST_F(OverlapTest, OffloadedBoundaryActivationsGiveBitIdenticalResultsOnLessDeviceMemory) {
  for (DType precision : {DType::kBF16, DType::kF32}) {
    for (int accum : {2}) {
      SCOPED_TRACE(fmt::format("{} accum {}", DTypeName(precision), accum));
      auto ref_options = Options(precision, ParamHome::kDevice, OptimizerHome::kHost, accum);
      ref_options.overlap = false;
      const TrainRun reference = Train(ref_options, 2);
      // Streamed params (loads of params and activations share the H2D stream) and resident
      // ones (in backward the activation loads are the only H2D traffic).
      for (ParamHome params : {ParamHome::kNvme, ParamHome::kDevice}) {
        auto o = Options(precision, params, OptimizerHome::kNvme, accum);
        o.placement.offload_activations = true;
        if (params != ParamHome::kDevice) {
          o.placement.device_budget_bytes =
              StreamingMinimumBytes(*model_, precision, o.micro_batch, 3, /*offload=*/true) + 1024;
        }
        // Slow copies (a 4 KiB activation takes 20 ms with resident params) and random delays:
        // a load back that is not waited for is read before it lands.
        const TrainRun offloaded = Train(o, 2, /*max_delay_us=*/1000,
                                         /*copy_bps=*/params == ParamHome::kDevice ? 2e5 : 2e7);
        EXPECT_TRUE(offloaded.plan.offload_activations);
        if (params != ParamHome::kDevice) {
          EXPECT_LT(offloaded.counters.device_peak_bytes,
                    StreamingMinimumBytes(*model_, precision, o.micro_batch, 3, false));
        }
        ExpectBitIdentical(reference, offloaded);
      }
    }
  }
}

TEST_F(OverlapTest, PoisonedBucketsAreNeverReadBeforeTheirCopyLands) {
  // Two buckets only, so each is reused at once; NaN poison on release would make any early
  // read or early reuse a non-finite gradient (a skipped step) and different weights.
  auto ref_options = Options(DType::kBF16, ParamHome::kNvme, OptimizerHome::kNvme, 2);
  ref_options.overlap = false;
  const TrainRun reference = Train(ref_options, 4);
  auto o = Options(DType::kBF16, ParamHome::kNvme, OptimizerHome::kNvme, 2);
  o.placement.host_grad_buckets = 2;
  o.test_hooks.poison_released_buckets = true;
  const TrainRun run = Train(o, 4, /*max_delay_us=*/200);
  // Every block's bucket of every micro-batch was poisoned after its fold.
  EXPECT_EQ(run.counters.buckets_poisoned, 4u * 2u * model_->num_blocks());
  for (const auto& r : run.results) EXPECT_FALSE(r.skipped);
  ExpectBitIdentical(reference, run);
}

TEST_F(OverlapTest, UpdateDuringBackwardIsTheUpdateAfterBackwardBitForBit) {
  // Clipping never, on every step, and on some steps; bf16, fp16 and fp32; state in host memory
  // and on NVMe; the prediction of clipping and speculation on every block regardless. Master
  // weights and every optimizer state tensor equal the update after backward's, bit for bit.
  const TrainRun probe = Train(Options(DType::kF32, ParamHome::kHost, OptimizerHome::kHost, 2), 6);
  std::vector<double> norms;
  for (const auto& r : probe.results) norms.push_back(r.grad_norm);
  std::sort(norms.begin(), norms.end());
  const float some = static_cast<float>(norms[norms.size() / 2]);  // clips about half the steps
  int rollbacks = 0;
  for (DType precision : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (auto [params, optim] : {std::pair{ParamHome::kHost, OptimizerHome::kHost},
                                 std::pair{ParamHome::kNvme, OptimizerHome::kNvme},
                                 std::pair{ParamHome::kHost, OptimizerHome::kNvme}}) {
      for (float clip : {0.0f, 1e-6f, some}) {
        for (bool always : {false, true}) {
          SCOPED_TRACE(fmt::format("{} params {} optimizer {} clip {} always {}",
                                   DTypeName(precision), ParamHomeName(params),
                                   OptimizerHomeName(optim), clip, always));
          auto after = Options(precision, params, optim, 2);
          after.grad_clip_norm = clip;
          auto during = after;
          during.update_during_backward = true;
          // Forced: every block speculates and runs before the verdict, so every step that
          // clips rolls back (and fails here if the rollback did not restore).
          during.test_hooks.always_speculate = always;
          during.test_hooks.finish_speculation_before_verdict = always;
          const StateSnapshot a = Snapshot(after, 6), d = Snapshot(during, 6, 100);
          ExpectSameState(a, d);
          EXPECT_EQ(a.counters.params_updated_during_backward, 0u);
          EXPECT_EQ(a.counters.rollback_steps, 0u);
          uint64_t rolled = 0;
          for (size_t s = 0; s < d.results.size(); ++s) {
            const StepResult& r = d.results[s];
            const bool clipped = clip > 0 && r.grad_norm > clip;
            rolled += r.rolled_back;
            // A rollback only where the step clipped; with speculation forced, every such step.
            if (r.rolled_back) {
              EXPECT_TRUE(clipped) << "step " << s;
            }
            if (always) {
              EXPECT_EQ(r.rolled_back, clipped) << "step " << s;
            }
            // Updates that ran during backward stood only on a step that did not clip.
            if (r.params_updated_during_backward > 0) {
              EXPECT_FALSE(clipped) << "step " << s;
            }
            // Forced: some ran before the verdict (at most the queue depth waits at a time, and
            // with NVMe the pipeline's buffers' worth).
            if (always && !clipped) {
              EXPECT_GT(r.params_updated_during_backward, 0) << "step " << s;
            }
          }
          EXPECT_EQ(d.counters.rollback_steps, rolled);
          if (clip == 1e-6f && !always) {
            EXPECT_EQ(rolled, 0u) << "predicted: no speculation";
          }
          rollbacks += static_cast<int>(rolled);
        }
      }
    }
  }
  EXPECT_GT(rollbacks, 0);
}

TEST_F(OverlapTest, UpdateDuringBackwardRollsBackOnAnFp16Overflow) {
  // An inf in block 0's gradient, the last one folded: every other block was updated
  // speculatively by then and must be restored; the step is skipped as the update after
  // backward skips it.
  OverflowInjector model(model_.get());
  for (auto [params, optim] : {std::pair{ParamHome::kHost, OptimizerHome::kHost},
                               std::pair{ParamHome::kNvme, OptimizerHome::kNvme}}) {
    SCOPED_TRACE(
        fmt::format("params {} optimizer {}", ParamHomeName(params), OptimizerHomeName(optim)));
    auto after = Options(DType::kF16, params, optim, 2);
    after.loss_scaler.initial_scale = 1024.0f;
    after.grad_clip_norm = 0;
    auto during = after;
    during.update_during_backward = true;
    // Every speculative update runs before the verdict, so that step 2 rolls back whatever the
    // load on the machine (without it, a starved update thread may not have started any block
    // by then: no rollback to check, and the test failed once under ctest -j2).
    during.test_hooks.finish_speculation_before_verdict = true;
    auto arm = [&](int s) {
      if (s == 2) {
        model.Arm(0);
      } else {
        model.Disarm();
      }
    };
    const StateSnapshot a = Snapshot(after, 4, 0, &model, arm),
                        d = Snapshot(during, 4, 100, &model, arm);
    ExpectSameState(a, d);
    ASSERT_EQ(d.results.size(), 4u);
    EXPECT_TRUE(d.results[2].skipped);
    EXPECT_TRUE(d.results[2].rolled_back);
    EXPECT_EQ(d.counters.rollback_steps, 1u);
    EXPECT_GT(d.results[3].params_updated_during_backward, 0);
  }
}

TEST_F(OverlapTest, UpdateDuringBackwardWithASmallBackupAreaWaitsForTheVerdict) {
  // A backup area of one block: the other speculative updates wait for the verdict and then run
  // (or skip and rerun on a rollback) without a copy.
  for (float clip : {0.0f, 1e-6f}) {
    auto after = Options(DType::kBF16, ParamHome::kHost, OptimizerHome::kHost, 2);
    after.grad_clip_norm = clip;
    auto during = after;
    during.update_during_backward = true;
    during.test_hooks.always_speculate = true;
    during.speculation_backup_bytes = 1;
    const StateSnapshot a = Snapshot(after, 4), d = Snapshot(during, 4, 100);
    ExpectSameState(a, d);
    for (const StepResult& r : d.results) {
      EXPECT_LE(r.params_updated_during_backward, 0) << "nothing fits a 1-byte area";
      EXPECT_FALSE(r.rolled_back);
    }
  }
}

TEST_F(OverlapTest, Fp16OverflowInAnyBlockSkipsEveryBlocksUpdate) {
  OverflowInjector model(model_.get());
  const int n = model.num_blocks();
  for (int block : {0, n / 2, n - 1}) {
    SCOPED_TRACE("overflow in block " + std::to_string(block));
    auto o = Options(DType::kF16, ParamHome::kNvme, OptimizerHome::kNvme, 2);
    o.loss_scaler.initial_scale = 1024.0f;
    auto device = gpu::CreateHostDevice({});
    auto engine = Engine::Create(&model, device->get(), o);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    auto& e = **engine;
    const auto tokens = RandomTokenVectors(12, o.micro_batch.tokens(), 5);
    auto batch = [&](int s) {
      return std::vector<MicroBatch>{{tokens[4 * s], tokens[4 * s + 1]},
                                     {tokens[4 * s + 2], tokens[4 * s + 3]}};
    };
    model.Disarm();
    auto r0 = e.Step(batch(0));  // an applied step first: its update is in flight
    ASSERT_TRUE(r0.ok());
    ASSERT_FALSE(r0->skipped);
    std::vector<std::vector<float>> before;
    for (int b = 0; b < n; ++b) before.push_back(*e.MasterWeights(b));
    model.Arm(block);
    auto r1 = e.Step(batch(1));
    ASSERT_TRUE(r1.ok()) << r1.status().ToString();
    EXPECT_TRUE(r1->skipped);
    EXPECT_EQ(e.loss_scale(), 512.0f);
    for (int b = 0; b < n; ++b) {
      const auto after = *e.MasterWeights(b);
      for (size_t i = 0; i < after.size(); ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(after[i]), std::bit_cast<uint32_t>(before[b][i]))
            << "block " << b << " element " << i;
      }
    }
    model.Disarm();
    auto r2 = e.Step(batch(2));
    ASSERT_TRUE(r2.ok());
    EXPECT_FALSE(r2->skipped);
    EXPECT_NE((*e.MasterWeights(block))[0], before[block][0]);
  }
}

TEST_F(OverlapTest, KMicroBatchesOfBEqualOneBatchOfKTimesB) {
  // With eps = 1 AdamW's first update is ~ lr * g, linear in the gradient, so the weights
  // differ only by the rounding of the gradient sums.
  auto accumulated = Options(DType::kF32, ParamHome::kNvme, OptimizerHome::kNvme, 3);
  accumulated.micro_batch = {2, 16};
  accumulated.optimizer.adamw().eps = 1.0f;
  accumulated.grad_clip_norm = 0;
  auto whole = accumulated;
  whole.grad_accum_steps = 1;
  whole.micro_batch = {6, 16};
  whole.placement.device_budget_bytes =
      StreamingMinimumBytes(*model_, DType::kF32, whole.micro_batch, 3) + 1024;

  const auto tokens = RandomTokenVectors(6, accumulated.micro_batch.tokens(), 21);
  std::vector<int32_t> all_tokens, all_targets;
  for (int i = 0; i < 3; ++i) {
    all_tokens.insert(all_tokens.end(), tokens[2 * i].begin(), tokens[2 * i].end());
    all_targets.insert(all_targets.end(), tokens[2 * i + 1].begin(), tokens[2 * i + 1].end());
  }
  auto device = gpu::CreateHostDevice({});
  auto a = Engine::Create(model_.get(), device->get(), accumulated);
  auto w = Engine::Create(model_.get(), device->get(), whole);
  ASSERT_TRUE(a.ok() && w.ok());
  const std::vector<MicroBatch> three = {
      {tokens[0], tokens[1]}, {tokens[2], tokens[3]}, {tokens[4], tokens[5]}};
  const std::vector<MicroBatch> one = {{all_tokens, all_targets}};
  auto ra = (*a)->Step(three);
  auto rw = (*w)->Step(one);
  ASSERT_TRUE(ra.ok() && rw.ok());
  EXPECT_NEAR(ra->loss, rw->loss, 1e-5 * std::abs(rw->loss));
  EXPECT_NEAR(ra->grad_norm, rw->grad_norm, 1e-5 * rw->grad_norm);
  double max_update = 0;
  for (int b = 0; b < model_->num_blocks(); ++b) {
    std::vector<float> init(model_->block_num_params(b));
    ASSERT_TRUE(model_->InitParams(b, accumulated.seed, init).ok());
    const auto pa = *(*a)->MasterWeights(b);
    const auto pw = *(*w)->MasterWeights(b);
    for (size_t i = 0; i < pa.size(); ++i) {
      max_update = std::max(max_update, std::abs(double{pw[i]} - init[i]));
      // The update is ~1e-2 * g; rounding of the gradient sums moves it by far less than 1e-6.
      ASSERT_NEAR(pa[i], pw[i], 1e-6) << "block " << b << " element " << i;
    }
  }
  EXPECT_GT(max_update, 1e-5);  // the step really moved the weights
}

}  // namespace
}  // namespace strata::engine
