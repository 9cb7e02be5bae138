// Preference data: TRL's standard, conversational and implicit-prompt lines rendered into a
// chosen and a rejected example, each rendered as instruction data renders the conversation
// (the same tokens), the loss on the side's own assistant turns only (not on assistant turns
// inside the prompt) with {% generation %} blocks, with prefix renders and with no template, the
// flags of a pair (example starts, the pair start on the chosen side), files of pairs in line
// order whatever the threads, and every bad line's one-line error with its line number.
#include "data/preference_data.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "data/instruction_data.h"
#include "data/token_dataset.h"
#include "data/tokenizer.h"
#include "tests/data/chat_test_tokenizer.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

class PreferenceDataTest : public testing::ChatTokenizerTest {
 protected:
  std::string Decode(const std::vector<int32_t>& ids) const {
    auto text = tok_->Decode(ids);
    EXPECT_TRUE(text.ok());
    return *text;
  }
  static ChatFormat Format(std::string_view name) {
    auto f = ResolveChatFormat(name, "/nonexistent/t");
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    return f.ok() ? *f : ChatFormat{};
  }
  // A Jinja template written to a file and resolved.
  static ChatFormat FileFormat(const std::string& name, std::string_view jinja) {
    const fs::path file = *dir_ / name;
    std::ofstream(file) << jinja;
    return Format(file.string());
  }
  static PreferencePair Line(std::string_view json_line) {
    auto p = ParsePreferenceLine(json_line);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? *p : PreferencePair{};
  }
  RenderedPair Render(const ChatFormat& f, const PreferencePair& p) const {
    auto r = RenderPreferencePair(f, *tok_, p);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : RenderedPair{};
  }
  // The in-loss runs of an example, decoded.
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
  // The first token of the chosen side starts the pair and an example; the rejected side's
  // first token starts an example only; no other token starts anything.
  static void ExpectPairFlags(const RenderedPair& p) {
    for (const RenderedExample* e : {&p.chosen, &p.rejected}) {
      ASSERT_EQ(e->tokens.size(), e->flags.size());
      ASSERT_FALSE(e->flags.empty());
      for (size_t i = 1; i < e->flags.size(); ++i) {
        EXPECT_EQ(e->flags[i] & ~kTokenFlagInLoss, 0) << i;
      }
    }
    EXPECT_EQ(p.chosen.flags[0] & ~kTokenFlagInLoss, kTokenFlagExampleStart | kTokenFlagPairStart);
    EXPECT_EQ(p.rejected.flags[0] & ~kTokenFlagInLoss, kTokenFlagExampleStart);
  }
  // What instruction data makes of the same conversation: the same tokens, and the loss on
  // every assistant turn.
  RenderedExample AsInstruction(const ChatFormat& f, const InstructionExample& e) const {
    auto r = RenderExample(f, *tok_, e);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : RenderedExample{};
  }
  std::string WriteJsonl(const std::string& name, const std::vector<std::string>& lines) const {
    const std::string path = (*dir_ / name).string();
    std::ofstream out(path);
    for (const auto& l : lines) out << l << "\n";
    return path;
  }
};

