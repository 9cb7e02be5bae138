// Per-head RMSNorm of the q and k heads on CUDA (ops.cuh; the host op ops/head_rms_norm.h): one
// warp per (row, head) through the RMSNorm row functions (rms_norm_row.cuh); the weight gradient
// through a deterministic two-pass column reduction (per-block partials, then an ordered sum).
#include <cstdint>
#include <string>

#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/ops.cuh"
#include "models/ops/cuda/rms_norm_row.cuh"

namespace strata::models::ops::cuda {
namespace {

using namespace internal;  // NOLINT: the shared device helpers

constexpr int kRowWarps = 8;         // head rows (warps) per block of the row kernels
constexpr int kPartialsBlock = 128;  // columns (threads) per block of the partials kernel
constexpr int kSumBlock = 256;

// Head row i = r num_heads + h: raw row i (contiguous), qk columns h hs .. of row r.
template <typename D>
__global__ void HeadRmsNormForwardKernel(D* qk, int64_t ld, int64_t rows, int num_heads,
                                         int num_q_heads, int64_t hs, const D* w, float eps, D* raw,
                                         float* rstd, bool unit_offset) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(i, rows * num_heads) {
    const int64_t r = i / num_heads;
    const int h = static_cast<int>(i % num_heads);
    D* head = qk + r * ld + h * hs;
    D* saved = raw + i * hs;
    // Lane l copies the elements it reads back in the row function (the same lane mapping).
    for (int64_t c = lane; c < hs; c += kWarp) saved[c] = head[c];
    const D* wh = h < num_q_heads ? w : w + hs;
    const float s =
        RmsNormWarpRowForward(static_cast<const D*>(saved), wh, eps, hs, head, lane, unit_offset);
    if (lane == 0) rstd[i] = s;
  }
}

template <typename D>
__global__ void HeadRmsNormBackwardKernel(const D* raw, int64_t rows, int num_heads,
                                          int num_q_heads, int64_t hs, const D* w,
                                          const float* rstd, D* dqk, int64_t ld, bool unit_offset) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(i, rows * num_heads) {
    const int64_t r = i / num_heads;
    const int h = static_cast<int>(i % num_heads);
    D* head = dqk + r * ld + h * hs;
    const D* wh = h < num_q_heads ? w : w + hs;
    RmsNormWarpRowBackward(raw + i * hs, wh, rstd[i], static_cast<const D*>(head),
                           static_cast<const D*>(nullptr), hs, head, lane, unit_offset);
  }
}

// Pass 1: partials[p, 0, c] (q) and partials[p, 1, c] (k) = the sums of dy xhat over rows
// p R .. (p + 1) R - 1 (in order) and, within a row, the part's heads (in order).
template <typename D>
__global__ void HeadRmsNormPartialsKernel(const D* raw, const float* rstd, const D* dqk, int64_t ld,
                                          int64_t rows, int num_heads, int num_q_heads, int64_t hs,
                                          float* partials) {
  const int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t p = blockIdx.y;
  if (c >= hs) return;
  const int64_t r0 = p * kHeadRmsRowsPerPartial;
  const int64_t r1 = r0 + kHeadRmsRowsPerPartial < rows ? r0 + kHeadRmsRowsPerPartial : rows;
  float acc_q = 0.0f, acc_k = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    for (int h = 0; h < num_heads; ++h) {
      const int64_t i = r * num_heads + h;
      const float v = ToF(dqk[r * ld + h * hs + c]) * (ToF(raw[i * hs + c]) * rstd[i]);
      if (h < num_q_heads) {
        acc_q += v;
      } else {
        acc_k += v;
      }
    }
  }
  partials[(p * 2) * hs + c] = acc_q;
  partials[(p * 2 + 1) * hs + c] = acc_k;
}

Status CheckHeads(const char* op, int64_t ld, int64_t rows, int num_heads, int num_q_heads,
                  int64_t hs) {
  if (rows < 0 || hs < 1 || num_heads < 1 || num_q_heads < 0 || num_q_heads > num_heads) {
    return InvalidArgumentError(std::string(op) +
                                ": need rows >= 0, hs >= 1, num_heads >= 1 and 0 <= num_q_heads "
                                "<= num_heads");
  }
  if (ld < int64_t{num_heads} * hs) {
    return InvalidArgumentError(std::string(op) + ": the row stride ld is below num_heads hs");
  }
  return Status::Ok();
}

}  // namespace

