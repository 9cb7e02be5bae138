// Writes a 16/32-bit Hugging Face directory as a bitsandbytes 4-bit directory (`strata
// quantize`; QLoRA's base, issue 45): what transformers' save_pretrained writes for the model
// loaded with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type, bnb_4bit_use_double_quant)
// (models/hf_bnb.h), so that HfCheckpoint, transformers and PEFT read it:
//
//   OUT/config.json              IN's, key for key, with "quantization_config" added
//                                (BnbQuantizationConfigJson; bnb_4bit_compute_dtype the
//                                16-bit type the weights were quantized from)
//   OUT/model.safetensors        all tensors, or shards model-0000k-of-0000N.safetensors of at
//                                most max_shard_bytes (a 4-bit tensor's parts kept together) with
//                                model.safetensors.index.json
//   OUT/<tokenizer files>, chat_template.jinja, generation_config.json: copies of IN's
//
// The tensors HfBaseQuantized names are quantized (ops::Quantize4bit) after their values are
// rounded to the 16-bit type the model is loaded in, as bitsandbytes quantizes the loaded
// tensor: an F16 tensor as it is, a BF16 one as it is, an F32 one rounded to bf16 (its
// quant_state's dtype says which). Every other tensor is written in its stored dtype with the
// same values (byte-equal but for NaN payloads). Tensors in block order, each 4-bit weight
// followed by its parts; safetensors metadata {"format": "pt"}.
//
// Memory: one block's fp32 chunk at a time (HfCheckpoint::ReadBlock) and one tensor's rounded
// values and packed record.
//
// Crash safety: WriteDirectoryAtomically (models/hf_export.h): out_dir must not exist or be an
// empty directory; everything is written into a temporary sibling that is renamed into place, or
// removed on any error.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"
#include "models/hf_checkpoint.h"
#include "models/ops/quantize_4bit.h"

namespace strata::models {

struct QuantizeHfOptions {
  ops::Quant4Params params;                  // nf4 with double quantization by default
  uint64_t max_shard_bytes = 5'000'000'000;  // of tensor data per safetensors file
};

struct QuantizeHfSummary {
  int64_t tensors_quantized = 0;
  int64_t tensors_kept = 0;   // written as they were
  uint64_t bytes_before = 0;  // tensor data read from IN (the tensors the model uses)
  uint64_t bytes_after = 0;   // tensor data written to OUT
  int num_shards = 0;
  DType quantized_from = DType::kBF16;  // the 16-bit type of the first quantized tensor
};

// Errors: kInvalidArgument for a directory that is already 4-bit, a GPT-2 one
// (CheckHfBaseQuantizable), a Gemma 3 multimodal one (its vision tower would be lost), a
// non-finite value in a tensor to quantize (naming it), max_shard_bytes == 0; kAlreadyExists for
// an out_dir that exists and is not empty; I/O errors naming the file.
StatusOr<QuantizeHfSummary> WriteQuantizedHfDirectory(const HfCheckpoint& in,
                                                      const std::string& out_dir,
                                                      const QuantizeHfOptions& options);

}  // namespace strata::models
