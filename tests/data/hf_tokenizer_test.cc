// Hugging Face tokenizer.json tokenizers: the test builds its own files — BPE merges learned here
// from tinyshakespeare by a tiny trainer, written as a GPT-2-style file (ByteLevel pre-tokenizer),
// a Llama-3-style file (Split with Llama 3's regex, then ByteLevel; ignore_merges) and a
// SentencePiece-style file (Prepend and Replace normalizers, <0xXX> byte fallback), each with
// added special tokens — and compares Strata's ids with a reference written here independently:
// the plainest BPE (merge the lowest-ranked adjacent pair of the whole pre-token until none is
// left). Also: decode(encode(text)) == text, streaming a text file in tiny blocks gives
// Encode(whole)'s ids, and unsupported components and malformed files are refused by name.
#include "data/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <pcre2.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "data/tokenizer.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;
using Merges = std::vector<std::pair<std::string, std::string>>;

constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const std::string kSpace = "\xE2\x96\x81";  // ▁
const std::vector<std::string> kSpecials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteFile(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

std::string Shakespeare(size_t bytes) { return ReadFile(STRATA_TINYSHAKESPEARE).substr(0, bytes); }

// ---- The reference: pre-tokenization by the file's regex through plain pcre2_match, then the
// plainest BPE. ----

// Matches and the gaps between them, in order (HF's Split with behavior Isolated).
std::vector<std::string> RegexPieces(const std::string& pattern, std::string_view text) {
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

std::vector<std::string> Utf8Chars(std::string_view s) {
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
std::vector<std::string> PlainBpe(std::vector<std::string> symbols,
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
Merges LearnMerges(const std::map<std::vector<std::string>, int>& word_counts, int n) {
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

std::string TrainingText() {
  return Shakespeare(40000) +
         "Привет, мир! Как дела? Москва и Петербург.\n"
         "It's 2024: they'd say we've 12345 apples, I'll go.\n";
}

// ---- Byte-level (GPT-2, Llama 3) ----

std::string ByteChars(std::string_view bytes) {  // GPT-2's bytes_to_unicode
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
const std::vector<std::string> kWholeWords = {" wherefore", " Romeo", "ing"};

Model ByteLevelModel() {
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
  for (const std::string& s : kSpecials) m.specials[s] = m.next_id++;
  return m;
}

std::vector<int32_t> ReferenceByteLevel(const Model& m, const std::string& regex,
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

Json AddedTokens(const Model& m, bool normalized) {
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
// ByteLevel(use_regex false), [["a","b"]] merges, ignore_merges, a BOS template.
std::string ByteLevelJson(const Model& m, const std::string& style) {
  Json vocab = Json::object();
  for (const auto& [token, id] : m.vocab) vocab[ByteChars(token)] = id;
  Json merges = Json::array();
  for (const auto& [a, b] : m.merges) {
    if (style == "gpt2") {
      merges.push_back(ByteChars(a) + " " + ByteChars(b));
    } else {
      merges.push_back(Json::array({ByteChars(a), ByteChars(b)}));
    }
  }
  Json j = {{"version", "1.0"},
            {"truncation", nullptr},
            {"padding", nullptr},
            {"normalizer", nullptr},
            {"added_tokens", AddedTokens(m, style == "gpt2")},
            {"decoder",
             {{"type", "ByteLevel"},
              {"add_prefix_space", true},
              {"trim_offsets", true},
              {"use_regex", true}}}};
  const Json byte_level = {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", true},
                           {"use_regex", style == "gpt2"}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", style != "gpt2"},
                {"vocab", vocab},
                {"merges", merges}};
  if (style == "gpt2") {
    j["pre_tokenizer"] = byte_level;
    j["post_processor"] = byte_level;
  } else {
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"},
                             {"pattern", {{"Regex", kLlama3Regex}}},
                             {"behavior", "Isolated"},
                             {"invert", false}},
                            byte_level}}};
    const int bos = m.specials.at("<|endoftext|>");
    j["post_processor"] = {
        {"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"pair", Json::array()},
        {"special_tokens",
         {{"<|endoftext|>",
           {{"id", "<|endoftext|>"}, {"ids", {bos}}, {"tokens", {"<|endoftext|>"}}}}}}};
  }
  return j.dump();
}

// ---- SentencePiece-style (Llama 2) ----

std::string SpNormalize(std::string_view seg) {
  std::string out = kSpace;
  for (char c : seg) {
    if (c == ' ') {
      out += kSpace;
    } else {
      out.push_back(c);
    }
  }
  return out;
}

Model SentencePieceModel() {
  // Words: runs starting at ▁, with a newline its own word (so no merge crosses one).
  std::map<std::vector<std::string>, int> words;
  std::vector<std::string> word;
  for (const std::string& ch : Utf8Chars(SpNormalize(TrainingText()))) {
    if ((ch == kSpace || ch == "\n") && !word.empty()) ++words[word], word.clear();
    if (ch != "\n") word.push_back(ch);
  }
  if (!word.empty()) ++words[word];
  Model m;
  m.Add("<unk>"), m.Add("<s>"), m.Add("</s>");
  for (int b = 0; b < 256; ++b) m.Add(fmt::format("<0x{:02X}>", b));
  for (const auto& [w, c] : words) {
    for (const std::string& ch : w) m.Add(ch);
  }
  m.merges = LearnMerges(words, 300);
  for (size_t r = 0; r < m.merges.size(); ++r) {
    m.rank[m.merges[r]] = static_cast<int>(r);
    m.Add(m.merges[r].first + m.merges[r].second);
  }
  m.specials = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  m.specials["<|im_start|>"] = m.next_id++;
  m.specials["<|im_end|>"] = m.next_id++;
  return m;
}

std::vector<int32_t> ReferenceSentencePiece(const Model& m, std::string_view text) {
  return SplitSpecials(text, m.specials, [&](std::string_view seg, std::vector<int32_t>* ids) {
    for (const std::string& s : PlainBpe(Utf8Chars(SpNormalize(seg)), m.rank)) {
      if (auto it = m.vocab.find(s); it != m.vocab.end()) {
        ids->push_back(it->second);
      } else {
        for (unsigned char b : s) ids->push_back(m.vocab.at(fmt::format("<0x{:02X}>", b)));
      }
    }
  });
}

std::string SentencePieceJson(const Model& m) {
  Json vocab = Json::object();
  for (const auto& [token, id] : m.vocab) vocab[token] = id;
  Json merges = Json::array();
  for (const auto& [a, b] : m.merges) merges.push_back(a + " " + b);
  Json j = {{"version", "1.0"},
            {"truncation", nullptr},
            {"padding", nullptr},
            {"added_tokens", AddedTokens(m, false)},
            {"pre_tokenizer", nullptr}};
  j["normalizer"] = {
      {"type", "Sequence"},
      {"normalizers",
       {{{"type", "Prepend"}, {"prepend", kSpace}},
        {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kSpace}}}}};
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders",
                   {{{"type", "Replace"}, {"pattern", {{"String", kSpace}}}, {"content", " "}},
                    {{"type", "ByteFallback"}},
                    {{"type", "Fuse"}},
                    {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", "<unk>"},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", true},
                {"byte_fallback", true},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", merges}};
  j["post_processor"] = nullptr;
  return j.dump();
}

// ---- The texts ----

std::vector<std::string> Texts() {
  return {
      "Hello world",
      "a   b\t\tc\n\n\nd  \n e   ",
      "   leading spaces and trailing   ",
      "\t\ttabs\tand\r\nCRLF\r\nlines\n",
      "Numbers: 12345678901234567890, 3.14159, 2024-11-27, 007",
      "Punctuation!!! (yes) -- \"quotes\" ... ?!; [brackets] {braces} @#$%^&*",
      "Contractions: I'm you're he'll we've it's they'd DON'T Won't",
      "Привет, мир! Кириллица здесь.",
      "日本語のテキストと中文文本",
      "مرحبا بالعالم",
      "Emoji: 👍🏽 👨‍👩‍👧‍👦 🎉🎉 ok",
      "wherefore art thou Romeo? Romeo, wherefore",
      "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>",
      "text<|endoftext|>more text <|endoftext|> <|im_start|><|im_end|>",
      "",
      "x",
  };
}

class HfTokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("strata_hf_tokenizer_" + std::to_string(::getpid())));
    fs::remove_all(*dir_);
    byte_model_ = new Model(ByteLevelModel());
    sp_model_ = new Model(SentencePieceModel());
    for (const char* style : {"gpt2", "llama3", "sp"}) {
      fs::create_directories(*dir_ / style);
      WriteFile(*dir_ / style / "tokenizer.json", std::string(style) == "sp"
                                                      ? SentencePieceJson(*sp_model_)
                                                      : ByteLevelJson(*byte_model_, style));
    }
    WriteFile(*dir_ / "sp" / "tokenizer_config.json",
              R"({"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false}})");
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
    delete byte_model_;
    delete sp_model_;
  }

  static std::string JsonPath(const char* style) {
    return (*dir_ / style / "tokenizer.json").string();
  }
  static std::unique_ptr<Tokenizer> LoadStyle(const char* style) {
    auto t = Tokenizer::Load(JsonPath(style));
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(*t) : nullptr;
  }
  static std::vector<int32_t> Reference(const char* style, std::string_view text) {
    const std::string s = style;
    if (s == "sp") return ReferenceSentencePiece(*sp_model_, text);
    return ReferenceByteLevel(*byte_model_, s == "gpt2" ? kGpt2Regex : kLlama3Regex, s == "llama3",
                              text);
  }
  // A copy of `style`'s file with `edit` applied to its JSON.
  template <typename F>
  static std::string EditedFile(const char* style, const std::string& name, F edit) {
    Json j = Json::parse(ReadFile(JsonPath(style)));
    edit(j);
    const fs::path path = *dir_ / (name + ".json");
    WriteFile(path, j.dump());
    return path.string();
  }

  static fs::path* dir_;
  static Model* byte_model_;
  static Model* sp_model_;
};

