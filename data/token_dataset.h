// Token data in llm.c's file format, read through read-only memory maps (no copy in RAM).
//
// File format (all integers little-endian):
//   header  256 int32: [0] magic 20240520, [1] version (1: uint16 tokens, 2: uint32 tokens),
//           [2] token count N, [3] flags (0: none, 1: N uint8 flags follow the tokens), the rest
//           unused (written as 0)
//   tokens  N uint16 or uint32
//   flags   (only when header[3] == 1) N uint8, one per token: bit 0 (kTokenFlagInLoss) the
//           token counts in the loss as a target (it is predicted from the tokens before it in
//           its example); bit 1 (kTokenFlagExampleStart) the token begins an example; bit 2
//           (kTokenFlagPairStart) the token begins a preference pair: it is the first token of
//           the pair's chosen sequence (an example, so bit 1 is set too), and the next example
//           is the pair's rejected sequence (bit 1 without bit 2); bits 3-7 zero
// so a file is exactly 1024 + N * (2 or 4) bytes, plus N with flags. llm.c's own files have
// header[3] == 0 and read exactly as they always did: its GPT-2 files are version 1 above, its
// Llama 3 files (dev/data/data_common.py, train_llama3.py) magic 20240801 version 7 with uint32
// tokens, read as version 2 (Strata writes uint32 files as magic 20240520 version 2). Flags are
// what `strata tokenize` writes for instruction data (data/instruction_data.h) and preference data
// (data/preference_data.h), and what example datasets (data/example_dataset.h) and preference
// datasets (data/preference_dataset.h, which checks that the pairs alternate) read.
//
// A TokenDataset is one or more such files (shards) read as one sequence of tokens, in order;
// a Slice of it is a contiguous range of that sequence. Copies share the maps (cheap).
//
// Thread-safety: immutable after Open; every const method may run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "data/dataset.h"

namespace strata::data {

inline constexpr int32_t kTokenFileMagic = 20240520;
// llm.c's Llama 3 token files: this magic, version 7, uint32 tokens.
inline constexpr int32_t kLlama3TokenFileMagic = 20240801;
inline constexpr int32_t kLlama3TokenFileVersion = 7;
inline constexpr int kTokenFileHeaderInts = 256;
inline constexpr int64_t kTokenFileHeaderBytes = kTokenFileHeaderInts * 4;
// Per-token flag bits (header[3] == 1).
inline constexpr uint8_t kTokenFlagInLoss = 1;        // bit 0: a target the loss counts
inline constexpr uint8_t kTokenFlagExampleStart = 2;  // bit 1: the first token of an example
// bit 2: the first token of a preference pair's chosen sequence (with kTokenFlagExampleStart);
// the pair's rejected sequence is the next example.
inline constexpr uint8_t kTokenFlagPairStart = 4;
inline constexpr uint8_t kTokenFlagsKnown =
    kTokenFlagInLoss | kTokenFlagExampleStart | kTokenFlagPairStart;

class TokenDataset {
 public:
  // Opens `patterns` in order: each a path, or a glob(3) pattern whose matches are taken in
  // sorted order. Maps every file and checks it: header present, magic, version, flags word,
  // count equal to what the file size holds, every token < vocab_size (one pass over the
  // tokens), no unknown flag bit (one pass over the flags).
  // Errors, each one line naming the file (and token offset):
  //   kInvalidArgument  no pattern; a glob that matches nothing; a file shorter than the
  //                     header; a bad magic; an unsupported version; a flags word other than
  //                     0 or 1; a count that disagrees with the file size (both given); a token
  //                     >= vocab_size; a flag with an unknown bit; shards of which some carry
  //                     flags and some do not
  //   kNotFound / kPermissionDenied / ...  a file that cannot be opened, mapped or stat'ed
  static StatusOr<TokenDataset> Open(const std::vector<std::string>& patterns, int vocab_size);

  // Tokens in this dataset (or slice).
  int64_t num_tokens() const { return end_ - begin_; }
  // The files, in order, and their token widths in bytes (2 or 4).
  std::vector<std::string> paths() const;
  int max_token_bytes() const;
  // Whether the files carry per-token flags (all of them do, or none: checked by Open).
  bool has_flags() const { return has_flags_; }

  // Where token `offset` of this dataset (or slice) is stored: its file and its index in that
  // file (for errors that name a token). Precondition (checked): 0 <= offset < num_tokens().
  struct Location {
    std::string path;
    int64_t index = 0;
  };
  Location Locate(int64_t offset) const;

  // Tokens [begin, end) of this dataset, sharing its maps. Precondition (checked):
  // 0 <= begin <= end <= num_tokens().
  TokenDataset Slice(int64_t begin, int64_t end) const;

