// Data parallelism in the engine (EngineOptions::comm): ranks as threads of this process
// (thread_communicator.h), each with its own host device and engine.
//   - one rank with a communicator trains bit for bit as without one, for every placement;
//   - N ranks with micro-batch B each match one rank accumulating N micro-batches of B;
//   - each rank keeps 1/N of the master weights, optimizer state, gradients and NVMe bytes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <thread>

#include "engine/engine.h"
#include "engine/plan/planner.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/thread_communicator.h"

namespace strata::engine {
namespace {

using testing::ExpectBitIdentical;
using testing::RandomTokenVectors;
using testing::ThreadWorld;
using testing::TrainOn;
using testing::TrainRun;

TEST(PartitionTest, SplitsIntoAlignedContiguousPartitionsThatCoverTheChunk) {
  for (int64_t n : {1, 63, 64, 1000, 13377, 65536}) {
    for (int ranks : {1, 2, 3, 4, 8}) {
      int64_t covered = 0;
      for (int r = 0; r < ranks; ++r) {
        const Partition p = PartitionOf(n, ranks, r);
        SCOPED_TRACE(fmt::format("n {} ranks {} rank {}", n, ranks, r));
        if (ranks > 1) {
          EXPECT_EQ(p.part_elems % kPartitionAlign, 0);
        }
        EXPECT_EQ(p.offset_elems, r * p.part_elems);
        EXPECT_EQ(p.padded_elems, p.part_elems * ranks);
        EXPECT_GE(p.padded_elems, n);
        EXPECT_LT(p.padded_elems - n, ranks * kPartitionAlign + ranks);
        EXPECT_EQ(p.own_elems, std::clamp<int64_t>(n - p.offset_elems, 0, p.part_elems));
        covered += p.own_elems;
      }
      EXPECT_EQ(covered, n);
    }
  }
  const Partition one = PartitionOf(1000, 1, 0);
  EXPECT_EQ(one.part_elems, 1000);
  EXPECT_EQ(one.padded_elems, 1000);
}

std::unique_ptr<Engine> CreateRankEngine(Model* model, gpu::Device* device,
                                         const EngineOptions& o) {
  auto engine = Engine::Create(model, device, o);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(*engine) : nullptr;
}

class DataParallelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // 8 blocks of ~13k params (tied embedding and head).
    auto model = models::GptModel::Create({256, 16, 6, 2, 32});
    ASSERT_TRUE(model.ok());
    model_ = std::move(*model);
    dir_ = std::filesystem::temp_directory_path() /
           ("strata_data_parallel_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  EngineOptions Options(DType precision, ParamHome params, OptimizerHome optim, int accum,
                        int ranks, int rank) {
    const std::string swap_dir = (dir_ / fmt::format("rank{}", rank)).string();
    std::filesystem::create_directories(swap_dir);
    // The overlap tests' options (streamed blocks mix with one resident layer), with a device
    // budget padded for the ranks' partitions and reduce-scatter buffers.
    EngineOptions o =
        testing::MixedPlacementOptions(*model_, precision, params, optim, accum, swap_dir);
    // The POSIX backend: ranks here are threads of one process, and each uring engine maps rings
    // that the kernel may place where another thread's unmapped ring was, an ordering
    // ThreadSanitizer cannot see. (strata train runs one engine per process; tests/mpi runs it
    // with io_uring.)
    o.io.kind = io::BackendKind::kPosix;
    o.placement.optimizer_device_fraction = device_fraction_;
    o.placement.schedule = schedule_;
    const int held = schedule_ == Schedule::kLayerMajor ? accum : 1;
    if (params != ParamHome::kDevice) {
      o.placement.device_budget_bytes =
          StreamingMinimumBytes(*model_, precision, o.micro_batch, 3, false, ranks, true, held) +
          PartitionOf(model_->block_num_params(1), ranks, 0).padded_elems * SizeOf(precision) +
          1024;
    }
    return o;
  }

