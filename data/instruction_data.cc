#include "data/instruction_data.h"

#include <fmt/format.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/file.h"
#include "base/untrusted_text.h"
#include "data/token_dataset.h"

namespace strata::data {
namespace {

using json = nlohmann::json;

constexpr std::string_view kWhitespace = " \t\n\r\f\v";

bool Has(std::string_view text, std::string_view piece) {
  return text.find(piece) != std::string_view::npos;
}

// ASCII whitespace trimmed: what a blank JSON line is.
std::string_view Trim(std::string_view s) {
  const size_t first = s.find_first_not_of(kWhitespace);
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(kWhitespace) - first + 1);
}

// Python's str.isspace(): ASCII \t \n \v \f \r, the separators U+001C..U+001F, space, U+0085,
// U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000.
bool IsPythonSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// The length in bytes of the UTF-8 sequence at s[0] when it is one character that
// IsPythonSpace, else 0 (also for an invalid or truncated sequence).
size_t PythonSpaceBytes(std::string_view s) {
  if (s.empty()) return 0;
  const auto b0 = static_cast<unsigned char>(s[0]);
  const size_t len = b0 < 0x80 ? 1 : (b0 >> 5) == 0x6 ? 2 : (b0 >> 4) == 0xE ? 3 : 0;
  if (len == 0 || s.size() < len) return 0;  // 4-byte sequences hold no whitespace
  char32_t c = len == 1 ? b0 : len == 2 ? (b0 & 0x1F) : (b0 & 0x0F);
  for (size_t i = 1; i < len; ++i) {
    const auto b = static_cast<unsigned char>(s[i]);
    if ((b & 0xC0) != 0x80) return 0;
    c = (c << 6) | (b & 0x3F);
  }
  return IsPythonSpace(c) ? len : 0;
}

// Jinja's `| trim`: Python's str.strip(), which removes every str.isspace() character at either
// end — Unicode whitespace too (U+3000 around Japanese text, U+00A0), not only ASCII.
std::string_view JinjaTrim(std::string_view s) {
  while (const size_t n = PythonSpaceBytes(s)) s.remove_prefix(n);
  for (;;) {
    // The last character starts at most 3 bytes before the end (no whitespace needs 4).
    size_t n = 0;
    for (size_t len = 1; len <= 3 && len <= s.size() && n == 0; ++len) {
      if (PythonSpaceBytes(s.substr(s.size() - len)) == len) n = len;
    }
    if (n == 0) return s;
    s.remove_suffix(n);
  }
}

std::string_view RoleName(ChatRole role) {
  switch (role) {
    case ChatRole::kSystem:
      return "system";
    case ChatRole::kUser:
      return "user";
    case ChatRole::kAssistant:
      return "assistant";
  }
  return "?";
}

// A Jinja string literal's escapes (\n, \t, \\, \', \") resolved.
std::string Unescape(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    const char c = s[++i];
    out += c == 'n' ? '\n' : c == 't' ? '\t' : c;
  }
  return out;
}

// ChatML's default system line: a literal "<|im_start|>system\n TEXT <|im_end|>" whose TEXT is
// plain (no quote, brace or '+': not an expression). Empty when the template has none.
std::string DefaultSystemLine(std::string_view jinja) {
  constexpr std::string_view kStart = "<|im_start|>system";
  for (size_t at = jinja.find(kStart); at != std::string_view::npos;
       at = jinja.find(kStart, at + 1)) {
    std::string_view rest = jinja.substr(at + kStart.size());
    if (rest.starts_with("\\n")) {
      rest.remove_prefix(2);
    } else if (rest.starts_with("\n")) {
      rest.remove_prefix(1);
    } else {
      continue;
    }
    const size_t end = rest.find("<|im_end|>");
    if (end == std::string_view::npos) continue;
    const std::string_view text = rest.substr(0, end);
    if (text.empty() || text.find_first_of("'\"{}+") != std::string_view::npos) continue;
    return Unescape(text);
  }
  return "";
}

