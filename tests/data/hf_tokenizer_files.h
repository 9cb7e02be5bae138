// tokenizer.json files for tests, built from BPE merges a tiny trainer learns here from
// tinyshakespeare, and the plainest reference BPE to check encodings against (merge the
// lowest-ranked adjacent pair of the whole pre-token until none is left). Shared by
// hf_tokenizer_test (the tokenizer itself) and the chat-template tests (chat_tokenizer_json_test,
// tools/tokenize_cli_test). A user of this header defines STRATA_TINYSHAKESPEARE (the text's
// path) and links PCRE2 and nlohmann_json.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <gtest/gtest.h>
#include <pcre2.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace strata::data::testing {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using Merges = std::vector<std::pair<std::string, std::string>>;

inline constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
inline constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// Added special tokens: ChatML's (Qwen 2's, and what hf_tokenizer_test uses) and Llama 3's.
inline const std::vector<std::string> kChatmlSpecials = {"<|endoftext|>", "<|im_start|>",
                                                         "<|im_end|>"};
inline const std::vector<std::string> kLlama3Specials = {"<|begin_of_text|>", "<|end_of_text|>",
                                                         "<|start_header_id|>", "<|end_header_id|>",
                                                         "<|eot_id|>"};

inline std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void WriteFile(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

inline std::string Shakespeare(size_t bytes) {
  return ReadFile(STRATA_TINYSHAKESPEARE).substr(0, bytes);
}

// ---- The reference: pre-tokenization by the file's regex through plain pcre2_match, then the
// plainest BPE. ----

// Matches and the gaps between them, in order (HF's Split with behavior Isolated).
inline std::vector<std::string> RegexPieces(const std::string& pattern, std::string_view text) {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                 PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  EXPECT_NE(re, nullptr);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re, nullptr);
  std::vector<std::string> pieces;
  size_t pos = 0, prev = 0;
  while (pos < text.size() && pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(text.data()),
                                          text.size(), pos, 0, md, nullptr) >= 0) {
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    if (ov[0] > prev) pieces.emplace_back(text.substr(prev, ov[0] - prev));
    if (ov[1] > ov[0]) pieces.emplace_back(text.substr(ov[0], ov[1] - ov[0]));
    prev = ov[1];
    pos = ov[1] > ov[0] ? ov[1] : ov[1] + 1;
  }
  if (prev < text.size()) pieces.emplace_back(text.substr(prev));
  pcre2_match_data_free(md);
  pcre2_code_free(re);
  return pieces;
}

inline std::vector<std::string> Utf8Chars(std::string_view s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    out.emplace_back(s.substr(i, len));
    i += len;
  }
  return out;
}

// Repeatedly merges the adjacent pair of lowest rank (the leftmost of equals).
inline std::vector<std::string> PlainBpe(
    std::vector<std::string> symbols,
    const std::map<std::pair<std::string, std::string>, int>& rank) {
  for (;;) {
    int best = -1;
    size_t at = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto it = rank.find({symbols[i], symbols[i + 1]});
      if (it != rank.end() && (best < 0 || it->second < best)) best = it->second, at = i;
    }
    if (best < 0) return symbols;
    symbols[at] += symbols[at + 1];
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
}

// Leftmost-longest added tokens, then `segment` on the text between them.
template <typename F>
std::vector<int32_t> SplitSpecials(std::string_view text,
                                   const std::map<std::string, int>& specials, F segment) {
  std::vector<int32_t> ids;
  size_t start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    std::string best;
    for (const auto& [content, id] : specials) {
      if (text.substr(i, content.size()) == content && content.size() > best.size()) best = content;
    }
    if (best.empty()) continue;
    if (i > start) segment(text.substr(start, i - start), &ids);
    ids.push_back(specials.at(best));
    start = i + best.size();
    i = start - 1;
  }
  if (start < text.size()) segment(text.substr(start), &ids);
  return ids;
}

// A learned model in "unit" space: raw bytes for byte-level files, characters otherwise.
struct Model {
  Merges merges;
  std::map<std::pair<std::string, std::string>, int> rank;
  std::map<std::string, int> vocab;  // unit-space token -> id
  std::map<std::string, int> specials;
  int next_id = 0;
  void Add(const std::string& token) {
    if (vocab.emplace(token, next_id).second) ++next_id;
  }
};

