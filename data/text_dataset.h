// Byte-level text data: every byte is a token (vocabulary 256). The file is
// split into a training part (the first 90%) and a validation part (the rest).
// One of the trainer's Datasets (data/dataset.h).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "data/dataset.h"

namespace strata::data {

class TextDataset final : public Dataset {
 public:
  // Reads the whole file. Errors: kNotFound / kPermissionDenied naming the path;
  // kInvalidArgument when either split is shorter than seq_len + 1 bytes.
  static StatusOr<TextDataset> Load(const std::string& path, int seq_len,
                                    double train_fraction = 0.9);

  size_t size_bytes() const { return bytes_.size(); }
  size_t train_bytes() const { return split_; }
  size_t val_bytes() const { return bytes_.size() - split_; }
  int64_t train_tokens() const override { return static_cast<int64_t>(train_bytes()); }
  int64_t val_tokens() const override { return static_cast<int64_t>(val_bytes()); }
  // "'path' as bytes, N bytes (train ..., val ...)".
  std::string Describe() const override;

  // Fills batch->tokens/targets (batch_size * seq_len each; targets are the tokens
  // shifted by one) with windows at uniformly random offsets of the training
  // split, drawn from `rng`: the data position is the rng state. positions: empty.
  void SampleTrainBatch(std::mt19937_64& rng, int batch_size, int seq_len,
                        Batch* batch) const override;
  // The i-th of `count` evenly spaced windows of the validation split. positions: empty.
  void ValBatch(int index, int count, int batch_size, int seq_len, Batch* batch) const override;
  // Tokens of `text` (bytes), for prompts.
  static std::vector<int32_t> Encode(std::string_view text);

 private:
  void Window(size_t offset, int seq_len, int32_t* tokens, int32_t* targets) const;
  std::string path_;
  std::vector<uint8_t> bytes_;
  size_t split_ = 0;
};

}  // namespace strata::data