  // Copies tokens [offset, offset + n) into out[0, n) as int32, across shard boundaries.
  // Precondition (checked): 0 <= offset, 0 <= n, offset + n <= num_tokens().
  void Read(int64_t offset, int64_t n, int32_t* out) const;
  // Copies the flags of tokens [offset, offset + n) into out[0, n), across shard boundaries.
  // Precondition (checked): has_flags(), and the range as for Read.
  void ReadFlags(int64_t offset, int64_t n, uint8_t* out) const;

  // batch_size windows (see dataset.h) at uniformly random offsets, drawn from `rng` as
  // TextDataset does: offset = rng() % (num_tokens() - seq_len). batch->tokens/targets are
  // resized to batch_size * seq_len; batch->positions cleared. Flags are not read.
  // Precondition (checked): num_tokens() > seq_len.
  void SampleTrainBatch(std::mt19937_64& rng, int batch_size, int seq_len, Batch* batch) const;
  // Batch `index` of `count` batches of evenly spaced windows, as TextDataset::ValBatch.
  void ValBatch(int index, int count, int batch_size, int seq_len, Batch* batch) const;

  // Evaluation windows, consecutive from the start: window i has inputs
  // tokens[i * seq_len, i * seq_len + seq_len) and targets tokens[i * seq_len + 1,
  // i * seq_len + seq_len + 1). num_windows counts the full windows within the first
  // max_tokens tokens (max_tokens <= 0: all): floor((N - 1) / seq_len) for N = min(max_tokens,
  // num_tokens()) tokens, 0 when N < seq_len + 1.
  int64_t num_windows(int seq_len, int64_t max_tokens = 0) const;
  // tokens/targets: seq_len each. Precondition (checked): index < num_windows(seq_len).
  void EvalWindow(int64_t index, int seq_len, int32_t* tokens, int32_t* targets) const;

 private:
  struct Shard;
  TokenDataset() = default;
  // Maps and validates one file (see Open).
  static StatusOr<std::shared_ptr<Shard>> OpenShard(const std::string& path, int vocab_size);
  static Status CheckTokens(const Shard& shard, int vocab_size);
  void Window(int64_t offset, int seq_len, int32_t* tokens, int32_t* targets) const;
  // fn(shard, local, take, done) for each run of [offset, offset + n) within one shard, in order:
  // `take` items from the shard's item `local`, the run's first item the `done`-th of the range.
  template <typename Fn>
  void ForEachShardRun(int64_t offset, int64_t n, Fn&& fn) const;

  // Shards in order; starts_[i] is the first global token of shards_[i] (starts_.back() is the
  // total), both over the whole file list, not only this slice.
  std::vector<std::shared_ptr<const Shard>> shards_;
  std::vector<int64_t> starts_;
  int64_t begin_ = 0;
  int64_t end_ = 0;
  bool has_flags_ = false;
};

// Whether `path` is a regular file whose header (magic, version, flags word, count) describes
// its size exactly: a cheap check of a token cache before it is reused (a truncated or
// overwritten one is made again). False for anything unreadable. Thread-safe.
bool TokenFileLooksWhole(const std::string& path);

// Writes `tokens` as an llm.c token file at `path`: version 1 (uint16) when every token is
// below 65536, else version 2 (uint32). `flags` empty: no flags (header[3] = 0, a file llm.c
// reads); else one per token (header[3] = 1, the flags after the tokens). Crash-safe: written
// to a temporary file in the same directory, fsynced, renamed over `path`, and the directory
// fsynced; on error `path` is left as it was and the temporary file removed.
// Errors: kInvalidArgument for a negative token, more than 2^31 - 1 tokens, flags whose count
// differs from the tokens' or with a bit outside kTokenFlagsKnown; errno-mapped codes
// (kResourceExhausted for ENOSPC, kPermissionDenied, ...) naming the file.
Status WriteTokenFile(const std::string& path, std::span<const int32_t> tokens,
                      std::span<const uint8_t> flags = {});

// The llm.c token files as the trainer's Dataset: a training set and a validation set, read as
// windows (flags, if any, are not read: OpenTrainingData gives files with flags to
// ExampleDataset instead).
class TokenTrainingData final : public Dataset {
 public:
  // `description` names the source for Describe() (e.g. the files, or "text.txt tokenized").
  TokenTrainingData(TokenDataset train, TokenDataset val, std::string description);

  const TokenDataset& train() const { return train_; }
  const TokenDataset& val() const { return val_; }

  int64_t train_tokens() const override { return train_.num_tokens(); }
  int64_t val_tokens() const override { return val_.num_tokens(); }
  void SampleTrainBatch(std::mt19937_64& rng, int batch_size, int seq_len,
                        Batch* batch) const override {
    train_.SampleTrainBatch(rng, batch_size, seq_len, batch);
  }
  void ValBatch(int index, int count, int batch_size, int seq_len, Batch* batch) const override {
    val_.ValBatch(index, count, batch_size, seq_len, batch);
  }
  std::string Describe() const override;

 private:
  TokenDataset train_;
  TokenDataset val_;
  std::string description_;
};

}  // namespace strata::data
