// Instruction data: each built-in chat template rendered against its literal text, the whole
// string encoded once, the loss mask from the assistant spans ({% generation %} blocks, or prefix
// renders for a model's template without them, Qwen3's dropped reasoning included) with the rule
// for a token straddling a span's edge, the model's own template from tokenizer_config.json,
// chat_template.jinja or a file, template variables and kwargs, and the one-line errors naming
// the file and line. A tiny SentencePiece model is trained here with the templates' special
// tokens as user-defined symbols and byte fallback, without a dummy prefix, so decoding the ids
// gives the rendered text back exactly.
#include "data/instruction_data.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "data/token_dataset.h"
#include "data/tokenizer.h"
#include "tests/data/chat_test_tokenizer.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

class InstructionDataTest : public testing::ChatTokenizerTest {
 protected:
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
  static ChatFormat Format(std::string_view name, const std::string& tokenizer = "/nonexistent/t",
                           std::string_view kwargs = "") {
    auto f = ResolveChatFormat(name, tokenizer, kwargs);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    return f.ok() ? *f : ChatFormat{};
  }
  static InstructionExample Line(std::string_view json_line) {
    auto e = ParseInstructionLine(json_line);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? *e : InstructionExample{};
  }
  RenderedExample Render(const ChatFormat& f, const InstructionExample& e) const {
    auto r = RenderExample(f, *tok_, e);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : RenderedExample{};
  }
  static std::vector<int32_t> Cat(std::initializer_list<std::vector<int32_t>> parts) {
    std::vector<int32_t> out;
    for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
  }
  // The in-loss runs, decoded: one per assistant turn.
  std::vector<std::string> LossRuns(const RenderedExample& e) const {
    std::vector<std::string> runs;
    std::vector<int32_t> run;
    for (size_t i = 0; i <= e.tokens.size(); ++i) {
      if (i < e.tokens.size() && (e.flags[i] & kTokenFlagInLoss)) {
        run.push_back(e.tokens[i]);
      } else if (!run.empty()) {
        runs.push_back(Decode(run));
        run.clear();
      }
    }
    return runs;
  }
};

constexpr std::string_view kChat = R"({"messages": [{"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": " Hello!\n"}]})";

TEST_F(InstructionDataTest, Llama3RendersHeadersTrimmedContentAndEncodesTheStringOnce) {
  const RenderedExample e = Render(Format("llama3"), Line(kChat));
  const std::string text =
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>";
  EXPECT_EQ(Decode(e.tokens), text);
  EXPECT_EQ(e.tokens, Enc(text));
  EXPECT_EQ(LossRuns(e), std::vector<std::string>{"Hello!<|eot_id|>"});
  ExpectOneExampleStart(e);
}

TEST_F(InstructionDataTest, ChatmlTakesEachAssistantContentAndItsImEndNotTheNewlineAfter) {
  const RenderedExample e =
      Render(Format("chatml"), Line(R"({"messages": [{"role": "user", "content": "Hi there"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"},
          {"role": "assistant", "content": "Sure."}]})"));
  const std::string text =
      "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
      "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\nSure.<|im_end|>\n";
  EXPECT_EQ(Decode(e.tokens), text);
  EXPECT_EQ(e.tokens, Enc(text));
  EXPECT_EQ(LossRuns(e), (std::vector<std::string>{"Hello!<|im_end|>", "Sure.<|im_end|>"}));
  ExpectOneExampleStart(e);
}

TEST_F(InstructionDataTest, MistralCutsItsControlSymbolsAndRefusesRolesOutOfOrder) {
  const RenderedExample e =
      Render(Format("mistral"), Line(R"({"messages": [{"role": "system", "content": "Be brief."},
          {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
          {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]})"));
  // <s> and </s> are the model's control symbols: SentencePiece would spell them out, so they
  // are cut from the rendering and given their ids; the text between is encoded whole.
  const int bos = Id("<s>"), eos = Id("</s>");
  EXPECT_EQ(e.tokens, Cat({{bos},
                           Enc("[INST] Be brief.\n\nQ1 [/INST]A1"),
                           {eos},
                           Enc("[INST] Q2 [/INST]A2"),
                           {eos}}));
  EXPECT_EQ(LossRuns(e), (std::vector<std::string>{"A1", "A2"}));  // </s> decodes to ""
  EXPECT_EQ(e.flags.back() & kTokenFlagInLoss, kTokenFlagInLoss);
  ExpectOneExampleStart(e);
  auto bad = RenderExample(Format("mistral"), *tok_,
                           Line(R"({"messages": [{"role": "assistant", "content": "A"}]})"));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("roles alternating user, assistant"));
  EXPECT_THAT(bad.status().message(), HasSubstr("the built-in mistral chat template line 1"));
}

