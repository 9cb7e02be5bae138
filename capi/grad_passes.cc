// The stateless gradient passes of the C API: statistics, accumulation and dtype
// conversion, over cpu_optim/grad_stats.h.
#include <cstdint>
#include <span>
#include <string>

#include "capi/capi_internal.h"
#include "cpu_optim/grad_stats.h"
#include "strata/strata.h"

namespace strata::capi {
namespace {

strata_grad_stats ToC(const cpu_optim::GradStats& s) {
  return strata_grad_stats{
      .sum_squares = s.sum_squares, .nonfinite = s.nonfinite ? 1 : 0, .num_elems = s.num_elems};
}

Status CheckCount(const char* what, int64_t num_elems) {
  if (num_elems < 0) {
    return InvalidArgumentError(std::string(what) + ": num_elems must be >= 0, got " +
                                std::to_string(num_elems));
  }
  return Status::Ok();
}

}  // namespace
}  // namespace strata::capi

extern "C" {

strata_status strata_grad_stats_compute(const void* grad, strata_dtype dtype, int64_t num_elems,
                                        float scale, strata_grad_stats* out) {
  using namespace strata;
  using namespace strata::capi;
  return Guard([&]() -> Status {
    if (out == nullptr) return InvalidArgumentError("strata_grad_stats_compute: out is NULL");
    const auto d = ToDType(dtype);
    if (!d) return BadDType("strata_grad_stats_compute", dtype);
    STRATA_RETURN_IF_ERROR(CheckBuffer("strata_grad_stats_compute", "grad", grad, num_elems));
    STRATA_ASSIGN_OR_RETURN(const cpu_optim::GradStats stats,
                            cpu_optim::ComputeGradStats({grad, *d}, num_elems, scale));
    *out = ToC(stats);
    return Status::Ok();
  });
}

strata_status strata_grad_accumulate(float* accum, const void* grad, strata_dtype grad_dtype,
                                     int64_t num_elems, int overwrite, strata_grad_stats* stats) {
  using namespace strata;
  using namespace strata::capi;
  return Guard([&]() -> Status {
    STRATA_RETURN_IF_ERROR(CheckCount("strata_grad_accumulate", num_elems));
    const auto d = ToDType(grad_dtype);
    if (!d) return BadDType("strata_grad_accumulate", grad_dtype);
    STRATA_RETURN_IF_ERROR(CheckBuffer("strata_grad_accumulate", "accum", accum, num_elems));
    STRATA_RETURN_IF_ERROR(CheckBuffer("strata_grad_accumulate", "grad", grad, num_elems));
    STRATA_ASSIGN_OR_RETURN(
        const cpu_optim::GradStats result,
        cpu_optim::AccumulateGrad(std::span<float>(accum, static_cast<size_t>(num_elems)),
                                  {grad, *d}, overwrite != 0, stats != nullptr));
    if (stats != nullptr) *stats = ToC(result);
    return Status::Ok();
  });
}

strata_status strata_convert_from_f32(const float* src, void* dst, strata_dtype dst_dtype,
                                      int64_t num_elems) {
  using namespace strata;
  using namespace strata::capi;
  return Guard([&]() -> Status {
    const auto d = ToDType(dst_dtype);
    if (!d) return BadDType("strata_convert_from_f32", dst_dtype);
    STRATA_RETURN_IF_ERROR(CheckBuffer("strata_convert_from_f32", "src", src, num_elems));
    STRATA_RETURN_IF_ERROR(CheckBuffer("strata_convert_from_f32", "dst", dst, num_elems));
    return cpu_optim::ConvertFromF32(src, dst, *d, num_elems);
  });
}

strata_status strata_convert_to_f32(const void* src, strata_dtype src_dtype, float* dst,
                                    int64_t num_elems) {
  using namespace strata;
  using namespace strata::capi;
  return Guard([&]() -> Status {
    const auto d = ToDType(src_dtype);
    if (!d) return BadDType("strata_convert_to_f32", src_dtype);
    STRATA_RETURN_IF_ERROR(CheckBuffer("strata_convert_to_f32", "src", src, num_elems));
    STRATA_RETURN_IF_ERROR(CheckBuffer("strata_convert_to_f32", "dst", dst, num_elems));
    return cpu_optim::ConvertToF32(src, *d, dst, num_elems);
  });
}

}  // extern "C"
