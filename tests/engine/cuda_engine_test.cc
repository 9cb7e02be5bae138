// The whole engine on the CUDA backend (label gpu): the same training as on the host backend for
// every placement and precision, run to run bit-identical on the GPU, the overlapped and the
// sequential pipelines bit-identical, an fp16 overflow in any block skipping the update, and
// offloaded activations changing no bit. Skipped with the reason without a GPU or without the
// CUDA backend in this build.
//
// GPU and host kernels sum in different orders (gpt_cuda.h), so a GPU run is compared with the
// host run to rounding, not bit for bit: losses per step within a relative 1e-4 (fp32 working
// params) or 2e-3 (16-bit), every master weight within 2 lr per step of the host's (Adam's
// largest move; a wrong kernel moves most weights by ~lr = 1e-2), and closer than that:
//
// fp32: EVERY master weight within its own bound, close + steps * lr * delta / (sqrt(v^) + eps),
// with close = 1e-7. The second term is how far Adam's update moves when its gradient moves by
// delta: d/dg of lr * m^ / (sqrt(v^) + eps) is about lr / (sqrt(v^) + eps) (first step: exactly
// lr * eps / (|g| + eps)^2), per step. v^ is the host run's bias-corrected second moment of the
// weight (read from a checkpoint), so sqrt(v^) is its gradient's size. delta, the fp32 rounding
// noise of a gradient element, scales with the terms summed into it, not with their sum: it is
// kNoise * 2^-24 * the RMS of sqrt(v^) over the weight's tensor (its neighbours' gradient size).
// kNoise = 512 is a calibration, not a derivation: sums over the 64 tokens of a step (sqrt(64) =
// 8) through a few layers of backward give ~64, and the final v^ understates the sensitivity of
// the early steps (after step 1, v^ is g1^2 alone): with 64 the reordering below reached 4.8
// times its bound at 5 weights, with 512 at most 0.69, while a wrong beta2 exceeds it up to 293
// times at 74,279 weights. Where a gradient is as large as its tensor's, the term is
// ~lr * steps * 3e-5 = 1.2e-6; where a gradient nearly cancels, it grows as 1 / sqrt(v^). The
// extreme case is the attention key bias, whose gradient is zero in exact arithmetic: the bias adds
// q_i . b_k / sqrt(d) to every score of row i, a per-row shift that the softmax cancels (causal
// mask or not), so dL/db_k = sum_i q_i / sqrt(d) * sum_j dS_ij, and every row of the softmax
// backward sums to zero (dS_ij = P_ij (dP_ij - sum_l P_il dP_il)). What the kernels compute for it
// is rounding noise, 1e-10 to 1e-8, the size of eps = 1e-8, and any two summation orders move it by
// 1e-5 to 1e-3. The fixed fraction this replaces (99.9% within 1e-7) did not hold even on the host
// alone: swapping the two sequences of each micro-batch moved 298 of 93,184 weights by more than
// 1e-7 (176 key biases, 122 others whose gradients nearly cancel), the fraction allowing 93.
//
// 16-bit working params: a master weight near a rounding boundary of its 16-bit copy can round
// to the other neighbour on one side, which changes the forward by a 16-bit ulp; that noise is
// not the fp32 rounding modelled above, so these keep a fraction: 99% of the weights (key biases
// excepted, for the reason above) within 1e-6 of the host's.
//
// The tests CloseToHostAcceptsAReorderedBatch and CloseToHostRejectsAChangedBeta2 check the
// comparison with the host backend standing in for the GPU, so they run without one.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "models/gpt_layout.h"
#include "tests/engine/engine_test_util.h"

#ifdef STRATA_HAVE_CUDA
#include "gpu/cuda/cuda_device.h"
#include "tests/gpu/cuda_test_util.h"
#endif

