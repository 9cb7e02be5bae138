#include "base/dtype.h"

#include <fmt/format.h>

namespace strata {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "fp32";
    case DType::kF16: return "fp16";
    case DType::kBF16: return "bf16";
  }
  return "?";
}

StatusOr<DType> ParseDType(std::string_view n) {
  if (n == "fp32" || n == "float32" || n == "f32") return DType::kF32;
  if (n == "fp16" || n == "float16" || n == "f16" || n == "half") return DType::kF16;
  if (n == "bf16" || n == "bfloat16") return DType::kBF16;
  return InvalidArgumentError(fmt::format("unknown dtype '{}': use fp32, fp16 or bf16", n));
}

}  // namespace strata