TEST_F(PreferenceDataTest, StandardLinesAreSystemUserAndEachCompletionAsAnAssistantTurn) {
  const PreferencePair p =
      Line(R"({"system": "Be brief.", "prompt": "Hi there", "chosen": "Hello!", )"
           R"("rejected": " Go away.\n"})");
  EXPECT_EQ(p.prompt_messages, 2u);
  const RenderedPair r = Render(Format("chatml"), p);
  const std::string prompt =
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
      "<|im_start|>assistant\n";
  EXPECT_EQ(Decode(r.chosen.tokens), prompt + "Hello!<|im_end|>\n");
  EXPECT_EQ(r.chosen.tokens, Enc(prompt + "Hello!<|im_end|>\n"));
  EXPECT_EQ(r.rejected.tokens, Enc(prompt + " Go away.\n<|im_end|>\n"));
  EXPECT_EQ(LossRuns(r.chosen), std::vector<std::string>{"Hello!<|im_end|>"});
  EXPECT_EQ(LossRuns(r.rejected), std::vector<std::string>{" Go away.\n<|im_end|>"});
  ExpectPairFlags(r);
  // Each side is what instruction data makes of {"prompt", "response"}, flags but the pair bit.
  const RenderedExample chosen = AsInstruction(
      Format("chatml"), ParseInstructionLine(R"({"system": "Be brief.", "prompt": "Hi there", )"
                                             R"("response": "Hello!"})")
                            .value());
  EXPECT_EQ(chosen.tokens, r.chosen.tokens);
  std::vector<uint8_t> flags = r.chosen.flags;
  flags[0] &= ~kTokenFlagPairStart;
  EXPECT_EQ(chosen.flags, flags);
}

// A multi-turn prompt holds an assistant turn: it is context, not learned, whether the turns come
// from {% generation %} blocks (chatml), from prefix renders (a template without them) or from
// no template; the side's own turn is what instruction data takes for it.
constexpr std::string_view kQwenLike =
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' "
    "}}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
constexpr std::string_view kMultiTurn =
    R"({"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                   {"role": "user", "content": "Again"}],
        "chosen": [{"role": "assistant", "content": "Sure."}],
        "rejected": [{"role": "assistant", "content": "No."}]})";

TEST_F(PreferenceDataTest, OnlyTheSidesOwnAssistantTurnsAreInTheLossNotThoseOfThePrompt) {
  const PreferencePair p = Line(kMultiTurn);
  EXPECT_EQ(p.prompt_messages, 3u);
  ASSERT_EQ(p.chosen.messages.size(), 4u);
  EXPECT_EQ(p.rejected.messages[3]["content"], "No.");
  const ChatFormat prefixes = FileFormat("qwen_like.jinja", kQwenLike);
  ASSERT_FALSE(prefixes.jinja->has_generation_blocks());
  const ChatFormat chatml = Format("chatml");
  ASSERT_TRUE(chatml.jinja->has_generation_blocks());
  for (const ChatFormat* f : {&chatml, &prefixes}) {
    SCOPED_TRACE(f->source);
    const RenderedPair r = Render(*f, p);
    ExpectPairFlags(r);
    EXPECT_EQ(LossRuns(r.chosen), std::vector<std::string>{"Sure.<|im_end|>"});
    EXPECT_EQ(LossRuns(r.rejected), std::vector<std::string>{"No.<|im_end|>"});
    // Instruction data renders the same tokens and learns the prompt's turn as well.
    const RenderedExample all = AsInstruction(*f, p.chosen);
    EXPECT_EQ(all.tokens, r.chosen.tokens);
    EXPECT_EQ(LossRuns(all), (std::vector<std::string>{"Hello!<|im_end|>", "Sure.<|im_end|>"}));
  }
  const RenderedPair none = Render(Format("none"), p);
  const int bos = tok_->bos_id(), eos = tok_->eos_id();
  std::vector<int32_t> want = {bos};
  for (const char* s : {"Hi", "Hello!", "Again", "Sure."}) {
    const auto ids = Enc(s);
    want.insert(want.end(), ids.begin(), ids.end());
    // Every assistant turn ends with the EOS, the prompt's too (outside the loss).
    if (std::string_view(s) == "Hello!" || std::string_view(s) == "Sure.") want.push_back(eos);
  }
  EXPECT_EQ(none.chosen.tokens, want);
  EXPECT_EQ(AsInstruction(Format("none"), p.chosen).tokens, none.chosen.tokens);
  std::vector<int32_t> in_loss;
  for (size_t i = 0; i < want.size(); ++i) {
    if (none.chosen.flags[i] & kTokenFlagInLoss) in_loss.push_back(none.chosen.tokens[i]);
  }
  std::vector<int32_t> want_loss = Enc("Sure.");
  want_loss.push_back(eos);
  EXPECT_EQ(in_loss, want_loss);
  ExpectPairFlags(none);
}