  // Rank r of `ranks` trains `steps` steps taking micro-batches r*A .. r*A + A - 1 of each
  // global batch of ranks*A micro-batches (the stream TrainOn draws for one rank with ranks*A).
  std::vector<TrainRun> TrainRanks(int ranks, DType precision, ParamHome params,
                                   OptimizerHome optim, int accum, int steps) {
    ThreadWorld world(ranks);
    std::vector<TrainRun> runs(ranks);
    std::vector<std::thread> threads;
    const auto tokens = RandomTokenVectors(steps * ranks * accum * 2, 2 * 16, 99);
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        auto comm = world.Rank(r);
        EngineOptions o = Options(precision, params, optim, accum, ranks, r);
        o.comm = comm.get();
        auto device = gpu::CreateHostDevice({});
        ASSERT_TRUE(device.ok());
        auto engine = CreateRankEngine(model_.get(), device->get(), o);
        ASSERT_NE(engine, nullptr);
        TrainRun& run = runs[r];
        for (int s = 0; s < steps; ++s) {
          std::vector<MicroBatch> mbs;
          for (int i = 0; i < accum; ++i) {
            const size_t k = ((s * ranks + r) * accum + i) * 2;
            mbs.push_back({tokens[k], tokens[k + 1]});
          }
          auto result = engine->Step(mbs);
          ASSERT_TRUE(result.ok()) << result.status().ToString();
          run.results.push_back(*result);
        }
        for (int b = 0; b < model_->num_blocks(); ++b) {
          auto w = engine->MasterWeights(b);
          ASSERT_TRUE(w.ok()) << w.status().ToString();
          run.master.push_back(std::move(*w));
        }
        auto hash = engine->MasterWeightsXxh3();
        ASSERT_TRUE(hash.ok());
        run.hash = *hash;
        run.counters = engine->counters();
        run.plan = engine->plan();
      });
    }
    for (auto& t : threads) t.join();
    return runs;
  }

  TrainRun TrainOneRank(DType precision, ParamHome params, OptimizerHome optim, int accum,
                        int steps, bool with_comm) {
    auto comm = comm::CreateLocalCommunicator();
    EngineOptions o = Options(precision, params, optim, accum, 1, 0);
    if (with_comm) o.comm = comm.get();
    auto device = gpu::CreateHostDevice({});
    EXPECT_TRUE(device.ok());
    return TrainOn(**device, *model_, o, steps);
  }

  std::unique_ptr<models::GptModel> model_;
  std::filesystem::path dir_;
  double device_fraction_ = 0;  // PlacementOptions::optimizer_device_fraction of every run
  Schedule schedule_ = Schedule::kMicroBatchMajor;  // PlacementOptions::schedule of every run
};

TEST_F(DataParallelTest, OneRankWithACommunicatorIsBitIdenticalToNone) {
  for (DType precision : {DType::kBF16, DType::kF16}) {
    for (ParamHome params : {ParamHome::kDevice, ParamHome::kNvme}) {
      for (OptimizerHome optim : {OptimizerHome::kHost, OptimizerHome::kNvme}) {
        SCOPED_TRACE(fmt::format("{} params {} optimizer {}", DTypeName(precision),
                                 ParamHomeName(params), OptimizerHomeName(optim)));
        const TrainRun plain = TrainOneRank(precision, params, optim, 1, 4, false);
        const TrainRun with_comm = TrainOneRank(precision, params, optim, 1, 4, true);
        ExpectBitIdentical(plain, with_comm);
        EXPECT_TRUE(with_comm.plan.data_parallel);
      }
    }
  }
}

// The bound for a change of the number of ranks. The gradients themselves are the same bits (a
// sum of two fp32 values does not depend on its order), but the squared norm is summed per
// partition and then over ranks, and the tied embedding's four contributions are added in
// another order: the clipping coefficient and that block's gradient move by a few fp32 ulps, and
// the updates after them by a few ulps of lr-sized steps. Over 3 steps of lr 1e-2 a weight may
// then differ by well under 1e-5; a wrong partition, a missed rank or a stale gather moves
// weights by about lr = 1e-2.
constexpr float kRankChangeBound = 2e-5f;

