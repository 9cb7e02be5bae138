// The parts of a Hugging Face tokenizer.json that Strata reads (the format of HF tokenizers'
// Tokenizer::from_file: added_tokens, normalizer, pre_tokenizer, model, post_processor, decoder),
// parsed into plain structs, and the bos/eos names of a tokenizer_config.json. Anything else a
// file uses is refused by name. Internal to data/ (hf_tokenizer.h).
//
// The file is untrusted input: it is parsed with a nesting limit (kMaxJsonDepth of
// base/untrusted_text.h), Sequence components nest at most kMaxComponentDepth deep, every token
// id is an integer in 0..kMaxTokenId, and at most kMaxUnusedIds ids below the largest have no
// token, so the id table sized from the file is bounded by the file's own entries. Every
// refusal names the JSON pointer of the value ("/model/vocab/b: must be a token id, ...") and
// quotes at most a bounded excerpt of it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"
#include "data/hf_bpe.h"
#include "data/hf_text.h"

namespace strata::data::hf {

struct AddedToken {
  std::string content;
  int id = -1;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// One step of the normalizer (a Sequence is flattened).
struct NormalizerStep {
  enum Kind { kPrepend, kReplace, kNfc } kind;
  std::string a, b;  // Prepend: a = prepend; Replace: a = pattern (String), b = content
};

enum class PrependScheme { kAlways, kFirst, kNever };

// One step of the pre-tokenizer (a Sequence is flattened).
struct PreTokenizerStep {
  enum Kind { kByteLevel, kSplit, kMetaspace } kind;
  // ByteLevel: use_regex selects GPT-2's pattern in `regex`.
  bool add_prefix_space = false;
  // Split: the pattern is `regex`, or the literal `literal` when regex is null.
  std::shared_ptr<const Regex> regex;
  std::string literal;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  // Metaspace.
  std::string replacement;
  PrependScheme prepend_scheme = PrependScheme::kAlways;
  bool split = true;
};

// One step of the decoder (a Sequence is flattened).
struct DecoderStep {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string a, b;         // Replace: a = pattern, b = content; Strip: a = content; Metaspace: a
  int start = 0, stop = 0;  // Strip
  PrependScheme prepend_scheme = PrependScheme::kAlways;  // Metaspace
};

// The largest token id accepted: id + 1, a vocabulary size, is still an int.
inline constexpr int kMaxTokenId = 2147483646;
// How many ids below the largest may have no token (real files have none: an id is a row of the
// model's embedding).
inline constexpr int64_t kMaxUnusedIds = 65536;
// How deep Sequence normalizers, pre-tokenizers, decoders and post-processors may nest.
inline constexpr int kMaxComponentDepth = 16;

struct TokenizerJson {
  std::unique_ptr<BpeModel> model;
  // max(id) + 1 over the model's vocabulary and the added tokens (checked as above).
  int vocab_size = 0;
  std::vector<AddedToken> added_tokens;
  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  bool has_decoder = false;
  std::vector<DecoderStep> decoder;
  // From the post-processor's TemplateProcessing "single" template: the special token before and
  // after the sequence, or "" when there is none.
  std::string template_bos, template_eos;
  int template_bos_id = -1, template_eos_id = -1;
};

// GPT-2's pre-tokenization pattern (the ByteLevel pre-tokenizer with use_regex).
inline constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Parses the text of a tokenizer.json. Errors: kInvalidArgument with a one-line reason (a JSON
// syntax error, nesting past the limits, a missing or mistyped field or an id out of range named
// by its JSON pointer, an unsupported component named with the supported ones, a
// TemplateProcessing special-token id that is no token's); the caller adds the file's name.
StatusOr<TokenizerJson> ParseTokenizerJson(std::string_view json);

// bos_token / eos_token of a tokenizer_config.json's text: the token's content, "" when absent
// (*present false) or null (*present true); add_bos_token / add_eos_token when given (-1: absent,
// else 0 or 1); tokenizer_class ("" when absent or null).
struct SpecialTokenNames {
  bool has_bos = false, has_eos = false;
  std::string bos, eos;
  int add_bos = -1, add_eos = -1;
  std::string tokenizer_class;
};
// Errors: kInvalidArgument naming the JSON pointer ("/eos_token/content: must be a string",
// "/add_bos_token: must be true or false", "/tokenizer_class: must be a string").
StatusOr<SpecialTokenNames> ParseTokenizerConfigJson(std::string_view json);

// The tokenizer_config.json in the directory of `tokenizer_path` (a tokenizer.json or
// tokenizer.model), parsed as above; the defaults (nothing named, add_* -1) when there is none.
// Errors: the read's (naming the file), or ParseTokenizerConfigJson's on one line naming the file.
// Reads the file once per call (at most 64 MiB); thread-safe.
StatusOr<SpecialTokenNames> ReadTokenizerConfigBeside(const std::string& tokenizer_path);

}  // namespace strata::data::hf