// A template that writes the completion right after the prompt's text: encoded whole, BPE would
// merge the prompt's last characters with the completion's first, giving the two sides different
// prompt tokens and a merged token in the loss. The prompt is encoded on its own, as TRL's
// DPOTrainer encodes prompt and completions: the same prompt tokens on both sides, none of them
// in the loss, each side's rest its completion's own encoding.
TEST_F(PreferenceDataTest, ThePromptIsEncodedApartSoBothSidesShareItsTokens) {
  const ChatFormat plain = FileFormat(
      "plain.jinja", "{% for message in messages %}{{ message['content'] }}{% endfor %}");
  // A split of a trained syllable that the tokenizer merges across ("b" + "a" -> "ba", say).
  std::string head, tail;
  for (const char c : std::string("bdfgklmnprst")) {
    for (const char v : std::string("aeiou")) {
      if (!head.empty()) break;
      const std::string a(1, c), b(1, v);
      std::vector<int32_t> apart = Enc("mi " + a);
      const std::vector<int32_t> rest = Enc(b);
      apart.insert(apart.end(), rest.begin(), rest.end());
      if (Enc("mi " + a + b) != apart) head = a, tail = b;
    }
  }
  ASSERT_FALSE(head.empty()) << "no merge across a syllable boundary: the test cannot fail";
  const PreferencePair p = Line(fmt::format(
      R"({{"prompt": "mi {}", "chosen": "{} ke", "rejected": "{}"}})", head, tail, tail + "ra"));
  const RenderedPair r = Render(plain, p);
  ExpectPairFlags(r);
  const std::vector<int32_t> want_prompt = Enc("mi " + head);  // the template writes no BOS
  for (const auto& [side, completion] :
       {std::pair{&r.chosen, tail + " ke"}, std::pair{&r.rejected, tail + "ra"}}) {
    SCOPED_TRACE(completion);
    ASSERT_GT(side->tokens.size(), want_prompt.size());
    EXPECT_EQ(std::vector<int32_t>(side->tokens.begin(), side->tokens.begin() + want_prompt.size()),
              want_prompt);
    std::vector<int32_t> want_rest = Enc(completion);
    EXPECT_EQ(std::vector<int32_t>(side->tokens.begin() + want_prompt.size(), side->tokens.end()),
              want_rest);
    for (size_t i = 0; i < side->tokens.size(); ++i) {
      EXPECT_EQ((side->flags[i] & kTokenFlagInLoss) != 0, i >= want_prompt.size()) << i;
    }
  }
}

TEST_F(PreferenceDataTest, AnImplicitPromptIsTheMessagesBothSidesBeginWith) {
  const PreferencePair implicit = Line(
      R"({"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                     {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Sure."}],
          "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                       {"role": "user", "content": "Again"}, {"role": "assistant", "content": "No."}]})");
  const PreferencePair given = Line(kMultiTurn);
  EXPECT_EQ(implicit.prompt_messages, 3u);
  EXPECT_EQ(implicit.chosen.messages, given.chosen.messages);
  EXPECT_EQ(implicit.rejected.messages, given.rejected.messages);
  const RenderedPair a = Render(Format("chatml"), implicit), b = Render(Format("chatml"), given);
  EXPECT_EQ(a.chosen.tokens, b.chosen.tokens);
  EXPECT_EQ(a.chosen.flags, b.chosen.flags);
  EXPECT_EQ(a.rejected.flags, b.rejected.flags);
  // Sides that differ from their first message on: an empty prompt.
  const PreferencePair none = Line(R"({"chosen": [{"role": "assistant", "content": "A"}],
      "rejected": [{"role": "assistant", "content": "B"}]})");
  EXPECT_EQ(none.prompt_messages, 0u);
}