fs::path* HfTokenizerTest::dir_ = nullptr;
Model* HfTokenizerTest::byte_model_ = nullptr;
Model* HfTokenizerTest::sp_model_ = nullptr;

TEST_F(HfTokenizerTest, TheTrainerLearnedEnoughMergesToMatter) {
  EXPECT_GE(byte_model_->merges.size(), 250u);
  EXPECT_GE(sp_model_->merges.size(), 250u);
  const std::string text = Shakespeare(5000);
  for (const char* style : {"gpt2", "llama3", "sp"}) {
    auto t = LoadStyle(style);
    ASSERT_NE(t, nullptr);
    EXPECT_LT(t->Encode(text)->size() * 2, text.size()) << style;  // < 0.5 tokens per byte
  }
}

TEST_F(HfTokenizerTest, EveryStyleGivesTheReferenceIdsOnEveryText) {
  std::vector<std::string> texts = Texts();
  texts.push_back(Shakespeare(30000).substr(20000));  // text beyond what the merges saw
  for (const char* style : {"gpt2", "llama3", "sp"}) {
    auto t = LoadStyle(style);
    ASSERT_NE(t, nullptr);
    for (const std::string& text : texts) {
      if (std::string(style) == "sp" && text.size() > 2000) continue;  // the reference is O(n^2)
      auto ids = t->Encode(text);
      ASSERT_TRUE(ids.ok()) << ids.status().ToString();
      EXPECT_EQ(*ids, Reference(style, text)) << style << ": '" << text << "'";
    }
  }
}

