// Kernels of the CUDA backend; see cuda_kernels.cuh for the contracts. The scalar
// conversions are base/dtype.h's (host and device code), the NaN-keeping scale cuda_dtype.cuh's.
// No fmt here: fmt 9's headers do not compile under nvcc, so messages are built with
// std::to_string.
#include <algorithm>
#include <cstdint>
#include <string>

#include "base/dtype.h"
#include "gpu/cuda/cuda_dtype.cuh"
#include "gpu/cuda/cuda_kernels.cuh"
#include "gpu/cuda/cuda_status.h"

namespace strata::gpu::cuda {
namespace {

constexpr int kBlock = 256;         // threads per block of the elementwise kernels
constexpr int64_t kMaxGrid = 8192;  // grid-stride beyond this many blocks
constexpr int kReduceMaxBlocks = 1024;
constexpr int64_t kReduceElemsPerBlock = int64_t{kBlock} * 16;
// The first chunk of an in-place narrowing conversion: one block loads it into
// registers, waits at a barrier, then stores.
constexpr int kFirstChunkThreads = 1024;
constexpr int kFirstChunkPerThread = 4;
constexpr int64_t kFirstChunk = int64_t{kFirstChunkThreads} * kFirstChunkPerThread;

__device__ __forceinline__ float Load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kF16:
      return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.0f;
}

__device__ __forceinline__ void Store(void* p, DType t, int64_t i, float x) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(p)[i] = x;
      break;
    case DType::kF16:
      static_cast<uint16_t*>(p)[i] = FloatToHalf(x);
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(p)[i] = FloatToBf16(x);
      break;
  }
}

// Elements [begin, end), grid-stride. Each element is read and written by one thread.
__global__ void ConvertKernel(void* dst, DType dt, const void* src, DType st, int64_t begin,
                              int64_t end, float scale) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = begin + int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < end; i += stride) {
    float x = Load(src, st, i);
    if (scale != 1.0f) x = ScaleDev(x, scale);
    Store(dst, dt, i, x);
  }
}

// Elements [0, end) with end <= kFirstChunk, one block: all loads, a barrier, all stores.
__global__ void ConvertFirstChunkKernel(void* dst, DType dt, const void* src, DType st, int64_t end,
                                        float scale) {
  float x[kFirstChunkPerThread];
#pragma unroll
  for (int k = 0; k < kFirstChunkPerThread; ++k) {
    const int64_t i = threadIdx.x + int64_t{k} * kFirstChunkThreads;
    x[k] = i < end ? Load(src, st, i) : 0.0f;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kFirstChunkPerThread; ++k) {
    const int64_t i = threadIdx.x + int64_t{k} * kFirstChunkThreads;
    if (i < end) Store(dst, dt, i, scale != 1.0f ? ScaleDev(x[k], scale) : x[k]);
  }
}

int GridFor(int64_t num_elems) {
  return static_cast<int>(std::clamp<int64_t>((num_elems + kBlock - 1) / kBlock, 1, kMaxGrid));
}

