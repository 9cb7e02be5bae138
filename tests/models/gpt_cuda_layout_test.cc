// The CUDA layer's host-callable layout (models/cuda/gpt_cuda_layout.h), checked without a
// GPU: the scratch regions tile CudaLayerScratchElems exactly and cover the host's figure;
// every buffer of a group fits the work area, and buffers that are alive at the same time
// do not overlap, for shapes up to gpt-13b; and the attention's strided-batched GEMMs, run
// through a row-major GEMM emulation (with cuBLAS' argument rules checked and every access
// bounds-checked against the documented buffer sizes), reproduce a naive causal multi-head
// attention forward and backward in double.
#include "models/cuda/gpt_cuda_layout.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "models/gpt_kernels.h"

namespace strata::models::cuda {
namespace {

// ---------------------------------------------------------------------------
// Scratch layout.

struct NamedShape {
  const char* name;
  GptShape shape;
};
const NamedShape kShapes[] = {
    {"odd", {256, 128, 2, 3, 48}},
    {"gpt2-124m", {256, 1024, 12, 12, 768}},
    {"gpt2-1.5b", {256, 1024, 48, 25, 1600}},
    {"gpt-13b", {256, 2048, 40, 40, 5120}},
};

bool Disjoint(const Region& a, const Region& b) {
  return a.end() <= b.offset || b.end() <= a.offset;
}

// Pairs of work-area buffers that gpt_cuda.cu keeps alive at the same time (one is read
// while the other is written, or both are read later), so they must not overlap.
std::vector<std::pair<const char*, std::pair<Region, Region>>> LiveTogether(
    const CudaLayerWorkLayout& w) {
  return {
      {"fc product reads ln2, writes fch", {w.ln2, w.fch}},
      {"GELU reads fch, writes gelu", {w.fch, w.gelu}},
      {"GELU backward reads fch, writes dfch", {w.fch, w.dfch}},
      {"fc_w gradient reads ln2 (recomputed) and dfch", {w.ln2_again, w.dfch}},
      {"dln2 product reads dfch", {w.dln2, w.dfch}},
      {"attention backward reads datty, writes dqkv", {w.datty, w.dqkv}},
      {"attention backward reads datty, writes dprobs", {w.datty, w.dprobs}},
      {"softmax backward reads dprobs; dqkv is alive", {w.dqkv, w.dprobs}},
      {"qkv_w gradient reads ln1 (recomputed) and dqkv", {w.ln1_again, w.dqkv}},
      {"dln1 product reads dqkv", {w.dln1, w.dqkv}},
      {"LayerNorm 1 gradients read dln1 after ln1 was used", {w.ln1_again, w.dln1}},
  };
}

TEST(GptCudaLayout, ScratchRegionsTileTheScratchAndCoverTheHostFigure) {
  for (const NamedShape& ns : kShapes) {
    const GptShape& s = ns.shape;
    for (int B : {1, 2, 3, 5, 40, 64}) {
      for (int T : {1, 7, 64, 67, 256, 1024, 2048}) {
        if (T > s.max_seq_len) continue;
        SCOPED_TRACE(std::string(ns.name) + " B=" + std::to_string(B) + " T=" + std::to_string(T));
        const CudaLayerScratchLayout l = CudaLayerScratchLayoutFor(s, B, T);
        const int64_t G = l.group_seqs, R = G * T, C = s.channels;
        EXPECT_EQ(G, std::min<int64_t>(B, (256 + T - 1) / T));
        const Region order[] = {l.mean1, l.rstd1, l.mean2, l.rstd2, l.qkv, l.probs, l.work};
        EXPECT_EQ(order[0].offset, 0);
        for (size_t i = 1; i < std::size(order); ++i)
          EXPECT_EQ(order[i].offset, order[i - 1].end());
        EXPECT_EQ(l.mean1.elems, R);
        EXPECT_EQ(l.qkv.elems, 3 * R * C);
        EXPECT_EQ(l.probs.elems, G * s.num_heads * int64_t{T} * T);
        EXPECT_EQ(l.total(), CudaLayerScratchElems(s, B, T));
      }
    }
  }
}

TEST(GptCudaLayout, EveryGroupBufferFitsTheWorkAreaAndLiveBuffersDoNotOverlap) {
  for (const NamedShape& ns : kShapes) {
    const GptShape& s = ns.shape;
    for (int B : {1, 3, 5, 40, 64}) {
      for (int T : {1, 7, 64, 67, 1024, 2048}) {
        if (T > s.max_seq_len) continue;
        const CudaLayerScratchLayout l = CudaLayerScratchLayoutFor(s, B, T);
        const int64_t G = l.group_seqs;
        // A full group and the last (possibly partial) group of the micro-batch.
        for (int64_t seqs : {G, B - (B - 1) / G * G}) {
          SCOPED_TRACE(std::string(ns.name) + " B=" + std::to_string(B) +
                       " T=" + std::to_string(T) + " seqs=" + std::to_string(seqs));
          const CudaLayerWorkLayout w = CudaLayerWorkLayoutFor(s, seqs, T);
          const Region all[] = {w.ln1,  w.atty,      w.fch,       w.ln2,        w.gelu,
                                w.dfch, w.ln2_again, w.dln2,      w.atty_again, w.datty,
                                w.dqkv, w.dprobs,    w.ln1_again, w.dln1};
          for (const Region& r : all) {
            EXPECT_GE(r.offset, 0);
            EXPECT_GT(r.elems, 0);
            EXPECT_LE(r.end(), l.work.elems);
          }
          for (const auto& [why, pair] : LiveTogether(w)) {
            EXPECT_TRUE(Disjoint(pair.first, pair.second)) << why;
          }
          // In place by design: dfch replaces gelu (dead after the mlp_proj_w gradient).
          EXPECT_EQ(w.dfch.offset, w.gelu.offset);
        }
      }
    }
  }
}

// The figure a user of gpt-13b pays per layer scratch, pinned so a change shows up here:
// G = 1 sequence of 2048 tokens, 40 heads: 4 R + 3 R C + H T^2 + (5 R C + H T^2) elements.
TEST(GptCudaLayout, Gpt13bLayerScratchIsOnePointFiveSixGiB) {
  const GptShape s{256, 2048, 40, 40, 5120};
  const int64_t R = 2048, C = 5120, probs = int64_t{40} * 2048 * 2048;
  EXPECT_EQ(CudaLayerScratchElems(s, 64, 2048), 4 * R + 3 * R * C + probs + 5 * R * C + probs);
  EXPECT_EQ(CudaLayerScratchElems(s, 64, 2048) * 4, int64_t{1677754368});
}

// ---------------------------------------------------------------------------
// Attention GEMMs.

using Buffers = std::vector<std::vector<double>>;  // indexed by AttnBuffer

// gpu::cuda::GemmStridedBatched's row-major contract, in double: for i in [0, batch),
// C_i = alpha op(A_i) op(B_i), beta = 0 (C not read). The argument rules that
// gpu/cuda/cuda_gemm.cc enforces (and cuBLAS needs) are EXPECTed; accesses outside a
// buffer throw.
void EmulateGemm(const AttnGemm& g, Buffers& buf) {
  EXPECT_NE(g.c.buffer, g.a.buffer) << "C must not alias A";
  EXPECT_NE(g.c.buffer, g.b.buffer) << "C must not alias B";
  EXPECT_GE(g.a.ld, std::max<int64_t>(1, g.trans_a ? g.M : g.K)) << "lda";
  EXPECT_GE(g.b.ld, std::max<int64_t>(1, g.trans_b ? g.K : g.N)) << "ldb";
  EXPECT_GE(g.c.ld, std::max<int64_t>(1, g.N)) << "ldc";
  if (g.batch > 1) {
    EXPECT_GE(g.c.stride, g.M * g.c.ld) << "batch outputs overlap";
  }
  const std::vector<double>& A = buf[static_cast<int>(g.a.buffer)];
  const std::vector<double>& B = buf[static_cast<int>(g.b.buffer)];
  std::vector<double>& Cm = buf[static_cast<int>(g.c.buffer)];
  for (int64_t n = 0; n < g.batch; ++n) {
    for (int64_t i = 0; i < g.M; ++i) {
      for (int64_t j = 0; j < g.N; ++j) {
        double dot = 0;
        for (int64_t k = 0; k < g.K; ++k) {
          const int64_t ai =
              g.a.offset + n * g.a.stride + (g.trans_a ? k * g.a.ld + i : i * g.a.ld + k);
          const int64_t bi =
              g.b.offset + n * g.b.stride + (g.trans_b ? j * g.b.ld + k : k * g.b.ld + j);
          dot += A.at(ai) * B.at(bi);
        }
        Cm.at(g.c.offset + n * g.c.stride + i * g.c.ld + j) = static_cast<double>(g.alpha) * dot;
      }
    }
  }
}

// The contracts of LaunchCausalSoftmaxForward/Backward (checked on a GPU in
// gpt_cuda_test.cc), in double, on num_mats (T, T) matrices.
void CausalSoftmax(std::vector<double>& p, int64_t num_mats, int64_t T) {
  for (int64_t r = 0; r < num_mats * T; ++r) {
    const int64_t t = r % T;
    double* row = p.data() + r * T;
    double mx = row[0], sum = 0;
    for (int64_t s = 0; s <= t; ++s) mx = std::max(mx, row[s]);
    for (int64_t s = 0; s <= t; ++s) sum += std::exp(row[s] - mx);
    for (int64_t s = 0; s < T; ++s) row[s] = s <= t ? std::exp(row[s] - mx) / sum : 0.0;
  }
}

void CausalSoftmaxBackward(std::vector<double>& p, const std::vector<double>& dp, int64_t num_mats,
                           int64_t T) {
  for (int64_t r = 0; r < num_mats * T; ++r) {
    const int64_t t = r % T;
    double* row = p.data() + r * T;
    const double* drow = dp.data() + r * T;
    double dot = 0;
    for (int64_t s = 0; s <= t; ++s) dot += row[s] * drow[s];
    for (int64_t s = 0; s < T; ++s) row[s] = s <= t ? row[s] * (drow[s] - dot) : 0.0;
  }
}

std::vector<double> Random(size_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-1.5, 1.5);
  std::vector<double> v(n);
  for (double& x : v) x = u(gen);
  return v;
}

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int shown = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= 1e-12 * (1 + std::abs(want[i]))) && shown++ < 5) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", naive attention gives "
                    << want[i];
    }
  }
}

