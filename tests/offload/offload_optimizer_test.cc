// OffloadOptimizer against a sequential reference built from cpu_optim's primitives (gradient
// accumulation, statistics, the optimizers: each tested against its own fp64 reference in
// tests/cpu_optim), bit for bit: host and NVMe homes, thread counts, staging and per-segment
// hand-off, gradient accumulation, clipping, loss scaling, the overflow skip, save/load, and the
// errors of bad use and of a failing drive.
#include "offload/offload_optimizer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/dtype.h"
#include "cpu_optim/adafactor.h"
#include "cpu_optim/adamw8bit.h"
#include "cpu_optim/grad_stats.h"
#include "io/fault_injection.h"

namespace strata::engine {
namespace {

using cpu_optim::AnyOptimizer;
using cpu_optim::OptimizerKind;

std::string TempDir(const std::string& tag) {
  const char* base = std::getenv("TMPDIR");
  std::string dir = fmt::format("{}/strata-offload-test-{}-XXXXXX", base ? base : "/tmp", tag);
  EXPECT_NE(::mkdtemp(dir.data()), nullptr);
  return dir;
}

// One bucket as the caller holds it: param_dtype storage split into segments.
struct CallerBucket {
  int group = 0;
  DType dtype = DType::kF32;
  std::vector<int64_t> lengths;
  std::vector<std::vector<uint16_t>> p16;    // 16-bit params, one vector per segment
  std::vector<std::vector<float>> p32;       // fp32 params
  std::vector<std::vector<int64_t>> shapes;  // per segment; empty: every segment flat

  int64_t total() const {
    int64_t n = 0;
    for (int64_t l : lengths) n += l;
    return n;
  }
  void* data(size_t s) {
    return dtype == DType::kF32 ? static_cast<void*>(p32[s].data())
                                : static_cast<void*>(p16[s].data());
  }
  // The segments' values widened, flat.
  std::vector<float> Values() const {
    std::vector<float> out;
    for (size_t s = 0; s < lengths.size(); ++s) {
      for (int64_t i = 0; i < lengths[s]; ++i) {
        if (dtype == DType::kF32) {
          out.push_back(p32[s][i]);
        } else if (dtype == DType::kBF16) {
          out.push_back(Bf16ToFloat(p16[s][i]));
        } else {
          out.push_back(HalfToFloat(p16[s][i]));
        }
      }
    }
    return out;
  }
};

// The model of the tests: three buckets in two groups (AdamW, SGD with momentum), every dtype,
// odd segment lengths.
struct TestModel {
  std::vector<AnyOptimizer> groups;
  std::vector<CallerBucket> buckets;
};

// Appends a tensor of l N(0, 1) values to the caller's bucket, in `dtype`.
void AddRandomTensor(CallerBucket& b, DType dtype, int64_t l, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(l);
  for (float& x : v) x = normal(rng);
  if (dtype == DType::kF32) {
    b.p32.push_back(v);
    return;
  }
  std::vector<uint16_t> h(l);
  for (int64_t i = 0; i < l; ++i) {
    h[i] = dtype == DType::kBF16 ? FloatToBf16(v[i]) : FloatToHalf(v[i]);
  }
  b.p16.push_back(h);
}

TestModel MakeModel(uint64_t seed) {
  TestModel s;
  cpu_optim::AdamWConfig adamw{.lr = 1e-2f, .weight_decay = 0.1f};
  s.groups.push_back(AnyOptimizer{OptimizerKind::kAdamW, adamw});
  cpu_optim::SgdConfig sgd{.lr = 5e-2f, .momentum = 0.9f, .weight_decay = 1e-3f};
  s.groups.push_back(AnyOptimizer{OptimizerKind::kSgd, sgd});
  std::mt19937_64 rng(seed);
  auto add = [&](int group, DType dtype, std::vector<int64_t> lengths) {
    CallerBucket b;
    b.group = group;
    b.dtype = dtype;
    b.lengths = lengths;
    for (int64_t l : lengths) {
      AddRandomTensor(b, dtype, l, rng);
    }
    s.buckets.push_back(std::move(b));
  };
  add(0, DType::kBF16, {1000, 3, 4097});
  add(1, DType::kF32, {777, 65});
  add(0, DType::kF16, {5001});
  return s;
}

// Gradients of one micro-batch: per bucket, flat, of grad dtype `dtype` (as raw bytes).
struct Grads {
  DType dtype;
  std::vector<std::vector<std::byte>> per_bucket;
};

Grads MakeGrads(const TestModel& s, DType dtype, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  Grads g{dtype, {}};
  for (const CallerBucket& b : s.buckets) {
    std::vector<std::byte> bytes(b.total() * SizeOf(dtype));
    for (int64_t i = 0; i < b.total(); ++i) {
      const float v = normal(rng);
      if (dtype == DType::kF32) {
        std::memcpy(bytes.data() + 4 * i, &v, 4);
      } else {
        const uint16_t h = dtype == DType::kBF16 ? FloatToBf16(v) : FloatToHalf(v);
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      }
    }
    g.per_bucket.push_back(std::move(bytes));
  }
  return g;
}

std::unique_ptr<OffloadOptimizer> Create(TestModel& s, OffloadOptimizerOptions o) {
  auto opt = OffloadOptimizer::Create(std::move(o));
  EXPECT_TRUE(opt.ok()) << opt.status().ToString();
  if (!opt.ok()) return nullptr;
  for (const AnyOptimizer& g : s.groups) {
    auto id = (*opt)->AddGroup(g);
    EXPECT_TRUE(id.ok()) << id.status().ToString();
  }
  for (CallerBucket& b : s.buckets) {
    std::vector<OffloadSegment> segs;
    for (size_t i = 0; i < b.lengths.size(); ++i) {
      segs.push_back(
          {b.data(i), b.lengths[i], b.shapes.empty() ? std::vector<int64_t>{} : b.shapes[i]});
    }
    auto id = (*opt)->AddBucket(b.group, b.dtype, segs);
    EXPECT_TRUE(id.ok()) << id.status().ToString();
  }
  return std::move(*opt);
}

enum class HandOff { kWhole, kStaging, kSegments };

void Submit(OffloadOptimizer& opt, const TestModel& s, const Grads& g, HandOff how) {
  // Backward order: the last bucket first.
  for (int b = static_cast<int>(s.buckets.size()) - 1; b >= 0; --b) {
    const std::vector<std::byte>& bytes = g.per_bucket[b];
    switch (how) {
      case HandOff::kWhole:
        ASSERT_TRUE(opt.SubmitGradient(b, -1, bytes.data(), g.dtype, s.buckets[b].total()).ok());
        break;
      case HandOff::kStaging: {
        auto staging = opt.AcquireStaging(b, g.dtype);
        ASSERT_TRUE(staging.ok()) << staging.status().ToString();
        ASSERT_EQ(staging->size(), bytes.size());
        std::memcpy(staging->data(), bytes.data(), bytes.size());
        ASSERT_TRUE(opt.SubmitGradient(b, -1, staging->data(), g.dtype, s.buckets[b].total()).ok());
        break;
      }
      case HandOff::kSegments: {
        int64_t off = 0;
        const auto& lengths = s.buckets[b].lengths;
        for (int seg = static_cast<int>(lengths.size()) - 1; seg >= 0; --seg) {
          off = 0;
          for (int i = 0; i < seg; ++i) off += lengths[i];
          ASSERT_TRUE(opt.SubmitGradient(b, seg, bytes.data() + off * SizeOf(g.dtype), g.dtype,
                                         lengths[seg])
                          .ok());
        }
        break;
      }
    }
  }
}

// The sequential reference: fp32 masters and state per bucket, stepped with cpu_optim directly.
struct Reference {
  std::vector<std::vector<float>> master;
  std::vector<std::vector<std::vector<float>>> state;
  std::vector<int64_t> steps;