template <typename D>
Status LaunchHeadRmsNormForward(cudaStream_t stream, D* qk, int64_t ld, int64_t rows, int num_heads,
                                int num_q_heads, int64_t hs, const D* w, float eps, D* raw,
                                float* rstd, bool unit_offset) {
  constexpr const char* kOp = "LaunchHeadRmsNormForward";
  STRATA_RETURN_IF_ERROR(CheckHeads(kOp, ld, rows, num_heads, num_q_heads, hs));
  if (!(eps > 0.0f)) return InvalidArgumentError(std::string(kOp) + ": eps must be > 0");
  if (rows == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers(kOp, {qk, w, raw, rstd}));
  HeadRmsNormForwardKernel<D>
      <<<GridFor(rows * num_heads, kRowWarps), kRowWarps * kWarp, 0, stream>>>(
          qk, ld, rows, num_heads, num_q_heads, hs, w, eps, raw, rstd, unit_offset);
  return Launched("HeadRmsNormForwardKernel");
}

template <typename D>
Status LaunchHeadRmsNormBackward(cudaStream_t stream, const D* raw, int64_t rows, int num_heads,
                                 int num_q_heads, int64_t hs, const D* w, const float* rstd, D* dqk,
                                 int64_t ld, D* dw, float* partials, bool unit_offset) {
  constexpr const char* kOp = "LaunchHeadRmsNormBackward";
  STRATA_RETURN_IF_ERROR(CheckHeads(kOp, ld, rows, num_heads, num_q_heads, hs));
  if (rows > 0) STRATA_RETURN_IF_ERROR(CheckPointers(kOp, {raw, w, rstd, dqk}));
  if (dw != nullptr) {
    const int64_t num_partials = HeadRmsPartials(rows);
    const int64_t col_blocks = (hs + kPartialsBlock - 1) / kPartialsBlock;
    if (num_partials > kMaxGrid || col_blocks > kMaxGrid) {
      return InvalidArgumentError(std::string(kOp) +
                                  ": too many rows or columns for the weight gradient's partials");
    }
    if (rows > 0) {
      STRATA_RETURN_IF_ERROR(CheckPointers(kOp, {partials}));
      const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(num_partials));
      HeadRmsNormPartialsKernel<D><<<grid, kPartialsBlock, 0, stream>>>(
          raw, rstd, dqk, ld, rows, num_heads, num_q_heads, hs, partials);
      STRATA_RETURN_IF_ERROR(Launched("HeadRmsNormPartialsKernel"));
    }
    SumPartialsKernel<D>
        <<<GridFor(2 * hs, kSumBlock), kSumBlock, 0, stream>>>(partials, num_partials, 2 * hs, dw);
    STRATA_RETURN_IF_ERROR(Launched("SumPartialsKernel"));
  }
  if (rows == 0) return Status::Ok();
  HeadRmsNormBackwardKernel<D>
      <<<GridFor(rows * num_heads, kRowWarps), kRowWarps * kWarp, 0, stream>>>(
          raw, rows, num_heads, num_q_heads, hs, w, rstd, dqk, ld, unit_offset);
  return Launched("HeadRmsNormBackwardKernel");
}

#define STRATA_INSTANTIATE_HEAD_RMS_NORM(D)                                                        \
  template Status LaunchHeadRmsNormForward<D>(cudaStream_t, D*, int64_t, int64_t, int, int,        \
                                              int64_t, const D*, float, D*, float*, bool);         \
  template Status LaunchHeadRmsNormBackward<D>(cudaStream_t, const D*, int64_t, int, int, int64_t, \
                                               const D*, const float*, D*, int64_t, D*, float*,    \
                                               bool);
STRATA_INSTANTIATE_HEAD_RMS_NORM(float)
STRATA_INSTANTIATE_HEAD_RMS_NORM(__half)
STRATA_INSTANTIATE_HEAD_RMS_NORM(__nv_bfloat16)
#undef STRATA_INSTANTIATE_HEAD_RMS_NORM

}  // namespace strata::models::ops::cuda