// Pass 1: per block, fp32 sum of squares of the finite elements and count of the rest.
__global__ void SumSquaresPartialKernel(const void* x, DType t, int64_t n, float* partial_sums,
                                        unsigned long long* partial_counts) {
  __shared__ float sums[kBlock];
  __shared__ unsigned long long counts[kBlock];
  float acc = 0.0f;
  unsigned long long bad = 0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = Load(x, t, i);
    if (isfinite(v)) {
      acc = fmaf(v, v, acc);
    } else {
      ++bad;
    }
  }
  sums[threadIdx.x] = acc;
  counts[threadIdx.x] = bad;
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s /= 2) {  // fixed tree order: deterministic
    if (threadIdx.x < s) {
      sums[threadIdx.x] += sums[threadIdx.x + s];
      counts[threadIdx.x] += counts[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partial_sums[blockIdx.x] = sums[0];
    partial_counts[blockIdx.x] = counts[0];
  }
}

// Pass 2: one block adds the partials in double, in a fixed order.
__global__ void SumSquaresFinalKernel(const float* partial_sums,
                                      const unsigned long long* partial_counts, int num_partials,
                                      NonFiniteAndSumSquares* result) {
  __shared__ double sums[kBlock];
  __shared__ unsigned long long counts[kBlock];
  double acc = 0.0;
  unsigned long long bad = 0;
  for (int i = threadIdx.x; i < num_partials; i += kBlock) {
    acc += static_cast<double>(partial_sums[i]);
    bad += partial_counts[i];
  }
  sums[threadIdx.x] = acc;
  counts[threadIdx.x] = bad;
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      sums[threadIdx.x] += sums[threadIdx.x + s];
      counts[threadIdx.x] += counts[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    result->sum_squares = sums[0];
    result->num_nonfinite = counts[0];
  }
}

__global__ void PackBucketKernel(void* bucket, DType bt, const PackSegment* segments,
                                 int num_segments, float scale) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (int s = 0; s < num_segments; ++s) {
    const PackSegment seg = segments[s];
    for (int64_t i = first; i < seg.num_elems; i += stride) {
      float x = seg.src[i];
      if (scale != 1.0f) x = ScaleDev(x, scale);
      Store(bucket, bt, seg.dst_offset_elems + i, x);
    }
  }
}

bool ValidDType(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

bool Aligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

int ReduceBlocks(int64_t num_elems) {
  return static_cast<int>(std::clamp<int64_t>(
      (num_elems + kReduceElemsPerBlock - 1) / kReduceElemsPerBlock, 1, kReduceMaxBlocks));
}

}  // namespace

Status LaunchConvert(cudaStream_t stream, void* dst, DType dst_dtype, const void* src,
                     DType src_dtype, int64_t num_elems, float scale) {
  if (!ValidDType(dst_dtype) || !ValidDType(src_dtype)) {
    return InvalidArgumentError("convert: unknown dtype");
  }
  if (num_elems < 0) {
    return InvalidArgumentError("convert: num_elems " + std::to_string(num_elems) + " < 0");
  }
  if (num_elems == 0) return Status::Ok();
  if (!dst || !src) return InvalidArgumentError("convert: null device pointer");
  const size_t ds = SizeOf(dst_dtype);
  const size_t ss = SizeOf(src_dtype);
  if (!Aligned(dst, ds) || !Aligned(src, ss)) {
    return InvalidArgumentError("convert: misaligned pointer (dst needs " + std::to_string(ds) +
                                "-byte, src " + std::to_string(ss) + "-byte alignment)");
  }
  const auto d0 = reinterpret_cast<uintptr_t>(dst);
  const auto s0 = reinterpret_cast<uintptr_t>(src);
  const uint64_t n = static_cast<uint64_t>(num_elems);
  const bool overlap = d0 < s0 + n * ss && s0 < d0 + n * ds;
  if (overlap && d0 != s0) {
    return InvalidArgumentError(
        "convert: dst and src overlap without being the same address; only exact in-place "
        "conversion is supported");
  }
  if (d0 == s0 && ds > ss) {
    return InvalidArgumentError("convert: in-place widening conversion is not supported");
  }
  if (d0 == s0 && ds < ss) {
    // In-place narrowing: the first chunk in one block with a barrier, then ranges
    // [lo, hi) with hi <= 2 lo, each in its own launch (kernel boundaries order them):
    // such a range writes bytes [lo*ds, hi*ds) that hold only source elements below lo,
    // which earlier launches have already converted.
    const int64_t first = std::min(num_elems, kFirstChunk);
    ConvertFirstChunkKernel<<<1, kFirstChunkThreads, 0, stream>>>(dst, dst_dtype, src, src_dtype,
                                                                  first, scale);
    STRATA_RETURN_IF_ERROR(LaunchStatus(cudaGetLastError(), "ConvertFirstChunkKernel"));
    for (int64_t lo = first; lo < num_elems; lo *= 2) {
      const int64_t hi = std::min(num_elems, 2 * lo);
      ConvertKernel<<<GridFor(hi - lo), kBlock, 0, stream>>>(dst, dst_dtype, src, src_dtype, lo, hi,
                                                             scale);
      STRATA_RETURN_IF_ERROR(LaunchStatus(cudaGetLastError(), "ConvertKernel"));
    }
    return Status::Ok();
  }
  ConvertKernel<<<GridFor(num_elems), kBlock, 0, stream>>>(dst, dst_dtype, src, src_dtype, 0,
                                                           num_elems, scale);
  return LaunchStatus(cudaGetLastError(), "ConvertKernel");
}