  explicit Reference(const TestModel& s) : steps(s.groups.size(), 0) {
    for (const CallerBucket& b : s.buckets) {
      master.push_back(b.Values());
      std::vector<std::vector<float>> st;
      const AnyOptimizer& o = s.groups[b.group];
      for (int i = 0; i < cpu_optim::NumState(o); ++i) {
        st.emplace_back(b.total(), cpu_optim::InitialStateValue(o, i));
      }
      state.push_back(std::move(st));
    }
  }

  // Returns whether the step was applied (false: a non-finite gradient).
  bool Step(const TestModel& s, const std::vector<Grads>& micro, double max_norm,
            float loss_scale) {
    std::vector<std::vector<float>> accum;
    cpu_optim::GradStats total;
    for (size_t b = 0; b < s.buckets.size(); ++b) {
      const CallerBucket& cb = s.buckets[b];
      std::vector<float> acc(cb.total());
      int64_t off = 0;
      for (int64_t len : cb.lengths) {
        cpu_optim::GradStats last;
        for (size_t m = 0; m < micro.size(); ++m) {
          const auto* g = micro[m].per_bucket[b].data() + off * SizeOf(micro[m].dtype);
          auto st = cpu_optim::AccumulateGrad(std::span<float>(acc.data() + off, len),
                                              {g, micro[m].dtype}, m == 0, true);
          EXPECT_TRUE(st.ok());
          last = *st;
        }
        cpu_optim::Merge(total, last);
        off += len;
      }
      accum.push_back(std::move(acc));
    }
    const double norm = std::sqrt(total.sum_squares) / loss_scale;
    if (total.nonfinite || !std::isfinite(norm)) return false;
    float clip = 1.0f;
    if (max_norm > 0 && max_norm / (norm + 1e-6) < 1.0) {
      clip = static_cast<float>(max_norm / (norm + 1e-6));
    }
    const float grad_scale = loss_scale == 1.0f ? clip : clip / loss_scale;
    for (int64_t& t : steps) ++t;
    for (size_t b = 0; b < s.buckets.size(); ++b) {
      const AnyOptimizer& o = s.groups[s.buckets[b].group];
      std::vector<std::span<float>> st;
      for (auto& v : state[b]) st.emplace_back(v);
      EXPECT_TRUE(
          cpu_optim::Update(
              o, cpu_optim::OptimStep{.step = steps[s.buckets[b].group], .grad_scale = grad_scale},
              master[b], st, {accum[b].data(), DType::kF32})
              .ok());
    }
    return true;
  }
};

void ExpectEqualsReference(OffloadOptimizer& opt, const TestModel& s, const Reference& ref) {
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    ASSERT_TRUE(opt.WaitBucket(static_cast<int>(b)).ok());
    const int64_t n = s.buckets[b].total();
    std::vector<float> got(n);
    ASSERT_TRUE(opt.ReadState(static_cast<int>(b), 0, got).ok());
    ASSERT_EQ(0, std::memcmp(got.data(), ref.master[b].data(), n * 4)) << "masters of bucket " << b;
    for (size_t t = 0; t < ref.state[b].size(); ++t) {
      ASSERT_TRUE(opt.ReadState(static_cast<int>(b), static_cast<int>(t) + 1, got).ok());
      ASSERT_EQ(0, std::memcmp(got.data(), ref.state[b][t].data(), n * 4))
          << "state " << t << " of bucket " << b;
    }
    // The caller's segments hold the masters rounded to their dtype.
    const std::vector<float> values = s.buckets[b].Values();
    for (int64_t i = 0; i < n; ++i) {
      float want = ref.master[b][i];
      if (s.buckets[b].dtype == DType::kBF16) want = Bf16ToFloat(FloatToBf16(want));
      if (s.buckets[b].dtype == DType::kF16) want = HalfToFloat(FloatToHalf(want));
      ASSERT_EQ(values[i], want) << "bucket " << b << " element " << i;
    }
  }
}

struct Variant {
  OffloadOptimizerOptions::Home home;
  int threads;
  HandOff hand_off;
  DType grad_dtype;
};

class OffloadEquivalence : public ::testing::TestWithParam<Variant> {};

TEST_P(OffloadEquivalence, StepsMatchTheSequentialReferenceBitForBit) {
  const Variant v = GetParam();
  TestModel s = MakeModel(7);
  Reference ref(s);
  OffloadOptimizerOptions o;
  o.home = v.home;
  o.num_threads = v.threads;
  o.staging_buffers = 2;  // fewer than buckets: acquiring waits for folds
  o.buffer_count = 2;
  std::string dir;
  if (v.home == OffloadOptimizerOptions::Home::kNvme) {
    dir = TempDir("eq");
    o.nvme_paths = {dir};
  }
  auto opt = Create(s, o);
  ASSERT_NE(opt, nullptr);
  // 4 steps: accumulation of 2, clipping that bites, an fp16-style loss scale.
  for (int step = 0; step < 4; ++step) {
    const float loss_scale = step == 3 ? 1024.0f : 1.0f;
    std::vector<Grads> micro = {MakeGrads(s, v.grad_dtype, 100 + 2 * step, 0.5f * loss_scale),
                                MakeGrads(s, v.grad_dtype, 101 + 2 * step, 0.5f * loss_scale)};
    for (const Grads& g : micro) Submit(*opt, s, g, v.hand_off);
    OffloadStepResult r;
    ASSERT_TRUE(opt->Step({.max_grad_norm = 20.0, .loss_scale = loss_scale}, &r).ok());
    EXPECT_FALSE(r.skipped);
    EXPECT_EQ(r.micro_batches, 2);
    ASSERT_TRUE(ref.Step(s, micro, 20.0, loss_scale));
    ExpectEqualsReference(*opt, s, ref);
  }
  EXPECT_EQ(opt->group_step(0), 4);
  EXPECT_EQ(opt->counters().steps, 4);
  if (v.home == OffloadOptimizerOptions::Home::kNvme) {
    EXPECT_GT(opt->counters().nvme_bytes_written, 0u);
    opt.reset();
    std::filesystem::remove_all(dir);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Homes, OffloadEquivalence,
    ::testing::Values(
        Variant{OffloadOptimizerOptions::Home::kHost, 1, HandOff::kWhole, DType::kBF16},
        Variant{OffloadOptimizerOptions::Home::kHost, 2, HandOff::kStaging, DType::kF16},
        Variant{OffloadOptimizerOptions::Home::kHost, 0, HandOff::kSegments, DType::kF32},
        Variant{OffloadOptimizerOptions::Home::kNvme, 2, HandOff::kWhole, DType::kF32},
        Variant{OffloadOptimizerOptions::Home::kNvme, 1, HandOff::kStaging, DType::kBF16},
        Variant{OffloadOptimizerOptions::Home::kNvme, 2, HandOff::kSegments, DType::kF16}));

TEST(OffloadOptimizer, NonFiniteGradientSkipsTheStepAndChangesNothing) {
  TestModel s = MakeModel(3);
  auto opt = Create(s, {});
  ASSERT_NE(opt, nullptr);
  Grads g = MakeGrads(s, DType::kF16, 1, 1.0f);
  Submit(*opt, s, g, HandOff::kWhole);
  ASSERT_TRUE(opt->Step({}, nullptr).ok());
  ASSERT_TRUE(opt->Synchronize().ok());
  const TestModel before = s;
  std::vector<float> master_before(s.buckets[1].total());
  ASSERT_TRUE(opt->ReadState(1, 0, master_before).ok());

  Grads bad = MakeGrads(s, DType::kF16, 2, 1.0f);
  const uint16_t inf = 0x7c00;
  std::memcpy(bad.per_bucket[2].data() + 2 * 4000, &inf, 2);
  Submit(*opt, s, bad, HandOff::kWhole);
  OffloadStepResult r;
  ASSERT_TRUE(opt->Step({.loss_scale = 65536.0f}, &r).ok());
  EXPECT_TRUE(r.skipped);
  EXPECT_FALSE(std::isfinite(r.grad_norm));
  ASSERT_TRUE(opt->Synchronize().ok());
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    EXPECT_EQ(s.buckets[b].p16, before.buckets[b].p16);
    EXPECT_EQ(s.buckets[b].p32, before.buckets[b].p32);
  }
  std::vector<float> master_after(s.buckets[1].total());
  ASSERT_TRUE(opt->ReadState(1, 0, master_after).ok());
  EXPECT_EQ(master_before, master_after);
  EXPECT_EQ(opt->group_step(0), 1);
  EXPECT_EQ(opt->counters().skipped_steps, 1);
  // The next clean step works and counts from where it was.
  Submit(*opt, s, g, HandOff::kWhole);
  ASSERT_TRUE(opt->Step({}, &r).ok());
  EXPECT_FALSE(r.skipped);
  EXPECT_EQ(opt->group_step(0), 2);
}

TEST(OffloadOptimizer, SaveLoadIntoANewOptimizerContinuesBitIdentically) {
  for (auto home : {OffloadOptimizerOptions::Home::kHost, OffloadOptimizerOptions::Home::kNvme}) {
    SCOPED_TRACE(home == OffloadOptimizerOptions::Home::kHost ? "host" : "nvme");
    const std::string dir = TempDir("ckpt");
    OffloadOptimizerOptions o;
    o.home = home;
    if (home == OffloadOptimizerOptions::Home::kNvme) o.nvme_paths = {dir};
    auto grads = [&](const TestModel& s, int step) {
      return MakeGrads(s, DType::kBF16, 500 + step, 0.3f);
    };
    // Uninterrupted: 4 steps.
    TestModel a = MakeModel(11);
    auto opt_a = Create(a, o);
    for (int step = 0; step < 4; ++step) {
      const Grads g = grads(a, step);  // must outlive its fold: Step waits for it
      Submit(*opt_a, a, g, HandOff::kWhole);
      ASSERT_TRUE(opt_a->Step({.max_grad_norm = 5.0}, nullptr).ok());
    }
    ASSERT_TRUE(opt_a->Synchronize().ok());
    // Interrupted: 2 steps, save, a new optimizer over a fresh model, load, 2 steps.
    TestModel b = MakeModel(11);
    auto opt_b = Create(b, o);
    for (int step = 0; step < 2; ++step) {
      const Grads g = grads(b, step);
      Submit(*opt_b, b, g, HandOff::kWhole);
      ASSERT_TRUE(opt_b->Step({.max_grad_norm = 5.0}, nullptr).ok());
    }
    const std::string ckpt = dir + "/opt";
    ASSERT_TRUE(opt_b->Save(ckpt).ok());
    ASSERT_TRUE(opt_b->Save(ckpt).ok());  // replacing an existing save works
    // Save replaces its directory whole: never a user's file, or a directory of other files.
    std::ofstream(dir + "/model.pt") << "the model";
    std::filesystem::create_directory(dir + "/shared");
    std::ofstream(dir + "/shared/model.pt") << "the model";
    for (const std::string& not_ours : {dir + "/model.pt", dir + "/shared"}) {
      const Status refused = opt_b->Save(not_ours);
      EXPECT_EQ(refused.code(), StatusCode::kAlreadyExists) << not_ours;
      EXPECT_NE(refused.message().find("model.pt"), std::string::npos) << refused.ToString();
    }
    EXPECT_EQ(opt_b->Save(dir).code(), StatusCode::kAlreadyExists);  // holds opt/, model.pt, ...
    std::ifstream kept(dir + "/shared/model.pt");
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), {}), "the model");
    EXPECT_TRUE(std::filesystem::is_regular_file(dir + "/model.pt"));
    EXPECT_TRUE(std::filesystem::is_regular_file(ckpt + "/manifest.json"));
    opt_b.reset();
    TestModel c = MakeModel(999);  // different initial weights: the load must replace them
    auto opt_c = Create(c, o);
    const Status loaded = opt_c->Load(ckpt);
    ASSERT_TRUE(loaded.ok()) << loaded.ToString();
    EXPECT_EQ(opt_c->group_step(0), 2);
    for (size_t k = 0; k < c.buckets.size(); ++k) {
      EXPECT_EQ(b.buckets[k].Values(), c.buckets[k].Values()) << "after load, bucket " << k;
    }
    for (int step = 2; step < 4; ++step) {
      const Grads g = grads(c, step);
      Submit(*opt_c, c, g, HandOff::kWhole);
      ASSERT_TRUE(opt_c->Step({.max_grad_norm = 5.0}, nullptr).ok());
    }
    ASSERT_TRUE(opt_c->Synchronize().ok());
    for (size_t k = 0; k < a.buckets.size(); ++k) {
      EXPECT_EQ(a.buckets[k].Values(), c.buckets[k].Values()) << "bucket " << k;
      for (int t = 0; t < 3 && t <= cpu_optim::NumState(a.groups[a.buckets[k].group]); ++t) {
        std::vector<float> x(a.buckets[k].total()), y(a.buckets[k].total());
        ASSERT_TRUE(opt_a->ReadState(static_cast<int>(k), t, x).ok());
        ASSERT_TRUE(opt_c->ReadState(static_cast<int>(k), t, y).ok());
        EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * 4)) << "bucket " << k << " t " << t;
      }
    }

    // Another structure is refused before anything changes.
    TestModel other = MakeModel(11);
    other.buckets[1].lengths = {777, 64};
    other.buckets[1].p32[1].resize(64);
    auto opt_o = Create(other, o);
    const Status wrong = opt_o->Load(ckpt);
    EXPECT_EQ(wrong.code(), StatusCode::kInvalidArgument) << wrong.ToString();
    EXPECT_NE(wrong.message().find("bucket 1 differs"), std::string::npos) << wrong.ToString();
    EXPECT_EQ(opt_o->group_step(0), 0);

    // A damaged file is kDataLoss.
    {
      std::fstream f(ckpt + "/optimizer.safetensors",
                     std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(-5, std::ios::end);
      f.put('\x7f');
    }
    TestModel d = MakeModel(11);
    auto opt_d = Create(d, o);
    const Status damaged = opt_d->Load(ckpt);
    EXPECT_EQ(damaged.code(), StatusCode::kDataLoss) << damaged.ToString();
    opt_a.reset();
    opt_c.reset();
    opt_o.reset();
    opt_d.reset();
    std::filesystem::remove_all(dir);
  }
}

