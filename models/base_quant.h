// QLoRA's 4-bit frozen base (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized
// LLMs"): how a layer's frozen chunk is encoded when LoRA trains adapters over a base held in
// bitsandbytes' 4-bit layout (models/ops/quantize_4bit.h), and how a layer's weights come back
// in the working precision before its products.
//
// Which tensors: every 2-D tensor of a transformer layer (the family's TensorShapes for the
// layer block: q/k/v/o and the MLP's projections, Phi-3's fused qkv_proj and gate_up_proj), each
// quantized on its own in its stored row-major (out, in) order, as transformers' bitsandbytes
// integration replaces each nn.Linear, except those a bitsandbytes directory keeps in 16 bits
// (its llm_int8_skip_modules); the 1-D tensors (norms, biases) stay in the working precision,
// and so do the embedding and the LM head (blocks other than layers are not encoded).
//
// The encoded chunk: the layer's tensors in chunk order, each part starting at a multiple of 16
// bytes: a 1-D tensor as its n values in the working precision S, a 2-D one as its 4-bit record
// (ops::Quant4Layout). Decoding writes the layer's ordinary chunk (the family's layout, S) into
// the block workspace (engine::BlockBuffers::workspace), which the layer then reads as its
// params: a dequantized weight is rounded to S once, as bitsandbytes' dequantize_4bit returns
// the compute dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "models/ops/quantize_4bit.h"

namespace strata::gpu {
class Stream;
}

namespace strata::models {

// One tensor of an encoded layer chunk.
struct EncodedPart {
  int64_t chunk_offset = 0;  // element offset in the layer's ordinary chunk
  int64_t n = 0;             // elements
  bool quantized = false;    // a 2-D tensor: a 4-bit record (`record`), else n values of S
  int64_t byte_offset = 0;   // where the part starts in the encoded chunk (a multiple of 16)
  ops::Quant4Layout record;  // quantized parts only
};

struct EncodedLayerLayout {
  std::vector<EncodedPart> parts;  // in chunk order; they tile the ordinary chunk
  int64_t num_params = 0;          // the ordinary chunk's elements
  int64_t bytes = 0;               // the encoded chunk's, a multiple of 16
};

// The layout of a layer with tensors `shapes` (the family's TensorShapes, chunk order) encoded
// with `params`, for working precision `precision`. `kept` (may be empty), asked with a 2-D
// tensor's element offset in the chunk: true keeps that tensor in the working precision,
// unquantized (a bitsandbytes directory's llm_int8_skip_modules). Pure but for `kept`.
EncodedLayerLayout MakeEncodedLayerLayout(const std::vector<std::vector<int64_t>>& shapes,
                                          const ops::Quant4Params& params, DType precision,
                                          const std::function<bool(int64_t)>& kept = nullptr);

// Encodes a layer's ordinary chunk `values` (fp32, num_params) into `out` (layout.bytes, host
// memory, OVERWRITTEN): 1-D tensors rounded to `precision`; 2-D tensors rounded to `precision`
// first (bitsandbytes quantizes the loaded 16-bit tensor) and quantized. `source`, when given, is
// asked first for each quantized part: it writes the part's record itself and returns true (a
// directory that holds the tensor quantized already), or returns false (quantize `values`).
// Errors: kInvalidArgument for a size mismatch; the source's. Reentrant (oneTBB inside).
using RecordSource = std::function<StatusOr<bool>(const EncodedPart&, std::span<std::byte>)>;
Status EncodeLayerChunk(const EncodedLayerLayout& layout, DType precision,
                        std::span<const float> values, std::span<std::byte> out,
                        const RecordSource& source = nullptr);

// Decodes an encoded chunk (host memory) into the ordinary chunk `out` (num_params values of S,
// OVERWRITTEN). Reentrant; oneTBB inside.
template <typename S>
void DecodeLayerChunk(const EncodedLayerLayout& layout, const std::byte* chunk, S* out);

// The values a layer computes with, widened to fp32: the chunk (encoded for `precision`) decoded
// in `precision` (its 1-D parts are stored in it) into out (num_params fp32, OVERWRITTEN). What
// a merge of adapters into the base, or a 16-bit copy of the 4-bit base, reads. Reentrant.
void DecodeLayerChunkToF32(const EncodedLayerLayout& layout, DType precision,
                           const std::byte* chunk, float* out);

// The same for device memory, enqueued on `stream`: the host backend runs DecodeLayerChunk as a
// host function, CUDA launches ops::CudaDequantize4bit per 2-D tensor and a copy per 1-D one;
// the results are bit-identical. `layout` must outlive the enqueued work (the model owns it).
// Errors: the launches'.
template <typename S>
Status EnqueueDecodeLayerChunk(const EncodedLayerLayout* layout, const std::byte* chunk, S* out,
                               gpu::Stream& stream);

}  // namespace strata::models
