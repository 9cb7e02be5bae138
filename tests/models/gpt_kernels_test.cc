#include "models/gpt_kernels.h"

#include <gtest/gtest.h>
#include <tbb/info.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tests/models/gpt_test_model.h"

namespace strata::models {
namespace {

using test_model::BlockName;
using test_model::BlockTensors;
using test_model::CastModel;
using test_model::Model;
using test_model::RandomModel;
using test_model::RandomTokens;
using test_model::Runner;

struct Case {
  GptShape shape;
  int B, T;
};

// Tiny config from the spec: one attention row block, one group.
Case TinyCase() { return {{17, 8, 2, 2, 8}, 2, 5}; }
// T above the attention row block (64) and B above the group size
// (ceil(256 / 65) = 4 sequences): two row blocks, groups of 4 and 1.
Case LongCase() { return {{5, 65, 1, 2, 4}, 5, 65}; }

bool Close(double got, double want, double atol, double rtol) {
  return std::abs(got - want) <= atol + rtol * std::max(std::abs(got), std::abs(want));
}

// Central differences of the loss (double) against the analytic gradient for
// every element of every parameter tensor of every block, and for every
// dx_stride-th element of the embedding output.
void CheckAgainstFiniteDifferences(const Case& c, uint64_t seed, size_t dx_stride) {
  ASSERT_TRUE(ValidateShape(c.shape).ok());
  Model<double> m = RandomModel(c.shape, seed);
  const int n = c.B * c.T;
  const std::vector<int32_t> tokens = RandomTokens(n, c.shape.vocab_size, seed + 1);
  const std::vector<int32_t> targets = RandomTokens(n, c.shape.vocab_size, seed + 2);
  Runner<double> run(c.shape, c.B, c.T);

  std::vector<std::vector<double>> grads;
  std::vector<double> dx0;
  const double loss = run.Backward(m, tokens, targets, &grads, &dx0);
  ASSERT_TRUE(std::isfinite(loss));
  ASSERT_GT(loss, 0.1);

  constexpr double kEps = 1e-5, kAtol = 1e-9, kRtol = 1e-6;
  int failures = 0;
  double max_abs_err = 0;
  auto check = [&](const std::string& what, double analytic, double numeric) {
    max_abs_err = std::max(max_abs_err, std::abs(analytic - numeric));
    if (!Close(analytic, numeric, kAtol, kRtol) && ++failures <= 20) {
      ADD_FAILURE() << what << ": analytic " << analytic << " numeric " << numeric;
    }
  };

  for (size_t b = 0; b < m.blocks.size(); ++b) {
    for (const TensorInfo& t : BlockTensors(c.shape, b)) {
      for (int64_t i = 0; i < t.num_elems; ++i) {
        double& p = m.blocks[b][t.offset + i];
        const double saved = p;
        p = saved + kEps;
        const double up = run.Loss(m, tokens, targets.data());
        p = saved - kEps;
        const double down = run.Loss(m, tokens, targets.data());
        p = saved;
        check(BlockName(c.shape, b) + "." + t.name + "[" + std::to_string(i) + "]",
              grads[b][t.offset + i], (up - down) / (2 * kEps));
      }
    }
  }
  const std::vector<double> x0 = run.Embed(m, tokens);
  for (size_t i = 0; i < x0.size(); i += dx_stride) {
    std::vector<double> x = x0;
    x[i] = x0[i] + kEps;
    const double up = run.LossFromX0(m, x, targets.data());
    x[i] = x0[i] - kEps;
    const double down = run.LossFromX0(m, x, targets.data());
    check("d(embedding output)[" + std::to_string(i) + "]", dx0[i], (up - down) / (2 * kEps));
  }
  EXPECT_EQ(failures, 0) << "max abs error " << max_abs_err;
}

TEST(GptBackward, MatchesCentralFiniteDifferencesForEveryParameter) {
  CheckAgainstFiniteDifferences(TinyCase(), 1234, /*dx_stride=*/1);
}

TEST(GptBackward, MatchesFiniteDifferencesWithLongSequencesAndSeveralGroups) {
  CheckAgainstFiniteDifferences(LongCase(), 99, /*dx_stride=*/7);
}

// Tolerance for float results against double: relative to the magnitude of
// the tensor, since small gradient entries carry the absolute error of the
// large ones they are computed with.
void ExpectFloatClose(const std::string& what, const std::vector<float>& f,
                      const std::vector<double>& d) {
  ASSERT_EQ(f.size(), d.size());
  double scale = 0;
  for (double v : d) scale = std::max(scale, std::abs(v));
  int failures = 0;
  for (size_t i = 0; i < d.size(); ++i) {
    if (!Close(f[i], d[i], 2e-5 * scale, 2e-4) && ++failures <= 10) {
      ADD_FAILURE() << what << "[" << i << "]: float " << f[i] << " double " << d[i]
                    << " (tensor max " << scale << ")";
    }
  }
}

Case MediumCase() { return {{64, 80, 2, 4, 32}, 5, 70}; }

TEST(GptKernels, FloatAgreesWithDouble) {
  const Case c = MediumCase();
  const Model<double> md = RandomModel(c.shape, 5);
  const Model<float> mf = CastModel<float>(md);
  const std::vector<int32_t> tokens = RandomTokens(c.B * c.T, c.shape.vocab_size, 6);
  const std::vector<int32_t> targets = RandomTokens(c.B * c.T, c.shape.vocab_size, 7);

  Runner<double> rd(c.shape, c.B, c.T);
  Runner<float> rf(c.shape, c.B, c.T);
  std::vector<std::vector<double>> gd;
  std::vector<std::vector<float>> gf;
  std::vector<double> dxd;
  std::vector<float> dxf;
  const double loss_d = rd.Backward(md, tokens, targets, &gd, &dxd);
  const float loss_f = rf.Backward(mf, tokens, targets, &gf, &dxf);
  EXPECT_NEAR(loss_f, loss_d, 1e-5 * loss_d);

  ASSERT_EQ(rd.Loss(md, tokens, targets.data()), loss_d);
  ASSERT_EQ(rf.Loss(mf, tokens, targets.data()), loss_f);
  ExpectFloatClose("logits", rf.logits(), rd.logits());
  for (size_t b = 0; b < gd.size(); ++b) {
    for (const TensorInfo& t : BlockTensors(c.shape, b)) {
      ExpectFloatClose(
          BlockName(c.shape, b) + "." + t.name,
          std::vector<float>(gf[b].begin() + t.offset, gf[b].begin() + t.offset + t.num_elems),
          std::vector<double>(gd[b].begin() + t.offset, gd[b].begin() + t.offset + t.num_elems));
    }
  }
  ExpectFloatClose("d(embedding output)", dxf, dxd);
}

TEST(GptKernels, LogitsUpToPositionTDoNotDependOnLaterTokens) {
  const Case c = MediumCase();
  const Model<float> m = CastModel<float>(RandomModel(c.shape, 21));
  const int t_last = 40;  // changed tokens span the attention row block at 64
  const std::vector<int32_t> a = RandomTokens(c.B * c.T, c.shape.vocab_size, 22);
  std::vector<int32_t> b = a;
  for (int seq = 0; seq < c.B; ++seq) {
    for (int t = t_last + 1; t < c.T; ++t) {
      b[seq * c.T + t] = (a[seq * c.T + t] + 1 + t) % c.shape.vocab_size;
    }
  }
  Runner<float> run(c.shape, c.B, c.T);
  const int64_t V = c.shape.vocab_size;
  run.Loss(m, a, nullptr);
  const std::vector<float> logits_a = run.logits();
  run.Loss(m, b, nullptr);
  const std::vector<float> logits_b = run.logits();
  for (int seq = 0; seq < c.B; ++seq) {
    for (int t = 0; t < c.T; ++t) {
      const float* la = logits_a.data() + (int64_t{seq} * c.T + t) * V;
      const float* lb = logits_b.data() + (int64_t{seq} * c.T + t) * V;
      const bool same = std::equal(la, la + V, lb);
      if (t <= t_last) {
        EXPECT_TRUE(same) << "sequence " << seq << " position " << t << " saw a later token";
      } else {
        EXPECT_FALSE(same) << "sequence " << seq << " position " << t << " ignored its tokens";
      }
    }
  }
}

TEST(GptKernels, HeadForwardWithoutTargetsReturnsZeroAndTheSameLogits) {
  const Case c = TinyCase();
  const Model<double> m = RandomModel(c.shape, 3);
  const std::vector<int32_t> tokens = RandomTokens(c.B * c.T, c.shape.vocab_size, 4);
  Runner<double> run(c.shape, c.B, c.T);
  const double loss = run.Loss(m, tokens, tokens.data());
  const std::vector<double> logits = run.logits();
  EXPECT_GT(loss, 0.0);
  EXPECT_EQ(run.Loss(m, tokens, nullptr), 0.0);
  EXPECT_EQ(run.logits(), logits);
}

TEST(GptKernels, BitIdenticalAcrossRunsAndThreadCounts) {
  const Case c = MediumCase();
  const Model<float> m = CastModel<float>(RandomModel(c.shape, 31));
  const std::vector<int32_t> tokens = RandomTokens(c.B * c.T, c.shape.vocab_size, 32);
  const std::vector<int32_t> targets = RandomTokens(c.B * c.T, c.shape.vocab_size, 33);
  struct Result {
    float loss;
    std::vector<std::vector<float>> grads;
    std::vector<float> dx0;
  };
  auto run = [&] {
    Runner<float> r(c.shape, c.B, c.T);
    Result res;
    res.loss = r.Backward(m, tokens, targets, &res.grads, &res.dx0);
    return res;
  };
  auto same_bits = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  const Result first = run();
  Result others[3];
  others[0] = run();
  tbb::task_arena(1).execute([&] { others[1] = run(); });
  tbb::task_arena(tbb::info::default_concurrency()).execute([&] { others[2] = run(); });
  for (const Result& o : others) {
    EXPECT_EQ(std::memcmp(&first.loss, &o.loss, sizeof(float)), 0);
    EXPECT_TRUE(same_bits(first.dx0, o.dx0));
    for (size_t b = 0; b < first.grads.size(); ++b) {
      EXPECT_TRUE(same_bits(first.grads[b], o.grads[b])) << BlockName(c.shape, b);
    }
  }
}

TEST(GptKernels, ScratchSizesFollowTheDocumentedFormula) {
  // GPT-2 small, B = 8, T = 1024: one sequence per group.
  const GptShape gpt2{50257, 1024, 12, 12, 768};
  const int64_t R = 1024, C = 768, H = 12, T = 1024;
  EXPECT_EQ(LayerScratchElems(gpt2, 8, 1024),
            4 * R + 3 * R * C + H * T * T + std::max(8 * R * C, 5 * R * C + H * 64 * T));
  EXPECT_EQ(LayerScratchElems(gpt2, 1, 1024), LayerScratchElems(gpt2, 8, 1024));
  // Short sequences: groups of ceil(256 / 64) = 4 sequences, capped by B.
  const GptShape small{256, 64, 4, 4, 128};
  const int64_t r2 = 2 * 64, r4 = 4 * 64, c2 = 128;
  EXPECT_EQ(LayerScratchElems(small, 2, 64),
            4 * r2 + 3 * r2 * c2 + 2 * 4 * 64 * 64 +
                std::max(8 * r2 * c2, 5 * r2 * c2 + 2 * 4 * 64 * 64));
  EXPECT_EQ(LayerScratchElems(small, 16, 64),
            4 * r4 + 3 * r4 * c2 + 4 * 4 * 64 * 64 +
                std::max(8 * r4 * c2, 5 * r4 * c2 + 4 * 4 * 64 * 64));
  EXPECT_EQ(HeadScratchElems(gpt2, 8, 1024), 8 * 1024 * (768 + 3));
}

}  // namespace
}  // namespace strata::models
