#include "data/text_dataset.h"

#include <fmt/format.h>

#include <cerrno>
#include <fstream>

namespace strata::data {

StatusOr<TextDataset> TextDataset::Load(const std::string& path, int seq_len,
                                        double train_fraction) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return ErrnoToStatus(errno ? errno : ENOENT, fmt::format("cannot open data file '{}'", path));
  }
  TextDataset d;
  d.path_ = path;
  d.bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (in.bad()) return ErrnoToStatus(errno, fmt::format("reading data file '{}'", path));
  d.split_ = static_cast<size_t>(static_cast<double>(d.bytes_.size()) * train_fraction);
  const size_t need = static_cast<size_t>(seq_len) + 1;
  if (d.split_ < need || d.bytes_.size() - d.split_ < need) {
    return InvalidArgumentError(fmt::format(
        "data file '{}' has {} bytes: too short for a 90/10 split with windows of {} tokens", path,
        d.bytes_.size(), need));
  }
  return d;
}

void TextDataset::Window(size_t offset, int seq_len, int32_t* tokens, int32_t* targets) const {
  for (int t = 0; t < seq_len; ++t) {
    tokens[t] = bytes_[offset + t];
    targets[t] = bytes_[offset + t + 1];
  }
}

void TextDataset::SampleTrainBatch(std::mt19937_64& rng, int batch_size, int seq_len,
                                   Batch* batch) const {
  std::vector<int32_t>* tokens = &batch->tokens;
  std::vector<int32_t>* targets = &batch->targets;
  batch->positions.clear();
  tokens->resize(static_cast<size_t>(batch_size) * seq_len);
  targets->resize(tokens->size());
  const uint64_t positions = split_ - seq_len;  // windows [o, o + seq_len] inside the split
  for (int b = 0; b < batch_size; ++b) {
    const size_t o = static_cast<size_t>(rng() % positions);
    Window(o, seq_len, tokens->data() + b * seq_len, targets->data() + b * seq_len);
  }
}

void TextDataset::ValBatch(int index, int count, int batch_size, int seq_len, Batch* batch) const {
  std::vector<int32_t>* tokens = &batch->tokens;
  std::vector<int32_t>* targets = &batch->targets;
  batch->positions.clear();
  tokens->resize(static_cast<size_t>(batch_size) * seq_len);
  targets->resize(tokens->size());
  const uint64_t positions = val_bytes() - seq_len;
  const uint64_t windows = static_cast<uint64_t>(count) * batch_size;
  for (int b = 0; b < batch_size; ++b) {
    const uint64_t k = static_cast<uint64_t>(index) * batch_size + b;
    const size_t o = split_ + static_cast<size_t>(k * positions / windows);
    Window(o, seq_len, tokens->data() + b * seq_len, targets->data() + b * seq_len);
  }
}

std::string TextDataset::Describe() const {
  return fmt::format("'{}' as bytes, {} bytes (train {}, val {})", path_, size_bytes(),
                     train_bytes(), val_bytes());
}

std::vector<int32_t> TextDataset::Encode(std::string_view text) {
  std::vector<int32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<uint8_t>(text[i]);
  return out;
}

}  // namespace strata::data
