// Hugging Face tokenizer.json tokenizers: the test builds its own files — BPE merges learned
// from tinyshakespeare by a tiny trainer, written as a GPT-2-style file (ByteLevel
// pre-tokenizer), a Llama-3-style file (Split with Llama 3's regex, then ByteLevel;
// ignore_merges), both from hf_tokenizer_files.h, and a SentencePiece-style file (Prepend and
// Replace normalizers, <0xXX> byte fallback), each with added special tokens — and compares
// Strata's ids with a reference written independently: the plainest BPE (merge the
// lowest-ranked adjacent pair of the whole pre-token until none is left). Also:
// decode(encode(text)) == text, streaming a text file in tiny blocks gives Encode(whole)'s ids,
// and unsupported components and malformed files are refused by name.
#include "data/hf_tokenizer.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "data/hf_text.h"
#include "data/tokenizer.h"
#include "tests/data/hf_tokenizer_files.h"
#include "tests/data/token_offsets_check.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;
using testing::AddedTokens;
using testing::ByteChars;
using testing::ByteLevelJson;
using testing::ByteLevelModel;
using ::testing::HasSubstr;
using testing::Json;
using testing::kGpt2Regex;
using testing::kLlama3Regex;
using testing::LearnMerges;
using testing::Model;
using ::testing::Not;
using testing::PlainBpe;
using testing::ReadFile;
using testing::ReferenceByteLevel;
using testing::Shakespeare;
using testing::SpanShape;
using testing::SplitSpecials;
using testing::TrainingText;
using testing::Utf8Chars;
using testing::WriteFile;

const std::string kSpace = "\xE2\x96\x81";  // ▁

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
    if (t->adds_bos()) want.push_back(t->bos_id());
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

// add_bos_token / add_eos_token of tokenizer_config.json, as Hugging Face's tokenizer(text)
// honours them: a document without its BOS, or ending with its EOS; absent, the BOS of a
// tokenizer_class whose add_bos_token defaults to true (LlamaTokenizerFast) or of the
// post-processor's template, and no EOS.
TEST_F(HfTokenizerTest, AddBosAndAddEosTokenDecideADocumentsSpecialTokens) {
  const fs::path text_path = *dir_ / "doc.txt";
  WriteFile(text_path, "Hello there.\n");
  const fs::path dir = *dir_ / "sp_add";
  fs::create_directories(dir);
  fs::copy_file(JsonPath("sp"), dir / "tokenizer.json", fs::copy_options::overwrite_existing);
  auto tokenize = [&](const std::string& config) {
    WriteFile(dir / "tokenizer_config.json", config);
    auto t = Tokenizer::Load((dir / "tokenizer.json").string());
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    auto ids = TokenizeTextFile(**t, text_path.string());
    EXPECT_TRUE(ids.ok()) << ids.status().ToString();
    auto text = (*t)->Encode("Hello there.\n");
    return std::make_pair(*ids, *text);
  };
  const int bos = sp_model_->specials.at("<s>"), eos = sp_model_->specials.at("</s>");
  // Llama 2's and Mistral's class: a BOS though this tokenizer.json has no post-processor.
  auto [ids, text] = tokenize(
      R"({"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "LlamaTokenizerFast"})");
  std::vector<int32_t> want = {bos};
  want.insert(want.end(), text.begin(), text.end());
  EXPECT_EQ(ids, want);
  // Another class (or none) and no post-processor template: no BOS, as tokenizer(text) (before,
  // a named bos_token alone added one).
  for (const char* config : {R"({"bos_token": "<s>", "eos_token": "</s>"})",
                             R"({"bos_token": "<s>", "tokenizer_class": "GPT2TokenizerFast"})"}) {
    std::tie(ids, text) = tokenize(config);
    EXPECT_EQ(ids, text) << config;
  }
  std::tie(ids, text) = tokenize(
      R"({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": false, "add_eos_token": true})");
  want = text;
  want.push_back(eos);
  EXPECT_EQ(ids, want);
  // The text cache is named by what decides these too: another config, another cache.
  auto cache_of = [&](const std::string& config) {
    WriteFile(dir / "tokenizer_config.json", config);
    auto t = Tokenizer::Load((dir / "tokenizer.json").string());
    EXPECT_TRUE(t.ok());
    return TokenCachePath(text_path.string(), **t);
  };
  const std::string with_bos =
      cache_of(R"({"bos_token": "<s>", "tokenizer_class": "LlamaTokenizerFast"})");
  EXPECT_EQ(with_bos, cache_of(R"({"bos_token": "<s>", "add_bos_token": true})"));
  EXPECT_NE(with_bos, cache_of(R"({"bos_token": "<s>", "add_bos_token": false})"));
  EXPECT_NE(with_bos, cache_of(R"({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true,
                                   "add_eos_token": true})"));
  WriteFile(dir / "tokenizer_config.json", R"({"bos_token": "<s>", "add_bos_token": "yes"})");
  auto bad = Tokenizer::Load((dir / "tokenizer.json").string());
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("/add_bos_token: must be true or false"));
  EXPECT_THAT(bad.status().message(), HasSubstr("tokenizer_config.json"));
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

