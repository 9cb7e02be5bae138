// Chat templates over Hugging Face tokenizer.json files, as Llama 3 and Qwen 2 users run them: a
// model directory with a byte-level tokenizer.json (hf_tokenizer_files.h: merges learned from
// tinyshakespeare, the model's added special tokens) and a tokenizer_config.json holding the
// model's own Jinja chat template, then Tokenizer::Load(dir), ResolveChatFormat("auto", dir) (the
// model's template through the Jinja engine) and TokenizeInstructionFile over JSON lines written
// here (prompt/response and messages lines, non-ASCII text, emoji, whitespace around contents).
// Each example's ids must equal a reference built here without Strata: the text the template
// renders (written here as pieces, checked against a verbatim rendering of the template) through
// the plain reference BPE as one string (what transformers' apply_chat_template(tokenize=True)
// computes), which here equals its pieces encoded one by one, special tokens by id. The loss flags
// (the template has no {% generation %} blocks: from prefix renders) must cover exactly each
// assistant content's tokens and its end-of-turn token; the example-start flag each example's
// first token.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "data/instruction_data.h"
#include "data/token_dataset.h"
#include "data/tokenizer.h"
#include "tests/data/hf_tokenizer_files.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;
using testing::AddSpecials;
using testing::ByteLevelModel;
using ::testing::HasSubstr;
using testing::Json;
using testing::kChatmlSpecials;
using testing::kLlama3Regex;
using testing::kLlama3Specials;
using testing::kQwen2DefaultSystem;
using testing::kQwen2Regex;
using testing::Model;
using testing::ReferenceByteLevel;
using testing::Utf8Chars;
using testing::WriteFile;

// ---- The reference rendering ----

// Python's str.isspace(): what Jinja's `| trim` (str.strip()) removes.
bool IsPythonSpace(std::string_view ch) {
  static const std::vector<std::string> kSpaces = {
      "\t",     "\n",     "\v",     "\f",     "\r",     "\x1C",   "\x1D",   "\x1E",
      "\x1F",   " ",      "\u0085", "\u00A0", "\u1680", "\u2000", "\u2001", "\u2002",
      "\u2003", "\u2004", "\u2005", "\u2006", "\u2007", "\u2008", "\u2009", "\u200A",
      "\u2028", "\u2029", "\u202F", "\u205F", "\u3000"};
  for (const std::string& s : kSpaces) {
    if (ch == s) return true;
  }
  return false;
}

std::string JinjaTrim(std::string_view text) {
  const std::vector<std::string> chars = Utf8Chars(text);
  size_t begin = 0, end = chars.size();
  while (begin < end && IsPythonSpace(chars[begin])) ++begin;
  while (end > begin && IsPythonSpace(chars[end - 1])) --end;
  std::string out;
  for (size_t i = begin; i < end; ++i) out += chars[i];
  return out;
}

struct Message {
  std::string role;
  std::string content;
};

// One piece of a rendered example: a special token (by its content) or text, and whether the
// loss counts it.
struct Piece {
  std::string text;
  bool special = false;
  bool in_loss = false;
};

// Meta-Llama-3-Instruct's template: bos_token, then per message
// '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + content | trim + '<|eot_id|>'.
std::vector<Piece> Llama3Pieces(const std::vector<Message>& messages) {
  std::vector<Piece> out = {{"<|begin_of_text|>", true, false}};
  for (const Message& m : messages) {
    const bool loss = m.role == "assistant";
    out.push_back({"<|start_header_id|>", true, false});
    out.push_back({m.role, false, false});
    out.push_back({"<|end_header_id|>", true, false});
    out.push_back({"\n\n", false, false});
    out.push_back({JinjaTrim(m.content), false, loss});
    out.push_back({"<|eot_id|>", true, loss});
  }
  return out;
}

