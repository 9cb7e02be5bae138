// The offload optimizer's C API (strata_offload_*, include/strata/strata.h) as a client sees it:
// through libstrata.so only. Every result is held against a sequential reference computed with
// strata_optimizer_step on plain fp32 buffers, bit for bit, and against itself across homes
// (host memory, NVMe), thread counts, submission styles and a save/load in the middle; bad use
// comes back as a code and a one-line message and changes nothing.
#include <dlfcn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "strata/strata.h"

namespace {

using ::testing::HasSubstr;

// --- The model under test: two groups, five buckets of mixed dtypes and odd segments --------

struct BucketSpec {
  int group;
  strata_dtype param_dtype;
  strata_dtype grad_dtype;
  std::vector<int64_t> lengths;
};

const std::vector<BucketSpec>& Specs() {
  static const std::vector<BucketSpec> specs = {
      {0, STRATA_DTYPE_BF16, STRATA_DTYPE_BF16, {37, 1, 129}},
      {1, STRATA_DTYPE_F16, STRATA_DTYPE_F16, {63, 200, 3}},
      {0, STRATA_DTYPE_F32, STRATA_DTYPE_F32, {17, 90}},
      {1, STRATA_DTYPE_BF16, STRATA_DTYPE_F32, {5}},  // fp32 gradients for bf16 weights
      {0, STRATA_DTYPE_F16, STRATA_DTYPE_F16, {255, 2}},
  };
  return specs;
}

int64_t TotalElems(const BucketSpec& spec) {
  int64_t n = 0;
  for (int64_t len : spec.lengths) n += len;
  return n;
}

strata_adamw_config GroupAdamW(float lr = 3e-3f) {
  strata_adamw_config c;
  strata_adamw_config_init(&c);
  c.lr = lr;
  c.beta1 = 0.85f;
  c.beta2 = 0.99f;
  c.eps = 1e-6f;
  c.weight_decay = 0.05f;
  return c;
}

strata_sgd_config GroupSgd() {
  strata_sgd_config c;
  strata_sgd_config_init(&c);
  c.lr = 0.02f;
  c.momentum = 0.9f;
  c.nesterov = 1;
  c.weight_decay = 1e-3f;
  return c;
}

constexpr int kSteps = 4;
constexpr int kMicroBatches = 2;  // gradient accumulation
constexpr float kLossScale = 256.0f;
constexpr double kMaxGradNorm = 2.0;   // below the norms of the gradients below: clipping is on
constexpr float kScheduledLr = 1e-3f;  // group 0's lr from step kScheduleStep on
constexpr int kScheduleStep = 3;

// Values of the given dtype (returned widened to fp32, so they convert back exactly),
// spanning several magnitudes, with zeros and negatives.
std::vector<float> RandomValues(int64_t n, uint32_t seed, float scale, strata_dtype dtype) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-8, 2);
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = i % 31 == 7 ? 0.0f : scale * normal(rng) * std::ldexp(1.0f, exponent(rng));
  }
  std::vector<uint8_t> bytes(v.size() * strata_dtype_size(dtype));
  EXPECT_EQ(strata_convert_from_f32(v.data(), bytes.data(), dtype, n), STRATA_OK);
  EXPECT_EQ(strata_convert_to_f32(bytes.data(), dtype, v.data(), n), STRATA_OK);
  return v;
}

std::vector<uint8_t> ToBytes(const std::vector<float>& v, strata_dtype dtype) {
  std::vector<uint8_t> bytes(v.size() * strata_dtype_size(dtype));
  EXPECT_EQ(strata_convert_from_f32(v.data(), bytes.data(), dtype, static_cast<int64_t>(v.size())),
            STRATA_OK);
  return bytes;
}

std::vector<float> InitialParams(size_t bucket) {
  const BucketSpec& s = Specs()[bucket];
  return RandomValues(TotalElems(s), 1000 + static_cast<uint32_t>(bucket), 1.0f, s.param_dtype);
}

// One micro-batch's gradient of every bucket: the fp32 values and their bytes in grad_dtype.
struct MicroBatch {
  std::vector<std::vector<float>> values;   // [bucket]
  std::vector<std::vector<uint8_t>> bytes;  // [bucket], grad_dtype
};

MicroBatch Gradients(int step, int micro) {
  MicroBatch mb;
  for (size_t b = 0; b < Specs().size(); ++b) {
    const BucketSpec& s = Specs()[b];
    const uint32_t seed = static_cast<uint32_t>(100000 * step + 1000 * micro + b);
    mb.values.push_back(RandomValues(TotalElems(s), seed, kLossScale, s.grad_dtype));
    mb.bytes.push_back(ToBytes(mb.values.back(), s.grad_dtype));
  }
  return mb;
}

// --- State of an optimizer, as read back through the C API ----------------------------------

struct Snapshot {
  std::vector<std::vector<float>> masters;              // [bucket]
  std::vector<std::vector<std::vector<float>>> states;  // [bucket][state buffer]
  std::vector<std::vector<uint8_t>> params;             // [bucket] caller's segments, in a row
  std::vector<int64_t> group_steps;
};

// Empty when equal; else where the first difference is.
std::string FirstDifference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size())
    return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      return "element " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " +
             std::to_string(b[i]);
    }
  }
  return "";
}

void ExpectSameSnapshot(const Snapshot& a, const Snapshot& b, const std::string& what) {
  ASSERT_EQ(a.masters.size(), b.masters.size()) << what;
  for (size_t k = 0; k < a.masters.size(); ++k) {
    EXPECT_EQ(FirstDifference(a.masters[k], b.masters[k]), "")
        << what << ": bucket " << k << " master";
    ASSERT_EQ(a.states[k].size(), b.states[k].size()) << what;
    for (size_t i = 0; i < a.states[k].size(); ++i) {
      EXPECT_EQ(FirstDifference(a.states[k][i], b.states[k][i]), "")
          << what << ": bucket " << k << " state " << i;
    }
    EXPECT_TRUE(a.params[k] == b.params[k]) << what << ": bucket " << k << " caller's segments";
  }
  EXPECT_EQ(a.group_steps, b.group_steps) << what;
}

// --- The sequential reference: strata_optimizer_step on plain fp32 buffers -------------------

class Reference {
 public:
  Reference() {
    const strata_adamw_config adamw = GroupAdamW();
    const strata_sgd_config sgd = GroupSgd();
    EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_ADAMW, &adamw, nullptr, &groups_[0]),
              STRATA_OK);
    EXPECT_EQ(strata_optimizer_create(STRATA_OPTIMIZER_SGD, &sgd, nullptr, &groups_[1]), STRATA_OK);
    for (size_t b = 0; b < Specs().size(); ++b) {
      masters_.push_back(InitialParams(b));
      const int num_state = strata_optimizer_num_state(groups_[Specs()[b].group]);
      states_.emplace_back(num_state, std::vector<float>(masters_.back().size(), 0.0f));
    }
  }
  ~Reference() {
    strata_optimizer_destroy(groups_[0]);
    strata_optimizer_destroy(groups_[1]);
  }
  Reference(const Reference&) = delete;
  Reference& operator=(const Reference&) = delete;

  void SetLr0(float lr) {
    const strata_adamw_config c = GroupAdamW(lr);
    EXPECT_EQ(strata_optimizer_set_config(groups_[0], &c), STRATA_OK);
  }

  // One step over the micro-batches: accumulate segment by segment (the first micro-batch
  // overwrites, the others add in fp32), with the statistics of each segment's accumulated
  // gradient merged in bucket and segment order; skip on a non-finite gradient; else clip as
  // torch.nn.utils.clip_grad_norm_ (coef = max_norm / (norm + 1e-6) when < 1, rounded to fp32)
  // and unscale (grad_scale = coef / loss_scale in fp32), and step every bucket in order.
  strata_offload_step_result Step(const std::vector<MicroBatch>& micro, double max_norm,
                                  float loss_scale) {
    std::vector<std::vector<float>> acc(Specs().size());
    double sum_squares = 0;
    bool nonfinite = false;
    for (size_t b = 0; b < Specs().size(); ++b) {
      acc[b].resize(masters_[b].size());
      int64_t offset = 0;
      for (int64_t len : Specs()[b].lengths) {
        strata_grad_stats stats{};
        for (size_t m = 0; m < micro.size(); ++m) {
          EXPECT_EQ(
              strata_grad_accumulate(acc[b].data() + offset, micro[m].values[b].data() + offset,
                                     STRATA_DTYPE_F32, len, m == 0 ? 1 : 0, &stats),
              STRATA_OK);
        }
        sum_squares += stats.sum_squares;
        nonfinite = nonfinite || stats.nonfinite != 0;
        offset += len;
      }
    }
    strata_offload_step_result result{};
    result.micro_batches = static_cast<int>(micro.size());
    result.grad_norm = std::sqrt(sum_squares) / loss_scale;
    if (nonfinite) {
      result.skipped = 1;
      return result;
    }
    float clip = 1.0f;
    if (max_norm > 0) {
      const double coef = max_norm / (result.grad_norm + 1e-6);
      if (coef < 1.0) clip = static_cast<float>(coef);
    }
    const float grad_scale = clip / loss_scale;
    ++steps_[0];
    ++steps_[1];
    for (size_t b = 0; b < Specs().size(); ++b) {
      strata_optimizer* opt = groups_[Specs()[b].group];
      std::vector<float*> state;
      for (auto& s : states_[b]) state.push_back(s.data());
      EXPECT_EQ(strata_optimizer_step(opt, steps_[Specs()[b].group], grad_scale, masters_[b].data(),
                                      state.data(), static_cast<int>(state.size()), acc[b].data(),
                                      STRATA_DTYPE_F32, nullptr, STRATA_DTYPE_F32,
                                      static_cast<int64_t>(acc[b].size())),
                STRATA_OK)
          << strata_last_error();
    }
    return result;
  }

  Snapshot Snap() const {
    Snapshot s;
    s.masters = masters_;
    s.states = states_;
    for (size_t b = 0; b < Specs().size(); ++b) {
      s.params.push_back(ToBytes(masters_[b], Specs()[b].param_dtype));
    }
    s.group_steps = {steps_[0], steps_[1]};
    return s;
  }

 private:
  strata_optimizer* groups_[2] = {nullptr, nullptr};
  int64_t steps_[2] = {0, 0};
  std::vector<std::vector<float>> masters_;
  std::vector<std::vector<std::vector<float>>> states_;
};

