// The layer-major schedule (PlacementOptions::schedule, engine/layer_major_step.cc) against the
// micro-batch-major one: the same master weights bit for bit for untied GPT and Llama models in
// every params home, precision and number of micro-batches; a tied chunk's gradient within the
// bound of its reordered fp32 sum; params loaded once per pass and gradients sent D2H once per
// step (the byte counters); fp16 overflow, checkpoints and the update during backward under it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>

#include "engine/engine.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/tiny_families.h"

namespace strata::engine {
namespace {

using testing::ExpectBitIdentical;
using testing::TrainOn;
using testing::TrainRun;

std::unique_ptr<Model> UntiedGpt() {
  models::GptShape s{256, 16, 5, 2, 32};
  s.tie_embeddings = false;
  return std::unique_ptr<Model>(*models::GptModel::Create(s));
}
std::unique_ptr<Model> UntiedLlama() {
  return std::unique_ptr<Model>(*models::LlamaModel::Create(testing::TinyLlama(false)));
}

class LayerMajorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           fmt::format("strata_layer_major_test_{}", ::getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // The overlap tests' options (AdamW, clipping at 1, 2 x 16 tokens), in `schedule`: with
  // params on the device everything is resident; otherwise the budget holds the schedule's
  // fixed regions, 3 streaming slots and one resident layer, so streamed and resident blocks
  // mix in both schedules. NVMe params come with the optimizer state on NVMe.
  EngineOptions Options(const Model& model, DType precision, ParamHome params, int accum,
                        Schedule schedule) {
    EngineOptions o = testing::MixedPlacementOptions(
        model, precision, params,
        params == ParamHome::kNvme ? OptimizerHome::kNvme : OptimizerHome::kHost, accum,
        dir_.string());
    o.placement.schedule = schedule;
    const int held = schedule == Schedule::kLayerMajor ? accum : 1;
    if (params != ParamHome::kDevice) {
      o.placement.device_budget_bytes =
          StreamingMinimumBytes(model, precision, o.micro_batch, 3, false, 1, false, held) +
          model.block_num_params(1) * SizeOf(precision) + 1024;
    }
    return o;
  }
  TrainRun Train(Model& model, const EngineOptions& o, int steps) {
    auto device = gpu::CreateHostDevice({});
    EXPECT_TRUE(device.ok());
    if (!device.ok()) return {};
    return TrainOn(**device, model, o, steps);
  }

  std::filesystem::path dir_;
};

TEST_F(LayerMajorTest, UntiedGptAndLlamaMatchTheMicroBatchMajorScheduleBitForBit) {
  for (auto make : {UntiedGpt, UntiedLlama}) {
    const std::unique_ptr<Model> model = make();
    for (DType precision : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (int accum : {1, 2, 8}) {
        for (ParamHome params : {ParamHome::kDevice, ParamHome::kHost, ParamHome::kNvme}) {
          SCOPED_TRACE(fmt::format("{} {} accum {} params {}", model->description(),
                                   DTypeName(precision), accum, ParamHomeName(params)));
          const TrainRun reference = Train(
              *model, Options(*model, precision, params, accum, Schedule::kMicroBatchMajor), 3);
          const TrainRun run =
              Train(*model, Options(*model, precision, params, accum, Schedule::kLayerMajor), 3);
          ASSERT_EQ(run.results.size(), 3u);
          EXPECT_EQ(run.plan.layer_major(), accum > 1);
          if (params != ParamHome::kDevice) {
            EXPECT_LT(run.plan.num_resident(), model->num_blocks() - 1);
          }
          EXPECT_LE(run.counters.device_peak_bytes, run.plan.device_budget_bytes);
          ExpectBitIdentical(reference, run);
        }
      }
    }
  }
}

// Blocks whose optimizer runs on the device sum every micro-batch's gradient in their own device
// region (GradStreamer::Stream), beside the host-optimized blocks' accumulators.
TEST_F(LayerMajorTest, OptimizerSplitBetweenDeviceAndHostMatchesBitForBit) {
  const std::unique_ptr<Model> model = UntiedGpt();
  for (int accum : {2, 8}) {
    SCOPED_TRACE(fmt::format("accum {}", accum));
    auto options = [&](Schedule schedule) {
      EngineOptions o = Options(*model, DType::kBF16, ParamHome::kDevice, accum, schedule);
      o.placement.optimizer_device_fraction = 0.5;
      o.placement.device_budget_bytes = 256 << 20;
      return o;
    };
    const TrainRun reference = Train(*model, options(Schedule::kMicroBatchMajor), 3);
    const TrainRun run = Train(*model, options(Schedule::kLayerMajor), 3);
    EXPECT_GT(run.plan.device_optimizer_params, 0);
    EXPECT_TRUE(run.plan.has_cpu_optimizer());
    ExpectBitIdentical(reference, run);
  }
}

// LoRA over a streamed base (frozen chunks, issue 30), adapter dropout on: each micro-batch keeps
// its dropout seed, and the frozen chunks are loaded once per pass too.
TEST_F(LayerMajorTest, LoraOverAStreamedBaseMatchesBitForBit) {
  auto llama = models::LlamaModel::Create(testing::TinyLlama(false));
  ASSERT_TRUE(llama.ok());
  ASSERT_TRUE(
      (*llama)
          ->EnableLora({.rank = 4, .alpha = 8, .targets = {"q_proj", "v_proj"}, .dropout = 0.1})
          .ok());
  Model& model = **llama;
  for (ParamHome params : {ParamHome::kHost, ParamHome::kNvme}) {
    SCOPED_TRACE(ParamHomeName(params));
    const TrainRun reference =
        Train(model, Options(model, DType::kBF16, params, 4, Schedule::kMicroBatchMajor), 3);
    const TrainRun run =
        Train(model, Options(model, DType::kBF16, params, 4, Schedule::kLayerMajor), 3);
    EXPECT_LT(run.plan.num_frozen_resident(), model.num_blocks() - 2);
    ExpectBitIdentical(reference, run);
  }
}

// Every operation of the host device delayed at random, copies throttled and the landing buckets
// poisoned with NaN when released: a missing wait on the accumulators' events (acc_ready, acc_free)
// or on a bucket would give other numbers. Against the sequential micro-batch-major run.
TEST_F(LayerMajorTest, LateCopiesAndEventsStillGiveBitIdenticalResults) {
  const std::unique_ptr<Model> model = UntiedLlama();
  EngineOptions reference_options =
      Options(*model, DType::kBF16, ParamHome::kNvme, 4, Schedule::kMicroBatchMajor);
  reference_options.overlap = false;
  const TrainRun reference = Train(*model, reference_options, 3);
  for (bool offload : {false, true}) {
    SCOPED_TRACE(fmt::format("offload {}", offload));
    EngineOptions o = Options(*model, DType::kBF16, ParamHome::kNvme, 4, Schedule::kLayerMajor);
    o.test_hooks.poison_released_buckets = true;
    o.placement.offload_activations = offload;
    o.placement.device_budget_bytes +=
        StreamingMinimumBytes(*model, DType::kBF16, o.micro_batch, 3, true, 1, false, 4);
    gpu::HostDeviceOptions d;
    d.max_random_delay_us = 300;
    d.random_delay_seed = 1234;
    // Copies slower than a block's backwards: a sum still going D2H when its accumulator is
    // taken again would be overwritten.
    d.copy_bytes_per_second = 2e6;
    auto device = gpu::CreateHostDevice(d);
    ASSERT_TRUE(device.ok());
    const TrainRun run = TrainOn(**device, *model, o, 3);
    EXPECT_GT(run.counters.buckets_poisoned, 0u);
    ExpectBitIdentical(reference, run);
  }
}

TEST_F(LayerMajorTest, OffloadedActivationsMatchBitForBit) {
  const std::unique_ptr<Model> model = UntiedLlama();
  for (int accum : {2, 8}) {
    SCOPED_TRACE(fmt::format("accum {}", accum));
    auto options = [&](Schedule schedule) {
      EngineOptions o = Options(*model, DType::kBF16, ParamHome::kHost, accum, schedule);
      o.placement.offload_activations = true;
      o.placement.device_budget_bytes +=
          StreamingMinimumBytes(*model, DType::kBF16, o.micro_batch, 3, true, 1, false,
                                schedule == Schedule::kLayerMajor ? accum : 1);
      return o;
    };
    const TrainRun reference = Train(*model, options(Schedule::kMicroBatchMajor), 3);
    const TrainRun run = Train(*model, options(Schedule::kLayerMajor), 3);
    EXPECT_TRUE(run.plan.offload_activations);
    ExpectBitIdentical(reference, run);
  }
}

// Copies every backward's contribution to the tied chunk (the head's tied_grads and the tied
// block's own grads) into pinned memory, in stream order, for the bound of their sum.
class ContributionRecorder final : public ForwardingModel {
 public:
  ContributionRecorder(Model* inner, gpu::Device* device, int micro_batches)
      : ForwardingModel(inner) {
    head_ = inner->num_blocks() - 1;
    tied_ = inner->tied_block(head_);
    const size_t bytes = inner->block_num_params(tied_) * 4;  // fp32 holds any precision
    for (int k = 0; k < 2 * micro_batches; ++k) {
      auto buffer = device->AllocatePinned(bytes, "test contribution");
      EXPECT_TRUE(buffer.ok());
      copies_.push_back(std::move(*buffer));
    }
  }
  Status Backward(int b, const BlockBuffers& buf, gpu::Stream& s) override {
    STRATA_RETURN_IF_ERROR(inner()->Backward(b, buf, s));
    const TensorRef* g = b == head_ ? &buf.tied_grads : b == tied_ ? &buf.grads : nullptr;
    if (!g) return Status::Ok();
    const size_t bytes = block_num_params(tied_) * SizeOf(g->dtype);
    dtype_ = g->dtype;
    return s.CopyD2H(copies_[next_++].span().subspan(0, bytes), gpu::DeviceSpan{g->data, bytes});
  }
  // Contribution k (in recording order) widened to fp32.
  std::vector<double> Contribution(int k) const {
    const int64_t n = block_num_params(tied_);
    std::vector<double> out(n);
    DispatchDType(dtype_, [&]<typename S>() {
      const auto* p = reinterpret_cast<const S*>(copies_[k].data());
      for (int64_t i = 0; i < n; ++i) out[i] = ToFloat(p[i]);
    });
    return out;
  }
  int recorded() const { return next_; }
  int tied() const { return tied_; }

