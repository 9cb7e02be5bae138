#include "data/hf_tokenizer_json.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/file.h"
#include "base/untrusted_text.h"

namespace strata::data::hf {

namespace {

using Json = nlohmann::json;

// Errors inside the parser travel as this exception and become kInvalidArgument at the top.
struct Refusal {
  std::string message;
};

[[noreturn]] void Refuse(std::string message) { throw Refusal{std::move(message)}; }

// A refusal of the value at JSON pointer `at`: "/model/vocab/a: WHAT".
[[noreturn]] void RefuseAt(const std::string& at, std::string_view what) {
  Refuse(fmt::format("{}: {}", at.empty() ? "/" : at, what));
}

// The typed reads of a value at a JSON pointer: a wrong type is refused naming the pointer, the
// type wanted and an excerpt of what is there (never nlohmann's type_error without a key).
const Json& ObjectAt(const Json& j, const std::string& at) {
  if (!j.is_object()) RefuseAt(at, fmt::format("must be an object, got {}", JsonExcerpt(j)));
  return j;
}

const Json& ArrayAt(const Json& j, const std::string& at) {
  if (!j.is_array()) RefuseAt(at, fmt::format("must be an array, got {}", JsonExcerpt(j)));
  return j;
}

std::string StringAt(const Json& j, const std::string& at) {
  if (!j.is_string()) RefuseAt(at, fmt::format("must be a string, got {}", JsonExcerpt(j)));
  return j.get<std::string>();
}

// A token id: an integer in [0, kMaxTokenId], so that id + 1 (a vocabulary size) is an int.
int IdAt(const Json& j, const std::string& at) {
  if (!j.is_number_integer() || (!j.is_number_unsigned() && j.get<int64_t>() < 0) ||
      j.get<uint64_t>() > static_cast<uint64_t>(kMaxTokenId)) {
    RefuseAt(at, fmt::format("must be a token id, an integer in 0..{}, got {}", kMaxTokenId,
                             JsonExcerpt(j)));
  }
  return static_cast<int>(j.get<int64_t>());
}

// A count in a component (Strip's start and stop): an integer in [0, 2^20].
int CountAt(const Json& j, const std::string& at) {
  constexpr int64_t kMax = int64_t{1} << 20;
  if (!j.is_number_integer() || (!j.is_number_unsigned() && j.get<int64_t>() < 0) ||
      j.get<uint64_t>() > static_cast<uint64_t>(kMax)) {
    RefuseAt(at, fmt::format("must be an integer in 0..{}, got {}", kMax, JsonExcerpt(j)));
  }
  return static_cast<int>(j.get<int64_t>());
}

// obj[key], refused as missing when absent.
const Json& Field(const Json& obj, const std::string& at, const char* key) {
  const auto it = obj.find(key);
  if (it == obj.end()) RefuseAt(JsonPointerChild(at, key), "is missing");
  return *it;
}

std::string StringField(const Json& obj, const std::string& at, const char* key) {
  return StringAt(Field(obj, at, key), JsonPointerChild(at, key));
}

std::string TypeOf(const Json& j, const std::string& at, const char* what) {
  if (!j.is_object()) {
    RefuseAt(at, fmt::format("{} must be an object, got {}", what, JsonExcerpt(j)));
  }
  if (!j.contains("type") || !j["type"].is_string()) {
    RefuseAt(at, fmt::format("{} has no \"type\" string", what));
  }
  return j["type"].get<std::string>();
}

// A Sequence's members nested deeper than kMaxComponentDepth.
void CheckDepth(int depth, const std::string& at, const char* what) {
  if (depth > kMaxComponentDepth) {
    RefuseAt(
        at, fmt::format("{} Sequence nested deeper than {} (the limit)", what, kMaxComponentDepth));
  }
}

[[noreturn]] void Unsupported(const std::string& at, const char* what, const std::string& type,
                              const char* supported) {
  RefuseAt(at, fmt::format("{} type {} is not supported (supported: {})", what, Excerpt(type),
                           supported));
}

bool BoolOr(const Json& j, const std::string& at, const char* key, bool fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) {
    RefuseAt(JsonPointerChild(at, key),
             fmt::format("must be true or false, got {}", JsonExcerpt(*it)));
  }
  return it->get<bool>();
}

// A Split or Replace pattern: {"String": s} or {"Regex": r}; *is_regex says which.
std::string Pattern(const Json& j, const std::string& at, const char* what, bool* is_regex) {
  const std::string p_at = JsonPointerChild(at, "pattern");
  const Json& p = ObjectAt(Field(j, at, "pattern"), p_at);
  if (p.contains("String")) return *is_regex = false, StringField(p, p_at, "String");
  if (p.contains("Regex")) return *is_regex = true, StringField(p, p_at, "Regex");
  RefuseAt(p_at, fmt::format("{} pattern is neither String nor Regex", what));
}

void ParseNormalizer(const Json& j, const std::string& at, int depth,
                     std::vector<NormalizerStep>* out) {
  const std::string type = TypeOf(j, at, "normalizer");
  if (type == "Sequence") {
    const std::string list_at = JsonPointerChild(at, "normalizers");
    const Json& list = ArrayAt(Field(j, at, "normalizers"), list_at);
    CheckDepth(depth + 1, list_at, "normalizer");
    for (size_t i = 0; i < list.size(); ++i) {
      ParseNormalizer(list[i], JsonPointerChild(list_at, i), depth + 1, out);
    }
  } else if (type == "Prepend") {
    out->push_back({NormalizerStep::kPrepend, StringField(j, at, "prepend"), ""});
  } else if (type == "Replace") {
    bool regex = false;
    std::string pattern = Pattern(j, at, "normalizer Replace", &regex);
    if (regex) {
      RefuseAt(at, "normalizer Replace with a Regex pattern is not supported (String only)");
    }
    if (pattern.empty()) RefuseAt(at, "normalizer Replace has an empty pattern");
    out->push_back({NormalizerStep::kReplace, std::move(pattern), StringField(j, at, "content")});
  } else if (type == "NFC") {
    out->push_back({NormalizerStep::kNfc, "", ""});
  } else {
    Unsupported(at, "normalizer", type, "Prepend, Replace, NFC, Sequence");
  }
}

PrependScheme ParsePrependScheme(const Json& j, const std::string& at) {
  if (j.contains("prepend_scheme")) {
    const std::string s = StringField(j, at, "prepend_scheme");
    if (s == "always") return PrependScheme::kAlways;
    if (s == "first") return PrependScheme::kFirst;
    if (s == "never") return PrependScheme::kNever;
    RefuseAt(JsonPointerChild(at, "prepend_scheme"),
             fmt::format("Metaspace prepend_scheme '{}' is not supported (always, first, never)",
                         Excerpt(s)));
  }
  // Files older than prepend_scheme: add_prefix_space.
  return BoolOr(j, at, "add_prefix_space", true) ? PrependScheme::kAlways : PrependScheme::kNever;
}

SplitBehavior ParseBehavior(const std::string& s, const std::string& at) {
  if (s == "Removed") return SplitBehavior::kRemoved;
  if (s == "Isolated") return SplitBehavior::kIsolated;
  if (s == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (s == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (s == "Contiguous") return SplitBehavior::kContiguous;
  RefuseAt(at,
           fmt::format("Split behavior {} is not supported (Removed, Isolated, MergedWithPrevious, "
                       "MergedWithNext, Contiguous)",
                       Excerpt(s)));
}

std::shared_ptr<const Regex> Compile(const std::string& pattern, const std::string& at) {
  auto re = Regex::Create(pattern);
  if (!re.ok()) RefuseAt(at, Excerpt(re.status().message(), 240));
  return std::shared_ptr<const Regex>(std::move(*re));
}

void ParsePreTokenizer(const Json& j, const std::string& at, int depth,
                       std::vector<PreTokenizerStep>* out) {
  const std::string type = TypeOf(j, at, "pre_tokenizer");
  PreTokenizerStep step{};
  if (type == "Sequence") {
    const std::string list_at = JsonPointerChild(at, "pretokenizers");
    const Json& list = ArrayAt(Field(j, at, "pretokenizers"), list_at);
    CheckDepth(depth + 1, list_at, "pre_tokenizer");
    for (size_t i = 0; i < list.size(); ++i) {
      ParsePreTokenizer(list[i], JsonPointerChild(list_at, i), depth + 1, out);
    }
    return;
  } else if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::kByteLevel;
    step.add_prefix_space = BoolOr(j, at, "add_prefix_space", true);
    if (BoolOr(j, at, "use_regex", true)) step.regex = Compile(kGpt2Pattern, at);
  } else if (type == "Split") {
    step.kind = PreTokenizerStep::kSplit;
    bool regex = false;
    std::string pattern = Pattern(j, at, "pre_tokenizer Split", &regex);
    if (pattern.empty()) RefuseAt(at, "pre_tokenizer Split has an empty pattern");
    if (regex) {
      step.regex = Compile(pattern, JsonPointerChild(at, "pattern"));
    } else {
      step.literal = std::move(pattern);
    }
    step.behavior = ParseBehavior(StringField(j, at, "behavior"), JsonPointerChild(at, "behavior"));
    step.invert = BoolOr(j, at, "invert", false);
  } else if (type == "Metaspace") {
    step.kind = PreTokenizerStep::kMetaspace;
    step.replacement = StringField(j, at, "replacement");
    size_t len = 0;
    if (step.replacement.empty() || FindInvalidUtf8(step.replacement) != std::string::npos ||
        (DecodeUtf8(step.replacement, 0, &len), len != step.replacement.size())) {
      RefuseAt(JsonPointerChild(at, "replacement"),
               "pre_tokenizer Metaspace replacement is not one character");
    }
    step.prepend_scheme = ParsePrependScheme(j, at);
    step.split = BoolOr(j, at, "split", true);
  } else {
    Unsupported(at, "pre_tokenizer", type, "ByteLevel, Split, Metaspace, Sequence");
  }
  if (!out->empty() && out->back().kind == PreTokenizerStep::kByteLevel) {
    RefuseAt(at,
             "pre_tokenizer ByteLevel followed by another pre-tokenizer is not supported "
             "(ByteLevel must come last)");
  }
  out->push_back(std::move(step));
}

void ParseDecoder(const Json& j, const std::string& at, int depth, std::vector<DecoderStep>* out) {
  const std::string type = TypeOf(j, at, "decoder");
  DecoderStep step{};
  if (type == "Sequence") {
    const std::string list_at = JsonPointerChild(at, "decoders");
    const Json& list = ArrayAt(Field(j, at, "decoders"), list_at);
    CheckDepth(depth + 1, list_at, "decoder");
    for (size_t i = 0; i < list.size(); ++i) {
      ParseDecoder(list[i], JsonPointerChild(list_at, i), depth + 1, out);
    }
    return;
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::kByteLevel;
  } else if (type == "Replace") {
    step.kind = DecoderStep::kReplace;
    bool regex = false;
    step.a = Pattern(j, at, "decoder Replace", &regex);
    if (regex) RefuseAt(at, "decoder Replace with a Regex pattern is not supported (String only)");
    if (step.a.empty()) RefuseAt(at, "decoder Replace has an empty pattern");
    step.b = StringField(j, at, "content");
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::kFuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::kStrip;
    step.a = StringField(j, at, "content");
    step.start = CountAt(Field(j, at, "start"), JsonPointerChild(at, "start"));
    step.stop = CountAt(Field(j, at, "stop"), JsonPointerChild(at, "stop"));
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::kMetaspace;
    step.a = StringField(j, at, "replacement");
    step.prepend_scheme = ParsePrependScheme(j, at);
  } else {
    Unsupported(at, "decoder", type,
                "ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence");
  }
  out->push_back(std::move(step));
}

// A merge as "a b" or ["a", "b"].
std::pair<std::string, std::string> ParseMerge(const Json& m, const std::string& at) {
  if (m.is_array()) {
    if (m.size() != 2) RefuseAt(at, "does not have two parts");
    return {StringAt(m[0], JsonPointerChild(at, size_t{0})),
            StringAt(m[1], JsonPointerChild(at, size_t{1}))};
  }
  const std::string s = StringAt(m, at);
  const size_t space = s.find(' ');
  if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
    RefuseAt(at, fmt::format("'{}' is not two parts separated by one space", Excerpt(s)));
  }
  return {s.substr(0, space), s.substr(space + 1)};
}

bool NullOrEmpty(const Json& j, const std::string& at, const char* key) {
  return !j.contains(key) || j[key].is_null() || StringField(j, at, key).empty();
}

std::unique_ptr<BpeModel> ParseModel(const Json& j, bool byte_level) {
  const std::string at = "/model";
  const std::string type = j.contains("type") ? TypeOf(j, at, "model") : "BPE";
  ObjectAt(j, at);
  if (type != "BPE") Unsupported(at, "model", type, "BPE");
  if (j.contains("dropout") && !j["dropout"].is_null()) {
    RefuseAt(JsonPointerChild(at, "dropout"), "model BPE dropout is not supported (null only)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!NullOrEmpty(j, at, key)) {
      RefuseAt(JsonPointerChild(at, key),
               fmt::format("model BPE {} is not supported (null only)", key));
    }
  }
  BpeOptions o;
  o.byte_level = byte_level;
  o.byte_fallback = BoolOr(j, at, "byte_fallback", false);
  o.fuse_unk = BoolOr(j, at, "fuse_unk", false);
  o.ignore_merges = BoolOr(j, at, "ignore_merges", false);
  if (j.contains("unk_token") && !j["unk_token"].is_null()) {
    o.unk_token = StringField(j, at, "unk_token");
  }
  Vocab vocab;
  const std::string vocab_at = JsonPointerChild(at, "vocab");
  const Json& v = ObjectAt(Field(j, at, "vocab"), vocab_at);
  vocab.reserve(v.size());
  for (const auto& [token, id] : v.items()) {
    vocab.emplace(token, IdAt(id, JsonPointerChild(vocab_at, token)));
  }
  std::vector<std::pair<std::string, std::string>> merges;
  const std::string merges_at = JsonPointerChild(at, "merges");
  const Json& m = ArrayAt(Field(j, at, "merges"), merges_at);
  merges.reserve(m.size());
  for (size_t r = 0; r < m.size(); ++r)
    merges.push_back(ParseMerge(m[r], JsonPointerChild(merges_at, r)));
  auto model = BpeModel::Create(std::move(vocab), merges, std::move(o));
  if (!model.ok()) Refuse(model.status().message());
  return std::move(*model);
}

AddedToken ParseAddedToken(const Json& j, const std::string& at) {
  ObjectAt(j, at);
  AddedToken t;
  t.id = IdAt(Field(j, at, "id"), JsonPointerChild(at, "id"));
  t.content = StringField(j, at, "content");
  if (t.content.empty()) RefuseAt(JsonPointerChild(at, "content"), "is empty");
  t.single_word = BoolOr(j, at, "single_word", false);
  t.lstrip = BoolOr(j, at, "lstrip", false);
  t.rstrip = BoolOr(j, at, "rstrip", false);
  t.normalized = BoolOr(j, at, "normalized", false);
  t.special = BoolOr(j, at, "special", false);
  return t;
}

// The ids the model's vocabulary and the added tokens give a token, checked before anything is
// sized from them: the table of ids is max id + 1 entries, and at most kMaxUnusedIds of them may
// have no token, so its size is bounded by the file's own entries.
class IdSet {
 public:
  explicit IdSet(const TokenizerJson& c) {
    int64_t max_id = -1;
    size_t entries = 0;
    for (const auto& [token, id] : c.model->vocab())
      max_id = std::max<int64_t>(max_id, id), ++entries;
    for (const AddedToken& t : c.added_tokens) max_id = std::max<int64_t>(max_id, t.id), ++entries;
    if (max_id + 1 > static_cast<int64_t>(entries) + kMaxUnusedIds) {
      Refuse(fmt::format(
          "the largest token id {} leaves more than {} ids below it without a token ({} tokens "
          "in /model/vocab and /added_tokens): ids must be dense, as a model's embedding rows are",
          max_id, kMaxUnusedIds, entries));
    }
    has_.resize(static_cast<size_t>(max_id + 1));
    for (const auto& [token, id] : c.model->vocab()) has_[id] = true;
    for (const AddedToken& t : c.added_tokens) has_[t.id] = true;
  }
  bool Has(int64_t id) const {
    return id >= 0 && id < static_cast<int64_t>(has_.size()) && has_[id];
  }
  int64_t size() const { return static_cast<int64_t>(has_.size()); }

