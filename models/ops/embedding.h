// Token embedding lookup (and learned position embeddings, GPT-2 style), forward and backward.
//
// Storage and rounding: S in {float, double, Bf16, Fp16}; the forward's sum of the two rows in
// ComputeType<S>, rounded once; each gradient row an fp32 sum in token order, rounded once.
//
// Scaled embedding (Gemma's Gemma3TextScaledWordEmbedding: embedding(ids) * embed_scale with
// embed_scale = sqrt(hidden_size) cast to the weight dtype): `scale` multiplies the table rows.
// It is first rounded to S, s = S(scale) (through fp32 for the 16-bit types, as transformers'
// fp32 buffer .to(weight.dtype)), then used in ComputeType<S>. scale 1.0 (the default) gives what
// the op gave before the parameter existed, bit for bit; scale must be finite (STRATA_CHECK).
// Token ids are int32 in [0, V): a value outside is a STRATA_CHECK failure (the caller
// validates data), never an out-of-bounds access.
//
// Deterministic (bit-identical across runs and thread counts), reentrant, oneTBB loops inside.
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace strata::models::ops {

// out[r] = S(table[tokens[r]] s (+ positions[p(r)])) for r < rows, s = S(scale): the product
// (and the sum with the position row) in ComputeType<S>, rounded to S once; with scale 1.0 and no
// positions an exact copy of the table row. table (V, C); out (rows, C);
// positions (T', C) with T' >= T nullable (learned positions, T = seq_len given, rows a multiple
// of T: sequences of T tokens); p(r) = position_ids[r] when position_ids ((rows) int32, each in
// [0, T): packed sequences) is given, else r % T.
template <typename S>
void EmbeddingForward(const S* table, const int32_t* tokens, int64_t rows, int64_t C, int V, S* out,
                      const S* positions = nullptr, int seq_len = 0,
                      const int32_t* position_ids = nullptr, double scale = 1.0);

// Scratch of EmbeddingBackward in bytes (a counting sort of the rows by token: (V + 1) + rows
// int32, each part 64-byte aligned from the scratch's start). Pure.
int64_t EmbeddingBackwardScratchBytes(int64_t rows, int V);

// dtable (V, C) OVERWRITTEN: row v = S(s * (fp32 sum of the dout rows with token v, in token
// order)), s = S(scale) as the forward's: the sum is scaled once, after it is complete (one
// product in ComputeType<S>, rounded with the sum; scale 1.0 multiplies by 1, exact), zero for
// absent tokens. The position rows are not scaled. dpositions (seq_len, C) nullable: row t = S(fp32
// sum of the dout rows r with p(r) = t, r in increasing order: over b of dout[b, t] without
// position_ids), zero for a position no row has (rows beyond seq_len left untouched: the caller
// zeroes them); rows a multiple of seq_len then. dout (rows, C). scratch:
// EmbeddingBackwardScratchBytes(rows, V), 4-byte aligned, contents undefined after.
template <typename S>
void EmbeddingBackward(const int32_t* tokens, const S* dout, int64_t rows, int64_t C, int V,
                       S* dtable, void* scratch, S* dpositions = nullptr, int seq_len = 0,
                       const int32_t* position_ids = nullptr, double scale = 1.0);

}  // namespace strata::models::ops
