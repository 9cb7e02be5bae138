// Instruction data: each chat template rendered against its literal text and ids, the loss mask
// on exactly the responses and their end-of-turn tokens, template recognition from Jinja text
// and tokenizer_config.json, and the one-line errors naming the file and line. A tiny
// SentencePiece model is trained here with the templates' special tokens as user-defined
// symbols and byte fallback, without a dummy prefix, so decoding the ids gives the rendered text
// back exactly.
#include "data/instruction_data.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "data/token_dataset.h"
#include "data/tokenizer.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

std::string MakeText(int lines) {
  const std::string consonants = "bdfgklmnprst", vowels = "aeiou";
  std::mt19937 gen(4);
  std::string out;
  for (int l = 0; l < lines; ++l) {
    const int n = 3 + static_cast<int>(gen() % 6);
    for (int w = 0; w < n; ++w) {
      if (w > 0) out += ' ';
      for (int s = 0; s < 2; ++s) {
        out += consonants[gen() % consonants.size()];
        out += vowels[gen() % vowels.size()];
      }
    }
    out += ".\n";
  }
  return out;
}

class InstructionDataTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("strata_instruction_data_" + std::to_string(::getpid())));
    fs::create_directories(*dir_);
    const std::string text = (*dir_ / "text.txt").string();
    std::ofstream(text) << MakeText(400);
    const auto status = sentencepiece::SentencePieceTrainer::Train(fmt::format(
        "--input={} --model_prefix={} --vocab_size=330 --model_type=bpe --num_threads=1 "
        "--minloglevel=2 --byte_fallback=true --add_dummy_prefix=false "
        "--normalization_rule_name=identity --remove_extra_whitespaces=false "
        "--user_defined_symbols=<|begin_of_text|>,<|start_header_id|>,<|end_header_id|>,"
        "<|eot_id|>,<|im_start|>,<|im_end|>",
        text, (*dir_ / "tok").string()));
    ASSERT_TRUE(status.ok()) << status.ToString();
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  void SetUp() override {
    auto t = Tokenizer::Load((*dir_ / "tok.model").string());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tok_ = std::move(*t);
  }

  std::vector<int32_t> Enc(std::string_view text) const {
    auto ids = tok_->Encode(text);
    EXPECT_TRUE(ids.ok());
    return *ids;
  }
  int Id(std::string_view piece) const {
    const int id = tok_->TokenId(piece);
    EXPECT_GE(id, 0) << piece;
    return id;
  }
  std::string Decode(const std::vector<int32_t>& ids) const {
    auto text = tok_->Decode(ids);
    EXPECT_TRUE(text.ok());
    return *text;
  }
  // The ids whose flags have kTokenFlagInLoss.
  static std::vector<int32_t> InLoss(const RenderedExample& e) {
    std::vector<int32_t> out;
    for (size_t i = 0; i < e.tokens.size(); ++i) {
      if (e.flags[i] & kTokenFlagInLoss) out.push_back(e.tokens[i]);
    }
    return out;
  }
  static void ExpectOneExampleStart(const RenderedExample& e) {
    ASSERT_EQ(e.tokens.size(), e.flags.size());
    ASSERT_FALSE(e.flags.empty());
    EXPECT_TRUE(e.flags[0] & kTokenFlagExampleStart);
    for (size_t i = 1; i < e.flags.size(); ++i) {
      EXPECT_FALSE(e.flags[i] & kTokenFlagExampleStart) << i;
    }
  }
  RenderedExample Render(const ChatFormat& f, const std::vector<ChatMessage>& m) const {
    auto e = RenderExample(f, *tok_, m);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? *e : RenderedExample{};
  }
  static std::vector<int32_t> Cat(std::initializer_list<std::vector<int32_t>> parts) {
    std::vector<int32_t> out;
    for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
  }

  static fs::path* dir_;
  std::unique_ptr<Tokenizer> tok_;
};
fs::path* InstructionDataTest::dir_ = nullptr;

const std::vector<ChatMessage> kChat = {{ChatRole::kSystem, "Be brief."},
                                        {ChatRole::kUser, "Hi there"},
                                        {ChatRole::kAssistant, " Hello!\n"}};

