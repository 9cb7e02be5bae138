// Preference data for the trainer: token files whose flags mark pairs (data/token_dataset.h:
// kTokenFlagPairStart on each pair's chosen sequence, the next example its rejected sequence;
// written by `strata tokenize` from TRL's preference data, data/preference_data.h) read as
// micro-batches that keep every pair's two sides together, for DPO-style objectives that compare
// the chosen and the rejected completion of a pair.
//
// Pairs: the data is a run of pairs, each a chosen sequence (an example whose first token has
// kTokenFlagExampleStart | kTokenFlagPairStart; token 0 always begins an example) followed by
// exactly one rejected sequence (an example without kTokenFlagPairStart). Any other order is
// refused when the data is opened, naming the file and token.
//
// Groups: the pairs, in file order, are laid out once (when the data is opened) into groups of
// B = micro_batch_size rows of T = seq_len tokens; a group is one micro-batch, and both sides of
// a pair are always in the same group:
//   - unpacked (pack false): B must be even; a group holds B / 2 consecutive pairs, the group's
//     pair k with its chosen side in row 2 k and its rejected side in row 2 k + 1; the last group
//     may hold fewer pairs, its other rows padding only;
//   - packed (pack true): sides are placed greedily, in file order, into the rows of the current
//     group, the chosen side then the rejected side: a side that does not fit in the rest of the
//     current row starts the next row, and a pair whose two sides do not both fit in the rest of
//     the group starts the next group. With B = 1 both sides share the group's one row, so a pair
//     whose sides hold more than T tokens together is long too (below).
// Long pairs: a pair with a side longer than T (or, packed with B = 1, sides longer than T
// together) is refused with an error naming its file and number (LongExamples::kRefuse), left
// out (kSkip), or cut (kTruncate): each side to its first T tokens; packed with B = 1, the chosen
// side to min(c, max(T - r, T / 2)) tokens and the rejected side to the rest of the row (c, r:
// the sides' lengths). A pair one of whose sides is left without a target in the loss (cut, or so
// written) is left out and counted (SplitStats::no_target).
//
// Tokens, targets and positions are those of example data (data/example_dataset.h), a side
// being an example: targets[t] = tokens[t + 1] when t + 1 is in the same row and the same side
// and its flags have kTokenFlagInLoss, else kIgnoreTarget; positions restart at 0 at each side;
// padding is the pad id at position 0 (each pad token a one-token example of its own, as in
// example data). Batch::sequences (B, T) is 2 k for a counted target of the group's pair k's chosen
// side, 2 k + 1 for its rejected side, -1 where the target is kIgnoreTarget; Batch::pair_ids[k]
// is the pair's index among its split's laid-out pairs in file order (0 .. train_pairs() - 1 or
// val_pairs() - 1: the pairs of one group are consecutive).
//
// Thread-safety: immutable after Create; every const method may run concurrently.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"
#include "data/dataset.h"
#include "data/token_dataset.h"

namespace strata::data {

struct PreferenceBatchOptions {
  int seq_len = 0;           // T: tokens per row
  int micro_batch_size = 0;  // B: rows per group (micro-batch)
  bool pack = false;
  LongExamples long_examples = LongExamples::kTruncate;
  int32_t pad_id = 0;  // below the vocabulary
};

// Whether a token of `tokens` has kTokenFlagPairStart (one pass over the flags): preference
// data. Precondition (checked): tokens.has_flags().
bool HasPairStarts(const TokenDataset& tokens);

class PreferenceDataset final : public Dataset {
 public:
  // Finds the pairs of both splits (one pass over their flags) and lays out their groups.
  // `description` names the source for Describe(). Errors (kInvalidArgument, one line):
  //   - a split without flags, or whose sequences do not alternate as pairs (naming the file
  //     and the token);
  //   - options out of range: seq_len or micro_batch_size not positive ("--micro-batch-size"),
  //     an odd micro_batch_size unpacked, a negative pad id;
  //   - a long pair with LongExamples::kRefuse ("'pairs.bin': pair 17 (token 5120) has a chosen
  //     side of 300 tokens, longer than --seq-len 256; pass --long-examples truncate or skip"),
  //     the pair numbered from 0 in its file;
  //   - a split left without pairs (none, or every one left out).
  static StatusOr<PreferenceDataset> Create(TokenDataset train, TokenDataset val,
                                            const PreferenceBatchOptions& options,
                                            std::string description);
  // One set of files split at a pair boundary: the first floor(n * train_fraction) of its n
  // pairs (at least 1, at most n - 1) for training, the rest for validation. Errors: Create's,
  // and kInvalidArgument for fewer than 2 pairs.
  static StatusOr<PreferenceDataset> CreateHeldOut(TokenDataset tokens, double train_fraction,
                                                   const PreferenceBatchOptions& options,
                                                   std::string description);