TEST_F(PreferenceDataTest, SystemGoesBeforeAPromptWithoutOneAndToolsReachBothSides) {
  const PreferencePair p = Line(R"({"system": "Be brief.",
      "prompt": [{"role": "user", "content": "Q"}],
      "chosen": [{"role": "assistant", "content": "A"}],
      "rejected": [{"role": "assistant", "content": "B"}], "tools": [{"name": "f"}]})");
  EXPECT_EQ(p.prompt_messages, 2u);
  EXPECT_EQ(p.chosen.messages[0]["role"], "system");
  EXPECT_EQ(p.rejected.messages[0]["content"], "Be brief.");
  EXPECT_EQ(p.chosen.tools, p.rejected.tools);
  EXPECT_EQ(p.rejected.tools[0]["name"], "f");
  const PreferencePair kept = Line(R"({"system": "Ignored.",
      "prompt": [{"role": "system", "content": "Own."}, {"role": "user", "content": "Q"}],
      "chosen": [{"role": "assistant", "content": "A"}],
      "rejected": [{"role": "assistant", "content": "B"}]})");
  EXPECT_EQ(kept.prompt_messages, 2u);
  EXPECT_EQ(kept.chosen.messages[0]["content"], "Own.");
}

TEST_F(PreferenceDataTest, AFileIsPairAfterPairWithTheFlagsWhereEachCompletionIs) {
  // kMultiTurn spans lines: written as one.
  std::string multi(kMultiTurn);
  std::erase(multi, '\n');
  const std::string file = WriteJsonl(
      "pairs.jsonl", {R"({"prompt": "Q1", "chosen": "A1", "rejected": "B1 no"})", "", "  ", multi});
  auto r = TokenizePreferenceFile(*tok_, Format("none"), file);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->pairs, 2);
  const int bos = tok_->bos_id(), eos = tok_->eos_id();
  // Each example: BOS, the prompt's contents (its assistant turn followed by the EOS), the
  // completion's and its EOS, in the loss.
  struct Side {
    std::vector<std::string> prompt;
    std::string completion;
  };
  const std::vector<Side> sides = {{{"Q1"}, "A1"},
                                   {{"Q1"}, "B1 no"},
                                   {{"Hi", "Hello!", "Again"}, "Sure."},
                                   {{"Hi", "Hello!", "Again"}, "No."}};
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;
  for (size_t s = 0; s < sides.size(); ++s) {
    const size_t first = tokens.size();
    tokens.push_back(bos);
    flags.push_back(0);
    for (const auto& p : sides[s].prompt) {
      for (int32_t id : Enc(p)) tokens.push_back(id), flags.push_back(0);
      if (p == "Hello!") tokens.push_back(eos), flags.push_back(0);  // the assistant's turn
    }
    for (int32_t id : Enc(sides[s].completion)) tokens.push_back(id), flags.push_back(1);
    tokens.push_back(eos);
    flags.push_back(1);
    flags[first] |= kTokenFlagExampleStart | (s % 2 == 0 ? kTokenFlagPairStart : 0);
  }
  EXPECT_EQ(r->tokens, tokens);
  EXPECT_EQ(r->flags, flags);
  int64_t in_loss = 0;
  for (uint8_t f : flags) in_loss += f & kTokenFlagInLoss;
  EXPECT_EQ(r->tokens_in_loss, in_loss);
}

