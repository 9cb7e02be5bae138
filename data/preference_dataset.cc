#include "data/preference_dataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace strata::data {
namespace {

constexpr int64_t kFlagChunk = 1 << 16;

// "'path' token N": where token `offset` of `tokens` is stored.
std::string TokenAt(const TokenDataset& tokens, int64_t offset) {
  const TokenDataset::Location at = tokens.Locate(offset);
  return fmt::format("'{}' token {}", at.path, at.index);
}

// The targets a side cut to `length` tokens has: its tokens 1 .. length - 1 with
// kTokenFlagInLoss (its first token is predicted by nothing in it). `flags`: scratch.
int64_t CountTargets(const TokenDataset& tokens, int64_t begin, int64_t length,
                     std::vector<uint8_t>& flags) {
  flags.resize(static_cast<size_t>(length));
  tokens.ReadFlags(begin, length, flags.data());
  int64_t n = 0;
  for (int64_t t = 1; t < length; ++t) n += (flags[t] & kTokenFlagInLoss) != 0;
  return n;
}

}  // namespace

bool HasPairStarts(const TokenDataset& tokens) {
  STRATA_CHECK_MSG(tokens.has_flags(), "pair starts of token files without flags");
  std::vector<uint8_t> flags(kFlagChunk);
  const int64_t n = tokens.num_tokens();
  for (int64_t begin = 0; begin < n; begin += kFlagChunk) {
    const int64_t take = std::min(kFlagChunk, n - begin);
    tokens.ReadFlags(begin, take, flags.data());
    for (int64_t i = 0; i < take; ++i) {
      if ((flags[i] & kTokenFlagPairStart) != 0) return true;
    }
  }
  return false;
}

Status PreferenceDataset::CheckOptions(const PreferenceBatchOptions& o) {
  if (o.seq_len <= 0) {
    return InvalidArgumentError(fmt::format("sequence length {} is not positive", o.seq_len));
  }
  if (o.micro_batch_size <= 0) {
    return InvalidArgumentError(fmt::format(
        "micro-batch size {} is not positive (--micro-batch-size)", o.micro_batch_size));
  }
  if (!o.pack && o.micro_batch_size % 2 != 0) {
    return InvalidArgumentError(fmt::format(
        "--micro-batch-size {} is odd: unpacked preference data puts each pair in two rows (its "
        "chosen and its rejected side); give an even size, or --pack",
        o.micro_batch_size));
  }
  if (o.pad_id < 0) return InvalidArgumentError(fmt::format("pad id {} is negative", o.pad_id));
  return Status::Ok();
}

StatusOr<std::vector<PreferenceDataset::FoundPair>> PreferenceDataset::FindPairs(
    const TokenDataset& tokens) {
  std::vector<FoundPair> pairs;
  // Of the last pair: none yet, its chosen side found, or both sides.
  enum { kNone, kChosen, kBoth } state = kNone;
  std::vector<uint8_t> flags(kFlagChunk);
  const int64_t n = tokens.num_tokens();
  for (int64_t begin = 0; begin < n; begin += kFlagChunk) {
    const int64_t take = std::min(kFlagChunk, n - begin);
    tokens.ReadFlags(begin, take, flags.data());
    for (int64_t i = 0; i < take; ++i) {
      const int64_t t = begin + i;
      const uint8_t f = flags[i];
      const bool pair_start = (f & kTokenFlagPairStart) != 0;
      if (pair_start && (f & kTokenFlagExampleStart) == 0) {
        return InvalidArgumentError(
            fmt::format("{}: flags 0x{:02x} begin a pair (bit 2) but no example (bit 1)",
                        TokenAt(tokens, t), f));
      }
      if (t != 0 && (f & kTokenFlagExampleStart) == 0) continue;
      if (pair_start) {
        if (state == kChosen) {
          return InvalidArgumentError(
              fmt::format("{}: a pair begins before the pair begun at {} has its rejected sequence",
                          TokenAt(tokens, t), TokenAt(tokens, pairs.back().chosen)));
        }
        if (!pairs.empty()) pairs.back().end = t;
        pairs.push_back({.chosen = t});
        state = kChosen;
      } else if (state == kNone) {
        return InvalidArgumentError(fmt::format(
            "{}: the data begins with a sequence that begins no preference pair (flag bit 2 "
            "missing): preference data is pairs of a chosen and a rejected sequence",
            TokenAt(tokens, t)));
      } else if (state == kBoth) {
        return InvalidArgumentError(fmt::format(
            "{}: a third sequence in the pair begun at {}: a pair is its chosen sequence and "
            "exactly one rejected sequence",
            TokenAt(tokens, t), TokenAt(tokens, pairs.back().chosen)));
      } else {
        pairs.back().rejected = t;
        state = kBoth;
      }
    }
  }
  if (state == kChosen) {
    return InvalidArgumentError(fmt::format(
        "{}: the pair begun here has no rejected sequence (the data ends after its chosen one)",
        TokenAt(tokens, pairs.back().chosen)));
  }
  if (!pairs.empty()) pairs.back().end = n;
  return pairs;
}