 private:
  std::vector<bool> has_;
};

// TemplateProcessing's "single": the special tokens right before and after the sequence. Every
// special token's ids must be tokens of the file.
void ParseTemplate(const Json& j, const std::string& at, const IdSet& ids, TokenizerJson* c) {
  const Json* specials = nullptr;
  const std::string specials_at = JsonPointerChild(at, "special_tokens");
  if (j.contains("special_tokens") && !j["special_tokens"].is_null()) {
    specials = &ObjectAt(j["special_tokens"], specials_at);
    for (const auto& [name, entry] : specials->items()) {
      const std::string entry_at = JsonPointerChild(specials_at, name);
      const std::string ids_at = JsonPointerChild(entry_at, "ids");
      const Json& list = ArrayAt(Field(ObjectAt(entry, entry_at), entry_at, "ids"), ids_at);
      for (size_t k = 0; k < list.size(); ++k) {
        const std::string id_at = JsonPointerChild(ids_at, k);
        const int id = IdAt(list[k], id_at);
        if (!ids.Has(id)) {
          RefuseAt(id_at, fmt::format("special token id {} is not the id of a token in "
                                      "/model/vocab or /added_tokens (ids 0..{})",
                                      id, ids.size() - 1));
        }
      }
    }
  }
  const std::string single_at = JsonPointerChild(at, "single");
  const Json& single = ArrayAt(Field(j, at, "single"), single_at);
  bool seen_sequence = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const Json& item = single[i];
    const std::string item_at = JsonPointerChild(single_at, i);
    if (!item.is_object())
      RefuseAt(item_at, fmt::format("must be an object, got {}", JsonExcerpt(item)));
    if (item.contains("Sequence")) {
      seen_sequence = true;
    } else if (item.contains("SpecialToken")) {
      const std::string st_at = JsonPointerChild(item_at, "SpecialToken");
      const std::string name = StringField(ObjectAt(item["SpecialToken"], st_at), st_at, "id");
      int id = -1;
      if (specials != nullptr && specials->contains(name)) {
        const Json& list = (*specials)[name]["ids"];
        if (list.size() == 1) id = list[0].get<int>();
      }
      if (!seen_sequence) {
        c->template_bos = name, c->template_bos_id = id;
      } else if (c->template_eos.empty()) {
        c->template_eos = name, c->template_eos_id = id;
      }
    }
  }
}