 private:
  int head_ = 0, tied_ = 0, next_ = 0;
  DType dtype_ = DType::kF32;
  std::vector<gpu::PinnedBuffer> copies_;
};

// A tied chunk sums its 2a contributions (the head's and the embedding's of each micro-batch)
// in another order under the layer-major schedule: (h0 + ... + h_{a-1}) + (e0 + ... + e_{a-1})
// instead of h0 + e0 + h1 + e1 + ...; both are fp32 recursive sums of the same m = 2a exact
// terms, so each is within gamma_{m-1} sum |x_j| of the exact sum (Higham, "Accuracy and
// Stability of Numerical Algorithms", 2nd ed., eq. 4.4; gamma_k = k u / (1 - k u), u = 2^-24),
// and they are within twice that of each other. Every other chunk's gradient, and (no
// clipping) every other block's master weights after the step, are bit for bit the same.
TEST_F(LayerMajorTest, TiedChunkGradientIsWithinTheReorderedSumsBound) {
  for (const testing::Family& family : testing::TinyFamilies(/*with_untied=*/false)) {
    for (DType precision : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (const std::pair<int, ParamHome>& c : {std::pair{2, ParamHome::kDevice},
                                                 {8, ParamHome::kDevice},
                                                 {2, ParamHome::kHost},
                                                 {8, ParamHome::kNvme}}) {
        // Named variables, not a structured binding: the lambda below captures them (clang 14,
        // which builds the sanitizer checks, cannot capture a binding).
        const int accum = c.first;
        const ParamHome params = c.second;
        SCOPED_TRACE(fmt::format("{} {} accum {} params {}", family.name, DTypeName(precision),
                                 accum, ParamHomeName(params)));
        std::unique_ptr<Model> model = family.make();
        struct Run {
          std::vector<std::vector<float>> grads, master;
          std::vector<std::vector<double>> contributions;
        };
        auto run = [&](Schedule schedule) {
          Run out;
          auto device = gpu::CreateHostDevice({});
          EXPECT_TRUE(device.ok());
          ContributionRecorder recorder(model.get(), device->get(), accum);
          EngineOptions o = Options(*model, precision, params, accum, schedule);
          o.grad_clip_norm = 0;
          auto engine = Engine::Create(&recorder, device->get(), o);
          EXPECT_TRUE(engine.ok()) << engine.status().ToString();
          if (!engine.ok()) return out;
          const auto tokens = testing::RandomTokenVectors(2 * accum, o.micro_batch.tokens(), 5);
          std::vector<MicroBatch> mbs;
          for (int i = 0; i < accum; ++i) mbs.push_back({tokens[2 * i], tokens[2 * i + 1]});
          auto r = (*engine)->Step(mbs);
          EXPECT_TRUE(r.ok()) << r.status().ToString();
          EXPECT_FALSE(r.ok() && r->skipped);
          for (int b = 0; b < model->num_blocks(); ++b) {
            out.grads.push_back(*(*engine)->AccumulatedGradient(b));
            out.master.push_back(*(*engine)->MasterWeights(b));
          }
          EXPECT_EQ(recorder.recorded(), 2 * accum);
          for (int k = 0; k < recorder.recorded(); ++k) {
            out.contributions.push_back(recorder.Contribution(k));
          }
          return out;
        };
        const Run mb = run(Schedule::kMicroBatchMajor);
        const Run lm = run(Schedule::kLayerMajor);
        ASSERT_EQ(lm.contributions.size(), static_cast<size_t>(2 * accum));
        ASSERT_EQ(mb.contributions.size(), lm.contributions.size());
        const int t = model->tied_block(model->num_blocks() - 1);
        for (int b = 0; b < model->num_blocks(); ++b) {
          if (b == t) continue;
          ASSERT_EQ(mb.grads[b], lm.grads[b]) << "block " << b;
          ASSERT_EQ(mb.master[b], lm.master[b]) << "block " << b;
        }
        // The contributions are the same terms in both runs (each micro-batch's backward is).
        ASSERT_EQ(mb.contributions[0], lm.contributions[0]);
        const double u = std::ldexp(1.0, -24), m1 = 2.0 * accum - 1;
        const double gamma = m1 * u / (1 - m1 * u);
        int64_t differ = 0;
        for (size_t e = 0; e < lm.grads[t].size(); ++e) {
          double exact = 0, abs_sum = 0;
          for (const auto& x : lm.contributions) {
            exact += x[e];
            abs_sum += std::fabs(x[e]);
          }
          const double bound = gamma * abs_sum;
          ASSERT_LE(std::fabs(lm.grads[t][e] - exact), bound) << "element " << e;
          ASSERT_LE(std::fabs(mb.grads[t][e] - exact), bound) << "element " << e;
          differ += lm.grads[t][e] != mb.grads[t][e];
        }
        RecordProperty(fmt::format("{}_{}_{}_{}_differing", family.name, DTypeName(precision),
                                   accum, ParamHomeName(params)),
                       std::to_string(differ));
      }
    }
  }
}

// Per step, with every block streamed from pinned host memory: the layer-major schedule copies
// each block's params H2D at most once per pass (2 per step) and each block's gradient D2H once
// (fp32), the micro-batch-major one a gradient per micro-batch (16-bit) and params per use.
TEST_F(LayerMajorTest, ParamsCrossOncePerPassAndGradientsOncePerStep) {
  const std::unique_ptr<Model> model = UntiedLlama();
  const int accum = 4, steps = 3;
  const DType precision = DType::kBF16;
  struct PerStep {
    uint64_t h2d = 0, grad_d2h = 0;
  };
  auto measure = [&](Schedule schedule) {
    EngineOptions o = Options(*model, precision, ParamHome::kHost, accum, schedule);
    auto device = gpu::CreateHostDevice({});
    EXPECT_TRUE(device.ok());
    auto engine = Engine::Create(model.get(), device->get(), o);
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    const auto tokens = testing::RandomTokenVectors(2 * accum * steps, o.micro_batch.tokens(), 3);
    std::vector<PerStep> per_step;
    EngineCounters before = (*engine)->counters();
    for (int s = 0; s < steps; ++s) {
      std::vector<MicroBatch> mbs;
      for (int i = 0; i < accum; ++i) {
        mbs.push_back({tokens[2 * (s * accum + i)], tokens[2 * (s * accum + i) + 1]});
      }
      EXPECT_TRUE((*engine)->Step(mbs).ok());
      EXPECT_TRUE((*engine)->Flush().ok());
      const EngineCounters now = (*engine)->counters();
      per_step.push_back(
          {now.bytes_h2d - before.bytes_h2d, now.grad_bytes_d2h - before.grad_bytes_d2h});
      before = now;
    }
    return std::make_pair(per_step, (*engine)->plan());
  };
  const auto [lm, plan] = measure(Schedule::kLayerMajor);
  const auto [mbm, mb_plan] = measure(Schedule::kMicroBatchMajor);
  ASSERT_TRUE(plan.layer_major());
  ASSERT_GT(plan.streaming_slots, 0);
  uint64_t streamed = 0, resident = 0, grads32 = 0, grads16 = 0;
  for (int b = 0; b < model->num_blocks(); ++b) {
    const uint64_t bytes = model->block_num_params(b) * SizeOf(precision);
    (plan.blocks[b].resident ? resident : streamed) += bytes;
    grads32 += model->block_num_params(b) * 4;
    grads16 += bytes;
  }
  ASSERT_GT(streamed, 0u);
  // Tokens and targets of every micro-batch, then the params.
  const uint64_t token_bytes =
      accum * 2 * 4 *
      Options(*model, precision, ParamHome::kHost, accum, Schedule::kLayerMajor)
          .micro_batch.tokens();
  for (int s = 1; s < steps; ++s) {  // steady steps: every block was updated by the last one
    SCOPED_TRACE(fmt::format("step {}", s));
    const uint64_t lm_params = lm[s].h2d - token_bytes;
    // Once per pass at most (a block used last in forward may still be in its slot for the
    // backward); at least once per step for streamed and updated resident blocks alike.
    EXPECT_LE(lm_params, 2 * streamed + resident);
    EXPECT_GE(lm_params, streamed + resident);
    EXPECT_EQ(lm[s].grad_d2h, grads32);
    EXPECT_EQ(mbm[s].grad_d2h, accum * grads16);
    EXPECT_GT(mbm[s].h2d - token_bytes, 2 * lm_params);
  }
}

// Records the device's H2D byte counter at every Forward and Backward call. Without overlap
// every load completes inside ParamCache::Acquire, before the block's op, and nothing is
// prefetched, so the counter moves only where a block's params are loaded.
class LoadRecorder final : public ForwardingModel {
 public:
  LoadRecorder(Model* inner, const gpu::Device* device) : ForwardingModel(inner), device_(device) {}
  struct Call {
    bool backward;
    int block;
    uint64_t bytes_h2d;
  };
  Status Forward(int b, const BlockBuffers& buf, gpu::Stream& s) override {
    calls_.push_back({false, b, device_->counters().bytes_h2d});
    return inner()->Forward(b, buf, s);
  }
  Status Backward(int b, const BlockBuffers& buf, gpu::Stream& s) override {
    calls_.push_back({true, b, device_->counters().bytes_h2d});
    return inner()->Backward(b, buf, s);
  }
  std::vector<Call>& calls() { return calls_; }

