// Shared by device_optimizer_test.cc (host backend) and device_optimizer_cuda_test.cc: the
// optimizer configurations the device runs, random inputs, and the comparison of
// EnqueueDeviceUpdate / EnqueueDeviceGradStats / EnqueueDeviceGradAccumulate with cpu_optim on
// the same inputs, bit for bit, whatever the backend (DeviceAccess moves the bytes).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "cpu_optim/any_optimizer.h"
#include "cpu_optim/grad_stats.h"
#include "engine/device_optimizer.h"
#include "gpu/device.h"

namespace strata::engine::testing {

// How a test reaches a device: carve device memory, copy bytes in and out (synchronously).
struct DeviceAccess {
  gpu::Stream* stream = nullptr;
  std::function<gpu::DeviceSpan(size_t size_bytes)> carve;
  std::function<void(gpu::DeviceSpan dst, std::span<const std::byte> src)> upload;
  std::function<std::vector<std::byte>(gpu::DeviceSpan src, size_t size_bytes)> download;
};

struct OptimizerCase {
  std::string name;
  cpu_optim::AnyOptimizer optimizer;
};

// Every kind and mode the device runs, with non-default hyper-parameters.
inline std::vector<OptimizerCase> DeviceOptimizerCases() {
  using cpu_optim::OptimizerKind;
  std::vector<OptimizerCase> cases;
  auto adam = [&](std::string name, OptimizerKind kind, float wd, bool amsgrad, bool maximize) {
    cpu_optim::AdamWConfig c;
    c.lr = 3e-3f;
    c.beta1 = 0.85f;
    c.beta2 = 0.995f;
    c.eps = 1e-7f;
    c.weight_decay = wd;
    c.decoupled_weight_decay = kind == OptimizerKind::kAdamW;
    c.amsgrad = amsgrad;
    c.maximize = maximize;
    cases.push_back({std::move(name), {kind, c}});
  };
  adam("AdamWDecoupled", OptimizerKind::kAdamW, 0.1f, false, false);
  adam("AdamWAmsgrad", OptimizerKind::kAdamW, 0.01f, true, false);
  adam("AdamWMaximize", OptimizerKind::kAdamW, 0.01f, false, true);
  adam("AdamL2", OptimizerKind::kAdam, 0.05f, false, false);
  adam("AdamNoDecayAmsgrad", OptimizerKind::kAdam, 0.0f, true, false);
  {
    cpu_optim::AdamWConfig c;  // beta1 < 0.5: torch's other lerp form
    c.beta1 = 0.3f;
    c.bias_correction = false;
    cases.push_back({"AdamWSmallBeta1NoBiasCorrection", {OptimizerKind::kAdamW, c}});
  }
  cases.push_back(
      {"Lion",
       {OptimizerKind::kLion,
        cpu_optim::LionConfig{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.98f, .weight_decay = 0.1f}}});
  cases.push_back(
      {"LionMaximize", {OptimizerKind::kLion, cpu_optim::LionConfig{.maximize = true}}});
  cases.push_back({"SgdPlain", {OptimizerKind::kSgd, cpu_optim::SgdConfig{.lr = 0.1f}}});
  cases.push_back({"SgdMomentumDampening",
                   {OptimizerKind::kSgd,
                    cpu_optim::SgdConfig{
                        .lr = 0.05f, .momentum = 0.9f, .dampening = 0.1f, .weight_decay = 0.01f}}});
  cases.push_back({"SgdNesterov",
                   {OptimizerKind::kSgd,
                    cpu_optim::SgdConfig{.lr = 0.05f, .momentum = 0.9f, .nesterov = true}}});
  cases.push_back(
      {"AdagradLrDecay",
       {OptimizerKind::kAdagrad, cpu_optim::AdagradConfig{.lr = 0.05f,
                                                          .lr_decay = 0.01f,
                                                          .weight_decay = 0.02f,
                                                          .initial_accumulator_value = 0.1f}}});
  return cases;
}

inline size_t ElemBytes(DType d) { return d == DType::kF32 ? 4 : 2; }

// num_elems random gradient elements of dtype, as bytes: mostly N(0, sigma), with zeros, signed
// zeros, denormals (fp32: 1e-40) and large values mixed in; finite (fp16 in its range).
inline std::vector<std::byte> RandomGrad(DType dtype, int64_t num_elems, std::mt19937_64& rng,
                                         float sigma = 1.0f) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<std::byte> bytes(static_cast<size_t>(num_elems) * ElemBytes(dtype));
  for (int64_t i = 0; i < num_elems; ++i) {
    float x = normal(rng);
    if (i % 97 == 0) x = 0.0f;
    if (i % 101 == 0) x = -0.0f;
    if (i % 103 == 0) x = dtype == DType::kF32 ? 1e-40f : 3e-6f;
    if (i % 107 == 0) x *= 1000.0f;
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + i * 4, &x, 4);
    } else {
      const uint16_t h = dtype == DType::kF16 ? FloatToHalf(x) : FloatToBf16(x);
      std::memcpy(bytes.data() + i * 2, &h, 2);
    }
  }
  return bytes;
}

