// Text <-> token ids through a SentencePiece model (Kudo and Richardson, "SentencePiece: A
// simple and language independent subword tokenizer and detokenizer for Neural Text
// Processing", EMNLP 2018), by Debian's libsentencepiece: the tokenizer.model files that
// Llama-family checkpoints ship.
//
// Thread-safety: immutable after Load; Encode and Decode may run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace strata::data {

class Tokenizer {
 public:
  // Reads and loads the SentencePiece model file at `path`.
  // Errors (one line naming the file): the errno-mapped code when it cannot be read (kNotFound,
  // kPermissionDenied, ...); kInvalidArgument when it is not a SentencePiece model.
  static StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  const std::string& path() const { return path_; }
  // XXH3_64bits of the model file's bytes: names the token cache of a text file.
  uint64_t fingerprint() const { return fingerprint_; }

  // Ids are in [0, vocab_size()).
  int vocab_size() const;
  // The beginning/end-of-sequence ids, or -1 when the model has none.
  int bos_id() const;
  int eos_id() const;

  // The ids of `text` (no BOS or EOS added). Errors: kInternal if SentencePiece fails.
  StatusOr<std::vector<int32_t>> Encode(std::string_view text) const;
  // The text of `ids`. Errors: kInvalidArgument for an id outside [0, vocab_size()).
  StatusOr<std::string> Decode(std::span<const int32_t> ids) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl, std::string path, uint64_t fingerprint);
  std::unique_ptr<Impl> impl_;
  std::string path_;
  uint64_t fingerprint_ = 0;
};

// The tokens of a text file treated as one document: the BOS id first when the tokenizer has
// one, then Encode(whole file). What `strata tokenize` writes and the token cache holds.
// Errors: the file's errno-mapped code naming it; Encode's.
StatusOr<std::vector<int32_t>> TokenizeTextFile(const Tokenizer& tokenizer,
                                                const std::string& text_path);

// "<text_path>.<16 lowercase hex digits of tokenizer.fingerprint()>.tokens".
std::string TokenCachePath(const std::string& text_path, const Tokenizer& tokenizer);

// The path of `text_path`'s token cache, made now unless it exists and was modified after both
// the text file and the tokenizer file (then it is reused as is; its contents are validated
// when opened). A made cache is written crash-safely (WriteTokenFile). `*reused` (may be null)
// says which happened.
// Errors: those of TokenizeTextFile and WriteTokenFile; the errno-mapped code of a stat.
StatusOr<std::string> TokenizeTextFileCached(const Tokenizer& tokenizer,
                                             const std::string& text_path, bool* reused);

}  // namespace strata::data