  // What a split holds once laid out.
  struct SplitStats {
    int64_t pairs = 0;           // in the files
    int64_t groups = 0;          // of micro_batch_size rows of seq_len tokens
    int64_t truncated = 0;       // pairs kept with a side cut (kTruncate)
    int64_t skipped = 0;         // pairs left out as long (kSkip)
    int64_t no_target = 0;       // pairs left out with a side without a target in the loss
    int64_t tokens = 0;          // pair tokens placed in rows (padding not counted)
    int64_t tokens_in_loss = 0;  // targets other than kIgnoreTarget over all groups
  };
  const SplitStats& train_stats() const { return train_.stats; }
  const SplitStats& val_stats() const { return val_.stats; }
  const PreferenceBatchOptions& options() const { return options_; }

  int64_t train_groups() const { return train_.stats.groups; }
  int64_t val_groups() const { return val_.stats.groups; }
  // Laid-out pairs (those not left out): the range of Batch::pair_ids.
  int64_t train_pairs() const { return static_cast<int64_t>(train_.pairs.size()); }
  int64_t val_pairs() const { return static_cast<int64_t>(val_.pairs.size()); }

  // Group g of a split into `batch`: tokens, targets, positions and sequences B * T each,
  // pair_ids one per pair of the group. Precondition (checked): 0 <= g < groups.
  void TrainGroup(int64_t g, Batch* batch) const;
  void ValGroup(int64_t g, Batch* batch) const;

  // Pair tokens placed in each split's rows.
  int64_t train_tokens() const override { return train_.stats.tokens; }
  int64_t val_tokens() const override { return val_.stats.tokens; }
  // One group drawn uniformly with one draw of `rng` (g = rng() % train_groups()).
  // Precondition (checked): batch_size == micro_batch_size, seq_len == options.seq_len.
  void SampleTrainBatch(std::mt19937_64& rng, int batch_size, int seq_len,
                        Batch* batch) const override;
  // Validation group index * val_groups() / count. Precondition (checked): batch_size ==
  // micro_batch_size, seq_len == options.seq_len, 0 <= index < count.
  void ValBatch(int index, int count, int batch_size, int seq_len, Batch* batch) const override;

  // "<description>: 120 pairs (train 108, val 12) in 40 micro-batches of 4 rows of 256 tokens
  // (train 36, val 4), packed; 2 truncated to 256 tokens; 9876 tokens in loss (train ..., val
  // ...)".
  std::string Describe() const override;

 private:
  // A pair as the flags give it: tokens [chosen, rejected) are its chosen side, [rejected, end)
  // its rejected side (offsets in the scanned data).
  struct FoundPair {
    int64_t chosen = 0;
    int64_t rejected = 0;
    int64_t end = 0;
  };
  // One side placed in a group: tokens [begin, begin + length) of the split's data at columns
  // [column, column + length) of the group's row `row`.
  struct Placed {
    int64_t begin = 0;
    int32_t length = 0;
    int32_t row = 0;
    int32_t column = 0;
  };
  struct LaidPair {
    Placed chosen;
    Placed rejected;
  };
  struct Split {
    explicit Split(TokenDataset t) : tokens(std::move(t)) {}
    TokenDataset tokens;
    std::vector<LaidPair> pairs;        // laid out, in file order: the pair id is the index
    std::vector<int64_t> group_starts;  // group g is pairs [group_starts[g], group_starts[g + 1])
    SplitStats stats;
  };

  PreferenceDataset(Split train, Split val, const PreferenceBatchOptions& options,
                    std::string description)
      : options_(options),
        train_(std::move(train)),
        val_(std::move(val)),
        description_(std::move(description)) {}
  static Status CheckOptions(const PreferenceBatchOptions& options);
  static StatusOr<std::vector<FoundPair>> FindPairs(const TokenDataset& tokens);
  // Lays out pairs[first, last) of `found`, the pairs of `tokens`; `what` names the split.
  static StatusOr<Split> LayOut(TokenDataset tokens, const std::vector<FoundPair>& found,
                                size_t first, size_t last, const PreferenceBatchOptions& options,
                                std::string_view what);
  void FillGroup(const Split& split, int64_t g, Batch* batch) const;

  PreferenceBatchOptions options_;
  Split train_;
  Split val_;
  std::string description_;
};

}  // namespace strata::data
