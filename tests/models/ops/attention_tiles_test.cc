// The tensor-core attention's tile schedule (models/ops/cuda/attention_tiles.h), checked on the
// host: for T in 1..300 and the tile sizes the kernels use, the forward / dq schedule (query
// tiles over key tiles) and the dk/dv schedule (key tiles over query tiles) visit every causal
// pair (query i, key j <= i < T) exactly once; unmasked tiles hold only valid pairs; skipped
// tiles hold none; with a sliding window the dk/dv blocks stop at the last query tile that sees
// their keys; and every kernel's shared memory fits the smallest opt-in limit.
#include "models/ops/cuda/attention_tiles.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace strata::models::ops::cuda::attention_tiles {
namespace {

bool Valid(int i, int j, int T) { return i < T && j < T && j <= i; }

// Counts, for one visited tile, each valid pair in `seen`; fails if the tile is unmasked but
// holds an invalid pair.
void Visit(int q0, int nq, int k0, int nk, int T, std::vector<int>& seen, const std::string& what) {
  const bool masked = TileNeedsMask(q0, nq, k0, nk, T);
  for (int i = q0; i < q0 + nq; ++i) {
    for (int j = k0; j < k0 + nk; ++j) {
      if (Valid(i, j, T)) {
        ++seen[size_t(i) * T + j];
      } else if (!masked) {
        ADD_FAILURE() << what << ": unmasked tile (" << q0 << ", " << k0 << ") holds pair (" << i
                      << ", " << j << ") with T " << T;
        return;
      }
    }
  }
}

void ExpectEachValidPairOnce(const std::vector<int>& seen, int T, const std::string& what) {
  for (int i = 0; i < T; ++i) {
    for (int j = 0; j < T; ++j) {
      const int want = j <= i ? 1 : 0;
      if (seen[size_t(i) * T + j] != want) {
        ADD_FAILURE() << what << ": pair (" << i << ", " << j << ") visited "
                      << seen[size_t(i) * T + j] << " times, want " << want << ", T " << T;
        return;
      }
    }
  }
}

TEST(AttentionTiles, QueryTileScheduleCoversEachCausalPairOnce) {
  for (const int nk : {kKeyTile, 32}) {
    for (int T = 1; T <= 300; ++T) {
      std::vector<int> seen(size_t(T) * T, 0);
      for (int q = 0; q < NumTiles(T, kQueryTile); ++q) {
        const int last = LastKeyTile(q, kQueryTile, nk, T);
        for (int k = 0; k <= last; ++k)
          Visit(q * kQueryTile, kQueryTile, k * nk, nk, T, seen, "fwd");
        // The skipped tiles hold no valid pair.
        for (int k = last + 1; k < NumTiles(T, nk); ++k) {
          for (int i = q * kQueryTile; i < (q + 1) * kQueryTile; ++i) {
            EXPECT_FALSE(Valid(i, k * nk, T)) << "skipped tile (" << q << ", " << k << ") T " << T;
          }
        }
      }
      ExpectEachValidPairOnce(seen, T, "forward/dq, key tile " + std::to_string(nk));
    }
  }
}

TEST(AttentionTiles, KeyTileScheduleCoversEachCausalPairOnce) {
  for (const int hs : {64, 128}) {
    const int nq = DkDvQueryTile(hs);
    for (int T = 1; T <= 300; ++T) {
      std::vector<int> seen(size_t(T) * T, 0);
      for (int k = 0; k < NumTiles(T, kDkDvKeyTile); ++k) {
        const int first = FirstQueryTile(k, kDkDvKeyTile, nq);
        for (int q = first; q < NumTiles(T, nq); ++q) {
          Visit(q * nq, nq, k * kDkDvKeyTile, kDkDvKeyTile, T, seen, "dk/dv");
        }
        for (int q = 0; q < first; ++q) {  // skipped: the last query of the tile precedes k0
          EXPECT_LT((q + 1) * nq - 1, k * kDkDvKeyTile) << "T " << T;
        }
      }
      ExpectEachValidPairOnce(seen, T, "dk/dv, hs " + std::to_string(hs));
    }
  }
}

// With a sliding window w the dk/dv blocks visit query tiles FirstQueryTile(k) ..
// EndQueryTile(k) - 1: every query tile holding a query that sees a key of key tile k (query i,
// key j < T with i - w < j <= i) lies in that range, and the range's last tile holds one (the
// bound is tight); without a window (0, or w >= T) the range ends at the last query tile.
TEST(AttentionTiles, WindowedKeyTileScheduleVisitsEveryQueryTileThatSeesTheKeys) {
  for (const int hs : {64, 128}) {
    const int nq = DkDvQueryTile(hs), nk = kDkDvKeyTile;
    for (int T = 1; T <= 300; ++T) {
      for (const int w : {0, 1, 2, 5, 31, 32, 33, 63, 64, 65, 100, T - 1, T, T + 7}) {
        if (w < 0) continue;
        for (int k = 0; k < NumTiles(T, nk); ++k) {
          const int first = FirstQueryTile(k, nk, nq), end = EndQueryTile(k, nk, nq, T, w);
          const int k0 = k * nk, k1 = (k + 1) * nk - 1 < T - 1 ? (k + 1) * nk - 1 : T - 1;
          if (w == 0 || w >= T) {
            EXPECT_EQ(end, NumTiles(T, nq)) << "T " << T << " w " << w;
          }
          int last_seeing = -1;
          for (int q = 0; q < NumTiles(T, nq); ++q) {
            bool sees = false;
            for (int i = q * nq; i < (q + 1) * nq && i < T && !sees; ++i) {
              const int lo = w > 0 && i - w + 1 > k0 ? i - w + 1 : k0;
              sees = lo <= (i < k1 ? i : k1);
            }
            if (!sees) continue;
            last_seeing = q;
            EXPECT_TRUE(q >= first && q < end)
                << "query tile " << q << " sees key tile " << k << " outside [" << first << ", "
                << end << "), T " << T << " w " << w;
          }
          EXPECT_EQ(end - 1, last_seeing) << "key tile " << k << " T " << T << " w " << w;
        }
      }
    }
  }
}

TEST(AttentionTiles, InteriorTilesNeedNoMask) {
  // Below the diagonal and inside T: no masking (the fast path of the kernels).
  EXPECT_FALSE(TileNeedsMask(128, 64, 0, 64, 1024));
  EXPECT_FALSE(TileNeedsMask(128, 64, 64, 64, 1024));
  EXPECT_TRUE(TileNeedsMask(128, 64, 128, 64, 1024)) << "the diagonal tile";
  EXPECT_TRUE(TileNeedsMask(0, 64, 0, 64, 63)) << "rows past T";
}

TEST(AttentionTiles, SharedMemoryFitsEveryTargetAndRowsStay16ByteAligned) {
  for (const int hs : {64, 128}) {
    EXPECT_TRUE(TensorCoreAttentionSupports(hs, 2));
    EXPECT_LE(ForwardSmemBytes(hs, 2), kMaxSmemBytesPerBlock) << hs;
    EXPECT_LE(DqSmemBytes(hs, 2), kMaxSmemBytesPerBlock) << hs;
    EXPECT_LE(DkDvSmemBytes(hs, 2), kMaxSmemBytesPerBlock) << hs;
    EXPECT_EQ(SmemStride(hs) * 2 % 16, 0) << "cp.async and ldmatrix need 16-byte rows";
    // Conflict-free ldmatrix: 8 consecutive rows start in 8 different 16-byte bank groups.
    EXPECT_EQ((SmemStride(hs) * 2 / 16) % 2, 1) << hs;
  }
  EXPECT_FALSE(TensorCoreAttentionSupports(32, 2));
  EXPECT_FALSE(TensorCoreAttentionSupports(64, 4)) << "fp32 stays on the CUDA cores";
  EXPECT_EQ(kQueryTile % 16, 0);
  EXPECT_EQ(DkDvQueryTile(128) % 16, 0);
}

}  // namespace
}  // namespace strata::models::ops::cuda::attention_tiles
