// The CUDA dequantization of a 4-bit record (quantize_4bit.h CudaDequantize4bit; the host op
// ops/quantize_4bit.cc): one thread per byte of codes (grid-stride), i.e. per pair of values,
// with the fp32 operations of quantize_4bit_math.h, so the output is the host's bit for bit.
#include <cstddef>
#include <cstdint>
#include <string>

#include "gpu/cuda/cuda_native.h"
#include "models/ops/cuda/common.cuh"
#include "models/ops/quantize_4bit.h"
#include "models/ops/quantize_4bit_math.h"

namespace strata::models::ops {
namespace {

using namespace cuda::internal;  // NOLINT: the shared device helpers

constexpr int kBlock = 256;

// The tables, passed by value (1088 bytes of kernel parameters) and copied to shared memory.
struct Tables {
  float code4[16];  // quant4::DequantTable(type)
  float map8[256];  // DynamicMap8()
};

// The record's parts; the nested ones are null without double quantization.
struct RecordParts {
  const uint8_t* codes;
  const float* absmax;         // fp32 absmax (no double quantization)
  const uint8_t* qabsmax;      // 8-bit absmax codes (double quantization)
  const float* nested_absmax;  // (nested_blocks)
  const float* offset;         // (1)
};

template <typename D>
__global__ void Dequantize4bitKernel(RecordParts rec, int64_t n, int64_t codes_bytes, Tables t,
                                     DType dtype, D* out) {
  __shared__ float code4[16];
  __shared__ float map8[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) map8[i] = t.map8[i];
  if (threadIdx.x < 16) code4[threadIdx.x] = t.code4[threadIdx.x];
  __syncthreads();
  STRATA_FOR_EACH_INDEX(i, codes_bytes) {
    const int64_t v = 2 * i;
    const int64_t b = v / kQuant4BlockSize;
    const float absmax =
        rec.qabsmax != nullptr
            ? quant4::NestedAbsmax(map8[rec.qabsmax[b]],
                                   rec.nested_absmax[b / kQuant4NestedBlockSize], *rec.offset)
            : rec.absmax[b];
    const uint8_t byte = rec.codes[i];
    out[v] = FromF<D>(
        quant4::RoundToQuantDType(quant4::DequantizedValue(code4[byte >> 4], absmax), dtype));
    if (v + 1 < n) {
      out[v + 1] = FromF<D>(
          quant4::RoundToQuantDType(quant4::DequantizedValue(code4[byte & 0x0F], absmax), dtype));
    }
  }
}

}  // namespace

template <typename S>
Status CudaDequantize4bit(const Quant4Layout& layout, const std::byte* record, S* out,
                          gpu::Stream& stream) {
  if (layout.n < 1) {
    return InvalidArgumentError("CudaDequantize4bit: need n >= 1, got " + std::to_string(layout.n));
  }
  STRATA_RETURN_IF_ERROR(CheckPointers("CudaDequantize4bit", {record, out}));
  if (reinterpret_cast<uintptr_t>(record) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(out) % alignof(S) != 0) {
    return InvalidArgumentError(
        "CudaDequantize4bit: the record must be 16-byte aligned and out aligned to its type");
  }
  Tables t;
  const std::array<float, 16> code4 = quant4::DequantTable(layout.params.type);
  for (int i = 0; i < 16; ++i) t.code4[i] = code4[i];
  const std::span<const float, 256> map8 = DynamicMap8();
  for (int i = 0; i < 256; ++i) t.map8[i] = map8[i];

  RecordParts rec{};
  rec.codes = reinterpret_cast<const uint8_t*>(record + layout.codes_offset);
  if (layout.params.double_quant) {
    rec.qabsmax = reinterpret_cast<const uint8_t*>(record + layout.absmax_offset);
    rec.nested_absmax = reinterpret_cast<const float*>(record + layout.nested_absmax_offset);
    rec.offset = reinterpret_cast<const float*>(record + layout.offset_offset);
  } else {
    rec.absmax = reinterpret_cast<const float*>(record + layout.absmax_offset);
  }
  Dequantize4bitKernel<Dev<S>>
      <<<GridFor(layout.codes_bytes, kBlock), kBlock, 0, gpu::NativeStream(stream)>>>(
          rec, layout.n, layout.codes_bytes, t, layout.params.dtype, D(out));
  return Launched("Dequantize4bitKernel");
}

#define STRATA_INSTANTIATE_CUDA_DEQUANTIZE_4BIT(S) \
  template Status CudaDequantize4bit<S>(const Quant4Layout&, const std::byte*, S*, gpu::Stream&);
STRATA_INSTANTIATE_CUDA_DEQUANTIZE_4BIT(float)
STRATA_INSTANTIATE_CUDA_DEQUANTIZE_4BIT(Bf16)
STRATA_INSTANTIATE_CUDA_DEQUANTIZE_4BIT(Fp16)
#undef STRATA_INSTANTIATE_CUDA_DEQUANTIZE_4BIT

}  // namespace strata::models::ops