Status Refuse(std::string_view where, std::string_view why) {
  return InvalidArgumentError(
      fmt::format("{}'s chat_template is not one Strata renders (llama3, chatml, mistral){}: give "
                  "--chat-template NAME or none",
                  where, why.empty() ? "" : fmt::format(" ({})", why)));
}

}  // namespace

std::string_view ChatTemplateName(ChatTemplate kind) {
  switch (kind) {
    case ChatTemplate::kNone:
      return "none";
    case ChatTemplate::kLlama3:
      return "llama3";
    case ChatTemplate::kChatml:
      return "chatml";
    case ChatTemplate::kMistral:
      return "mistral";
  }
  return "?";
}

StatusOr<ChatFormat> ChatFormatFromJinja(std::string_view jinja, std::string_view where) {
  const bool llama3 = Has(jinja, "<|start_header_id|>") && Has(jinja, "<|eot_id|>");
  const bool chatml = Has(jinja, "<|im_start|>") && Has(jinja, "<|im_end|>");
  const bool mistral = Has(jinja, "[INST]") && Has(jinja, "[/INST]");
  if (int{llama3} + int{chatml} + int{mistral} != 1) {
    return Refuse(where, llama3 || chatml || mistral ? "the pieces of several families" : "");
  }
  ChatFormat f;
  f.source = fmt::format("chat_template of {}", where);
  if (llama3) {
    if (Has(jinja, "Cutting Knowledge Date")) {
      return Refuse(where, "Llama 3.1's dated system preamble");
    }
    f.kind = ChatTemplate::kLlama3;
  } else if (chatml) {
    if (Has(jinja, "<think>")) return Refuse(where, "ChatML with <think> reasoning");
    f.kind = ChatTemplate::kChatml;
    f.default_system = DefaultSystemLine(jinja);
  } else {
    if (Has(jinja, "<<SYS>>")) return Refuse(where, "Llama 2's <<SYS>> system block");
    if (!Has(jinja, " [/INST]")) return Refuse(where, "[/INST] without a space before it");
    f.kind = ChatTemplate::kMistral;
  }
  return f;
}

namespace {

// tokenizer_config.json's chat_template: a string, or the "default" of a list of named ones;
// empty when absent or null.
StatusOr<std::string> ChatTemplateText(const json& config, const std::string& path) {
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const json& t : *it) {
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") &&
          t["template"].is_string()) {
        return t["template"].get<std::string>();
      }
    }
  }
  return InvalidArgumentError(fmt::format(
      "'{}': chat_template is neither a string nor a list with a \"default\" template", path));
}

}  // namespace