TEST_F(InstructionDataTest, NoneIsBosThenEachContentOnItsOwnAndEos) {
  const RenderedExample e =
      Render(Format("none"), Line(R"({"prompt": "Q: red?", "response": "A"})"));
  EXPECT_EQ(e.tokens, Cat({{tok_->bos_id()}, Enc("Q: red?"), Enc("A"), {tok_->eos_id()}}));
  ExpectOneExampleStart(e);
  auto tool = RenderExample(
      Format("none"), *tok_,
      Line(
          R"({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]})"));
  ASSERT_FALSE(tool.ok());
  EXPECT_THAT(tool.status().message(),
              HasSubstr("the role \"tool\", which the none chat template"));
}

// A model's template without {% generation %} blocks takes the turns from prefix renders; one
// with them from the blocks; both give the built-in's mask here.
constexpr std::string_view kQwenLike =
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' "
    "}}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
constexpr std::string_view kTurns = R"({"messages": [{"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "\n\nHello!\n"}, {"role": "user", "content": "Again"},
    {"role": "assistant", "content": "Sure."}]})";

TEST_F(InstructionDataTest, PrefixRendersAndGenerationBlocksFindTheSameTurns) {
  const fs::path file = *dir_ / "qwen_like.jinja";
  std::ofstream(file) << kQwenLike;
  const ChatFormat prefixes = Format(file.string());
  ASSERT_EQ(prefixes.kind, ChatTemplate::kJinja);
  ASSERT_FALSE(prefixes.jinja->has_generation_blocks());
  const RenderedExample a = Render(prefixes, Line(kTurns));
  const RenderedExample b = Render(Format("chatml"), Line(kTurns));
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.flags, b.flags);
  EXPECT_EQ(LossRuns(a), (std::vector<std::string>{"\n\nHello!\n<|im_end|>", "Sure.<|im_end|>"}));
}

// Qwen3's template drops the reasoning of assistant turns before the last user message and writes
// an empty <think> block into the generation prompt when thinking is off: the turns are still
// found (their text past the prompt, as the whole conversation holds it).
constexpr std::string_view kQwen3Like =
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages[::-1] %}{%- if m.role == 'user' and ns.last_query == -1 %}"
    "{%- set ns.last_query = messages|length - 1 - loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + (m.reasoning_content | default('')) + "
    "'\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}";

TEST_F(InstructionDataTest, TurnsAreFoundWhereTheTemplateRendersThemDifferentlyInContext) {
  const fs::path file = *dir_ / "qwen3_like.jinja";
  std::ofstream(file) << kQwen3Like;
  const std::string line = R"({"messages": [{"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
      {"role": "user", "content": "Again"},
      {"role": "assistant", "content": "Sure.", "reasoning_content": "agree"}]})";
  // Thinking on: the last turn's reasoning is generated; the first turn's was dropped.
  RenderedExample e = Render(Format(file.string()), Line(line));
  EXPECT_THAT(Decode(e.tokens), HasSubstr("<|im_start|>assistant\nHello!<|im_end|>"));
  EXPECT_EQ(LossRuns(e), (std::vector<std::string>{"Hello!<|im_end|>",
                                                   "<think>\nagree\n</think>\n\nSure.<|im_end|>"}));
  // Thinking off (--chat-template-kwargs), data without reasoning: the prompt ends in the empty
  // think block, which the whole conversation holds for the last turn only.
  e = Render(Format(file.string(), "/nonexistent/t", R"({"enable_thinking": false})"),
             Line(R"({"messages": [{"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"},
                 {"role": "assistant", "content": "Sure."}]})"));
  EXPECT_THAT(Decode(e.tokens), HasSubstr("assistant\n<think>\n\n</think>\n\nSure."));
  EXPECT_EQ(LossRuns(e), (std::vector<std::string>{"Hello!<|im_end|>", "Sure.<|im_end|>"}));
}

