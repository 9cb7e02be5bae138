// Internal to models/: the deterministic loops, scratch carving, per-thread work buffers and
// fixed-width vector helpers that every host op (models/ops/*.cc) and the host model kernels
// build on. Header-only.
//
// Determinism: every helper here gives results that do not depend on the number of threads
// or on how oneTBB splits a range: row loops hand out independent rows, column reductions
// sum their rows in order inside fixed column blocks, and elementwise transcendental functions
// go through Eigen's code path for a fixed-size array of kVec elements (padded at the tail), so
// an element's result never depends on its address (Eigen's vectorized exp/tanh differ from the
// scalar ones in the last bits).
#pragma once

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"

namespace strata::models::ops {

// Column reductions (bias and LayerNorm parameter gradients, embedding rows) run one task per
// block of this many columns, each summing its rows in order.
inline constexpr int64_t kColBlock = 64;
// Row-parallel loops aim at this many elements per task.
inline constexpr int64_t kGrainElems = 1 << 14;
// Sub-buffers of a scratch start at multiples of this many bytes.
inline constexpr int64_t kScratchAlign = 64;

constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// STRATA_CHECK that token is in [0, vocab_size).
inline void CheckToken(int32_t token, int vocab_size) {
  STRATA_CHECK_MSG(
      token >= 0 && token < vocab_size,
      "token " + std::to_string(token) + " outside [0, " + std::to_string(vocab_size) + ")");
}

// ---------------------------------------------------------------------------
// Scratch carving. One walk over a layout serves both the size (base == nullptr) and the
// pointers, so the two cannot disagree. Each Take starts at a multiple of kScratchAlign bytes
// from the base.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}

  template <typename T>
  T* Take(int64_t num_elems) {
    T* p = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset_bytes_);
    offset_bytes_ +=
        CeilDiv(num_elems * static_cast<int64_t>(sizeof(T)), kScratchAlign) * kScratchAlign;
    return p;
  }
  // The rest of the scratch from here (the pointer a nested carving starts at).
  void* Here() const { return base_ == nullptr ? nullptr : base_ + offset_bytes_; }
  void Skip(int64_t size_bytes) {
    offset_bytes_ += CeilDiv(size_bytes, kScratchAlign) * kScratchAlign;
  }
  int64_t size_bytes() const { return offset_bytes_; }

 private:
  char* base_;
  int64_t offset_bytes_ = 0;
};

// ---------------------------------------------------------------------------
// Deterministic parallel loops.

// f(begin, end) over row ranges; rows are independent, so any split gives the same result.
template <typename F>
void ParallelRows(int64_t rows, int64_t elems_per_row, F&& f) {
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, elems_per_row));
  if (rows <= grain) {
    f(int64_t{0}, rows);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, rows, grain),
                    [&](const tbb::blocked_range<int64_t>& r) { f(r.begin(), r.end()); });
}

// f(c0, c1) over fixed column blocks of kColBlock; used for sums over rows, each block summing
// its rows in order.
template <typename F>
void ParallelColumnBlocks(int64_t cols, F&& f) {
  const int64_t blocks = CeilDiv(cols, kColBlock);
  auto run = [&](int64_t i) { f(i * kColBlock, std::min(cols, (i + 1) * kColBlock)); };
  if (blocks == 1) {
    run(0);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks, 1),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      for (int64_t i = r.begin(); i != r.end(); ++i) run(i);
                    });
}

// ---------------------------------------------------------------------------
// Per-thread work buffers (compute-type copies of 16-bit GEMM operands, attention tiles),
// grown once. A lease holds them for one product or one attention task; a nested lease on the
// same thread (oneTBB may run another of our tasks on a thread that waits inside a parallel
// loop) gets private heap buffers instead, so no two users ever share one.

inline constexpr int kNumWorkBuffers = 12;

template <typename F>
struct WorkBuffers {
  std::vector<F> buf[kNumWorkBuffers];
  bool busy = false;
};

template <typename F>
class WorkLease {
 public:
  WorkLease() {
    thread_local WorkBuffers<F> tls;
    if (tls.busy) {
      own_ = std::make_unique<WorkBuffers<F>>();
      w_ = own_.get();
    } else {
      tls.busy = true;
      w_ = &tls;
    }
  }
  ~WorkLease() {
    if (own_ == nullptr) w_->busy = false;
  }
  WorkLease(const WorkLease&) = delete;
  WorkLease& operator=(const WorkLease&) = delete;

  // Buffer i in [0, kNumWorkBuffers) with room for at least n elements (contents unspecified).
  F* Get(int i, int64_t n) {
    std::vector<F>& v = w_->buf[i];
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  }

 private:
  WorkBuffers<F>* w_ = nullptr;
  std::unique_ptr<WorkBuffers<F>> own_;
};

// ---------------------------------------------------------------------------
// Fixed-width vectors: loads convert with ToFloat, stores round with FromFloat.

inline constexpr int kVec = 16;
template <typename F>
using Vec = Eigen::Array<F, kVec, 1>;

template <typename T>
Vec<ComputeType<T>> LoadVec(const T* x, int64_t len) {
  Vec<ComputeType<T>> v;
  for (int64_t j = 0; j < len; ++j) v[j] = ToFloat(x[j]);
  for (int64_t j = len; j < kVec; ++j) v[j] = 0;
  return v;
}

template <typename T>
void StoreVec(const Vec<ComputeType<T>>& v, int64_t len, T* y) {
  for (int64_t j = 0; j < len; ++j) y[j] = FromFloat<T>(v[j]);
}

// Sum of exp(x[i] - shift) over i < n, added in index order.
template <typename T>
ComputeType<T> SumExpShifted(const T* x, int64_t n, ComputeType<T> shift) {
  ComputeType<T> sum = 0;
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t len = std::min<int64_t>(kVec, n - i);
    const Vec<ComputeType<T>> e = (LoadVec(x + i, len) - shift).exp();
    for (int64_t j = 0; j < len; ++j) sum += e[j];
  }
  return sum;
}

// max over i < n of x[i], n >= 1.
template <typename T>
ComputeType<T> MaxOf(const T* x, int64_t n) {
  ComputeType<T> m = ToFloat(x[0]);
  for (int64_t i = 1; i < n; ++i) m = std::max(m, ToFloat(x[i]));
  return m;
}

}  // namespace strata::models::ops