// --- The optimizer under test, with the caller's parameter buffers ---------------------------

// A private directory under $TMPDIR (or /tmp), removed with its contents.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "strata-offload-capi-XXXXXX");
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
    EXPECT_FALSE(path_.empty()) << "mkdtemp failed";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, ec);
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct HarnessOptions {
  strata_offload_device device = STRATA_OFFLOAD_CPU;
  std::string nvme_path;  // for STRATA_OFFLOAD_NVME
  int num_threads = 2;
  bool staging = true;  // whole buckets from staging buffers, else segment by segment
  // Bucket 1's lengths, to build an optimizer of another structure.
  std::vector<int64_t> bucket1_lengths = Specs()[1].lengths;
  int num_groups = 2;
  const char* io_backend = nullptr;  // strata_offload_options.io_backend
};

HarnessOptions OneGroup() {
  HarnessOptions o;
  o.num_groups = 1;
  return o;
}

class Harness {
 public:
  explicit Harness(const HarnessOptions& options) : options_(options) {
    strata_offload_options o;
    strata_offload_options_init(&o);
    o.device = options.device;
    const char* paths[1] = {options_.nvme_path.c_str()};
    if (options.device == STRATA_OFFLOAD_NVME) {
      o.nvme_paths = paths;
      o.num_nvme_paths = 1;
    }
    o.num_threads = options.num_threads;
    o.buffer_count = 3;
    o.staging_buffers = 2;
    o.pin_memory = 0;  // CI's memlock limit; pinning changes no number
    o.io_backend = options.io_backend;
    EXPECT_EQ(strata_offload_create(&o, &h_), STRATA_OK) << strata_last_error();
    if (h_ == nullptr) return;
    const strata_adamw_config adamw = GroupAdamW();
    const strata_sgd_config sgd = GroupSgd();
    int group = -1;
    EXPECT_EQ(strata_offload_add_group(h_, STRATA_OPTIMIZER_ADAMW, &adamw, &group), STRATA_OK)
        << strata_last_error();
    EXPECT_EQ(group, 0);
    if (options.num_groups > 1) {
      EXPECT_EQ(strata_offload_add_group(h_, STRATA_OPTIMIZER_SGD, &sgd, &group), STRATA_OK)
          << strata_last_error();
      EXPECT_EQ(group, 1);
    }
    for (size_t b = 0; b < Specs().size(); ++b) {
      const BucketSpec& s = Specs()[b];
      const std::vector<int64_t> lengths = b == 1 ? options.bucket1_lengths : s.lengths;
      const std::vector<float> init = InitialParams(b);
      const std::vector<uint8_t> bytes = ToBytes(init, s.param_dtype);
      const size_t elem = strata_dtype_size(s.param_dtype);
      std::vector<void*> ptrs;
      size_t offset = 0;
      segments_.emplace_back();
      for (int64_t len : lengths) {
        // Separate allocations, as a framework's parameters are.
        const size_t size = static_cast<size_t>(len) * elem;
        auto& seg = segments_.back().emplace_back(size / 4 + 1, 0u);
        EXPECT_LE(offset + size, bytes.size());  // other lengths keep the total
        std::memcpy(seg.data(), bytes.data() + offset, std::min(size, bytes.size() - offset));
        offset += size;
        ptrs.push_back(seg.data());
      }
      int bucket = -1;
      EXPECT_EQ(strata_offload_add_bucket(h_, options.num_groups > 1 ? s.group : 0, s.param_dtype,
                                          ptrs.data(), lengths.data(),
                                          static_cast<int>(lengths.size()), &bucket),
                STRATA_OK)
          << strata_last_error();
      EXPECT_EQ(bucket, static_cast<int>(b));
    }
  }
  ~Harness() { strata_offload_destroy(h_); }
  Harness(const Harness&) = delete;
  Harness& operator=(const Harness&) = delete;

  strata_offload* get() const { return h_; }

  // Hands one micro-batch in, buckets in reverse order (as backward produces them); segment by
  // segment in reverse order too unless staging.
  void Submit(const MicroBatch& mb) {
    for (int b = static_cast<int>(Specs().size()) - 1; b >= 0; --b) {
      const BucketSpec& s = Specs()[b];
      const std::vector<uint8_t>& bytes = mb.bytes[b];
      const int64_t n = TotalElems(s);
      if (options_.staging) {
        void* data = nullptr;
        ASSERT_EQ(strata_offload_acquire_staging(h_, b, s.grad_dtype, &data), STRATA_OK)
            << strata_last_error();
        ASSERT_NE(data, nullptr);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(data) % 64, 0u);
        std::memcpy(data, bytes.data(), bytes.size());
        ASSERT_EQ(strata_offload_submit_grad(h_, b, -1, data, s.grad_dtype, n, nullptr), STRATA_OK)
            << strata_last_error();
        continue;
      }
      std::vector<size_t> offsets;
      size_t offset = 0;
      for (int64_t len : s.lengths) {
        offsets.push_back(offset);
        offset += static_cast<size_t>(len) * strata_dtype_size(s.grad_dtype);
      }
      for (int i = static_cast<int>(s.lengths.size()) - 1; i >= 0; --i) {
        ASSERT_EQ(strata_offload_submit_grad(h_, b, i, bytes.data() + offsets[i], s.grad_dtype,
                                             s.lengths[i], nullptr),
                  STRATA_OK)
            << strata_last_error();
      }
    }
  }

  strata_offload_step_result Step(double max_norm, float loss_scale) {
    strata_offload_step_options o;
    strata_offload_step_options_init(&o);
    o.max_grad_norm = max_norm;
    o.loss_scale = loss_scale;
    strata_offload_step_result r{};
    EXPECT_EQ(strata_offload_step(h_, &o, &r), STRATA_OK) << strata_last_error();
    return r;
  }

  void SetLr0(float lr) {
    const strata_adamw_config c = GroupAdamW(lr);
    EXPECT_EQ(strata_offload_set_group_config(h_, 0, &c), STRATA_OK) << strata_last_error();
  }

  // Masters and state (read_state waits for the work in flight), the caller's segments (after
  // wait_bucket) and the group step counts.
  Snapshot Snap() {
    Snapshot snap;
    for (size_t b = 0; b < Specs().size(); ++b) {
      const int bucket = static_cast<int>(b);
      EXPECT_EQ(strata_offload_wait_bucket(h_, bucket), STRATA_OK) << strata_last_error();
      const int64_t n = strata_offload_bucket_num_elems(h_, bucket);
      EXPECT_EQ(n, TotalElems(Specs()[b]));
      const int num_state = strata_offload_bucket_num_state(h_, bucket);
      snap.masters.emplace_back(static_cast<size_t>(n));
      EXPECT_EQ(strata_offload_read_state(h_, bucket, 0, snap.masters.back().data(), n), STRATA_OK)
          << strata_last_error();
      snap.states.emplace_back();
      for (int i = 0; i < num_state; ++i) {
        auto& s = snap.states.back().emplace_back(static_cast<size_t>(n));
        EXPECT_EQ(strata_offload_read_state(h_, bucket, 1 + i, s.data(), n), STRATA_OK)
            << strata_last_error();
      }
      std::vector<uint8_t> params;
      const size_t elem = strata_dtype_size(Specs()[b].param_dtype);
      const auto& lengths = b == 1 ? options_.bucket1_lengths : Specs()[b].lengths;
      for (size_t i = 0; i < lengths.size(); ++i) {
        const auto* p = reinterpret_cast<const uint8_t*>(segments_[b][i].data());
        params.insert(params.end(), p, p + lengths[i] * elem);
      }
      snap.params.push_back(std::move(params));
    }
    for (int g = 0; g < options_.num_groups; ++g) {
      int64_t t = -1;
      EXPECT_EQ(strata_offload_get_group_step(h_, g, &t), STRATA_OK);
      snap.group_steps.push_back(t);
    }
    return snap;
  }

 private:
  HarnessOptions options_;
  strata_offload* h_ = nullptr;
  std::vector<std::vector<std::vector<uint32_t>>> segments_;  // [bucket][segment] storage
};

