// The CUDA blocks' host-callable layout (models/cuda/gpt_cuda_layout.h) and the row-major ->
// cuBLASLt argument mapping (gpu/cuda/cuda_lt_mapping.h), checked without a GPU: every scratch
// region is aligned and inside the scratch, buffers that are live at the same time do not
// overlap, the scratch grows linearly in T (no T x T buffer), for float, Bf16 and Fp16 and
// shapes up to gpt-13b; and the products the blocks ask for, run through an emulation of
// cuBLASLt's documented column-major semantics (epilogues included), equal the row-major
// products computed naively.
#include "models/cuda/gpt_cuda_layout.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "gpu/cuda/cuda_lt_mapping.h"
#include "models/gpt_kernels.h"

namespace strata::models::cuda {
namespace {

struct NamedShape {
  const char* name;
  GptShape shape;
};
const NamedShape kShapes[] = {
    {"tiny", {256, 64, 2, 4, 32}},
    {"odd", {256, 128, 2, 3, 48}},
    {"gpt2-124m", {50257, 1024, 12, 12, 768}},
    {"gpt2-1.5b", {50257, 1024, 48, 25, 1600}},
    {"gpt-13b", {50257, 2048, 40, 40, 5120}},
};
struct BT {
  int B, T;
};
const BT kBatches[] = {{1, 1}, {1, 7}, {2, 67}, {4, 64}, {8, 1024}};

bool Disjoint(const Region& a, const Region& b) {
  return a.bytes == 0 || b.bytes == 0 || a.end() <= b.offset || b.end() <= a.offset;
}

void ExpectPlaced(const std::vector<NamedRegion>& regions, int64_t total, const std::string& what) {
  for (const NamedRegion& r : regions) {
    EXPECT_EQ(r.region.offset % kScratchAlign, 0) << what << " " << r.name;
    EXPECT_GE(r.region.bytes, 0) << what << " " << r.name;
    EXPECT_LE(r.region.end(), total) << what << " " << r.name;
  }
}

template <typename S>
void CheckLayouts(const GptShape& s, int B, int T, const std::string& what) {
  const int64_t N = int64_t{B} * T, C = s.channels, e = sizeof(S);
  const GptLayerScratchLayout l = GptLayerScratchLayoutFor<S>(s, B, T);
  EXPECT_EQ(l.total, GptCudaLayerScratchBytes<S>(s, B, T));
  for (const auto& [phase, live] : GptLayerLivePhases<S>(s, B, T)) {
    ExpectPlaced(live, l.total, what + " layer " + phase);
    for (size_t i = 0; i < live.size(); ++i) {
      for (size_t j = i + 1; j < live.size(); ++j) {
        EXPECT_TRUE(Disjoint(live[i].region, live[j].region))
            << what << " layer " << phase << ": " << live[i].name << " overlaps " << live[j].name;
      }
    }
  }
  // The sizes the kernels rely on.
  EXPECT_EQ(l.qkv.bytes, 3 * N * C * e);
  EXPECT_GE(l.h.bytes, 3 * N * C * e) << "dqkv lives over h";
  EXPECT_EQ(l.g.bytes, 4 * N * C * e);
  EXPECT_EQ(l.lse.bytes, int64_t{B} * s.num_heads * T * 4);
  EXPECT_GE(l.ln_partials.bytes, LnPartials(N) * 4 * C * 4) << "bias-gradient partials of 4C";

  const GptCudaHeadScratchLayout hl = GptCudaHeadScratchLayoutFor<S>(s, B, T);
  EXPECT_EQ(hl.total, GptCudaHeadScratchBytes<S>(s, B, T));
  const std::vector<NamedRegion> head = {{"mean", hl.mean},         {"rstd", hl.rstd},
                                         {"losses", hl.losses},     {"ln_partials", hl.ln_partials},
                                         {"lnf", hl.lnf},           {"dlnf", hl.dlnf},
                                         {"lnf_last", hl.lnf_last}, {"chunk", hl.chunk},
                                         {"dwlm_acc", hl.dwlm_acc}};
  ExpectPlaced(head, hl.total, what + " head");
  for (size_t i = 0; i < head.size(); ++i) {
    for (size_t j = i + 1; j < head.size(); ++j) {
      EXPECT_TRUE(Disjoint(head[i].region, head[j].region))
          << what << " head: " << head[i].name << " overlaps " << head[j].name;
    }
  }
  EXPECT_GE(hl.ln_partials.bytes, LnPartials(N) * 2 * C * 4);
  // No (N, V) logits: a chunk of HeadChunkRows(N, V) rows, and the fp32 (C, V) dWlm
  // accumulator for 16-bit storage only (fp32 accumulates in the gradient itself).
  const int64_t V = s.vocab_size;
  EXPECT_EQ(hl.chunk_rows, HeadChunkRows(N, V));
  EXPECT_EQ(hl.chunk.bytes, hl.chunk_rows * V * e);
  EXPECT_LE(hl.chunk_rows * V, std::max<int64_t>(kHeadChunkElems, V));
  EXPECT_EQ(hl.lnf_last.bytes, int64_t{B} * C * e);
  EXPECT_EQ(hl.dwlm_acc.bytes, e == 4 ? 0 : C * V * 4);

  const CudaEmbeddingScratchLayout el = CudaEmbeddingScratchLayoutFor(s, B, T);
  EXPECT_EQ(el.total, GptCudaEmbeddingScratchBytes<S>(s, B, T));
  // Both counting sorts (by token; by position, for packed sequences) are live together.
  const std::vector<NamedRegion> emb = {
      {"counts", el.counts},         {"offsets", el.offsets},       {"cursor", el.cursor},
      {"order", el.order},           {"pos_counts", el.pos_counts}, {"pos_offsets", el.pos_offsets},
      {"pos_cursor", el.pos_cursor}, {"pos_order", el.pos_order}};
  ExpectPlaced(emb, el.total, what + " embedding");
  for (size_t i = 0; i < emb.size(); ++i) {
    for (size_t j = i + 1; j < emb.size(); ++j) {
      EXPECT_TRUE(Disjoint(emb[i].region, emb[j].region)) << what << " embedding";
    }
  }
  EXPECT_EQ(el.offsets.bytes, (int64_t{s.vocab_size} + 1) * 4);
  EXPECT_EQ(el.order.bytes, N * 4);
  EXPECT_EQ(el.pos_counts.bytes, int64_t{T} * 4);
  EXPECT_EQ(el.pos_offsets.bytes, (int64_t{T} + 1) * 4);
  EXPECT_EQ(el.pos_cursor.bytes, int64_t{T} * 4);
  EXPECT_EQ(el.pos_order.bytes, N * 4);
}

TEST(GptCudaLayout, RegionsAreAlignedInsideTheScratchAndLiveBuffersDoNotOverlap) {
  for (const NamedShape& ns : kShapes) {
    for (const BT& bt : kBatches) {
      if (bt.T > ns.shape.max_seq_len) continue;
      const std::string what =
          std::string(ns.name) + " B=" + std::to_string(bt.B) + " T=" + std::to_string(bt.T);
      CheckLayouts<float>(ns.shape, bt.B, bt.T, what + " fp32");
      CheckLayouts<Bf16>(ns.shape, bt.B, bt.T, what + " bf16");
      CheckLayouts<Fp16>(ns.shape, bt.B, bt.T, what + " fp16");
    }
  }
}

TEST(GptCudaLayout, LayerScratchIsLinearInTheSequenceLengthAndHalvesWith16BitStorage) {
  const GptShape s = kShapes[4].shape;  // gpt-13b, T up to 2048
  const int64_t t512 = GptCudaLayerScratchBytes<Bf16>(s, 1, 512);
  const int64_t t2048 = GptCudaLayerScratchBytes<Bf16>(s, 1, 2048);
  EXPECT_LE(t2048, 4 * t512 + 64 * kScratchAlign) << "a T x T term would grow 16-fold";
  // 16 N C elements of S plus fp32 statistics: 16 * 2048 * 5120 * 2 bytes = 320 MiB in bf16.
  const int64_t N = 2048, C = s.channels;
  EXPECT_GE(t2048, 16 * N * C * 2);
  EXPECT_LE(t2048, 16 * N * C * 2 + N * (4 * 4 + 8 * s.num_heads + 4 * C * 4 / 64) + 32 * 256);
  EXPECT_LT(GptCudaLayerScratchBytes<Bf16>(s, 1, 2048),
            GptCudaLayerScratchBytes<float>(s, 1, 2048));
}

// ---------------------------------------------------------------------------
// cuBLASLt mapping.

using gpu::cuda::LtEpilogue;
using gpu::cuda::LtMatmulMapping;
using gpu::cuda::RowEpilogue;

double Gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}
double GeluGrad(double x) {
  const double u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
  const double t = std::tanh(u);
  return 0.5 * (1.0 + t) +
         0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * x * x);
}

