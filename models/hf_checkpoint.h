// A Hugging Face model directory as the source of a model's initial master weights:
//
//   DIR/config.json                       (models/hf_config.h)
//   DIR/model.safetensors                 one file, or
//   DIR/model.safetensors.index.json      {"metadata": {...}, "weight_map": {tensor: shard}}
//   DIR/<shard>.safetensors ...           the shards it names (plain file names in DIR)
//   DIR/tokenizer.model, tokenizer.json, ... (optional; listed by companion_files())
//
// Open reads the config and the headers of every safetensors file (never tensor data), and
// checks, before any training starts, every tensor the config implies (HfBlockTensors): present
// (in the index and in the shard it names), dtype F32, F16 or BF16, exactly the expected shape.
// Tensors the model does not use are an error naming them (a config/checkpoint mismatch), except
// the buffers Hugging Face saves with some models ("*.attn.bias", "*.attn.masked_bias",
// "*rotary_emb.inv_freq") and a tied model's "lm_head.weight", which are ignored. GPT-2 names
// are accepted with or without the "transformer." prefix (the original gpt2 upload has none).
//
// Every Open error is ONE line naming the file and, where there is one, the tensor:
// kNotFound (missing config.json, weights or shard file), kInvalidArgument (config field, index
// entry missing, wrong dtype or shape, unexpected tensor, bad shard name), kDataLoss (a
// safetensors file whose header is malformed or whose data ranges lie outside the file).
//
// Files may be symbolic links (the Hugging Face hub cache's snapshots link to blobs).
//
// A bitsandbytes 4-bit directory (config.json's quantization_config, models/hf_bnb.h: QLoRA's
// base, issue 45) stores the tensors HfBaseQuantized names as bitsandbytes' parts (the packed
// codes under the weight's own name, absmax, quant_map, nested_absmax, nested_quant_map,
// quant_state); Open checks every part's dtype and shape, and also reads the small ones (the
// quant_map, the nested_quant_map and the quant_state JSON: under 2 KiB a tensor) to check them
// against bitsandbytes' tables and the config (blocksize 64, nested_blocksize 256, the shape).
// Its other tensors are read as in a plain directory. Such a directory is refused for GPT-2.
//
// Memory: the shard files stay open (one fd each) with their parsed headers; ReadBlock stages at
// most kStagingBytes of file data at a time besides its output, and a 4-bit tensor's packed
// record (ops::Quant4Layout::total_bytes, about n / 2 bytes) whole.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "formats/safetensors.h"
#include "models/hf_config.h"
#include "models/ops/quantize_4bit.h"
#include "models/weight_source.h"

namespace strata::models {

class HfCheckpoint final : public WeightSource {
 public:
  // The largest read ReadBlock makes into its staging buffers (16-bit data, and transposed
  // tensors) in bytes.
  static constexpr int64_t kStagingBytes = int64_t{4} << 20;

  static StatusOr<std::shared_ptr<HfCheckpoint>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const HfModelConfig& config() const { return config_; }
  // Blocks as the family's engine model numbers them (0 embedding, 1..L layers, L + 1 head) with
  // the same chunk sizes (GptModel / the Llama model; a tied head holds no lm_head).
  int num_blocks() const { return static_cast<int>(blocks_.size()); }
  int64_t block_num_params(int block) const;
  // "embedding", "layer0", ..., "head".
  const std::vector<std::string>& block_names() const { return block_names_; }
  // Paths (DIR/NAME) of the files that travel with the weights, those present in DIR, in this
  // order: the tokenizer's (tokenizer.model, tokenizer.json, tokenizer_config.json,
  // special_tokens_map.json, vocab.json, merges.txt), its chat_template.jinja, and
  // generation_config.json (the sampling defaults and end-of-turn ids). Export and quantize copy
  // them into the directories they write, as save_pretrained does.
  const std::vector<std::string>& companion_files() const { return companion_files_; }
  // The safetensors files read, in name order (DIR/model.safetensors or the shards).
  std::vector<std::string> weight_files() const;
  // The stored element type of each tensor of `block`, in HfBlockTensors order (U8: a 4-bit
  // tensor's codes). block in [0, num_blocks()) (STRATA_CHECK).
  std::vector<formats::TensorDType> block_dtypes(int block) const;