StatusOr<ChatFormat> ResolveChatFormat(std::string_view name, const std::string& tokenizer_path) {
  for (ChatTemplate kind : {ChatTemplate::kNone, ChatTemplate::kLlama3, ChatTemplate::kChatml,
                            ChatTemplate::kMistral}) {
    if (name == ChatTemplateName(kind)) return ChatFormat{kind, "", "named"};
  }
  if (name != "auto") {
    return InvalidArgumentError(
        fmt::format("chat template '{}' is not one of auto, llama3, chatml, mistral, none", name));
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path dir = fs::is_directory(tokenizer_path, ec)
                           ? fs::path(tokenizer_path)
                           : fs::path(tokenizer_path).parent_path();
  const std::string path = (dir / "tokenizer_config.json").string();
  const std::string dir_name = dir.empty() ? "." : dir.string();
  if (!fs::exists(path, ec)) {
    return ChatFormat{ChatTemplate::kNone, "",
                      fmt::format("no tokenizer_config.json in '{}'", dir_name)};
  }
  auto text = ReadSmallFile(path, {.max_bytes = 64ull << 20});
  if (!text.ok()) return text.status().WithContext("tokenizer config");
  auto parsed = ParseJsonBounded(*text);
  if (!parsed.ok()) return parsed.status().WithContext(fmt::format("'{}'", path));
  const json config = std::move(*parsed);
  if (!config.is_object()) {
    return InvalidArgumentError(fmt::format("'{}' is not a JSON object", path));
  }
  STRATA_ASSIGN_OR_RETURN(std::string jinja, ChatTemplateText(config, path));
  if (jinja.empty()) {
    return ChatFormat{ChatTemplate::kNone, "", fmt::format("no chat_template in '{}'", path)};
  }
  return ChatFormatFromJinja(jinja, fmt::format("'{}'", path));
}

namespace {

StatusOr<std::string> StringField(const json& j, const char* key, std::string_view what) {
  const auto it = j.find(key);
  if (it == j.end()) return InvalidArgumentError(fmt::format("{} has no \"{}\"", what, key));
  if (!it->is_string()) {
    return InvalidArgumentError(fmt::format("{}'s \"{}\" is not a string", what, key));
  }
  return it->get<std::string>();
}

StatusOr<std::vector<ChatMessage>> ParseMessages(const json& list) {
  if (!list.is_array()) return InvalidArgumentError("\"messages\" is not a list");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const json& m = list[i];
    const std::string what = fmt::format("message {}", i);
    if (!m.is_object()) return InvalidArgumentError(fmt::format("{} is not an object", what));
    STRATA_ASSIGN_OR_RETURN(std::string role, StringField(m, "role", what));
    STRATA_ASSIGN_OR_RETURN(std::string content, StringField(m, "content", what));
    ChatMessage msg{ChatRole::kUser, std::move(content)};
    if (role == "system") {
      msg.role = ChatRole::kSystem;
    } else if (role == "assistant") {
      msg.role = ChatRole::kAssistant;
    } else if (role != "user") {
      return InvalidArgumentError(fmt::format(
          "{} has the unknown role \"{}\" (system, user or assistant)", what, Excerpt(role)));
    }
    out.push_back(std::move(msg));
  }
  return out;
}

}  // namespace

StatusOr<std::vector<ChatMessage>> ParseInstructionLine(std::string_view line) {
  // Nesting is limited: a line is untrusted input like a whole file.
  auto parsed = ParseJsonBounded(line);
  if (!parsed.ok()) {
    return InvalidArgumentError(fmt::format("not valid JSON ({})", parsed.status().message()));
  }
  const json j = std::move(*parsed);
  if (!j.is_object()) return InvalidArgumentError("not a JSON object");
  std::vector<ChatMessage> messages;
  if (j.contains("messages")) {
    STRATA_ASSIGN_OR_RETURN(messages, ParseMessages(j["messages"]));
  } else if (j.contains("prompt") || j.contains("response")) {
    STRATA_ASSIGN_OR_RETURN(std::string prompt, StringField(j, "prompt", "the example"));
    STRATA_ASSIGN_OR_RETURN(std::string response, StringField(j, "response", "the example"));
    if (j.contains("system")) {
      STRATA_ASSIGN_OR_RETURN(std::string system, StringField(j, "system", "the example"));
      messages.push_back({ChatRole::kSystem, std::move(system)});
    }
    messages.push_back({ChatRole::kUser, std::move(prompt)});
    messages.push_back({ChatRole::kAssistant, std::move(response)});
  } else {
    return InvalidArgumentError(
        "neither \"prompt\" and \"response\" nor \"messages\" (a list of role/content objects)");
  }
  bool any_assistant = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role != ChatRole::kAssistant) continue;
    any_assistant = true;
    if (JinjaTrim(messages[i].content).empty()) {
      return InvalidArgumentError(j.contains("messages")
                                      ? fmt::format("empty response (message {}'s content)", i)
                                      : std::string("empty response"));
    }
  }
  if (!any_assistant) return InvalidArgumentError("no assistant message: nothing to learn");
  return messages;
}