// Naive causal multi-head attention (Vaswani et al. 2017) on qkv (seqs, T, 3C) in the
// host's layout, forward y and, from dy, the backward dqkv.
struct NaiveAttention {
  std::vector<double> y, dqkv;
};
NaiveAttention Naive(const AttnShape& d, const std::vector<double>& qkv,
                     const std::vector<double>& dy) {
  const int64_t T = d.T, C = d.C, hs = d.hs();
  const double scale = d.scale();
  NaiveAttention out{std::vector<double>(d.seqs * T * C, 0.0),
                     std::vector<double>(d.seqs * T * 3 * C, 0.0)};
  auto q = [&](int64_t b, int64_t t, int64_t h, int64_t e) {
    return qkv[(b * T + t) * 3 * C + h * hs + e];
  };
  auto k = [&](int64_t b, int64_t t, int64_t h, int64_t e) {
    return qkv[(b * T + t) * 3 * C + C + h * hs + e];
  };
  auto v = [&](int64_t b, int64_t t, int64_t h, int64_t e) {
    return qkv[(b * T + t) * 3 * C + 2 * C + h * hs + e];
  };
  for (int64_t b = 0; b < d.seqs; ++b) {
    for (int64_t h = 0; h < d.H; ++h) {
      std::vector<double> P(T * T, 0.0), dS(T * T, 0.0);
      for (int64_t t = 0; t < T; ++t) {
        double mx = -std::numeric_limits<double>::infinity(), sum = 0;
        std::vector<double> sc(t + 1);
        for (int64_t s = 0; s <= t; ++s) {
          double dot = 0;
          for (int64_t e = 0; e < hs; ++e) dot += q(b, t, h, e) * k(b, s, h, e);
          sc[s] = scale * dot;
          mx = std::max(mx, sc[s]);
        }
        for (int64_t s = 0; s <= t; ++s) sum += std::exp(sc[s] - mx);
        for (int64_t s = 0; s <= t; ++s) P[t * T + s] = std::exp(sc[s] - mx) / sum;
        for (int64_t e = 0; e < hs; ++e) {
          double acc = 0;
          for (int64_t s = 0; s <= t; ++s) acc += P[t * T + s] * v(b, s, h, e);
          out.y[(b * T + t) * C + h * hs + e] = acc;
        }
        // dP = dy v^T, dS = P (dP - sum P dP).
        std::vector<double> dP(t + 1);
        double dot = 0;
        for (int64_t s = 0; s <= t; ++s) {
          double acc = 0;
          for (int64_t e = 0; e < hs; ++e) acc += dy[(b * T + t) * C + h * hs + e] * v(b, s, h, e);
          dP[s] = acc;
          dot += P[t * T + s] * acc;
        }
        for (int64_t s = 0; s <= t; ++s) dS[t * T + s] = P[t * T + s] * (dP[s] - dot);
      }
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t e = 0; e < hs; ++e) {
          double dq = 0, dk = 0, dv = 0;
          for (int64_t s = 0; s <= t; ++s) dq += dS[t * T + s] * k(b, s, h, e);
          for (int64_t u = t; u < T; ++u) {  // t as a key: queries u >= t
            dk += dS[u * T + t] * q(b, u, h, e);
            dv += P[u * T + t] * dy[(b * T + u) * C + h * hs + e];
          }
          double* row = out.dqkv.data() + (b * T + t) * 3 * C + h * hs + e;
          row[0] = scale * dq;
          row[C] = scale * dk;
          row[2 * C] = dv;
        }
      }
    }
  }
  return out;
}