// Learns up to `n` merges from words (unit sequences) with counts: the most frequent pair
// first, ties to the pair seen first. Pair counts are updated only for the words a merge changes.
inline Merges LearnMerges(const std::map<std::vector<std::string>, int>& word_counts, int n) {
  std::vector<std::string> names;
  std::unordered_map<std::string, int> index;
  auto id_of = [&](const std::string& s) {
    auto [it, added] = index.emplace(s, static_cast<int>(names.size()));
    if (added) names.push_back(s);
    return it->second;
  };
  std::vector<std::vector<int>> words;
  std::vector<int> counts;
  for (const auto& [w, c] : word_counts) {
    words.emplace_back();
    for (const std::string& u : w) words.back().push_back(id_of(u));
    counts.push_back(c);
  }
  auto key = [](int a, int b) {
    return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b);
  };
  std::map<uint64_t, long> pairs;  // ordered: ties go to the smaller key
  auto count = [&](const std::vector<int>& w, long c) {
    for (size_t i = 0; i + 1 < w.size(); ++i) pairs[key(w[i], w[i + 1])] += c;
  };
  for (size_t k = 0; k < words.size(); ++k) count(words[k], counts[k]);
  Merges merges;
  for (int m = 0; m < n; ++m) {
    auto best = pairs.end();
    for (auto it = pairs.begin(); it != pairs.end(); ++it) {
      if (best == pairs.end() || it->second > best->second) best = it;
    }
    if (best == pairs.end() || best->second < 2) break;
    const int a = static_cast<int>(best->first >> 32),
              b = static_cast<int>(best->first & 0xFFFFFFFF);
    merges.push_back({names[a], names[b]});
    const int merged = id_of(names[a] + names[b]);
    for (size_t k = 0; k < words.size(); ++k) {
      std::vector<int>& w = words[k];
      bool has = false;
      for (size_t i = 0; i + 1 < w.size() && !has; ++i) has = w[i] == a && w[i + 1] == b;
      if (!has) continue;
      count(w, -counts[k]);
      std::vector<int> out;
      for (size_t i = 0; i < w.size(); ++i) {
        if (i + 1 < w.size() && w[i] == a && w[i + 1] == b) {
          out.push_back(merged);
          ++i;
        } else {
          out.push_back(w[i]);
        }
      }
      w = std::move(out);
      count(w, counts[k]);
    }
    std::erase_if(pairs, [](const auto& p) { return p.second == 0; });
  }
  return merges;
}

inline std::string TrainingText() {
  return Shakespeare(40000) +
         "Привет, мир! Как дела? Москва и Петербург.\n"
         "It's 2024: they'd say we've 12345 apples, I'll go.\n";
}

// ---- Byte-level (GPT-2, Llama 3) ----

inline std::string ByteChars(std::string_view bytes) {  // GPT-2's bytes_to_unicode
  std::string out;
  for (unsigned char b : bytes) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    int cp = b;
    if (!printable) {
      cp = 256;
      for (int k = 0; k < b; ++k) {
        const bool p = (k >= '!' && k <= '~') || (k >= 0xA1 && k <= 0xAC) || k >= 0xAE;
        cp += p ? 0 : 1;
      }
    }
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }
  return out;
}

// Whole words the merges do not reach: only ignore_merges takes them whole.
inline const std::vector<std::string> kWholeWords = {" wherefore", " Romeo", "ing"};

// Appends `specials` as added tokens, with the ids after the vocabulary's, in order.
inline void AddSpecials(Model& m, const std::vector<std::string>& specials) {
  for (const std::string& s : specials) m.specials[s] = m.next_id++;
}

// Merges learned from TrainingText() split by GPT-2's regex; the vocabulary is the 256 bytes, the
// merged tokens, kWholeWords, then `specials`.
inline Model ByteLevelModel(const std::vector<std::string>& specials = kChatmlSpecials) {
  std::map<std::vector<std::string>, int> words;
  for (const std::string& piece : RegexPieces(kGpt2Regex, TrainingText())) {
    std::vector<std::string> units;
    for (char c : piece) units.emplace_back(1, c);
    ++words[units];
  }
  Model m;
  m.merges = LearnMerges(words, 300);
  for (int b = 0; b < 256; ++b) m.Add(std::string(1, static_cast<char>(b)));
  for (size_t r = 0; r < m.merges.size(); ++r) {
    m.rank[m.merges[r]] = static_cast<int>(r);
    m.Add(m.merges[r].first + m.merges[r].second);
  }
  for (const std::string& w : kWholeWords) m.Add(w);
  AddSpecials(m, specials);
  return m;
}

inline std::vector<int32_t> ReferenceByteLevel(const Model& m, const std::string& regex,
                                               bool ignore_merges, std::string_view text) {
  return SplitSpecials(text, m.specials, [&](std::string_view seg, std::vector<int32_t>* ids) {
    for (const std::string& piece : RegexPieces(regex, seg)) {
      if (ignore_merges && m.vocab.count(piece)) {
        ids->push_back(m.vocab.at(piece));
        continue;
      }
      std::vector<std::string> units;
      for (char c : piece) units.emplace_back(1, c);
      for (const std::string& s : PlainBpe(units, m.rank)) ids->push_back(m.vocab.at(s));
    }
  });
}