// Steps [first, last) of the standard run: kMicroBatches micro-batches each, clipping and
// loss scaling, group 0's lr changed at kScheduleStep. Returns the step results.
std::vector<strata_offload_step_result> Train(Harness& h, int first, int last) {
  std::vector<strata_offload_step_result> results;
  for (int step = first; step < last; ++step) {
    if (step == kScheduleStep) h.SetLr0(kScheduledLr);
    // The gradients must stay unchanged until their folds finish; step waits for them.
    std::vector<MicroBatch> micro;
    for (int m = 0; m < kMicroBatches; ++m) micro.push_back(Gradients(step, m));
    for (const MicroBatch& mb : micro) h.Submit(mb);
    results.push_back(h.Step(kMaxGradNorm, kLossScale));
  }
  return results;
}

std::vector<strata_offload_step_result> Train(Reference& ref, int first, int last) {
  std::vector<strata_offload_step_result> results;
  for (int step = first; step < last; ++step) {
    if (step == kScheduleStep) ref.SetLr0(kScheduledLr);
    std::vector<MicroBatch> micro;
    for (int m = 0; m < kMicroBatches; ++m) micro.push_back(Gradients(step, m));
    results.push_back(ref.Step(micro, kMaxGradNorm, kLossScale));
  }
  return results;
}

void ExpectSameResults(const std::vector<strata_offload_step_result>& got,
                       const std::vector<strata_offload_step_result>& want,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].grad_norm, want[i].grad_norm) << what << ": step " << i;
    EXPECT_EQ(got[i].skipped, want[i].skipped) << what << ": step " << i;
    EXPECT_EQ(got[i].micro_batches, want[i].micro_batches) << what << ": step " << i;
  }
}

// The reference run, once.
const Snapshot& ReferenceSnapshot() {
  static const Snapshot snap = [] {
    Reference ref;
    const auto results = Train(ref, 0, kSteps);
    // Clipping was really on, and no step was skipped: the comparison is not vacuous.
    bool clipped = false;
    for (const auto& r : results) {
      clipped = clipped || r.grad_norm > kMaxGradNorm;
      EXPECT_EQ(r.skipped, 0);
    }
    EXPECT_TRUE(clipped);
    return ref.Snap();
  }();
  return snap;
}

std::vector<strata_offload_step_result> ReferenceResults() {
  Reference ref;
  return Train(ref, 0, kSteps);
}

// --- Equivalence ---------------------------------------------------------------------------

struct RunCase {
  strata_offload_device device;
  int num_threads;
  bool staging;
  const char* io_backend;
};

class OffloadCApiRun : public ::testing::TestWithParam<RunCase> {};

TEST_P(OffloadCApiRun, MatchesSequentialReferenceBitForBit) {
  const RunCase c = GetParam();
  TempDir dir;
  HarnessOptions o;
  o.device = c.device;
  o.nvme_path = dir.path();
  o.num_threads = c.num_threads;
  o.staging = c.staging;
  o.io_backend = c.io_backend;
  Harness h(o);
  ASSERT_NE(h.get(), nullptr);
  const auto results = Train(h, 0, kSteps);
  ExpectSameResults(results, ReferenceResults(), "step results");
  ExpectSameSnapshot(h.Snap(), ReferenceSnapshot(), "offload vs reference");
  strata_offload_stats stats{};
  ASSERT_EQ(strata_offload_get_stats(h.get(), &stats), STRATA_OK);
  EXPECT_EQ(stats.steps, kSteps);
  EXPECT_EQ(stats.skipped_steps, 0);
  if (c.device == STRATA_OFFLOAD_NVME) {
    EXPECT_GT(stats.nvme_bytes_written, 0u);
    EXPECT_GT(stats.nvme_bytes_read, 0u);
  } else {
    EXPECT_EQ(stats.nvme_bytes_written, 0u);
    EXPECT_GT(stats.host_state_bytes, 0u);
  }
}

// Host and NVMe, one and two threads, staging buffers and per-segment submission: each run
// equals the same reference bit for bit, so they equal each other.
INSTANTIATE_TEST_SUITE_P(HomesThreadsAndSubmission, OffloadCApiRun,
                         ::testing::Values(RunCase{STRATA_OFFLOAD_CPU, 1, true, nullptr},
                                           RunCase{STRATA_OFFLOAD_CPU, 2, true, nullptr},
                                           RunCase{STRATA_OFFLOAD_CPU, 2, false, nullptr},
                                           RunCase{STRATA_OFFLOAD_NVME, 1, true, nullptr},
                                           RunCase{STRATA_OFFLOAD_NVME, 2, false, "auto"},
                                           RunCase{STRATA_OFFLOAD_NVME, 2, true, "posix"}),
                         [](const ::testing::TestParamInfo<RunCase>& info) {
                           return std::string(info.param.device == STRATA_OFFLOAD_NVME ? "Nvme"
                                                                                       : "Host") +
                                  std::to_string(info.param.num_threads) + "Threads" +
                                  (info.param.staging ? "Staging" : "PerSegment") +
                                  (info.param.io_backend == nullptr                ? ""
                                   : std::string(info.param.io_backend) == "posix" ? "Posix"
                                                                                   : "Auto");
                         });

TEST(OffloadCApi, HostAndNvmeRunsAreBitIdentical) {
  TempDir dir;
  Harness host(HarnessOptions{.device = STRATA_OFFLOAD_CPU, .nvme_path = "", .num_threads = 1});
  Harness nvme(HarnessOptions{
      .device = STRATA_OFFLOAD_NVME, .nvme_path = dir.path(), .num_threads = 2, .staging = false});
  ASSERT_NE(host.get(), nullptr);
  ASSERT_NE(nvme.get(), nullptr);
  ExpectSameResults(Train(host, 0, kSteps), Train(nvme, 0, kSteps), "host vs nvme results");
  ExpectSameSnapshot(host.Snap(), nvme.Snap(), "host vs nvme");
}