// Lines are rendered in parallel: the result is the one-thread result, whatever the threads; the
// error is the first bad line's in line order.
TEST_F(PreferenceDataTest, ThreadsChangeNothingAndTheFirstBadLineIsTheOneNamed) {
  std::vector<std::string> lines;
  for (int i = 0; i < 200; ++i) {
    lines.push_back(
        i % 2 == 0 ? fmt::format(R"({{"prompt": "Q{} ba", "chosen": "A{} {}", "rejected": "R{}"}})",
                                 i, i, std::string(i % 13, 'k'), i)
                   : fmt::format(R"({{"chosen": [{{"role": "user", "content": "Q{}"}},)"
                                 R"( {{"role": "assistant", "content": "A{}"}}],)"
                                 R"( "rejected": [{{"role": "user", "content": "Q{}"}},)"
                                 R"( {{"role": "assistant", "content": "R{} {}"}}]}})",
                                 i, i, i, i, std::string(i % 7, 'd')));
  }
  const std::string path = WriteJsonl("many.jsonl", lines);
  const ChatFormat chatml = Format("chatml");
  auto one = TokenizePreferenceFile(*tok_, chatml, path, 1);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(one->pairs, 200);
  int64_t pair_starts = 0, example_starts = 0;
  for (uint8_t f : one->flags) {
    pair_starts += (f & kTokenFlagPairStart) != 0;
    example_starts += (f & kTokenFlagExampleStart) != 0;
  }
  EXPECT_EQ(pair_starts, 200);
  EXPECT_EQ(example_starts, 400);
  for (int threads : {0, 2, 3}) {
    auto r = TokenizePreferenceFile(*tok_, chatml, path, threads);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->tokens, one->tokens) << threads;
    EXPECT_EQ(r->flags, one->flags) << threads;
    EXPECT_EQ(r->tokens_in_loss, one->tokens_in_loss);
  }
  lines[56] = R"({"prompt": "Q", "chosen": "A"})";
  lines[120] = R"({"prompt": "Q", "rejected": "A"})";
  WriteJsonl("many.jsonl", lines);
  for (int threads : {1, 0, 3}) {
    auto r = TokenizePreferenceFile(*tok_, chatml, path, threads);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("line 57: no \"rejected\"")) << threads;
  }
}

TEST_F(PreferenceDataTest, BadLinesAreOneLineErrorsNamingFileAndLine) {
  const std::string path = (*dir_ / "bad.jsonl").string();
  constexpr const char* kA = R"({"role": "assistant", "content": "A"})";
  constexpr const char* kU = R"({"role": "user", "content": "Q"})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"prompt": "Q", "chosen": "A")", "not valid JSON"},
      {R"(["prompt", "chosen"])", "not a JSON object"},
      {R"({"prompt": "Q", "chosen": "A"})", "no \"rejected\""},
      {R"({"prompt": "Q", "rejected": "A"})", "no \"chosen\""},
      {R"({"prompt": "Q", "response": "A"})", "instruction data (\"messages\" or \"response\")"},
      {R"({"prompt": "Q", "chosen": " \n", "rejected": "B"})", "the chosen completion is empty"},
      {R"({"prompt": "Q", "chosen": "A", "rejected": "\u3000"})",
       "the rejected completion is empty"},
      {fmt::format(R"({{"prompt": [{}], "chosen": [], "rejected": [{}]}})", kU, kA),
       "the chosen completion is empty (no message)"},
      {fmt::format(R"({{"prompt": [{}], "chosen": [{}],)"
                   R"( "rejected": [{{"role": "assistant", "content": " "}}]}})",
                   kU, kA),
       "the rejected completion is empty (message 0 of \"rejected\""},
      {fmt::format(R"({{"prompt": [{}], "chosen": [{}], "rejected": [{}]}})", kU, kU, kA),
       "the chosen completion has no assistant message"},
      {R"({"prompt": 3, "chosen": "A", "rejected": "B"})",
       "\"prompt\" is neither a string nor a list of messages"},
      {R"({"prompt": "Q", "chosen": {"a": 1}, "rejected": "B"})",
       "\"chosen\" is neither a string nor a list of messages"},
      {fmt::format(R"({{"prompt": "Q", "chosen": [{}], "rejected": [{}]}})", kA, kA),
       "\"prompt\" is a string but \"chosen\" is a list of messages"},
      {fmt::format(R"({{"prompt": [{}], "chosen": "A", "rejected": "B"}})", kU),
       "\"prompt\" is a list of messages but \"chosen\" is a string"},
      {fmt::format(R"({{"chosen": "A", "rejected": [{}]}})", kA),
       "\"rejected\" is a list of messages but \"chosen\" is a string"},
      {R"({"chosen": "A", "rejected": "B"})", "no \"prompt\" (an implicit prompt needs"},
      {fmt::format(R"({{"chosen": [{}, {}], "rejected": [{}, {}, {}]}})", kU, kA, kU, kA, kU),
       "the implicit prompt (the 2 messages \"chosen\" and \"rejected\" begin with) leaves the "
       "chosen side empty"},
      {fmt::format(R"({{"prompt": [{{"content": "x"}}], "chosen": [{}], "rejected": [{}]}})", kA,
                   kA),
       "message 0 of \"prompt\" has no \"role\" string"},
      {fmt::format(R"({{"prompt": [{}], "chosen": [{{"role": "assistant", "content": 3}}],)"
                   R"( "rejected": [{}]}})",
                   kU, kA),
       "message 0 of \"chosen\"'s \"content\" is not a string"},
      {R"({"prompt": "Q", "chosen": "A", "rejected": "B", "system": 1})",
       "\"system\" is not a string"},
      {R"({"prompt": "Q", "chosen": "A", "rejected": "B", "tools": 1})", "\"tools\" is not a list"},
  };
  for (const auto& [line, expected] : cases) {
    std::ofstream(path) << R"({"prompt": "ok", "chosen": "yes", "rejected": "no"})"
                        << "\n\n"
                        << line << "\n";
    auto r = TokenizePreferenceFile(*tok_, Format("chatml"), path);
    ASSERT_FALSE(r.ok()) << line;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("'" + path + "' line 3: " + expected)) << line;
    EXPECT_THAT(r.status().message(), Not(HasSubstr("\n")));
  }
  // A file of blank lines holds no pair.
  std::ofstream(path) << "\n  \n";
  auto blank = TokenizePreferenceFile(*tok_, Format("chatml"), path);
  ASSERT_FALSE(blank.ok());
  EXPECT_EQ(blank.status().message(), "preference data '" + path + "' has no pairs");
  // An assistant message with tool calls may have no content.
  EXPECT_TRUE(
      ParsePreferenceLine(fmt::format(R"({{"prompt": [{}], "chosen": [{{"role": "assistant", )"
                                      R"("tool_calls": [{{"name": "f"}}]}}], "rejected": [{}]}})",
                                      kU, kA))
          .ok());
}