// ---- EncodeWithOffsets ----

// "\n\n" as one token, as Llama 3 and Qwen 2 have it ("ĊĊ"): the llama3 file with the merge
// first.
std::string WithNewlinePairMerge(Json& j) {
  const std::string nl = "\xC4\x8A";  // Ċ
  j["model"]["vocab"][nl + nl] = j["model"]["vocab"].size() + j["added_tokens"].size();
  j["model"]["merges"].insert(j["model"]["merges"].begin(), Json::array({nl, nl}));
  return nl + nl;
}

// Texts for offsets: Texts(), tinyshakespeare slices, and the cases the contract names.
std::vector<std::string> OffsetTexts() {
  std::vector<std::string> texts = Texts();
  for (const std::string& t :
       {std::string("\n\nWhat is 2+2?"), std::string("A\n\nB"), std::string("  two leading"),
        std::string("trailing  \n\n"), std::string(" "), std::string("\n"),
        std::string("a\n\n\n  \n\tb  c"), std::string("e\xCC\x81 = \xC3\xA9"),  // e + U+0301
        std::string("\xCC\x81 starts with a combining mark"),
        std::string("A\xCC\x8A k\xCC\xA3\xCC\x81 \xE1\x84\x80\xE1\x85\xA1!"),  // Å, ḳ́, 가
        std::string("<|im_start|>e\xCC\x81<|im_end|>x"), std::string("\xE2\x82\xAC 5 \xE2\x82\xAC"),
        std::string("a <|im_start|>  b  <|im_end|>  c <|endoftext|>"),
        std::string("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n\nWhat is "
                    "2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")}) {
    texts.push_back(t);
  }
  const std::string shakespeare = Shakespeare(40000);
  for (size_t at : {size_t{0}, size_t{777}, size_t{20000}, size_t{33333}}) {
    texts.push_back(shakespeare.substr(at, 2500));
  }
  return texts;
}

class HfOffsetsTest : public HfTokenizerTest {
 protected:
  // The configurations: name -> file.
  static std::vector<std::pair<std::string, std::string>> Files() {
    std::vector<std::pair<std::string, std::string>> files = {
        {"gpt2", JsonPath("gpt2")}, {"llama3", JsonPath("llama3")}, {"sp", JsonPath("sp")}};
    files.push_back(
        {"llama3nn", EditedFile("llama3", "llama3nn", [](Json& j) { WithNewlinePairMerge(j); })});
    const std::string qwen2 = (*dir_ / "qwen2.json").string();
    WriteFile(qwen2, ByteLevelJson(*byte_model_, "qwen2"));
    files.push_back({"qwen2", qwen2});
    auto strip = [](Json& j) {
      for (Json& t : j["added_tokens"]) {
        if (t["content"] == "<|im_start|>") t["lstrip"] = true;
        if (t["content"] == "<|im_end|>") t["rstrip"] = true;
      }
    };
    files.push_back({"gpt2-strip", EditedFile("gpt2", "gpt2-strip", strip)});
    files.push_back({"sp-strip", EditedFile("sp", "sp-strip", strip)});
    for (const char* scheme : {"always", "first"}) {
      for (bool split : {false, true}) {
        const std::string name = fmt::format("metaspace-{}-{}", scheme, split ? "split" : "whole");
        files.push_back({name, EditedFile("sp", name, [&](Json& j) {
                           j["normalizer"] = nullptr;
                           j["pre_tokenizer"] = {{"type", "Metaspace"},
                                                 {"replacement", kSpace},
                                                 {"prepend_scheme", scheme},
                                                 {"split", split}};
                         })});
      }
    }
    files.push_back({"sp-nfc", EditedFile("sp", "sp-nfc", [](Json& j) {
                       j["normalizer"]["normalizers"].push_back({{"type", "NFC"}});
                     })});
    // Unknown characters as one (fused) <unk> instead of byte fallback.
    files.push_back({"sp-unk", EditedFile("sp", "sp-unk",
                                          [](Json& j) { j["model"]["byte_fallback"] = false; })});
    // A ByteLevel pre-tokenizer that inserts a space before the text (GPT-2 as RoBERTa uses it).
    files.push_back({"gpt2-prefix", EditedFile("gpt2", "gpt2-prefix", [](Json& j) {
                       j["pre_tokenizer"]["add_prefix_space"] = true;
                     })});
    return files;
  }
  static std::unique_ptr<Tokenizer> Load(const std::string& path) {
    auto t = Tokenizer::Load(path);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(*t) : nullptr;
  }
  static std::unique_ptr<Tokenizer> Config(const std::string& name) {
    for (const auto& [n, path] : Files()) {
      if (n == name) return Load(path);
    }
    ADD_FAILURE() << "no configuration " << name;
    return nullptr;
  }
  // The bytes of each byte-level token: the model's vocabulary (in bytes) and added tokens.
  static std::map<int32_t, std::string> ByteLevelTokenBytes() {
    std::map<int32_t, std::string> bytes;
    for (const auto& [token, id] : byte_model_->vocab) bytes[id] = token;
    for (const auto& [content, id] : byte_model_->specials) bytes[id] = content;
    return bytes;
  }
};

