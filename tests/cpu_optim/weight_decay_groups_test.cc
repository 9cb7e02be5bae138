// UpdateState's weight decay groups (any_optimizer.h): the elements of the no-decay ranges step
// as torch.optim's second parameter group with weight_decay=0, the others as the first group,
// checked element by element and bit for bit against the whole buffer stepped once with each
// config (per-element kinds, Adafactor per tensor) or, for AdamW8bit, against the scalar
// reference AdamWUpdateReference applied element by element to the dequantized moments, which
// are then quantized once per block.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cpu_optim/adamw.h"
#include "cpu_optim/adamw8bit.h"
#include "cpu_optim/any_optimizer.h"
#include "tests/cpu_optim/test_data.h"

namespace strata::cpu_optim {
namespace {

using testing::GradData;
using testing::Mix;

// A buffer's master weights, state sections and bf16 copy-out, as bytes.
struct Buffers {
  std::vector<float> master;
  std::vector<std::vector<std::byte>> sections;
  std::vector<uint16_t> out;
  std::vector<std::span<std::byte>> spans() {
    std::vector<std::span<std::byte>> s;
    for (auto& b : sections) s.emplace_back(b);
    return s;
  }
};

// Master weights of O(1) and a state that is not the initial one (a few steps' worth of
// random moments), so that every group's formula shows in the result.
Buffers MakeBuffers(const AnyOptimizer& o, std::span<const std::vector<int64_t>> shapes,
                    std::mt19937& rng) {
  int64_t n = 0;
  for (const auto& s : shapes) {
    int64_t e = 1;
    for (int64_t d : s) e *= d;
    n += e;
  }
  Buffers b;
  std::uniform_real_distribution<float> w(-2.0f, 2.0f), pos(0.0f, 1e-2f);
  for (int64_t i = 0; i < n; ++i) b.master.push_back(w(rng));
  for (const StateSpec& spec : StateLayout(o, shapes)) {
    std::vector<std::byte> bytes(spec.size_bytes());
    if (spec.dtype == StateDType::kU8) {
      for (auto& x : bytes) x = static_cast<std::byte>(rng());
    } else {
      std::vector<float> f(static_cast<size_t>(spec.num_elems));
      for (auto& x : f)
        x = spec.name == "exp_avg" || spec.name == "momentum_buffer" ? w(rng) * 1e-2f : pos(rng);
      std::memcpy(bytes.data(), f.data(), bytes.size());
    }
    b.sections.push_back(std::move(bytes));
  }
  b.out.assign(static_cast<size_t>(n), 0xABAB);
  return b;
}

bool InRanges(std::span<const ElemRange> ranges, int64_t i) {
  for (const ElemRange& r : ranges) {
    if (i >= r.begin && i < r.end) return true;
  }
  return false;
}

Status Step(const AnyOptimizer& o, std::span<const std::vector<int64_t>> shapes, Buffers& b,
            const GradData& g, std::span<const ElemRange> no_decay = {}) {
  auto spans = b.spans();
  return UpdateState(o, OptimStep{.step = 3, .grad_scale = 0.5f}, shapes, b.master, spans, g.view(),
                     CopyOut{b.out.data(), DType::kBF16}, no_decay);
}

uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

std::vector<AnyOptimizer> PerElementKinds() {
  std::vector<AnyOptimizer> v;
  AdamWConfig adamw{.lr = 1e-2f, .weight_decay = 0.5f};
  v.push_back({OptimizerKind::kAdamW, adamw});
  AdamWConfig amsgrad = adamw;
  amsgrad.amsgrad = true;
  v.push_back({OptimizerKind::kAdamW, amsgrad});
  AdamWConfig adam = adamw;
  adam.decoupled_weight_decay = false;
  v.push_back({OptimizerKind::kAdam, adam});
  v.push_back({OptimizerKind::kLion, LionConfig{.lr = 1e-2f, .weight_decay = 0.5f}});
  v.push_back({OptimizerKind::kSgd,
               SgdConfig{.lr = 1e-2f, .momentum = 0.9f, .weight_decay = 0.5f, .nesterov = true}});
  v.push_back({OptimizerKind::kAdagrad, AdagradConfig{.lr = 1e-2f, .weight_decay = 0.5f}});
  return v;
}

// Every element of `got` equals `decayed`'s outside the ranges and `undecayed`'s inside, in every
// buffer whose layout is per element (master, copy-out, every state section of n elements).
void ExpectPicked(const Buffers& got, const Buffers& decayed, const Buffers& undecayed,
                  std::span<const ElemRange> ranges, const std::string& what) {
  const auto n = static_cast<int64_t>(got.master.size());
  int64_t differing = 0;  // elements where the two groups differ: the test must see some
  for (int64_t i = 0; i < n; ++i) {
    const Buffers& want = InRanges(ranges, i) ? undecayed : decayed;
    differing += Bits(decayed.master[i]) != Bits(undecayed.master[i]) && InRanges(ranges, i);
    ASSERT_EQ(Bits(got.master[i]), Bits(want.master[i])) << what << " master " << i;
    ASSERT_EQ(got.out[i], want.out[i]) << what << " copy-out " << i;
    for (size_t k = 0; k < got.sections.size(); ++k) {
      if (got.sections[k].size() != static_cast<size_t>(n) * 4) continue;
      float a, b;
      std::memcpy(&a, got.sections[k].data() + 4 * i, 4);
      std::memcpy(&b, want.sections[k].data() + 4 * i, 4);
      ASSERT_EQ(Bits(a), Bits(b)) << what << " state section " << k << " element " << i;
    }
  }
  EXPECT_GT(differing, 0) << what << ": weight decay changed nothing in the ranges";
}

TEST(WeightDecayGroupsTest, PerElementKindsStepEachGroupWithItsConfig) {
  const int64_t n = 5000;
  const std::vector<std::vector<int64_t>> shapes = {{n}};
  const std::vector<ElemRange> ranges = {{0, 7}, {100, 2100}, {4990, 5000}};
  for (const AnyOptimizer& o : PerElementKinds()) {
    std::mt19937 rng(7);
    const Buffers start = MakeBuffers(o, shapes, rng);
    const GradData g = GradData::Random(DType::kBF16, n, rng, Mix::kFinite);
    Buffers decayed = start, undecayed = start, got = start;
    ASSERT_TRUE(Step(o, shapes, decayed, g).ok());
    ASSERT_TRUE(Step(WithoutWeightDecay(o), shapes, undecayed, g).ok());
    const Status s = Step(o, shapes, got, g, ranges);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ExpectPicked(got, decayed, undecayed, ranges, std::string(OptimizerKindName(o.kind)));
  }
}

TEST(WeightDecayGroupsTest, AdafactorStepsEachTensorWithItsGroup) {
  AdafactorConfig c{.lr = 1e-2f, .beta1 = 0.9f, .weight_decay = 0.5f, .scale_parameter = true};
  const AnyOptimizer o{OptimizerKind::kAdafactor, c};
  const std::vector<std::vector<int64_t>> shapes = {{16, 8}, {8}, {4, 4}, {5}, {3, 2, 4}};
  const std::vector<ElemRange> ranges = {{128, 136}, {152, 157}};  // the two 1-D tensors
  std::mt19937 rng(11);
  const Buffers start = MakeBuffers(o, shapes, rng);
  const GradData g = GradData::Random(DType::kF32, 181, rng, Mix::kFinite);
  Buffers decayed = start, undecayed = start, got = start;
  ASSERT_TRUE(Step(o, shapes, decayed, g).ok());
  ASSERT_TRUE(Step(WithoutWeightDecay(o), shapes, undecayed, g).ok());
  const Status s = Step(o, shapes, got, g, ranges);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectPicked(got, decayed, undecayed, ranges, "Adafactor");
  // The factored statistics do not depend on the decay: the same in all three.
  EXPECT_EQ(got.sections[0], decayed.sections[0]);
  EXPECT_EQ(got.sections[1], decayed.sections[1]);

  // A range that cuts a tensor: refused, nothing written.
  Buffers cut = start;
  const std::vector<ElemRange> cutting = {{130, 136}};
  const Status e = Step(o, shapes, cut, g, cutting);
  EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.message().find("cut tensor 1 [128, 136)"), std::string::npos) << e.message();
  EXPECT_EQ(cut.master, start.master);
  EXPECT_EQ(cut.sections, start.sections);
}

// AdamW8bit with per-element decay, from the scalar references: the moments dequantized, each
// element stepped by AdamWUpdateReference with its group's config, the moments quantized per
// block of the whole buffer.
Buffers AdamW8bitByElement(const AdamWConfig& c, Buffers b, const GradData& g,
                           std::span<const ElemRange> no_decay) {
  const auto n = static_cast<int64_t>(b.master.size());
  const int64_t blocks = QuantizedAbsmaxCount(n);
  auto codes = [&](size_t k) {
    return std::span(reinterpret_cast<uint8_t*>(b.sections[k].data()), static_cast<size_t>(n));
  };
  auto absmax = [&](size_t k) {
    return std::span(reinterpret_cast<float*>(b.sections[k].data()), static_cast<size_t>(blocks));
  };
  std::vector<float> m(static_cast<size_t>(n)), v(static_cast<size_t>(n));
  EXPECT_TRUE(DequantizeBlockwise({codes(0), absmax(1)}, true, m).ok());
  EXPECT_TRUE(DequantizeBlockwise({codes(2), absmax(3)}, false, v).ok());
  AdamWConfig undecayed = c;
  undecayed.weight_decay = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const size_t e = static_cast<size_t>(i);
    const GradData one = [&] {
      GradData x(g.dtype(), 1);
      x.Set(0, g.value(i));
      return x;
    }();
    EXPECT_TRUE(AdamWUpdateReference(
                    InRanges(no_decay, i) ? undecayed : c, OptimStep{.step = 3, .grad_scale = 0.5f},
                    std::span(&b.master[e], 1), std::span(&m[e], 1), std::span(&v[e], 1),
                    one.view(), CopyOut{&b.out[e], DType::kBF16})
                    .ok());
  }
  EXPECT_TRUE(QuantizeBlockwise(m, true, {codes(0), absmax(1)}).ok());
  EXPECT_TRUE(QuantizeBlockwise(v, false, {codes(2), absmax(3)}).ok());
  return b;
}

