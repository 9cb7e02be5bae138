#include "models/gpt_kernels.h"

#include <gtest/gtest.h>
#include <tbb/info.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/models/gpt_test_model.h"
#include "tests/models/terms_bound.h"

namespace strata::models {
namespace {

using test_model::BlockName;
using test_model::BlockTensors;
using test_model::CastModel;
using test_model::CastVector;
using test_model::GuardedScratch;
using test_model::Model;
using test_model::PoisonedVector;
using test_model::RandomModel;
using test_model::RandomTokens;
using test_model::RoundedModel;
using test_model::Runner;
using test_model::ToDouble;
using test_model::ToDoubles;

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

TEST(GptKernels, PositionsUpToTDoNotDependOnLaterTokens) {
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
  const int64_t C = c.shape.channels, V = c.shape.vocab_size;
  run.Loss(m, a, nullptr);
  const std::vector<float> x_a = run.head_input(), logits_a = run.logits();
  run.Loss(m, b, nullptr);
  const std::vector<float> x_b = run.head_input(), logits_b = run.logits();
  for (int seq = 0; seq < c.B; ++seq) {
    for (int t = 0; t < c.T; ++t) {
      const float* xa = x_a.data() + (int64_t{seq} * c.T + t) * C;
      const float* xb = x_b.data() + (int64_t{seq} * c.T + t) * C;
      const bool same = std::equal(xa, xa + C, xb);
      if (t <= t_last) {
        EXPECT_TRUE(same) << "sequence " << seq << " position " << t << " saw a later token";
      } else {
        EXPECT_FALSE(same) << "sequence " << seq << " position " << t << " ignored its tokens";
      }
    }
    // The last position's logits see the changed tokens.
    EXPECT_FALSE(std::equal(logits_a.begin() + seq * V, logits_a.begin() + (seq + 1) * V,
                            logits_b.begin() + seq * V))
        << "sequence " << seq;
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

// Every run of a model (forward and backward, every block) gives the same bits: twice in the
// default arena, once on one thread, once on all threads.
template <typename S>
void ExpectBitIdenticalAcrossRunsAndThreadCounts() {
  const Case c = MediumCase();
  const Model<S> m = CastModel<S>(RandomModel(c.shape, 31));
  const std::vector<int32_t> tokens = RandomTokens(c.B * c.T, c.shape.vocab_size, 32);
  const std::vector<int32_t> targets = RandomTokens(c.B * c.T, c.shape.vocab_size, 33);
  struct Result {
    ComputeType<S> loss;
    std::vector<std::vector<S>> grads;
    std::vector<S> dx0;
  };
  auto run = [&] {
    Runner<S> r(c.shape, c.B, c.T);
    Result res;
    res.loss = r.Backward(m, tokens, targets, &res.grads, &res.dx0);
    return res;
  };
  auto same_bits = [](const std::vector<S>& x, const std::vector<S>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(S)) == 0;
  };
  const Result first = run();
  Result others[3];
  others[0] = run();
  tbb::task_arena(1).execute([&] { others[1] = run(); });
  tbb::task_arena(tbb::info::default_concurrency()).execute([&] { others[2] = run(); });
  for (const Result& o : others) {
    EXPECT_EQ(std::memcmp(&first.loss, &o.loss, sizeof(first.loss)), 0);
    EXPECT_TRUE(same_bits(first.dx0, o.dx0));
    for (size_t b = 0; b < first.grads.size(); ++b) {
      EXPECT_TRUE(same_bits(first.grads[b], o.grads[b])) << BlockName(c.shape, b);
    }
  }
}

TEST(GptKernels, FloatRunsAreBitIdenticalAcrossRunsAndThreadCounts) {
  ExpectBitIdenticalAcrossRunsAndThreadCounts<float>();
}
TEST(GptKernels, Bf16RunsAreBitIdenticalAcrossRunsAndThreadCounts) {
  ExpectBitIdenticalAcrossRunsAndThreadCounts<Bf16>();
}
TEST(GptKernels, Fp16RunsAreBitIdenticalAcrossRunsAndThreadCounts) {
  ExpectBitIdenticalAcrossRunsAndThreadCounts<Fp16>();
}

// Byte sizes from the layout documented next to the declarations: 64-byte aligned
// sub-buffers, statistics in ComputeType, activations in S; the layer's (the one layout of both
// backends, models/gpt_layout.h) at multiples of 256.
int64_t Aligned(int64_t bytes) { return (bytes + 63) / 64 * 64; }
int64_t Aligned256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

TEST(GptKernels, ScratchSizesFollowTheDocumentedLayout) {
  const GptShape gpt2{50257, 1024, 12, 12, 768};
  const int64_t N = 8 * 1024, C = 768, H = 12, V = 50257;
  for (int64_t es : {2, 4, 8}) {
    const int64_t fs = es == 8 ? 8 : 4;
    // mean1, rstd1, mean2, rstd2; lse, delta; the CUDA column-sum partials (N / 64, 4C) fp32;
    // ln1, att, x2, ln2; qkv; h, g; dln (N, C) S or the fp32 DGELU product of N es / 16 rows.
    const int64_t layer = 4 * Aligned256(N * fs) + 2 * Aligned256(H * N * fs) +
                          Aligned256(N / 64 * 4 * C * 4) + 4 * Aligned256(N * C * es) +
                          Aligned256(3 * N * C * es) + 2 * Aligned256(4 * N * C * es) +
                          Aligned256(std::max(N * C * es, N * es / 16 * 4 * C * 4));
    // lnf, mean / rstd / losses, the (R, V) logits chunk and, for 16-bit S, the (C, V) fp32
    // dWlm accumulator.
    const int64_t R = (int64_t{1} << 22) / V;
    const int64_t head = Aligned(N * C * es) + 3 * Aligned(N * fs) + Aligned(R * V * es) +
                         (es == 2 ? Aligned(C * V * 4) : 0);
    const int64_t got_layer = es == 2   ? GptLayerScratchBytes<Bf16>(gpt2, 8, 1024)
                              : es == 4 ? GptLayerScratchBytes<float>(gpt2, 8, 1024)
                                        : GptLayerScratchBytes<double>(gpt2, 8, 1024);
    const int64_t got_head = es == 2   ? GptHeadScratchBytes<Fp16>(gpt2, 8, 1024)
                             : es == 4 ? GptHeadScratchBytes<float>(gpt2, 8, 1024)
                                       : GptHeadScratchBytes<double>(gpt2, 8, 1024);
    EXPECT_EQ(got_layer, layer) << es;
    EXPECT_EQ(got_head, head) << es;
  }
  EXPECT_EQ(GptEmbeddingScratchBytes<Bf16>(gpt2, 8, 1024), Aligned((V + 1) * 4) + Aligned(N * 4));
  // No T x T buffer: the layer scratch grows linearly with T.
  EXPECT_EQ(GptLayerScratchBytes<Bf16>(gpt2, 1, 1024),
            8 * GptLayerScratchBytes<Bf16>(gpt2, 1, 128));
}

// ---------------------------------------------------------------------------
// Each block in S = float, Bf16, Fp16 against the double reference on the same (rounded)
// inputs, element by element.
//
// Error model. Every rounding to S of a value v adds at most u |v| (u = 2^-8 bf16, 2^-11 fp16,
// 2^-24 fp32); an fp32 sum of K terms adds at most K 2^-24 times the sum of their magnitudes.
// With the test's data (unit-scale activations, weights scaled to unit-variance outputs,
// LayerNorm renormalizing), each intermediate is O(rms) of the tensor it feeds, and each
// rounding on the path to an output perturbs the output by about u (|out| + rms(out)): the
// linear maps after it have gain of order one. So the bound for one output element is
//     |got - ref| <= k * (u + K * 2^-24) * (|ref| + rms(ref)),
// k = (number of roundings to S on the path) * (a gain margin of 2), K = the longest fp32 sum
// on the path. The k of each tensor is written beside it. For S = float u + K 2^-24 is
// dominated by K, for 16-bit storage by u.

template <typename S>
constexpr double kUnitRoundoff = std::is_same_v<S, Bf16>   ? 0x1p-8
                                 : std::is_same_v<S, Fp16> ? 0x1p-11
                                                           : 0x1p-24;

double Rms(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x * x;
  return v.empty() ? 0 : std::sqrt(sum / static_cast<double>(v.size()));
}

// Returns max |got - ref| / bound so callers can print how tight the bound is.
double ExpectWithinBound(const std::string& what, const std::vector<double>& got,
                         const std::vector<double>& ref, double k, double eps) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  const double scale = Rms(ref);
  double worst = 0;
  int failures = 0;
  for (size_t i = 0; i < ref.size() && i < got.size(); ++i) {
    const double bound = k * eps * (std::abs(ref[i]) + scale);
    const double err = std::abs(got[i] - ref[i]);
    worst = std::max(worst, err / bound);
    if (!(err <= bound) && ++failures <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " reference " << ref[i]
                    << " error " << err << " bound " << bound;
    }
  }
  EXPECT_EQ(failures, 0) << what << ": " << failures << " elements out of bounds";
  // How tight the bound is, in the XML report (--gtest_output=xml).
  ::testing::Test::RecordProperty("worst_error_over_bound " + what, std::to_string(worst));
  return worst;
}

std::vector<double> RandomValues(size_t n, double amplitude, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-amplitude, amplitude);
  std::vector<double> v(n);
  for (double& x : v) x = u(gen);
  return v;
}

std::vector<double> Slice(const std::vector<double>& v, const TensorInfo& t) {
  return std::vector<double>(v.begin() + t.offset, v.begin() + t.offset + t.num_elems);
}

// Odd sizes: C = 48 with 4 heads (hs = 12), B = 3, T = 70 (two attention row blocks, the
// second partial), V = 67; and T = 1.
const Case kOddCase{{67, 80, 1, 4, 48}, 3, 70};
const Case kSingleTokenCase{{67, 80, 1, 4, 48}, 3, 1};

template <typename S>
class GptBlockTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(GptBlockTest, StorageTypes);

// The data of one block test in S and the same values in double.
template <typename S>
struct BlockData {
  std::vector<S> params, x, dy;
  std::vector<double> params_d, x_d, dy_d;
};

template <typename S>
BlockData<S> MakeBlockData(const std::vector<double>& params, size_t n_x, size_t n_dy,
                           uint64_t seed) {
  BlockData<S> d;
  d.params = CastVector<S>(params);
  d.x = CastVector<S>(RandomValues(n_x, 1.0, seed));
  d.dy = CastVector<S>(RandomValues(n_dy, 1.0, seed + 1));
  d.params_d = ToDoubles(d.params);
  d.x_d = ToDoubles(d.x);
  d.dy_d = ToDoubles(d.dy);
  return d;
}

template <typename S>
void CheckEmbedding(const Case& c) {
  const GptShape& s = c.shape;
  const int64_t N = int64_t{c.B} * c.T, C = s.channels;
  const Model<double> m = RandomModel(s, 41);
  const BlockData<S> d = MakeBlockData<S>(m.blocks[0], 0, N * C, 42);
  // Few distinct tokens, so that wte rows sum many positions (and some rows none).
  std::vector<int32_t> tokens = RandomTokens(c.B * c.T, 7, 43);
  for (int32_t& t : tokens) t = t * 9 % s.vocab_size;

  std::vector<S> x = PoisonedVector<S>(N * C);
  std::vector<double> x_ref(N * C);
  GptEmbeddingForward<S>(s, d.params.data(), tokens.data(), c.B, c.T, x.data());
  GptEmbeddingForward<double>(s, d.params_d.data(), tokens.data(), c.B, c.T, x_ref.data());
  const double u = kUnitRoundoff<S>;
  // x = S(wte + wpe): one rounding, k = 1 (no gain).
  ExpectWithinBound("embedding x", ToDoubles(x), x_ref, 1, u);

  std::vector<S> g = PoisonedVector<S>(d.params.size());
  std::vector<double> g_ref(d.params.size());
  GuardedScratch scratch(GptEmbeddingScratchBytes<S>(s, c.B, c.T));
  GuardedScratch scratch_d(GptEmbeddingScratchBytes<double>(s, c.B, c.T));
  GptEmbeddingBackward<S>(s, tokens.data(), d.dy.data(), c.B, c.T, g.data(), scratch.Poisoned());
  scratch.CheckGuard("GptEmbeddingBackward");
  GptEmbeddingBackward<double>(s, tokens.data(), d.dy_d.data(), c.B, c.T, g_ref.data(),
                               scratch_d.Poisoned());
  // One fp32 sum of up to N terms of magnitude <= 1 (|sum| up to sqrt(N) rms), then one
  // rounding: k = 1 for the rounding, K = N for the sum.
  for (const TensorInfo& t : EmbeddingTensors(s)) {
    ExpectWithinBound("embedding d" + t.name, Slice(ToDoubles(g), t), Slice(g_ref, t), 1,
                      u + N * 0x1p-24);
  }
  // Rows of absent tokens and of positions >= T are exactly zero.
  for (int64_t v = 0; v < s.vocab_size; ++v) {
    if (std::find(tokens.begin(), tokens.end(), v) != tokens.end()) continue;
    for (int64_t j = 0; j < C; ++j) ASSERT_EQ(ToDouble(g[v * C + j]), 0.0) << "wte row " << v;
  }
  for (int64_t i = (int64_t{s.vocab_size} + c.T) * C; i < static_cast<int64_t>(g.size()); ++i) {
    ASSERT_EQ(ToDouble(g[i]), 0.0) << "wpe element " << i;
  }
}

TYPED_TEST(GptBlockTest, EmbeddingMatchesDoubleWithinOneRounding) {
  CheckEmbedding<TypeParam>(kOddCase);
  CheckEmbedding<TypeParam>(kSingleTokenCase);
}

// k of each layer output: the roundings to S on its path, no margin (the layer's data keep the
// gains near one). Forward y: ln1, qkv, P, att, x2, ln2, h/g, y = 8. Backward, in the order
// the gradients are formed (the recomputed forward's roundings included where the tensor
// depends on them): dmlp_proj_b = S(colsum dy) 1; dmlp_proj_w = S(g^T dy) 8; dh 9 (dfc_b,
// dfc_w); dln2 10 (dln2_w, dln2_b); dx2 11 (dattn_proj_b, dattn_proj_w); datt 12, dS 13,
// dqkv 14 (dqkv_b, dqkv_w); dln1 15 (dln1_w, dln1_b); dx 16.
constexpr double kLayerForwardK = 8;
constexpr double kLayerDxK = 16;
double LayerGradK(const std::string& name) {
  if (name == "mlp_proj_b") return 1;
  if (name == "mlp_proj_w") return 8;
  if (name == "mlp_fc_b" || name == "mlp_fc_w") return 9;
  if (name == "ln2_w" || name == "ln2_b") return 10;
  if (name == "attn_proj_b" || name == "attn_proj_w") return 11;
  if (name == "attn_qkv_b" || name == "attn_qkv_w") return 14;
  return 15;  // ln1_w, ln1_b
}

template <typename S>
void CheckLayer(const Case& c) {
  const GptShape& s = c.shape;
  const int64_t N = int64_t{c.B} * c.T, C = s.channels;
  const Model<double> m = RandomModel(s, 51);
  const BlockData<S> d = MakeBlockData<S>(m.blocks[1], N * C, N * C, 52);
  // Longest fp32 sum: a weight gradient over N rows, or the fc projection over 4C.
  const double eps = kUnitRoundoff<S> + std::max<int64_t>(N, 4 * C) * 0x1p-24;

  GuardedScratch scratch(GptLayerScratchBytes<S>(s, c.B, c.T));
  GuardedScratch scratch_d(GptLayerScratchBytes<double>(s, c.B, c.T));
  std::vector<S> y = PoisonedVector<S>(N * C);
  std::vector<double> y_ref(N * C);
  GptLayerForward<S>(s, d.params.data(), d.x.data(), y.data(), c.B, c.T, scratch.Poisoned());
  scratch.CheckGuard("GptLayerForward");
  GptLayerForward<double>(s, d.params_d.data(), d.x_d.data(), y_ref.data(), c.B, c.T,
                          scratch_d.Poisoned());
  ExpectWithinBound("layer y", ToDoubles(y), y_ref, kLayerForwardK, eps);

  std::vector<S> dx = PoisonedVector<S>(N * C), g = PoisonedVector<S>(d.params.size());
  std::vector<double> dx_ref(N * C), g_ref(d.params.size());
  GptLayerBackward<S>(s, d.params.data(), d.x.data(), d.dy.data(), dx.data(), g.data(), c.B, c.T,
                      scratch.Poisoned());
  scratch.CheckGuard("GptLayerBackward");
  GptLayerBackward<double>(s, d.params_d.data(), d.x_d.data(), d.dy_d.data(), dx_ref.data(),
                           g_ref.data(), c.B, c.T, scratch_d.Poisoned());
  ExpectWithinBound("layer dx", ToDoubles(dx), dx_ref, kLayerDxK, eps);
  const std::vector<double> gd = ToDoubles(g);
  for (const TensorInfo& t : LayerTensors(s)) {
    ExpectWithinBound("layer d" + t.name, Slice(gd, t), Slice(g_ref, t), LayerGradK(t.name), eps);
  }
}

TYPED_TEST(GptBlockTest, LayerMatchesDoubleWithinTheRoundingsOnEachPath) {
  CheckLayer<TypeParam>(kOddCase);
  CheckLayer<TypeParam>(kSingleTokenCase);
}

// Head: lnf, logits (2 roundings: k = 4 with the margin) — the last-position logits (B, V)
// and, through the chunks' logits, the loss (the logits' error, k = 4, scaled by |loss| + rms);
// backward dlogits, dWlm (fp32 accumulation over the chunks, one rounding), dlnf, dx (+ the
// forward's 2: 6 roundings, k = 12). chunk_rows 0: the default HeadChunkRows(N, V).
struct HeadResult {
  double loss = 0;
  std::vector<double> logits, dx, grads;
};

template <typename S>
HeadResult RunHead(const Case& c, const BlockData<S>& d, const std::vector<int32_t>& targets,
                   int64_t chunk_rows) {
  const GptShape& s = c.shape;
  const int64_t N = int64_t{c.B} * c.T, C = s.channels, V = s.vocab_size;
  if (chunk_rows == 0) chunk_rows = HeadChunkRows(N, V);
  GuardedScratch scratch(internal::GptHeadScratchBytesWithChunkRows<S>(s, c.B, c.T, chunk_rows));
  std::vector<S> logits = PoisonedVector<S>(int64_t{c.B} * V);
  HeadResult r;
  r.loss =
      internal::GptHeadForwardWithChunkRows<S>(s, d.params.data(), d.x.data(), targets.data(), c.B,
                                               c.T, logits.data(), scratch.Poisoned(), chunk_rows);
  scratch.CheckGuard("GptHeadForward");
  std::vector<S> dx = PoisonedVector<S>(N * C), g = PoisonedVector<S>(d.params.size());
  internal::GptHeadBackwardWithChunkRows<S>(s, d.params.data(), d.x.data(), targets.data(),
                                            ComputeType<S>(1), c.B, c.T, dx.data(), g.data(),
                                            scratch.Poisoned(), chunk_rows);
  scratch.CheckGuard("GptHeadBackward");
  r.logits = ToDoubles(logits);
  r.dx = ToDoubles(dx);
  r.grads = ToDoubles(g);
  return r;
}

template <typename S>
void CheckHead(const Case& c, int64_t chunk_rows = 0) {
  const GptShape& s = c.shape;
  const int64_t N = int64_t{c.B} * c.T, V = s.vocab_size;
  const Model<double> m = RandomModel(s, 61);
  const BlockData<S> d = MakeBlockData<S>(m.blocks.back(), N * s.channels, 0, 62);
  const BlockData<double> dd{d.params_d, d.x_d, {}, d.params_d, d.x_d, {}};
  const std::vector<int32_t> targets = RandomTokens(c.B * c.T, s.vocab_size, 63);
  const double eps = kUnitRoundoff<S> + std::max<int64_t>(N, V) * 0x1p-24;
  const std::string what = "head (chunk rows " + std::to_string(chunk_rows) + ") ";

  const HeadResult got = RunHead<S>(c, d, targets, chunk_rows);
  const HeadResult ref = RunHead<double>(c, dd, targets, 0);
  ExpectWithinBound(what + "last-position logits", got.logits, ref.logits, 4, eps);
  ExpectWithinBound(what + "loss", {got.loss}, {ref.loss}, 4, eps);
  ExpectWithinBound(what + "dx", got.dx, ref.dx, 12, eps);
  for (const TensorInfo& t : HeadTensors(s)) {
    ExpectWithinBound(what + "d" + t.name, Slice(got.grads, t), Slice(ref.grads, t), 12, eps);
  }
}

TYPED_TEST(GptBlockTest, HeadMatchesDoubleWithinTheRoundingsOnEachPath) {
  CheckHead<TypeParam>(kOddCase);
  CheckHead<TypeParam>(kSingleTokenCase);
  // Several chunks: one row each, an odd chunk with a remainder (210 = 2 x 97 + 16), and the
  // last chunk a single row (210 = 11 x 19 + 1).
  for (int64_t rows : {1, 97, 19}) CheckHead<TypeParam>(kOddCase, rows);
}

TEST(GptKernels, HeadChunkRowsIsTheLargestWithinTheChunkBudget) {
  EXPECT_EQ(kHeadChunkElems, int64_t{1} << 22);
  EXPECT_EQ(HeadChunkRows(8192, 50257), (int64_t{1} << 22) / 50257);  // 83 rows
  EXPECT_EQ(HeadChunkRows(8192, 256), 8192);                          // (N, V) fits: one chunk
  EXPECT_EQ(HeadChunkRows(10, 256), 10);
  EXPECT_EQ(HeadChunkRows(8192, int64_t{1} << 23), 1);  // at least one row
  EXPECT_EQ(HeadChunkRows(1, 1), 1);
  for (int64_t V : {67, 256, 50257, 151936}) {
    const int64_t r = HeadChunkRows(1 << 20, V);
    EXPECT_LE(r * V, kHeadChunkElems) << V;
    EXPECT_GT((r + 1) * V, kHeadChunkElems) << V;
  }
}

// Chunking changes only summation groupings: the loss and dx rows are computed row by row
// (equal up to the products' blocking), dWlm sums the same N terms per element in fp32 in
// other groups before its one rounding. So chunked and one-chunk results agree within one
// rounding of S plus an fp32 sum over N (k = 2), and every chunking repeats bit for bit.
template <typename S>
void ExpectChunkedMatchesOneChunkAndRepeatsBitIdentically() {
  const Case c = kOddCase;
  const GptShape& s = c.shape;
  const int64_t N = int64_t{c.B} * c.T;
  const Model<double> m = RandomModel(s, 65);
  const BlockData<S> d = MakeBlockData<S>(m.blocks.back(), N * s.channels, 0, 66);
  const std::vector<int32_t> targets = RandomTokens(c.B * c.T, s.vocab_size, 67);
  const double eps = kUnitRoundoff<S> + N * 0x1p-24;
  const HeadResult one = RunHead<S>(c, d, targets, N);
  for (int64_t rows : {1, 19, 97}) {
    const std::string what = "chunk rows " + std::to_string(rows) + " ";
    const HeadResult chunked = RunHead<S>(c, d, targets, rows);
    EXPECT_EQ(chunked.logits, one.logits) << what << "last-position logits (their own product)";
    ExpectWithinBound(what + "loss", {chunked.loss}, {one.loss}, 2, eps);
    ExpectWithinBound(what + "dx", chunked.dx, one.dx, 2, eps);
    ExpectWithinBound(what + "grads", chunked.grads, one.grads, 2, eps);
    const HeadResult again = RunHead<S>(c, d, targets, rows);
    EXPECT_EQ(std::memcmp(&again.loss, &chunked.loss, sizeof(double)), 0) << what;
    EXPECT_EQ(again.dx, chunked.dx) << what;
    EXPECT_EQ(again.grads, chunked.grads) << what;
  }
}

TYPED_TEST(GptBlockTest, HeadChunkedMatchesOneChunkWithinRoundingAndRepeatsBitIdentically) {
  ExpectChunkedMatchesOneChunkAndRepeatsBitIdentically<TypeParam>();
}

// The whole model in bf16 (embedding -> 2 layers -> head and back) against double on the
// same rounded parameters. Every gradient passes through the head's backward and each layer's
// backward after it: roundings on the longest path (dx0): head 6 + 2 layers x 16 + the
// embedding 1 = 39, k = 2 * 39 = 78; for the logits and loss, the forward path
// 1 + 2 x 8 + 2 = 19, k = 38.
// Issue 26, item 4, on the host: gpt_cuda_test's fp16 head in several chunks (V = 50257, C = 48,
// B 2 x T 64, chunks of 83 rows), whose lnf_w[8] the GPU run had 1.6e-5 from the host's. The host
// run itself is that far from double there: lnf_w[c] sums dlnf xhat over the 128 rows, terms of
// about 1e-3 that cancel to a few 1e-4, so k u (|ref| + rms) + 1e-6 (64 u, the CUDA test's bound
// against double) does not hold for it (checked: it fails), and the bound with the magnitude of
// the cancelling terms (test_model::HeadParamTerms, terms_bound.h) does.
TEST(GptKernels, Fp16HeadInSeveralChunksIsWithinItsTermsBoundOfDouble) {
  using S = Fp16;
  const double u = 0x1p-11;
  const GptShape s{50257, 64, 1, 4, 48};
  const int B = 2, T = 64;
  const int64_t N = int64_t{B} * T, C = s.channels, PH = HeadNumParams(s);
  ASSERT_EQ(HeadChunkRows(N, s.vocab_size), 83);
  std::mt19937_64 rng(17);
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<double> phd(PH), xd(N * C);
  for (double& v : phd) v = 0.2 * d(rng);
  for (double& v : xd) v = d(rng);
  const std::vector<S> ph = CastVector<S>(phd), x = CastVector<S>(xd);
  const std::vector<double> phw = test_model::ToDoubles(ph), xw = test_model::ToDoubles(x);
  std::uniform_int_distribution<int32_t> tok(0, s.vocab_size - 1);
  std::vector<int32_t> targets(N);
  for (int32_t& t : targets) t = tok(rng);
  std::vector<S> dx(N * C), dp(PH);
  std::vector<uint8_t> sc(GptHeadScratchBytes<S>(s, B, T));
  GptHeadBackward<S>(s, ph.data(), x.data(), targets.data(), 1.0f, B, T, dx.data(), dp.data(),
                     sc.data());
  std::vector<double> dx_ref(N * C), dp_ref(PH);
  std::vector<uint8_t> scd(GptHeadScratchBytes<double>(s, B, T));
  GptHeadBackward<double>(s, phw.data(), xw.data(), targets.data(), 1.0, B, T, dx_ref.data(),
                          dp_ref.data(), scd.data());
  const std::vector<double> got = test_model::ToDoubles(dp);
  std::vector<double> terms = test_model::HeadParamTerms(s, phw, xw, targets, N);
  for (double& t : terms) t += 1e-6 / (64 * u);  // the CUDA test's 1e-6 floor
  // Without the terms: the lnf_w elements whose sum cancels are past the bound.
  const double rms = terms_bound::Rms(dp_ref);
  int past = 0;
  for (int64_t c = 0; c < C; ++c) {
    past += std::abs(got[c] - dp_ref[c]) > 64 * u * (std::abs(dp_ref[c]) + rms) + 1e-6;
  }
  EXPECT_GT(past, 0) << "no lnf_w element past k u (|ref| + rms): the case lost its cancellation";
  terms_bound::ExpectWithinTermsBound("fp16 head dparams vs double", got, dp_ref, terms, 64, u);
}

TEST(GptKernels, Bf16WholeModelGradientsMatchDoubleWithinTheRoundingsOnTheirPath) {
  const Case c{{67, 80, 2, 4, 48}, 3, 70};
  const Model<double> md = RandomModel(c.shape, 71);
  const Model<Bf16> mb = CastModel<Bf16>(md);
  const Model<double> mr = RoundedModel<Bf16>(md);
  const std::vector<int32_t> tokens = RandomTokens(c.B * c.T, c.shape.vocab_size, 72);
  const std::vector<int32_t> targets = RandomTokens(c.B * c.T, c.shape.vocab_size, 73);
  Runner<double> rd(c.shape, c.B, c.T);
  Runner<Bf16> rb(c.shape, c.B, c.T);
  std::vector<std::vector<double>> gd;
  std::vector<std::vector<Bf16>> gb;
  std::vector<double> dxd;
  std::vector<Bf16> dxb;
  const double loss_d = rd.Backward(mr, tokens, targets, &gd, &dxd);
  const double loss_b = rb.Backward(mb, tokens, targets, &gb, &dxb);
  const double eps = 0x1p-8 + 4 * c.shape.channels * 0x1p-24;
  ExpectWithinBound("loss", {loss_b}, {loss_d}, 38, eps);
  for (size_t b = 0; b < gd.size(); ++b) {
    const std::vector<double> g = ToDoubles(gb[b]);
    for (const TensorInfo& t : BlockTensors(c.shape, b)) {
      ExpectWithinBound(BlockName(c.shape, b) + ".d" + t.name, Slice(g, t), Slice(gd[b], t), 78,
                        eps);
    }
  }
  ExpectWithinBound("d(embedding output)", ToDoubles(dxb), dxd, 78, eps);
}

}  // namespace
}  // namespace strata::models
