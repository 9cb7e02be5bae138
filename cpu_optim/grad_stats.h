// Fused gradient passes over a landing gradient bucket: statistics (sum of squares
// for the global norm used by clipping, inf/nan for the loss scaler), gradient
// accumulation into fp32, and fp32 <-> fp16/bf16 conversion for copy-out.
//
// Gradient clipping by global norm as in Pascanu et al., "On the difficulty of
// training recurrent neural networks", ICML 2013; overflow detection for dynamic
// loss scaling as in Micikevicius et al., "Mixed Precision Training", ICLR 2018.
//
// Units: num_elems are elements, not bytes. Alignment: none required. Ownership:
// the caller owns every buffer; nothing is retained. No buffers are allocated
// (oneTBB allocates its task objects).
//
// Determinism: sum_squares is accumulated in fp64 per fixed chunk of 4096
// elements (in 8 fixed lanes), chunks are summed in order within leaves of 64Ki
// elements, and leaves are combined pairwise in a tree fixed by their count (the
// exact order is in kernels.h), so it is bit-identical whatever the thread count,
// tile size or ISA variant.
//
// Threading: runs on the calling thread and oneTBB workers in the caller's arena;
// different buffers may be processed concurrently from several threads.
//
// Errors: kInvalidArgument for a null pointer with num_elems > 0, num_elems < 0, an
// unknown dtype, overlapping buffers or a non-finite scale; nothing is modified.
#pragma once

#include <cstdint>
#include <span>

#include "base/dtype.h"
#include "base/status.h"
#include "cpu_optim/adamw.h"

namespace strata::cpu_optim {

struct GradStats {
  // Sum over elements of (scale * g)^2, each product and square in fp64. Finite
  // inputs and a finite scale always give a finite sum; inf or NaN here means a
  // non-finite element.
  double sum_squares = 0;
  bool nonfinite = false;  // some element was +-inf or NaN
  int64_t num_elems = 0;   // elements covered
};

// into += other (sum_squares added, nonfinite or-ed, num_elems added). Merging
// bucket statistics in a fixed order keeps the global result deterministic.
void Merge(GradStats& into, const GradStats& other);

// Statistics of num_elems gradient elements at grad (scale applied to each element
// before squaring, e.g. 1 / loss_scale).
StatusOr<GradStats> ComputeGradStats(GradView grad, int64_t num_elems, float scale = 1.0f);

// dst = the num_elems elements of grad, copied bit for bit in grad's dtype, and their statistics
// (scale 1) in the same pass over memory: the statistics equal ComputeGradStats(grad, num_elems)
// bit for bit (the same fixed leaves, summed in the same order). In parallel on the caller's
// oneTBB arena. For a gradient consumed as it landed (the engine's only contribution of a
// step), where a separate copy and statistics pass would read it twice. dst and grad must not
// overlap; kInvalidArgument as ComputeGradStats, or for overlap.
StatusOr<GradStats> CopyGradWithStats(GradView grad, void* dst, int64_t num_elems);

// Gradient accumulation over micro-batches, accum.size() elements:
//   overwrite:  accum[i] = float(grad[i])            (exact copy of the value)
//   otherwise:  accum[i] = accum[i] + float(grad[i])  (one fp32 rounding)
// Returns the statistics of the resulting accum values (scale 1) when want_stats,
// computed in the same pass; otherwise a zero GradStats. accum and grad must not
// overlap.
StatusOr<GradStats> AccumulateGrad(std::span<float> accum, GradView grad, bool overwrite,
                                   bool want_stats);

// dst[i] = dst_dtype(src[i]) for num_elems elements: round to nearest even, NaN
// kept (quiet), overflow to inf, denormals kept; bit for bit base/dtype.h
// FloatToHalf / FloatToBf16. kF32 copies the bits. src and dst must not overlap.
Status ConvertFromF32(const float* src, void* dst, DType dst_dtype, int64_t num_elems);

// dst[i] = float(src[i]) for num_elems elements (exact; as base/dtype.h HalfToFloat /
// Bf16ToFloat). kF32 copies the bits. src and dst must not overlap.
Status ConvertToF32(const void* src, DType src_dtype, float* dst, int64_t num_elems);

}  // namespace strata::cpu_optim