// Qwen2-Instruct's template: the default system message when the first is not a system one,
// then per message '<|im_start|>' + role + '\n' + content + '<|im_end|>' + '\n'; no BOS.
std::vector<Piece> Qwen2Pieces(const std::vector<Message>& messages) {
  std::vector<Message> all = messages;
  if (all.front().role != "system") all.insert(all.begin(), {"system", kQwen2DefaultSystem});
  std::vector<Piece> out;
  for (const Message& m : all) {
    const bool loss = m.role == "assistant";
    out.push_back({"<|im_start|>", true, false});
    out.push_back({m.role + "\n", false, false});
    out.push_back({m.content, false, loss});
    out.push_back({"<|im_end|>", true, loss});
    out.push_back({"\n", false, false});
  }
  return out;
}

std::string Text(const std::vector<Piece>& pieces) {
  std::string out;
  for (const Piece& p : pieces) out += p.text;
  return out;
}

struct Encoded {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;
};

// The pieces through the reference: special tokens by id, text by the reference BPE; the loss
// flag on what the template marks, the example-start flag on the first token.
Encoded EncodePieces(const Model& m, const char* regex, bool ignore_merges,
                     const std::vector<Piece>& pieces) {
  Encoded out;
  for (const Piece& p : pieces) {
    const std::vector<int32_t> ids = p.special
                                         ? std::vector<int32_t>{m.specials.at(p.text)}
                                         : ReferenceByteLevel(m, regex, ignore_merges, p.text);
    out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
    out.flags.insert(out.flags.end(), ids.size(), p.in_loss ? kTokenFlagInLoss : 0);
  }
  if (!out.flags.empty()) out.flags[0] |= kTokenFlagExampleStart;
  return out;
}

// ---- The data ----

// The JSON lines: prompt/response (with and without a system), messages with several turns;
// Cyrillic, Japanese, Arabic, emoji (skin tones, a ZWJ family, a flag), Unicode whitespace
// around contents (which Llama 3's `| trim` removes), a vocabulary word only ignore_merges
// takes whole (" wherefore"), and one line written with \u escapes.
struct Example {
  Json line;
  bool ascii_escapes = false;
  std::vector<Message> messages;
};

std::vector<Example> Examples() {
  return {
      {{{"prompt", "Who wrote Romeo and Juliet?"},
        {"response", "  William Shakespeare; wherefore art thou Romeo?\n"}},
       false,
       {{"user", "Who wrote Romeo and Juliet?"},
        {"assistant", "  William Shakespeare; wherefore art thou Romeo?\n"}}},
      {{{"system", "Réponds en russe. 🇫🇷"},
        {"prompt", "How are you today?"},
        {"response", "Привет, мир! Всё хорошо 👍🏽"}},
       false,
       {{"system", "Réponds en russe. 🇫🇷"},
        {"user", "How are you today?"},
        {"assistant", "Привет, мир! Всё хорошо 👍🏽"}}},
      {{{"messages",
         {{{"role", "system"}, {"content", "You are terse. Answer in the user's language."}},
          {{"role", "user"}, {"content", "日本語で答えて。\u3000"}},
          {{"role", "assistant"}, {"content", "\u3000こんにちは！🎉🎉 Nice to meet you.\u00A0"}},
          {{"role", "user"}, {"content", "And the family emoji?"}},
          {{"role", "assistant"},
           {"content",
            "👨‍👩‍👧‍👦 It's 2024: they'd say we've 12345 apples.\n\n"}}}}},
       false,
       {{"system", "You are terse. Answer in the user's language."},
        {"user", "日本語で答えて。\u3000"},
        {"assistant", "\u3000こんにちは！🎉🎉 Nice to meet you.\u00A0"},
        {"user", "And the family emoji?"},
        {"assistant", "👨‍👩‍👧‍👦 It's 2024: they'd say we've 12345 apples.\n\n"}}},
      {{{"prompt", "Café ☕ — 3,50 €?"}, {"response", "Oui: مرحبا بالعالم ✓ 😀"}},
       true,
       {{"user", "Café ☕ — 3,50 €?"}, {"assistant", "Oui: مرحبا بالعالم ✓ 😀"}}},
  };
}