TEST_F(HfOffsetsTest, EveryConfigurationGivesEncodesIdsAndSpansThatMeetTheContract) {
  const std::vector<std::string> texts = OffsetTexts();
  const std::map<int32_t, std::string> token_bytes = ByteLevelTokenBytes();
  for (const auto& [name, path] : Files()) {
    auto t = Load(path);
    ASSERT_NE(t, nullptr) << name;
    // Byte-level without an inserted prefix: the spans tile the text.
    const bool byte_level = (name.starts_with("gpt2") && name != "gpt2-prefix") ||
                            name.starts_with("llama3") || name == "qwen2";
    const bool nfc = name == "qwen2" || name == "sp-nfc";
    for (const std::string& text : texts) {
      const bool nfc_changes = nfc && !hf::IsNfc(text) && *hf::Nfc(text) != text;
      const SpanShape shape = nfc_changes  ? SpanShape::kOverlapping
                              : byte_level ? SpanShape::kTiles
                                           : SpanShape::kTilesWithPrefixes;
      const EncodedText enc =
          testing::ExpectOffsetContract(*t, text, shape, name + " on '" + text + "'");
      if (!byte_level || nfc_changes || name == "llama3nn") continue;
      // Byte-level: each token's span is its own bytes (an added token's, with what it swallowed).
      for (size_t i = 0; i < enc.ids.size(); ++i) {
        const std::string got(
            text.substr(enc.spans[i].begin, enc.spans[i].end - enc.spans[i].begin));
        const std::string& own = token_bytes.at(enc.ids[i]);
        if (name == "gpt2-strip" && own.starts_with("<|")) {
          EXPECT_THAT(got, HasSubstr(own)) << name << " token " << i;
        } else {
          EXPECT_EQ(got, own) << name << " token " << i << " of '" << text << "'";
        }
      }
    }
  }
}

const std::string kNl = "\xC4\x8A", kSp = "\xC4\xA0";  // Ċ, Ġ: "\n", " " byte-level

TEST_F(HfOffsetsTest, TwoNewlinesMergedIntoOneTokenHaveOneSpanEvenAcrossAPartBoundary) {
  auto t = Config("llama3nn");
  ASSERT_NE(t, nullptr);
  testing::ExpectSpans(*t, "\n\nWhat is 2+2?",
                       {kNl + kNl, "What", kSp + "is", kSp, "2", "+", "2", "?"},
                       {{0, 2}, {2, 6}, {6, 9}, {9, 10}, {10, 11}, {11, 12}, {12, 13}, {13, 14}});
  // "A\n" ends one part of a rendered chat and "\nB" starts the next: the merged token spans
  // both, so a mask over either part takes it.
  testing::ExpectSpans(*t, std::string("A\n") + "\nB", {"A", kNl + kNl, "B"},
                       {{0, 1}, {1, 3}, {3, 4}});
}