// Found by a review against jinja2 and transformers (2026-12-02): each of these put the wrong
// characters in the loss, or refused a conversation transformers renders.
TEST_F(InstructionDataTest, TurnsAreFoundWhereThePromptMovesOrTheContentIsHidden) {
  // Mistral's tools go before the last user message only: the whole conversation renders the
  // first turn's prompt without them, and that turn is its text, not its user message.
  std::ofstream(*dir_ / "tools_last.jinja")
      << "<s>{% set last = (messages | selectattr('role', 'equalto', 'user') | list)[-1] %}"
         "{% for m in messages %}{% if m.role == 'user' %}{% if tools and m == last %}"
         "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
         "[INST]{{ m.content }}[/INST]{% else %}{{ m.content }}</s>{% endif %}{% endfor %}";
  RenderedExample e = Render(Format((*dir_ / "tools_last.jinja").string()),
                             Line(R"({"messages": [{"role": "user", "content": "q1"},
                 {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                 {"role": "assistant", "content": "a2"}], "tools": [{"name": "f"}]})"));
  std::vector<std::string> runs = LossRuns(e);
  ASSERT_EQ(runs.size(), 2u) << Decode(e.tokens);
  EXPECT_THAT(runs[0], HasSubstr("a1</s>"));
  EXPECT_THAT(runs[0], Not(HasSubstr("q1")));  // was "[INST]q1[/INST]a1</s>"
  EXPECT_THAT(runs[1], HasSubstr("a2</s>"));
  // A generation prompt that is not how a turn begins (DeepSeek-R1's "<think>\n"), and a content
  // whose first byte is the first of what follows it: the turn keeps its '<'.
  std::ofstream(*dir_ / "think_prompt.jinja")
      << "{% for m in messages %}{% if m.role == 'user' %}<U>{{ m.content }}{% else %}<A>"
         "{{ m.content }}<end>{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}<A><think>{{ '\n' }}{% endif %}";
  e = Render(Format((*dir_ / "think_prompt.jinja").string()),
             Line(R"({"messages": [{"role": "user", "content": "q"},
                 {"role": "assistant", "content": "<b>bold</b>"}]})"));
  runs = LossRuns(e);
  ASSERT_EQ(runs.size(), 1u) << Decode(e.tokens);
  EXPECT_THAT(runs[0], HasSubstr("<b>bold</b><end>"));  // was "b>bold</b><end>"
  // A turn of tool calls alone, whose prompt the template renders otherwise once it follows (the
  // system message moves into the last user message): found, with its [TOOL_CALLS] and not the
  // user message before it (was "found nowhere", then "q[/INST][TOOL_CALLS]...").
  std::ofstream(*dir_ / "tool_turn.jinja")
      << "<s>{% if messages[0].role == 'system' %}{% set sys = messages[0].content %}"
         "{% set msgs = messages[1:] %}{% else %}{% set msgs = messages %}{% endif %}"
         "{% for m in msgs %}{% if m.role == 'user' %}{% if loop.last and sys is defined %}"
         "[INST]{{ sys }}{{ '\n\n' }}{{ m.content }}[/INST]{% else %}[INST]{{ m.content }}[/INST]"
         "{% endif %}{% elif m.tool_calls is defined %}[TOOL_CALLS]{{ m.tool_calls | tojson }}</s>"
         "{% elif m.role == 'assistant' %}{{ m.content }}</s>{% elif m.role == 'tool' %}"
         "[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}";
  e = Render(Format((*dir_ / "tool_turn.jinja").string()),
             Line(R"({"messages": [{"role": "system", "content": "S"},
                 {"role": "user", "content": "q"},
                 {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]},
                 {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}]})"));
  runs = LossRuns(e);
  ASSERT_EQ(runs.size(), 2u) << Decode(e.tokens);
  EXPECT_THAT(runs[0], HasSubstr(R"([TOOL_CALLS][{"name": "f"}]</s>)"));
  EXPECT_THAT(runs[0], Not(HasSubstr("q")));
  EXPECT_THAT(runs[1], HasSubstr("a</s>"));
}

