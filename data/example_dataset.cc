#include "data/example_dataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace strata::data {
namespace {

constexpr int64_t kFlagChunk = 1 << 16;

}  // namespace

std::vector<int64_t> ExampleStarts(const TokenDataset& tokens) {
  STRATA_CHECK_MSG(tokens.has_flags(), "example starts of token files without flags");
  std::vector<int64_t> starts;
  std::vector<uint8_t> flags(kFlagChunk);
  const int64_t n = tokens.num_tokens();
  for (int64_t begin = 0; begin < n; begin += kFlagChunk) {
    const int64_t take = std::min(kFlagChunk, n - begin);
    tokens.ReadFlags(begin, take, flags.data());
    for (int64_t i = 0; i < take; ++i) {
      if (begin + i == 0 || (flags[i] & kTokenFlagExampleStart) != 0) starts.push_back(begin + i);
    }
  }
  return starts;
}

StatusOr<std::pair<TokenDataset, TokenDataset>> SplitExamples(const TokenDataset& tokens,
                                                              double train_fraction,
                                                              std::string_view what) {
  const std::vector<int64_t> starts = ExampleStarts(tokens);
  const auto n = static_cast<int64_t>(starts.size());
  if (n < 2) {
    return InvalidArgumentError(fmt::format(
        "{} has {} example{}: too few to hold some out for validation (give validation data)", what,
        n, n == 1 ? "" : "s"));
  }
  const auto split = std::clamp<int64_t>(
      static_cast<int64_t>(std::floor(static_cast<double>(n) * train_fraction)), 1, n - 1);
  return std::pair{tokens.Slice(0, starts[split]),
                   tokens.Slice(starts[split], tokens.num_tokens())};
}

StatusOr<ExampleDataset::Split> ExampleDataset::LayOut(TokenDataset tokens,
                                                       const ExampleRowOptions& o,
                                                       std::string_view what) {
  if (!tokens.has_flags()) {
    return InvalidArgumentError(fmt::format(
        "{} has no per-token flags: examples need token files written from instruction data",
        what));
  }
  Split s(std::move(tokens));
  const std::vector<int64_t> starts = ExampleStarts(s.tokens);
  s.stats.examples = static_cast<int64_t>(starts.size());
  int64_t used = o.seq_len;  // of the current row: full, so the first example opens a row
  std::vector<uint8_t> flags;
  for (size_t e = 0; e < starts.size(); ++e) {
    const int64_t end = e + 1 < starts.size() ? starts[e + 1] : s.tokens.num_tokens();
    int64_t length = end - starts[e];
    if (length > o.seq_len) {
      if (o.long_examples == LongExamples::kRefuse) {
        const TokenDataset::Location at = s.tokens.Locate(starts[e]);
        return InvalidArgumentError(fmt::format(
            "'{}': the example at token {} has {} tokens, longer than --seq-len {}; pass "
            "--long-examples truncate or skip",
            at.path, at.index, length, o.seq_len));
      }
      if (o.long_examples == LongExamples::kSkip) {
        ++s.stats.skipped;
        continue;
      }
      length = o.seq_len;
    }
    // Only the targets that stay in the row count: a prompt longer than T, cut to its first T
    // tokens, leaves none, and a row of such examples alone would train nothing (a step drawing
    // only those would have no loss at all).
    flags.resize(static_cast<size_t>(length));
    s.tokens.ReadFlags(starts[e], length, flags.data());
    int64_t in_loss = 0;
    for (int64_t t = 1; t < length; ++t) in_loss += (flags[t] & kTokenFlagInLoss);
    if (in_loss == 0) {
      ++s.stats.no_target;
      continue;
    }
    if (length < end - starts[e]) ++s.stats.truncated;
    if (!o.pack || used + length > o.seq_len) {
      s.row_starts.push_back(static_cast<int64_t>(s.pieces.size()));
      used = 0;
    }
    s.pieces.push_back({starts[e], static_cast<int32_t>(length)});
    used += length;
    s.stats.tokens += length;
    s.stats.tokens_in_loss += in_loss;
  }
  s.stats.rows = static_cast<int64_t>(s.row_starts.size());
  s.row_starts.push_back(static_cast<int64_t>(s.pieces.size()));
  if (s.stats.rows == 0) {
    return InvalidArgumentError(fmt::format(
        "{} has no example of at most {} tokens with a target in the loss ({} example{}, {} longer "
        "skipped, {} without a target{})",
        what, o.seq_len, s.stats.examples, s.stats.examples == 1 ? "" : "s", s.stats.skipped,
        s.stats.no_target,
        s.stats.no_target > 0 ? fmt::format(" within their first {} tokens", o.seq_len) : ""));
  }
  return s;
}

StatusOr<ExampleDataset> ExampleDataset::Create(TokenDataset train, TokenDataset val,
                                                const ExampleRowOptions& options,
                                                std::string description) {
  if (options.seq_len <= 0) {
    return InvalidArgumentError(fmt::format("sequence length {} is not positive", options.seq_len));
  }
  if (options.pad_id < 0) {
    return InvalidArgumentError(fmt::format("pad id {} is negative", options.pad_id));
  }
  STRATA_ASSIGN_OR_RETURN(
      Split train_split,
      LayOut(std::move(train), options, fmt::format("the training split of {}", description)));
  STRATA_ASSIGN_OR_RETURN(
      Split val_split,
      LayOut(std::move(val), options, fmt::format("the validation split of {}", description)));
  return ExampleDataset(std::move(train_split), std::move(val_split), options,
                        std::move(description));
}