// A saved state's manifest.json is read back from a file that may be damaged or edited by hand:
// each bad field is one clean line naming it (text from the file escaped, no number converted
// out of range), and the optimizer is left as it was.
TEST(OffloadOptimizer, AHandEditedManifestIsOneCleanLineAndChangesNothing) {
  const std::string dir = TempDir("manifest");
  const std::string ckpt = dir + "/opt";
  TestModel a = MakeModel(11);
  {
    auto opt_a = Create(a, {});
    const Grads g = MakeGrads(a, DType::kBF16, 500, 0.3f);
    Submit(*opt_a, a, g, HandOff::kWhole);
    ASSERT_TRUE(opt_a->Step({}, nullptr).ok());
    ASSERT_TRUE(opt_a->Save(ckpt).ok());
  }
  const std::string manifest_path = ckpt + "/manifest.json";
  std::string saved_text;
  {
    std::ifstream in(manifest_path);
    saved_text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const nlohmann::json saved = nlohmann::json::parse(saved_text);
  ASSERT_TRUE(saved.at("buckets").at(2).contains("shapes")) << saved_text;
  using Edit = std::function<void(nlohmann::json&)>;
  struct Case {
    std::string name;
    Edit edit;  // applied to the saved manifest; nullptr: `text` is written instead
    std::string text;
    StatusCode code;
    std::string expected;  // a part of the message
  };
  const std::vector<Case> cases = {
      {"a control character in the format", [](auto& m) { m["format"] = "strata\x01offload"; }, "",
       StatusCode::kInvalidArgument, "(format 'strata\\x01offload')"},
      {"a control character in a kind",
       [](auto& m) { m["groups"][0]["optimizer"]["kind"] = "Ad\x1b[2Jam"; }, "",
       StatusCode::kInvalidArgument, "group 0 was Ad\\x1B[2Jam, here it is AdamW"},
      {"an lr beyond fp32", [](auto& m) { m["groups"][0]["optimizer"]["lr"] = 6.7e98; }, "",
       StatusCode::kDataLoss, "\"lr\" = 6.7e+98 does not fit fp32"},
      {"a version beyond int", [](auto& m) { m["format_version"] = 1e300; }, "",
       StatusCode::kDataLoss, "manifest.json: format_version is missing or not a number"},
      {"a step beyond int64", [](auto& m) { m["groups"][1]["step"] = 1e300; }, "",
       StatusCode::kDataLoss, "manifest.json: groups[1].step is missing or not a number"},
      {"a negative step", [](auto& m) { m["groups"][1]["step"] = -2; }, "", StatusCode::kDataLoss,
       "groups[1].step = -2 is outside [0, 9223372036854775807]"},
      {"a fractional segment", [](auto& m) { m["buckets"][0]["segments"][1] = 3.5; }, "",
       StatusCode::kDataLoss, "buckets[0].segments[1] = 3.5 is not an integer in [1, "},
      {"a group beyond int", [](auto& m) { m["buckets"][0]["group"] = -1e300; }, "",
       StatusCode::kDataLoss, "buckets[0].group is missing or not a number"},
      {"a DEL in a dtype",
       [](auto& m) {
         m["buckets"][1]["dtype"] =
             "f\x7f"
             "32";
       },
       "", StatusCode::kInvalidArgument, "saved group 1, dtype f\\x7F32,"},
      {"shapes whose product overflows",
       [](auto& m) {
         m["buckets"][2]["shapes"] = nlohmann::json::array(
             {nlohmann::json::array({int64_t{1} << 32, int64_t{1} << 32, 3})});
       },
       "", StatusCode::kDataLoss,
       "buckets[2].shapes[0] [4294967296, 4294967296, 3] does not hold the segment's 5001 "
       "elements"},
      {"a shape per segment missing", [](auto& m) { m["buckets"][0]["shapes"].erase(0); }, "",
       StatusCode::kDataLoss, "buckets[0].shapes lists 2 shapes for 3 segments"},
      {"an xxh3 that is not hex", [](auto& m) { m["files"][0]["xxh3"] = "12zz\n"; }, "",
       StatusCode::kDataLoss, "files[0].xxh3 '12zz\\x0A' is not 16 hex digits"},
      {"a negative size", [](auto& m) { m["files"][0]["size_bytes"] = -3; }, "",
       StatusCode::kDataLoss, "files[0].size_bytes = -3 is outside"},
      {"no file", [](auto& m) { m["files"] = nlohmann::json::array(); }, "", StatusCode::kDataLoss,
       "files[0] is not an object"},
      {"nested too deep", nullptr, std::string(100, '[') + std::string(100, ']'),
       StatusCode::kDataLoss, "nested deeper than 64 levels"},
      {"a control character where the JSON breaks", nullptr, "{\"format\": \x01\x02}",
       StatusCode::kDataLoss, "manifest.json: malformed JSON"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    {
      std::ofstream out(manifest_path, std::ios::trunc);
      if (c.edit) {
        nlohmann::json m = saved;
        c.edit(m);
        out << m.dump(2, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
      } else {
        out << c.text;
      }
    }
    TestModel b = MakeModel(12);
    const std::vector<float> before = b.buckets[0].Values();
    auto opt = Create(b, {});
    const Status loaded = opt->Load(ckpt);
    EXPECT_EQ(loaded.code(), c.code) << loaded.ToString();
    const std::string& message = loaded.message();
    EXPECT_NE(message.find(c.expected), std::string::npos) << message;
    EXPECT_NE(message.find("offload optimizer: Load '" + ckpt + "'"), std::string::npos) << message;
    for (char ch : message) {
      EXPECT_TRUE(static_cast<unsigned char>(ch) >= 0x20 && ch != 0x7f)
          << "byte " << static_cast<int>(static_cast<unsigned char>(ch)) << " in " << message;
    }
    EXPECT_EQ(opt->group_step(0), 0);
    EXPECT_EQ(opt->group_step(1), 0);
    EXPECT_EQ(b.buckets[0].Values(), before);
  }
  // The saved text itself still loads.
  { std::ofstream(manifest_path, std::ios::trunc) << saved_text; }
  TestModel c = MakeModel(12);
  auto opt_c = Create(c, {});
  const Status loaded = opt_c->Load(ckpt);
  EXPECT_TRUE(loaded.ok()) << loaded.ToString();
  EXPECT_EQ(opt_c->group_step(0), 1);
  EXPECT_EQ(c.buckets[0].Values(), a.buckets[0].Values());
  opt_c.reset();
  std::filesystem::remove_all(dir);
}

TEST(OffloadOptimizer, BadUseIsAClearErrorAndChangesNothing) {
  TestModel s = MakeModel(5);
  auto opt = Create(s, {});
  ASSERT_NE(opt, nullptr);
  Grads g = MakeGrads(s, DType::kF32, 1, 1.0f);
  const void* p = g.per_bucket[0].data();
  EXPECT_EQ(opt->SubmitGradient(7, -1, p, DType::kF32, 10).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(opt->SubmitGradient(0, 3, p, DType::kF32, 10).code(), StatusCode::kInvalidArgument);
  const Status size = opt->SubmitGradient(0, 0, p, DType::kF32, 999);
  EXPECT_EQ(size.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(size.message().find("1000 elements"), std::string::npos) << size.ToString();
  EXPECT_EQ(opt->SubmitGradient(0, 0, nullptr, DType::kF32, 1000).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(opt->SubmitGradient(0, 0, p, static_cast<DType>(9), 1000).code(),
            StatusCode::kInvalidArgument);

  // A step before every segment received its gradient.
  ASSERT_TRUE(opt->SubmitGradient(0, -1, p, DType::kF32, s.buckets[0].total()).ok());
  const Status early = opt->Step({}, nullptr);
  EXPECT_EQ(early.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(early.message().find("bucket 1 segment 0 has 0"), std::string::npos)
      << early.ToString();
  EXPECT_EQ(opt->group_step(0), 0);
  // The same segment twice in one micro-batch.
  const Status twice =
      opt->SubmitGradient(0, 1, static_cast<const std::byte*>(p) + 4000, DType::kF32, 3);
  EXPECT_EQ(twice.code(), StatusCode::kFailedPrecondition) << twice.ToString();
  // Completing the micro-batch makes the step work.
  for (int b = 1; b < 3; ++b) {
    ASSERT_TRUE(
        opt->SubmitGradient(b, -1, g.per_bucket[b].data(), DType::kF32, s.buckets[b].total()).ok());
  }
  OffloadStepResult r;
  ASSERT_TRUE(opt->Step({}, &r).ok());
  EXPECT_EQ(r.micro_batches, 1);
  // Buckets are fixed once gradients flowed.
  std::vector<float> extra(10);
  const OffloadSegment seg{extra.data(), 10, {}};
  EXPECT_EQ(opt->AddBucket(0, DType::kF32, {&seg, 1}).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(opt->Step({.loss_scale = 0.0f}, nullptr).code(), StatusCode::kInvalidArgument);
  // Overlapping segments and a kind change are refused.
  TestModel t = MakeModel(5);
  auto opt2 = Create(t, {});
  const OffloadSegment overlap{t.buckets[1].p32[0].data() + 10, 5, {}};
  EXPECT_EQ(opt2->AddBucket(1, DType::kF32, {&overlap, 1}).status().code(),
            StatusCode::kInvalidArgument);
  const Status kind_change =
      opt2->SetGroupOptimizer(0, AnyOptimizer{OptimizerKind::kSgd, cpu_optim::SgdConfig{}});
  EXPECT_EQ(kind_change.code(), StatusCode::kInvalidArgument);
  // It names what the group has and would have, not the sizes of a layout no bucket has.
  EXPECT_EQ(kind_change.message(),
            "offload optimizer: group 0 is AdamW with state exp_avg, exp_avg_sq; its new config "
            "is SGD with no state: the kind, amsgrad, whether SGD has momentum (0 or not) and "
            "whether Adafactor has beta1 cannot change after the group was added");
  cpu_optim::AdamWConfig lr_changed{.lr = 3e-4f, .weight_decay = 0.1f};
  EXPECT_TRUE(opt2->SetGroupOptimizer(0, AnyOptimizer{OptimizerKind::kAdamW, lr_changed}).ok());
}

// Every staging buffer acquired and none submitted: no fold would ever return one, so the next
// AcquireStaging says so instead of waiting forever (calls on one handle do not overlap).
TEST(OffloadOptimizer, AcquiringMoreStagingThanThePoolHoldsIsAnErrorNotAHang) {
  TestModel s = MakeModel(6);
  OffloadOptimizerOptions o;
  o.staging_buffers = 2;
  auto opt = Create(s, o);
  ASSERT_NE(opt, nullptr);
  auto first = opt->AcquireStaging(0, DType::kF32);
  auto second = opt->AcquireStaging(1, DType::kF32);
  ASSERT_TRUE(first.ok() && second.ok());
  const auto third = opt->AcquireStaging(2, DType::kF32);
  EXPECT_EQ(third.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(third.status().message().find("all 2 staging buffers are acquired and none was "
                                          "submitted"),
            std::string::npos)
      << third.status().ToString();
  // Not sticky: once one is submitted, its fold frees it for the next acquire.
  const Grads g = MakeGrads(s, DType::kF32, 2, 1.0f);
  std::memcpy(first->data(), g.per_bucket[0].data(), first->size());
  ASSERT_TRUE(opt->SubmitGradient(0, -1, first->data(), DType::kF32, s.buckets[0].total()).ok());
  auto again = opt->AcquireStaging(2, DType::kF32);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->data(), first->data());
}

// DiscardGradients (torch's zero_grad between backward and step, or after a backward that raised
// halfway): whatever was handed in since the last step leaves no trace. Optimizer A receives a
// half micro-batch (one bucket whole, one segment of another, a staging buffer acquired and never
// submitted), discards it and then receives g; B receives g only. Both step the same, bit for bit,
// at the first step and with the previous update still in flight (on NVMe, its write-back too).
TEST(OffloadOptimizer, DiscardedGradientsLeaveNoTrace) {
  for (auto home : {OffloadOptimizerOptions::Home::kHost, OffloadOptimizerOptions::Home::kNvme}) {
    SCOPED_TRACE(home == OffloadOptimizerOptions::Home::kHost ? "host" : "nvme");
    TestModel a_model = MakeModel(9);
    TestModel b_model = a_model;
    std::vector<std::string> dirs;
    auto options = [&] {
      OffloadOptimizerOptions o;
      o.home = home;
      o.staging_buffers = 2;
      o.buffer_count = 2;
      if (home == OffloadOptimizerOptions::Home::kNvme) {
        dirs.push_back(TempDir("discard"));
        o.nvme_paths = {dirs.back()};
      }
      return o;
    };
    auto a = Create(a_model, options());
    auto b = Create(b_model, options());
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    for (int step = 0; step < 3; ++step) {
      const Grads junk = MakeGrads(a_model, DType::kBF16, 500 + step, 100.0f);
      ASSERT_TRUE(a->SubmitGradient(2, -1, junk.per_bucket[2].data(), DType::kBF16,
                                    a_model.buckets[2].total())
                      .ok());
      ASSERT_TRUE(a->SubmitGradient(0, 1, junk.per_bucket[0].data(), DType::kBF16, 3).ok());
      auto held = a->AcquireStaging(1, DType::kF32);
      ASSERT_TRUE(held.ok()) << held.status().ToString();
      ASSERT_TRUE(a->DiscardGradients().ok());
      // The held buffer is back in the pool: both can be acquired again.
      auto first = a->AcquireStaging(0, DType::kF32);
      auto second = a->AcquireStaging(1, DType::kF32);
      ASSERT_TRUE(first.ok() && second.ok()) << second.status().ToString();
      ASSERT_TRUE(a->DiscardGradients().ok());
      // Step refuses until a whole micro-batch arrived again.
      EXPECT_EQ(a->Step({}, nullptr).code(), StatusCode::kFailedPrecondition);

      const Grads g = MakeGrads(a_model, DType::kF16, 600 + step, 1.0f);
      Submit(*a, a_model, g, HandOff::kStaging);
      Submit(*b, b_model, g, HandOff::kWhole);
      OffloadStepResult ra, rb;
      ASSERT_TRUE(a->Step({.max_grad_norm = 5.0}, &ra).ok());
      ASSERT_TRUE(b->Step({.max_grad_norm = 5.0}, &rb).ok());
      EXPECT_EQ(ra.grad_norm, rb.grad_norm);
      EXPECT_EQ(ra.micro_batches, 1);
      // The next step's junk arrives while this update may still run.
    }
    ASSERT_TRUE(a->Synchronize().ok());
    ASSERT_TRUE(b->Synchronize().ok());
    for (size_t k = 0; k < a_model.buckets.size(); ++k) {
      EXPECT_EQ(a_model.buckets[k].p16, b_model.buckets[k].p16) << "bucket " << k;
      EXPECT_EQ(a_model.buckets[k].p32, b_model.buckets[k].p32) << "bucket " << k;
      for (int t = 0; t <= static_cast<int>(a->bucket_state_layout(k).size()); ++t) {
        std::vector<float> sa(t == 0 ? a_model.buckets[k].total()
                                     : a->bucket_state_layout(k)[t - 1].num_elems);
        std::vector<float> sb(sa.size());
        ASSERT_TRUE(a->ReadState(k, t, sa).ok());
        ASSERT_TRUE(b->ReadState(k, t, sb).ok());
        EXPECT_EQ(sa, sb) << "bucket " << k << " tensor " << t;
      }
    }
    EXPECT_EQ(a->group_step(0), 3);
    a.reset();
    b.reset();
    for (const std::string& d : dirs) std::filesystem::remove_all(d);
  }
}

// WaitBucket may run beside any other call (a framework's forward hooks): here beside AddBucket,
// the first gradient (which builds the pipeline) and steps. TSan checks it in CI
// (scripts/check.sh tsan).
TEST(OffloadOptimizer, WaitBucketMayRunBesideAddBucketAndTheFirstGradient) {
  TestModel s = MakeModel(8);
  auto made = OffloadOptimizer::Create({});
  ASSERT_TRUE(made.ok());
  std::unique_ptr<OffloadOptimizer> opt = std::move(*made);
  for (const AnyOptimizer& g : s.groups) ASSERT_TRUE(opt->AddGroup(g).ok());
  std::atomic<bool> done{false};
  std::atomic<int> waited{0}, unknown{0};
  std::thread waiter([&] {
    while (!done.load()) {
      for (int b = 0; b < 3; ++b) {
        const Status w = opt->WaitBucket(b);
        if (w.ok()) {
          waited.fetch_add(1);
        } else if (w.code() == StatusCode::kInvalidArgument) {
          unknown.fetch_add(1);  // not added yet
        } else {
          ADD_FAILURE() << w.ToString();
        }
      }
    }
  });
  // The caller's work, beside the waiter (ASSERTs end this lambda, and the waiter is still joined).
  [&] {
    while (unknown.load() == 0) std::this_thread::yield();  // the waiter runs from here on
    for (CallerBucket& b : s.buckets) {
      std::vector<OffloadSegment> segs;
      for (size_t i = 0; i < b.lengths.size(); ++i) segs.push_back({b.data(i), b.lengths[i], {}});
      ASSERT_TRUE(opt->AddBucket(b.group, b.dtype, segs).ok());
    }
    for (int step = 1; step <= 2; ++step) {
      const Grads g = MakeGrads(s, DType::kBF16, step, 1.0f);  // read by the folds until Step
      Submit(*opt, s, g, HandOff::kWhole);
      ASSERT_TRUE(opt->Step({}, nullptr).ok());
    }
    ASSERT_TRUE(opt->Synchronize().ok());
    while (waited.load() == 0) std::this_thread::yield();
  }();
  done.store(true);
  waiter.join();
  EXPECT_EQ(opt->WaitBucket(3).code(), StatusCode::kInvalidArgument);
}

TEST(OffloadOptimizer, ABucketPastTwoToTheFiftyElementsIsRefusedBeforeItIsRead) {
  TestModel s = MakeModel(4);
  auto opt = Create(s, {});
  ASSERT_NE(opt, nullptr);
  std::vector<float> small(16);
  // Never read: the count is refused first (a caller's bad length, not memory it has).
  const OffloadSegment huge{small.data(), int64_t{1} << 50, {}};
  const OffloadSegment one{small.data(), 1, {}};
  const OffloadSegment over[] = {huge, one};
  const Status s2 = opt->AddBucket(0, DType::kF32, over).status();
  EXPECT_EQ(s2.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s2.message().find("2^50"), std::string::npos) << s2.ToString();
  const OffloadSegment max_both[] = {huge, {small.data(), INT64_MAX, {}}};
  EXPECT_EQ(opt->AddBucket(0, DType::kF32, max_both).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(opt->num_buckets(), 3);
}

TEST(OffloadOptimizer, UnusableNvmePathIsAnError) {
  OffloadOptimizerOptions o;
  o.home = OffloadOptimizerOptions::Home::kNvme;
  EXPECT_EQ(OffloadOptimizer::Create(o).status().code(), StatusCode::kInvalidArgument);
  const std::string dir = TempDir("file");
  const std::string file = dir + "/not-a-dir";
  std::ofstream(file) << "x";
  o.nvme_paths = {file};
  const auto made = OffloadOptimizer::Create(o);
  EXPECT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("not-a-dir"), std::string::npos)
      << made.status().ToString();
  std::filesystem::remove_all(dir);
}

TEST(OffloadOptimizer, AnNvmeWriteErrorIsStickyAndNamed) {
  const std::string dir = TempDir("eio");
  io::FaultInjectingBackend* faults = nullptr;
  OffloadOptimizerOptions o;
  o.home = OffloadOptimizerOptions::Home::kNvme;
  o.nvme_paths = {dir};
  o.io.kind = io::BackendKind::kPosix;
  o.io_backend_factory =
      [&](const io::IoBackendOptions& io) -> StatusOr<std::unique_ptr<io::IoBackend>> {
    STRATA_ASSIGN_OR_RETURN(auto f, io::FaultInjectingBackend::Create(io));
    faults = f.get();
    return std::unique_ptr<io::IoBackend>(std::move(f));
  };
  TestModel s = MakeModel(9);
  auto opt = Create(s, o);
  ASSERT_NE(opt, nullptr);
  ASSERT_NE(faults, nullptr);
  faults->AddFault(io::Fault::Errno(io::IoOp::kWrite, EIO));
  const Grads g = MakeGrads(s, DType::kBF16, 1, 1.0f);
  Submit(*opt, s, g, HandOff::kWhole);
  ASSERT_TRUE(opt->Step({}, nullptr).ok());  // the update runs behind the return
  const Status failed = opt->Synchronize();
  EXPECT_FALSE(failed.ok());
  EXPECT_NE(failed.ToString().find("bucket"), std::string::npos) << failed.ToString();
  // Every later call says so.
  const Status later = opt->Step({}, nullptr);
  EXPECT_EQ(later.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(later.message().find("earlier error"), std::string::npos) << later.ToString();
  opt.reset();
  std::filesystem::remove_all(dir);
}

TEST(OffloadOptimizer, CountersReportTheUpdateAndTheWaits) {
  TestModel s = MakeModel(2);
  auto opt = Create(s, {});
  const Grads g = MakeGrads(s, DType::kF32, 1, 1.0f);
  Submit(*opt, s, g, HandOff::kWhole);
  ASSERT_TRUE(opt->Step({}, nullptr).ok());
  ASSERT_TRUE(opt->Synchronize().ok());
  const OffloadCounters c = opt->counters();
  EXPECT_EQ(c.steps, 1);
  EXPECT_GT(c.update_seconds, 0.0);
  EXPECT_GE(c.wait_seconds, 0.0);
  // Masters + AdamW's 2 or SGD's 1 state buffers + the accumulator, per bucket.
  EXPECT_GE(c.host_state_bytes, (5101 + 5001) * 4u * 4 + 842 * 4u * 3);
}

namespace state_kinds {

// AdamW8bit and Adafactor (with and without a first moment) over tensors of several shapes:
// matrices and a 3-D tensor (Adafactor factors them), vectors and a scalar (it does not), and
// lengths past one quantization block (AdamW8bit's blocks restart at each segment).
TestModel MakeStateModel(uint64_t seed) {
  TestModel s;
  cpu_optim::AdamWConfig adamw{.lr = 1e-2f, .weight_decay = 0.1f};
  s.groups.push_back(AnyOptimizer{OptimizerKind::kAdamW8bit, adamw});
  s.groups.push_back(AnyOptimizer{OptimizerKind::kAdafactor,
                                  cpu_optim::AdafactorConfig{.lr = 1e-2f, .weight_decay = 1e-2f}});
  s.groups.push_back(
      AnyOptimizer{OptimizerKind::kAdafactor,
                   cpu_optim::AdafactorConfig{.relative_step = true, .scale_parameter = true}});
  std::get<cpu_optim::AdafactorConfig>(s.groups[2].config).beta1 = 0.9f;
  std::mt19937_64 rng(seed);
  auto add = [&](int group, DType dtype, std::vector<std::vector<int64_t>> shapes) {
    CallerBucket b;
    b.group = group;
    b.dtype = dtype;
    b.shapes = shapes;
    for (const auto& shape : shapes) {
      int64_t l = 1;
      for (int64_t d : shape) l *= d;
      b.lengths.push_back(l);
      AddRandomTensor(b, dtype, l, rng);
    }
    s.buckets.push_back(std::move(b));
  };
  add(0, DType::kBF16, {{3001}, {45, 67}, {7}});
  add(1, DType::kF32, {{33}, {50, 41}, {3, 5, 9}, {1}});
  add(2, DType::kF16, {{20, 30}, {129}});
  add(0, DType::kF32, {{2048}, {1}});
  return s;
}

// Per segment, the state as cpu_optim's kernels keep it; stepped with AdamW8bitUpdate and
// AdafactorUpdate directly.
struct SegmentState {
  std::vector<float> master;
  std::map<std::string, std::vector<uint8_t>> u8;
  std::map<std::string, std::vector<float>> f32;
};

struct StateReference {
  std::vector<std::vector<SegmentState>> seg;  // [bucket][segment]
  std::vector<int64_t> steps;

  explicit StateReference(const TestModel& s) : steps(s.groups.size(), 0) {
    for (const CallerBucket& b : s.buckets) {
      std::vector<float> values = b.Values();
      std::vector<SegmentState> segs;
      int64_t off = 0;
      const AnyOptimizer& o = s.groups[b.group];
      for (size_t i = 0; i < b.lengths.size(); ++i) {
        const int64_t n = b.lengths[i];
        SegmentState st;
        st.master.assign(values.begin() + off, values.begin() + off + n);
        if (o.kind == OptimizerKind::kAdamW8bit) {
          const int64_t blocks = cpu_optim::QuantizedAbsmaxCount(n);
          st.u8["exp_avg"].assign(n, cpu_optim::QuantizedZeroCode(true));
          st.u8["exp_avg_sq"].assign(n, cpu_optim::QuantizedZeroCode(false));
          st.f32["exp_avg.absmax"].assign(blocks, 0.0f);
          st.f32["exp_avg_sq.absmax"].assign(blocks, 0.0f);
        } else {
          const auto& c = std::get<cpu_optim::AdafactorConfig>(o.config);
          const auto& shape = b.shapes[i];
          if (cpu_optim::AdafactorFactored(shape)) {
            st.f32["exp_avg_sq_row"].assign(n / shape.back(), 0.0f);
            st.f32["exp_avg_sq_col"].assign(shape.back(), 0.0f);
          } else {
            st.f32["exp_avg_sq"].assign(n, 0.0f);
          }
          if (c.beta1 > 0) st.f32["exp_avg"].assign(n, 0.0f);
        }
        segs.push_back(std::move(st));
        off += n;
      }
      seg.push_back(std::move(segs));
    }
  }

  void Step(const TestModel& s, const Grads& g, double max_norm) {
    std::vector<std::vector<float>> accum;
    cpu_optim::GradStats total;
    for (size_t b = 0; b < s.buckets.size(); ++b) {
      std::vector<float> acc(s.buckets[b].total());
      int64_t off = 0;
      for (int64_t len : s.buckets[b].lengths) {
        auto st = cpu_optim::AccumulateGrad(
            std::span<float>(acc.data() + off, len),
            {g.per_bucket[b].data() + off * SizeOf(g.dtype), g.dtype}, true, true);
        ASSERT_TRUE(st.ok());
        cpu_optim::Merge(total, *st);
        off += len;
      }
      accum.push_back(std::move(acc));
    }
    const double norm = std::sqrt(total.sum_squares);
    float clip = 1.0f;
    if (max_norm > 0 && max_norm / (norm + 1e-6) < 1.0) {
      clip = static_cast<float>(max_norm / (norm + 1e-6));
    }
    for (int64_t& t : steps) ++t;
    for (size_t b = 0; b < s.buckets.size(); ++b) {
      const CallerBucket& cb = s.buckets[b];
      const AnyOptimizer& o = s.groups[cb.group];
      const cpu_optim::OptimStep step{.step = steps[cb.group], .grad_scale = clip};
      int64_t off = 0;
      for (size_t i = 0; i < cb.lengths.size(); ++i) {
        SegmentState& st = seg[b][i];
        const cpu_optim::GradView grad{accum[b].data() + off, DType::kF32};
        Status r;
        if (o.kind == OptimizerKind::kAdamW8bit) {
          r = cpu_optim::AdamW8bitUpdate(
              o.adamw(), step, st.master,
              cpu_optim::QuantizedState{st.u8["exp_avg"], st.f32["exp_avg.absmax"]},
              cpu_optim::QuantizedState{st.u8["exp_avg_sq"], st.f32["exp_avg_sq.absmax"]}, grad);
        } else {
          auto span_of = [&](const char* name) {
            auto it = st.f32.find(name);
            return it == st.f32.end() ? std::span<float>() : std::span<float>(it->second);
          };
          r = cpu_optim::AdafactorUpdate(
              std::get<cpu_optim::AdafactorConfig>(o.config), step, cb.shapes[i], st.master,
              cpu_optim::AdafactorState{span_of("exp_avg_sq_row"), span_of("exp_avg_sq_col"),
                                        span_of("exp_avg_sq"), span_of("exp_avg")},
              grad);
        }
        ASSERT_TRUE(r.ok()) << r.ToString();
        off += cb.lengths[i];
      }
    }
  }

  // The bucket's section `name` as the offload optimizer documents it: the segments' parts
  // back to back, as bytes.
  std::vector<std::byte> Section(size_t b, const std::string& name) const {
    std::vector<std::byte> out;
    for (const SegmentState& st : seg[b]) {
      const std::byte* p = nullptr;
      size_t n = 0;
      if (auto it = st.u8.find(name); it != st.u8.end()) {
        p = reinterpret_cast<const std::byte*>(it->second.data());
        n = it->second.size();
      } else if (auto jt = st.f32.find(name); jt != st.f32.end()) {
        p = reinterpret_cast<const std::byte*>(jt->second.data());
        n = jt->second.size() * 4;
      }
      out.insert(out.end(), p, p + n);
    }
    return out;
  }
  std::vector<float> Master(size_t b) const {
    std::vector<float> out;
    for (const SegmentState& st : seg[b]) out.insert(out.end(), st.master.begin(), st.master.end());
    return out;
  }
};

// Every tensor of every bucket of opt, as bytes.
std::vector<std::vector<std::byte>> AllState(OffloadOptimizer& opt) {
  std::vector<std::vector<std::byte>> out;
  for (int b = 0; b < opt.num_buckets(); ++b) {
    const auto layout = opt.bucket_state_layout(b);
    for (int t = 0; t <= static_cast<int>(layout.size()); ++t) {
      const size_t bytes = t == 0 ? opt.bucket_num_elems(b) * 4 : layout[t - 1].size_bytes();
      std::vector<std::byte> v(bytes);
      EXPECT_TRUE(opt.ReadStateBytes(b, t, v).ok());
      out.push_back(std::move(v));
    }
  }
  return out;
}

class OffloadStateKinds : public ::testing::TestWithParam<OffloadOptimizerOptions::Home> {};

TEST_P(OffloadStateKinds, AdamW8bitAndAdafactorMatchTheirKernelsPerSegmentBitForBit) {
  TestModel s = MakeStateModel(3);
  StateReference ref(s);
  OffloadOptimizerOptions o;
  o.home = GetParam();
  o.num_threads = 2;
  o.buffer_count = 2;
  std::string dir;
  if (o.home == OffloadOptimizerOptions::Home::kNvme) {
    dir = TempDir("kinds");
    o.nvme_paths = {dir};
  }
  auto opt = Create(s, o);
  ASSERT_NE(opt, nullptr);
  // The documented layout: sections in StateLayout's order, segment parts back to back.
  ASSERT_EQ(opt->bucket_state_layout(0).size(), 4u);
  EXPECT_EQ(opt->bucket_state_layout(0)[0].name, "exp_avg");
  EXPECT_EQ(opt->bucket_state_layout(0)[0].dtype, cpu_optim::StateDType::kU8);
  EXPECT_EQ(opt->bucket_state_layout(0)[1].num_elems, 2 + 2 + 1);  // blocks restart per segment
  auto r = opt->SegmentStateRange(0, 1, 2);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->offset_elems, 2);
  EXPECT_EQ(r->num_elems, 2);
  auto row = opt->SegmentStateRange(1, 2, 1);  // exp_avg_sq_row of the (3, 5, 9) tensor
  ASSERT_TRUE(row.ok());
  EXPECT_EQ(opt->bucket_state_layout(1)[0].name, "exp_avg_sq_row");
  EXPECT_EQ(row->offset_elems, 50);
  EXPECT_EQ(row->num_elems, 15);
  auto none = opt->SegmentStateRange(1, 0, 1);  // the vector has no rows
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->num_elems, 0);
  std::vector<float> f(5);
  EXPECT_EQ(opt->ReadState(0, 1, f).code(), StatusCode::kInvalidArgument);  // codes are U8

  for (int step = 0; step < 3; ++step) {
    const Grads g = MakeGrads(s, DType::kBF16, 40 + step, 0.5f);
    Submit(*opt, s, g, step == 1 ? HandOff::kSegments : HandOff::kWhole);
    ASSERT_TRUE(opt->Step({.max_grad_norm = step == 2 ? 10.0 : 0.0}, nullptr).ok());
    ref.Step(s, g, step == 2 ? 10.0 : 0.0);
    for (size_t b = 0; b < s.buckets.size(); ++b) {
      ASSERT_TRUE(opt->WaitBucket(static_cast<int>(b)).ok());
      std::vector<float> master(s.buckets[b].total());
      ASSERT_TRUE(opt->ReadState(static_cast<int>(b), 0, master).ok());
      ASSERT_EQ(0, std::memcmp(master.data(), ref.Master(b).data(), master.size() * 4))
          << "masters of bucket " << b << " step " << step;
      const auto layout = opt->bucket_state_layout(static_cast<int>(b));
      for (size_t t = 0; t < layout.size(); ++t) {
        std::vector<std::byte> got(layout[t].size_bytes());
        ASSERT_TRUE(opt->ReadStateBytes(static_cast<int>(b), static_cast<int>(t) + 1, got).ok());
        ASSERT_EQ(got, ref.Section(b, layout[t].name))
            << layout[t].name << " of bucket " << b << " step " << step;
      }
      const std::vector<float> values = s.buckets[b].Values();
      const std::vector<float> want = ref.Master(b);
      for (size_t i = 0; i < values.size(); ++i) {
        float w = want[i];
        if (s.buckets[b].dtype == DType::kBF16) w = Bf16ToFloat(FloatToBf16(w));
        if (s.buckets[b].dtype == DType::kF16) w = HalfToFloat(FloatToHalf(w));
        ASSERT_EQ(values[i], w) << "bucket " << b << " element " << i;
      }
    }
  }
  if (o.home == OffloadOptimizerOptions::Home::kNvme) {
    EXPECT_GT(opt->counters().nvme_bytes_written, 0u);
    opt.reset();
    std::filesystem::remove_all(dir);
  }
}

TEST_P(OffloadStateKinds, SaveLoadAndStateBytesRoundTripExactly) {
  const std::string dir = TempDir("kinds-ckpt");
  OffloadOptimizerOptions o;
  o.home = GetParam();
  if (o.home == OffloadOptimizerOptions::Home::kNvme) o.nvme_paths = {dir};
  auto grads = [](const TestModel& s, int step) {
    return MakeGrads(s, DType::kF16, 70 + step, 0.2f);
  };
  TestModel a = MakeStateModel(8);
  auto opt_a = Create(a, o);
  for (int step = 0; step < 3; ++step) {
    const Grads g = grads(a, step);
    Submit(*opt_a, a, g, HandOff::kWhole);
    ASSERT_TRUE(opt_a->Step({}, nullptr).ok());
  }
  TestModel b = MakeStateModel(8);
  auto opt_b = Create(b, o);
  for (int step = 0; step < 2; ++step) {
    const Grads g = grads(b, step);
    Submit(*opt_b, b, g, HandOff::kWhole);
    ASSERT_TRUE(opt_b->Step({}, nullptr).ok());
  }
  const std::string ckpt = dir + "/opt";
  ASSERT_TRUE(opt_b->Save(ckpt).ok());
  // Through the byte API: a third optimizer receives b's state tensor by tensor.
  const auto b_state = AllState(*opt_b);
  opt_b.reset();
  TestModel c = MakeStateModel(77);
  auto opt_c = Create(c, o);
  const Status loaded = opt_c->Load(ckpt);
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  EXPECT_EQ(AllState(*opt_c), b_state);
  TestModel d = MakeStateModel(78);
  auto opt_d = Create(d, o);
  size_t i = 0;
  for (int k = 0; k < opt_d->num_buckets(); ++k) {
    for (int t = 0; t <= static_cast<int>(opt_d->bucket_state_layout(k).size()); ++t) {
      ASSERT_TRUE(opt_d->WriteStateBytes(k, t, b_state[i++]).ok());
    }
  }
  for (int g = 0; g < opt_d->num_groups(); ++g) ASSERT_TRUE(opt_d->SetGroupStep(g, 2).ok());
  for (auto* x : {&c, &d}) {
    auto& opt = x == &c ? opt_c : opt_d;
    const Grads g = grads(*x, 2);
    Submit(*opt, *x, g, HandOff::kWhole);
    ASSERT_TRUE(opt->Step({}, nullptr).ok());
    ASSERT_TRUE(opt->Synchronize().ok());
  }
  ASSERT_TRUE(opt_a->Synchronize().ok());
  EXPECT_EQ(AllState(*opt_c), AllState(*opt_a));
  EXPECT_EQ(AllState(*opt_d), AllState(*opt_a));
  for (size_t k = 0; k < a.buckets.size(); ++k) {
    EXPECT_EQ(a.buckets[k].Values(), c.buckets[k].Values()) << "bucket " << k;
  }

  // Other shapes (the layout of Adafactor's state changes) are refused before anything changes.
  TestModel other = MakeStateModel(8);
  other.buckets[1].shapes[1] = {41, 50};
  auto opt_o = Create(other, o);
  const Status wrong = opt_o->Load(ckpt);
  EXPECT_EQ(wrong.code(), StatusCode::kInvalidArgument) << wrong.ToString();
  EXPECT_NE(wrong.message().find("shapes"), std::string::npos) << wrong.ToString();
  // So is another first-moment setting.
  TestModel beta = MakeStateModel(8);
  std::get<cpu_optim::AdafactorConfig>(beta.groups[1].config).beta1 = 0.5f;
  auto opt_beta = Create(beta, o);
  const Status moment = opt_beta->Load(ckpt);
  EXPECT_EQ(moment.code(), StatusCode::kInvalidArgument) << moment.ToString();
  // And a bad size through the byte API.
  std::vector<std::byte> small(3);
  EXPECT_EQ(opt_beta->WriteStateBytes(0, 1, small).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(opt_beta->group_step(1), 0);
  // A config change that would change the layout is refused too.
  auto changed = beta.groups[1];
  std::get<cpu_optim::AdafactorConfig>(changed.config).beta1 = 0.0f;
  EXPECT_EQ(opt_beta->SetGroupOptimizer(1, changed).code(), StatusCode::kInvalidArgument);
  std::get<cpu_optim::AdafactorConfig>(changed.config).beta1 = 0.8f;
  EXPECT_TRUE(opt_beta->SetGroupOptimizer(1, changed).ok());
  opt_a.reset();
  opt_c.reset();
  opt_d.reset();
  opt_o.reset();
  opt_beta.reset();
  std::filesystem::remove_all(dir);
}

TEST(OffloadOptimizer, ASegmentShapeMustCoverItsElements) {
  auto opt = OffloadOptimizer::Create({});
  ASSERT_TRUE(opt.ok());
  ASSERT_TRUE(
      (*opt)->AddGroup(AnyOptimizer{OptimizerKind::kAdafactor, cpu_optim::AdafactorConfig{}}).ok());
  std::vector<float> p(12);
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{5, 2}, {12, 0}, {-3, -4}}) {
    std::vector<OffloadSegment> segs = {{p.data(), 12, shape}};
    auto b = (*opt)->AddBucket(0, DType::kF32, segs);
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  }
  std::vector<OffloadSegment> segs = {{p.data(), 12, {3, 4}}};
  EXPECT_TRUE((*opt)->AddBucket(0, DType::kF32, segs).ok());
}

INSTANTIATE_TEST_SUITE_P(Homes, OffloadStateKinds,
                         ::testing::Values(OffloadOptimizerOptions::Home::kHost,
                                           OffloadOptimizerOptions::Home::kNvme));

}  // namespace state_kinds

}  // namespace
}  // namespace strata::engine