TEST_F(HfTokenizerTest, DecodeOfEncodeGivesTheTextBack) {
  std::vector<std::string> texts = Texts();
  texts.push_back(Shakespeare(5000));
  for (const char* style : {"gpt2", "llama3", "sp"}) {
    auto t = LoadStyle(style);
    ASSERT_NE(t, nullptr);
    for (const std::string& text : texts) {
      // A SentencePiece-style file prepends "▁" to the text after each added token too (as HF
      // does), which decodes to a space: compare texts without added tokens there.
      if (std::string(style) == "sp" && text.find("<|") != std::string::npos) continue;
      auto ids = t->Encode(text);
      ASSERT_TRUE(ids.ok()) << ids.status().ToString();
      auto back = t->Decode(*ids);
      ASSERT_TRUE(back.ok()) << back.status().ToString();
      EXPECT_EQ(*back, text) << style;
    }
  }
}

TEST_F(HfTokenizerTest, SpecialTokensInTextEncodeToTheirIds) {
  for (const char* style : {"gpt2", "llama3", "sp"}) {
    auto t = LoadStyle(style);
    ASSERT_NE(t, nullptr);
    const int start = t->TokenId("<|im_start|>"), end = t->TokenId("<|im_end|>");
    ASSERT_GE(start, 0);
    ASSERT_GE(end, 0);
    auto ids = t->Encode("<|im_start|>user\nhi<|im_end|>");
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(ids->front(), start) << style;
    EXPECT_EQ(ids->back(), end) << style;
    EXPECT_EQ(std::count(ids->begin(), ids->end(), start), 1);
  }
}