// The largest |a - b| over every master weight of two runs of the same model.
float WorstDifference(const TrainRun& a, const TrainRun& b) {
  float worst = 0;
  EXPECT_EQ(a.master.size(), b.master.size());
  for (size_t blk = 0; blk < a.master.size() && blk < b.master.size(); ++blk) {
    EXPECT_EQ(a.master[blk].size(), b.master[blk].size());
    for (size_t i = 0; i < a.master[blk].size() && i < b.master[blk].size(); ++i) {
      worst = std::max(worst, std::abs(a.master[blk][i] - b.master[blk][i]));
    }
  }
  return worst;
}

TEST_F(DataParallelTest, TwoRanksMatchOneRankAccumulatingTheirMicroBatches) {
  for (DType precision : {DType::kBF16, DType::kF16}) {
    for (ParamHome params : {ParamHome::kDevice, ParamHome::kNvme}) {
      for (OptimizerHome optim : {OptimizerHome::kHost, OptimizerHome::kNvme}) {
        SCOPED_TRACE(fmt::format("{} params {} optimizer {}", DTypeName(precision),
                                 ParamHomeName(params), OptimizerHomeName(optim)));
        const TrainRun one = TrainOneRank(precision, params, optim, 2, 3, false);
        const std::vector<TrainRun> two = TrainRanks(2, precision, params, optim, 1, 3);
        ASSERT_EQ(two.size(), 2u);
        ASSERT_EQ(one.master.size(), two[0].master.size());
        // Every rank sees the same whole model.
        EXPECT_EQ(two[0].hash, two[1].hash);
        for (int s = 0; s < 3; ++s) {
          EXPECT_EQ(two[0].results[s].loss, two[1].results[s].loss);
          EXPECT_NEAR(two[0].results[s].loss, one.results[s].loss, 1e-5f) << "step " << s;
          EXPECT_NEAR(two[0].results[s].grad_norm, one.results[s].grad_norm,
                      1e-5 * one.results[s].grad_norm);
        }
        const float worst = WorstDifference(one, two[0]);
        EXPECT_LE(worst, kRankChangeBound);
        RecordProperty("worst_" + std::string(DTypeName(precision)), std::to_string(worst));
        std::printf("max |one rank - two ranks| = %g\n", worst);
      }
    }
  }
}

// The optimizer on the device (and half of it, the split) with two ranks: each rank updates its
// partition on its device and all-gathers the block; the result is the one-rank host-optimizer
// run's within the same bound as for the CPU homes (the update itself is cpu_optim's bit for bit,
// tests/engine/device_optimizer_home_test.cc), every rank sees the same model, and nothing of the
// gradient crosses to the host with everything on the device.
TEST_F(DataParallelTest, TwoRanksWithTheOptimizerOnTheDeviceMatchOneRank) {
  const TrainRun one =
      TrainOneRank(DType::kBF16, ParamHome::kDevice, OptimizerHome::kHost, 2, 3, false);
  for (const auto& [home, fraction] :
       {std::pair{OptimizerHome::kDevice, 1.0}, std::pair{OptimizerHome::kHost, 0.5}}) {
    SCOPED_TRACE(
        fmt::format("optimizer {} with {} on the device", OptimizerHomeName(home), fraction));
    device_fraction_ = home == OptimizerHome::kDevice ? 0.0 : fraction;
    const std::vector<TrainRun> two = TrainRanks(2, DType::kBF16, ParamHome::kDevice, home, 1, 3);
    ASSERT_EQ(two.size(), 2u);
    ASSERT_EQ(two[0].results.size(), 3u);
    EXPECT_GT(two[0].plan.device_optimizer_params, 0);
    EXPECT_EQ(two[0].hash, two[1].hash);
    if (fraction == 1.0) {
      EXPECT_EQ(two[0].counters.grad_bytes_d2h, 0u);
    }
    const float worst = WorstDifference(one, two[0]);
    EXPECT_LE(worst, kRankChangeBound);
    std::printf("max |one rank - two ranks, optimizer on the device| = %g\n", worst);
  }
  device_fraction_ = 0;
}