// strftime_now reads the format's clock, read once when it is resolved: every prefix render of
// an example shows the same time (a clock that ticked between them put the prompt in the loss).
TEST_F(InstructionDataTest, EveryRenderOfARunShowsTheSameTime) {
  std::ofstream(*dir_ / "clock.jinja")
      << "[{{ strftime_now('%Y') }}]{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>"
         "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
  ChatFormat f = Format((*dir_ / "clock.jinja").string());
  EXPECT_NE(f.now, 0);
  f.now = 400 * 86400;  // 1971-02-05
  const RenderedExample e = Render(f, Line(R"({"prompt": "Q", "response": "A"})"));
  EXPECT_THAT(Decode(e.tokens), HasSubstr("[1971]<user>Q</s>"));
  EXPECT_EQ(LossRuns(e), std::vector<std::string>{"A</s>"});
  // apply_chat_template's own arguments are not kwargs: refused, not silently overwritten.
  for (const std::string key : {"tools", "add_generation_prompt", "documents", "messages"}) {
    auto r = ResolveChatFormat("chatml", "/nonexistent/t", "{\"" + key + "\": true}");
    ASSERT_FALSE(r.ok()) << key;
    EXPECT_THAT(r.status().message(),
                HasSubstr("--chat-template-kwargs: '" + key + "' is not a template kwarg"));
  }
}

// Phi-3-mini's template writes eos_token after the last message when no generation prompt
// follows: a turn rendered as the last message ends in it, where the whole conversation has the
// next user turn. Each turn is what the two agree on; the last keeps its EOS.
TEST_F(InstructionDataTest, TurnsAreFoundWhenTheTemplateEndsTheLastMessageWithTheEos) {
  const fs::path file = *dir_ / "phi3_like.jinja";
  std::ofstream(file)
      << "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + "
         "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' "
         "+ message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' "
         "%}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% "
         "if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}";
  // The tokenizer's EOS piece as the template's eos_token (a tokenizer_config.json would give it).
  const RenderedExample e = Render(
      Format(file.string(), "/nonexistent/t", R"({"eos_token": "</s>"})"), Line(R"({"messages": [
      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
      {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Sure."}]})"));
  const std::vector<std::string> runs = LossRuns(e);
  ASSERT_EQ(runs.size(), 2u) << Decode(e.tokens);
  EXPECT_EQ(runs[0], "Hello!<|end|>");
  EXPECT_THAT(runs[1], ::testing::StartsWith("Sure.<|end|>"));
  ASSERT_GE(e.tokens.size(), 1u);
  EXPECT_EQ(e.tokens.back(), tok_->eos_id());
  EXPECT_NE(e.flags.back() & kTokenFlagInLoss, 0);
}

// A token straddling a span's edge is in the loss: over tokens of two bytes, the spans' edges
// fall inside tokens.
class PairsTokenizer final : public Tokenizer {
 public:
  PairsTokenizer() : Tokenizer("pairs", 0) {}
  int vocab_size() const override { return 65536; }
  int bos_id() const override { return -1; }
  int eos_id() const override { return -1; }
  int TokenId(std::string_view) const override { return -1; }
  StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override {
    auto e = EncodeWithOffsets(text);
    return e->ids;
  }
  StatusOr<EncodedText> EncodeWithOffsets(std::string_view text) const override {
    EncodedText out;
    for (size_t i = 0; i < text.size(); i += 2) {
      const auto hi = static_cast<unsigned char>(text[i]);
      const auto lo = i + 1 < text.size() ? static_cast<unsigned char>(text[i + 1]) : 0;
      out.ids.push_back(hi << 8 | lo);
      out.spans.push_back({i, std::min(i + 2, text.size())});
    }
    return out;
  }
  StatusOr<std::string> Decode(std::span<const int32_t> ids) const override {
    std::string s;
    for (int32_t id : ids) {
      s += static_cast<char>(id >> 8);
      if (id & 0xFF) s += static_cast<char>(id & 0xFF);
    }
    return s;
  }
};

TEST_F(InstructionDataTest, ATokenStraddlingASpanEdgeIsInTheLoss) {
  const PairsTokenizer pairs;
  auto e =
      RenderExample(Format("chatml"), pairs, Line(R"({"messages": [{"role": "user", "content": "Q"},
                             {"role": "assistant", "content": "Answer"}]})"));
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const std::string text =
      "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nAnswer<|im_end|>\n";
  const size_t begin = text.find("Answer"), end = text.rfind('\n');
  ASSERT_EQ(begin % 2, 1u);  // the span starts inside a token: "\nA"
  for (size_t i = 0; i < e->tokens.size(); ++i) {
    const size_t b = 2 * i, t_end = std::min(b + 2, text.size());
    EXPECT_EQ((e->flags[i] & kTokenFlagInLoss) != 0, b < end && begin < t_end) << i;
  }
}