TEST_F(HfTokenizerTest, IgnoreMergesTakesAWholeVocabularyWord) {
  auto gpt2 = LoadStyle("gpt2"), llama3 = LoadStyle("llama3");
  ASSERT_NE(gpt2, nullptr);
  ASSERT_NE(llama3, nullptr);
  const int whole = llama3->TokenId("\xC4\xA0wherefore");  // "Ġwherefore"
  ASSERT_GE(whole, 0);
  EXPECT_EQ(*llama3->Encode(" wherefore"), std::vector<int32_t>{whole});
  EXPECT_GT(gpt2->Encode(" wherefore")->size(), 1u);
}

TEST_F(HfTokenizerTest, SpecialIdsComeFromTheConfigOrTheTemplate) {
  auto gpt2 = LoadStyle("gpt2"), llama3 = LoadStyle("llama3"), sp = LoadStyle("sp");
  ASSERT_NE(sp, nullptr);
  EXPECT_EQ(gpt2->bos_id(), -1);
  EXPECT_EQ(gpt2->eos_id(), -1);
  EXPECT_EQ(llama3->bos_id(), llama3->TokenId("<|endoftext|>"));
  EXPECT_EQ(llama3->eos_id(), -1);
  EXPECT_EQ(sp->bos_id(), 1);
  EXPECT_EQ(sp->eos_id(), 2);
  EXPECT_EQ(sp->vocab_size(), sp_model_->next_id);
  EXPECT_EQ(sp->TokenId(kSpace + "the"),
            sp_model_->vocab.count(kSpace + "the") ? sp_model_->vocab.at(kSpace + "the") : -1);
  EXPECT_EQ(sp->TokenId("no such token"), -1);
  const std::string bytes = ReadFile(JsonPath("sp"));
  EXPECT_EQ(sp->fingerprint(), XXH3_64bits(bytes.data(), bytes.size()));
  EXPECT_EQ(sp->path(), JsonPath("sp"));
}

TEST_F(HfTokenizerTest, StreamingInTinyBlocksGivesTheIdsOfTheWholeText) {
  const std::string text = Shakespeare(12000) + Texts()[7] + "\n" + Texts()[10] + "\nEnd.\n" +
                           "<|im_start|>user\nSo<|im_end|>\nAnd   \n\nthen\n";
  const fs::path text_path = *dir_ / "stream.txt";
  WriteFile(text_path, text);
  for (const char* style : {"gpt2", "llama3", "sp"}) {
    auto t = LoadStyle(style);
    ASSERT_NE(t, nullptr);
    std::vector<int32_t> want;
    if (t->bos_id() >= 0) want.push_back(t->bos_id());
    const auto whole = t->Encode(text);
    ASSERT_TRUE(whole.ok());
    want.insert(want.end(), whole->begin(), whole->end());
    for (size_t block : {size_t{1}, size_t{7}, size_t{100}, size_t{4096}, kTokenizeBlockBytes}) {
      auto ids = TokenizeTextFile(*t, text_path.string(), block);
      ASSERT_TRUE(ids.ok()) << ids.status().ToString();
      EXPECT_EQ(*ids, want) << style << ", blocks of " << block;
    }
    // The cut points exist (the text is not simply held whole).
    EXPECT_GT(t->LastSafeCut(text, 0), text.size() / 2) << style;
  }
}

TEST_F(HfTokenizerTest, CutPointsAreWhereTheyAreProvablySafe) {
  auto gpt2 = LoadStyle("gpt2"), sp = LoadStyle("sp");
  ASSERT_NE(sp, nullptr);
  // Byte-level: before a letter after "<non-space>\n".
  EXPECT_EQ(gpt2->LastSafeCut("ab.\nHello", 0), 4u);
  EXPECT_EQ(gpt2->LastSafeCut("ab \nHello", 0), 0u);    // a space before the newline
  EXPECT_EQ(gpt2->LastSafeCut("ab.\n\nHello", 0), 0u);  // a newline run
  EXPECT_EQ(gpt2->LastSafeCut("ab.\n<|im_start|>", 0), 0u);
  EXPECT_EQ(gpt2->LastSafeCut("ab.\nHello", 5), 0u);
  // SentencePiece-style: after a newline.
  EXPECT_EQ(sp->LastSafeCut("ab \n  x", 0), 4u);
}