inline Json AddedTokens(const Model& m, bool normalized) {
  Json added = Json::array();
  for (const auto& [content, id] : m.specials) {
    added.push_back({{"id", id},
                     {"content", content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", normalized},
                     {"special", true}});
  }
  return added;
}

// style "gpt2": ByteLevel(use_regex) and "a b" merges; "llama3": Split(Llama 3's regex) +
// ByteLevel(use_regex false), [["a","b"]] merges, ignore_merges, a template that puts
// `bos_token` first; "qwen2": an NFC normalizer, Split(Qwen 2's regex) + ByteLevel(use_regex
// false), [["a","b"]] merges, a ByteLevel post-processor (no BOS), as Qwen 2 / 2.5 ship.
inline std::string ByteLevelJson(const Model& m, const std::string& style,
                                 const std::string& bos_token = "<|endoftext|>") {
  const bool gpt2 = style == "gpt2", llama3 = style == "llama3";
  Json vocab = Json::object();
  for (const auto& [token, id] : m.vocab) vocab[ByteChars(token)] = id;
  Json merges = Json::array();
  for (const auto& [a, b] : m.merges) {
    if (gpt2) {
      merges.push_back(ByteChars(a) + " " + ByteChars(b));
    } else {
      merges.push_back(Json::array({ByteChars(a), ByteChars(b)}));
    }
  }
  Json j = {{"version", "1.0"},
            {"truncation", nullptr},
            {"padding", nullptr},
            {"normalizer", nullptr},
            {"added_tokens", AddedTokens(m, gpt2)},
            {"decoder",
             {{"type", "ByteLevel"},
              {"add_prefix_space", true},
              {"trim_offsets", true},
              {"use_regex", true}}}};
  const Json byte_level = {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", true},
                           {"use_regex", gpt2}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", llama3},
                {"vocab", vocab},
                {"merges", merges}};
  if (gpt2) {
    j["pre_tokenizer"] = byte_level;
    j["post_processor"] = byte_level;
    return j.dump();
  }
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"},
                           {"pattern", {{"Regex", llama3 ? kLlama3Regex : kQwen2Regex}}},
                           {"behavior", "Isolated"},
                           {"invert", false}},
                          byte_level}}};
  if (!llama3) {
    j["normalizer"] = {{"type", "NFC"}};
    j["post_processor"] = {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", false},
                           {"use_regex", false}};
    return j.dump();
  }
  const int bos = m.specials.at(bos_token);
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", bos_token}, {"type_id", 0}}}},
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"pair", Json::array()},
      {"special_tokens",
       {{bos_token, {{"id", bos_token}, {"ids", {bos}}, {"tokens", {bos_token}}}}}}};
  return j.dump();
}

// ---- Chat templates (tokenizer_config.json's chat_template), as the models ship them ----

// Meta-Llama-3-8B-Instruct's, verbatim (as JSON-decoded from its tokenizer_config.json: the
// newlines inside the Jinja strings are real ones).
inline constexpr const char* kLlama3ChatTemplate =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% "
    "endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

// Qwen2-7B-Instruct's, verbatim: ChatML with a default system message.
inline constexpr const char* kQwen2ChatTemplate =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
    "+ message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if "
    "add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
inline constexpr const char* kQwen2DefaultSystem = "You are a helpful assistant.";

// A model directory as the Hub has it: `dir`/tokenizer.json and `dir`/tokenizer_config.json
// (`config`, e.g. bos_token, eos_token and chat_template).
inline void WriteTokenizerDir(const fs::path& dir, const std::string& tokenizer_json,
                              const Json& config) {
  fs::create_directories(dir);
  WriteFile(dir / "tokenizer.json", tokenizer_json);
  WriteFile(dir / "tokenizer_config.json", config.dump(2));
}

// Llama 3 (Instruct): `m` with kLlama3Specials, the "llama3" style, its chat template.
inline void WriteLlama3Dir(const fs::path& dir, const Model& m) {
  WriteTokenizerDir(dir, ByteLevelJson(m, "llama3", "<|begin_of_text|>"),
                    {{"bos_token", "<|begin_of_text|>"},
                     {"eos_token", "<|eot_id|>"},
                     {"chat_template", kLlama3ChatTemplate}});
}

// Qwen 2 (Instruct): `m` with kChatmlSpecials, the "qwen2" style, its chat template.
inline void WriteQwen2Dir(const fs::path& dir, const Model& m) {
  WriteTokenizerDir(dir, ByteLevelJson(m, "qwen2"),
                    {{"bos_token", nullptr},
                     {"eos_token", "<|im_end|>"},
                     {"pad_token", "<|endoftext|>"},
                     {"chat_template", kQwen2ChatTemplate}});
}

}  // namespace strata::data::testing
