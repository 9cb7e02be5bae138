// The example model of the C++ package (examples/offload_mlp/mlp_model.h) against a double-
// precision reference written here: its loss and its hand-written backward, as the engine runs
// them, through libstrata_engine.so (Strata::engine in the build tree).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "engine/engine.h"
#include "engine/version.h"
#include "gpu/device.h"
#include "mlp_model.h"

namespace offload_mlp {
namespace {

using strata::engine::Engine;
using strata::engine::MicroBatch;

// A small instance: 2 residual layers, so every kind of block is there.
MlpConfig SmallConfig() {
  MlpConfig c;
  c.input_dim = 4;
  c.width = 8;
  c.hidden_layers = 2;
  c.num_samples = 32;
  c.max_positions = 8;
  return c;
}

// The loss of mlp_model.h's network in double, from the blocks' fp32 parameters.
double ReferenceLoss(const MlpConfig& c, const std::vector<std::vector<double>>& params,
                     const std::vector<int32_t>& ids) {
  const int width = c.width;
  double sum = 0;
  for (int32_t id : ids) {
    std::vector<float> x(c.input_dim);
    for (int j = 0; j < c.input_dim; ++j) x[j] = Feature(id, j, c.input_dim);
    std::vector<double> h(x.begin(), x.end());
    for (int b = 0; b <= c.hidden_layers; ++b) {
      const std::vector<double>& p = params[b];
      const int fan_in = static_cast<int>(h.size());
      std::vector<double> out(width);
      for (int i = 0; i < width; ++i) {
        double z = p[static_cast<size_t>(fan_in) * width + i];
        for (int k = 0; k < fan_in; ++k) z += h[k] * p[static_cast<size_t>(k) * width + i];
        out[i] = (b > 0 ? h[i] : 0.0) + std::tanh(z);
      }
      h = out;
    }
    const std::vector<double>& head = params.back();
    double y_hat = head[width];
    for (int i = 0; i < width; ++i) y_hat += h[i] * head[i];
    const double y = Teacher(x);
    sum += (y_hat - y) * (y_hat - y);
  }
  return sum / static_cast<double>(ids.size());
}

class PackageExampleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto device = strata::gpu::CreateHostDevice({});
    ASSERT_TRUE(device.ok()) << device.status().ToString();
    device_ = std::move(*device);
    options_.precision = strata::DType::kF32;
    options_.micro_batch = {2, 3};
    options_.grad_clip_norm = 0;
    options_.placement.param_home = strata::engine::ParamHome::kDevice;
    options_.placement.optimizer_home = strata::engine::OptimizerHome::kHost;
    options_.placement.device_budget_bytes = 16 << 20;
    auto engine = Engine::Create(&model_, device_.get(), options_);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    engine_ = std::move(*engine);
    for (int b = 0; b < model_.num_blocks(); ++b) {
      auto w = engine_->MasterWeights(b);
      ASSERT_TRUE(w.ok()) << w.status().ToString();
      params_.emplace_back(w->begin(), w->end());
    }
    ids_ = {3, 17, 0, 31, 8, 3};  // B * T sample ids, one repeated
  }

  MlpRegressor model_{SmallConfig()};
  std::unique_ptr<strata::gpu::Device> device_;
  strata::engine::EngineOptions options_;
  std::unique_ptr<Engine> engine_;
  std::vector<std::vector<double>> params_;  // the initial master weights, per block
  std::vector<int32_t> ids_;
};

TEST_F(PackageExampleTest, LibraryVersionIsTheHeadersVersion) {
  EXPECT_EQ(strata::engine::VersionString(), STRATA_ENGINE_VERSION_STRING);
}

TEST_F(PackageExampleTest, LossEqualsTheDoublePrecisionReference) {
  auto loss = engine_->EvaluateLoss(MicroBatch{ids_, ids_}, options_.micro_batch);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  const double reference = ReferenceLoss(SmallConfig(), params_, ids_);
  EXPECT_GT(reference, 0.01);  // not trivially zero
  EXPECT_NEAR(*loss, reference, 1e-5 * reference);
}

TEST_F(PackageExampleTest, GradientOfEveryParameterMatchesFiniteDifferencesOfTheReference) {
  auto step = engine_->Step({std::vector<MicroBatch>{MicroBatch{ids_, ids_}}});
  ASSERT_TRUE(step.ok()) << step.status().ToString();
  const MlpConfig c = SmallConfig();
  for (int b = 0; b < model_.num_blocks(); ++b) {
    auto grad = engine_->AccumulatedGradient(b);
    ASSERT_TRUE(grad.ok()) << grad.status().ToString();
    ASSERT_EQ(grad->size(), params_[b].size());
    for (size_t i = 0; i < grad->size(); ++i) {
      // Central differences in double: truncation ~h^2, rounding ~1e-16 / h.
      constexpr double kH = 1e-5;
      auto p = params_;
      p[b][i] += kH;
      const double up = ReferenceLoss(c, p, ids_);
      p[b][i] -= 2 * kH;
      const double down = ReferenceLoss(c, p, ids_);
      const double expected = (up - down) / (2 * kH);
      // fp32 sums over at most N * width terms of magnitude ~1: a few hundred fp32 ulps.
      EXPECT_NEAR((*grad)[i], expected, 1e-5 + 1e-4 * std::abs(expected))
          << model_.block_name(b) << " parameter " << i;
    }
  }
}

}  // namespace
}  // namespace offload_mlp
