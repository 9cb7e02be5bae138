// A Hugging Face model directory as the source of a model's initial master weights:
//
//   DIR/config.json                       (models/hf_config.h)
//   DIR/model.safetensors                 one file, or
//   DIR/model.safetensors.index.json      {"metadata": {...}, "weight_map": {tensor: shard}}
//   DIR/<shard>.safetensors ...           the shards it names (plain file names in DIR)
//   DIR/tokenizer.model, tokenizer.json, ... (optional; listed by tokenizer_files())
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
// Memory: the shard files stay open (one fd each) with their parsed headers; ReadBlock stages at
// most kStagingBytes of file data at a time besides its output.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "formats/safetensors.h"
#include "models/hf_config.h"
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
  // Paths (DIR/NAME) of the tokenizer files present in DIR, in this order: tokenizer.model,
  // tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab.json, merges.txt.
  const std::vector<std::string>& tokenizer_files() const { return tokenizer_files_; }
  // The safetensors files read, in name order (DIR/model.safetensors or the shards).
  std::vector<std::string> weight_files() const;

  // Writes block `block`'s chunk as fp32 (out.size() == block_num_params(block), else
  // kInvalidArgument): each tensor read with pread in pieces of at most kStagingBytes (F32 data
  // straight into `out` when it is not transposed), F16/BF16 converted exactly to fp32.
  // kDataLoss naming the file and tensor on a short read (a file truncated since Open); other
  // I/O errors errno-derived, naming the file. Thread-compatible: one call at a time.
  Status ReadBlock(int block, std::span<float> out) const override;

 private:
  struct Shard {
    std::string path;
    formats::OpenSafetensors file;
  };
  struct Source {
    HfTensor layout;  // name is the canonical Hugging Face name
    int shard = 0;
    const formats::SafetensorsTensor* tensor = nullptr;  // points into shards_[shard]
  };
  HfCheckpoint() = default;

  std::string dir_;
  HfModelConfig config_;
  std::vector<std::unique_ptr<Shard>> shards_;  // stable addresses for Source::tensor
  std::vector<std::vector<Source>> blocks_;
  std::vector<int64_t> block_num_params_;
  std::vector<std::string> block_names_;
  std::vector<std::string> tokenizer_files_;
};

}  // namespace strata::models
