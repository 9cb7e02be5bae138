#include "data/instruction_data.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <utility>

#include "data/chat_render.h"

namespace strata::data {
namespace {

using ojson = nlohmann::ordered_json;

Status CheckMessages(const ojson& list, bool from_messages) {
  if (!list.is_array()) return InvalidArgumentError("\"messages\" is not a list");
  bool any_assistant = false;
  for (size_t i = 0; i < list.size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(const MessageKind kind,
                            CheckMessage(list[i], fmt::format("message {}", i)));
    any_assistant |= kind.assistant;
    if (kind.empty_assistant) {
      return InvalidArgumentError(from_messages
                                      ? fmt::format("empty response (message {}'s content)", i)
                                      : std::string("empty response"));
    }
  }
  if (!any_assistant) return InvalidArgumentError("no assistant message: nothing to learn");
  return Status::Ok();
}

StatusOr<std::string> StringField(const ojson& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end()) return InvalidArgumentError(fmt::format("the example has no \"{}\"", key));
  if (!it->is_string()) {
    return InvalidArgumentError(fmt::format("the example's \"{}\" is not a string", key));
  }
  return it->get<std::string>();
}

}  // namespace

StatusOr<InstructionExample> ParseInstructionLine(std::string_view line) {
  STRATA_ASSIGN_OR_RETURN(ojson j, ParseJsonLine(line));
  if (!j.is_object()) return InvalidArgumentError("not a JSON object");
  if (j.contains("chosen") && !j.contains("messages") && !j.contains("response")) {
    return InvalidArgumentError(
        "a preference pair (\"chosen\"), not instruction data: every line of a file is one "
        "kind, which its first line decides");
  }
  InstructionExample example;
  if (j.contains("messages")) {
    STRATA_RETURN_IF_ERROR(CheckMessages(j["messages"], true));
    example.messages = std::move(j["messages"]);
  } else if (j.contains("prompt") || j.contains("response")) {
    STRATA_ASSIGN_OR_RETURN(std::string prompt, StringField(j, "prompt"));
    STRATA_ASSIGN_OR_RETURN(std::string response, StringField(j, "response"));
    if (j.contains("system")) {
      STRATA_ASSIGN_OR_RETURN(std::string system, StringField(j, "system"));
      example.messages.push_back(ChatMessage("system", std::move(system)));
    }
    example.messages.push_back(ChatMessage("user", std::move(prompt)));
    example.messages.push_back(ChatMessage("assistant", std::move(response)));
    STRATA_RETURN_IF_ERROR(CheckMessages(example.messages, false));
  } else {
    return InvalidArgumentError(
        "neither \"prompt\" and \"response\" nor \"messages\" (a list of role/content objects)");
  }
  if (j.contains("tools") && !j["tools"].is_null()) {
    if (!j["tools"].is_array()) return InvalidArgumentError("\"tools\" is not a list");
    example.tools = std::move(j["tools"]);
  }
  return example;
}

StatusOr<RenderedExample> RenderExample(const ChatFormat& format, const Tokenizer& tokenizer,
                                        const InstructionExample& example) {
  ExampleEncoder encoder(format, tokenizer);
  return RenderConversation(format, tokenizer, example, 0, encoder);
}

StatusOr<InstructionTokens> TokenizeInstructionFile(const Tokenizer& tokenizer,
                                                    const ChatFormat& format,
                                                    const std::string& jsonl_path, int threads) {
  const RenderJsonlLine render =
      [&](std::string_view line,
          ExampleEncoder& encoder) -> StatusOr<std::vector<RenderedExample>> {
    STRATA_ASSIGN_OR_RETURN(InstructionExample example, ParseInstructionLine(line));
    STRATA_ASSIGN_OR_RETURN(RenderedExample rendered,
                            RenderConversation(format, tokenizer, std::move(example), 0, encoder));
    std::vector<RenderedExample> out;
    out.push_back(std::move(rendered));
    return out;
  };
  STRATA_ASSIGN_OR_RETURN(
      JsonlTokens data,
      TokenizeJsonlLines(format, tokenizer, jsonl_path, "instruction data", threads, render));
  if (data.lines == 0) {
    return InvalidArgumentError(fmt::format("instruction data '{}' has no examples", jsonl_path));
  }
  InstructionTokens out;
  out.tokens = std::move(data.tokens);
  out.flags = std::move(data.flags);
  out.examples = data.examples;
  out.tokens_in_loss = data.tokens_in_loss;
  return out;
}

}  // namespace strata::data
