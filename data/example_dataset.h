// Example data for the trainer: token files with per-token flags (data/token_dataset.h, written
// by `strata tokenize` from instruction data, data/instruction_data.h) read as whole examples,
// one per row or packed several to a row, never as windows that cut across examples.
//
// Examples: an example begins at token 0 and at every token with kTokenFlagExampleStart, and
// runs to the next begin. Rows of seq_len (T) tokens are laid out once, when the data is opened:
//   - one example per row (pack false): an example longer than T is truncated to its first T
//     tokens (LongExamples::kTruncate), left out (kSkip) or refused (kRefuse: Create fails,
//     naming the example's file and token); a shorter one is padded;
//   - packed (pack true): examples, in file order, are placed greedily into rows: an example
//     that does not fit in the rest of the current row starts the next row; longer than T:
//     truncated or left out as above; the rest of each row padded.
// Padding: the pad id (the tokenizer's EOS, else 0), target kIgnoreTarget, position 0 (each pad
// token a one-token example of its own: it sees only itself, and max(positions) + 1 is the
// longest example's length, the sequence length transformers sees for a batch padded to its
// longest example or packed without padding, which LongRoPE's factors depend on; no real token
// sees a pad token either way, so this changes no loss or gradient). Positions restart at 0 at
// each example. Targets:
//   targets[t] = tokens[t + 1] when t + 1 is in the same row and the same example and its flags
//                have kTokenFlagInLoss; else kIgnoreTarget
// so an example's last token never predicts the next example's first, and a truncated example's
// last token in the row predicts nothing. An example left without a target in the loss (its
// prompt fills the first T tokens, or it has no response tokens) is left out and counted
// (SplitStats::no_target): rows of it alone would train nothing, and a step that drew only such
// rows would have no loss to take a mean of.
//
// Thread-safety: immutable after Create; every const method may run concurrently.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "data/dataset.h"
#include "data/token_dataset.h"

namespace strata::data {

struct ExampleRowOptions {
  int seq_len = 0;  // T: tokens per row
  bool pack = false;
  LongExamples long_examples = LongExamples::kTruncate;
  int32_t pad_id = 0;  // below the vocabulary
};

// The first token of every example of `tokens` (see above), ascending; {0} for one example,
// empty for no tokens. Precondition (checked): tokens.has_flags().
std::vector<int64_t> ExampleStarts(const TokenDataset& tokens);

// `tokens` split at an example boundary: the first floor(n * train_fraction) of its n examples
// (at least 1, at most n - 1) and the rest. Precondition (checked): tokens.has_flags().
// Errors: kInvalidArgument (naming `what`) for fewer than 2 examples.
StatusOr<std::pair<TokenDataset, TokenDataset>> SplitExamples(const TokenDataset& tokens,
                                                              double train_fraction,
                                                              std::string_view what);

class ExampleDataset final : public Dataset {
 public:
  // Lays out the rows of both splits (one pass over their flags). `description` names the
  // source for Describe(). Errors: kInvalidArgument for a split without flags, options out of
  // range (seq_len <= 0, a negative pad id), an example longer than seq_len with kRefuse, or a
  // split left without rows (every example skipped or without a target in the loss).
  static StatusOr<ExampleDataset> Create(TokenDataset train, TokenDataset val,
                                         const ExampleRowOptions& options, std::string description);
  // One set of files that is both splits (what `strata eval` scores: its rows are the
  // validation split's). Errors as Create's, naming `description` (e.g. the token files), not a
  // training split there is none of.
  static StatusOr<ExampleDataset> CreateWhole(TokenDataset tokens, const ExampleRowOptions& options,
                                              std::string description);

  // What a split holds once laid out.
  struct SplitStats {
    int64_t examples = 0;        // in the files
    int64_t rows = 0;            // of seq_len tokens
    int64_t truncated = 0;       // examples cut to seq_len tokens
    int64_t skipped = 0;         // examples left out (longer than seq_len, kSkip)
    int64_t no_target = 0;       // examples left out: no target in the loss in the row (a
                                 // prompt longer than seq_len, truncated; an empty response)
    int64_t tokens = 0;          // example tokens placed in rows (padding not counted)
    int64_t tokens_in_loss = 0;  // targets other than kIgnoreTarget over all rows
  };
  const SplitStats& train_stats() const { return train_.stats; }
  const SplitStats& val_stats() const { return val_.stats; }

  // Example tokens placed in each split's rows.
  int64_t train_tokens() const override { return train_.stats.tokens; }
  int64_t val_tokens() const override { return val_.stats.tokens; }

  // batch_size rows drawn uniformly with `rng` (row = rng() % rows); tokens, targets and
  // positions batch_size * seq_len each. Precondition (checked): seq_len == options.seq_len.
  void SampleTrainBatch(std::mt19937_64& rng, int batch_size, int seq_len,
                        Batch* batch) const override;
  // Rows k * rows / (count * batch_size) of the validation split for k = index * batch_size +
  // b. Precondition (checked): seq_len == options.seq_len, 0 <= index < count.
  void ValBatch(int index, int count, int batch_size, int seq_len, Batch* batch) const override;
  // Rows [first, first + n) of the validation split, in order (an evaluation over every row).
  // Precondition (checked): seq_len == options.seq_len, 0 <= first, n >= 0, first + n <= rows.
  void ValRows(int64_t first, int n, int seq_len, Batch* batch) const;

  // "<description>: 120 examples (train 108, val 12) in 40 rows of 256 tokens (train 36, val
  // 4), packed; 2 truncated to 256 tokens; 9876 tokens in loss (train ..., val ...)".
  std::string Describe() const override;

 private:
  // A run of one example's tokens in a row: tokens [begin, begin + length) of the split.
  struct Piece {
    int64_t begin = 0;
    int32_t length = 0;
  };
  struct Split {
    explicit Split(TokenDataset t) : tokens(std::move(t)) {}
    TokenDataset tokens;
    std::vector<Piece> pieces;
    std::vector<int64_t> row_starts;  // row r is pieces [row_starts[r], row_starts[r + 1])
    SplitStats stats;
  };
  ExampleDataset(Split train, Split val, const ExampleRowOptions& options, std::string description)
      : options_(options),
        train_(std::move(train)),
        val_(std::move(val)),
        description_(std::move(description)) {}
  static StatusOr<Split> LayOut(TokenDataset tokens, const ExampleRowOptions& options,
                                std::string_view what);
  // Row `row` of `split` into tokens/targets/positions (seq_len each); `flags`: scratch.
  void FillRow(const Split& split, int64_t row, int32_t* tokens, int32_t* targets,
               int32_t* positions, std::vector<uint8_t>& flags) const;
  void Fill(const Split& split, const std::vector<int64_t>& rows, Batch* batch) const;

  ExampleRowOptions options_;
  Split train_;
  Split val_;
  std::string description_;
};

}  // namespace strata::data
