#include "data/preference_data.h"

#include <fmt/format.h>

#include <cerrno>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include "base/file.h"
#include "data/chat_render.h"
#include "data/token_dataset.h"

namespace strata::data {
namespace {

using ojson = nlohmann::ordered_json;

constexpr const char* kSides[2] = {"chosen", "rejected"};

// A value of the line: a string (the standard form) or a list of messages (conversational).
enum class Form { kString, kMessages };

StatusOr<Form> FormOf(const ojson& j, const char* key) {
  const ojson& v = j[key];
  if (v.is_string()) return Form::kString;
  if (v.is_array()) return Form::kMessages;
  return InvalidArgumentError(
      fmt::format("\"{}\" is neither a string nor a list of messages", key));
}

// Each message of the list `key` checked as instruction data checks it.
Status CheckMessageList(const ojson& list, const char* key) {
  for (size_t i = 0; i < list.size(); ++i) {
    STRATA_RETURN_IF_ERROR(
        CheckMessage(list[i], fmt::format("message {} of \"{}\"", i, key)).status());
  }
  return Status::Ok();
}

// A side's own messages, list[first, end), as a completion: at least one message, an assistant
// one, none of them blank.
Status CheckCompletion(const ojson& list, size_t first, const char* side) {
  if (first >= list.size()) {
    return InvalidArgumentError(fmt::format("the {} completion is empty (no message)", side));
  }
  bool any_assistant = false;
  for (size_t i = first; i < list.size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(const MessageKind kind, CheckMessage(list[i], "a message"));
    if (kind.empty_assistant) {
      return InvalidArgumentError(fmt::format(
          "the {} completion is empty (message {} of \"{}\" has no non-whitespace content)", side,
          i, side));
    }
    any_assistant |= kind.assistant;
  }
  if (!any_assistant) {
    return InvalidArgumentError(
        fmt::format("the {} completion has no assistant message: nothing to learn", side));
  }
  return Status::Ok();
}

// The standard form: strings.
StatusOr<PreferencePair> StandardPair(ojson& j) {
  if (!j.contains("prompt")) {
    return InvalidArgumentError(
        "no \"prompt\" (an implicit prompt needs \"chosen\" and \"rejected\" as lists of "
        "messages)");
  }
  PreferencePair pair;
  ojson prompt = ojson::array();
  if (j.contains("system")) {
    prompt.push_back(ChatMessage("system", j["system"].get<std::string>()));
  }
  prompt.push_back(ChatMessage("user", j["prompt"].get<std::string>()));
  pair.prompt_messages = prompt.size();
  for (const char* side : kSides) {
    std::string completion = j[side].get<std::string>();
    if (IsBlankText(completion)) {
      return InvalidArgumentError(fmt::format("the {} completion is empty", side));
    }
    InstructionExample& e = side == kSides[0] ? pair.chosen : pair.rejected;
    e.messages = prompt;
    e.messages.push_back(ChatMessage("assistant", std::move(completion)));
  }
  return pair;
}

// The conversational form, the prompt given or implicit.
StatusOr<PreferencePair> ConversationalPair(ojson& j) {
  for (const char* side : kSides) STRATA_RETURN_IF_ERROR(CheckMessageList(j[side], side));
  ojson& chosen = j["chosen"];
  ojson& rejected = j["rejected"];
  ojson prompt = ojson::array();
  size_t first = 0;  // of each side's own messages in its list
  if (j.contains("prompt")) {
    prompt = std::move(j["prompt"]);
    STRATA_RETURN_IF_ERROR(CheckMessageList(prompt, "prompt"));
  } else {
    // TRL's extract_prompt: the longest run of whole messages both sides begin with.
    while (first < chosen.size() && first < rejected.size() && chosen[first] == rejected[first]) {
      ++first;
    }
    for (const char* side : kSides) {
      if (first == j[side].size()) {
        return InvalidArgumentError(fmt::format(
            "the implicit prompt (the {} message{} \"chosen\" and \"rejected\" begin with) "
            "leaves the {} side empty",
            first, first == 1 ? "" : "s", side));
      }
    }
    for (size_t i = 0; i < first; ++i) prompt.push_back(chosen[i]);
  }
  for (const char* side : kSides) STRATA_RETURN_IF_ERROR(CheckCompletion(j[side], first, side));
  if (j.contains("system")) {
    bool has_system = false;
    for (const ojson& m : prompt) has_system |= m["role"] == "system";
    if (!has_system) {
      prompt.insert(prompt.begin(), ChatMessage("system", j["system"].get<std::string>()));
    }
  }
  PreferencePair pair;
  pair.prompt_messages = prompt.size();
  pair.chosen.messages = prompt;
  pair.rejected.messages = std::move(prompt);
  for (size_t i = first; i < chosen.size(); ++i) {
    pair.chosen.messages.push_back(std::move(chosen[i]));
  }
  for (size_t i = first; i < rejected.size(); ++i) {
    pair.rejected.messages.push_back(std::move(rejected[i]));
  }
  return pair;
}

// Render one side and flag it; `side` names it in errors.
StatusOr<RenderedExample> RenderSide(const ChatFormat& format, const Tokenizer& tokenizer,
                                     InstructionExample example, size_t prompt_messages,
                                     const char* side, ExampleEncoder& encoder) {
  STRATA_ASSIGN_OR_RETURN(RenderedExample r,
                          RenderConversation(format, tokenizer, std::move(example), prompt_messages,
                                             encoder, PromptEncoding::kApart));
  // A target is predicted from the tokens before it: the side's first token is none.
  bool in_loss = false;
  for (size_t i = 1; i < r.flags.size(); ++i) in_loss |= (r.flags[i] & kTokenFlagInLoss) != 0;
  if (!in_loss) {
    return InvalidArgumentError(
        fmt::format("the {} completion renders to no token in the loss (chat template {})", side,
                    format.jinja != nullptr ? format.jinja->where()
                                            : std::string(ChatTemplateName(format.kind))));
  }
  r.flags[0] |=
      side == kSides[0] ? kTokenFlagExampleStart | kTokenFlagPairStart : kTokenFlagExampleStart;
  return r;
}

StatusOr<RenderedPair> RenderPair(const ChatFormat& format, const Tokenizer& tokenizer,
                                  PreferencePair pair, ExampleEncoder& encoder) {
  RenderedPair out;
  STRATA_ASSIGN_OR_RETURN(out.chosen, RenderSide(format, tokenizer, std::move(pair.chosen),
                                                 pair.prompt_messages, kSides[0], encoder));
  STRATA_ASSIGN_OR_RETURN(out.rejected, RenderSide(format, tokenizer, std::move(pair.rejected),
                                                   pair.prompt_messages, kSides[1], encoder));
  return out;
}

}  // namespace

StatusOr<PreferencePair> ParsePreferenceLine(std::string_view line) {
  STRATA_ASSIGN_OR_RETURN(ojson j, ParseJsonLine(line));
  if (!j.is_object()) return InvalidArgumentError("not a JSON object");
  if (!j.contains("chosen") && (j.contains("messages") || j.contains("response"))) {
    return InvalidArgumentError(
        "instruction data (\"messages\" or \"response\"), not a preference pair: every line of "
        "a file is one kind, which its first line decides");
  }
  for (const char* side : kSides) {
    if (!j.contains(side)) return InvalidArgumentError(fmt::format("no \"{}\"", side));
  }
  STRATA_ASSIGN_OR_RETURN(const Form form, FormOf(j, "chosen"));
  STRATA_ASSIGN_OR_RETURN(const Form rejected_form, FormOf(j, "rejected"));
  const auto name = [](Form f) { return f == Form::kString ? "a string" : "a list of messages"; };
  const auto mixed = [&](const char* key, Form f) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is {} but \"chosen\" is {}: a line holds strings (the standard form) or lists "
        "of messages (the conversational form), not both",
        key, name(f), name(form)));
  };
  if (rejected_form != form) return mixed("rejected", rejected_form);
  if (j.contains("prompt")) {
    STRATA_ASSIGN_OR_RETURN(const Form prompt_form, FormOf(j, "prompt"));
    if (prompt_form != form) return mixed("prompt", prompt_form);
  }
  if (j.contains("system") && !j["system"].is_string()) {
    return InvalidArgumentError("\"system\" is not a string");
  }
  ojson tools;
  if (j.contains("tools") && !j["tools"].is_null()) {
    if (!j["tools"].is_array()) return InvalidArgumentError("\"tools\" is not a list");
    tools = std::move(j["tools"]);
  }
  STRATA_ASSIGN_OR_RETURN(PreferencePair pair,
                          form == Form::kString ? StandardPair(j) : ConversationalPair(j));
  pair.chosen.tools = tools;
  pair.rejected.tools = std::move(tools);
  return pair;
}