StatusOr<PreferenceDataset::Split> PreferenceDataset::LayOut(TokenDataset tokens,
                                                             const std::vector<FoundPair>& found,
                                                             size_t first, size_t last,
                                                             const PreferenceBatchOptions& o,
                                                             std::string_view what) {
  Split s(std::move(tokens));
  s.stats.pairs = static_cast<int64_t>(last - first);
  const int T = o.seq_len, B = o.micro_batch_size;
  // Packed into one row per group, a pair's sides share that row.
  const bool shared_row = o.pack && B == 1;
  // The current group: full, so that the first pair opens one.
  int row = B, used = 0, pairs_in_group = B / 2;
  std::vector<uint8_t> flags;
  for (size_t p = first; p < last; ++p) {
    const FoundPair& f = found[p];
    int64_t c = f.rejected - f.chosen, r = f.end - f.rejected;
    const bool long_pair = c > T || r > T || (shared_row && c + r > T);
    if (long_pair && o.long_examples == LongExamples::kRefuse) {
      // The pair's number in its file: the pairs found before it from the file's first token.
      const TokenDataset::Location at = s.tokens.Locate(f.chosen);
      const auto in_file =
          std::lower_bound(found.begin(), found.end(), f.chosen - at.index,
                           [](const FoundPair& x, int64_t token) { return x.chosen < token; });
      const auto number = static_cast<int64_t>(&f - &*in_file);
      if (c > T || r > T) {
        return InvalidArgumentError(fmt::format(
            "'{}': pair {} (token {}) has a {} side of {} tokens, longer than --seq-len {}; pass "
            "--long-examples truncate or skip",
            at.path, number, at.index, c > T ? "chosen" : "rejected", std::max(c, r), T));
      }
      return InvalidArgumentError(fmt::format(
          "'{}': pair {} (token {}) has sides of {} and {} tokens, more together than the one "
          "row of --seq-len {} that --micro-batch-size 1 packs them into; pass --long-examples "
          "truncate or skip, or a larger --micro-batch-size",
          at.path, number, at.index, c, r, T));
    }
    if (long_pair && o.long_examples == LongExamples::kSkip) {
      ++s.stats.skipped;
      continue;
    }
    if (long_pair) {
      if (shared_row) {
        c = std::min<int64_t>(c, std::max<int64_t>(T - r, T / 2));
        r = std::min<int64_t>(r, T - c);
      } else {
        c = std::min<int64_t>(c, T);
        r = std::min<int64_t>(r, T);
      }
    }
    const int64_t chosen_targets = CountTargets(s.tokens, f.chosen, c, flags);
    const int64_t rejected_targets = CountTargets(s.tokens, f.rejected, r, flags);
    if (chosen_targets == 0 || rejected_targets == 0) {
      ++s.stats.no_target;
      continue;
    }
    if (long_pair) ++s.stats.truncated;
    LaidPair lp;
    lp.chosen = {.begin = f.chosen, .length = static_cast<int32_t>(c)};
    lp.rejected = {.begin = f.rejected, .length = static_cast<int32_t>(r)};
    if (!o.pack) {
      if (pairs_in_group == B / 2) {
        s.group_starts.push_back(static_cast<int64_t>(s.pairs.size()));
        pairs_in_group = 0;
      }
      lp.chosen.row = 2 * pairs_in_group;
      lp.rejected.row = 2 * pairs_in_group + 1;
      ++pairs_in_group;
    } else {
      // A side goes into the rest of the current row, else into the next row of the group.
      const auto place = [&](int& in_row, int& in_used, Placed& side) {
        if (in_used + side.length > T) {
          ++in_row;
          in_used = 0;
        }
        if (in_row >= B) return false;
        side.row = in_row;
        side.column = in_used;
        in_used += side.length;
        return true;
      };
      int next_row = row, next_used = used;
      if (!place(next_row, next_used, lp.chosen) || !place(next_row, next_used, lp.rejected)) {
        s.group_starts.push_back(static_cast<int64_t>(s.pairs.size()));
        next_row = 0;
        next_used = 0;
        const bool fits =
            place(next_row, next_used, lp.chosen) && place(next_row, next_used, lp.rejected);
        STRATA_CHECK_MSG(fits, fmt::format("a pair of sides of {} and {} tokens does not fit in "
                                           "an empty group of {} rows of {}",
                                           c, r, B, T));
      }
      row = next_row;
      used = next_used;
    }
    s.pairs.push_back(lp);
    s.stats.tokens += c + r;
    s.stats.tokens_in_loss += chosen_targets + rejected_targets;
  }
  s.stats.groups = static_cast<int64_t>(s.group_starts.size());
  s.group_starts.push_back(static_cast<int64_t>(s.pairs.size()));
  if (s.pairs.empty()) {
    return InvalidArgumentError(fmt::format(
        "{} has no pair to train on ({} pair{}: {} longer than --seq-len {} skipped, {} without a "
        "target in the loss)",
        what, s.stats.pairs, s.stats.pairs == 1 ? "" : "s", s.stats.skipped, T, s.stats.no_target));
  }
  return s;
}