 private:
  const gpu::Device* device_;
  std::vector<Call> calls_;
};

// In each pass (forward or backward of a step) every block is loaded at most once: the H2D
// bytes that precede its ops sum to at most its params. The same check fails for the
// micro-batch-major schedule, whose passes load streamed blocks once per micro-batch.
TEST_F(LayerMajorTest, NoBlockIsLoadedTwiceInOnePass) {
  const std::unique_ptr<Model> model = UntiedLlama();
  const int accum = 4, steps = 2, n = model->num_blocks();
  for (Schedule schedule : {Schedule::kLayerMajor, Schedule::kMicroBatchMajor}) {
    SCOPED_TRACE(ScheduleName(schedule));
    EngineOptions o = Options(*model, DType::kBF16, ParamHome::kHost, accum, schedule);
    o.overlap = false;
    auto device = gpu::CreateHostDevice({});
    ASSERT_TRUE(device.ok());
    LoadRecorder recorder(model.get(), device->get());
    const TrainRun run = TrainOn(**device, recorder, o, steps);
    ASSERT_EQ(run.results.size(), static_cast<size_t>(steps));
    ASSERT_GT(run.plan.streaming_slots, 0);
    const auto& calls = recorder.calls();
    const size_t per_step = 2u * accum * n;
    ASSERT_EQ(calls.size(), steps * per_step);
    // loaded[step][pass][block]: H2D bytes since the op before each of the block's ops.
    std::vector<uint64_t> loaded(steps * 2 * n, 0);
    for (size_t k = 1; k < calls.size(); ++k) {
      if (k % per_step == 0) continue;  // a step's first op follows its token uploads
      const uint64_t moved = calls[k].bytes_h2d - calls[k - 1].bytes_h2d;
      loaded[(k / per_step * 2 + calls[k].backward) * n + calls[k].block] += moved;
    }
    // The step's token uploads run on the compute stream and may land in any block's share.
    const uint64_t tokens = 2u * accum * o.micro_batch.tokens() * 4;
    int twice = 0;
    for (size_t i = 0; i < loaded.size(); ++i) {
      twice += loaded[i] > static_cast<uint64_t>(model->block_num_params(i % n)) * 2 + tokens;
    }
    if (schedule == Schedule::kLayerMajor) {
      EXPECT_EQ(twice, 0);
    } else {
      EXPECT_GT(twice, 0);
    }
  }
}

TEST_F(LayerMajorTest, Fp16OverflowOfOneMicroBatchSkipsTheStep) {
  const std::unique_ptr<Model> model = UntiedLlama();
  EngineOptions o = Options(*model, DType::kF16, ParamHome::kNvme, 4, Schedule::kLayerMajor);
  testing::OverflowInjector injected(model.get());
  injected.Arm(2);
  const TrainRun run = Train(injected, o, 1);
  ASSERT_EQ(run.results.size(), 1u);
  EXPECT_TRUE(run.results[0].skipped);
  for (int b = 0; b < model->num_blocks(); ++b) {
    std::vector<float> init(model->block_num_params(b));
    ASSERT_TRUE(model->InitParams(b, o.seed, init).ok());
    ASSERT_EQ(run.master[b], init) << "block " << b;
  }
}

TEST_F(LayerMajorTest, UpdateDuringBackwardGivesTheExactStep) {
  const std::unique_ptr<Model> model = UntiedGpt();
  for (ParamHome params : {ParamHome::kHost, ParamHome::kNvme}) {
    SCOPED_TRACE(ParamHomeName(params));
    EngineOptions o = Options(*model, DType::kBF16, params, 4, Schedule::kLayerMajor);
    o.grad_clip_norm = 0;  // no clipping: every speculative update stands
    const TrainRun reference = Train(*model, o, 3);
    o.update_during_backward = true;
    o.test_hooks.always_speculate = true;
    const TrainRun run = Train(*model, o, 3);
    ExpectBitIdentical(reference, run);
    EXPECT_GT(run.counters.params_updated_during_backward, 0u);
  }
}

TEST_F(LayerMajorTest, CheckpointResumesBitIdentically) {
  const std::unique_ptr<Model> model = UntiedLlama();
  const int n = 2, m = 2, accum = 2;
  const EngineOptions o =
      Options(*model, DType::kBF16, ParamHome::kNvme, accum, Schedule::kLayerMajor);
  const auto tokens = testing::RandomTokenVectors(2 * accum * (n + m), o.micro_batch.tokens(), 8);
  auto run = [&](Engine& e, int from, int to) {
    for (int s = from; s < to; ++s) {
      std::vector<MicroBatch> mbs;
      for (int i = 0; i < accum; ++i) {
        mbs.push_back({tokens[2 * (s * accum + i)], tokens[2 * (s * accum + i) + 1]});
      }
      auto r = e.Step(mbs);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
  };
  auto device = gpu::CreateHostDevice({});
  ASSERT_TRUE(device.ok());
  auto straight = Engine::Create(model.get(), device->get(), o);
  ASSERT_TRUE(straight.ok()) << straight.status().ToString();
  run(**straight, 0, n + m);
  const uint64_t want = *(*straight)->MasterWeightsXxh3();
  straight->reset();

  auto first = Engine::Create(model.get(), device->get(), o);
  ASSERT_TRUE(first.ok());
  run(**first, 0, n);
  std::string saved;
  ASSERT_TRUE((*first)->SaveCheckpoint((dir_ / "ckpt").string(), {}, {}, &saved).ok());
  first->reset();
  auto second = Engine::Create(model.get(), device->get(), o);
  ASSERT_TRUE(second.ok());
  TrainerState trainer;
  ASSERT_TRUE((*second)->LoadCheckpoint(saved, &trainer).ok());
  run(**second, n, n + m);
  EXPECT_EQ(*(*second)->MasterWeightsXxh3(), want);
}

TEST_F(LayerMajorTest, PlanHoldsEveryMicroBatchAndFp32Accumulators) {
  const std::unique_ptr<Model> model = UntiedLlama();
  const EngineOptions o = Options(*model, DType::kBF16, ParamHome::kHost, 8, Schedule::kLayerMajor);
  auto plan = MakePlan(*model, o.precision, o.micro_batch, o.placement, {o.optimizer, 8});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->held_micro_batches, 8);
  EXPECT_TRUE(plan->device_grad_accumulators);
  EXPECT_EQ(plan->grad_bucket_bytes % 4096, 0u);
  EXPECT_GE(plan->grad_bucket_bytes, static_cast<uint64_t>(plan->max_block_params) * 4);
  const uint64_t act = model->activation_elems(o.micro_batch) * 2;
  bool accumulators = false;
  for (const DeviceRegion& r : plan->device_regions) {
    if (r.label.starts_with("boundary activations")) {
      EXPECT_EQ(r.size_bytes, act * (model->num_blocks() - 1) * 8);
    }
    if (r.label.starts_with("activation gradients")) {
      EXPECT_EQ(r.size_bytes, act * 2 * 8);
    }
    accumulators |= r.label.starts_with("gradient accumulators");
  }
  EXPECT_TRUE(accumulators);
  EXPECT_NE(plan->Describe().find("layer-major over 8 micro-batches"), std::string::npos);
  // One micro-batch: the same plan as the micro-batch-major schedule's.
  auto one = MakePlan(*model, o.precision, o.micro_batch, o.placement, {o.optimizer, 1});
  ASSERT_TRUE(one.ok());
  EXPECT_FALSE(one->layer_major());
  EXPECT_FALSE(one->device_grad_accumulators);
}

}  // namespace
}  // namespace strata::engine