inline std::vector<float> RandomFloats(int64_t num_elems, std::mt19937_64& rng, float sigma) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> v(static_cast<size_t>(num_elems));
  for (float& x : v) x = normal(rng);
  return v;
}

template <typename T>
std::span<const std::byte> Bytes(const std::vector<T>& v) {
  return std::as_bytes(std::span(v));
}

// Compares two byte buffers of elements of elem_bytes; reports the first differing element.
inline ::testing::AssertionResult SameBits(const std::vector<std::byte>& want,
                                           const std::vector<std::byte>& got, size_t elem_bytes) {
  if (want.size() != got.size()) {
    return ::testing::AssertionFailure() << "sizes " << want.size() << " vs " << got.size();
  }
  for (size_t i = 0; i < want.size(); i += elem_bytes) {
    if (std::memcmp(want.data() + i, got.data() + i, elem_bytes) != 0) {
      uint32_t a = 0, b = 0;
      std::memcpy(&a, want.data() + i, elem_bytes);
      std::memcpy(&b, got.data() + i, elem_bytes);
      return ::testing::AssertionFailure() << "element " << i / elem_bytes << ": cpu_optim bits 0x"
                                           << std::hex << a << ", device bits 0x" << b;
    }
  }
  return ::testing::AssertionSuccess();
}

// Runs `steps` steps of `c` over num_elems elements through EnqueueDeviceUpdate on the device and
// through cpu_optim::UpdateState on host copies of the same inputs, and expects the master
// weights, every state section and the copy-out to have the same bits after each step. With
// perturb, the device runs step t + 1 where cpu_optim runs t (a different update: the comparison
// must then find a difference, which the caller checks by the return value).
inline bool RunUpdateComparison(const DeviceAccess& d, const OptimizerCase& c, DType grad_dtype,
                                std::optional<DType> working, int64_t n, int steps, uint64_t seed,
                                bool perturb = false) {
  std::mt19937_64 rng(seed);
  const std::vector<int64_t> shape = {n};
  const std::vector<cpu_optim::StateSpec> layout =
      cpu_optim::StateLayout(c.optimizer, std::span(&shape, 1));
  std::vector<float> master = RandomFloats(n, rng, 0.5f);
  std::vector<std::vector<std::byte>> state;
  for (const cpu_optim::StateSpec& spec : layout) {
    state.emplace_back(spec.size_bytes());
    cpu_optim::InitializeState(spec, state.back());
  }
  const size_t wbytes = working ? static_cast<size_t>(n) * ElemBytes(*working) : 0;
  std::vector<std::byte> out(wbytes);

  DeviceUpdateBuffers b;
  b.num_elems = n;
  b.master = d.carve(static_cast<size_t>(n) * 4);
  d.upload(b.master, Bytes(master));
  for (size_t i = 0; i < layout.size(); ++i) {
    b.state.push_back(d.carve(layout[i].size_bytes()));
    d.upload(b.state.back(), state[i]);
  }
  b.grad = d.carve(static_cast<size_t>(n) * ElemBytes(grad_dtype));
  b.grad_dtype = grad_dtype;
  if (working) {
    b.working = d.carve(wbytes);
    b.working_dtype = *working;
  }
  bool all_same = true;
  for (int t = 1; t <= steps; ++t) {
    const std::vector<std::byte> grad = RandomGrad(grad_dtype, n, rng);
    const cpu_optim::OptimStep step{.step = t, .grad_scale = t == 2 ? 0.5f : 1.0f};
    d.upload(b.grad, grad);
    cpu_optim::OptimStep device_step = step;
    if (perturb) device_step.step = t + 1;
    const Status s = EnqueueDeviceUpdate(*d.stream, c.optimizer, device_step, b);
    EXPECT_TRUE(s.ok()) << s.ToString();
    std::vector<std::span<std::byte>> state_spans(state.begin(), state.end());
    const Status r = cpu_optim::UpdateState(
        c.optimizer, step, std::span(&shape, 1), master, state_spans, {grad.data(), grad_dtype},
        working ? cpu_optim::CopyOut{out.data(), *working} : cpu_optim::CopyOut{});
    EXPECT_TRUE(r.ok()) << r.ToString();
    const std::string where = c.name + " step " + std::to_string(t);
    const auto got_master = d.download(b.master, static_cast<size_t>(n) * 4);
    const auto want_master = std::vector<std::byte>(Bytes(master).begin(), Bytes(master).end());
    auto same = SameBits(want_master, got_master, 4);
    all_same = all_same && same;
    if (!perturb) {
      EXPECT_TRUE(same) << where << ": master";
    }
    for (size_t i = 0; i < layout.size(); ++i) {
      same = SameBits(state[i], d.download(b.state[i], layout[i].size_bytes()), 4);
      all_same = all_same && same;
      if (!perturb) {
        EXPECT_TRUE(same) << where << ": state " << layout[i].name;
      }
    }
    if (working) {
      same = SameBits(out, d.download(b.working, wbytes), ElemBytes(*working));
      all_same = all_same && same;
      if (!perturb) {
        EXPECT_TRUE(same) << where << ": working copy";
      }
    }
    if (perturb) {  // keep comparing from the same state
      d.upload(b.master, Bytes(master));
      for (size_t i = 0; i < layout.size(); ++i) d.upload(b.state[i], state[i]);
    }
  }
  return all_same;
}