TEST_F(InstructionDataTest, TheModelsTemplateVariablesAndToolsReachTheTemplate) {
  const fs::path model_dir = *dir_ / "vars";
  fs::create_directories(model_dir);
  std::ofstream(model_dir / "tokenizer_config.json")
      << R"({"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|eot_id|>",)"
      << R"( "chat_template": "{{ bos_token }}{{ tools | tojson if tools is defined else '' }})"
      << R"({{ greeting | default('') }}{% for m in messages %}{{ m.role }}:{{ m.content }})"
      << R"({% if m.role == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %})"
      << R"({% if add_generation_prompt %}assistant:{% endif %}"})";
  const std::string tokenizer = (model_dir / "tokenizer.model").string();
  auto f = ResolveChatFormat("auto", tokenizer, R"({"greeting": "hey"})");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->kind, ChatTemplate::kJinja);
  EXPECT_THAT(f->source, HasSubstr("tokenizer_config.json"));
  const RenderedExample e =
      Render(*f, Line(R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
          "content": "b"}], "tools": [{"name": "f", "z": 1, "a": 2}]})"));
  EXPECT_EQ(Decode(e.tokens),
            R"(<|begin_of_text|>[{"name": "f", "z": 1, "a": 2}]heyuser:aassistant:b<|eot_id|>)");
  EXPECT_EQ(LossRuns(e), std::vector<std::string>{"b<|eot_id|>"});
  // Without tools, tools and documents are defined and None, as transformers passes them.
  std::ofstream(*dir_ / "defined.jinja")
      << "{% if tools is defined and tools is none %}T{% endif %}{% if documents is defined and "
         "documents is none %}D{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}";
  const RenderedExample d = Render(Format((*dir_ / "defined.jinja").string()),
                                   Line(R"({"messages": [{"role": "user", "content": "a"},
                                       {"role": "assistant", "content": "b"}]})"));
  EXPECT_EQ(Decode(d.tokens), "TDab");
  // chat_template.jinja beside the config wins.
  std::ofstream(model_dir / "chat_template.jinja")
      << "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}";
  f = ResolveChatFormat("auto", model_dir.string());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_THAT(f->source, HasSubstr("chat_template.jinja"));
  EXPECT_TRUE(f->jinja->has_generation_blocks());
}

TEST_F(InstructionDataTest, AutoWithoutATemplateIsNoneAndBadNamesAndTemplatesAreOneLine) {
  const fs::path model_dir = *dir_ / "model";
  fs::create_directories(model_dir);
  const std::string tokenizer = (model_dir / "tokenizer.model").string();
  auto none = ResolveChatFormat("auto", tokenizer);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_EQ(none->kind, ChatTemplate::kNone);
  EXPECT_THAT(none->source, HasSubstr("no tokenizer_config.json"));
  std::ofstream(model_dir / "tokenizer_config.json") << "{\"bos_token\": \"<s>\"}";
  auto absent = ResolveChatFormat("auto", tokenizer);
  ASSERT_TRUE(absent.ok());
  EXPECT_EQ(absent->kind, ChatTemplate::kNone);
  EXPECT_THAT(absent->source, HasSubstr("no chat_template"));
  auto unknown = ResolveChatFormat("gemma", tokenizer);
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(unknown.status().message(),
              HasSubstr("chat template 'gemma' is not one of auto, llama3, chatml, mistral, none"));
  std::ofstream(model_dir / "tokenizer_config.json")
      << R"({"chat_template": "{% for m in messages %}\n{{ m.content }}\n{% include 'x' %}"})";
  auto bad = ResolveChatFormat("auto", tokenizer);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("tokenizer_config.json' chat_template line 3"));
  EXPECT_THAT(bad.status().message(), Not(HasSubstr("\n")));
  // A built-in is as named: the model's files (here a template that does not parse) are not read.
  EXPECT_TRUE(ResolveChatFormat("chatml", tokenizer).ok());
  auto kwargs = ResolveChatFormat("chatml", tokenizer, "[1]");
  ASSERT_FALSE(kwargs.ok());
  EXPECT_THAT(kwargs.status().message(), HasSubstr("--chat-template-kwargs"));
}

// --- JSON lines ---

