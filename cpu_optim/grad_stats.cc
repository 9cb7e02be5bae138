#include "cpu_optim/grad_stats.h"

#include <fmt/format.h>

#include <cmath>
#include <cstddef>
#include <cstring>

#include "cpu_optim/kernels.h"
#include "cpu_optim/parallel.h"

namespace strata::cpu_optim {
namespace internal {
namespace {

Status CheckView(const char* what, const void* data, DType dtype, int64_t num_elems) {
  if (num_elems < 0) {
    return InvalidArgumentError(fmt::format("{}: num_elems must be >= 0, got {}", what, num_elems));
  }
  if (!IsValidDType(dtype)) {
    return InvalidArgumentError(fmt::format("{}: unknown dtype {}", what, static_cast<int>(dtype)));
  }
  if (num_elems > 0 && data == nullptr) {
    return InvalidArgumentError(fmt::format("{}: null pointer with num_elems {}", what, num_elems));
  }
  return Status::Ok();
}

}  // namespace

StatusOr<GradStats> ComputeGradStatsWith(const KernelTable& kernels, GradView grad,
                                         int64_t num_elems, float scale) {
  STRATA_RETURN_IF_ERROR(CheckView("ComputeGradStats", grad.data, grad.dtype, num_elems));
  if (!std::isfinite(scale)) {
    return InvalidArgumentError(
        fmt::format("ComputeGradStats: scale must be finite, got {}", scale));
  }
  GradStats stats;
  stats.num_elems = num_elems;
  STRATA_RETURN_IF_ERROR(DeterministicLeafSum(
      num_elems,
      [&](int64_t begin, int64_t end) {
        return kernels.sum_squares(grad.data, grad.dtype, static_cast<double>(scale), begin, end);
      },
      &stats.sum_squares));
  stats.nonfinite = !std::isfinite(stats.sum_squares);
  return stats;
}

StatusOr<GradStats> AccumulateGradWith(const KernelTable& kernels, std::span<float> accum,
                                       GradView grad, bool overwrite, bool want_stats) {
  const auto n = static_cast<int64_t>(accum.size());
  STRATA_RETURN_IF_ERROR(CheckView("AccumulateGrad", grad.data, grad.dtype, n));
  if (n > 0 && accum.data() == nullptr) {
    return InvalidArgumentError(fmt::format("AccumulateGrad: null accum with num_elems {}", n));
  }
  if (Overlaps(accum.data(), accum.size_bytes(), grad.data,
               static_cast<size_t>(n) * SizeOf(grad.dtype))) {
    return InvalidArgumentError("AccumulateGrad: accum and grad overlap");
  }
  double sum = 0.0;
  STRATA_RETURN_IF_ERROR(DeterministicLeafSum(
      n,
      [&](int64_t begin, int64_t end) {
        return kernels.accumulate(accum.data(), grad.data, grad.dtype, overwrite, want_stats, begin,
                                  end);
      },
      &sum));
  if (!want_stats) return GradStats{};
  return GradStats{.sum_squares = sum, .nonfinite = !std::isfinite(sum), .num_elems = n};
}

StatusOr<GradStats> CopyGradWithStatsWith(const KernelTable& kernels, GradView grad, void* dst,
                                          int64_t num_elems) {
  STRATA_RETURN_IF_ERROR(CheckView("CopyGradWithStats", grad.data, grad.dtype, num_elems));
  STRATA_RETURN_IF_ERROR(CheckView("CopyGradWithStats", dst, grad.dtype, num_elems));
  const size_t width = SizeOf(grad.dtype);
  if (Overlaps(grad.data, static_cast<size_t>(num_elems) * width, dst,
               static_cast<size_t>(num_elems) * width)) {
    return InvalidArgumentError("CopyGradWithStats: grad and dst overlap");
  }
  GradStats stats;
  stats.num_elems = num_elems;
  // Each leaf is copied, then summed from the copy while it is still in cache.
  STRATA_RETURN_IF_ERROR(DeterministicLeafSum(
      num_elems,
      [&](int64_t begin, int64_t end) {
        std::memcpy(static_cast<std::byte*>(dst) + begin * width,
                    static_cast<const std::byte*>(grad.data) + begin * width,
                    static_cast<size_t>(end - begin) * width);
        return kernels.sum_squares(dst, grad.dtype, 1.0, begin, end);
      },
      &stats.sum_squares));
  stats.nonfinite = !std::isfinite(stats.sum_squares);
  return stats;
}

Status ConvertFromF32With(const KernelTable& kernels, const float* src, void* dst, DType dst_dtype,
                          int64_t num_elems) {
  STRATA_RETURN_IF_ERROR(CheckView("ConvertFromF32", dst, dst_dtype, num_elems));
  if (num_elems > 0 && src == nullptr) {
    return InvalidArgumentError(
        fmt::format("ConvertFromF32: null src with num_elems {}", num_elems));
  }
  const auto n = static_cast<size_t>(num_elems);
  if (Overlaps(src, n * sizeof(float), dst, n * SizeOf(dst_dtype))) {
    return InvalidArgumentError("ConvertFromF32: src and dst overlap");
  }
  return ParallelForTiles(num_elems, kConvertTileElems, [&](int64_t begin, int64_t end) {
    kernels.from_f32(src, dst, dst_dtype, begin, end);
  });
}

Status ConvertToF32With(const KernelTable& kernels, const void* src, DType src_dtype, float* dst,
                        int64_t num_elems) {
  STRATA_RETURN_IF_ERROR(CheckView("ConvertToF32", src, src_dtype, num_elems));
  if (num_elems > 0 && dst == nullptr) {
    return InvalidArgumentError(fmt::format("ConvertToF32: null dst with num_elems {}", num_elems));
  }
  const auto n = static_cast<size_t>(num_elems);
  if (Overlaps(src, n * SizeOf(src_dtype), dst, n * sizeof(float))) {
    return InvalidArgumentError("ConvertToF32: src and dst overlap");
  }
  return ParallelForTiles(num_elems, kConvertTileElems, [&](int64_t begin, int64_t end) {
    kernels.to_f32(src, src_dtype, dst, begin, end);
  });
}

}  // namespace internal

void Merge(GradStats& into, const GradStats& other) {
  into.sum_squares += other.sum_squares;
  into.nonfinite = into.nonfinite || other.nonfinite;
  into.num_elems += other.num_elems;
}

StatusOr<GradStats> ComputeGradStats(GradView grad, int64_t num_elems, float scale) {
  return internal::ComputeGradStatsWith(internal::BestKernelTable(), grad, num_elems, scale);
}

StatusOr<GradStats> CopyGradWithStats(GradView grad, void* dst, int64_t num_elems) {
  return internal::CopyGradWithStatsWith(internal::BestKernelTable(), grad, dst, num_elems);
}

StatusOr<GradStats> AccumulateGrad(std::span<float> accum, GradView grad, bool overwrite,
                                   bool want_stats) {
  return internal::AccumulateGradWith(internal::BestKernelTable(), accum, grad, overwrite,
                                      want_stats);
}

Status ConvertFromF32(const float* src, void* dst, DType dst_dtype, int64_t num_elems) {
  return internal::ConvertFromF32With(internal::BestKernelTable(), src, dst, dst_dtype, num_elems);
}

Status ConvertToF32(const void* src, DType src_dtype, float* dst, int64_t num_elems) {
  return internal::ConvertToF32With(internal::BestKernelTable(), src, src_dtype, dst, num_elems);
}

}  // namespace strata::cpu_optim
