#include "models/ops/embedding.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "models/ops/parallel.h"

namespace strata::models::ops {
namespace {

// The backward's counting sort: first[V + 1] (where each token's rows start) and order[rows]
// (rows sorted by token id, in token order within an id).
struct EmbeddingScratch {
  int32_t* first;
  int32_t* order;
  int64_t size_bytes;
};

EmbeddingScratch CarveEmbeddingScratch(int64_t rows, int V, void* scratch) {
  Carver c(scratch);
  EmbeddingScratch sc;
  sc.first = c.Take<int32_t>(int64_t{V} + 1);
  sc.order = c.Take<int32_t>(rows);
  sc.size_bytes = c.size_bytes();
  return sc;
}

void CheckSequences(int64_t rows, int seq_len) {
  STRATA_CHECK_MSG(seq_len >= 1 && rows % seq_len == 0,
                   "rows=" + std::to_string(rows) + " seq_len=" + std::to_string(seq_len));
}

// s = S(scale) in ComputeType<S>: rounded to the storage type first (through fp32 for the 16-bit
// types), as transformers casts embed_scale to the weight dtype.
template <typename S>
ComputeType<S> StoredScale(double scale) {
  STRATA_CHECK_MSG(std::isfinite(scale), "embedding scale " + std::to_string(scale));
  return ToFloat(FromFloat<S>(static_cast<ComputeType<S>>(scale)));
}

}  // namespace

template <typename S>
void EmbeddingForward(const S* table, const int32_t* tokens, int64_t rows, int64_t C, int V, S* out,
                      const S* positions, int seq_len, const int32_t* position_ids, double scale) {
  using F = ComputeType<S>;
  if (positions != nullptr) CheckSequences(rows, seq_len);
  const F s = StoredScale<S>(scale);
  // Unscaled: the loops of before the scale existed (an exact copy without positions).
  const bool scaled = s != F(1);
  ParallelRows(rows, C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      CheckToken(tokens[r], V);
      const S* te = table + tokens[r] * C;
      S* o = out + r * C;
      if (positions != nullptr) {
        const int64_t t = position_ids != nullptr ? position_ids[r] : r % seq_len;
        STRATA_CHECK(t >= 0 && t < seq_len);
        const S* pe = positions + t * C;
        if (scaled) {
          for (int64_t c = 0; c < C; ++c) {
            o[c] = FromFloat<S>(ToFloat(te[c]) * s + ToFloat(pe[c]));
          }
        } else {
          for (int64_t c = 0; c < C; ++c) o[c] = FromFloat<S>(ToFloat(te[c]) + ToFloat(pe[c]));
        }
      } else if (scaled) {
        for (int64_t c = 0; c < C; ++c) o[c] = FromFloat<S>(ToFloat(te[c]) * s);
      } else {
        for (int64_t c = 0; c < C; ++c) o[c] = FromFloat<S>(ToFloat(te[c]));
      }
    }
  });
}

int64_t EmbeddingBackwardScratchBytes(int64_t rows, int V) {
  return CarveEmbeddingScratch(rows, V, nullptr).size_bytes;
}

template <typename S>
void EmbeddingBackward(const int32_t* tokens, const S* dout, int64_t rows, int64_t C, int V,
                       S* dtable, void* scratch, S* dpositions, int seq_len,
                       const int32_t* position_ids, double scale) {
  using F = ComputeType<S>;
  if (dpositions != nullptr) CheckSequences(rows, seq_len);
  const F s = StoredScale<S>(scale);
  const EmbeddingScratch sc = CarveEmbeddingScratch(rows, V, scratch);
  // Counting sort of the rows by token id, stable (token order within an id).
  std::fill(sc.first, sc.first + V + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    CheckToken(tokens[r], V);
    ++sc.first[tokens[r] + 1];
  }
  for (int64_t v = 0; v < V; ++v) sc.first[v + 1] += sc.first[v];
  for (int64_t r = 0; r < rows; ++r) sc.order[sc.first[tokens[r]]++] = static_cast<int32_t>(r);
  // first[v] now holds the end of token v's run, which is where token v + 1's starts.
  auto run_begin = [&](int64_t v) { return v == 0 ? 0 : sc.first[v - 1]; };

  // Table row v: its rows of dout in token order; position row t: dout[b, t] over b in order, or
  // with position_ids the rows at position t in row order (found by a scan of the ids: B T^2
  // integer compares, no scratch).
  const int64_t num_positions = dpositions != nullptr ? seq_len : 0;
  const int64_t num_seqs = dpositions != nullptr ? rows / seq_len : 0;
  ParallelRows(V + num_positions, C, [&](int64_t r0, int64_t r1) {
    F acc[kColBlock];
    for (int64_t row = r0; row < r1; ++row) {
      const bool is_table = row < V;
      const int64_t t = row - V;
      S* o = is_table ? dtable + row * C : dpositions + t * C;
      const bool scan = !is_table && position_ids != nullptr;
      const int64_t count = is_table ? sc.first[row] - run_begin(row) : scan ? rows : num_seqs;
      for (int64_t c0 = 0; c0 < C; c0 += kColBlock) {
        const int64_t w = std::min(kColBlock, C - c0);
        std::fill(acc, acc + w, F(0));
        for (int64_t i = 0; i < count; ++i) {
          if (scan && position_ids[i] != t) continue;
          const int64_t pos = is_table ? sc.order[run_begin(row) + i] : scan ? i : i * seq_len + t;
          const S* g = dout + pos * C + c0;
          for (int64_t j = 0; j < w; ++j) acc[j] += ToFloat(g[j]);
        }
        // A table row's sum scaled once, complete (times 1: exact, the unscaled sum).
        const F mul = is_table ? s : F(1);
        for (int64_t j = 0; j < w; ++j) o[c0 + j] = FromFloat<S>(acc[j] * mul);
      }
    }
  });
}

#define STRATA_INSTANTIATE_EMBEDDING(S)                                                            \
  template void EmbeddingForward<S>(const S*, const int32_t*, int64_t, int64_t, int, S*, const S*, \
                                    int, const int32_t*, double);                                  \
  template void EmbeddingBackward<S>(const int32_t*, const S*, int64_t, int64_t, int, S*, void*,   \
                                     S*, int, const int32_t*, double);

STRATA_INSTANTIATE_EMBEDDING(float)
STRATA_INSTANTIATE_EMBEDDING(double)
STRATA_INSTANTIATE_EMBEDDING(Bf16)
STRATA_INSTANTIATE_EMBEDDING(Fp16)

#undef STRATA_INSTANTIATE_EMBEDDING

}  // namespace strata::models::ops