StatusOr<ExampleDataset> ExampleDataset::CreateWhole(TokenDataset tokens,
                                                     const ExampleRowOptions& options,
                                                     std::string description) {
  if (options.seq_len <= 0) {
    return InvalidArgumentError(fmt::format("sequence length {} is not positive", options.seq_len));
  }
  if (options.pad_id < 0) {
    return InvalidArgumentError(fmt::format("pad id {} is negative", options.pad_id));
  }
  STRATA_ASSIGN_OR_RETURN(Split split, LayOut(std::move(tokens), options, description));
  Split copy = split;
  return ExampleDataset(std::move(copy), std::move(split), options, std::move(description));
}

void ExampleDataset::FillRow(const Split& split, int64_t row, int32_t* tokens, int32_t* targets,
                             int32_t* positions, std::vector<uint8_t>& flags) const {
  const int T = options_.seq_len;
  int used = 0;
  for (int64_t p = split.row_starts[row]; p < split.row_starts[row + 1]; ++p) {
    const Piece& piece = split.pieces[p];
    const int n = piece.length;
    split.tokens.Read(piece.begin, n, tokens + used);
    flags.resize(static_cast<size_t>(n));
    split.tokens.ReadFlags(piece.begin, n, flags.data());
    for (int t = 0; t < n; ++t) {
      positions[used + t] = t;
      targets[used + t] = t + 1 < n && (flags[t + 1] & kTokenFlagInLoss) != 0 ? tokens[used + t + 1]
                                                                              : kIgnoreTarget;
    }
    used += n;
  }
  STRATA_CHECK_MSG(used > 0 && used <= T,
                   fmt::format("row {} holds {} of {} tokens", row, used, T));
  for (int t = used; t < T; ++t) {
    tokens[t] = options_.pad_id;
    targets[t] = kIgnoreTarget;
    positions[t] = 0;  // a one-token example of its own (example_dataset.h)
  }
}

void ExampleDataset::Fill(const Split& split, const std::vector<int64_t>& rows,
                          Batch* batch) const {
  const size_t T = static_cast<size_t>(options_.seq_len);
  const size_t n = rows.size() * T;
  batch->tokens.resize(n);
  batch->targets.resize(n);
  batch->positions.resize(n);
  std::vector<uint8_t> flags;
  for (size_t b = 0; b < rows.size(); ++b) {
    FillRow(split, rows[b], batch->tokens.data() + b * T, batch->targets.data() + b * T,
            batch->positions.data() + b * T, flags);
  }
}

void ExampleDataset::SampleTrainBatch(std::mt19937_64& rng, int batch_size, int seq_len,
                                      Batch* batch) const {
  STRATA_CHECK_MSG(seq_len == options_.seq_len && batch_size >= 0,
                   fmt::format("a batch of {} rows of {} tokens from rows of {}", batch_size,
                               seq_len, options_.seq_len));
  std::vector<int64_t> rows(static_cast<size_t>(batch_size));
  const auto n = static_cast<uint64_t>(train_.stats.rows);
  for (auto& r : rows) r = static_cast<int64_t>(rng() % n);
  Fill(train_, rows, batch);
}

void ExampleDataset::ValBatch(int index, int count, int batch_size, int seq_len,
                              Batch* batch) const {
  STRATA_CHECK_MSG(seq_len == options_.seq_len && 0 <= index && index < count && batch_size >= 0,
                   fmt::format("validation batch {} of {}, rows of {} tokens (data: {})", index,
                               count, seq_len, options_.seq_len));
  std::vector<int64_t> rows(static_cast<size_t>(batch_size));
  const auto n = static_cast<uint64_t>(val_.stats.rows);
  const uint64_t total = static_cast<uint64_t>(count) * batch_size;
  for (int b = 0; b < batch_size; ++b) {
    const uint64_t k = static_cast<uint64_t>(index) * batch_size + b;
    rows[b] = static_cast<int64_t>(k * n / total);
  }
  Fill(val_, rows, batch);
}

void ExampleDataset::ValRows(int64_t first, int n, int seq_len, Batch* batch) const {
  STRATA_CHECK_MSG(
      seq_len == options_.seq_len && first >= 0 && n >= 0 && first + n <= val_.stats.rows,
      fmt::format("validation rows [{}, {}) of {}, rows of {} tokens (data: {})", first, first + n,
                  val_.stats.rows, seq_len, options_.seq_len));
  std::vector<int64_t> rows(static_cast<size_t>(n));
  for (int b = 0; b < n; ++b) rows[b] = first + b;
  Fill(val_, rows, batch);
}

std::string ExampleDataset::Describe() const {
  const SplitStats& t = train_.stats;
  const SplitStats& v = val_.stats;
  std::string long_line;
  if (t.truncated + v.truncated > 0) {
    long_line =
        fmt::format("; {} truncated to {} tokens", t.truncated + v.truncated, options_.seq_len);
  }
  if (t.skipped + v.skipped > 0) {
    long_line =
        fmt::format("; {} longer than {} tokens skipped", t.skipped + v.skipped, options_.seq_len);
  }
  if (t.no_target + v.no_target > 0) {
    long_line += fmt::format("; {} without a target in the loss in their first {} tokens skipped",
                             t.no_target + v.no_target, options_.seq_len);
  }
  return fmt::format(
      "{}: {} examples (train {}, val {}) in {} rows of {} tokens (train {}, val {}), {}{}; {} "
      "tokens in loss (train {}, val {})",
      description_, t.examples + v.examples, t.examples, v.examples, t.rows + v.rows,
      options_.seq_len, t.rows, v.rows, options_.pack ? "packed" : "one example per row", long_line,
      t.tokens_in_loss + v.tokens_in_loss, t.tokens_in_loss, v.tokens_in_loss);
}

}  // namespace strata::data