// Under the layer-major schedule every micro-batch's gradient is still reduce-scattered on its
// own and folded on the host in micro-batch order (the model is untied): the same bits.
TEST_F(DataParallelTest, LayerMajorTwoRanksMatchMicroBatchMajor) {
  for (ParamHome params : {ParamHome::kDevice, ParamHome::kNvme}) {
    SCOPED_TRACE(ParamHomeName(params));
    schedule_ = Schedule::kMicroBatchMajor;
    const auto a = TrainRanks(2, DType::kBF16, params, OptimizerHome::kNvme, 4, 2);
    schedule_ = Schedule::kLayerMajor;
    const auto b = TrainRanks(2, DType::kBF16, params, OptimizerHome::kNvme, 4, 2);
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(b[r].plan.layer_major());
      EXPECT_FALSE(b[r].plan.device_grad_accumulators);
      ExpectBitIdentical(a[r], b[r]);
    }
  }
}

TEST_F(DataParallelTest, TwoRankRunsAreBitIdentical) {
  const auto a = TrainRanks(2, DType::kBF16, ParamHome::kNvme, OptimizerHome::kNvme, 2, 3);
  const auto b = TrainRanks(2, DType::kBF16, ParamHome::kNvme, OptimizerHome::kNvme, 2, 3);
  for (int r = 0; r < 2; ++r) ExpectBitIdentical(a[r], b[r]);
}

TEST_F(DataParallelTest, EachRankKeepsItsShareOfHostAndNvmeState) {
  const TrainRun one =
      TrainOneRank(DType::kBF16, ParamHome::kNvme, OptimizerHome::kNvme, 2, 1, true);
  const auto two = TrainRanks(2, DType::kBF16, ParamHome::kNvme, OptimizerHome::kNvme, 1, 1);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const Plan& p = two[r].plan;
    EXPECT_EQ(p.ranks, 2);
    EXPECT_EQ(p.rank, r);
    // Half, within the padding of a partition (64 elements) and the 4 KiB alignment of each of
    // a block's four NVMe parts (params, master weights, m, v).
    const double slack = model_->num_blocks() * (4 * 4096.0 + 64 * 16);
    EXPECT_NEAR(p.nvme_bytes, one.plan.nvme_bytes / 2.0, slack);
    EXPECT_NEAR(p.host_grad_bytes, one.plan.host_grad_bytes / 2.0, slack);
    EXPECT_NEAR(two[r].counters.nvme_bytes_written, one.counters.nvme_bytes_written / 2.0,
                2 * slack);
  }
}

