#include "tools/tokenize_command.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "data/instruction_data.h"
#include "data/preference_data.h"
#include "data/token_dataset.h"
#include "data/tokenizer.h"

namespace strata::tools {

void AddTokenizeFlags(CLI::App& cmd, TokenizeFlags& f) {
  auto* tok = cmd.add_option("--tokenizer", f.tokenizer,
                             "SentencePiece model or tokenizer.json (or a model directory: its "
                             "tokenizer.json, else its tokenizer.model)");
  auto* bytes = cmd.add_flag("--byte-level", f.byte_level,
                             "Every byte is a token (vocabulary 256) instead of a tokenizer");
  tok->excludes(bytes);
  bytes->excludes(tok);
  cmd.add_option("--input", f.input,
                 "Text file, tokenized as one document; or JSON lines (*.jsonl): instruction "
                 "data (one {\"prompt\", \"response\"} or {\"messages\": [...]} object per "
                 "line), or preference data when the first line has \"chosen\" (TRL's "
                 "{\"prompt\", \"chosen\", \"rejected\"}, strings or lists of messages, or "
                 "{\"chosen\": [...], \"rejected\": [...]} with an implicit prompt)")
      ->required();
  cmd.add_option("--output", f.output,
                 "Token file to write (llm.c format: uint16 tokens when every id < 65536, else "
                 "uint32; JSON lines add per-token flags: the loss mask, example starts and, for "
                 "preference data, pair starts: each pair's chosen side, then its rejected "
                 "side); replaced crash-safely")
      ->required();
  cmd.add_option("--format", f.format, "Input format: auto (*.jsonl is jsonl), text or jsonl")
      ->check(CLI::IsMember({"auto", "text", "jsonl"}))
      ->capture_default_str();
  cmd.add_option("--chat-template", f.chat_template,
                 "JSON lines: auto (the model's own template: chat_template.jinja or "
                 "tokenizer_config.json's chat_template beside the tokenizer; none without one), "
                 "a Jinja template FILE (a path with '/' or ending in .jinja), a built-in llama3, "
                 "chatml or mistral, or none (BOS, contents, EOS after each response)")
      ->capture_default_str();
  cmd.add_option("--chat-template-kwargs", f.chat_template_kwargs,
                 "JSON lines: a JSON object whose keys become template variables, as "
                 "apply_chat_template's keyword arguments (e.g. '{\"enable_thinking\": false}')");
}

namespace {

// The summary line goes to stdout, or to stderr when the token file itself goes to a stream
// (--output /dev/stdout, a FIFO), so that what a reader of the stream gets is the file alone.
std::FILE* ReportStream(const std::string& output) {
  struct stat st;
  return ::stat(output.c_str(), &st) == 0 && !S_ISREG(st.st_mode) ? stderr : stdout;
}

// The bytes WriteTokenFile wrote for num_tokens tokens whose largest is max_token (a stream has
// no size to ask for).
uintmax_t TokenFileBytes(size_t num_tokens, int32_t max_token, size_t num_flags) {
  return static_cast<uintmax_t>(data::kTokenFileHeaderBytes) +
         num_tokens * (max_token < 65536 ? 2u : 4u) + num_flags;
}

bool IsJsonl(const TokenizeFlags& f) {
  if (f.format != "auto") return f.format == "jsonl";
  return std::filesystem::path(f.input).extension() == ".jsonl";
}

// What a JSONL file gave: its tokens and flags, and the summary's counts.
struct JsonlOutput {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;
  std::string counts;  // "3 examples" or "2 pairs"
  int64_t tokens_in_loss = 0;
};

// Instruction data or preference data (the first non-blank line decides): rendered examples with
// their flags.
Status RunTokenizeJsonl(const TokenizeFlags& f) {
  STRATA_ASSIGN_OR_RETURN(const bool preference, data::IsPreferenceFile(f.input));
  const char* kind = preference ? "preference data" : "instruction data";
  if (!f.byte_level && f.tokenizer.empty()) {
    return InvalidArgumentError(
        fmt::format("{} '{}' needs --tokenizer (its chat template's special tokens), or "
                    "--byte-level for a byte-level model (--chat-template none)",
                    kind, f.input));
  }
  std::unique_ptr<data::Tokenizer> tokenizer;
  if (f.byte_level) {
    // Bytes have no special tokens: only the `none` template renders (auto means it).
    if (f.chat_template != "auto" && f.chat_template != "none") {
      return InvalidArgumentError(fmt::format(
          "--byte-level has no special tokens for the {} chat template: use --chat-template none",
          f.chat_template));
    }
    tokenizer = data::MakeByteLevelTokenizer();
  } else {
    STRATA_ASSIGN_OR_RETURN(tokenizer, data::Tokenizer::Load(f.tokenizer));
  }
  STRATA_ASSIGN_OR_RETURN(data::ChatFormat format,
                          data::ResolveChatFormat(f.byte_level ? "none" : f.chat_template,
                                                  f.tokenizer, f.chat_template_kwargs));
  JsonlOutput data;
  if (preference) {
    STRATA_ASSIGN_OR_RETURN(data::PreferenceTokens pairs,
                            data::TokenizePreferenceFile(*tokenizer, format, f.input));
    data = {std::move(pairs.tokens), std::move(pairs.flags), fmt::format("{} pairs", pairs.pairs),
            pairs.tokens_in_loss};
  } else {
    STRATA_ASSIGN_OR_RETURN(data::InstructionTokens examples,
                            data::TokenizeInstructionFile(*tokenizer, format, f.input));
    data = {std::move(examples.tokens), std::move(examples.flags),
            fmt::format("{} examples", examples.examples), examples.tokens_in_loss};
  }
  STRATA_RETURN_IF_ERROR(data::WriteTokenFile(f.output, data.tokens, data.flags));
  int32_t max_token = 0;
  for (int32_t t : data.tokens) max_token = std::max(max_token, t);
  const uintmax_t out_bytes = TokenFileBytes(data.tokens.size(), max_token, data.flags.size());
  std::fprintf(
      ReportStream(f.output),
      "tokenized %s '%s' with '%s' (vocabulary %d), chat template %s (%s): %s, %zu tokens, %lld "
      "tokens in loss; wrote '%s' (%s with flags, %ju bytes)\n",
      kind, f.input.c_str(), f.byte_level ? "bytes" : f.tokenizer.c_str(), tokenizer->vocab_size(),
      std::string(data::ChatTemplateName(format.kind)).c_str(), format.source.c_str(),
      data.counts.c_str(), data.tokens.size(), static_cast<long long>(data.tokens_in_loss),
      f.output.c_str(), max_token < 65536 ? "uint16" : "uint32", out_bytes);
  return Status::Ok();
}

}  // namespace

Status RunTokenize(const TokenizeFlags& f) {
  std::error_code ec;
  if (std::filesystem::equivalent(f.input, f.output, ec)) {
    return InvalidArgumentError(
        fmt::format("--output '{}' is the input file; name another file", f.output));
  }
  if (IsJsonl(f)) return RunTokenizeJsonl(f);
  if (f.byte_level) {
    std::ifstream in(f.input, std::ios::binary);
    if (!in) return ErrnoToStatus(errno, fmt::format("reading --input '{}'", f.input));
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) return ErrnoToStatus(errno, fmt::format("reading --input '{}'", f.input));
    std::vector<int32_t> tokens(text.begin(), text.end());
    for (auto& t : tokens) t &= 0xFF;
    STRATA_RETURN_IF_ERROR(data::WriteTokenFile(f.output, tokens));
    std::fprintf(ReportStream(f.output), "wrote '%s': %zu byte-level tokens (uint16) of '%s'\n",
                 f.output.c_str(), tokens.size(), f.input.c_str());
    return Status::Ok();
  }
  if (f.tokenizer.empty()) {
    return InvalidArgumentError(
        "give --tokenizer tokenizer.model|tokenizer.json|DIR or --byte-level");
  }
  STRATA_ASSIGN_OR_RETURN(auto tokenizer, data::Tokenizer::Load(f.tokenizer));
  STRATA_ASSIGN_OR_RETURN(auto tokens, data::TokenizeTextFile(*tokenizer, f.input));
  STRATA_RETURN_IF_ERROR(data::WriteTokenFile(f.output, tokens));
  const auto text_bytes = std::filesystem::file_size(f.input, ec);
  int32_t max_token = 0;
  for (int32_t t : tokens) max_token = std::max(max_token, t);
  const uintmax_t out_bytes = TokenFileBytes(tokens.size(), max_token, 0);
  // Bytes of text per token, the BOS and EOS not counted.
  const size_t text_tokens =
      tokens.size() - (tokenizer->adds_bos() ? 1 : 0) - (tokenizer->adds_eos() ? 1 : 0);
  const double per_token =
      text_tokens > 0 ? static_cast<double>(text_bytes) / static_cast<double>(text_tokens) : 0.0;
  std::fprintf(ReportStream(f.output),
               "tokenized '%s' with '%s' (vocabulary %d): %zu tokens, %.3f bytes/token; wrote '%s' "
               "(%s, %ju bytes)\n",
               f.input.c_str(), tokenizer->path().c_str(), tokenizer->vocab_size(), tokens.size(),
               per_token, f.output.c_str(), max_token < 65536 ? "uint16" : "uint32", out_bytes);
  return Status::Ok();
}

}  // namespace strata::tools