TEST_F(InstructionDataTest, AFileOfPromptResponseAndMessagesLinesIsOneExampleAfterAnother) {
  const std::string path = (*dir_ / "a.jsonl").string();
  std::ofstream(path) << R"({"prompt": "Q1", "response": "A1"})"
                      << "\n\n"
                      << R"({"messages": [{"role": "user", "content": "Q2"},)"
                      << R"( {"role": "assistant", "content": "A2"}]})"
                      << "\n";
  auto r = TokenizeInstructionFile(*tok_, Format("none"), path);
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

// Lines are rendered in parallel: the result is the one-thread result, whatever the threads; the
// error is the first bad line's in line order.
TEST_F(InstructionDataTest, ThreadsChangeNothingAndTheFirstBadLineIsTheOneNamed) {
  const std::string path = (*dir_ / "many.jsonl").string();
  {
    std::ofstream out(path);
    for (int i = 0; i < 300; ++i) {
      out << fmt::format(R"({{"messages": [{{"role": "user", "content": "Q{} ba"}},)"
                         R"( {{"role": "assistant", "content": "A{} {}"}}]}})",
                         i, i, std::string(i % 17, 'k'))
          << "\n";
    }
  }
  const ChatFormat chatml = Format("chatml");
  auto one = TokenizeInstructionFile(*tok_, chatml, path, 1);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(one->examples, 300);
  for (int threads : {0, 2, 3}) {
    auto r = TokenizeInstructionFile(*tok_, chatml, path, threads);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->tokens, one->tokens) << threads;
    EXPECT_EQ(r->flags, one->flags) << threads;
    EXPECT_EQ(r->tokens_in_loss, one->tokens_in_loss);
  }
  {
    std::ofstream out(path);
    for (int i = 1; i <= 200; ++i) {
      out << (i == 57 || i == 130 ? R"({"prompt": "Q"})" : R"({"prompt": "Q", "response": "A"})")
          << "\n";
    }
  }
  for (int threads : {1, 0, 3}) {
    auto r = TokenizeInstructionFile(*tok_, chatml, path, threads);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("line 57: ")) << threads;
  }
}

TEST_F(InstructionDataTest, BadLinesAreOneLineErrorsNamingFileAndLine) {
  const std::string path = (*dir_ / "bad.jsonl").string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"prompt\": \"Q\"", "line 2: not valid JSON"},
      {R"({"prompt": "Q"})", "line 2: the example has no \"response\""},
      {R"({"text": "Q"})", "line 2: neither \"prompt\" and \"response\" nor \"messages\""},
      {R"({"messages": [{"content": "x"}]})", "message 0 has no \"role\" string"},
      {R"({"messages": [{"role": "user", "content": 3}]})", "\"content\" is not a string"},
      {R"({"prompt": "Q", "response": "  "})", "line 2: empty response"},
      {R"({"messages": [{"role": "user", "content": "x"}]})", "no assistant message"},
      {R"({"prompt": "Q", "response": 3})", "\"response\" is not a string"},
      {R"({"prompt": "Q", "response": "A", "tools": 1})", "\"tools\" is not a list"},
      {R"({"prompt": "Q", "chosen": "A", "rejected": "B"})",
       "line 2: a preference pair (\"chosen\"), not instruction data"},
      // An empty list calls no tool: the turn answers nothing.
      {R"({"messages": [{"role": "user", "content": "q"}, )"
       R"({"role": "assistant", "content": " ", "tool_calls": []}]})",
       "line 2: empty response"},
  };
  for (const auto& [line, expected] : cases) {
    std::ofstream(path) << R"({"prompt": "ok", "response": "ok"})"
                        << "\n"
                        << line << "\n";
    auto r = TokenizeInstructionFile(*tok_, Format("chatml"), path);
    ASSERT_FALSE(r.ok()) << line;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("'" + path + "' line 2: ")) << line;
    EXPECT_THAT(r.status().message(), HasSubstr(expected)) << line;
    EXPECT_THAT(r.status().message(), Not(HasSubstr("\n")));
  }
  // An assistant message with tool calls may have no content.
  EXPECT_TRUE(ParseInstructionLine(R"({"messages": [{"role": "user", "content": "q"},
      {"role": "assistant", "tool_calls": [{"name": "f"}]}]})")
                  .ok());
}

}  // namespace
}  // namespace strata::data