  // Writes block `block`'s chunk as fp32 (out.size() == block_num_params(block), else
  // kInvalidArgument): each tensor read with pread in pieces of at most kStagingBytes (F32 data
  // straight into `out` when it is not transposed), F16/BF16 converted exactly to fp32.
  // kDataLoss naming the file and tensor on a short read (a file truncated since Open); other
  // I/O errors errno-derived, naming the file. Thread-compatible: one call at a time.
  // A 4-bit tensor is dequantized (ops::Dequantize4bit<float>: fp32, not rounded to the
  // quant_state's dtype), so eval, export and full fine-tunes read a 4-bit directory unchanged.
  Status ReadBlock(int block, std::span<float> out) const override;
  // ReadBlock without the 4-bit tensors (their elements untouched), as WeightSource says.
  Status ReadBlockSkippingQuantized(int block, std::span<float> out) const override;

  // The directory's 4-bit quantization (config.json's bitsandbytes quantization_config);
  // nullopt for a directory of 16/32-bit weights.
  std::optional<ops::Quant4Params> base_quant() const override { return base_quant_; }
  // Whether the tensor at `chunk_offset` of `block` is stored 4-bit: what the directory holds
  // (a projection llm_int8_skip_modules keeps is stored 16-bit). False out of range.
  bool HoldsQuantized(int block, int64_t chunk_offset) const override;
  // The packed record (ops::Quant4Layout's parts: codes, absmax, nested_absmax, offset; padding
  // zero) of the 4-bit tensor of `block` at element `chunk_offset` of the block's chunk (an
  // HfTensor::chunk_offset of a tensor HfBaseQuantized names), read from the directory as
  // bitsandbytes stored it, into `record` (host memory, layout.total_bytes, OVERWRITTEN).
  // `layout` must be ops::MakeQuant4Layout(num_elems, *base_quant()). Errors: kInvalidArgument
  // (no 4-bit tensor there, another layout, a record of another size), kDataLoss naming the file
  // and tensor on a short read, errno-derived ones. Thread-safe (pread only).
  Status ReadQuantizedTensor(int block, int64_t chunk_offset, const ops::Quant4Layout& layout,
                             std::span<std::byte> record) const override;

 private:
  struct Shard {
    std::string path;
    formats::OpenSafetensors file;
  };
  // A stored tensor: its shard and its header there (pointing into shards_[shard]).
  struct Stored {
    int shard = 0;
    const formats::SafetensorsTensor* tensor = nullptr;
  };
  // A 4-bit tensor's parts (models/hf_bnb.h); nested_absmax unset without double quantization.
  struct Quantized {
    ops::Quant4Layout layout;
    Stored absmax, nested_absmax;
    float nested_offset = 0;  // from the quant_state JSON
  };
  struct Source {
    HfTensor layout;  // name is the canonical Hugging Face name
    int shard = 0;
    const formats::SafetensorsTensor* tensor = nullptr;  // points into shards_[shard]; the codes
    std::optional<Quantized> quantized;                  // of a 4-bit tensor
  };
  HfCheckpoint() = default;
  // Reads out.size() bytes at `offset_bytes` of a stored tensor; errors name the file and tensor.
  Status ReadStored(const Stored& part, uint64_t offset_bytes, std::span<std::byte> out) const;
  // The packed record of a 4-bit source (record.size() == its layout's total_bytes).
  Status ReadBlockImpl(int block, std::span<float> out, bool skip_quantized) const;
  Status ReadRecord(const Source& src, std::span<std::byte> record) const;

  std::string dir_;
  HfModelConfig config_;
  std::optional<ops::Quant4Params> base_quant_;
  std::vector<std::unique_ptr<Shard>> shards_;  // stable addresses for Source::tensor
  std::vector<std::vector<Source>> blocks_;
  std::vector<int64_t> block_num_params_;
  std::vector<std::string> block_names_;
  std::vector<std::string> companion_files_;
};

// The weight_map of a model.safetensors.index.json: `text`, read from `index_path` (which
// messages name). Returns tensor name -> shard file name, each shard a plain file name inside
// the model directory (not empty, ".", "..", no '/', '\\' or control character, at most 255
// bytes). The rest of the file ("metadata") is not read. kInvalidArgument, one line naming the
// file and, for a bad entry, the tensor (excerpts escaped, base/untrusted_text.h), when the text
// is not JSON, nests deeper than kMaxJsonDepth, or is not an object with a "weight_map" object
// of such strings. Pure function; fuzzed by tests/fuzz/hf_index_json_fuzz.cc.
StatusOr<std::map<std::string, std::string>> ParseSafetensorsIndex(std::string_view text,
                                                                   std::string_view index_path);

}  // namespace strata::models