// The runs of consecutive in-loss tokens, in order (one per assistant message).
std::vector<std::vector<int32_t>> InLossRuns(const std::vector<int32_t>& tokens,
                                             const std::vector<uint8_t>& flags) {
  std::vector<std::vector<int32_t>> runs;
  bool in_run = false;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const bool loss = flags[i] & kTokenFlagInLoss;
    if (loss && !in_run) runs.emplace_back();
    if (loss) runs.back().push_back(tokens[i]);
    in_run = loss;
  }
  return runs;
}

class ChatTokenizerJsonTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("strata_chat_tokenizer_json_" + std::to_string(::getpid())));
    fs::remove_all(*dir_);
    fs::create_directories(*dir_);
    // One training run, two vocabularies: the same merges with each model's added tokens. The
    // merges are learned from GPT-2's pre-tokens, which never hold "\n\n": a last merge makes it
    // one token, as in Llama 3's and Qwen 2's vocabularies (the headers' "\n\n").
    Model base = ByteLevelModel({});
    base.merges.push_back({"\n", "\n"});
    base.rank[base.merges.back()] = static_cast<int>(base.merges.size()) - 1;
    base.Add("\n\n");
    llama3_ = new Model(base);
    AddSpecials(*llama3_, kLlama3Specials);
    qwen2_ = new Model(base);
    AddSpecials(*qwen2_, kChatmlSpecials);
    testing::WriteLlama3Dir(*dir_ / "llama3", *llama3_);
    testing::WriteQwen2Dir(*dir_ / "qwen2", *qwen2_);
    std::string jsonl;
    for (const Example& e : Examples()) {
      jsonl += e.line.dump(-1, ' ', e.ascii_escapes) + "\n\n";  // blank lines are skipped
    }
    WriteFile(*dir_ / "sft.jsonl", jsonl);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
    delete llama3_;
    delete qwen2_;
  }

  struct Run {
    std::unique_ptr<Tokenizer> tokenizer;
    ChatFormat format;
    InstructionTokens data;
  };
  // Load(dir), ResolveChatFormat("auto", dir), TokenizeInstructionFile: as `strata tokenize`.
  static Run TokenizeWith(const std::string& name) {
    Run r;
    const std::string dir = (*dir_ / name).string();
    auto t = Tokenizer::Load(dir);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    if (!t.ok()) return r;
    r.tokenizer = std::move(*t);
    auto f = ResolveChatFormat("auto", dir);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    if (!f.ok()) return r;
    r.format = *f;
    auto d = TokenizeInstructionFile(*r.tokenizer, r.format, (*dir_ / "sft.jsonl").string());
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    if (d.ok()) r.data = std::move(*d);
    return r;
  }

  // Strata's ids and flags equal the reference's, example by example, and the reference's
  // pieces give the ids of the whole rendered string.
  template <typename PiecesFn>
  static void ExpectReference(const Run& r, const Model& m, const char* regex, bool ignore_merges,
                              PiecesFn pieces_of) {
    const std::vector<Example> examples = Examples();
    ASSERT_EQ(r.data.examples, static_cast<int64_t>(examples.size()));
    ASSERT_EQ(r.data.tokens.size(), r.data.flags.size());
    size_t at = 0;
    int64_t in_loss = 0;
    for (size_t e = 0; e < examples.size(); ++e) {
      SCOPED_TRACE(fmt::format("example {}", e));
      const std::vector<Piece> pieces = pieces_of(examples[e].messages);
      const Encoded want = EncodePieces(m, regex, ignore_merges, pieces);
      EXPECT_EQ(want.tokens, ReferenceByteLevel(m, regex, ignore_merges, Text(pieces)))
          << "rendered piece by piece differs from the whole string: '" << Text(pieces) << "'";
      ASSERT_LE(at + want.tokens.size(), r.data.tokens.size());
      const std::vector<int32_t> got(
          r.data.tokens.begin() + static_cast<std::ptrdiff_t>(at),
          r.data.tokens.begin() + static_cast<std::ptrdiff_t>(at + want.tokens.size()));
      const std::vector<uint8_t> got_flags(
          r.data.flags.begin() + static_cast<std::ptrdiff_t>(at),
          r.data.flags.begin() + static_cast<std::ptrdiff_t>(at + want.flags.size()));
      EXPECT_EQ(got, want.tokens) << "'" << Text(pieces) << "'";
      EXPECT_EQ(got_flags, want.flags);
      for (uint8_t f : want.flags) in_loss += (f & kTokenFlagInLoss) != 0;
      at += want.tokens.size();
    }
    EXPECT_EQ(at, r.data.tokens.size());
    EXPECT_EQ(r.data.tokens_in_loss, in_loss);
  }

  // Each example's first token is `first` and the only one with the start flag; the in-loss runs
  // decode to the assistant contents (as `content_of` renders them) each followed by `end`.
  template <typename ContentFn>
  static void ExpectFlags(const Run& r, int32_t first, const std::string& end,
                          ContentFn content_of) {
    std::vector<std::string> want_loss;
    for (const Example& e : Examples()) {
      for (const Message& m : e.messages) {
        if (m.role == "assistant") want_loss.push_back(content_of(m.content) + end);
      }
    }
    int64_t starts = 0;
    for (size_t i = 0; i < r.data.flags.size(); ++i) {
      ASSERT_EQ(r.data.flags[i] & ~kTokenFlagsKnown, 0) << i;
      if (r.data.flags[i] & kTokenFlagExampleStart) {
        ++starts;
        EXPECT_EQ(r.data.tokens[i], first) << i;
        EXPECT_FALSE(r.data.flags[i] & kTokenFlagInLoss) << i;
      }
    }
    EXPECT_EQ(starts, r.data.examples);
    EXPECT_TRUE(r.data.flags[0] & kTokenFlagExampleStart);
    const std::vector<std::vector<int32_t>> runs = InLossRuns(r.data.tokens, r.data.flags);
    ASSERT_EQ(runs.size(), want_loss.size());
    for (size_t k = 0; k < runs.size(); ++k) {
      auto text = r.tokenizer->Decode(runs[k]);
      ASSERT_TRUE(text.ok()) << text.status().ToString();
      EXPECT_EQ(*text, want_loss[k]) << k;
    }
  }

  static fs::path* dir_;
  static Model* llama3_;
  static Model* qwen2_;
};