TEST_F(HfOffsetsTest, ByteLevelTokensSpanTheirOwnBytes) {
  auto t = Config("gpt2");
  ASSERT_NE(t, nullptr);
  testing::ExpectSpans(*t, "Hello world", {"H", "ell", "o", kSp + "wor", "ld"},
                       {{0, 1}, {1, 4}, {4, 5}, {5, 9}, {9, 11}});
  // "€" is three bytes, each its own token here: each covers its byte.
  testing::ExpectSpans(*t, "\xE2\x82\xAC",
                       {ByteChars("\xE2"), ByteChars("\x82"), ByteChars("\xAC")},
                       {{0, 1}, {1, 2}, {2, 3}});
  testing::ExpectSpans(*t, "<|im_start|>hi", {"<|im_start|>", "hi"}, {{0, 12}, {12, 14}});
}

TEST_F(HfOffsetsTest, LstripAndRstripTokensSpanTheWhitespaceTheySwallow) {
  for (const char* name : {"gpt2-strip", "sp-strip"}) {
    auto t = Config(name);
    ASSERT_NE(t, nullptr);
    const bool sp = std::string(name) == "sp-strip";
    testing::ExpectSpans(
        *t, "a  <|im_start|><|im_end|> \t b",
        {sp ? kSpace + "a" : "a", "<|im_start|>", "<|im_end|>", sp ? kSpace + "b" : "b"},
        {{0, 1}, {1, 15}, {15, 28}, {28, 29}});
  }
}

TEST_F(HfOffsetsTest, SentencePieceStylePrefixesAreEmptyAndReplacedSpacesAreTheirByte) {
  for (const char* name : {"sp", "metaspace-always-split"}) {
    auto t = Config(name);
    ASSERT_NE(t, nullptr);
    testing::ExpectSpans(*t, "Hello world", {kSpace, "H", "ell", "o", kSpace + "wor", "ld"},
                         {{0, 0}, {0, 1}, {1, 4}, {4, 5}, {5, 9}, {9, 11}});
    testing::ExpectSpans(*t, "a b", {kSpace + "a", kSpace + "b"}, {{0, 1}, {1, 3}});
    testing::ExpectSpans(*t, "<|im_start|>hi", {"<|im_start|>", kSpace + "h", "i"},
                         {{0, 12}, {12, 13}, {13, 14}});
    // The three byte-fallback tokens of "€" each cover the whole character.
    testing::ExpectSpans(*t, "\xE2\x82\xAC", {kSpace, "<0xE2>", "<0x82>", "<0xAC>"},
                         {{0, 0}, {0, 3}, {0, 3}, {0, 3}});
  }
  // A Prepend normalizer adds "▁" before a leading space too; Metaspace does not.
  testing::ExpectSpans(*Config("sp"), " Hi  there",
                       {kSpace, kSpace, "H", "i", kSpace, kSpace + "the", "re"},
                       {{0, 0}, {0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 8}, {8, 10}});
  testing::ExpectSpans(*Config("metaspace-always-split"), " Hi  there",
                       {kSpace, "H", "i", kSpace, kSpace + "the", "re"},
                       {{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 8}, {8, 10}});
  // A ByteLevel prefix space is empty too; a fused unknown token covers its characters.
  testing::ExpectSpans(*Config("gpt2-prefix"), "world", {kSp + "wor", "ld"}, {{0, 3}, {3, 5}});
  testing::ExpectSpans(*Config("sp-unk"), "\xE2\x82\xAC\xE2\x82\xAC!", {kSpace, "<unk>", "!"},
                       {{0, 0}, {0, 6}, {6, 7}});
  // prepend_scheme "first": no "▁" after an added token.
  testing::ExpectSpans(*Config("metaspace-first-split"), "<|im_start|>hi", {"<|im_start|>", "hi"},
                       {{0, 12}, {12, 14}});
}

TEST_F(HfOffsetsTest, TokensOfARunNfcChangedSpanTheWholeRun) {
  // "e" + U+0301 (3 bytes) becomes "é" (2 bytes, 2 tokens): both tokens cover the 3 bytes.
  const std::string text = std::string("ae\xCC\x81") + "b";
  testing::ExpectSpans(*Config("qwen2"), text, {"a", ByteChars("\xC3"), ByteChars("\xA9"), "b"},
                       {{0, 1}, {1, 4}, {1, 4}, {4, 5}});
  testing::ExpectSpans(*Config("sp-nfc"), text, {kSpace + "a", "<0xC3>", "<0xA9>", "b"},
                       {{0, 1}, {1, 4}, {1, 4}, {4, 5}});
}

TEST_F(HfOffsetsTest, InvalidUtf8IsAnErrorAsInEncode) {
  auto t = Config("gpt2");
  ASSERT_NE(t, nullptr);
  auto bad = t->EncodeWithOffsets("ok \xFF no");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("byte 3"));
}

}  // namespace
}  // namespace strata::data