TEST_F(HfTokenizerTest, LoadTakesADirectoryOrAJsonFile) {
  auto dir = Tokenizer::Load((*dir_ / "sp").string());
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  EXPECT_EQ((*dir)->path(), (*dir_ / "sp" / "tokenizer.json").string());
  // tokenizer.json wins over tokenizer.model (here not a model at all).
  const fs::path both = *dir_ / "both";
  fs::create_directories(both);
  fs::copy_file(JsonPath("gpt2"), both / "tokenizer.json");
  WriteFile(both / "tokenizer.model", "not a model");
  EXPECT_TRUE(Tokenizer::Load(both.string()).ok());
  fs::remove(both / "tokenizer.json");
  auto model = Tokenizer::Load(both.string());
  ASSERT_FALSE(model.ok());
  EXPECT_THAT(model.status().message(), HasSubstr("SentencePiece"));
  fs::remove(both / "tokenizer.model");
  auto none = Tokenizer::Load(both.string());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
}

TEST_F(HfTokenizerTest, UnsupportedComponentsAreRefusedByName) {
  struct Case {
    const char* name;
    std::function<void(Json&)> edit;
    const char* want;
  };
  const std::vector<Case> cases = {
      {"digits",
       [](Json& j) {
         j["pre_tokenizer"] = {{"type", "Digits"}};
       },
       "pre_tokenizer type Digits is not supported (supported: ByteLevel, Split, Metaspace, "
       "Sequence)"},
      {"wordpiece", [](Json& j) { j["model"]["type"] = "WordPiece"; },
       "model type WordPiece is not supported"},
      {"lowercase",
       [](Json& j) {
         j["normalizer"] = {{"type", "Lowercase"}};
       },
       "normalizer type Lowercase is not supported"},
      {"dropout", [](Json& j) { j["model"]["dropout"] = 0.1; }, "dropout"},
      {"prefix", [](Json& j) { j["model"]["continuing_subword_prefix"] = "##"; },
       "continuing_subword_prefix"},
      {"truncation",
       [](Json& j) {
         j["truncation"] = {{"max_length", 8}};
       },
       "truncation"},
      {"decoder",
       [](Json& j) {
         j["decoder"] = {{"type", "WordPiece"}};
       },
       "decoder type WordPiece is not supported"},
      {"behavior", [](Json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; },
       "Split behavior Sideways"},
  };
  for (const Case& c : cases) {
    const std::string path =
        EditedFile(std::string(c.name) == "behavior" ? "llama3" : "gpt2", c.name, c.edit);
    auto t = Tokenizer::Load(path);
    ASSERT_FALSE(t.ok()) << c.name;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr("tokenizer.json '" + path + "': "));
    EXPECT_THAT(t.status().message(), HasSubstr(c.want));
    EXPECT_THAT(t.status().message(), Not(HasSubstr("\n")));
  }
}

TEST_F(HfTokenizerTest, AMalformedFileIsAOneLineErrorNamingIt) {
  const std::string good = ReadFile(JsonPath("gpt2"));
  const fs::path cut = *dir_ / "cut.json";
  WriteFile(cut, good.substr(0, good.size() / 2) + "\n\n");
  const std::string missing_merge =
      EditedFile("gpt2", "merge", [](Json& j) { j["model"]["merges"].push_back("zzz qqq"); });
  const std::string no_model = EditedFile("gpt2", "nomodel", [](Json& j) { j.erase("model"); });
  for (const std::string& path : {cut.string(), missing_merge, no_model}) {
    auto t = Tokenizer::Load(path);
    ASSERT_FALSE(t.ok()) << path;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr("'" + path + "'"));
    EXPECT_THAT(t.status().message(), Not(HasSubstr("\n")));
  }
}

TEST_F(HfTokenizerTest, InvalidUtf8AndUnknownIdsAreErrors) {
  auto t = LoadStyle("gpt2");
  ASSERT_NE(t, nullptr);
  auto bad = t->Encode("ok \xFF no");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("byte 3"));
  // Streamed: the part of the file it is in, and the byte within that part.
  const fs::path text_path = *dir_ / "bad_utf8.txt";
  WriteFile(text_path, "First line.\nSecond line \xFF here\n");
  auto file = TokenizeTextFile(*t, text_path.string(), 4);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().message(), HasSubstr("the part from byte 12"));
  EXPECT_THAT(file.status().message(), HasSubstr("at byte 12"));
  auto id = t->Decode(std::vector<int32_t>{1, t->vocab_size()});
  ASSERT_FALSE(id.ok());
  EXPECT_THAT(id.status().message(), HasSubstr("position 1"));
}

