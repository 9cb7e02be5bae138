// Elementwise and reduction kernels of the CUDA backend: dtype conversion with a
// scale, scaling in place, inf/nan detection with sum of squares, and gradient
// bucket packing.
//
// Every entry point takes an explicit cudaStream_t, allocates nothing, checks its
// arguments before launching (kInvalidArgument naming the problem), and returns
// the launch error (cudaGetLastError) as a Status. Errors of the running kernel
// surface at the next synchronization of the stream. Pointers are device pointers
// (or managed/mapped memory); sizes are in elements unless named *_bytes.
// Launches are thread-safe (they touch no shared host state). The caller must make
// the stream's device current (the CUDA backend's Stream does).
//
// Numerics match the scalar reference of base/dtype.h bit for bit: the value is
// multiplied by `scale` in fp32 (skipped when scale == 1), then rounded to nearest
// even; NaN stays NaN (quiet, sign and top payload bits kept, as x86-64 keeps them when
// the host multiplies; the GPU's own multiply would canonicalize them); values past the
// fp16 range become +-inf (the overflow the loss scaler looks for); denormals are
// kept in both directions (no flush to zero: built without --use_fast_math).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "base/dtype.h"
#include "base/status.h"

namespace strata::gpu::cuda {

// dst[i] = dst_dtype(src_dtype(src[i]) * scale) for i in [0, num_elems).
// Any pair of fp32/fp16/bf16. In place (dst == src) is allowed when narrowing or
// of the same width (an in-place fp32 -> 16-bit conversion runs as a few launches
// over ranges of doubling size, so no element is overwritten before it was read);
// any other overlap of dst and src is kInvalidArgument, as is in-place widening.
// num_elems == 0 launches nothing.
Status LaunchConvert(cudaStream_t stream, void* dst, DType dst_dtype, const void* src,
                     DType src_dtype, int64_t num_elems, float scale);

// x[i] = dtype(x[i] * scale) in place, any dtype (16-bit values round to nearest even).
Status LaunchScale(cudaStream_t stream, void* x, DType dtype, int64_t num_elems, float scale);

// Written by LaunchNonFiniteAndSumSquares into device memory.
struct NonFiniteAndSumSquares {
  double sum_squares;      // sum of x[i]^2 over the finite elements
  uint64_t num_nonfinite;  // number of elements that are +-inf or NaN
};

// Workspace for LaunchNonFiniteAndSumSquares, in bytes (a function of num_elems
// only; at most 16 KiB), 16-byte aligned device memory.
size_t NonFiniteAndSumSquaresWorkspaceBytes(int64_t num_elems);

// Counts the non-finite elements of x (num_elems elements of dtype) and sums the
// squares of the finite ones, into *result (device memory, 8-byte aligned).
// Two passes, deterministic: pass 1 has a grid whose size depends on num_elems only;
// each block accumulates its elements' squares in fp32 (fixed per-thread order,
// fixed tree reduction) and writes one partial into `workspace`; pass 2, one block,
// adds the partials in double in a fixed order. So the result is bit-identical from
// run to run for the same input. num_elems == 0 writes zeros. This is the overflow
// check of dynamic loss scaling (Micikevicius et al., "Mixed Precision Training",
// ICLR 2018) and the global norm for gradient clipping.
Status LaunchNonFiniteAndSumSquares(cudaStream_t stream, const void* x, DType dtype,
                                    int64_t num_elems, void* workspace, size_t workspace_bytes,
                                    NonFiniteAndSumSquares* result);

// One fp32 tensor gathered into a bucket: bucket[dst_offset_elems + i] = src[i] * scale
// for i in [0, num_elems).
struct PackSegment {
  const float* src;  // (num_elems) fp32, device memory
  int64_t num_elems;
  int64_t dst_offset_elems;  // where the segment starts in the bucket, in elements
};

// Gradient bucket packing: converts each segment (scaled) into the 16-bit bucket
// (bucket_dtype fp16 or bf16, bucket_capacity_elems elements). `segments` is an array
// of num_segments PackSegment in DEVICE memory (set up once, e.g. in the arena, since
// a bucket's layout is fixed); the host cannot check it, so the caller promises that
// every segment lies inside the bucket and segments do not overlap; `total_elems`
// (the sum of the segments' num_elems, <= bucket_capacity_elems) sizes the grid.
// Elements of the bucket not covered by a segment are left as they were.
Status LaunchPackBucket(cudaStream_t stream, void* bucket, DType bucket_dtype,
                        int64_t bucket_capacity_elems, const PackSegment* segments,
                        int num_segments, int64_t total_elems, float scale);

}  // namespace strata::gpu::cuda
