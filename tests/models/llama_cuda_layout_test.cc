// The Llama CUDA blocks' host-callable scratch layout (models/cuda/llama_cuda_layout.h), checked
// without a GPU: every region aligned and inside the scratch, the buffers live at the same time
// in each phase of the layer disjoint, the sizes the kernels rely on, linear growth in T (no
// T x T buffer), for float, Bf16 and Fp16 and configs from llama-tiny (GQA) to llama-13b; and
// LlamaModel::scratch_bytes covering both backends.
#include "models/cuda/llama_cuda_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "models/llama.h"
#include "models/llama_kernels.h"

namespace strata::models::cuda {
namespace {

// Every family: Qwen2 (q/k/v biases), Qwen3 (q/k norms and heads * head_dim != hidden), Phi-4.
const char* const kPresets[] = {"llama-tiny",   "llama-1b",   "llama-7b",   "llama-13b",
                                "qwen2.5-0.5b", "qwen3-0.6b", "qwen2.5-7b", "phi4"};
struct BT {
  int B, T;
};
const BT kBatches[] = {{1, 1}, {1, 7}, {2, 63}, {4, 64}};

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

void ExpectPairwiseDisjoint(const std::vector<NamedRegion>& live, const std::string& what) {
  for (size_t i = 0; i < live.size(); ++i) {
    for (size_t j = i + 1; j < live.size(); ++j) {
      EXPECT_TRUE(Disjoint(live[i].region, live[j].region))
          << what << ": " << live[i].name << " overlaps " << live[j].name;
    }
  }
}

template <typename S>
void CheckLayouts(const LlamaConfig& c, int B, int T, const std::string& what) {
  const int64_t N = int64_t{B} * T, C = c.hidden_size, I = c.intermediate_size, e = sizeof(S);
  const int64_t hs = c.head_dim, Dq = c.num_heads * hs,
                Dqkv = (c.num_heads + 2 * c.num_kv_heads) * hs;
  const LlamaLayerScratchLayout l = LlamaLayerScratchLayoutFor<S>(c, B, T);
  EXPECT_EQ(l.total, LlamaCudaLayerScratchBytes<S>(c, B, T));
  EXPECT_EQ(l.total, LlamaLayerScratchBytes<S>(c, B, T)) << "one layout for both backends";
  for (const auto& [phase, live] : LlamaLayerLivePhases<S>(c, B, T)) {
    ExpectPlaced(live, l.total, what + " layer " + phase);
    ExpectPairwiseDisjoint(live, what + " layer " + phase);
  }
  EXPECT_EQ(l.qkv.bytes, N * Dqkv * e);
  EXPECT_EQ(l.dqkv.bytes, N * Dqkv * e);
  EXPECT_EQ(l.att.bytes, N * Dq * e);
  EXPECT_EQ(l.gu.bytes, 2 * N * I * e) << "dgu lives over gu";
  EXPECT_GE(l.grad.bytes, N * std::max({C, I, Dq}) * e) << "grad holds dh, dxn2, datt, dxn";
  EXPECT_EQ(l.lse.bytes, int64_t{B} * c.num_heads * T * 4);
  EXPECT_EQ(l.cos.bytes, int64_t{T} * (hs / 2) * 4);
  EXPECT_GE(l.partials.bytes, LlamaRmsPartials(N) * C * 4);

  const LlamaCudaHeadScratchLayout hl = LlamaCudaHeadScratchLayoutFor<S>(c, B, T);
  EXPECT_EQ(hl.total, LlamaCudaHeadScratchBytes<S>(c, B, T));
  const std::vector<NamedRegion> head = {
      {"rstd", hl.rstd}, {"losses", hl.losses},   {"partials", hl.partials}, {"xn", hl.xn},
      {"dxn", hl.dxn},   {"xn_last", hl.xn_last}, {"chunk", hl.chunk},       {"dw_acc", hl.dw_acc}};
  ExpectPlaced(head, hl.total, what + " head");
  ExpectPairwiseDisjoint(head, what + " head");
  EXPECT_EQ(hl.chunk_rows, ops::HeadChunkRows(N, c.vocab_size));
  EXPECT_EQ(hl.chunk.bytes, hl.chunk_rows * c.vocab_size * e);
  EXPECT_EQ(hl.dw_acc.bytes, e == 4 ? 0 : int64_t{c.vocab_size} * C * 4);

  const CudaEmbeddingScratchLayout el = LlamaCudaEmbeddingScratchLayoutFor(c, B, T);
  const std::vector<NamedRegion> emb = {
      {"counts", el.counts}, {"offsets", el.offsets}, {"cursor", el.cursor}, {"order", el.order}};
  ExpectPlaced(emb, el.total, what + " embedding");
  ExpectPairwiseDisjoint(emb, what + " embedding");
  EXPECT_EQ(el.offsets.bytes, (int64_t{c.vocab_size} + 1) * 4);
  EXPECT_EQ(el.order.bytes, N * 4);
  EXPECT_EQ(el.pos_order.bytes, 0) << "no position table, no sort by position";
}

template <typename S>
void CheckAllConfigs(const char* type) {
  for (const char* name : kPresets) {
    StatusOr<LlamaConfig> c = LlamaPreset(name);
    ASSERT_TRUE(c.ok()) << c.status().message();
    for (const BT& bt : kBatches) {
      CheckLayouts<S>(*c, bt.B, bt.T,
                      std::string(name) + " " + type + " B=" + std::to_string(bt.B) +
                          " T=" + std::to_string(bt.T));
    }
  }
}

TEST(LlamaCudaLayout, EveryRegionAlignedInsideAndLiveBuffersDisjointFloat) {
  CheckAllConfigs<float>("float");
}
TEST(LlamaCudaLayout, EveryRegionAlignedInsideAndLiveBuffersDisjointBf16) {
  CheckAllConfigs<Bf16>("bf16");
}
TEST(LlamaCudaLayout, EveryRegionAlignedInsideAndLiveBuffersDisjointFp16) {
  CheckAllConfigs<Fp16>("fp16");
}

TEST(LlamaCudaLayout, LayerScratchGrowsLinearlyInTheSequenceLength) {
  StatusOr<LlamaConfig> c = LlamaPreset("llama-1b");
  ASSERT_TRUE(c.ok());
  // Doubling T (B fixed) at most doubles the layer scratch, up to alignment padding: no T x T.
  const int64_t a = LlamaCudaLayerScratchBytes<Bf16>(*c, 1, 1024);
  const int64_t b = LlamaCudaLayerScratchBytes<Bf16>(*c, 1, 2048);
  EXPECT_LE(b, 2 * a + 32 * kScratchAlign);
  EXPECT_GT(b, a);
}

TEST(LlamaCudaLayout, ModelScratchCoversTheHostAndTheCudaBlocks) {
  StatusOr<LlamaConfig> c = LlamaPreset("llama-tiny");
  ASSERT_TRUE(c.ok());
  auto model = LlamaModel::Create(*c);
  ASSERT_TRUE(model.ok()) << model.status().message();
  const engine::MicroBatchShape s{.batch_size = 2, .seq_len = 32};
  const int B = 2, T = 32;
  const int head = (*model)->num_blocks() - 1;
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    const int64_t emb = (*model)->scratch_bytes(0, s, d);
    const int64_t layer = (*model)->scratch_bytes(1, s, d);
    const int64_t hd = (*model)->scratch_bytes(head, s, d);
    DispatchDType(d, [&]<typename S>() {
      EXPECT_GE(emb, LlamaCudaEmbeddingScratchBytes<S>(*c, B, T));
      EXPECT_GE(emb, LlamaEmbeddingScratchBytes<S>(*c, B, T));
      EXPECT_GE(layer, LlamaCudaLayerScratchBytes<S>(*c, B, T));
      EXPECT_GE(layer, LlamaLayerScratchBytes<S>(*c, B, T));
      EXPECT_GE(hd, LlamaCudaHeadScratchBytes<S>(*c, B, T));
      EXPECT_GE(hd, LlamaHeadScratchBytes<S>(*c, B, T));
      return 0;
    });
  }
}

}  // namespace
}  // namespace strata::models::cuda
