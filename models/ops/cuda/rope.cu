// Rotary position embeddings on CUDA (ops.cuh): the cos/sin table in double on the device, the
// rotation one thread per pair, in place.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::ops::cuda {
namespace {

using namespace internal;  // NOLINT: the shared device helpers

constexpr int kBlock = 256;

struct RopeFreqs {
  double inv[kRopeMaxHeadDim / 2];
  double attention_factor;  // cos and sin times this (1: the table of before, bit for bit)
};

__global__ void RopeTableKernel(RopeFreqs f, int seq_len, int half, float* cos_out,
                                float* sin_out) {
  STRATA_FOR_EACH_INDEX(i, int64_t{seq_len} * half) {
    const double angle = static_cast<double>(i / half) * f.inv[i % half];
    cos_out[i] = static_cast<float>(f.attention_factor * cos(angle));
    sin_out[i] = static_cast<float>(f.attention_factor * sin(angle));
  }
}

// One thread per (row, head, pair i < rotary_dim/2): the pair (i, i + half) of the head's first
// rotary_dim = 2 half columns; the head's other columns are not touched. Row r is position
// position_ids[r] (packed sequences; outside [0, seq_len) traps) or r % seq_len.
template <typename D>
__global__ void RopeKernel(D* x, int64_t rows, int64_t row_stride, int num_heads, int head_dim,
                           int half, int seq_len, const float* cos, const float* sin, float sign,
                           const int32_t* position_ids) {
  const int64_t per_row = int64_t{num_heads} * half;
  STRATA_FOR_EACH_INDEX(idx, rows * per_row) {
    const int64_t r = idx / per_row;
    const int rem = static_cast<int>(idx % per_row);
    const int h = rem / half, i = rem % half;
    int64_t t = r % seq_len;
    if (position_ids != nullptr) {
      t = position_ids[r];
      CheckTokenOnDevice(static_cast<int32_t>(t), seq_len);
    }
    D* p = x + r * row_stride + int64_t{h} * head_dim;
    const float c = cos[t * half + i], si = sign * sin[t * half + i];
    const float a = ToF(p[i]), b = ToF(p[i + half]);
    p[i] = FromF<D>(a * c - b * si);
    p[i + half] = FromF<D>(b * c + a * si);
  }
}

}  // namespace

Status LaunchRopeTable(cudaStream_t stream, const RopeParams& p, int seq_len, float* cos,
                       float* sin) {
  const int dim = RopeRotaryDim(p);
  if (p.head_dim < 2 || p.head_dim % 2 != 0 || p.head_dim > kRopeMaxHeadDim || seq_len < 1 ||
      dim < 2 || dim % 2 != 0 || dim > p.head_dim ||
      (!p.ext_factors.empty() && static_cast<int>(p.ext_factors.size()) != dim / 2) ||
      !(p.attention_factor > 0) || !std::isfinite(p.attention_factor)) {
    return InvalidArgumentError(
        "LaunchRopeTable: need an even head_dim in [2, 256], an even rotary dim in [2, head_dim], "
        "rotary_dim / 2 ext_factors or none, a positive finite attention factor and seq_len >= 1");
  }
  if (!(p.linear_factor > 0) || !std::isfinite(p.linear_factor) ||
      (p.llama3 && (!(p.factor > 0) || !std::isfinite(p.factor) || !(p.low_freq_factor > 0) ||
                    !(p.high_freq_factor > p.low_freq_factor) ||
                    !std::isfinite(p.high_freq_factor) || p.original_max_position <= 0))) {
    return InvalidArgumentError(
        "LaunchRopeTable: need a positive finite linear factor and, with the Llama-3 rescaling, a "
        "positive finite factor, high_freq_factor > low_freq_factor > 0 and "
        "original_max_position > 0");
  }
  for (const double e : p.ext_factors) {
    if (!(e > 0) || !std::isfinite(e)) {
      return InvalidArgumentError("LaunchRopeTable: every ext_factor must be positive and finite");
    }
  }
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchRopeTable", {cos, sin}));
  const std::vector<double> inv = RopeInverseFrequencies(p);
  RopeFreqs f{};
  for (size_t i = 0; i < inv.size(); ++i) f.inv[i] = inv[i];
  f.attention_factor = p.attention_factor;
  const int half = dim / 2;
  RopeTableKernel<<<GridFor(int64_t{seq_len} * half, kBlock), kBlock, 0, stream>>>(f, seq_len, half,
                                                                                   cos, sin);
  return Launched("RopeTableKernel");
}

template <typename D>
Status LaunchRope(cudaStream_t stream, D* x, int64_t rows, int64_t row_stride, int num_heads,
                  int head_dim, int seq_len, const float* cos, const float* sin, bool inverse,
                  const int32_t* position_ids, int rotary_dim) {
  if (rotary_dim == 0) rotary_dim = head_dim;
  if (rows < 0 || num_heads < 1 || head_dim < 2 || head_dim % 2 != 0 || seq_len < 1 ||
      row_stride < int64_t{num_heads} * head_dim || rotary_dim < 2 || rotary_dim % 2 != 0 ||
      rotary_dim > head_dim) {
    return InvalidArgumentError(
        "LaunchRope: need rows >= 0, num_heads >= 1, an even head_dim >= 2, an even rotary_dim "
        "in [2, head_dim] (or 0), seq_len >= 1 and row_stride >= num_heads head_dim");
  }
  if (rows == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchRope", {x, cos, sin}));
  const int half = rotary_dim / 2;
  RopeKernel<D><<<GridFor(rows * num_heads * half, kBlock), kBlock, 0, stream>>>(
      x, rows, row_stride, num_heads, head_dim, half, seq_len, cos, sin, inverse ? -1.0f : 1.0f,
      position_ids);
  return Launched("RopeKernel");
}

#define STRATA_INSTANTIATE_ROPE(D)                                                               \
  template Status LaunchRope<D>(cudaStream_t, D*, int64_t, int64_t, int, int, int, const float*, \
                                const float*, bool, const int32_t*, int);
STRATA_INSTANTIATE_ROPE(float)
STRATA_INSTANTIATE_ROPE(__half)
STRATA_INSTANTIATE_ROPE(__nv_bfloat16)
#undef STRATA_INSTANTIATE_ROPE

}  // namespace strata::models::ops::cuda