// fp16 loss scaling's overflow: an inf in one element of one fp16 bucket skips the step; no
// caller buffer, master, state or step count changes; the next good step is the reference's.
TEST(OffloadCApi, NonFiniteGradientSkipsTheStepAndChangesNothing) {
  for (strata_offload_device device : {STRATA_OFFLOAD_CPU, STRATA_OFFLOAD_NVME}) {
    SCOPED_TRACE(device == STRATA_OFFLOAD_NVME ? "nvme" : "host");
    TempDir dir;
    Harness h(HarnessOptions{.device = device, .nvme_path = dir.path()});
    ASSERT_NE(h.get(), nullptr);
    Reference ref;
    Train(h, 0, 2);
    Train(ref, 0, 2);
    const Snapshot before = h.Snap();
    ExpectSameSnapshot(before, ref.Snap(), "before the overflow");

    std::vector<MicroBatch> micro = {Gradients(50, 0), Gradients(50, 1)};
    ASSERT_EQ(Specs()[1].grad_dtype, STRATA_DTYPE_F16);
    const uint16_t inf16 = 0x7c00;
    std::memcpy(micro[1].bytes[1].data() + 2 * 70, &inf16, 2);  // element 70: segment 1
    micro[1].values[1][70] = INFINITY;
    for (const MicroBatch& mb : micro) h.Submit(mb);
    const strata_offload_step_result r = h.Step(kMaxGradNorm, kLossScale);
    EXPECT_EQ(r.skipped, 1);
    EXPECT_EQ(r.micro_batches, kMicroBatches);
    EXPECT_FALSE(std::isfinite(r.grad_norm));
    EXPECT_EQ(ref.Step(micro, kMaxGradNorm, kLossScale).skipped, 1);
    ExpectSameSnapshot(h.Snap(), before, "after the skipped step");
    strata_offload_stats stats{};
    ASSERT_EQ(strata_offload_get_stats(h.get(), &stats), STRATA_OK);
    EXPECT_EQ(stats.steps, 2);
    EXPECT_EQ(stats.skipped_steps, 1);

    // Clean gradients again: the step counts move on from where they were.
    Train(h, 2, 3);
    Train(ref, 2, 3);
    ExpectSameSnapshot(h.Snap(), ref.Snap(), "after the next good step");
  }
}

// --- Save and load -------------------------------------------------------------------------

TEST(OffloadCApi, SaveDestroyLoadContinueEqualsAnUninterruptedRun) {
  for (strata_offload_device device : {STRATA_OFFLOAD_CPU, STRATA_OFFLOAD_NVME}) {
    SCOPED_TRACE(device == STRATA_OFFLOAD_NVME ? "nvme" : "host");
    TempDir swap, ckpt;
    const std::string saved = ckpt.path() + "/optimizer";
    HarnessOptions o{.device = device, .nvme_path = swap.path()};
    {
      Harness first(o);
      ASSERT_NE(first.get(), nullptr);
      Train(first, 0, 2);
      ASSERT_EQ(strata_offload_save(first.get(), saved.c_str()), STRATA_OK) << strata_last_error();
    }
    // A new optimizer over the same structure, its caller's buffers at their initial values;
    // loading puts the saved masters into them.
    Harness second(o);
    ASSERT_NE(second.get(), nullptr);
    ASSERT_EQ(strata_offload_load(second.get(), saved.c_str()), STRATA_OK) << strata_last_error();
    Reference ref;
    Train(ref, 0, 2);
    ExpectSameSnapshot(second.Snap(), ref.Snap(), "right after load");
    Train(second, 2, kSteps);
    ExpectSameSnapshot(second.Snap(), ReferenceSnapshot(), "resumed vs uninterrupted");
  }
}

TEST(OffloadCApi, LoadRefusesAnotherStructureAndADamagedFileAndChangesNothing) {
  TempDir ckpt;
  const std::string saved = ckpt.path() + "/optimizer";
  {
    Harness h(HarnessOptions{});
    ASSERT_NE(h.get(), nullptr);
    Train(h, 0, 1);
    ASSERT_EQ(strata_offload_save(h.get(), saved.c_str()), STRATA_OK) << strata_last_error();
  }
  Reference ref;
  const Snapshot initial = ref.Snap();

  // Other segment lengths in bucket 1 (same total is not enough: the segments differ).
  Harness other_lengths(HarnessOptions{.device = STRATA_OFFLOAD_CPU,
                                       .nvme_path = "",
                                       .num_threads = 2,
                                       .staging = true,
                                       .bucket1_lengths = {63, 199, 4}});
  ASSERT_NE(other_lengths.get(), nullptr);
  EXPECT_EQ(strata_offload_load(other_lengths.get(), saved.c_str()), STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("strata_offload_load"));
  EXPECT_THAT(strata_last_error(), HasSubstr("bucket"));

  // One group instead of two.
  Harness one_group(OneGroup());
  ASSERT_NE(one_group.get(), nullptr);
  const Snapshot one_group_before = one_group.Snap();
  EXPECT_EQ(strata_offload_load(one_group.get(), saved.c_str()), STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("group"));
  ExpectSameSnapshot(one_group.Snap(), one_group_before, "after a refused load");

  // A flipped byte in the tensor file: DATA_LOSS, nothing changed.
  const std::string file = saved + "/optimizer.safetensors";
  ASSERT_TRUE(std::filesystem::exists(file));
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(0, std::ios::end);
    const std::streamoff size = f.tellg();
    f.seekg(size - 37);
    char byte = 0;
    f.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    f.seekp(size - 37);
    f.write(&byte, 1);
  }
  Harness same(HarnessOptions{});
  ASSERT_NE(same.get(), nullptr);
  EXPECT_EQ(strata_offload_load(same.get(), saved.c_str()), STRATA_DATA_LOSS);
  EXPECT_THAT(strata_last_error(), HasSubstr("strata_offload_load"));
  ExpectSameSnapshot(same.Snap(), initial, "after a damaged file");

  EXPECT_NE(strata_offload_load(same.get(), (ckpt.path() + "/missing").c_str()), STRATA_OK);
  EXPECT_EQ(strata_offload_load(same.get(), nullptr), STRATA_INVALID_ARGUMENT);
  EXPECT_EQ(strata_offload_save(same.get(), ""), STRATA_INVALID_ARGUMENT);
}

// --- Bad use -------------------------------------------------------------------------------

// Expects `status` with a message naming the call and containing `what`.
#define EXPECT_ERROR(call_expr, code, call_name, what)                         \
  do {                                                                         \
    EXPECT_EQ((call_expr), (code));                                            \
    EXPECT_THAT(strata_last_error(), HasSubstr(call_name));                    \
    EXPECT_THAT(strata_last_error(), HasSubstr(what));                         \
    EXPECT_EQ(std::string(strata_last_error()).find('\n'), std::string::npos); \
  } while (0)

TEST(OffloadCApi, BadGradientsAreRefusedWithMessagesAndQueueNothing) {
  Harness h(HarnessOptions{});
  ASSERT_NE(h.get(), nullptr);
  strata_offload* o = h.get();
  const MicroBatch mb = Gradients(0, 0);
  const void* g0 = mb.bytes[0].data();
  const char* kSubmit = "strata_offload_submit_grad";
  EXPECT_ERROR(strata_offload_submit_grad(o, 99, -1, g0, STRATA_DTYPE_BF16, 167, nullptr),
               STRATA_INVALID_ARGUMENT, kSubmit, "unknown bucket 99");
  EXPECT_ERROR(strata_offload_submit_grad(o, -2, -1, g0, STRATA_DTYPE_BF16, 167, nullptr),
               STRATA_INVALID_ARGUMENT, kSubmit, "unknown bucket -2");
  EXPECT_ERROR(strata_offload_submit_grad(o, 0, 3, g0, STRATA_DTYPE_BF16, 37, nullptr),
               STRATA_INVALID_ARGUMENT, kSubmit, "unknown segment 3");
  EXPECT_ERROR(strata_offload_submit_grad(o, 0, -1, nullptr, STRATA_DTYPE_BF16, 167, nullptr),
               STRATA_INVALID_ARGUMENT, kSubmit, "grad is NULL");
  EXPECT_ERROR(strata_offload_submit_grad(o, 0, -1, g0, STRATA_DTYPE_BF16, 166, nullptr),
               STRATA_INVALID_ARGUMENT, kSubmit, "num_elems is 166");
  EXPECT_ERROR(strata_offload_submit_grad(o, 0, 1, g0, STRATA_DTYPE_BF16, 37, nullptr),
               STRATA_INVALID_ARGUMENT, kSubmit, "num_elems is 37");
  EXPECT_ERROR(
      strata_offload_submit_grad(o, 0, -1, g0, static_cast<strata_dtype>(77), 167, nullptr),
      STRATA_INVALID_ARGUMENT, kSubmit, "unknown dtype 77");
  EXPECT_ERROR(strata_offload_submit_grad(nullptr, 0, -1, g0, STRATA_DTYPE_BF16, 167, nullptr),
               STRATA_INVALID_ARGUMENT, kSubmit, "offload is NULL");
  void* staging = nullptr;
  EXPECT_ERROR(strata_offload_acquire_staging(o, 5, STRATA_DTYPE_BF16, &staging),
               STRATA_INVALID_ARGUMENT, "strata_offload_acquire_staging", "unknown bucket 5");
  EXPECT_EQ(staging, nullptr);

  // Nothing was queued: a whole micro-batch afterwards makes the reference's step.
  Train(h, 0, 1);
  Reference ref;
  Train(ref, 0, 1);
  ExpectSameSnapshot(h.Snap(), ref.Snap(), "after refused gradients");
}