namespace strata::engine {
namespace {

using testing::ExpectBitIdentical;
using testing::MixedPlacementOptions;
using testing::OverflowInjector;
using testing::RandomTokenVectors;
using testing::TrainOn;
using testing::TrainRun;

// Empty when a CUDA GPU can be used, else why not.
std::string NoCudaReason() {
#ifdef STRATA_HAVE_CUDA
  return gpu::testing::NoCudaReason();
#else
  return "this build has no CUDA backend (no nvcc at configure time)";
#endif
}

// The model, options and comparisons of the tests below; runs on any machine. CudaEngineTest
// adds the GPU.
class EngineComparisonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // 8 blocks of ~13k params: with 3 streaming slots most of them stream.
    auto model = models::GptModel::Create({256, 16, 6, 2, 32});
    ASSERT_TRUE(model.ok());
    model_ = std::move(*model);
    swap_dir_ = std::filesystem::temp_directory_path() /
                ("strata_cuda_engine_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(swap_dir_);
  }
  void TearDown() override {
    if (!swap_dir_.empty()) std::filesystem::remove_all(swap_dir_);
  }

  EngineOptions Options(DType precision, ParamHome params, OptimizerHome optim) {
    EngineOptions o =
        MixedPlacementOptions(*model_, precision, params, optim, /*accum=*/2, swap_dir_.string());
    EXPECT_EQ(o.adamw.lr, kLr);  // the bound of ExpectCloseToHost
    return o;
  }

  static std::unique_ptr<gpu::Device> MakeDevice(gpu::DeviceKind kind) {
    StatusOr<std::unique_ptr<gpu::Device>> device = std::unique_ptr<gpu::Device>();
    if (kind == gpu::DeviceKind::kHost) {
      device = gpu::CreateHostDevice({});
    } else {
#ifdef STRATA_HAVE_CUDA
      gpu::CudaDeviceOptions d;
      d.pinned_budget_bytes = size_t{1} << 30;
      device = gpu::CreateCudaDevice(d);
#endif
    }
    EXPECT_TRUE(device.ok()) << device.status().ToString();
    return device.ok() ? std::move(*device) : nullptr;
  }

  // Trains `steps` steps on a fixed token stream. With `injector`, arms block
  // `overflow_block` in step `overflow_step` (and disarms it afterwards).
  // The host reference run: also Adam's v, through a checkpoint (for CompareToHost).
  TrainRun TrainHostReference(const EngineOptions& o, int steps, bool swap_sequences = false) {
    auto device = MakeDevice(gpu::DeviceKind::kHost);
    if (!device) return {};
    const std::filesystem::path dir = swap_dir_ / "reference_checkpoint";
    std::filesystem::remove_all(dir);
    return TrainOn(*device, *model_, o, steps, {}, swap_sequences, dir.string());
  }

  TrainRun Train(gpu::DeviceKind kind, const EngineOptions& o, int steps,
                 OverflowInjector* injector = nullptr, int overflow_step = -1,
                 int overflow_block = -1) {
    auto device = MakeDevice(kind);
    if (!device) return {};
    if (!injector) return TrainOn(*device, *model_, o, steps);
    TrainRun run = TrainOn(*device, *injector, o, steps,
                           [&](int s) { injector->Arm(s == overflow_step ? overflow_block : -1); });
    injector->Disarm();
    return run;
  }

  // How far a run's master weights are from the host run's (see the top of the file).
  struct Closeness {
    bool per_weight = false;     // fp32: every weight within its own bound
    size_t checked = 0;          // weights held to the close criterion (16-bit: not key biases)
    size_t within = 0;           // of those, within it
    size_t key_bias = 0;         // key-bias weights
    size_t key_bias_within = 0;  // of those, within `close` (for the record)
    size_t past_bound = 0;       // weights further than `bound` (2 lr per step)
    double close = 0, bound = 0, required = 0;
    double worst_ratio = 0;  // fp32: the largest distance / own bound
    bool ok() const {
      if (past_bound != 0) return false;
      return per_weight ? within == checked
                        : static_cast<double>(within) >= required * static_cast<double>(checked);
    }
    std::string ToString() const {
      return fmt::format(
          "{} of {} master weights within {} (needed: {:.1f}%{}), {} of {} key-bias weights "
          "within {}; {} further than {}",
          within, checked, per_weight ? "their own bounds" : fmt::format("{}", close),
          100 * required,
          per_weight ? fmt::format(", worst distance/bound {:.3g}", worst_ratio) : "",
          key_bias_within, key_bias, close, past_bound, bound);
    }
  };

