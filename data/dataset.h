// The trainer's view of its data, whatever its source: a training split it samples windows
// from and a validation split it evaluates on. Implemented by TextDataset (bytes of one text
// file, split 90/10) and TokenTrainingData (llm.c token files, or text tokenized by a
// SentencePiece model into a cached token file). OpenTrainingData picks one from flag-like
// options.
//
// Windows: a window at offset o is tokens [o, o + seq_len) as inputs and [o + 1, o + seq_len]
// as targets (the inputs shifted by one).
//
// Thread-safety: the const methods of every implementation may run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/status.h"
#include "data/tokenizer.h"

namespace strata::data {

class Dataset {
 public:
  virtual ~Dataset() = default;

  // Tokens in each split.
  virtual int64_t train_tokens() const = 0;
  virtual int64_t val_tokens() const = 0;

  // Fills tokens/targets (batch_size * seq_len each, resized here) with batch_size windows at
  // uniformly random offsets of the training split, drawn from `rng`: the data position is the
  // rng state. Precondition (checked when the data is opened): train_tokens() > seq_len.
  virtual void SampleTrainBatch(std::mt19937_64& rng, int batch_size, int seq_len,
                                std::vector<int32_t>* tokens,
                                std::vector<int32_t>* targets) const = 0;
  // Batch `index` of `count` batches of evenly spaced windows over the validation split
  // (count * batch_size windows in all). Precondition: 0 <= index < count, val_tokens() > seq_len.
  virtual void ValBatch(int index, int count, int batch_size, int seq_len,
                        std::vector<int32_t>* tokens, std::vector<int32_t>* targets) const = 0;

  // One line for the run's header, e.g. "data: 3 token files (uint16), 1.2M tokens (train
  // ..., val ...)".
  virtual std::string Describe() const = 0;
};

// Flag-like options of OpenTrainingData (tools/ turns --data, --val-data, --tokenizer into it).
struct TrainingDataOptions {
  // --data: token files (paths or globs, concatenated in order), or one text file.
  std::vector<std::string> data;
  // --val-data: validation token files, or one text file when `tokenizer` is set. Empty: the
  // last `1 - train_fraction` of the training tokens are held out.
  std::vector<std::string> val_data;
  // --tokenizer: a SentencePiece model; text is tokenized with it (once, into a cache beside
  // the text: see TokenCachePath). Empty: text is byte-level (vocabulary 256).
  std::string tokenizer;
  int seq_len = 0;
  // The model's vocabulary: every token must be below it.
  int vocab_size = 0;
  double train_fraction = 0.9;
};

struct TrainingData {
  std::unique_ptr<Dataset> dataset;
  // The tokenizer that produced the tokens (for prompts and samples); null for token files
  // (the file does not say which tokenizer made it) and for byte-level text.
  std::unique_ptr<Tokenizer> tokenizer;
  // True when the tokens are bytes (TextDataset): a sample decodes as bytes.
  bool byte_level = false;
};

// Chooses the data source:
//   - the first entry of `data` is a glob, is named *.bin or *.tokens, or is a file that starts
//     with the llm.c magic (20240520): token files (TokenDataset::Open: every file is validated,
//     every token checked against vocab_size); validation from `val_data`, else the last 1 -
//     train_fraction (10%) held out;
//   - else, with `tokenizer`: `data` is one text file, tokenized into its cache (made or
//     reused), then as token files; `val_data` may be text (tokenized the same way) or tokens;
//   - else: one text file, byte-level, split 90/10 exactly as TextDataset::Load always did
//     (bit-identical batches for the same rng); `val_data` is then an error.
// Errors (one line naming the file): those of TokenDataset::Open, Tokenizer::Load,
// TextDataset::Load and TokenizeTextFileCached; kInvalidArgument for no --data, several text
// files, a split shorter than seq_len + 1 tokens, a tokenizer whose vocabulary exceeds
// vocab_size, or byte-level text with a vocab_size below 256.
StatusOr<TrainingData> OpenTrainingData(const TrainingDataOptions& options);

}  // namespace strata::data