TEST(WeightDecayGroupsTest, AdamW8bitQuantizesEachBlockOnceFromBothGroups) {
  const int64_t n = 3 * kQuantBlockElems + 300;
  const std::vector<std::vector<int64_t>> shapes = {{n}};
  // Ranges inside a block, straddling blocks, covering whole blocks and reaching the short last
  // block.
  const std::vector<ElemRange> ranges = {{10, 20}, {2040, 4200}, {6000, n}};
  for (bool decoupled : {true, false}) {
    AdamWConfig c{.lr = 1e-2f, .weight_decay = 0.5f};
    c.decoupled_weight_decay = decoupled;
    const AnyOptimizer o{OptimizerKind::kAdamW8bit, c};
    std::mt19937 rng(decoupled ? 3 : 4);
    const Buffers start = MakeBuffers(o, shapes, rng);
    const GradData g = GradData::Random(DType::kBF16, n, rng, Mix::kFinite);
    // The reference agrees with the 8-bit update where there are no ranges.
    Buffers whole = start;
    ASSERT_TRUE(Step(o, shapes, whole, g).ok());
    const Buffers whole_ref = AdamW8bitByElement(c, start, g, {});
    ASSERT_EQ(whole.master, whole_ref.master);
    ASSERT_EQ(whole.sections, whole_ref.sections);

    Buffers got = start;
    const Status s = Step(o, shapes, got, g, ranges);
    ASSERT_TRUE(s.ok()) << s.ToString();
    const Buffers want = AdamW8bitByElement(c, start, g, ranges);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(Bits(got.master[i]), Bits(want.master[i])) << decoupled << " master " << i;
      ASSERT_EQ(got.out[i], want.out[i]) << decoupled << " copy-out " << i;
    }
    for (size_t k = 0; k < got.sections.size(); ++k) {
      EXPECT_EQ(got.sections[k], want.sections[k]) << decoupled << " section " << k;
    }
    EXPECT_NE(got.master, whole.master);
  }
}