  // The tensors of block `b` as [begin, end) element ranges: a layer's twelve (models/
  // gpt_layout.h), the embedding and head blocks as one each. `key_bias` is the k third of
  // attn_qkv_b (empty outside layers).
  struct Tensors {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    std::pair<int64_t, int64_t> key_bias{0, 0};
  };
  Tensors BlockTensors(int b) const {
    Tensors t;
    const int64_t n = model_->block_num_params(b);
    if (b < 1 || b > model_->shape().num_layers) {  // blocks 1..L are the layers
      t.ranges = {{0, n}};
      return t;
    }
    const int64_t C = model_->shape().channels;
    const std::vector<float> base(1);
    const models::LayerParams<const float*> l(base.data(), C);
    const float* starts[] = {l.ln1_w, l.ln1_b, l.qkv_w, l.qkv_b, l.attn_proj_w, l.attn_proj_b,
                             l.ln2_w, l.ln2_b, l.fc_w,  l.fc_b,  l.mlp_proj_w,  l.mlp_proj_b};
    for (size_t k = 0; k < std::size(starts); ++k) {
      const int64_t begin = starts[k] - base.data();
      const int64_t end = k + 1 < std::size(starts) ? starts[k + 1] - base.data() : n;
      t.ranges.push_back({begin, end});
    }
    const int64_t k_bias = (l.qkv_b - base.data()) + C;
    t.key_bias = {k_bias, k_bias + C};
    return t;
  }

  static constexpr double kNoise = 512;  // see the top of the file

  // `host` must come from TrainOn with a checkpoint directory (its exp_avg_sq), `o` the options
  // both ran with.
  Closeness CompareToHost(const TrainRun& host, const TrainRun& run, const EngineOptions& o,
                          int steps) const {
    const bool fp32 = o.precision == DType::kF32;
    Closeness c;
    c.per_weight = fp32;
    c.close = fp32 ? 1e-7 : 1e-6;
    c.bound = 2.0 * kLr * steps;
    c.required = fp32 ? 1.0 : 0.99;
    const double v_correction = 1.0 - std::pow(double{o.adamw.beta2}, steps);
    const double lr = o.adamw.lr, eps = o.adamw.eps;
    for (size_t b = 0; b < host.master.size(); ++b) {
      const Tensors tensors = BlockTensors(static_cast<int>(b));
      for (const auto& [begin, end] : tensors.ranges) {
        double sum_v = 0;  // the tensor's mean v^
        for (int64_t i = begin; i < end; ++i) sum_v += host.exp_avg_sq[b][i] / v_correction;
        const double delta = kNoise * 0x1p-24 * std::sqrt(sum_v / double(end - begin));
        for (int64_t i = begin; i < end; ++i) {
          const double d = std::abs(double{run.master[b][i]} - double{host.master[b][i]});
          c.past_bound += !(d <= c.bound);  // NaN counts
          const bool key_bias = i >= tensors.key_bias.first && i < tensors.key_bias.second;
          if (key_bias) {
            ++c.key_bias;
            c.key_bias_within += d <= c.close;
          }
          if (fp32) {
            const double sqrt_v = std::sqrt(host.exp_avg_sq[b][i] / v_correction);
            const double own = c.close + steps * lr * delta / (sqrt_v + eps);
            ++c.checked;
            c.within += d <= own;
            c.worst_ratio = std::max(c.worst_ratio, d / own);
          } else if (!key_bias) {
            ++c.checked;
            c.within += d <= c.close;
          }
        }
      }
    }
    return c;
  }