// A template that writes nothing of a completion into its generation blocks leaves the side
// without a token in the loss: an error, not a pair that teaches nothing.
TEST_F(PreferenceDataTest, ACompletionRenderingToNoTokenInTheLossIsAnError) {
  const ChatFormat silent =
      FileFormat("silent.jinja",
                 "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% else %}"
                 "{% generation %}{% endgeneration %}{% endif %}{% endfor %}");
  ASSERT_TRUE(silent.jinja->has_generation_blocks());
  const std::string path =
      WriteJsonl("silent.jsonl", {R"({"prompt": "Q", "chosen": "A", "rejected": "B"})"});
  auto r = TokenizePreferenceFile(*tok_, silent, path);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(),
              HasSubstr("line 1: the chosen completion renders to no token in the loss"));
}

TEST_F(PreferenceDataTest, AFileIsPreferenceDataWhenItsFirstLineHasChosen) {
  const std::string pairs =
      WriteJsonl("p.jsonl", {"", R"({"prompt": "Q", "chosen": "A", "rejected": "B"})"});
  const std::string sft = WriteJsonl("s.jsonl", {R"({"prompt": "Q", "response": "A"})"});
  const std::string junk = WriteJsonl("j.jsonl", {"{not json", R"({"chosen": "A"})"});
  EXPECT_EQ(IsPreferenceFile(pairs).value(), true);
  EXPECT_EQ(IsPreferenceFile(sft).value(), false);
  EXPECT_EQ(IsPreferenceFile(junk).value(), false);
  auto missing = IsPreferenceFile((*dir_ / "missing.jsonl").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("missing.jsonl"));
}

}  // namespace
}  // namespace strata::data