TEST(WeightDecayGroupsTest, BadRangesAndBuffersAreRefusedBeforeAnythingIsWritten) {
  const int64_t n = 300;
  const std::vector<std::vector<int64_t>> shapes = {{n}};
  const AnyOptimizer o{OptimizerKind::kAdamW, AdamWConfig{.lr = 1e-2f, .weight_decay = 0.5f}};
  std::mt19937 rng(5);
  const Buffers start = MakeBuffers(o, shapes, rng);
  const GradData g = GradData::Random(DType::kBF16, n, rng, Mix::kFinite);
  const std::vector<std::vector<ElemRange>> bad = {
      {{5, 5}}, {{10, 20}, {15, 30}}, {{20, 30}, {0, 10}}, {{250, 301}}, {{-1, 3}}};
  for (const auto& ranges : bad) {
    Buffers b = start;
    const Status s = Step(o, shapes, b, g, ranges);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("no-decay range"), std::string::npos) << s.message();
    EXPECT_EQ(b.master, start.master);
  }
  // A copy-out that overlaps the master weights only in the last run: the whole buffer is
  // checked first, so the first runs are not stepped either.
  Buffers b = start;
  auto spans = b.spans();
  const std::vector<ElemRange> ranges = {{0, 100}};
  const Status s = UpdateState(
      o, OptimStep{.step = 1}, shapes, b.master, spans, g.view(),
      CopyOut{reinterpret_cast<uint16_t*>(b.master.data()) + 2 * n - 10, DType::kBF16}, ranges);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(b.master, start.master);
}

}  // namespace
}  // namespace strata::cpu_optim
