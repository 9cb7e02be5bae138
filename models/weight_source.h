// Where a model's initial master weights come from when they are not a random initialisation:
// an imported checkpoint (models/hf_checkpoint.h reads a Hugging Face directory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "base/status.h"
#include "models/ops/quantize_4bit.h"

namespace strata::models {

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // Writes block `block`'s whole chunk as fp32, in the model's chunk layout (out.size() ==
  // the block's num_params). Reads only that block's tensors (never a whole-model copy in
  // memory). Errors: I/O errors naming the file, kDataLoss for a file that changed or is short.
  // Thread-compatible: one call at a time.
  virtual Status ReadBlock(int block, std::span<float> out) const = 0;

  // A source that holds the layers' 2-D tensors 4-bit quantized already (a bitsandbytes
  // directory, models/hf_checkpoint.h; which tensors: models/base_quant.h): their quantization;
  // nullopt (the default) for a source of plain values. ReadBlock still gives every value
  // (dequantized).
  virtual std::optional<ops::Quant4Params> base_quant() const { return std::nullopt; }
  // Whether the tensor of block `block` that starts at element `chunk_offset` of its chunk is
  // held 4-bit (its record from ReadQuantizedTensor). A bitsandbytes directory holds every
  // tensor models/base_quant.h quantizes so, except the projections its llm_int8_skip_modules
  // keeps in 16 bits. False (the default) for sources of plain values. Thread-safe.
  virtual bool HoldsQuantized(int block, int64_t chunk_offset) const { return false; }
  // ReadBlock, except that the elements of the tensors held 4-bit are left as they are (their
  // records come from ReadQuantizedTensor): no dequantization nor read of them. The default, for
  // sources of plain values: ReadBlock.
  virtual Status ReadBlockSkippingQuantized(int block, std::span<float> out) const {
    return ReadBlock(block, out);
  }
  // The packed record (models/ops/quantize_4bit.h, `layout`) of the quantized tensor that starts
  // at element `chunk_offset` of block `block`'s chunk, into record (layout.total_bytes,
  // OVERWRITTEN), as stored: no requantization. Errors: kInvalidArgument when no quantized
  // tensor starts there or its layout differs; those of ReadBlock. Thread-compatible.
  virtual Status ReadQuantizedTensor(int block, int64_t chunk_offset,
                                     const ops::Quant4Layout& layout,
                                     std::span<std::byte> record) const {
    return UnimplementedError("this weight source holds no quantized tensors");
  }
};

}  // namespace strata::models