// Buffers of one product; the row-major and the column-major view share them.
struct Problem {
  bool trans_a = false, trans_b = false;
  int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldd = 0, aux_ld = 0;
  bool residual = false;
  RowEpilogue epilogue = RowEpilogue::kNone;
  std::vector<double> A, B, C, bias, aux_in;
};

struct Result {
  std::vector<double> D, aux, bias_grad;
};

// cuBLASLt as documented: column-major D(m, n) = epilogue(op(A) op(B) + beta C), bias one
// value per row of D, aux (m, n) with leading dimension AUX_LD, BGRADA = sums of op(A)'s rows
// over k. Every access is bounds-checked.
Result RunLt(const LtMatmulMapping& mp, const Problem& p) {
  const auto& g = mp.gemm;
  auto at = [](const std::vector<double>& v, int64_t i) {
    EXPECT_TRUE(i >= 0 && i < static_cast<int64_t>(v.size())) << "out of bounds " << i;
    return i >= 0 && i < static_cast<int64_t>(v.size()) ? v[i] : NAN;
  };
  // Lt's A is the row-major B and Lt's B the row-major A.
  const std::vector<double>& la = p.B;
  const std::vector<double>& lb = p.A;
  auto opA = [&](int64_t i, int64_t k) {
    return g.transa ? at(la, k + i * g.lda) : at(la, i + k * g.lda);
  };
  auto opB = [&](int64_t k, int64_t j) {
    return g.transb ? at(lb, j + k * g.ldb) : at(lb, k + j * g.ldb);
  };
  Result r;
  r.D.assign(p.M * p.ldd, NAN);
  r.aux =
      p.aux_in.empty() ? std::vector<double>(p.M * std::max<int64_t>(p.aux_ld, 1), NAN) : p.aux_in;
  r.bias_grad.assign(mp.vector_len, NAN);
  for (int64_t j = 0; j < g.n; ++j) {
    for (int64_t i = 0; i < g.m; ++i) {
      double acc = 0;
      for (int64_t k = 0; k < g.k; ++k) acc += opA(i, k) * opB(k, j);
      if (p.residual) acc += at(p.C, i + j * g.ldc);
      double out = acc;
      switch (mp.epilogue) {
        case LtEpilogue::kDefault:
        case LtEpilogue::kBgradA:
          break;
        case LtEpilogue::kBias:
          out = acc + at(p.bias, i);
          break;
        case LtEpilogue::kGeluAuxBias:
          at(r.aux, i + j * mp.aux_ld);
          r.aux[i + j * mp.aux_ld] = acc + at(p.bias, i);
          out = Gelu(acc + p.bias[i]);
          break;
        case LtEpilogue::kDGelu:
          out = acc * GeluGrad(at(p.aux_in, i + j * mp.aux_ld));
          break;
      }
      at(r.D, i + j * g.ldc);
      r.D[i + j * g.ldc] = out;
    }
  }
  if (mp.epilogue == LtEpilogue::kBgradA) {
    for (int64_t i = 0; i < g.m; ++i) {
      double s = 0;
      for (int64_t k = 0; k < g.k; ++k) s += opA(i, k);
      r.bias_grad[i] = s;
    }
  }
  return r;
}