StatusOr<RenderedPair> RenderPreferencePair(const ChatFormat& format, const Tokenizer& tokenizer,
                                            const PreferencePair& pair) {
  ExampleEncoder encoder(format, tokenizer);
  return RenderPair(format, tokenizer, pair, encoder);
}

StatusOr<PreferenceTokens> TokenizePreferenceFile(const Tokenizer& tokenizer,
                                                  const ChatFormat& format,
                                                  const std::string& jsonl_path, int threads) {
  const RenderJsonlLine render =
      [&](std::string_view line,
          ExampleEncoder& encoder) -> StatusOr<std::vector<RenderedExample>> {
    STRATA_ASSIGN_OR_RETURN(PreferencePair pair, ParsePreferenceLine(line));
    STRATA_ASSIGN_OR_RETURN(RenderedPair r,
                            RenderPair(format, tokenizer, std::move(pair), encoder));
    std::vector<RenderedExample> out;
    out.push_back(std::move(r.chosen));
    out.push_back(std::move(r.rejected));
    return out;
  };
  STRATA_ASSIGN_OR_RETURN(JsonlTokens data, TokenizeJsonlLines(format, tokenizer, jsonl_path,
                                                               "preference data", threads, render));
  if (data.lines == 0) {
    return InvalidArgumentError(fmt::format("preference data '{}' has no pairs", jsonl_path));
  }
  PreferenceTokens out;
  out.tokens = std::move(data.tokens);
  out.flags = std::move(data.flags);
  out.pairs = data.lines;
  out.tokens_in_loss = data.tokens_in_loss;
  return out;
}

StatusOr<bool> IsPreferenceFile(const std::string& jsonl_path) {
  STRATA_RETURN_IF_ERROR(OpenRegularFile(jsonl_path, "JSON lines").status());
  std::ifstream in(jsonl_path, std::ios::binary);
  if (!in) {
    return ErrnoToStatus(errno ? errno : ENOENT,
                         fmt::format("cannot open JSON lines '{}'", jsonl_path));
  }
  std::string line;
  while (std::getline(in, line)) {
    if (TrimAsciiSpace(line).empty()) continue;
    auto j = ParseJsonLine(line);
    return j.ok() && j->is_object() && j->contains("chosen");
  }
  if (in.bad()) return ErrnoToStatus(errno, fmt::format("reading '{}'", jsonl_path));
  return false;
}

}  // namespace strata::data