// A C caller that acquires every staging buffer and submits none gets an error, not a hang.
TEST(OffloadCApi, AcquiringEveryStagingBufferWithoutSubmittingIsRefusedNotHung) {
  Harness h(HarnessOptions{});  // 2 staging buffers
  ASSERT_NE(h.get(), nullptr);
  void* a = nullptr;
  void* b = nullptr;
  void* c = &a;
  ASSERT_EQ(strata_offload_acquire_staging(h.get(), 0, STRATA_DTYPE_BF16, &a), STRATA_OK);
  ASSERT_EQ(strata_offload_acquire_staging(h.get(), 1, STRATA_DTYPE_BF16, &b), STRATA_OK);
  EXPECT_ERROR(strata_offload_acquire_staging(h.get(), 0, STRATA_DTYPE_BF16, &c),
               STRATA_FAILED_PRECONDITION, "strata_offload_acquire_staging",
               "all 2 staging buffers are acquired and none was submitted");
  EXPECT_EQ(c, nullptr);
  // strata_offload_discard_grads (torch's zero_grad) returns both to the pool.
  ASSERT_EQ(strata_offload_discard_grads(h.get()), STRATA_OK) << strata_last_error();
  ASSERT_EQ(strata_offload_acquire_staging(h.get(), 0, STRATA_DTYPE_BF16, &c), STRATA_OK)
      << strata_last_error();
  EXPECT_TRUE(c == a || c == b);
  EXPECT_ERROR(strata_offload_discard_grads(nullptr), STRATA_INVALID_ARGUMENT,
               "strata_offload_discard_grads", "");
}

// A half micro-batch discarded leaves no trace: the next whole one steps as the reference.
TEST(OffloadCApi, DiscardedGradientsLeaveNoTrace) {
  Harness h(HarnessOptions{
      .device = STRATA_OFFLOAD_CPU, .nvme_path = "", .num_threads = 2, .staging = false});
  ASSERT_NE(h.get(), nullptr);
  strata_offload* o = h.get();
  Reference ref;
  Train(h, 0, 1);
  Train(ref, 0, 1);
  const MicroBatch junk = Gradients(7, 0);
  for (int b : {3, 1}) {
    ASSERT_EQ(strata_offload_submit_grad(o, b, -1, junk.bytes[b].data(), Specs()[b].grad_dtype,
                                         TotalElems(Specs()[b]), nullptr),
              STRATA_OK)
        << strata_last_error();
  }
  ASSERT_EQ(strata_offload_discard_grads(o), STRATA_OK) << strata_last_error();
  strata_offload_step_result r{};
  EXPECT_ERROR(strata_offload_step(o, nullptr, &r), STRATA_FAILED_PRECONDITION,
               "strata_offload_step", "bucket 0");
  Train(h, 1, 2);
  Train(ref, 1, 2);
  ExpectSameSnapshot(h.Snap(), ref.Snap(), "after the discarded half micro-batch");
}

TEST(OffloadCApi, StepBeforeEveryBucketArrivedIsRefusedAndChangesNothing) {
  Harness h(HarnessOptions{
      .device = STRATA_OFFLOAD_CPU, .nvme_path = "", .num_threads = 2, .staging = false});
  ASSERT_NE(h.get(), nullptr);
  strata_offload* o = h.get();
  Reference ref;
  Train(h, 0, 1);
  Train(ref, 0, 1);
  const Snapshot before = h.Snap();

  // No gradient at all.
  strata_offload_step_result r{};
  EXPECT_ERROR(strata_offload_step(o, nullptr, &r), STRATA_FAILED_PRECONDITION,
               "strata_offload_step", "bucket 0");
  // Every bucket but bucket 2.
  const MicroBatch mb = Gradients(1, 0);
  for (int b = 0; b < static_cast<int>(Specs().size()); ++b) {
    if (b == 2) continue;
    ASSERT_EQ(strata_offload_submit_grad(o, b, -1, mb.bytes[b].data(), Specs()[b].grad_dtype,
                                         TotalElems(Specs()[b]), nullptr),
              STRATA_OK)
        << strata_last_error();
  }
  EXPECT_ERROR(strata_offload_step(o, nullptr, &r), STRATA_FAILED_PRECONDITION,
               "strata_offload_step", "bucket 2");
  // A second gradient for a segment of this micro-batch.
  EXPECT_ERROR(strata_offload_submit_grad(o, 0, -1, mb.bytes[0].data(), Specs()[0].grad_dtype,
                                          TotalElems(Specs()[0]), nullptr),
               STRATA_FAILED_PRECONDITION, "strata_offload_submit_grad", "");
  EXPECT_ERROR(
      strata_offload_submit_grad(o, 3, 0, mb.bytes[3].data(), Specs()[3].grad_dtype, 5, nullptr),
      STRATA_FAILED_PRECONDITION, "strata_offload_submit_grad", "");
  ExpectSameSnapshot(h.Snap(), before, "after the refused step");

  // Bucket 2's gradient completes the micro-batch; the step is the reference's.
  ASSERT_EQ(strata_offload_submit_grad(o, 2, -1, mb.bytes[2].data(), Specs()[2].grad_dtype,
                                       TotalElems(Specs()[2]), nullptr),
            STRATA_OK)
      << strata_last_error();
  strata_offload_step_options so;
  strata_offload_step_options_init(&so);
  so.max_grad_norm = kMaxGradNorm;
  so.loss_scale = kLossScale;
  ASSERT_EQ(strata_offload_step(o, &so, &r), STRATA_OK) << strata_last_error();
  EXPECT_EQ(r.micro_batches, 1);
  ref.Step({mb}, kMaxGradNorm, kLossScale);
  ExpectSameSnapshot(h.Snap(), ref.Snap(), "after the completed step");

  // Buckets cannot be added after the first step.
  uint16_t extra[3] = {0, 0, 0};
  void* seg[1] = {extra};
  const int64_t len[1] = {3};
  int bucket = -1;
  EXPECT_ERROR(strata_offload_add_bucket(o, 0, STRATA_DTYPE_BF16, seg, len, 1, &bucket),
               STRATA_FAILED_PRECONDITION, "strata_offload_add_bucket", "");
}