// The row-major meaning, naively.
Result RunRowMajor(const Problem& p) {
  auto a = [&](int64_t i, int64_t k) {
    return p.trans_a ? p.A[k * p.lda + i] : p.A[i * p.lda + k];
  };
  auto b = [&](int64_t k, int64_t j) {
    return p.trans_b ? p.B[j * p.ldb + k] : p.B[k * p.ldb + j];
  };
  Result r;
  r.D.assign(p.M * p.ldd, NAN);
  r.aux =
      p.aux_in.empty() ? std::vector<double>(p.M * std::max<int64_t>(p.aux_ld, 1), NAN) : p.aux_in;
  for (int64_t i = 0; i < p.M; ++i) {
    for (int64_t j = 0; j < p.N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < p.K; ++k) acc += a(i, k) * b(k, j);
      if (p.residual) acc += p.C[i * p.ldd + j];
      double out = acc;
      if (p.epilogue == RowEpilogue::kBias) out = acc + p.bias[j];
      if (p.epilogue == RowEpilogue::kGeluAuxBias) {
        r.aux[i * p.aux_ld + j] = acc + p.bias[j];
        out = Gelu(acc + p.bias[j]);
      }
      if (p.epilogue == RowEpilogue::kDGelu) out = acc * GeluGrad(p.aux_in[i * p.aux_ld + j]);
      r.D[i * p.ldd + j] = out;
    }
  }
  if (p.epilogue == RowEpilogue::kBiasGradB) {
    r.bias_grad.assign(p.N, 0.0);
    for (int64_t j = 0; j < p.N; ++j) {
      for (int64_t k = 0; k < p.K; ++k) r.bias_grad[j] += b(k, j);
    }
  }
  return r;
}

std::vector<double> Random(int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> v(n);
  for (double& x : v) x = u(rng);
  return v;
}

void ExpectSame(const std::vector<double>& got, const std::vector<double>& want,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << what << " wrote outside the output at " << i;
    } else {
      EXPECT_NEAR(got[i], want[i], 1e-12) << what << " at " << i;
    }
  }
}

