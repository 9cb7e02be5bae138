// Tile schedule of the tensor-core attention kernels (attention.cu): tile sizes, which
// tiles of the causal (query, key) square each block visits, which of those need masking, and
// the shared memory each kernel asks for. Plain C++ (no CUDA headers), so the schedule is
// checked on the host in CI (tests/models/ops/attention_tiles_test.cc) and the kernels use the
// same functions.
//
// Causal square of one (sequence, query head): queries i and keys j in [0, T), pairs j <= i. Query
// tile q covers rows [q nq, q nq + nq), key tile k covers [k nk, k nk + nk); rows past T exist
// in the tiles (zero-filled in shared memory) but are masked or never stored.
//   forward and dq: one block per query tile q, visiting key tiles 0..LastKeyTile(q); tiles
//                   after it lie wholly above the diagonal and are skipped.
//   dk/dv:          one block per (key tile k, kv head), visiting for each query head of the
//                   kv head's group, in head order, query tiles FirstQueryTile(k)..last;
//                   tiles before it lie wholly above the diagonal.
// A visited tile is masked element by element (j > i, j >= T or i >= T set to -inf / 0) only
// where TileNeedsMask says some pair of it is invalid; elsewhere every pair is valid. Packed
// sequences (AttentionDims::position_ids) and a sliding window (AttentionDims::window) add a
// lower bound per query, which TileNeedsMask does not see: the kernels then mask every visited
// tile, start a query tile at the key tile of its smallest lower bound and skip the query tiles
// that see none of a dk/dv block's keys (attention.cu); with a window the dk/dv blocks stop at
// EndQueryTile.
#pragma once

#include <cstddef>

#include "base/host_device.h"
#include "models/ops/attention.h"

// The index functions run in the kernels too: STRATA_HD (host and device under nvcc).

namespace strata::models::ops::cuda {

// Which kernels LaunchAttentionForward / LaunchAttentionBackward run. kAuto: the tensor cores
// where TensorCoreAttentionSupports holds and the buffers are 16-byte aligned, the CUDA cores
// otherwise. kCudaCores: always the CUDA-core kernels (the reference). kTensorCores: the
// tensor-core kernels, or kInvalidArgument where they cannot run.
enum class AttentionPath { kAuto, kCudaCores, kTensorCores };

namespace attention_tiles {

constexpr int kWarpsPerBlock = 4;  // every tensor-core kernel: 4 warps of 32 threads
constexpr int kRowsPerWarp = 16;   // the m of mma.m16n8k16
constexpr int kQueryTile = kWarpsPerBlock * kRowsPerWarp;  // forward and dq: 64 queries
// Forward and dq: keys per tile. The forward's tiles are the online softmax's, a rounding point
// every backend shares (kAttentionKeyTile, models/ops/attention.h).
constexpr int kKeyTile = kAttentionKeyTile;
constexpr int kDkDvKeyTile = kWarpsPerBlock * kRowsPerWarp;  // dk/dv: 64 keys per block
// dk/dv: queries per tile. 32 for hs 128 keeps the accumulators (dk, dv: 2 hs / 8 fp32 per
// thread) and the two score tiles (2 tile / 8 fp32) within the registers without spills.
STRATA_HD constexpr int DkDvQueryTile(int hs) { return hs == 128 ? 32 : 64; }
// Shared-memory rows are padded by 8 elements (16 bytes) so that the 8 row addresses of an
// ldmatrix fall in 8 different 16-byte bank groups. SmemStride: elements per row.
constexpr int kRowPad = 8;
STRATA_HD constexpr int SmemStride(int hs) { return hs + kRowPad; }

// The tensor-core kernels exist for head dims 64 and 128 and 2-byte storage (bf16, fp16).
STRATA_HD constexpr bool TensorCoreAttentionSupports(int hs, int elem_bytes) {
  return (hs == 64 || hs == 128) && elem_bytes == 2;
}

STRATA_HD constexpr int NumTiles(int T, int tile) { return (T + tile - 1) / tile; }

// Last key tile (inclusive) that query tile q of a sequence of T sees.
STRATA_HD constexpr int LastKeyTile(int q, int query_tile, int key_tile, int T) {
  const int last_query = (q + 1) * query_tile - 1 < T - 1 ? (q + 1) * query_tile - 1 : T - 1;
  return last_query / key_tile;
}

// First query tile that key tile k is seen by.
STRATA_HD constexpr int FirstQueryTile(int k, int key_tile, int query_tile) {
  return k * key_tile / query_tile;
}

// The end (exclusive) of the query tiles that key tile k is seen by. Without a window (0, or
// T or more: it masks nothing) the last query tile, NumTiles(T, query_tile); with a sliding window
// w (AttentionDims::window) key j is seen by queries j .. j + w - 1 only, so the tile of the
// tile's last key plus w - 1 (or the last tile, the smaller).
STRATA_HD constexpr int EndQueryTile(int k, int key_tile, int query_tile, int T, int window) {
  const int all = NumTiles(T, query_tile);
  if (window <= 0 || window >= T) return all;
  const int end = ((k + 1) * key_tile - 1 + window - 1) / query_tile + 1;
  return end < all ? end : all;
}

// Whether the tile of queries [q0, q0 + nq) and keys [k0, k0 + nk) holds an invalid pair (a key
// after its query, or a row past T): then the kernels mask it element by element.
STRATA_HD constexpr bool TileNeedsMask(int q0, int nq, int k0, int nk, int T) {
  return k0 + nk - 1 > q0 || k0 + nk > T || q0 + nq > T;
}

// Dynamic shared memory per block, bytes, for elements of elem_bytes: the forward holds q, k
// and v tiles; dq q, dout, k and v tiles; dk/dv k, v, q and dout tiles and lse, delta (fp32).
STRATA_HD constexpr size_t ForwardSmemBytes(int hs, int elem_bytes) {
  return size_t(kQueryTile + 2 * kKeyTile) * SmemStride(hs) * elem_bytes;
}
STRATA_HD constexpr size_t DqSmemBytes(int hs, int elem_bytes) {
  return size_t(2 * kQueryTile + 2 * kKeyTile) * SmemStride(hs) * elem_bytes;
}
STRATA_HD constexpr size_t DkDvSmemBytes(int hs, int elem_bytes) {
  return size_t(2 * kDkDvKeyTile + 2 * DkDvQueryTile(hs)) * SmemStride(hs) * elem_bytes +
         size_t(2 * DkDvQueryTile(hs)) * sizeof(float);
}
// What every GPU the build targets (sm_80 and later; sm_86 and sm_89 have the least) grants a
// block that opts in with cudaFuncAttributeMaxDynamicSharedMemorySize.
constexpr size_t kMaxSmemBytesPerBlock = 99 * 1024;

}  // namespace attention_tiles
}  // namespace strata::models::ops::cuda