TEST(OffloadCApi, BadOptionsConfigsAndIndicesAreRefusedWithMessages) {
  strata_offload* o = reinterpret_cast<strata_offload*>(0x1);
  strata_offload_options opts;
  strata_offload_options_init(&opts);
  EXPECT_EQ(opts.struct_size, sizeof(strata_offload_options));
  EXPECT_EQ(opts.device, STRATA_OFFLOAD_CPU);
  EXPECT_EQ(opts.buffer_count, 4);
  EXPECT_EQ(opts.staging_buffers, 4);
  EXPECT_EQ(opts.pin_memory, 1);
  EXPECT_EQ(opts.io_backend, nullptr);
  const char* kCreate = "strata_offload_create";
  opts.struct_size -= 8;
  EXPECT_ERROR(strata_offload_create(&opts, &o), STRATA_INVALID_ARGUMENT, kCreate,
               "strata_offload_options_init");
  EXPECT_EQ(o, nullptr);
  strata_offload_options_init(&opts);
  opts.device = STRATA_OFFLOAD_NVME;
  EXPECT_ERROR(strata_offload_create(&opts, &o), STRATA_INVALID_ARGUMENT, kCreate, "nvme_paths");
  strata_offload_options_init(&opts);
  opts.buffer_count = 1;
  EXPECT_ERROR(strata_offload_create(&opts, &o), STRATA_INVALID_ARGUMENT, kCreate, "buffer_count");
  strata_offload_options_init(&opts);
  opts.staging_buffers = 0;
  EXPECT_ERROR(strata_offload_create(&opts, &o), STRATA_INVALID_ARGUMENT, kCreate,
               "staging_buffers");
  strata_offload_options_init(&opts);
  opts.num_threads = -1;
  EXPECT_ERROR(strata_offload_create(&opts, &o), STRATA_INVALID_ARGUMENT, kCreate, "num_threads");
  strata_offload_options_init(&opts);
  opts.io_backend = "aio";
  EXPECT_ERROR(strata_offload_create(&opts, &o), STRATA_INVALID_ARGUMENT, kCreate, "\"aio\"");
  strata_offload_options_init(&opts);
  opts.device = static_cast<strata_offload_device>(7);
  EXPECT_ERROR(strata_offload_create(&opts, &o), STRATA_INVALID_ARGUMENT, kCreate,
               "unknown device 7");
  EXPECT_ERROR(strata_offload_create(nullptr, nullptr), STRATA_INVALID_ARGUMENT, kCreate,
               "out is NULL");
  EXPECT_EQ(o, nullptr);

  // io_backend "posix" and "uring" are accepted by name ("uring" only where the kernel allows).
  strata_offload_options_init(&opts);
  opts.io_backend = "posix";
  ASSERT_EQ(strata_offload_create(&opts, &o), STRATA_OK) << strata_last_error();
  strata_offload_destroy(o);
  strata_offload_destroy(nullptr);  // allowed

  Harness h(HarnessOptions{});
  ASSERT_NE(h.get(), nullptr);
  o = h.get();
  // Configs: struct_size, hyper-parameters, kinds; all through the same parser as
  // strata_optimizer_create.
  strata_adamw_config adamw = GroupAdamW();
  adamw.struct_size = sizeof(strata_sgd_config);
  int group = -1;
  EXPECT_ERROR(strata_offload_add_group(o, STRATA_OPTIMIZER_ADAMW, &adamw, &group),
               STRATA_INVALID_ARGUMENT, "strata_offload_add_group", "struct_size");
  adamw = GroupAdamW(-1.0f);
  EXPECT_ERROR(strata_offload_add_group(o, STRATA_OPTIMIZER_ADAMW, &adamw, &group),
               STRATA_INVALID_ARGUMENT, "strata_offload_add_group", "lr");
  EXPECT_ERROR(strata_offload_add_group(o, static_cast<strata_optimizer_kind>(9), &adamw, &group),
               STRATA_INVALID_ARGUMENT, "strata_offload_add_group", "unknown optimizer kind 9");
  EXPECT_ERROR(strata_offload_set_group_config(o, 0, &adamw), STRATA_INVALID_ARGUMENT,
               "strata_offload_set_group_config", "lr");
  strata_sgd_config sgd = GroupSgd();
  sgd.momentum = 0;  // momentum cannot be switched off: the state buffer would go
  sgd.nesterov = 0;
  EXPECT_ERROR(strata_offload_set_group_config(o, 1, &sgd), STRATA_INVALID_ARGUMENT,
               "strata_offload_set_group_config", "");
  EXPECT_ERROR(strata_offload_set_group_config(o, 2, &sgd), STRATA_INVALID_ARGUMENT,
               "strata_offload_set_group_config", "unknown group 2");
  int64_t t = 0;
  EXPECT_ERROR(strata_offload_get_group_step(o, 5, &t), STRATA_INVALID_ARGUMENT,
               "strata_offload_get_group_step", "unknown group 5");
  EXPECT_ERROR(strata_offload_set_group_step(o, 0, -1), STRATA_INVALID_ARGUMENT,
               "strata_offload_set_group_step", "step");

  // Buckets: group, dtype, segments.
  uint16_t buf[4] = {};
  void* seg[2] = {buf, nullptr};
  const int64_t len[2] = {4, 4};
  int bucket = -1;
  const char* kAdd = "strata_offload_add_bucket";
  EXPECT_ERROR(strata_offload_add_bucket(o, 3, STRATA_DTYPE_BF16, seg, len, 1, &bucket),
               STRATA_INVALID_ARGUMENT, kAdd, "unknown group 3");
  EXPECT_ERROR(strata_offload_add_bucket(o, 0, static_cast<strata_dtype>(9), seg, len, 1, &bucket),
               STRATA_INVALID_ARGUMENT, kAdd, "unknown dtype 9");
  EXPECT_ERROR(strata_offload_add_bucket(o, 0, STRATA_DTYPE_BF16, seg, len, 2, &bucket),
               STRATA_INVALID_ARGUMENT, kAdd, "segment 1");
  EXPECT_ERROR(strata_offload_add_bucket(o, 0, STRATA_DTYPE_BF16, seg, len, 0, &bucket),
               STRATA_INVALID_ARGUMENT, kAdd, "num_segments");
  EXPECT_EQ(strata_offload_bucket_num_elems(o, 5), -1);
  EXPECT_EQ(strata_offload_bucket_num_elems(nullptr, 0), -1);

  // State access.
  EXPECT_EQ(strata_offload_bucket_num_state(o, 0), 2);  // AdamW: exp_avg, exp_avg_sq
  EXPECT_EQ(strata_offload_bucket_num_state(o, 1), 1);  // SGD with momentum
  EXPECT_EQ(strata_offload_bucket_num_state(o, 9), -1);
  EXPECT_STREQ(strata_offload_tensor_name(o, 0, 0), "master");
  EXPECT_STREQ(strata_offload_tensor_name(o, 0, 1), "exp_avg");
  EXPECT_STREQ(strata_offload_tensor_name(o, 0, 2), "exp_avg_sq");
  EXPECT_STREQ(strata_offload_tensor_name(o, 1, 1), "momentum_buffer");
  EXPECT_EQ(strata_offload_tensor_name(o, 0, 1), strata_offload_tensor_name(o, 2, 1));
  EXPECT_EQ(strata_offload_tensor_name(o, 0, 3), nullptr);
  EXPECT_EQ(strata_offload_tensor_name(o, 7, 0), nullptr);
  EXPECT_EQ(strata_offload_tensor_name(nullptr, 0, 0), nullptr);
  std::vector<float> out(167);
  EXPECT_ERROR(strata_offload_read_state(o, 0, 3, out.data(), 167), STRATA_INVALID_ARGUMENT,
               "strata_offload_read_state", "unknown tensor 3");
  EXPECT_ERROR(strata_offload_read_state(o, 0, 0, out.data(), 166), STRATA_INVALID_ARGUMENT,
               "strata_offload_read_state", "num_elems is 166");
  EXPECT_ERROR(strata_offload_write_state(o, 0, 1, nullptr, 167), STRATA_INVALID_ARGUMENT,
               "strata_offload_write_state", "NULL");
  EXPECT_ERROR(strata_offload_reload_masters(o, 8), STRATA_INVALID_ARGUMENT,
               "strata_offload_reload_masters", "unknown bucket 8");
  EXPECT_ERROR(strata_offload_wait_bucket(o, 8), STRATA_INVALID_ARGUMENT,
               "strata_offload_wait_bucket", "8");

  // Step options.
  strata_offload_step_options so;
  strata_offload_step_options_init(&so);
  EXPECT_EQ(so.max_grad_norm, 0.0);
  EXPECT_EQ(so.loss_scale, 1.0f);
  so.struct_size = 4;
  EXPECT_ERROR(strata_offload_step(o, &so, nullptr), STRATA_INVALID_ARGUMENT, "strata_offload_step",
               "strata_offload_step_options_init");
  strata_offload_step_options_init(&so);
  so.loss_scale = 0;
  EXPECT_ERROR(strata_offload_step(o, &so, nullptr), STRATA_INVALID_ARGUMENT, "strata_offload_step",
               "loss_scale");
  strata_offload_step_options_init(&so);
  so.max_grad_norm = NAN;
  EXPECT_ERROR(strata_offload_step(o, &so, nullptr), STRATA_INVALID_ARGUMENT, "strata_offload_step",
               "max_grad_norm");
  strata_offload_stats stats;
  EXPECT_ERROR(strata_offload_get_stats(o, nullptr), STRATA_INVALID_ARGUMENT,
               "strata_offload_get_stats", "stats is NULL");
  EXPECT_ERROR(strata_offload_get_stats(nullptr, &stats), STRATA_INVALID_ARGUMENT,
               "strata_offload_get_stats", "offload is NULL");
}