StatusOr<PreferenceDataset> PreferenceDataset::Create(TokenDataset train, TokenDataset val,
                                                      const PreferenceBatchOptions& options,
                                                      std::string description) {
  STRATA_RETURN_IF_ERROR(CheckOptions(options));
  std::vector<Split> splits;
  for (auto [tokens, what] : {std::pair{&train, "training"}, std::pair{&val, "validation"}}) {
    const std::string name = fmt::format("the {} split of {}", what, description);
    if (!tokens->has_flags()) {
      return InvalidArgumentError(
          fmt::format("{} has no per-token flags: preference pairs need token files written from "
                      "preference data",
                      name));
    }
    STRATA_ASSIGN_OR_RETURN(const std::vector<FoundPair> found, FindPairs(*tokens));
    STRATA_ASSIGN_OR_RETURN(Split s,
                            LayOut(std::move(*tokens), found, 0, found.size(), options, name));
    splits.push_back(std::move(s));
  }
  return PreferenceDataset(std::move(splits[0]), std::move(splits[1]), options,
                           std::move(description));
}

StatusOr<PreferenceDataset> PreferenceDataset::CreateHeldOut(TokenDataset tokens,
                                                             double train_fraction,
                                                             const PreferenceBatchOptions& options,
                                                             std::string description) {
  STRATA_RETURN_IF_ERROR(CheckOptions(options));
  if (!tokens.has_flags()) {
    return InvalidArgumentError(fmt::format(
        "{} has no per-token flags: preference pairs need token files written from preference "
        "data",
        description));
  }
  STRATA_ASSIGN_OR_RETURN(const std::vector<FoundPair> found, FindPairs(tokens));
  const auto n = static_cast<int64_t>(found.size());
  if (n < 2) {
    return InvalidArgumentError(fmt::format(
        "{} has {} pair{}: too few to hold some out for validation (give validation data)",
        description, n, n == 1 ? "" : "s"));
  }
  const auto split = static_cast<size_t>(std::clamp<int64_t>(
      static_cast<int64_t>(std::floor(static_cast<double>(n) * train_fraction)), 1, n - 1));
  STRATA_ASSIGN_OR_RETURN(Split train,
                          LayOut(tokens, found, 0, split, options,
                                 fmt::format("the training split of {}", description)));
  STRATA_ASSIGN_OR_RETURN(Split val,
                          LayOut(std::move(tokens), found, split, found.size(), options,
                                 fmt::format("the validation split of {}", description)));
  return PreferenceDataset(std::move(train), std::move(val), options, std::move(description));
}

