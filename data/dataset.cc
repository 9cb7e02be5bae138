#include "data/dataset.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <filesystem>
#include <tuple>

#include "base/unique_fd.h"
#include "data/example_dataset.h"
#include "data/preference_dataset.h"
#include "data/text_dataset.h"
#include "data/token_dataset.h"
#include "data/tokenizer.h"

namespace strata::data {
namespace {

// Whether --data names llm.c token files rather than text: a glob (text is one file), a
// *.bin / *.tokens name, or a file that starts with the magic.
bool LooksLikeTokenFiles(const std::string& first) {
  // A glob, unless a file has that name (as the token reader's expansion takes it).
  std::error_code ec;
  if (first.find_first_of("*?[") != std::string::npos && !std::filesystem::exists(first, ec)) {
    return true;
  }
  const std::string ext = std::filesystem::path(first).extension().string();
  if (ext == ".bin" || ext == ".tokens") return true;
  // Non-blocking: a FIFO is refused later by the reader of the file, not waited on here.
  UniqueFd fd(::open(first.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  int32_t magic = 0;
  return fd.valid() && ::pread(fd.get(), &magic, sizeof magic, 0) == sizeof magic &&
         (magic == kTokenFileMagic || magic == kLlama3TokenFileMagic);
}

std::string NameFiles(const std::vector<std::string>& paths) {
  if (paths.size() == 1) return fmt::format("token file '{}'", paths[0]);
  return fmt::format("{} token files ('{}' ... '{}')", paths.size(), paths.front(), paths.back());
}

Status CheckLongEnough(int64_t tokens, int seq_len, std::string_view what) {
  if (tokens > seq_len) return Status::Ok();
  return InvalidArgumentError(fmt::format("{} has {} tokens: too few for one window of {} tokens",
                                          what, tokens, int64_t{seq_len} + 1));
}

// `paths` as token files: tokenized into the cache first when they are one text file and a
// tokenizer is given. `what` receives their description.
StatusOr<TokenDataset> OpenTokens(const std::vector<std::string>& paths, const Tokenizer* tokenizer,
                                  int vocab_size, std::string* what) {
  if (tokenizer != nullptr && !LooksLikeTokenFiles(paths[0])) {
    if (paths.size() != 1) {
      return InvalidArgumentError(fmt::format(
          "{} text files given ('{}', ...): tokenized text is one file", paths.size(), paths[0]));
    }
    bool reused = false;
    std::string note;
    STRATA_ASSIGN_OR_RETURN(std::string cache,
                            TokenizeTextFileCached(*tokenizer, paths[0], &reused, &note));
    *what = fmt::format("'{}' tokenized by '{}' (cache '{}', {}{}{})", paths[0], tokenizer->path(),
                        cache, reused ? "reused" : "made now", note.empty() ? "" : " ", note);
    return TokenDataset::Open({cache}, vocab_size);
  }
  STRATA_ASSIGN_OR_RETURN(TokenDataset d, TokenDataset::Open(paths, vocab_size));
  *what = NameFiles(d.paths());
  return d;
}

int32_t PadId(const Tokenizer* tokenizer) {
  return tokenizer != nullptr && tokenizer->eos_id() >= 0 ? tokenizer->eos_id() : 0;
}

// Token files whose flags mark preference pairs: micro-batches of whole pairs.
StatusOr<std::unique_ptr<PreferenceDataset>> OpenPreference(const TrainingDataOptions& o,
                                                            const Tokenizer* tokenizer,
                                                            TokenDataset train,
                                                            const std::string& train_what) {
  const PreferenceBatchOptions groups{.seq_len = o.seq_len,
                                      .micro_batch_size = o.micro_batch_size,
                                      .pack = o.pack,
                                      .long_examples = o.long_examples,
                                      .pad_id = PadId(tokenizer)};
  if (o.val_data.empty()) {
    STRATA_ASSIGN_OR_RETURN(
        PreferenceDataset d,
        PreferenceDataset::CreateHeldOut(
            std::move(train), o.train_fraction, groups,
            fmt::format("{}, the last {:.0f}% of the pairs held out for validation", train_what,
                        100 * (1 - o.train_fraction))));
    return std::make_unique<PreferenceDataset>(std::move(d));
  }
  std::string val_what;
  STRATA_ASSIGN_OR_RETURN(TokenDataset val,
                          OpenTokens(o.val_data, tokenizer, o.vocab_size, &val_what));
  if (!val.has_flags() || !HasPairStarts(val)) {
    return InvalidArgumentError(fmt::format(
        "validation data {} holds no preference pairs but the training data {} does: give "
        "validation data written from preference data too",
        val_what, train_what));
  }
  STRATA_ASSIGN_OR_RETURN(
      PreferenceDataset d,
      PreferenceDataset::Create(std::move(train), std::move(val), groups,
                                fmt::format("{}; validation {}", train_what, val_what)));
  return std::make_unique<PreferenceDataset>(std::move(d));
}

// Token files with per-token flags: rows of whole examples.
StatusOr<std::unique_ptr<Dataset>> OpenExamples(const TrainingDataOptions& o,
                                                const Tokenizer* tokenizer, TokenDataset train,
                                                const std::string& train_what) {
  TokenDataset val = train;
  std::string description;
  if (o.val_data.empty()) {
    STRATA_ASSIGN_OR_RETURN(auto split, SplitExamples(train, o.train_fraction, train_what));
    std::tie(train, val) = std::move(split);
    description = fmt::format("{}, the last {:.0f}% of the examples held out for validation",
                              train_what, 100 * (1 - o.train_fraction));
  } else {
    std::string val_what;
    STRATA_ASSIGN_OR_RETURN(val, OpenTokens(o.val_data, tokenizer, o.vocab_size, &val_what));
    if (!val.has_flags()) {
      return InvalidArgumentError(fmt::format(
          "validation data {} has no per-token flags but the training data {} has: give "
          "validation data written from instruction data too",
          val_what, train_what));
    }
    if (HasPairStarts(val)) {
      return InvalidArgumentError(fmt::format(
          "validation data {} holds preference pairs but the training data {} does not: give "
          "both splits written from the same kind of data",
          val_what, train_what));
    }
    description = fmt::format("{}; validation {}", train_what, val_what);
  }
  const ExampleRowOptions rows{.seq_len = o.seq_len,
                               .pack = o.pack,
                               .long_examples = o.long_examples,
                               .pad_id = PadId(tokenizer)};
  STRATA_ASSIGN_OR_RETURN(ExampleDataset d, ExampleDataset::Create(std::move(train), std::move(val),
                                                                   rows, std::move(description)));
  return std::unique_ptr<Dataset>(std::make_unique<ExampleDataset>(std::move(d)));
}

// Token files (or text tokenized into its cache) as windows, or as examples when they carry
// flags, or as pairs when their flags mark pairs (then *preference is the dataset).
StatusOr<std::unique_ptr<Dataset>> OpenTokenData(const TrainingDataOptions& o,
                                                 const Tokenizer* tokenizer,
                                                 const PreferenceDataset** preference) {
  std::string train_what;
  STRATA_ASSIGN_OR_RETURN(TokenDataset train,
                          OpenTokens(o.data, tokenizer, o.vocab_size, &train_what));
  if (train.has_flags() && HasPairStarts(train)) {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<PreferenceDataset> d,
                            OpenPreference(o, tokenizer, std::move(train), train_what));
    *preference = d.get();
    return std::unique_ptr<Dataset>(std::move(d));
  }
  if (train.has_flags()) return OpenExamples(o, tokenizer, std::move(train), train_what);
  TokenDataset val = train;
  std::string description;
  if (o.val_data.empty()) {
    const int64_t n = train.num_tokens();
    const auto split = static_cast<int64_t>(std::floor(static_cast<double>(n) * o.train_fraction));
    val = train.Slice(split, n);
    train = train.Slice(0, split);
    description = fmt::format("{}, the last {:.0f}% held out for validation", train_what,
                              100 * (1 - o.train_fraction));
  } else {
    std::string val_what;
    STRATA_ASSIGN_OR_RETURN(val, OpenTokens(o.val_data, tokenizer, o.vocab_size, &val_what));
    description = fmt::format("{}; validation {}", train_what, val_what);
  }
  STRATA_RETURN_IF_ERROR(CheckLongEnough(train.num_tokens(), o.seq_len,
                                         fmt::format("the training split of {}", train_what)));
  STRATA_RETURN_IF_ERROR(CheckLongEnough(
      val.num_tokens(), o.seq_len,
      fmt::format("the validation split of {}", o.val_data.empty() ? train_what : o.val_data[0])));
  return std::unique_ptr<Dataset>(std::make_unique<TokenTrainingData>(
      std::move(train), std::move(val), std::move(description)));
}

// One text file, byte-level.
StatusOr<std::unique_ptr<Dataset>> OpenByteLevelText(const TrainingDataOptions& o) {
  if (o.data.size() != 1) {
    return InvalidArgumentError(fmt::format(
        "{} text files given ('{}', ...): byte-level text is one file; several files must be "
        "token files",
        o.data.size(), o.data[0]));
  }
  if (!o.val_data.empty()) {
    return InvalidArgumentError(fmt::format(
        "validation data '{}' needs token files or a tokenizer: byte-level text '{}' holds out "
        "its last {:.0f}% instead",
        o.val_data[0], o.data[0], 100 * (1 - o.train_fraction)));
  }
  if (o.vocab_size < 256) {
    return InvalidArgumentError(
        fmt::format("byte-level text '{}' needs a vocabulary of 256; the model has {}", o.data[0],
                    o.vocab_size));
  }
  STRATA_ASSIGN_OR_RETURN(TextDataset text,
                          TextDataset::Load(o.data[0], o.seq_len, o.train_fraction));
  return std::unique_ptr<Dataset>(std::make_unique<TextDataset>(std::move(text)));
}

}  // namespace

StatusOr<TrainingData> OpenTrainingData(const TrainingDataOptions& o) {
  if (o.data.empty()) return InvalidArgumentError("no training data given (--data)");
  if (o.seq_len <= 0) {
    return InvalidArgumentError(fmt::format("sequence length {} is not positive", o.seq_len));
  }
  if (!(o.train_fraction > 0 && o.train_fraction < 1)) {
    return InvalidArgumentError(
        fmt::format("training fraction {} is not in (0, 1)", o.train_fraction));
  }
  for (const auto& path : o.data) {
    if (std::filesystem::path(path).extension() == ".jsonl") {
      return InvalidArgumentError(fmt::format(
          "'{}' is instruction or preference data (JSON lines): write it as a token file first "
          "with `strata tokenize --tokenizer TOKENIZER --input {} --output FILE.bin` and train "
          "on that",
          path, path));
    }
  }
  TrainingData out;
  if (!o.tokenizer.empty()) {
    STRATA_ASSIGN_OR_RETURN(out.tokenizer, Tokenizer::Load(o.tokenizer));
    if (out.tokenizer->vocab_size() > o.vocab_size) {
      return InvalidArgumentError(
          fmt::format("tokenizer file '{}' has {} pieces, more than the model's vocabulary of {}",
                      o.tokenizer, out.tokenizer->vocab_size(), o.vocab_size));
    }
  }
  if (out.tokenizer == nullptr && !LooksLikeTokenFiles(o.data[0])) {
    STRATA_ASSIGN_OR_RETURN(out.dataset, OpenByteLevelText(o));
    out.byte_level = true;
    return out;
  }
  STRATA_ASSIGN_OR_RETURN(out.dataset, OpenTokenData(o, out.tokenizer.get(), &out.preference));
  return out;
}

}  // namespace strata::data
