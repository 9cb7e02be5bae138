// 4-bit blockwise quantization of frozen weights as bitsandbytes stores them (QLoRA: Dettmers et
// al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"; bitsandbytes' kQuantizeBlockwise /
// kDequantizeBlockwise in csrc/kernels.cu and quantize_4bit / dequantize_4bit in
// bitsandbytes/functional.py): a tensor of n values, in row-major order, is cut into blocks of
// kQuant4BlockSize (64) values; each block keeps its absolute maximum (absmax, fp32) and each
// value the 4-bit code of the nearest point of the type's table (Quant4Map: NF4, the normal-float
// quantiles, or FP4, bitsandbytes' e2m1 values) to value / absmax, two codes per byte, the first
// value of a pair in the high nibble. Double quantization ("compress_statistics") then stores
// the absmax values themselves in 8 bits: their mean (`offset`, fp32) is subtracted, and the
// differences are quantized blockwise (blocks of kQuant4NestedBlockSize = 256) to bitsandbytes'
// signed dynamic 8-bit map (DynamicMap8), with an fp32 absmax per nested block.
//
// Dequantization (what a forward reads): absmax_b = DynamicMap8()[q_b] * nested_absmax_{b/256} +
// offset with double quantization (two fp32 roundings, no fused multiply-add), else the stored
// fp32 absmax; value = Quant4Map()[code] * absmax_b, one fp32 rounding, then rounded once to the
// storage type S. The host and the CUDA dequantization compute exactly these operations, so they
// agree bit for bit.
//
// The packed record of one tensor (host or device memory, 16-byte aligned parts, in this order;
// Quant4Layout gives each part's offset and size):
//   codes          ceil(n / 2) bytes                 bitsandbytes' packed uint8 weight
//   absmax         blocks fp32, or with double quantization blocks uint8
//   nested_absmax  nested_blocks fp32                 (double quantization only)
//   offset         1 fp32                             (double quantization only: nested_offset)
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "base/status.h"

namespace strata::gpu {
class Stream;
}

namespace strata::models::ops {

// bitsandbytes' bnb_4bit_quant_type names: "nf4", "fp4".
enum class Quant4Type { kNf4, kFp4 };

inline constexpr int64_t kQuant4BlockSize = 64;
inline constexpr int64_t kQuant4NestedBlockSize = 256;

std::string_view Quant4TypeName(Quant4Type type);
// "nf4" or "fp4"; kInvalidArgument naming the value and the choices otherwise.
StatusOr<Quant4Type> ParseQuant4Type(std::string_view name);

// The 16 values a code stands for, in code order, fp32 (bitsandbytes' quant_map).
std::span<const float, 16> Quant4Map(Quant4Type type);
// bitsandbytes' signed dynamic 8-bit map (functional.create_dynamic_map(signed=True), the code
// of quantize_blockwise and so of the nested absmax), 256 fp32 values ascending.
std::span<const float, 256> DynamicMap8();

struct Quant4Params {
  Quant4Type type = Quant4Type::kNf4;
  bool double_quant = true;  // bnb_4bit_use_double_quant
};

// Where the parts of one tensor's packed record lie, bytes from the record's start.
struct Quant4Layout {
  int64_t n = 0;  // values
  Quant4Params params;
  int64_t blocks = 0;         // ceil(n / 64)
  int64_t nested_blocks = 0;  // ceil(blocks / 256) with double quantization, else 0
  int64_t codes_offset = 0, codes_bytes = 0;
  int64_t absmax_offset = 0, absmax_bytes = 0;
  int64_t nested_absmax_offset = 0, nested_absmax_bytes = 0;
  int64_t offset_offset = 0;  // the fp32 mean (double quantization), else 0
  int64_t total_bytes = 0;    // a multiple of 16
};
// n >= 1 (STRATA_CHECK). Pure.
Quant4Layout MakeQuant4Layout(int64_t n, Quant4Params params);

// Quantizes x (n values, fp32: the tensor's values, already rounded to the 16-bit type the
// model stores them in, as bitsandbytes quantizes the loaded 16-bit tensor) into `record`
// (layout.total_bytes, host memory, OVERWRITTEN; padding bytes zero). Deterministic and
// independent of the thread count (oneTBB inside); reentrant.
void Quantize4bit(const Quant4Layout& layout, const float* x, std::byte* record);

// Dequantizes a record (host memory) into out (n values of storage type S: float, Bf16, Fp16,
// OVERWRITTEN), as the top of this file says. Reentrant; oneTBB inside.
template <typename S>
void Dequantize4bit(const Quant4Layout& layout, const std::byte* record, S* out);

// The CUDA dequantization of a record in device memory into out (device memory, S as above),
// enqueued on `stream` (a CUDA stream); bit-identical to Dequantize4bit. Errors: kInternal from
// a failed launch; kFailedPrecondition in a build without the CUDA backend.
template <typename S>
Status CudaDequantize4bit(const Quant4Layout& layout, const std::byte* record, S* out,
                          gpu::Stream& stream);

}  // namespace strata::models::ops
