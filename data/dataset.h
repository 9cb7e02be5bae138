// The trainer's view of its data, whatever its source: a training split it samples windows
// from and a validation split it evaluates on. Implemented by TextDataset (bytes of one text
// file, split 90/10) and TokenTrainingData (llm.c token files, or text tokenized by a
// SentencePiece model into a cached token file), ExampleDataset (token files with per-token
// flags: whole examples, a loss mask, positions) and PreferenceDataset (token files whose flags
// mark preference pairs: micro-batches of whole pairs). OpenTrainingData picks one from
// flag-like options.
//
// Windows: a window at offset o is tokens [o, o + seq_len) as inputs and [o + 1, o + seq_len]
// as targets (the inputs shifted by one). Example data (token files with flags,
// data/example_dataset.h) fills rows of whole examples instead, with ignored targets and
// positions (see Batch).
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

// A target the loss does not count (padding, prompt tokens, an example's last token).
inline constexpr int32_t kIgnoreTarget = -1;

// One micro-batch of B rows of T tokens, filled (and resized) by a Dataset. Owned by the caller,
// reused across calls to avoid allocations.
struct Batch {
  std::vector<int32_t> tokens;   // (B, T) int32 row-major: token ids in [0, vocab)
  std::vector<int32_t> targets;  // (B, T) int32: the id the loss wants at each position, or
                                 // kIgnoreTarget where the loss does not count
  // (B, T) int32: each token's position within its example, or empty: 0..T-1 in every row.
  // Invariant within a row: positions[0] == 0 and positions[t] is either 0 (an example starts at
  // t) or positions[t - 1] + 1. Attention of token t covers tokens t - positions[t] .. t of its
  // row, so a packed example never sees another.
  std::vector<int32_t> positions;
  // Preference data only (data/preference_dataset.h), else empty. sequences (B, T) int32: for
  // each position whose target counts, the completion it belongs to within this micro-batch:
  // 2 k for the chosen side of the micro-batch's pair k, 2 k + 1 for its rejected side; -1
  // where the target is kIgnoreTarget. pair_ids: the index of each of the micro-batch's pairs
  // among its split's pairs (file order), pairs().
  std::vector<int32_t> sequences;
  std::vector<int64_t> pair_ids;
  int pairs() const { return static_cast<int>(pair_ids.size()); }
};

class Dataset {
 public:
  virtual ~Dataset() = default;

  // Tokens in each split.
  virtual int64_t train_tokens() const = 0;
  virtual int64_t val_tokens() const = 0;

  // Fills `batch` (tokens and targets batch_size * seq_len each, resized here; positions empty
  // or batch_size * seq_len) with batch_size rows drawn from the training split with `rng`: the
  // data position is the rng state. Windows at uniformly random offsets for text and plain token
  // files; uniformly drawn rows of examples for example data; one uniformly drawn micro-batch of
  // whole pairs for preference data (batch_size its micro_batch_size). Precondition (checked when
  // the data is opened): the split holds a window of seq_len + 1 tokens (text, plain token files)
  // or a row (example data); seq_len is the one the data was opened with.
  virtual void SampleTrainBatch(std::mt19937_64& rng, int batch_size, int seq_len,
                                Batch* batch) const = 0;
  // Batch `index` of `count` batches of evenly spaced windows (or rows) over the validation split
  // (count * batch_size in all); for preference data, evenly spaced micro-batches of pairs.
  // Precondition: 0 <= index < count, val_tokens() > seq_len.
  virtual void ValBatch(int index, int count, int batch_size, int seq_len, Batch* batch) const = 0;

  // One line for the run's header, e.g. "data: 3 token files (uint16), 1.2M tokens (train
  // ..., val ...)".
  virtual std::string Describe() const = 0;
};

// What happens to an example longer than a row of example data (data/example_dataset.h), or to
// a preference pair with a side longer than a row (data/preference_dataset.h): cut to the row's
// tokens, left out (both counted in the data's statistics), or refused: opening the data is then
// an error naming the file and the example or pair.
enum class LongExamples { kTruncate, kSkip, kRefuse };

class PreferenceDataset;

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
  // Token files with per-token flags (example data, data/example_dataset.h, and preference data,
  // data/preference_dataset.h) only: --pack packs several examples (sides of pairs) into a row;
  // --long-examples truncates, skips or refuses an example (a pair with a side) longer than
  // seq_len.
  bool pack = false;
  LongExamples long_examples = LongExamples::kTruncate;
  // Preference data only: --micro-batch-size, the rows of a micro-batch, which holds whole pairs
  // (a PreferenceDataset lays its groups out for it); must be positive there, and even unless
  // `pack`.
  int micro_batch_size = 0;
};

struct TrainingData {
  std::unique_ptr<Dataset> dataset;
  // The tokenizer that produced the tokens (for prompts and samples); null for token files
  // (the file does not say which tokenizer made it) and for byte-level text.
  std::unique_ptr<Tokenizer> tokenizer;
  // True when the tokens are bytes (TextDataset): a sample decodes as bytes.
  bool byte_level = false;
  // `dataset` itself when it is preference data (its groups, pair counts and statistics), else
  // null. Non-owning: valid as long as `dataset`.
  const PreferenceDataset* preference = nullptr;
};

// Chooses the data source:
//   - the first entry of `data` is a glob, is named *.bin or *.tokens, or is a file that starts
//     with the llm.c magic (20240520): token files (TokenDataset::Open: every file is validated,
//     every token checked against vocab_size); validation from `val_data`, else the last 1 -
//     train_fraction (10%) held out; token files with per-token flags are example data
//     (ExampleDataset: rows of whole examples, `pack` and `long_examples` apply, padding with
//     the tokenizer's EOS id, else 0; the held-out part is the last 10% of the examples, and
//     `val_data` must carry flags too); token files whose flags mark preference pairs
//     (kTokenFlagPairStart) are preference data (PreferenceDataset: micro-batches of
//     micro_batch_size rows holding whole pairs, `pack` and `long_examples` apply, the same
//     padding; the held-out part is the last 10% of the pairs), and `val_data` must be
//     preference data too (and for other training files must not be);
//   - else, with `tokenizer`: `data` is one text file, tokenized into its cache (made or
//     reused), then as token files; `val_data` may be text (tokenized the same way) or tokens;
//   - else: one text file, byte-level, split 90/10 exactly as TextDataset::Load always did
//     (bit-identical batches for the same rng); `val_data` is then an error.
// Errors (one line naming the file): those of TokenDataset::Open, Tokenizer::Load,
// TextDataset::Load, TokenizeTextFileCached, SplitExamples, ExampleDataset::Create and
// PreferenceDataset::Create / CreateHeldOut;
// kInvalidArgument for no --data, a *.jsonl file (instruction and preference data are
// tokenized first), several
// text files, a split shorter than seq_len + 1 tokens,
// a tokenizer whose vocabulary exceeds vocab_size, byte-level text with a vocab_size below 256,
// validation token files without flags for training files with them, or preference data for
// one split and not the other.
StatusOr<TrainingData> OpenTrainingData(const TrainingDataOptions& options);

}  // namespace strata::data