void PreferenceDataset::FillGroup(const Split& split, int64_t g, Batch* batch) const {
  const int T = options_.seq_len, B = options_.micro_batch_size;
  const size_t n = static_cast<size_t>(B) * T;
  batch->tokens.assign(n, options_.pad_id);
  batch->targets.assign(n, kIgnoreTarget);
  batch->positions.resize(n);
  batch->sequences.assign(n, -1);
  const int64_t first = split.group_starts[g], last = split.group_starts[g + 1];
  batch->pair_ids.resize(static_cast<size_t>(last - first));
  std::vector<int> used(static_cast<size_t>(B), 0);  // per row: columns holding tokens
  std::vector<uint8_t> flags;
  for (int64_t p = first; p < last; ++p) {
    const auto k = static_cast<int32_t>(p - first);
    batch->pair_ids[k] = p;
    for (int side_index = 0; side_index < 2; ++side_index) {
      const LaidPair& pair = split.pairs[p];
      const Placed& side = side_index == 0 ? pair.chosen : pair.rejected;
      const size_t at = static_cast<size_t>(side.row) * T + side.column;
      const int len = side.length;
      int32_t* tokens = batch->tokens.data() + at;
      split.tokens.Read(side.begin, len, tokens);
      flags.resize(static_cast<size_t>(len));
      split.tokens.ReadFlags(side.begin, len, flags.data());
      for (int t = 0; t < len; ++t) {
        batch->positions[at + t] = t;
        if (t + 1 < len && (flags[t + 1] & kTokenFlagInLoss) != 0) {
          batch->targets[at + t] = tokens[t + 1];
          batch->sequences[at + t] = 2 * k + side_index;
        }
      }
      used[side.row] = std::max(used[side.row], side.column + len);
    }
  }
  for (int r = 0; r < B; ++r) {
    int32_t* positions = batch->positions.data() + static_cast<size_t>(r) * T;
    for (int t = used[r]; t < T; ++t) positions[t] = 0;  // one-token examples of their own
  }
}

void PreferenceDataset::TrainGroup(int64_t g, Batch* batch) const {
  STRATA_CHECK_MSG(0 <= g && g < train_.stats.groups,
                   fmt::format("training group {} of {}", g, train_.stats.groups));
  FillGroup(train_, g, batch);
}

void PreferenceDataset::ValGroup(int64_t g, Batch* batch) const {
  STRATA_CHECK_MSG(0 <= g && g < val_.stats.groups,
                   fmt::format("validation group {} of {}", g, val_.stats.groups));
  FillGroup(val_, g, batch);
}

void PreferenceDataset::SampleTrainBatch(std::mt19937_64& rng, int batch_size, int seq_len,
                                         Batch* batch) const {
  STRATA_CHECK_MSG(
      batch_size == options_.micro_batch_size && seq_len == options_.seq_len,
      fmt::format("a batch of {} rows of {} tokens from micro-batches of {} rows of {}", batch_size,
                  seq_len, options_.micro_batch_size, options_.seq_len));
  const auto g = static_cast<int64_t>(rng() % static_cast<uint64_t>(train_.stats.groups));
  FillGroup(train_, g, batch);
}

void PreferenceDataset::ValBatch(int index, int count, int batch_size, int seq_len,
                                 Batch* batch) const {
  STRATA_CHECK_MSG(
      batch_size == options_.micro_batch_size && seq_len == options_.seq_len && 0 <= index &&
          index < count,
      fmt::format("validation batch {} of {}, {} rows of {} tokens (data: {} rows of "
                  "{})",
                  index, count, batch_size, seq_len, options_.micro_batch_size, options_.seq_len));
  const auto g =
      static_cast<int64_t>(static_cast<uint64_t>(index) * static_cast<uint64_t>(val_.stats.groups) /
                           static_cast<uint64_t>(count));
  FillGroup(val_, g, batch);
}

std::string PreferenceDataset::Describe() const {
  const SplitStats& t = train_.stats;
  const SplitStats& v = val_.stats;
  std::string left_out;
  if (t.truncated + v.truncated > 0) {
    left_out += fmt::format("; {} truncated to {} tokens a side", t.truncated + v.truncated,
                            options_.seq_len);
  }
  if (t.skipped + v.skipped > 0) {
    left_out += fmt::format("; {} longer than {} tokens a side skipped", t.skipped + v.skipped,
                            options_.seq_len);
  }
  if (t.no_target + v.no_target > 0) {
    left_out += fmt::format("; {} with a side without a target in the loss skipped",
                            t.no_target + v.no_target);
  }
  return fmt::format(
      "{}: {} pairs (train {}, val {}) in {} micro-batches of {} rows of {} tokens (train {}, val "
      "{}), {}{}; {} tokens in loss (train {}, val {})",
      description_, t.pairs + v.pairs, t.pairs, v.pairs, t.groups + v.groups,
      options_.micro_batch_size, options_.seq_len, t.groups, v.groups,
      options_.pack ? "packed" : "one pair per two rows", left_out,
      t.tokens_in_loss + v.tokens_in_loss, t.tokens_in_loss, v.tokens_in_loss);
}

}  // namespace strata::data
