#include "models/base_quant.h"

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "base/units.h"
#include "cpu_optim/grad_stats.h"
#include "gpu/device.h"

namespace strata::models {

EncodedLayerLayout MakeEncodedLayerLayout(const std::vector<std::vector<int64_t>>& shapes,
                                          const ops::Quant4Params& params, DType precision,
                                          const std::function<bool(int64_t)>& kept) {
  EncodedLayerLayout l;
  for (const std::vector<int64_t>& shape : shapes) {
    EncodedPart p;
    p.chunk_offset = l.num_params;
    p.n = 1;
    for (int64_t d : shape) p.n *= d;
    p.quantized = shape.size() == 2 && p.n > 0 && !(kept && kept(p.chunk_offset));
    p.byte_offset = l.bytes;
    if (p.quantized) {
      p.record = ops::MakeQuant4Layout(p.n, params);
      l.bytes += p.record.total_bytes;
    } else {
      l.bytes += AlignUp(static_cast<uint64_t>(p.n) * SizeOf(precision), 16);
    }
    l.num_params += p.n;
    l.parts.push_back(p);
  }
  return l;
}

Status EncodeLayerChunk(const EncodedLayerLayout& layout, DType precision,
                        std::span<const float> values, std::span<std::byte> out,
                        const RecordSource& source) {
  if (static_cast<int64_t>(values.size()) != layout.num_params ||
      static_cast<int64_t>(out.size()) != layout.bytes) {
    return InvalidArgumentError(fmt::format(
        "encoding a layer chunk of {} params into {} bytes: the layout has {} params, {} bytes",
        values.size(), out.size(), layout.num_params, layout.bytes));
  }
  std::memset(out.data(), 0, out.size());
  std::vector<float> rounded;
  for (const EncodedPart& p : layout.parts) {
    const float* x = values.data() + p.chunk_offset;
    std::byte* dst = out.data() + p.byte_offset;
    if (!p.quantized) {
      STRATA_RETURN_IF_ERROR(cpu_optim::ConvertFromF32(x, dst, precision, p.n));
      continue;
    }
    if (source) {
      STRATA_ASSIGN_OR_RETURN(const bool given,
                              source(p, std::span<std::byte>(dst, p.record.total_bytes)));
      if (given) continue;
    }
    // The tensor as the model stores it (16-bit), widened back: what bitsandbytes quantizes.
    rounded.resize(p.n);
    if (precision == DType::kF32) {
      std::memcpy(rounded.data(), x, p.n * sizeof(float));
    } else {
      std::vector<uint16_t> narrow(p.n);
      STRATA_RETURN_IF_ERROR(cpu_optim::ConvertFromF32(x, narrow.data(), precision, p.n));
      for (int64_t i = 0; i < p.n; ++i) {
        rounded[i] = precision == DType::kBF16 ? Bf16ToFloat(narrow[i]) : HalfToFloat(narrow[i]);
      }
    }
    ops::Quantize4bit(p.record, rounded.data(), dst);
  }
  return Status::Ok();
}

template <typename S>
void DecodeLayerChunk(const EncodedLayerLayout& layout, const std::byte* chunk, S* out) {
  for (const EncodedPart& p : layout.parts) {
    const std::byte* src = chunk + p.byte_offset;
    if (p.quantized) {
      ops::Dequantize4bit<S>(p.record, src, out + p.chunk_offset);
    } else {
      std::memcpy(out + p.chunk_offset, src, p.n * sizeof(S));
    }
  }
}

void DecodeLayerChunkToF32(const EncodedLayerLayout& layout, DType precision,
                           const std::byte* chunk, float* out) {
  if (precision == DType::kF32) return DecodeLayerChunk<float>(layout, chunk, out);
  DispatchDType(precision, [&]<typename S>() {
    std::vector<S> narrow(layout.num_params);
    DecodeLayerChunk<S>(layout, chunk, narrow.data());
    for (int64_t i = 0; i < layout.num_params; ++i) out[i] = ToFloat(narrow[i]);
  });
}

template <typename S>
Status EnqueueDecodeLayerChunk(const EncodedLayerLayout* layout, const std::byte* chunk, S* out,
                               gpu::Stream& stream) {
  if (stream.device_kind() != gpu::DeviceKind::kCuda) {
    return stream.LaunchHost([layout, chunk, out] {
      DecodeLayerChunk<S>(*layout, chunk, out);
      return Status::Ok();
    });
  }
  for (const EncodedPart& p : layout->parts) {
    const std::byte* src = chunk + p.byte_offset;
    if (p.quantized) {
      STRATA_RETURN_IF_ERROR(
          ops::CudaDequantize4bit<S>(p.record, src, out + p.chunk_offset, stream));
      continue;
    }
    // A copy in the same dtype (the stream's convert kernel: bit for bit).
    const uint64_t bytes = static_cast<uint64_t>(p.n) * sizeof(S);
    STRATA_RETURN_IF_ERROR(stream.Convert(
        gpu::DeviceSpan{reinterpret_cast<std::byte*>(out + p.chunk_offset), bytes}, DTypeOf<S>(),
        gpu::DeviceSpan{const_cast<std::byte*>(src), bytes}, DTypeOf<S>(), p.n));
  }
  return Status::Ok();
}

template void DecodeLayerChunk<float>(const EncodedLayerLayout&, const std::byte*, float*);
template void DecodeLayerChunk<Bf16>(const EncodedLayerLayout&, const std::byte*, Bf16*);
template void DecodeLayerChunk<Fp16>(const EncodedLayerLayout&, const std::byte*, Fp16*);
template Status EnqueueDecodeLayerChunk<float>(const EncodedLayerLayout*, const std::byte*, float*,
                                               gpu::Stream&);
template Status EnqueueDecodeLayerChunk<Bf16>(const EncodedLayerLayout*, const std::byte*, Bf16*,
                                              gpu::Stream&);
template Status EnqueueDecodeLayerChunk<Fp16>(const EncodedLayerLayout*, const std::byte*, Fp16*,
                                              gpu::Stream&);

}  // namespace strata::models
