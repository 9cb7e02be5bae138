// `strata quantize --model-dir IN --out-dir OUT [--quant nf4|fp4] [--double-quant on|off]
// [--max-shard-size 5GB]`: a Hugging Face directory of a Llama-family model (16/32-bit weights)
// written as a bitsandbytes 4-bit directory, the frozen base of a QLoRA fine-tune (issue 45):
// the layers' projections in 4 bits (models/hf_config.h HfBaseQuantized), the rest as stored,
// config.json with transformers' quantization_config (models/hf_quantize.h).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "base/status.h"

namespace strata::tools {

struct QuantizeFlags {
  std::string model_dir;
  std::string out_dir;
  std::string quant = "nf4";
  std::string double_quant = "on";
  std::string max_shard_size = "5GB";
};
void AddQuantizeFlags(CLI::App& cmd, QuantizeFlags& f);

// Prints one summary line (tensors quantized, bytes before and after). Nothing is written on any
// error: an OUT that exists and is not empty (kAlreadyExists), an IN that is already 4-bit, a
// GPT-2 or Gemma 3 multimodal IN, a flag out of its choices (kInvalidArgument), IN's one-line
// errors naming the file and tensor, I/O errors.
Status RunQuantize(const QuantizeFlags& f);

}  // namespace strata::tools
