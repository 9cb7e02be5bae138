#include "data/hf_tokenizer_json.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace strata::data::hf {

namespace {

using Json = nlohmann::json;

// Errors inside the parser travel as this exception and become kInvalidArgument at the top.
struct Refusal {
  std::string message;
};

[[noreturn]] void Refuse(std::string message) { throw Refusal{std::move(message)}; }

std::string TypeOf(const Json& j, const char* what) {
  if (!j.is_object()) Refuse(fmt::format("{} is not an object", what));
  if (!j.contains("type") || !j["type"].is_string()) {
    Refuse(fmt::format("{} has no \"type\"", what));
  }
  return j["type"].get<std::string>();
}

[[noreturn]] void Unsupported(const char* what, const std::string& type, const char* supported) {
  Refuse(fmt::format("{} type {} is not supported (supported: {})", what, type, supported));
}

bool BoolOr(const Json& j, const char* key, bool fallback) {
  return j.contains(key) && !j[key].is_null() ? j[key].get<bool>() : fallback;
}

// A Split or Replace pattern: {"String": s} or {"Regex": r}; *is_regex says which.
std::string Pattern(const Json& j, const char* what, bool* is_regex) {
  const Json& p = j.at("pattern");
  if (p.contains("String")) return *is_regex = false, p["String"].get<std::string>();
  if (p.contains("Regex")) return *is_regex = true, p["Regex"].get<std::string>();
  Refuse(fmt::format("{} pattern is neither String nor Regex", what));
}

void ParseNormalizer(const Json& j, std::vector<NormalizerStep>* out) {
  const std::string type = TypeOf(j, "normalizer");
  if (type == "Sequence") {
    for (const Json& n : j.at("normalizers")) ParseNormalizer(n, out);
  } else if (type == "Prepend") {
    out->push_back({NormalizerStep::kPrepend, j.at("prepend").get<std::string>(), ""});
  } else if (type == "Replace") {
    bool regex = false;
    std::string pattern = Pattern(j, "normalizer Replace", &regex);
    if (regex) Refuse("normalizer Replace with a Regex pattern is not supported (String only)");
    if (pattern.empty()) Refuse("normalizer Replace has an empty pattern");
    out->push_back(
        {NormalizerStep::kReplace, std::move(pattern), j.at("content").get<std::string>()});
  } else if (type == "NFC") {
    out->push_back({NormalizerStep::kNfc, "", ""});
  } else {
    Unsupported("normalizer", type, "Prepend, Replace, NFC, Sequence");
  }
}

PrependScheme ParsePrependScheme(const Json& j) {
  if (j.contains("prepend_scheme")) {
    const std::string s = j["prepend_scheme"].get<std::string>();
    if (s == "always") return PrependScheme::kAlways;
    if (s == "first") return PrependScheme::kFirst;
    if (s == "never") return PrependScheme::kNever;
    Refuse(fmt::format("Metaspace prepend_scheme '{}' is not supported (always, first, never)", s));
  }
  // Files older than prepend_scheme: add_prefix_space.
  return BoolOr(j, "add_prefix_space", true) ? PrependScheme::kAlways : PrependScheme::kNever;
}

SplitBehavior ParseBehavior(const std::string& s) {
  if (s == "Removed") return SplitBehavior::kRemoved;
  if (s == "Isolated") return SplitBehavior::kIsolated;
  if (s == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (s == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (s == "Contiguous") return SplitBehavior::kContiguous;
  Refuse(
      fmt::format("Split behavior {} is not supported (Removed, Isolated, MergedWithPrevious, "
                  "MergedWithNext, Contiguous)",
                  s));
}

std::shared_ptr<const Regex> Compile(const std::string& pattern) {
  auto re = Regex::Create(pattern);
  if (!re.ok()) Refuse(std::string(re.status().message()));
  return std::shared_ptr<const Regex>(std::move(*re));
}

void ParsePreTokenizer(const Json& j, std::vector<PreTokenizerStep>* out) {
  const std::string type = TypeOf(j, "pre_tokenizer");
  PreTokenizerStep step{};
  if (type == "Sequence") {
    for (const Json& p : j.at("pretokenizers")) ParsePreTokenizer(p, out);
    return;
  } else if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::kByteLevel;
    step.add_prefix_space = BoolOr(j, "add_prefix_space", true);
    if (BoolOr(j, "use_regex", true)) step.regex = Compile(kGpt2Pattern);
  } else if (type == "Split") {
    step.kind = PreTokenizerStep::kSplit;
    bool regex = false;
    std::string pattern = Pattern(j, "pre_tokenizer Split", &regex);
    if (pattern.empty()) Refuse("pre_tokenizer Split has an empty pattern");
    if (regex) {
      step.regex = Compile(pattern);
    } else {
      step.literal = std::move(pattern);
    }
    step.behavior = ParseBehavior(j.at("behavior").get<std::string>());
    step.invert = BoolOr(j, "invert", false);
  } else if (type == "Metaspace") {
    step.kind = PreTokenizerStep::kMetaspace;
    step.replacement = j.at("replacement").get<std::string>();
    size_t len = 0;
    if (step.replacement.empty() || FindInvalidUtf8(step.replacement) != std::string::npos ||
        (DecodeUtf8(step.replacement, 0, &len), len != step.replacement.size())) {
      Refuse("pre_tokenizer Metaspace replacement is not one character");
    }
    step.prepend_scheme = ParsePrependScheme(j);
    step.split = BoolOr(j, "split", true);
  } else {
    Unsupported("pre_tokenizer", type, "ByteLevel, Split, Metaspace, Sequence");
  }
  if (!out->empty() && out->back().kind == PreTokenizerStep::kByteLevel) {
    Refuse(
        "pre_tokenizer ByteLevel followed by another pre-tokenizer is not supported (ByteLevel "
        "must come last)");
  }
  out->push_back(std::move(step));
}

void ParseDecoder(const Json& j, std::vector<DecoderStep>* out) {
  const std::string type = TypeOf(j, "decoder");
  DecoderStep step{};
  if (type == "Sequence") {
    for (const Json& d : j.at("decoders")) ParseDecoder(d, out);
    return;
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::kByteLevel;
  } else if (type == "Replace") {
    step.kind = DecoderStep::kReplace;
    bool regex = false;
    step.a = Pattern(j, "decoder Replace", &regex);
    if (regex) Refuse("decoder Replace with a Regex pattern is not supported (String only)");
    if (step.a.empty()) Refuse("decoder Replace has an empty pattern");
    step.b = j.at("content").get<std::string>();
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::kFuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::kStrip;
    step.a = j.at("content").get<std::string>();
    step.start = j.at("start").get<int>();
    step.stop = j.at("stop").get<int>();
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::kMetaspace;
    step.a = j.at("replacement").get<std::string>();
    step.prepend_scheme = ParsePrependScheme(j);
  } else {
    Unsupported("decoder", type,
                "ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence");
  }
  out->push_back(std::move(step));
}

// A merge as "a b" or ["a", "b"].
std::pair<std::string, std::string> ParseMerge(const Json& m, size_t rank) {
  if (m.is_array()) {
    if (m.size() != 2) Refuse(fmt::format("model.merges[{}] does not have two parts", rank));
    return {m[0].get<std::string>(), m[1].get<std::string>()};
  }
  const std::string s = m.get<std::string>();
  const size_t space = s.find(' ');
  if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
    Refuse(fmt::format("model.merges[{}] '{}' is not two parts separated by one space", rank, s));
  }
  return {s.substr(0, space), s.substr(space + 1)};
}

bool NullOrEmpty(const Json& j, const char* key) {
  return !j.contains(key) || j[key].is_null() || j[key].get<std::string>().empty();
}

std::unique_ptr<BpeModel> ParseModel(const Json& j, bool byte_level) {
  const std::string type = j.contains("type") ? TypeOf(j, "model") : "BPE";
  if (type != "BPE") Unsupported("model", type, "BPE");
  if (j.contains("dropout") && !j["dropout"].is_null()) {
    Refuse("model BPE dropout is not supported (null only)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!NullOrEmpty(j, key)) Refuse(fmt::format("model BPE {} is not supported (null only)", key));
  }
  BpeOptions o;
  o.byte_level = byte_level;
  o.byte_fallback = BoolOr(j, "byte_fallback", false);
  o.fuse_unk = BoolOr(j, "fuse_unk", false);
  o.ignore_merges = BoolOr(j, "ignore_merges", false);
  if (j.contains("unk_token") && !j["unk_token"].is_null()) o.unk_token = j["unk_token"];
  Vocab vocab;
  const Json& v = j.at("vocab");
  if (!v.is_object()) Refuse("model.vocab is not an object");
  vocab.reserve(v.size());
  for (const auto& [token, id] : v.items()) {
    const int i = id.get<int>();
    if (i < 0) Refuse(fmt::format("model.vocab['{}'] is negative", token));
    vocab.emplace(token, i);
  }
  std::vector<std::pair<std::string, std::string>> merges;
  const Json& m = j.at("merges");
  merges.reserve(m.size());
  for (size_t r = 0; r < m.size(); ++r) merges.push_back(ParseMerge(m[r], r));
  auto model = BpeModel::Create(std::move(vocab), merges, std::move(o));
  if (!model.ok()) Refuse(std::string(model.status().message()));
  return std::move(*model);
}

AddedToken ParseAddedToken(const Json& j) {
  AddedToken t;
  t.id = j.at("id").get<int>();
  t.content = j.at("content").get<std::string>();
  if (t.content.empty()) Refuse(fmt::format("added token {} has empty content", t.id));
  t.single_word = BoolOr(j, "single_word", false);
  t.lstrip = BoolOr(j, "lstrip", false);
  t.rstrip = BoolOr(j, "rstrip", false);
  t.normalized = BoolOr(j, "normalized", false);
  t.special = BoolOr(j, "special", false);
  return t;
}

// TemplateProcessing's "single": the special tokens right before and after the sequence.
void ParseTemplate(const Json& j, TokenizerJson* c) {
  const Json& single = j.at("single");
  bool seen_sequence = false;
  for (const Json& item : single) {
    if (item.contains("Sequence")) {
      seen_sequence = true;
    } else if (item.contains("SpecialToken")) {
      const std::string name = item["SpecialToken"].at("id").get<std::string>();
      int id = -1;
      if (j.contains("special_tokens") && j["special_tokens"].contains(name)) {
        const Json& ids = j["special_tokens"][name].at("ids");
        if (ids.size() == 1) id = ids[0].get<int>();
      }
      if (!seen_sequence) {
        c->template_bos = name, c->template_bos_id = id;
      } else if (c->template_eos.empty()) {
        c->template_eos = name, c->template_eos_id = id;
      }
    }
  }
}

void ParsePostProcessor(const Json& j, TokenizerJson* c) {
  const std::string type = TypeOf(j, "post_processor");
  if (type == "Sequence") {
    for (const Json& p : j.at("processors")) ParsePostProcessor(p, c);
  } else if (type == "TemplateProcessing") {
    ParseTemplate(j, c);
  } else if (type != "ByteLevel") {
    Unsupported("post_processor", type, "TemplateProcessing, ByteLevel, Sequence");
  }
}

TokenizerJson ParseTop(const Json& j) {
  if (!j.is_object()) Refuse("the top level is not an object");
  for (const char* key : {"truncation", "padding"}) {
    if (j.contains(key) && !j[key].is_null()) {
      Refuse(fmt::format("{} is not supported (null only)", key));
    }
  }
  TokenizerJson c;
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    ParseNormalizer(j["normalizer"], &c.normalizer);
  }
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
    ParsePreTokenizer(j["pre_tokenizer"], &c.pre_tokenizer);
  }
  const bool byte_level =
      !c.pre_tokenizer.empty() && c.pre_tokenizer.back().kind == PreTokenizerStep::kByteLevel;
  for (const auto& step : c.pre_tokenizer) {
    if (byte_level && step.kind == PreTokenizerStep::kMetaspace) {
      Refuse("pre_tokenizer Metaspace together with ByteLevel is not supported");
    }
  }
  if (!j.contains("model")) Refuse("there is no \"model\"");
  c.model = ParseModel(j["model"], byte_level);
  if (j.contains("added_tokens")) {
    for (const Json& t : j["added_tokens"]) c.added_tokens.push_back(ParseAddedToken(t));
  }
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    c.has_decoder = true;
    ParseDecoder(j["decoder"], &c.decoder);
  }
  if (j.contains("post_processor") && !j["post_processor"].is_null()) {
    ParsePostProcessor(j["post_processor"], &c);
  }
  return c;
}

// A tokenizer_config.json special token: a string, an AddedToken object, or null.
std::string TokenName(const Json& j) {
  if (j.is_null()) return "";
  if (j.is_object()) return j.at("content").get<std::string>();
  return j.get<std::string>();
}

}  // namespace

StatusOr<TokenizerJson> ParseTokenizerJson(const std::string& json) {
  try {
    return ParseTop(Json::parse(json));
  } catch (const Refusal& r) {
    return InvalidArgumentError(r.message);
  } catch (const Json::exception& e) {
    return InvalidArgumentError(fmt::format("malformed: {}", e.what()));
  }
}

StatusOr<SpecialTokenNames> ParseTokenizerConfigJson(const std::string& json) {
  try {
    const Json j = Json::parse(json);
    SpecialTokenNames names;
    if (j.contains("bos_token")) names.has_bos = true, names.bos = TokenName(j["bos_token"]);
    if (j.contains("eos_token")) names.has_eos = true, names.eos = TokenName(j["eos_token"]);
    return names;
  } catch (const Json::exception& e) {
    return InvalidArgumentError(fmt::format("malformed: {}", e.what()));
  }
}

}  // namespace strata::data::hf