// Checkpoints: saved by 2 ranks (each writing its partitions into the shared files), resumed by
// 2 ranks bit for bit and by 1 rank within the bound of a change of N; saved by 1 rank and
// resumed by 2 the same way.
TEST_F(DataParallelTest, CheckpointsMoveBetweenRankCounts) {
  constexpr int kSteps = 4, kSaveAt = 2;
  const auto tokens = RandomTokenVectors(kSteps * 2 * 2, 2 * 16, 99);
  // Runs `ranks` ranks (A = 2 / ranks micro-batches each) for steps [from, to): loading `load`
  // first when not empty, saving into `save` after step `to` when not empty. Returns rank 0's
  // master weights.
  auto run = [&](int ranks, int from, int to, const std::string& load, const std::string& save) {
    ThreadWorld world(ranks);
    std::vector<std::vector<float>> master;
    std::vector<std::thread> threads;
    const int accum = 2 / ranks;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        auto comm = ranks > 1 ? world.Rank(r) : comm::CreateLocalCommunicator();
        EngineOptions o =
            Options(DType::kBF16, ParamHome::kNvme, OptimizerHome::kNvme, accum, ranks, r);
        o.comm = comm.get();
        auto device = gpu::CreateHostDevice({});
        ASSERT_TRUE(device.ok());
        auto engine = CreateRankEngine(model_.get(), device->get(), o);
        ASSERT_NE(engine, nullptr);
        Engine& e = *engine;
        if (!load.empty()) {
          TrainerState trainer;
          ASSERT_TRUE(e.LoadCheckpoint(load, &trainer).ok());
          EXPECT_EQ(trainer.step, from);
        }
        for (int s = from; s < to; ++s) {
          std::vector<MicroBatch> mbs;
          for (int i = 0; i < accum; ++i) {
            const size_t k = ((s * ranks + r) * accum + i) * 2;
            mbs.push_back({tokens[k], tokens[k + 1]});
          }
          ASSERT_TRUE(e.Step(mbs).ok());
        }
        if (!save.empty()) {
          TrainerState trainer;
          trainer.step = to;
          const Status saved = e.SaveCheckpoint(save, trainer);
          ASSERT_TRUE(saved.ok()) << saved.ToString();
        }
        std::vector<float> all;
        for (int b = 0; b < model_->num_blocks(); ++b) {
          auto w = e.MasterWeights(b);
          ASSERT_TRUE(w.ok());
          all.insert(all.end(), w->begin(), w->end());
        }
        if (r == 0) master.push_back(std::move(all));
      });
    }
    for (auto& t : threads) t.join();
    return master.empty() ? std::vector<float>() : master[0];
  };
  const std::string two_dir = (dir_ / "saved_by_two").string();
  const std::string one_dir = (dir_ / "saved_by_one").string();
  const std::vector<float> straight_two = run(2, 0, kSteps, "", "");
  const std::vector<float> straight_one = run(1, 0, kSteps, "", "");
  const std::vector<float> at_save_two = run(2, 0, kSaveAt, "", two_dir);
  run(1, 0, kSaveAt, "", one_dir);
  ASSERT_FALSE(straight_two.empty());
  ASSERT_EQ(straight_two.size(), straight_one.size());
  // The checkpoint holds whole tensors: a 2-rank save loads in 1 rank and back.
  const std::vector<float> two_then_two = run(2, kSaveAt, kSteps, two_dir, "");
  const std::vector<float> two_then_one = run(1, kSaveAt, kSteps, two_dir, "");
  const std::vector<float> one_then_two = run(2, kSaveAt, kSteps, one_dir, "");
  ASSERT_EQ(two_then_two.size(), straight_two.size());
  ASSERT_EQ(two_then_one.size(), straight_two.size());
  ASSERT_EQ(one_then_two.size(), straight_two.size());
  for (size_t i = 0; i < straight_two.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(two_then_two[i]), std::bit_cast<uint32_t>(straight_two[i]))
        << "element " << i;
    ASSERT_NEAR(two_then_one[i], straight_one[i], kRankChangeBound) << "element " << i;
    ASSERT_NEAR(one_then_two[i], straight_two[i], kRankChangeBound) << "element " << i;
  }
  // Training moved the weights past the bound, so the comparisons above can fail.
  float moved = 0;
  for (size_t i = 0; i < straight_two.size(); ++i) {
    moved = std::max(moved, std::abs(straight_two[i] - at_save_two[i]));
  }
  EXPECT_GT(moved, 100 * kRankChangeBound);
}

TEST_F(DataParallelTest, RefusesOptimizersWhoseStateDoesNotPartition) {
  ThreadWorld world(2);
  auto comm = world.Rank(0);
  EngineOptions o = Options(DType::kBF16, ParamHome::kDevice, OptimizerHome::kHost, 1, 2, 0);
  o.optimizer.kind = cpu_optim::OptimizerKind::kAdafactor;
  o.optimizer.config = cpu_optim::AdafactorConfig{};
  o.comm = comm.get();
  auto device = gpu::CreateHostDevice({});
  ASSERT_TRUE(device.ok());
  auto engine = Engine::Create(model_.get(), device->get(), o);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("adafactor"), std::string::npos);
}

}  // namespace
}  // namespace strata::engine