namespace {

// Appends ids with their flags; the example-start bit goes on the first token at the end.
class ExampleBuilder {
 public:
  ExampleBuilder(const Tokenizer& tokenizer, ChatTemplate kind)
      : tokenizer_(tokenizer), kind_(kind) {}

  void Id(int32_t id, bool in_loss) {
    out_.tokens.push_back(id);
    out_.flags.push_back(in_loss ? kTokenFlagInLoss : 0);
  }
  Status Special(std::string_view piece, bool in_loss = false) {
    const int id = tokenizer_.TokenId(piece);
    if (id < 0) {
      return InvalidArgumentError(fmt::format(
          "the {} chat template needs the token \"{}\", which tokenizer '{}' does not have",
          ChatTemplateName(kind_), piece, tokenizer_.path()));
    }
    Id(id, in_loss);
    return Status::Ok();
  }
  Status Text(std::string_view text, bool in_loss = false) {
    if (text.empty()) return Status::Ok();
    STRATA_ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer_.Encode(text));
    for (int32_t id : ids) Id(id, in_loss);
    return Status::Ok();
  }
  RenderedExample Finish() {
    if (!out_.flags.empty()) out_.flags[0] |= kTokenFlagExampleStart;
    return std::move(out_);
  }

 private:
  const Tokenizer& tokenizer_;
  const ChatTemplate kind_;
  RenderedExample out_;
};

Status RenderLlama3(std::span<const ChatMessage> messages, ExampleBuilder& b) {
  STRATA_RETURN_IF_ERROR(b.Special("<|begin_of_text|>"));
  for (const ChatMessage& m : messages) {
    const bool loss = m.role == ChatRole::kAssistant;
    STRATA_RETURN_IF_ERROR(b.Special("<|start_header_id|>"));
    STRATA_RETURN_IF_ERROR(b.Text(RoleName(m.role)));
    STRATA_RETURN_IF_ERROR(b.Special("<|end_header_id|>"));
    STRATA_RETURN_IF_ERROR(b.Text("\n\n"));
    STRATA_RETURN_IF_ERROR(b.Text(JinjaTrim(m.content), loss));
    STRATA_RETURN_IF_ERROR(b.Special("<|eot_id|>", loss));
  }
  return Status::Ok();
}

Status RenderChatml(std::span<const ChatMessage> messages, const std::string& default_system,
                    ExampleBuilder& b) {
  auto turn = [&](ChatRole role, std::string_view content) -> Status {
    const bool loss = role == ChatRole::kAssistant;
    STRATA_RETURN_IF_ERROR(b.Special("<|im_start|>"));
    STRATA_RETURN_IF_ERROR(b.Text(fmt::format("{}\n", RoleName(role))));
    STRATA_RETURN_IF_ERROR(b.Text(content, loss));
    STRATA_RETURN_IF_ERROR(b.Special("<|im_end|>", loss));
    return b.Text("\n");
  };
  if (!default_system.empty() && messages[0].role != ChatRole::kSystem) {
    STRATA_RETURN_IF_ERROR(turn(ChatRole::kSystem, default_system));
  }
  for (const ChatMessage& m : messages) STRATA_RETURN_IF_ERROR(turn(m.role, m.content));
  return Status::Ok();
}

Status RenderMistral(std::span<const ChatMessage> messages, const Tokenizer& tokenizer,
                     ExampleBuilder& b) {
  std::string system;
  if (messages[0].role == ChatRole::kSystem) {
    system = messages[0].content + "\n\n";
    messages = messages.subspan(1);
  }
  const bool inst_ids = tokenizer.TokenId("[INST]") >= 0 && tokenizer.TokenId("[/INST]") >= 0;
  STRATA_RETURN_IF_ERROR(b.Special("<s>"));
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const ChatRole expected = i % 2 == 0 ? ChatRole::kUser : ChatRole::kAssistant;
    if (m.role != expected) {
      return InvalidArgumentError(fmt::format(
          "the mistral chat template needs roles alternating user, assistant, ... (after an "
          "optional first system message): message {} is {}",
          i + (system.empty() ? 0 : 1), RoleName(m.role)));
    }
    if (m.role == ChatRole::kAssistant) {
      STRATA_RETURN_IF_ERROR(b.Text(m.content, true));
      STRATA_RETURN_IF_ERROR(b.Special("</s>", true));
      continue;
    }
    const std::string user = i == 0 ? system + m.content : m.content;
    if (inst_ids) {
      STRATA_RETURN_IF_ERROR(b.Special("[INST]"));
      STRATA_RETURN_IF_ERROR(b.Text(" " + user + " "));
      STRATA_RETURN_IF_ERROR(b.Special("[/INST]"));
    } else {
      STRATA_RETURN_IF_ERROR(b.Text("[INST] " + user + " [/INST]"));
    }
  }
  return Status::Ok();
}