  // The run agrees with the host run to fp32 rounding (see the top of the file).
  void ExpectCloseToHost(const TrainRun& host, const TrainRun& run, const EngineOptions& o,
                         int steps) const {
    const bool fp32 = o.precision == DType::kF32;
    ASSERT_EQ(host.results.size(), run.results.size());
    for (size_t s = 0; s < host.results.size(); ++s) {
      EXPECT_EQ(host.results[s].skipped, run.results[s].skipped) << "step " << s;
      EXPECT_NEAR(run.results[s].loss, host.results[s].loss,
                  (fp32 ? 1e-4 : 2e-3) * std::abs(host.results[s].loss))
          << "step " << s;
    }
    ASSERT_EQ(host.master.size(), run.master.size());
    ASSERT_EQ(host.exp_avg_sq.size(), host.master.size());
    for (size_t b = 0; b < host.master.size(); ++b) {
      ASSERT_EQ(host.master[b].size(), run.master[b].size());
      ASSERT_EQ(host.exp_avg_sq[b].size(), host.master[b].size());
    }
    const Closeness c = CompareToHost(host, run, o, steps);
    EXPECT_TRUE(c.ok()) << c.ToString();
  }

  static constexpr float kLr = 1e-2f;
  std::unique_ptr<models::GptModel> model_;
  std::filesystem::path swap_dir_;
};

class CudaEngineTest : public EngineComparisonTest {
 protected:
  void SetUp() override {
    if (const std::string why = NoCudaReason(); !why.empty()) GTEST_SKIP() << why;
    EngineComparisonTest::SetUp();
  }
};

// The host backend standing in for the GPU: a reordering that changes nothing in exact
// arithmetic passes the comparison in every precision...
TEST_F(EngineComparisonTest, CloseToHostAcceptsAReorderedBatch) {
  constexpr int kSteps = 4;
  for (DType precision : {DType::kBF16, DType::kF16, DType::kF32}) {
    SCOPED_TRACE(std::string(DTypeName(precision)));
    const EngineOptions o = Options(precision, ParamHome::kDevice, OptimizerHome::kHost);
    const TrainRun host = TrainHostReference(o, kSteps);
    const TrainRun swapped = TrainHostReference(o, kSteps, /*swap_sequences=*/true);
    ASSERT_EQ(swapped.master.size(), host.master.size());
    const Closeness c = CompareToHost(host, swapped, o, kSteps);
    std::cout << DTypeName(precision) << ", two sequences swapped: " << c.ToString() << "\n";
    ExpectCloseToHost(host, swapped, o, kSteps);
  }
}

// ...and one that is wrong fails it: Adam's beta2 0.99 instead of 0.999 on one side.
TEST_F(EngineComparisonTest, CloseToHostRejectsAChangedBeta2) {
  constexpr int kSteps = 4;
  for (DType precision : {DType::kBF16, DType::kF16, DType::kF32}) {
    SCOPED_TRACE(std::string(DTypeName(precision)));
    const EngineOptions o = Options(precision, ParamHome::kDevice, OptimizerHome::kHost);
    const TrainRun host = TrainHostReference(o, kSteps);
    EngineOptions wrong = o;
    wrong.adamw.beta2 = 0.99f;
    const TrainRun other = Train(gpu::DeviceKind::kHost, wrong, kSteps);
    ASSERT_EQ(other.master.size(), host.master.size());
    const Closeness c = CompareToHost(host, other, o, kSteps);
    std::cout << DTypeName(precision) << ", beta2 0.99 on one side: " << c.ToString() << "\n";
    EXPECT_FALSE(c.ok()) << c.ToString();
  }
}

TEST_F(CudaEngineTest, EveryPlacementAndPrecisionTrainsAsOnTheHostAndRepeatsBitForBit) {
  constexpr int kSteps = 4;
  for (DType precision : {DType::kBF16, DType::kF16, DType::kF32}) {
    const TrainRun host =
        TrainHostReference(Options(precision, ParamHome::kDevice, OptimizerHome::kHost), kSteps);
    ASSERT_NE(host.results.front().loss, host.results.back().loss);  // training did something
    for (ParamHome params : {ParamHome::kDevice, ParamHome::kHost, ParamHome::kNvme}) {
      for (OptimizerHome optim : {OptimizerHome::kHost, OptimizerHome::kNvme}) {
        SCOPED_TRACE(fmt::format("{} params {} optimizer {}", DTypeName(precision),
                                 ParamHomeName(params), OptimizerHomeName(optim)));
        const EngineOptions o = Options(precision, params, optim);
        const TrainRun gpu = Train(gpu::DeviceKind::kCuda, o, kSteps);
        ASSERT_EQ(gpu.results.size(), static_cast<size_t>(kSteps));
        if (params != ParamHome::kDevice) {
          EXPECT_LT(gpu.plan.num_resident(), model_->num_blocks());
        }
        EXPECT_LE(gpu.counters.device_peak_bytes, gpu.plan.device_budget_bytes);
        ExpectCloseToHost(host, gpu, o, kSteps);
        // Deterministic kernels and event-ordered streams: a second run is bit for bit the same
        // (a missing event wait on the GPU would show up here as a difference).
        ExpectBitIdentical(gpu, Train(gpu::DeviceKind::kCuda, o, kSteps));
      }
    }
  }
}

TEST_F(CudaEngineTest, OverlappedAndSequentialPipelinesAreBitIdentical) {
  for (DType precision : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(std::string(DTypeName(precision)));
    auto sequential = Options(precision, ParamHome::kNvme, OptimizerHome::kNvme);
    sequential.overlap = false;
    const TrainRun reference = Train(gpu::DeviceKind::kCuda, sequential, 4);
    auto overlapped = Options(precision, ParamHome::kNvme, OptimizerHome::kNvme);
    overlapped.poison_released_buckets = true;
    ExpectBitIdentical(reference, Train(gpu::DeviceKind::kCuda, overlapped, 4));
    auto offloaded = overlapped;
    offloaded.placement.offload_activations = true;
    offloaded.placement.device_budget_bytes =
        StreamingMinimumBytes(*model_, precision, offloaded.micro_batch, 3, /*offload=*/true) +
        1024;
    ExpectBitIdentical(reference, Train(gpu::DeviceKind::kCuda, offloaded, 4));
  }
}

TEST_F(CudaEngineTest, Fp16OverflowInAnyBlockSkipsTheWholeUpdate) {
  EngineOptions o = Options(DType::kF16, ParamHome::kNvme, OptimizerHome::kNvme);
  o.loss_scaler.initial_scale = 1024.0f;  // no overflow of its own
  const TrainRun clean = Train(gpu::DeviceKind::kCuda, o, 3);
  ASSERT_EQ(clean.results.size(), 3u);
  for (const StepResult& r : clean.results) ASSERT_FALSE(r.skipped);
  const TrainRun two_steps = Train(gpu::DeviceKind::kCuda, o, 2);
  for (int block : {0, model_->num_blocks() / 2, model_->num_blocks() - 1}) {
    SCOPED_TRACE(fmt::format("overflow in block {}", block));
    OverflowInjector injector(model_.get());
    const TrainRun run = Train(gpu::DeviceKind::kCuda, o, 3, &injector, /*overflow_step=*/2, block);
    ASSERT_EQ(run.results.size(), 3u);
    EXPECT_FALSE(run.results[1].skipped);
    EXPECT_TRUE(run.results[2].skipped);
    // The skipped step left every master weight as the first two steps made it.
    ASSERT_EQ(run.master.size(), two_steps.master.size());
    EXPECT_EQ(run.hash, two_steps.hash);
  }
}

}  // namespace
}  // namespace strata::engine