// The products of the GPT blocks (gpt_cuda.cu) with odd sizes and padded row strides.
TEST(GptCudaLtMapping, BlockProductsThroughLtSemanticsEqualTheRowMajorProducts) {
  std::mt19937_64 rng(13);
  const int64_t M = 5, N = 8, K = 3, pad = 3;
  struct Case {
    const char* name;
    bool trans_a, trans_b, residual;
    RowEpilogue epilogue;
  };
  const Case cases[] = {
      {"linear with bias", false, false, false, RowEpilogue::kBias},
      {"linear with bias and residual", false, false, true, RowEpilogue::kBias},
      {"fc with GELU aux", false, false, false, RowEpilogue::kGeluAuxBias},
      {"input gradient", false, true, false, RowEpilogue::kNone},
      {"input gradient through DGELU", false, true, false, RowEpilogue::kDGelu},
      {"weight gradient", true, false, false, RowEpilogue::kNone},
      {"weight gradient with bias gradient", true, false, false, RowEpilogue::kBiasGradB},
      // The head's chunked dWlm: beta = 1 on the (fp32) accumulator.
      {"weight gradient accumulated (beta 1)", true, false, true, RowEpilogue::kNone},
  };
  for (const Case& c : cases) {
    Problem p;
    p.trans_a = c.trans_a;
    p.trans_b = c.trans_b;
    p.M = M;
    p.N = N;
    p.K = K;
    p.residual = c.residual;
    p.epilogue = c.epilogue;
    p.lda = (c.trans_a ? M : K) + pad;
    p.ldb = (c.trans_b ? K : N) + pad;
    p.ldd = N + pad;
    p.aux_ld = 8 * ((N + 7) / 8) + 8;
    p.A = Random((c.trans_a ? K : M) * p.lda, rng);
    p.B = Random((c.trans_b ? N : K) * p.ldb, rng);
    p.C = Random(M * p.ldd, rng);
    p.bias = Random(N, rng);
    if (c.epilogue == RowEpilogue::kDGelu) p.aux_in = Random(M * p.aux_ld, rng);
    ASSERT_TRUE(gpu::cuda::LtMappingSupported(c.epilogue, c.trans_b)) << c.name;
    const LtMatmulMapping mp = gpu::cuda::RowMajorAsLt(c.trans_a, c.trans_b, M, N, K, p.lda, p.ldb,
                                                       p.ldd, c.epilogue, p.aux_ld);
    const Result lt = RunLt(mp, p);
    const Result want = RunRowMajor(p);
    ExpectSame(lt.D, want.D, std::string(c.name) + ": D");
    if (c.epilogue == RowEpilogue::kGeluAuxBias)
      ExpectSame(lt.aux, want.aux, std::string(c.name) + ": aux");
    if (c.epilogue == RowEpilogue::kBiasGradB) {
      ExpectSame(lt.bias_grad, want.bias_grad, std::string(c.name) + ": bias gradient");
    }
  }
}

TEST(GptCudaLtMapping, EpiloguesAndAlignmentsAreTheDocumentedValues) {
  using gpu::cuda::LtAlignmentBytes;
  EXPECT_EQ(
      gpu::cuda::RowMajorAsLt(false, false, 2, 3, 4, 4, 3, 3, RowEpilogue::kBias, 0).vector_len, 3);
  EXPECT_EQ(
      gpu::cuda::RowMajorAsLt(true, false, 2, 3, 4, 2, 3, 3, RowEpilogue::kBiasGradB, 0).epilogue,
      LtEpilogue::kBgradA);
  EXPECT_FALSE(gpu::cuda::LtMappingSupported(RowEpilogue::kBiasGradB, true));
  // 16-bit A and B into fp32 C and D: the plain epilogue only; C and D fp32, A and B as given.
  EXPECT_TRUE(gpu::cuda::LtMappingSupported(RowEpilogue::kNone, false, /*fp32_output=*/true));
  EXPECT_FALSE(gpu::cuda::LtMappingSupported(RowEpilogue::kBias, false, /*fp32_output=*/true));
  EXPECT_FALSE(gpu::cuda::LtMappingSupported(RowEpilogue::kBiasGradB, false, /*fp32_output=*/true));
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
    EXPECT_EQ(gpu::cuda::LtTypesFor(t, true).a_b, t);
    EXPECT_EQ(gpu::cuda::LtTypesFor(t, true).c_d, DType::kF32);
    EXPECT_EQ(gpu::cuda::LtTypesFor(t, false).a_b, t);
    EXPECT_EQ(gpu::cuda::LtTypesFor(t, false).c_d, t);
  }
  EXPECT_EQ(LtAlignmentBytes(0), 256u);
  EXPECT_EQ(LtAlignmentBytes(4096 + 2), 2u);
  EXPECT_EQ(LtAlignmentBytes(4096 + 16), 16u);
  EXPECT_EQ(LtAlignmentBytes(512), 256u);
}

}  // namespace
}  // namespace strata::models::cuda