void ParsePostProcessor(const Json& j, const std::string& at, int depth, const IdSet& ids,
                        TokenizerJson* c) {
  const std::string type = TypeOf(j, at, "post_processor");
  if (type == "Sequence") {
    const std::string list_at = JsonPointerChild(at, "processors");
    const Json& list = ArrayAt(Field(j, at, "processors"), list_at);
    CheckDepth(depth + 1, list_at, "post_processor");
    for (size_t i = 0; i < list.size(); ++i) {
      ParsePostProcessor(list[i], JsonPointerChild(list_at, i), depth + 1, ids, c);
    }
  } else if (type == "TemplateProcessing") {
    ParseTemplate(j, at, ids, c);
  } else if (type != "ByteLevel") {
    Unsupported(at, "post_processor", type, "TemplateProcessing, ByteLevel, Sequence");
  }
}

TokenizerJson ParseTop(const Json& j) {
  if (!j.is_object()) Refuse("the top level is not an object");
  for (const char* key : {"truncation", "padding"}) {
    if (j.contains(key) && !j[key].is_null()) {
      RefuseAt(JsonPointerChild("", key), fmt::format("{} is not supported (null only)", key));
    }
  }
  TokenizerJson c;
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    ParseNormalizer(j["normalizer"], "/normalizer", 0, &c.normalizer);
  }
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
    ParsePreTokenizer(j["pre_tokenizer"], "/pre_tokenizer", 0, &c.pre_tokenizer);
  }
  const bool byte_level =
      !c.pre_tokenizer.empty() && c.pre_tokenizer.back().kind == PreTokenizerStep::kByteLevel;
  for (const auto& step : c.pre_tokenizer) {
    if (byte_level && step.kind == PreTokenizerStep::kMetaspace) {
      RefuseAt("/pre_tokenizer",
               "pre_tokenizer Metaspace together with ByteLevel is not supported");
    }
  }
  if (!j.contains("model")) Refuse("there is no \"model\"");
  c.model = ParseModel(j["model"], byte_level);
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    const Json& list = ArrayAt(j["added_tokens"], "/added_tokens");
    for (size_t i = 0; i < list.size(); ++i) {
      c.added_tokens.push_back(ParseAddedToken(list[i], JsonPointerChild("/added_tokens", i)));
    }
  }
  const IdSet ids(c);
  c.vocab_size = static_cast<int>(ids.size());
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    c.has_decoder = true;
    ParseDecoder(j["decoder"], "/decoder", 0, &c.decoder);
  }
  if (j.contains("post_processor") && !j["post_processor"].is_null()) {
    ParsePostProcessor(j["post_processor"], "/post_processor", 0, ids, &c);
  }
  return c;
}