fs::path* ChatTokenizerJsonTest::dir_ = nullptr;
Model* ChatTokenizerJsonTest::llama3_ = nullptr;
Model* ChatTokenizerJsonTest::qwen2_ = nullptr;

TEST_F(ChatTokenizerJsonTest, TheReferenceRendersAsTheTemplatesDo) {
  // The first example as jinja2 renders each model's template (bos_token "<|begin_of_text|>").
  const std::vector<Message> m = Examples()[0].messages;
  EXPECT_EQ(Text(Llama3Pieces(m)),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWho wrote Romeo and "
            "Juliet?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nWilliam "
            "Shakespeare; wherefore art thou Romeo?<|eot_id|>");
  EXPECT_EQ(Text(Qwen2Pieces(m)),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWho "
            "wrote Romeo and Juliet?<|im_end|>\n<|im_start|>assistant\n  William Shakespeare; "
            "wherefore art thou Romeo?\n<|im_end|>\n");
  EXPECT_EQ(JinjaTrim("\u3000\u00A0 x \t\u2003"), "x");
}

TEST_F(ChatTokenizerJsonTest, Llama3DirectoryRendersItsOwnTemplate) {
  const std::string dir = (*dir_ / "llama3").string();
  auto f = ResolveChatFormat("auto", dir);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->kind, ChatTemplate::kJinja);
  EXPECT_EQ(f->variables.value("bos_token", ""), "<|begin_of_text|>");
  EXPECT_THAT(f->source, HasSubstr("chat_template of '"));
  EXPECT_THAT(f->source, HasSubstr("tokenizer_config.json'"));
  auto t = Tokenizer::Load(dir);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->path(), (*dir_ / "llama3" / "tokenizer.json").string());
  EXPECT_EQ((*t)->bos_id(), llama3_->specials.at("<|begin_of_text|>"));
  EXPECT_EQ((*t)->eos_id(), llama3_->specials.at("<|eot_id|>"));
  for (const std::string& s : kLlama3Specials) EXPECT_EQ((*t)->TokenId(s), llama3_->specials.at(s));
}