// The statistics of a gradient through the device and cpu_optim::ComputeGradStats.
inline void ExpectStatsMatchCpu(const DeviceAccess& d, DType dtype,
                                const std::vector<std::byte>& grad, int64_t n, float scale,
                                const std::string& where) {
  gpu::DeviceSpan g = d.carve(std::max<size_t>(grad.size(), 1));
  if (!grad.empty()) d.upload(g, grad);
  const size_t record_bytes = DeviceGradStatsBytes(n);
  gpu::DeviceSpan rec = d.carve(record_bytes);
  const Status s = EnqueueDeviceGradStats(*d.stream, g, dtype, n, scale, rec);
  ASSERT_TRUE(s.ok()) << where << ": " << s.ToString();
  const std::vector<std::byte> record = d.download(rec, record_bytes);
  const auto got = DecodeDeviceGradStats(record);
  ASSERT_TRUE(got.ok()) << where << ": " << got.status().ToString();
  const auto want = cpu_optim::ComputeGradStats({grad.data(), dtype}, n, scale);
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  EXPECT_EQ(got->num_elems, n) << where;
  EXPECT_EQ(got->nonfinite, want->nonfinite) << where;
  if (!want->nonfinite) {
    // The device sums in cpu_optim's order: the same bits (bound 0).
    EXPECT_EQ(std::bit_cast<uint64_t>(got->sum_squares), std::bit_cast<uint64_t>(want->sum_squares))
        << where << ": device " << got->sum_squares << ", cpu_optim " << want->sum_squares;
  }
}

// EnqueueDeviceGradAccumulate against cpu_optim::AccumulateGrad on the same inputs.
inline void ExpectAccumulateMatchesCpu(const DeviceAccess& d, DType dtype, int64_t n,
                                       bool overwrite, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> acc = RandomFloats(n, rng, 2.0f);
  const std::vector<std::byte> grad = RandomGrad(dtype, n, rng);
  gpu::DeviceSpan a = d.carve(static_cast<size_t>(n) * 4);
  gpu::DeviceSpan g = d.carve(grad.size());
  d.upload(a, Bytes(acc));
  d.upload(g, grad);
  ASSERT_TRUE(EnqueueDeviceGradAccumulate(*d.stream, a, g, dtype, n, overwrite).ok());
  ASSERT_TRUE(cpu_optim::AccumulateGrad(acc, {grad.data(), dtype}, overwrite, false).ok());
  const auto want = std::vector<std::byte>(Bytes(acc).begin(), Bytes(acc).end());
  EXPECT_TRUE(SameBits(want, d.download(a, static_cast<size_t>(n) * 4), 4))
      << "dtype " << DTypeName(dtype) << " overwrite " << overwrite;
}

}  // namespace strata::engine::testing