Status RenderNone(std::span<const ChatMessage> messages, const Tokenizer& tokenizer,
                  ExampleBuilder& b) {
  if (tokenizer.bos_id() >= 0) b.Id(tokenizer.bos_id(), false);
  for (const ChatMessage& m : messages) {
    const bool loss = m.role == ChatRole::kAssistant;
    STRATA_RETURN_IF_ERROR(b.Text(m.content, loss));
    if (loss && tokenizer.eos_id() >= 0) b.Id(tokenizer.eos_id(), true);
  }
  return Status::Ok();
}

}  // namespace

StatusOr<RenderedExample> RenderExample(const ChatFormat& format, const Tokenizer& tokenizer,
                                        std::span<const ChatMessage> messages) {
  if (messages.empty()) return InvalidArgumentError("an example without messages");
  ExampleBuilder b(tokenizer, format.kind);
  switch (format.kind) {
    case ChatTemplate::kLlama3:
      STRATA_RETURN_IF_ERROR(RenderLlama3(messages, b));
      break;
    case ChatTemplate::kChatml:
      STRATA_RETURN_IF_ERROR(RenderChatml(messages, format.default_system, b));
      break;
    case ChatTemplate::kMistral:
      STRATA_RETURN_IF_ERROR(RenderMistral(messages, tokenizer, b));
      break;
    case ChatTemplate::kNone:
      STRATA_RETURN_IF_ERROR(RenderNone(messages, tokenizer, b));
      break;
  }
  return b.Finish();
}

StatusOr<InstructionTokens> TokenizeInstructionFile(const Tokenizer& tokenizer,
                                                    const ChatFormat& format,
                                                    const std::string& jsonl_path) {
  // A FIFO or a device is refused before the stream opens it (which would wait on a FIFO).
  STRATA_RETURN_IF_ERROR(OpenRegularFile(jsonl_path, "instruction data").status());
  std::ifstream in(jsonl_path, std::ios::binary);
  if (!in) {
    return ErrnoToStatus(errno ? errno : ENOENT,
                         fmt::format("cannot open instruction data '{}'", jsonl_path));
  }
  InstructionTokens out;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (Trim(line).empty()) continue;
    auto at = [&](const Status& s) {
      return Status(s.code(), fmt::format("'{}' line {}: {}", jsonl_path, number, s.message()));
    };
    auto messages = ParseInstructionLine(line);
    if (!messages.ok()) return at(messages.status());
    auto example = RenderExample(format, tokenizer, *messages);
    if (!example.ok()) return at(example.status());
    out.tokens.insert(out.tokens.end(), example->tokens.begin(), example->tokens.end());
    out.flags.insert(out.flags.end(), example->flags.begin(), example->flags.end());
    for (uint8_t f : example->flags) out.tokens_in_loss += (f & kTokenFlagInLoss) != 0;
    ++out.examples;
  }
  if (in.bad()) return ErrnoToStatus(errno, fmt::format("reading '{}'", jsonl_path));
  if (out.examples == 0) {
    return InvalidArgumentError(fmt::format("instruction data '{}' has no examples", jsonl_path));
  }
  return out;
}

}  // namespace strata::data