// A tokenizer_config.json special token: a string, an AddedToken object, or null.
std::string TokenName(const Json& j, const std::string& at) {
  if (j.is_null()) return "";
  if (j.is_object()) return StringField(j, at, "content");
  return StringAt(j, at);
}

}  // namespace

StatusOr<TokenizerJson> ParseTokenizerJson(std::string_view json) {
  STRATA_ASSIGN_OR_RETURN(const Json j, ParseJsonBounded(json));
  try {
    return ParseTop(j);
  } catch (const Refusal& r) {
    return InvalidArgumentError(r.message);
  } catch (const Json::exception& e) {
    // Every read above checks its type first; this is a net, bounded like the rest.
    return InvalidArgumentError(fmt::format("malformed: {}", Excerpt(e.what(), 240)));
  }
}

StatusOr<SpecialTokenNames> ParseTokenizerConfigJson(std::string_view json) {
  STRATA_ASSIGN_OR_RETURN(const Json j, ParseJsonBounded(json));
  try {
    if (!j.is_object()) Refuse("the top level is not an object");
    SpecialTokenNames names;
    if (j.contains("bos_token")) {
      names.has_bos = true, names.bos = TokenName(j["bos_token"], "/bos_token");
    }
    if (j.contains("eos_token")) {
      names.has_eos = true, names.eos = TokenName(j["eos_token"], "/eos_token");
    }
    for (auto [key, out] :
         {std::pair{"add_bos_token", &names.add_bos}, std::pair{"add_eos_token", &names.add_eos}}) {
      const auto it = j.find(key);
      if (it == j.end() || it->is_null()) continue;
      if (!it->is_boolean()) RefuseAt(std::string("/") + key, "must be true or false");
      *out = it->get<bool>() ? 1 : 0;
    }
    if (const auto it = j.find("tokenizer_class"); it != j.end() && !it->is_null()) {
      names.tokenizer_class = StringAt(*it, "/tokenizer_class");
    }
    return names;
  } catch (const Refusal& r) {
    return InvalidArgumentError(r.message);
  } catch (const Json::exception& e) {
    return InvalidArgumentError(fmt::format("malformed: {}", Excerpt(e.what(), 240)));
  }
}

StatusOr<SpecialTokenNames> ReadTokenizerConfigBeside(const std::string& tokenizer_path) {
  const std::string path =
      (std::filesystem::path(tokenizer_path).parent_path() / "tokenizer_config.json").string();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return SpecialTokenNames{};
  auto bytes = ReadSmallFile(path, {.max_bytes = uint64_t{64} << 20});
  if (!bytes.ok()) return bytes.status().WithContext("tokenizer config");
  auto parsed = ParseTokenizerConfigJson(*bytes);
  if (!parsed.ok()) {
    std::string why(parsed.status().message());
    std::replace(why.begin(), why.end(), '\n', ' ');
    return InvalidArgumentError(fmt::format("tokenizer_config.json '{}': {}", path, why));
  }
  return parsed;
}

}  // namespace strata::data::hf