TEST(GptCudaLayout, AttentionGemmsReproduceNaiveCausalAttentionForwardAndBackward) {
  const AttnShape shapes[] = {
      {2, 5, 12, 3}, {1, 1, 8, 2}, {3, 7, 8, 1}, {2, 4, 6, 6}, {2, 9, 20, 4}};
  const double nan = std::numeric_limits<double>::quiet_NaN();
  uint64_t seed = 1;
  for (const AttnShape& d : shapes) {
    SCOPED_TRACE("seqs=" + std::to_string(d.seqs) + " T=" + std::to_string(d.T) +
                 " C=" + std::to_string(d.C) + " H=" + std::to_string(d.H));
    const int64_t rows = d.seqs * d.T, mats = d.seqs * d.H;
    const std::vector<double> qkv = Random(rows * 3 * d.C, seed++);
    const std::vector<double> dy = Random(rows * d.C, seed++);
    const NaiveAttention want = Naive(d, qkv, dy);

    // The buffers at exactly their documented sizes, outputs poisoned with NaN so that an
    // element no GEMM writes shows up.
    Buffers buf(kNumAttnBuffers);
    buf[static_cast<int>(AttnBuffer::kQkv)] = qkv;
    buf[static_cast<int>(AttnBuffer::kProbs)].assign(mats * d.T * d.T, nan);
    buf[static_cast<int>(AttnBuffer::kOut)].assign(rows * d.C, nan);
    buf[static_cast<int>(AttnBuffer::kDqkv)].assign(rows * 3 * d.C, nan);
    buf[static_cast<int>(AttnBuffer::kDprobs)].assign(mats * d.T * d.T, nan);
    std::vector<double>& probs = buf[static_cast<int>(AttnBuffer::kProbs)];

    // Forward, in gpt_cuda.cu's order.
    ASSERT_NO_THROW({
      for (int64_t h = 0; h < d.H; ++h) EmulateGemm(AttnScoresGemm(d, h), buf);
      CausalSoftmax(probs, mats, d.T);
      for (int64_t h = 0; h < d.H; ++h) EmulateGemm(AttnValuesGemm(d, h), buf);
    });
    ExpectNear(buf[static_cast<int>(AttnBuffer::kOut)], want.y, "y");

    // Backward: out now holds dy.
    buf[static_cast<int>(AttnBuffer::kOut)] = dy;
    ASSERT_NO_THROW({
      for (int64_t h = 0; h < d.H; ++h) {
        EmulateGemm(AttnGradValuesGemm(d, h), buf);
        EmulateGemm(AttnGradProbsGemm(d, h), buf);
      }
      CausalSoftmaxBackward(probs, buf[static_cast<int>(AttnBuffer::kDprobs)], mats, d.T);
      for (int64_t h = 0; h < d.H; ++h) {
        EmulateGemm(AttnGradQueriesGemm(d, h), buf);
        EmulateGemm(AttnGradKeysGemm(d, h), buf);
      }
    });
    ExpectNear(buf[static_cast<int>(AttnBuffer::kDqkv)], want.dqkv, "dqkv");
  }
}

// The scale is the host's fp32 1/sqrt(hs).
TEST(GptCudaLayout, AttentionScaleIsTheHostsFp32Value) {
  EXPECT_EQ(AttnShape({1, 1, 64, 4}).scale(), 0.25f);
  EXPECT_EQ(AttnShape({1, 1, 5120, 40}).scale(), 1.0f / std::sqrt(128.0f));
}

}  // namespace
}  // namespace strata::models::cuda
