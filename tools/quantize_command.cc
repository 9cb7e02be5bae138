#include "tools/quantize_command.h"

#include <fmt/format.h>

#include <cstdio>

#include "base/units.h"
#include "models/hf_checkpoint.h"
#include "models/hf_quantize.h"

namespace strata::tools {
namespace {

// The flags as the writer's options (one place).
StatusOr<models::QuantizeHfOptions> QuantizeOptions(const QuantizeFlags& f) {
  models::QuantizeHfOptions options;
  auto type = models::ops::ParseQuant4Type(f.quant);
  if (!type.ok()) {
    return InvalidArgumentError(fmt::format("--quant '{}' is not one of nf4, fp4", f.quant));
  }
  options.params.type = *type;
  if (f.double_quant != "on" && f.double_quant != "off") {
    return InvalidArgumentError(
        fmt::format("--double-quant '{}' is not one of on, off", f.double_quant));
  }
  options.params.double_quant = f.double_quant == "on";
  auto shard = ParseSize(f.max_shard_size);
  if (!shard.ok()) return shard.status().WithContext("--max-shard-size");
  options.max_shard_bytes = *shard;
  if (options.max_shard_bytes == 0) {
    return InvalidArgumentError("--max-shard-size must be positive");
  }
  return options;
}

}  // namespace

void AddQuantizeFlags(CLI::App& cmd, QuantizeFlags& f) {
  cmd.add_option("--model-dir", f.model_dir,
                 "Hugging Face directory of a Llama-family model (llama, mistral, qwen2, qwen3, "
                 "phi3, gemma2, gemma3_text) with 16- or 32-bit weights")
      ->required();
  cmd.add_option("--out-dir", f.out_dir,
                 "Output directory (must not exist or be empty): bitsandbytes 4-bit weights as "
                 "transformers saves them, config.json with its quantization_config, the "
                 "tokenizer files")
      ->required();
  cmd.add_option("--quant", f.quant,
                 "4-bit type of the layers' projections: nf4 (NormalFloat, QLoRA's) or fp4. "
                 "Values are rounded to their 16-bit type first, as bitsandbytes quantizes the "
                 "loaded model: fp16 weights as they are, bf16 as they are, fp32 rounded to bf16. "
                 "Embeddings, norms, biases and the LM head are written as stored")
      ->capture_default_str();
  cmd.add_option("--double-quant", f.double_quant,
                 "on: the block scales themselves in 8 bits (bnb_4bit_use_double_quant), off: "
                 "in fp32")
      ->capture_default_str();
  cmd.add_option("--max-shard-size", f.max_shard_size,
                 "Largest safetensors shard, e.g. 5GB, 2GiB; above it the weights are sharded "
                 "with an index")
      ->capture_default_str();
}

Status RunQuantize(const QuantizeFlags& f) {
  STRATA_ASSIGN_OR_RETURN(const models::QuantizeHfOptions options, QuantizeOptions(f));
  STRATA_ASSIGN_OR_RETURN(auto in, models::HfCheckpoint::Open(f.model_dir));
  STRATA_ASSIGN_OR_RETURN(const models::QuantizeHfSummary s,
                          models::WriteQuantizedHfDirectory(*in, f.out_dir, options));
  std::printf(
      "quantized %lld tensors to %s%s (%lld kept as stored, %s values rounded first) from %s to "
      "%s: %s -> %s in %d file(s)\n",
      static_cast<long long>(s.tensors_quantized),
      std::string(models::ops::Quant4TypeName(options.params.type)).c_str(),
      options.params.double_quant ? " with double quantization" : "",
      static_cast<long long>(s.tensors_kept), std::string(DTypeName(s.quantized_from)).c_str(),
      f.model_dir.c_str(), f.out_dir.c_str(), FormatBytes(s.bytes_before).c_str(),
      FormatBytes(s.bytes_after).c_str(), s.num_shards);
  return Status::Ok();
}

}  // namespace strata::tools