// The state is the caller's to replace (torch's load_state_dict): writing tensor 0 also
// rounds the masters into the caller's segments; reload_masters reads the segments back.
TEST(OffloadCApi, WriteStateAndReloadMastersReachTheCallersSegments) {
  Harness h(HarnessOptions{});
  ASSERT_NE(h.get(), nullptr);
  strata_offload* o = h.get();
  const int64_t n = TotalElems(Specs()[0]);
  const std::vector<float> masters = RandomValues(n, 77, 3.0f, STRATA_DTYPE_F32);
  const std::vector<float> m = RandomValues(n, 78, 0.1f, STRATA_DTYPE_F32);
  ASSERT_EQ(strata_offload_write_state(o, 0, 0, masters.data(), n), STRATA_OK)
      << strata_last_error();
  ASSERT_EQ(strata_offload_write_state(o, 0, 1, m.data(), n), STRATA_OK) << strata_last_error();
  Snapshot s = h.Snap();
  EXPECT_EQ(FirstDifference(s.masters[0], masters), "");
  EXPECT_EQ(FirstDifference(s.states[0][0], m), "");
  EXPECT_TRUE(s.params[0] == ToBytes(masters, STRATA_DTYPE_BF16));
  // The segments now hold bf16(masters); reloading widens them into the masters.
  ASSERT_EQ(strata_offload_reload_masters(o, 0), STRATA_OK) << strata_last_error();
  std::vector<float> rounded(static_cast<size_t>(n));
  ASSERT_EQ(strata_convert_to_f32(s.params[0].data(), STRATA_DTYPE_BF16, rounded.data(), n),
            STRATA_OK);
  s = h.Snap();
  EXPECT_EQ(FirstDifference(s.masters[0], rounded), "");
  ASSERT_EQ(strata_offload_set_group_step(o, 1, 41), STRATA_OK);
  int64_t t = 0;
  ASSERT_EQ(strata_offload_get_group_step(o, 1, &t), STRATA_OK);
  EXPECT_EQ(t, 41);
}

// --- The NVMe home's directory -------------------------------------------------------------

// Creates an NVMe-homed optimizer over `path`; returns the status (the handle must be NULL on
// error; on success it is destroyed).
strata_status CreateOverNvmePath(const std::string& path) {
  strata_offload_options opts;
  strata_offload_options_init(&opts);
  opts.device = STRATA_OFFLOAD_NVME;
  const char* paths[1] = {path.c_str()};
  opts.nvme_paths = paths;
  opts.num_nvme_paths = 1;
  strata_offload* o = reinterpret_cast<strata_offload*>(0x1);
  const strata_status status = strata_offload_create(&opts, &o);
  if (status == STRATA_OK) {
    strata_offload_destroy(o);
  } else {
    EXPECT_EQ(o, nullptr);
  }
  return status;
}

TEST(OffloadCApi, FileGivenAsNvmeDirectoryIsRefusedNamingIt) {
  TempDir dir;
  const std::string file = dir.path() + "/not-a-directory";
  std::ofstream(file) << "x";
  EXPECT_ERROR(CreateOverNvmePath(file), STRATA_INVALID_ARGUMENT, "strata_offload_create", file);
  const std::string missing = dir.path() + "/missing/parent";
  EXPECT_ERROR(CreateOverNvmePath(missing), STRATA_NOT_FOUND, "strata_offload_create", missing);
  EXPECT_EQ(CreateOverNvmePath(dir.path()), STRATA_OK) << strata_last_error();
}

TEST(OffloadCApi, ReadOnlyNvmeDirectoryIsPermissionDenied) {
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  TempDir dir;
  const std::string read_only = dir.path() + "/read-only";
  ASSERT_EQ(::mkdir(read_only.c_str(), 0500), 0);
  EXPECT_ERROR(CreateOverNvmePath(read_only), STRATA_PERMISSION_DENIED, "strata_offload_create",
               read_only);
}

// --- CUDA events ---------------------------------------------------------------------------