TEST_F(InstructionDataTest, Llama3RendersHeadersTrimmedContentAndEotIds) {
  const RenderedExample e = Render({ChatTemplate::kLlama3, "", ""}, kChat);
  EXPECT_EQ(Decode(e.tokens),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>");
  const int sh = Id("<|start_header_id|>"), eh = Id("<|end_header_id|>"), eot = Id("<|eot_id|>");
  EXPECT_EQ(e.tokens, Cat({{Id("<|begin_of_text|>"), sh},
                           Enc("system"),
                           {eh},
                           Enc("\n\n"),
                           Enc("Be brief."),
                           {eot, sh},
                           Enc("user"),
                           {eh},
                           Enc("\n\n"),
                           Enc("Hi there"),
                           {eot, sh},
                           Enc("assistant"),
                           {eh},
                           Enc("\n\n"),
                           Enc("Hello!"),
                           {eot}}));
  EXPECT_EQ(InLoss(e), Cat({Enc("Hello!"), {eot}}));
  ExpectOneExampleStart(e);
}

TEST_F(InstructionDataTest, ChatmlRendersTurnsWithTheDefaultSystemLineWhenTheTemplateHasOne) {
  const std::vector<ChatMessage> m = {{ChatRole::kUser, "Hi there"},
                                      {ChatRole::kAssistant, "Hello!"},
                                      {ChatRole::kUser, "Again"},
                                      {ChatRole::kAssistant, "Sure."}};
  const RenderedExample e = Render({ChatTemplate::kChatml, "You are a helpful assistant.", ""}, m);
  EXPECT_EQ(Decode(e.tokens),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\nSure.<|im_end|>\n");
  const int end = Id("<|im_end|>");
  EXPECT_EQ(InLoss(e), Cat({Enc("Hello!"), {end}, Enc("Sure."), {end}}));
  EXPECT_EQ(e.tokens[0], Id("<|im_start|>"));
  ExpectOneExampleStart(e);
  // An example's own system message replaces the default; without a default there is none.
  EXPECT_EQ(Decode(Render({ChatTemplate::kChatml, "Default.", ""}, kChat).tokens),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\n Hello!\n<|im_end|>\n");
  EXPECT_EQ(Decode(Render({ChatTemplate::kChatml, "", ""}, {m[0], m[1]}).tokens),
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n");
}

TEST_F(InstructionDataTest, MistralRendersInstBlocksWithBosAndEosAroundEachAnswer) {
  const std::vector<ChatMessage> m = {{ChatRole::kSystem, "Be brief."},
                                      {ChatRole::kUser, "Q1"},
                                      {ChatRole::kAssistant, "A1"},
                                      {ChatRole::kUser, "Q2"},
                                      {ChatRole::kAssistant, "A2"}};
  const RenderedExample e = Render({ChatTemplate::kMistral, "", ""}, m);
  const int bos = Id("<s>"), eos = Id("</s>");
  EXPECT_EQ(e.tokens, Cat({{bos},
                           Enc("[INST] Be brief.\n\nQ1 [/INST]"),
                           Enc("A1"),
                           {eos},
                           Enc("[INST] Q2 [/INST]"),
                           Enc("A2"),
                           {eos}}));
  EXPECT_EQ(Decode(e.tokens), "[INST] Be brief.\n\nQ1 [/INST]A1[INST] Q2 [/INST]A2");
  EXPECT_EQ(InLoss(e), Cat({Enc("A1"), {eos}, Enc("A2"), {eos}}));
  ExpectOneExampleStart(e);
  // Roles must alternate from a user.
  auto bad = RenderExample({ChatTemplate::kMistral, "", ""}, *tok_,
                           std::vector<ChatMessage>{m[1], m[3], m[2]});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("message 1 is user"));
}

TEST_F(InstructionDataTest, NoneIsBosPromptResponseEos) {
  const RenderedExample e = Render({ChatTemplate::kNone, "", ""},
                                   {{ChatRole::kUser, "Q: red?"}, {ChatRole::kAssistant, "A"}});
  EXPECT_EQ(e.tokens, Cat({{tok_->bos_id()}, Enc("Q: red?"), Enc("A"), {tok_->eos_id()}}));
  EXPECT_EQ(InLoss(e), Cat({Enc("A"), {tok_->eos_id()}}));
  ExpectOneExampleStart(e);
}

// A tokenizer without special tokens: every byte is a token.
class BytesTokenizer final : public Tokenizer {
 public:
  BytesTokenizer() : Tokenizer("bytes.model", 0) {}
  int vocab_size() const override { return 256; }
  int bos_id() const override { return -1; }
  int eos_id() const override { return -1; }
  int TokenId(std::string_view) const override { return -1; }
  StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  StatusOr<std::string> Decode(std::span<const int32_t> ids) const override {
    return std::string(ids.begin(), ids.end());
  }
};

TEST_F(InstructionDataTest, ASpecialTokenTheTokenizerLacksIsAnErrorNamingIt) {
  BytesTokenizer bytes;
  auto e = RenderExample({ChatTemplate::kChatml, "", ""}, bytes, kChat);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(),
              HasSubstr("the chatml chat template needs the token \"<|im_start|>\", which "
                        "tokenizer 'bytes.model' does not have"));
  // none needs no special token: no BOS or EOS when the tokenizer has none.
  auto none = RenderExample({ChatTemplate::kNone, "", ""}, bytes, kChat);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*bytes.Decode(none->tokens), "Be brief.Hi there Hello!\n");
}

// --- template recognition ---

constexpr std::string_view kLlama3Jinja =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% "
    "endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";
constexpr std::string_view kQwen2Jinja =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif "
    "%}{{'<|im_start|>' "
    "+ message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if "
    "add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
constexpr std::string_view kQwen25Jinja =
    "{%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>system\\n' + "
    "messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        {{- "
    "'<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- for message in messages %}{{- "
    "'<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endfor "
    "%}";
constexpr std::string_view kMistralJinja =
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' "
    "+ message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ "
    "message['content'] + eos_token}}{% endif %}{% endfor %}";

TEST_F(InstructionDataTest, TemplatesAreRecognisedByTheirLiteralPieces) {
  auto llama = ChatFormatFromJinja(kLlama3Jinja, "cfg");
  ASSERT_TRUE(llama.ok()) << llama.status().ToString();
  EXPECT_EQ(llama->kind, ChatTemplate::kLlama3);
  auto qwen2 = ChatFormatFromJinja(kQwen2Jinja, "cfg");
  ASSERT_TRUE(qwen2.ok()) << qwen2.status().ToString();
  EXPECT_EQ(qwen2->kind, ChatTemplate::kChatml);
  EXPECT_EQ(qwen2->default_system, "You are a helpful assistant.");
  auto qwen25 = ChatFormatFromJinja(kQwen25Jinja, "cfg");
  ASSERT_TRUE(qwen25.ok()) << qwen25.status().ToString();
  EXPECT_EQ(qwen25->default_system,
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  // ChatML without a literal default system line: none.
  auto plain = ChatFormatFromJinja(
      "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + "
      "'<|im_end|>\\n'}}{% endfor %}",
      "cfg");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->default_system, "");
  auto mistral = ChatFormatFromJinja(kMistralJinja, "cfg");
  ASSERT_TRUE(mistral.ok()) << mistral.status().ToString();
  EXPECT_EQ(mistral->kind, ChatTemplate::kMistral);
}

TEST_F(InstructionDataTest, TemplatesStrataCannotRenderFaithfullyAreRefusedWithWhatToDo) {
  const std::string llama31 = std::string(kLlama3Jinja) + "Cutting Knowledge Date: December 2023";
  for (const std::string& jinja :
       {std::string("{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>"),
        llama31, std::string(kQwen2Jinja) + "<think>\\n",
        std::string("[INST] <<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n [/INST]"),
        std::string("{{ '[INST] ' + message['content'] + '[/INST]' }}")}) {
    auto f = ChatFormatFromJinja(jinja, "'m/tokenizer_config.json'");
    ASSERT_FALSE(f.ok()) << jinja;
    EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(f.status().message(),
                HasSubstr("'m/tokenizer_config.json''s chat_template is not one Strata renders "
                          "(llama3, chatml, mistral)"));
    EXPECT_THAT(f.status().message(), HasSubstr("give --chat-template NAME or none"));
  }
}

TEST_F(InstructionDataTest, AutoReadsTokenizerConfigBesideTheTokenizer) {
  const fs::path model_dir = *dir_ / "model";
  fs::create_directories(model_dir);
  const std::string tokenizer = (model_dir / "tokenizer.model").string();
  auto none = ResolveChatFormat("auto", tokenizer);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_EQ(none->kind, ChatTemplate::kNone);
  EXPECT_THAT(none->source, HasSubstr("no tokenizer_config.json"));
  std::ofstream(model_dir / "tokenizer_config.json")
      << "{\"bos_token\": \"<s>\", \"chat_template\": \""
      << "{{'<|im_start|>system\\\\nHi.<|im_end|>'}}"
      << "{{'<|im_start|>' + m + '<|im_end|>'}}\"}";
  for (const std::string& path : {tokenizer, model_dir.string()}) {
    auto f = ResolveChatFormat("auto", path);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_EQ(f->kind, ChatTemplate::kChatml);
    EXPECT_EQ(f->default_system, "Hi.");
  }
  // Named: as named, the file not read.
  auto named = ResolveChatFormat("chatml", tokenizer);
  ASSERT_TRUE(named.ok());
  EXPECT_EQ(named->default_system, "");
  std::ofstream(model_dir / "tokenizer_config.json") << "{\"bos_token\": \"<s>\"}";
  auto absent = ResolveChatFormat("auto", tokenizer);
  ASSERT_TRUE(absent.ok());
  EXPECT_EQ(absent->kind, ChatTemplate::kNone);
  auto unknown = ResolveChatFormat("gemma", tokenizer);
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(unknown.status().message(),
              HasSubstr("chat template 'gemma' is not one of auto, llama3, chatml, mistral, none"));
}

// --- JSON lines ---

TEST_F(InstructionDataTest, AFileOfPromptResponseAndMessagesLinesIsOneExampleAfterAnother) {
  const std::string path = (*dir_ / "a.jsonl").string();
  std::ofstream(path) << R"({"prompt": "Q1", "response": "A1"})"
                      << "\n\n"
                      << R"({"messages": [{"role": "user", "content": "Q2"},)"
                      << R"( {"role": "assistant", "content": "A2"}]})"
                      << "\n";
  auto r = TokenizeInstructionFile(*tok_, {ChatTemplate::kNone, "", ""}, path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->examples, 2);
  const int bos = tok_->bos_id(), eos = tok_->eos_id();
  EXPECT_EQ(r->tokens,
            Cat({{bos}, Enc("Q1"), Enc("A1"), {eos}, {bos}, Enc("Q2"), Enc("A2"), {eos}}));
  EXPECT_EQ(r->tokens_in_loss, static_cast<int64_t>(Enc("A1").size() + Enc("A2").size() + 2));
  ASSERT_EQ(r->flags.size(), r->tokens.size());
  const size_t second = 1 + Enc("Q1").size() + Enc("A1").size() + 1;
  for (size_t i = 0; i < r->flags.size(); ++i) {
    EXPECT_EQ((r->flags[i] & kTokenFlagExampleStart) != 0, i == 0 || i == second) << i;
  }
}

TEST_F(InstructionDataTest, BadLinesAreOneLineErrorsNamingFileAndLine) {
  const std::string path = (*dir_ / "bad.jsonl").string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"prompt\": \"Q\"", "line 2: not valid JSON"},
      {R"({"prompt": "Q"})", "line 2: the example has no \"response\""},
      {R"({"text": "Q"})", "line 2: neither \"prompt\" and \"response\" nor \"messages\""},
      {R"({"messages": [{"role": "tool", "content": "x"}]})", "unknown role \"tool\""},
      {R"({"prompt": "Q", "response": "  "})", "line 2: empty response"},
      {R"({"messages": [{"role": "user", "content": "x"}]})", "no assistant message"},
      {R"({"prompt": "Q", "response": 3})", "\"response\" is not a string"},
  };
  for (const auto& [line, expected] : cases) {
    std::ofstream(path) << R"({"prompt": "ok", "response": "ok"})"
                        << "\n"
                        << line << "\n";
    auto r = TokenizeInstructionFile(*tok_, {ChatTemplate::kNone, "", ""}, path);
    ASSERT_FALSE(r.ok()) << line;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("'" + path + "' line 2: ")) << line;
    EXPECT_THAT(r.status().message(), HasSubstr(expected)) << line;
    EXPECT_THAT(r.status().message(), Not(HasSubstr("\n")));
  }
}

}  // namespace
}  // namespace strata::data
