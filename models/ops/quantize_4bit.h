// 4-bit blockwise quantization of frozen weights as bitsandbytes stores them (QLoRA: Dettmers et
// al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"; bitsandbytes' kQuantizeBlockwiseSmall
// / kDequantizeBlockwise in csrc/kernels.cu and quantize_4bit / dequantize_4bit in
// bitsandbytes/functional.py): a tensor of n values, in row-major order, is cut into blocks of
// kQuant4BlockSize (64) values; each block keeps its absolute maximum (absmax, fp32) and each
// value the 4-bit code of the nearest point of the type's table (Quant4Map: NF4, the normal-float
// quantiles, or FP4, bitsandbytes' e2m1 values) to value / absmax, two codes per byte, the first
// value of a pair in the high nibble. Double quantization ("compress_statistics") then stores
// the absmax values themselves in 8 bits: their mean (`offset`, fp32) is subtracted, and the
// differences are quantized blockwise (blocks of kQuant4NestedBlockSize = 256) to bitsandbytes'
// signed dynamic 8-bit map (DynamicMap8), with an fp32 absmax per nested block.
//
// Quantization, exactly as bitsandbytes' CUDA kernels compute it in fp32 (the host emulates them):
//   - a partial last block is padded with zeros (the kernels' load fills missing items with 0):
//     they take part in its absmax, and for odd n the last byte's low nibble is the code of that
//     padding zero (NF4 0b0111, FP4 0b0000; NF4 0b0000 when the block's absmax is 0);
//   - absmax = fmaxf over the block of |x| starting from -FLT_MAX (NaN ignored); the scale is the
//     fp32 reciprocal 1.0f / absmax and each value is normalized by multiplying with it, so an
//     all-zero block has scale inf, normalized values 0 * inf = NaN and codes 0 (NF4's -1.0 and
//     FP4's +0.0: it dequantizes to zeros, -0.0 for NF4; with double quantization its absmax_b
//     below is the 8-bit error around 0, and NF4 gives -absmax_b, as bitsandbytes does);
//   - the code is picked by bitsandbytes' decision tree of midpoints (dQuantizeNF4, and
//     dQuantizeFP4 on |x| with the sign bit for x < 0), not by a nearest search: a value on a
//     midpoint takes the lower code; the nested 8-bit codes by dQuantize's binary search over the
//     map and its choice between neighbours;
//   - bitsandbytes compiles its kernels with --use_fast_math: every product flushes subnormal
//     inputs and results to zero (emulated here), and its `1.0f / absmax` becomes the approximate
//     rcp.approx.ftz.f32 (at most 1 ulp from the correctly rounded quotient), which cannot be
//     reproduced off the GPU: here the quotient is correctly rounded, so a value within about one
//     ulp of a decision threshold can get the neighbouring code from a bitsandbytes CUDA run;
//   - offset: bitsandbytes takes torch's fp32 mean on the GPU, whose summation order cannot be
//     reproduced; here the fp32 absmax values are summed in index order in double, divided by
//     the count in double and rounded once to fp32 (it may differ from bitsandbytes' in the last
//     bit; what follows uses the stored offset, so the record is self-consistent).
//
// Dequantization (what a forward reads): absmax_b = DynamicMap8()[q_b] * nested_absmax_{b/256} +
// offset with double quantization (two fp32 roundings, no fused multiply-add; the product
// flushed as bitsandbytes' fast-math kDequantizeBlockwise flushes it, the add torch's), else the
// stored fp32 absmax; value = Quant4Map()[code] * absmax_b, one fp32 rounding (flushed), then
// rounded once to the storage type S. FP4's code 8 gives -0.0 (bitsandbytes' dDequantizeFP4Tree
// multiplies 0.0 by the sign -1.0), though its stored quant_map, Quant4Map, has +0.0 there. The
// host and the CUDA dequantization compute exactly these operations, so they agree bit for bit
// (for records of finite values; NaN payloads may differ).
//
// The packed record of one tensor (host or device memory, 16-byte aligned parts, in this order;
// Quant4Layout gives each part's offset and size; the bytes between parts are zero):
//   codes          ceil(n / 2) bytes                 bitsandbytes' packed uint8 weight
//   absmax         blocks fp32, or with double quantization blocks uint8
//   nested_absmax  nested_blocks fp32                 (double quantization only)
//   offset         1 fp32                             (double quantization only: nested_offset)
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "base/dtype.h"
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
  // The type bitsandbytes' dequantize_4bit returns (a checkpoint's quant_state `dtype`, the type
  // the weight was quantized from): each dequantized value is rounded to it (nearest even)
  // before the conversion to the output's type, as MatMul4Bit casts dequantize_4bit's result to
  // the compute dtype. kF32: no rounding but the output's (a base quantized on the fly from
  // values already in the working precision).
  DType dtype = DType::kF32;
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
// (layout.total_bytes, host memory, OVERWRITTEN; padding bytes zero), as the top of this file
// says. Deterministic and independent of the thread count (oneTBB inside); reentrant.
void Quantize4bit(const Quant4Layout& layout, const float* x, std::byte* record);

// Dequantizes a record (host memory) into out (n values of storage type S: float, Bf16, Fp16,
// OVERWRITTEN), as the top of this file says. Reentrant; oneTBB inside.
template <typename S>
void Dequantize4bit(const Quant4Layout& layout, const std::byte* record, S* out);

// The CUDA dequantization of a record in device memory (16-byte aligned) into out (device memory,
// S as above), enqueued on `stream` (a CUDA stream; the caller makes its device current, as for
// the ops of models/ops/cuda/ops.cuh); bit-identical to Dequantize4bit. Allocates nothing.
// Errors: kInvalidArgument for a null or misaligned pointer (checked before launching);
// kInternal from a failed launch (faults of the running kernel surface at the stream's next
// synchronization); kFailedPrecondition in a build without the CUDA backend.
template <typename S>
Status CudaDequantize4bit(const Quant4Layout& layout, const std::byte* record, S* out,
                          gpu::Stream& stream);

}  // namespace strata::models::ops