// libstrata.so links no CUDA runtime; a cuda_event needs one in the process. Where none can be
// found the call is FAILED_PRECONDITION and queues nothing. Where one can (this test then
// creates no event: there may be no GPU), a NULL event still works everywhere.
TEST(OffloadCApi, CudaEventWithoutCudaRuntimeIsRefused) {
  Harness h(HarnessOptions{});
  ASSERT_NE(h.get(), nullptr);
  bool runtime = false;
  for (const char* soname :
       {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11", "libcudart.so"}) {
    if (void* lib = dlopen(soname, RTLD_LAZY | RTLD_LOCAL)) {
      runtime = true;
      dlclose(lib);
      break;
    }
  }
  if (!runtime) {
    const MicroBatch mb = Gradients(0, 0);
    int fake_event = 0;
    EXPECT_ERROR(strata_offload_submit_grad(h.get(), 0, -1, mb.bytes[0].data(), STRATA_DTYPE_BF16,
                                            TotalElems(Specs()[0]), &fake_event),
                 STRATA_FAILED_PRECONDITION, "strata_offload_submit_grad",
                 "cuda_event given but no CUDA runtime (libcudart) is loaded in this process");
  }
  // Nothing queued: a full micro-batch with NULL events is the reference's step.
  Train(h, 0, 1);
  Reference ref;
  Train(ref, 0, 1);
  ExpectSameSnapshot(h.Snap(), ref.Snap(), "after the refused event");
  if (runtime) GTEST_SKIP() << "a CUDA runtime can be loaded here; the refusal is not reachable";
}

// ---- AdamW8bit and Adafactor (0.4): shaped buckets, sections, byte-level state ----

// Reads tensor t of a bucket as bytes.
std::vector<uint8_t> ReadBytes(strata_offload* o, int bucket, int t) {
  strata_state_section sec;
  EXPECT_EQ(strata_offload_state_section(o, bucket, t, &sec), STRATA_OK);
  std::vector<uint8_t> v(static_cast<size_t>(sec.size_bytes));
  EXPECT_EQ(strata_offload_read_state_bytes(o, bucket, t, v.data(), sec.size_bytes), STRATA_OK)
      << strata_last_error();
  return v;
}

TEST(OffloadCApi, AdamW8bitAndAdafactorBucketsStepAsTheStandaloneOptimizerPerSegment) {
  for (strata_offload_device device : {STRATA_OFFLOAD_CPU, STRATA_OFFLOAD_NVME}) {
    SCOPED_TRACE(device == STRATA_OFFLOAD_CPU ? "cpu" : "nvme");
    TempDir dir;
    const char* paths[1] = {dir.path().c_str()};
    strata_offload_options opts;
    strata_offload_options_init(&opts);
    opts.device = device;
    opts.num_threads = 2;
    if (device == STRATA_OFFLOAD_NVME) {
      opts.nvme_paths = paths;
      opts.num_nvme_paths = 1;
    }
    strata_offload* o = nullptr;
    ASSERT_EQ(strata_offload_create(&opts, &o), STRATA_OK) << strata_last_error();
    strata_adamw_config a;
    strata_adamw_config_init(&a);
    a.lr = 1e-2f;
    strata_adafactor_config f;
    strata_adafactor_config_init(&f);
    f.beta1 = 0.9f;
    f.lr = 1e-2f;
    const strata_optimizer_kind kinds[2] = {STRATA_OPTIMIZER_ADAMW8BIT, STRATA_OPTIMIZER_ADAFACTOR};
    const void* configs[2] = {&a, &f};
    int group = -1;
    for (int g = 0; g < 2; ++g) {
      ASSERT_EQ(strata_offload_add_group(o, kinds[g], configs[g], &group), STRATA_OK);
    }
    // Per group one bucket of a (31, 70) matrix and a vector of 2100 (two 8-bit blocks).
    const std::vector<std::vector<int64_t>> shapes = {{31, 70}, {2100}};
    std::vector<std::vector<float>> params[2];
    std::vector<std::vector<float>> masters[2];  // the standalone optimizer's
    for (int g = 0; g < 2; ++g) {
      std::vector<void*> segs;
      std::vector<int64_t> lens;
      std::vector<const int64_t*> shape_ptrs;
      std::vector<int> ndims;
      for (size_t s = 0; s < shapes.size(); ++s) {
        const int64_t n = shapes[s][0] * (shapes[s].size() > 1 ? shapes[s][1] : 1);
        params[g].push_back(RandomValues(n, 5 + g * 10 + s, 1.0f, STRATA_DTYPE_F32));
        masters[g].push_back(params[g].back());
        lens.push_back(n);
        shape_ptrs.push_back(shapes[s].data());
        ndims.push_back(static_cast<int>(shapes[s].size()));
      }
      for (auto& p : params[g]) segs.push_back(p.data());
      int bucket = -1;
      ASSERT_EQ(strata_offload_add_bucket_shaped(o, g, STRATA_DTYPE_F32, segs.data(), lens.data(),
                                                 shape_ptrs.data(), ndims.data(), 2, &bucket),
                STRATA_OK)
          << strata_last_error();
      ASSERT_EQ(bucket, g);
    }
    // The 8-bit bucket: codes are U8, the float API refuses them.
    strata_state_section sec;
    ASSERT_EQ(strata_offload_state_section(o, 0, 1, &sec), STRATA_OK);
    EXPECT_STREQ(sec.name, "exp_avg");
    EXPECT_EQ(sec.dtype, STRATA_STATE_U8);
    EXPECT_EQ(sec.num_elems, 31 * 70 + 2100);
    EXPECT_STREQ(strata_offload_tensor_name(o, 0, 2), "exp_avg.absmax");
    EXPECT_EQ(strata_offload_bucket_num_state(o, 0), 4);
    std::vector<float> wrong(sec.num_elems);
    EXPECT_EQ(strata_offload_read_state(o, 0, 1, wrong.data(), sec.num_elems),
              STRATA_INVALID_ARGUMENT);
    EXPECT_THAT(strata_last_error(), HasSubstr("strata_offload_read_state_bytes"));
    uint8_t small[4];
    EXPECT_EQ(strata_offload_read_state_bytes(o, 0, 1, small, 4), STRATA_INVALID_ARGUMENT);
    // The Adafactor bucket: rows and columns of the matrix only.
    ASSERT_EQ(strata_offload_state_section(o, 1, 1, &sec), STRATA_OK);
    EXPECT_STREQ(sec.name, "exp_avg_sq_row");
    EXPECT_EQ(sec.num_elems, 31);
    int64_t off = -1, len = -1;
    ASSERT_EQ(strata_offload_segment_state_range(o, 1, 1, 1, &off, &len), STRATA_OK);
    EXPECT_EQ(len, 0);
    EXPECT_EQ(strata_offload_segment_state_range(o, 1, 2, 1, &off, &len), STRATA_INVALID_ARGUMENT);

    // Standalone handles with the same configs, and their per-segment state.
    strata_optimizer* ref[2] = {nullptr, nullptr};
    std::vector<std::vector<std::vector<uint8_t>>> ref_state[2];
    for (int g = 0; g < 2; ++g) {
      ASSERT_EQ(strata_optimizer_create(kinds[g], configs[g], nullptr, &ref[g]), STRATA_OK);
      for (const auto& shape : shapes) {
        strata_state_section secs[STRATA_MAX_STATE_SECTIONS];
        int count = 0;
        ASSERT_EQ(strata_optimizer_state_layout(ref[g], shape.data(),
                                                static_cast<int>(shape.size()), secs, 8, &count),
                  STRATA_OK);
        std::vector<std::vector<uint8_t>> st;
        std::vector<void*> ptrs;
        for (int i = 0; i < count; ++i) st.emplace_back(secs[i].size_bytes);
        for (auto& x : st) ptrs.push_back(x.data());
        ASSERT_EQ(strata_optimizer_init_state(ref[g], shape.data(), static_cast<int>(shape.size()),
                                              ptrs.data(), count),
                  STRATA_OK);
        ref_state[g].push_back(std::move(st));
      }
    }
    for (int t = 1; t <= 3; ++t) {
      std::vector<std::vector<float>> grads[2];
      for (int g = 0; g < 2; ++g) {
        for (size_t s = 0; s < shapes.size(); ++s) {
          grads[g].push_back(RandomValues(static_cast<int64_t>(params[g][s].size()),
                                          100 * t + 10 * g + s, 0.2f, STRATA_DTYPE_F32));
          ASSERT_EQ(strata_offload_submit_grad(o, g, static_cast<int>(s), grads[g][s].data(),
                                               STRATA_DTYPE_F32,
                                               static_cast<int64_t>(grads[g][s].size()), nullptr),
                    STRATA_OK);
        }
      }
      ASSERT_EQ(strata_offload_step(o, nullptr, nullptr), STRATA_OK) << strata_last_error();
      ASSERT_EQ(strata_offload_synchronize(o), STRATA_OK);
      for (int g = 0; g < 2; ++g) {
        for (size_t s = 0; s < shapes.size(); ++s) {
          std::vector<void*> ptrs;
          std::vector<int64_t> sizes;
          for (auto& x : ref_state[g][s]) {
            ptrs.push_back(x.data());
            sizes.push_back(static_cast<int64_t>(x.size()));
          }
          ASSERT_EQ(strata_optimizer_step_state(
                        ref[g], t, 1.0f, masters[g][s].data(), shapes[s].data(),
                        static_cast<int>(shapes[s].size()), ptrs.data(), sizes.data(),
                        static_cast<int>(ptrs.size()), grads[g][s].data(), STRATA_DTYPE_F32,
                        nullptr, STRATA_DTYPE_F32),
                    STRATA_OK)
              << strata_last_error();
          ASSERT_EQ(params[g][s], masters[g][s]) << "group " << g << " segment " << s;
        }
        // Every section of the bucket: the segments' parts back to back.
        const int num = strata_offload_bucket_num_state(o, g);
        for (int x = 1; x <= num; ++x) {
          const std::vector<uint8_t> got = ReadBytes(o, g, x);
          ASSERT_EQ(strata_offload_state_section(o, g, x, &sec), STRATA_OK);
          const int64_t elem = sec.dtype == STRATA_STATE_U8 ? 1 : 4;
          for (size_t s = 0; s < shapes.size(); ++s) {
            ASSERT_EQ(strata_offload_segment_state_range(o, g, static_cast<int>(s), x, &off, &len),
                      STRATA_OK);
            if (len == 0) continue;
            // The segment's own section of that name: its layout lists present sections only.
            strata_state_section secs[STRATA_MAX_STATE_SECTIONS];
            int count = 0;
            ASSERT_EQ(
                strata_optimizer_state_layout(ref[g], shapes[s].data(),
                                              static_cast<int>(shapes[s].size()), secs, 8, &count),
                STRATA_OK);
            int k = 0;
            while (k < count && std::strcmp(secs[k].name, sec.name) != 0) ++k;
            ASSERT_LT(k, count) << sec.name;
            ASSERT_EQ(len * elem, secs[k].size_bytes);
            ASSERT_EQ(0, std::memcmp(got.data() + off * elem, ref_state[g][s][k].data(),
                                     secs[k].size_bytes))
                << "group " << g << " " << sec.name << " segment " << s << " step " << t;
          }
        }
      }
    }
    // Save, load into a new handle over other weights: every byte comes back.
    const std::string ckpt = dir.path() + "/ckpt";
    ASSERT_EQ(strata_offload_save(o, ckpt.c_str()), STRATA_OK) << strata_last_error();
    strata_offload* o2 = nullptr;
    ASSERT_EQ(strata_offload_create(&opts, &o2), STRATA_OK);
    std::vector<std::vector<float>> other[2];
    for (int g = 0; g < 2; ++g) {
      ASSERT_EQ(strata_offload_add_group(o2, kinds[g], configs[g], &group), STRATA_OK);
    }
    for (int g = 0; g < 2; ++g) {
      std::vector<void*> segs;
      std::vector<int64_t> lens;
      std::vector<const int64_t*> shape_ptrs;
      std::vector<int> ndims;
      for (size_t s = 0; s < shapes.size(); ++s) {
        other[g].push_back(std::vector<float>(params[g][s].size(), 0.5f));
        lens.push_back(static_cast<int64_t>(params[g][s].size()));
        shape_ptrs.push_back(shapes[s].data());
        ndims.push_back(static_cast<int>(shapes[s].size()));
      }
      for (auto& p : other[g]) segs.push_back(p.data());
      int bucket = -1;
      ASSERT_EQ(strata_offload_add_bucket_shaped(o2, g, STRATA_DTYPE_F32, segs.data(), lens.data(),
                                                 shape_ptrs.data(), ndims.data(), 2, &bucket),
                STRATA_OK);
    }
    ASSERT_EQ(strata_offload_load(o2, ckpt.c_str()), STRATA_OK) << strata_last_error();
    for (int g = 0; g < 2; ++g) {
      EXPECT_EQ(other[g], params[g]);
      for (int x = 0; x <= strata_offload_bucket_num_state(o, g); ++x) {
        EXPECT_EQ(ReadBytes(o2, g, x), ReadBytes(o, g, x)) << "group " << g << " tensor " << x;
      }
    }
    // Writing bytes back changes the state (and the masters reach the segments).
    std::vector<uint8_t> m = ReadBytes(o2, 0, 0);
    std::vector<float> ones(m.size() / 4, 1.0f);
    ASSERT_EQ(
        strata_offload_write_state_bytes(o2, 0, 0, ones.data(), static_cast<int64_t>(m.size())),
        STRATA_OK);
    EXPECT_EQ(other[0][1], std::vector<float>(2100, 1.0f));
    strata_offload_destroy(o2);
    strata_offload_destroy(o);
    strata_optimizer_destroy(ref[0]);
    strata_optimizer_destroy(ref[1]);
  }
}

}  // namespace