TEST_F(ChatTokenizerJsonTest, Llama3IdsAreTheTemplateTextsThroughTheReferenceBpe) {
  const Run r = TokenizeWith("llama3");
  ASSERT_NE(r.tokenizer, nullptr);
  ASSERT_EQ(r.format.kind, ChatTemplate::kJinja);
  ExpectReference(r, *llama3_, kLlama3Regex, /*ignore_merges=*/true, Llama3Pieces);
}

TEST_F(ChatTokenizerJsonTest, Llama3LossIsEachTrimmedAssistantContentAndItsEotId) {
  const Run r = TokenizeWith("llama3");
  ASSERT_NE(r.tokenizer, nullptr);
  ExpectFlags(r, llama3_->specials.at("<|begin_of_text|>"), "<|eot_id|>", JinjaTrim);
}

TEST_F(ChatTokenizerJsonTest, Qwen2DirectoryRendersItsOwnTemplate) {
  const std::string dir = (*dir_ / "qwen2").string();
  auto f = ResolveChatFormat("auto", dir);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->kind, ChatTemplate::kJinja);
  auto t = Tokenizer::Load(dir);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->bos_id(), -1);  // bos_token null, and a ByteLevel post-processor
  EXPECT_EQ((*t)->eos_id(), qwen2_->specials.at("<|im_end|>"));
}

TEST_F(ChatTokenizerJsonTest, Qwen2IdsAreTheTemplateTextsThroughTheReferenceBpe) {
  const Run r = TokenizeWith("qwen2");
  ASSERT_NE(r.tokenizer, nullptr);
  ASSERT_EQ(r.format.kind, ChatTemplate::kJinja);
  ExpectReference(r, *qwen2_, kQwen2Regex, /*ignore_merges=*/false, Qwen2Pieces);
}

TEST_F(ChatTokenizerJsonTest, Qwen2LossIsEachAssistantContentAsWrittenAndItsImEnd) {
  const Run r = TokenizeWith("qwen2");
  ASSERT_NE(r.tokenizer, nullptr);
  ExpectFlags(r, qwen2_->specials.at("<|im_start|>"), "<|im_end|>",
              [](const std::string& s) { return s; });
}

// Jinja's `| trim` is Python's str.strip(): Unicode whitespace too (U+3000, common around
// Japanese text; U+00A0; U+2003), not only ASCII.
TEST_F(ChatTokenizerJsonTest, Llama3TrimsUnicodeWhitespaceAsJinjaDoes) {
  auto t = Tokenizer::Load((*dir_ / "llama3").string());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto f = ResolveChatFormat("llama3", (*dir_ / "llama3").string());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto messages = ParseInstructionLine(
      R"({"messages": [{"role": "user", "content": "\u2003 質問\u3000"},
          {"role": "assistant", "content": "\u3000\u00A0答え。\u3000\n"}]})");
  ASSERT_TRUE(messages.ok()) << messages.status().ToString();
  auto e = RenderExample(*f, **t, *messages);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  auto text = (*t)->Decode(e->tokens);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n質問<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n答え。<|eot_id|>");
  // An assistant content of Unicode whitespace only is empty after the trim: refused.
  auto empty = ParseInstructionLine(R"({"prompt": "a", "response": "\u3000\u00a0"})");
  ASSERT_FALSE(empty.ok());
  EXPECT_THAT(empty.status().message(), HasSubstr("empty response"));
}

}  // namespace
}  // namespace strata::data