Status LaunchScale(cudaStream_t stream, void* x, DType dtype, int64_t num_elems, float scale) {
  return LaunchConvert(stream, x, dtype, x, dtype, num_elems, scale);
}

size_t NonFiniteAndSumSquaresWorkspaceBytes(int64_t num_elems) {
  return static_cast<size_t>(ReduceBlocks(num_elems)) *
         (sizeof(float) + sizeof(unsigned long long));
}

Status LaunchNonFiniteAndSumSquares(cudaStream_t stream, const void* x, DType dtype,
                                    int64_t num_elems, void* workspace, size_t workspace_bytes,
                                    NonFiniteAndSumSquares* result) {
  if (!ValidDType(dtype)) return InvalidArgumentError("sum of squares: unknown dtype");
  if (num_elems < 0) {
    return InvalidArgumentError("sum of squares: num_elems " + std::to_string(num_elems) + " < 0");
  }
  if (!result || !Aligned(result, alignof(NonFiniteAndSumSquares))) {
    return InvalidArgumentError("sum of squares: result must be 8-byte aligned device memory");
  }
  if (num_elems > 0 && (!x || !Aligned(x, SizeOf(dtype)))) {
    return InvalidArgumentError("sum of squares: input is null or misaligned for its dtype");
  }
  const int blocks = ReduceBlocks(num_elems);
  const size_t need = NonFiniteAndSumSquaresWorkspaceBytes(num_elems);
  if (!workspace || workspace_bytes < need || !Aligned(workspace, 16)) {
    return InvalidArgumentError("sum of squares: the workspace must be 16-byte aligned and hold " +
                                std::to_string(need) + " bytes (got " +
                                std::to_string(workspace_bytes) + ")");
  }
  auto* counts = static_cast<unsigned long long*>(workspace);
  auto* sums = reinterpret_cast<float*>(counts + blocks);
  SumSquaresPartialKernel<<<blocks, kBlock, 0, stream>>>(x, dtype, num_elems, sums, counts);
  STRATA_RETURN_IF_ERROR(LaunchStatus(cudaGetLastError(), "SumSquaresPartialKernel"));
  SumSquaresFinalKernel<<<1, kBlock, 0, stream>>>(sums, counts, blocks, result);
  return LaunchStatus(cudaGetLastError(), "SumSquaresFinalKernel");
}

Status LaunchPackBucket(cudaStream_t stream, void* bucket, DType bucket_dtype,
                        int64_t bucket_capacity_elems, const PackSegment* segments,
                        int num_segments, int64_t total_elems, float scale) {
  if (bucket_dtype != DType::kF16 && bucket_dtype != DType::kBF16) {
    return InvalidArgumentError("pack bucket: the bucket dtype must be fp16 or bf16");
  }
  if (num_segments < 0 || total_elems < 0 || bucket_capacity_elems < 0) {
    return InvalidArgumentError("pack bucket: negative count");
  }
  if (total_elems > bucket_capacity_elems) {
    return InvalidArgumentError("pack bucket: " + std::to_string(total_elems) +
                                " elements do not fit a bucket of " +
                                std::to_string(bucket_capacity_elems));
  }
  if (num_segments == 0 || total_elems == 0) return Status::Ok();
  if (!bucket || !segments || !Aligned(bucket, 2) || !Aligned(segments, alignof(PackSegment))) {
    return InvalidArgumentError("pack bucket: null or misaligned bucket or segment table");
  }
  PackBucketKernel<<<GridFor(total_elems), kBlock, 0, stream>>>(bucket, bucket_dtype, segments,
                                                                num_segments, scale);
  return LaunchStatus(cudaGetLastError(), "PackBucketKernel");
}

}  // namespace strata::gpu::cuda