TEST_F(HfTokenizerTest, SplitBehaviorsCutAsHfDoes) {
  // Without a regex, each pre-token is encoded whole: the ids of the expected pieces.
  const std::string whole_path = EditedFile("llama3", "whole", [](Json& j) {
    j["pre_tokenizer"] = j["pre_tokenizer"]["pretokenizers"][1];
    j["model"]["ignore_merges"] = false;
  });
  auto whole = Tokenizer::Load(whole_path);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  struct Case {
    const char* behavior;
    bool invert;
    std::vector<std::string> pieces;  // of "a b  c" split at " "
  };
  const std::vector<Case> cases = {
      {"Removed", false, {"a", "b", "c"}},
      {"Isolated", false, {"a", " ", "b", " ", " ", "c"}},
      {"MergedWithPrevious", false, {"a ", "b ", " ", "c"}},
      {"MergedWithNext", false, {"a", " b", " ", " c"}},
      {"Contiguous", false, {"a", " ", "b", "  ", "c"}},
      {"Removed", true, {" ", " ", " "}},
  };
  for (const Case& c : cases) {
    const std::string path = EditedFile("llama3", "split", [&](Json& j) {
      j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Split"},
                                                {"pattern", {{"String", " "}}},
                                                {"behavior", c.behavior},
                                                {"invert", c.invert}};
      j["model"]["ignore_merges"] = false;
    });
    auto t = Tokenizer::Load(path);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    std::vector<int32_t> want;
    for (const std::string& piece : c.pieces) {
      const auto ids = *(*whole)->Encode(piece);
      want.insert(want.end(), ids.begin(), ids.end());
    }
    EXPECT_EQ(*(*t)->Encode("a b  c"), want) << c.behavior << (c.invert ? " inverted" : "");
  }
}

TEST_F(HfTokenizerTest, AMetaspacePreTokenizerMatchesPrependAndReplace) {
  // Mistral-style: the Metaspace pre-tokenizer and decoder in place of the normalizers. The ids
  // are the same when the text does not start with a space (Metaspace then adds no second "▁").
  for (bool split : {false, true}) {
    const std::string path = EditedFile("sp", "metaspace", [&](Json& j) {
      j["normalizer"] = nullptr;
      j["pre_tokenizer"] = {{"type", "Metaspace"},
                            {"replacement", kSpace},
                            {"prepend_scheme", "always"},
                            {"split", split}};
      j["decoder"] = {{"type", "Sequence"},
                      {"decoders",
                       {{{"type", "ByteFallback"}},
                        {{"type", "Metaspace"},
                         {"replacement", kSpace},
                         {"prepend_scheme", "always"},
                         {"split", split}}}}};
    });
    auto meta = Tokenizer::Load(path);
    ASSERT_TRUE(meta.ok()) << meta.status().ToString();
    auto sp = LoadStyle("sp");
    for (const std::string& text : Texts()) {
      if (text.empty() || text[0] == ' ' || text.find("<|") != std::string::npos) continue;
      const auto ids = *(*meta)->Encode(text);
      EXPECT_EQ(ids, *sp->Encode(text)) << text;
      EXPECT_EQ(*(*meta)->Decode(ids), text);
    }
  }
}

TEST_F(HfTokenizerTest, LstripAndRstripTokensTakeTheSpacesBesideThem) {
  const std::string path = EditedFile("gpt2", "strip", [](Json& j) {
    for (Json& t : j["added_tokens"]) {
      if (t["content"] == "<|im_start|>") t["lstrip"] = true;
      if (t["content"] == "<|im_end|>") t["rstrip"] = true;
    }
  });
  auto t = Tokenizer::Load(path);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const int start = (*t)->TokenId("<|im_start|>"), end = (*t)->TokenId("<|im_end|>");
  std::vector<int32_t> want = *(*t)->Encode("a");
  want.push_back(start);
  want.push_back(end);
  const auto b = *(*t)->Encode("b");
  want.insert(want.end(), b.begin(), b.end());
  EXPECT_EQ(*(*t)->Encode("a  <|im_start|><|im_end|> \t b"), want);
}

}  // namespace
}  // namespace strata::data
