#include "data/chat_format.h"

#include <fmt/format.h>

#include <filesystem>
#include <utility>

#include "base/file.h"
#include "base/untrusted_text.h"

namespace strata::data {
namespace {

using ojson = nlohmann::ordered_json;
namespace fs = std::filesystem;

// The built-in templates (chat_format.h). Text holding a newline is written as an expression:
// trim_blocks would drop a newline that follows a block tag.
constexpr std::string_view kLlama3 =
    "<|begin_of_text|>{% for m in messages %}"
    "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}<|eot_id|>"
    "{% endgeneration %}{% else %}{{ m.content | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}";

constexpr std::string_view kChatml =
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

constexpr std::string_view kMistral =
    "<s>{% if messages[0].role == 'system' %}{% set system = messages[0].content + '\\n\\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}"
    "{% endif %}{% for m in turns %}"
    "{% if (m.role == 'user') != (loop.index0 % 2 == 0) or m.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('the mistral chat template needs roles alternating user, assistant, ... "
    "(after an optional first system message)') }}{% endif %}"
    "{% if m.role == 'user' %}{{ '[INST] ' + (system if loop.first else '') + m.content + "
    "' [/INST]' }}{% else %}{% generation %}{{ m.content }}</s>{% endgeneration %}{% endif %}"
    "{% endfor %}";

Status NotJson(const std::string& path, std::string_view what) {
  return InvalidArgumentError(fmt::format("'{}': {}", path, what));
}

// A JSON file's object, or a null JSON (not an object) when the file does not exist.
StatusOr<ojson> ReadJsonObject(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return ojson();
  STRATA_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, {.max_bytes = 64ull << 20}));
  auto parsed = ParseOrderedJsonBounded(text);
  if (!parsed.ok()) return parsed.status().WithContext(fmt::format("'{}'", path));
  if (!parsed->is_object()) return NotJson(path, "not a JSON object");
  return std::move(*parsed);
}

// tokenizer_config.json's chat_template: a string, or the "default" of a list of named ones;
// empty when absent or null.
StatusOr<std::string> ChatTemplateText(const ojson& config, const std::string& path) {
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const ojson& t : *it) {
      if (t.is_object() && t.contains("name") && t["name"] == "default" && t.contains("template") &&
          t["template"].is_string()) {
        return t["template"].get<std::string>();
      }
    }
  }
  return NotJson(path, "chat_template is neither a string nor a list with a \"default\" template");
}

// bos_token, eos_token, unk_token, pad_token of tokenizer_config.json (a string, or an added
// token's {"content": ...}), else of special_tokens_map.json beside it, as transformers'
// special_tokens_map passes them to the template.
void AddSpecialTokens(const ojson& config, const ojson& special_map, ojson& variables) {
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    for (const ojson* source : {&config, &special_map}) {
      if (!source->is_object()) continue;
      const auto it = source->find(key);
      if (it == source->end()) continue;
      if (it->is_string()) {
        variables[key] = *it;
      } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
        variables[key] = (*it)["content"];
      } else {
        continue;
      }
      break;
    }
  }
}

StatusOr<std::shared_ptr<const JinjaTemplate>> ParseTemplate(std::string_view text,
                                                             std::string where) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<JinjaTemplate> t,
                          JinjaTemplate::Parse(text, std::move(where)));
  return std::shared_ptr<const JinjaTemplate>(std::move(t));
}

// The built-in template `name` names (kNone for any other name).
ChatTemplate ChatTemplateFromName(std::string_view name) {
  if (name == "llama3") return ChatTemplate::kLlama3;
  if (name == "chatml") return ChatTemplate::kChatml;
  if (name == "mistral") return ChatTemplate::kMistral;
  return ChatTemplate::kNone;
}

bool NamesAFile(std::string_view name) {
  return name.find('/') != std::string_view::npos || name.ends_with(".jinja");
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
    case ChatTemplate::kJinja:
      return "jinja";
  }
  return "?";
}

std::string_view BuiltinChatTemplate(ChatTemplate kind) {
  switch (kind) {
    case ChatTemplate::kLlama3:
      return kLlama3;
    case ChatTemplate::kChatml:
      return kChatml;
    case ChatTemplate::kMistral:
      return kMistral;
    case ChatTemplate::kNone:
    case ChatTemplate::kJinja:
      break;
  }
  return {};
}

StatusOr<ChatFormat> ResolveChatFormat(std::string_view name, const std::string& tokenizer_path,
                                       std::string_view kwargs_json) {
  std::error_code ec;
  const fs::path dir = fs::is_directory(tokenizer_path, ec)
                           ? fs::path(tokenizer_path)
                           : fs::path(tokenizer_path).parent_path();
  const std::string dir_name = dir.empty() ? "." : dir.string();
  const std::string config_path = (dir / "tokenizer_config.json").string();
  // The model's files are read for its own template (auto, or a file meant for it); a built-in
  // or none is as named, whatever they hold.
  const bool builtin = name == "none" || !BuiltinChatTemplate(ChatTemplateFromName(name)).empty();
  ojson config, special_map;
  if (!builtin) {
    STRATA_ASSIGN_OR_RETURN(config, ReadJsonObject(config_path));
    STRATA_ASSIGN_OR_RETURN(special_map,
                            ReadJsonObject((dir / "special_tokens_map.json").string()));
  }

  ChatFormat f;
  f.now = std::time(nullptr);
  AddSpecialTokens(config, special_map, f.variables);
  if (!kwargs_json.empty()) {
    auto kwargs = ParseOrderedJsonBounded(kwargs_json);
    if (!kwargs.ok() || !kwargs->is_object()) {
      return InvalidArgumentError(
          fmt::format("--chat-template-kwargs '{}' is not a JSON object{}", Excerpt(kwargs_json),
                      kwargs.ok() ? "" : fmt::format(" ({})", kwargs.status().message())));
    }
    for (const auto& [key, value] : kwargs->items()) {
      // apply_chat_template's own arguments: set for each example and each render, never from
      // here (they were overwritten without a word).
      if (key == "messages" || key == "tools" || key == "documents" ||
          key == "add_generation_prompt") {
        return InvalidArgumentError(fmt::format(
            "--chat-template-kwargs: '{}' is not a template kwarg: {}", key,
            key == "tools" ? "give an example's tools as its line's \"tools\" list"
            : key == "add_generation_prompt"
                ? "training renders each conversation without it and each prompt with it"
                : "it comes from each example's line"));
      }
      f.variables[key] = value;
    }
  }

  for (ChatTemplate kind : {ChatTemplate::kLlama3, ChatTemplate::kChatml, ChatTemplate::kMistral}) {
    if (name != ChatTemplateName(kind)) continue;
    f.kind = kind;
    f.source = "named";
    STRATA_ASSIGN_OR_RETURN(f.jinja,
                            ParseTemplate(BuiltinChatTemplate(kind),
                                          fmt::format("the built-in {} chat template", name)));
    return f;
  }
  if (name == "none") {
    f.source = "named";
    return f;
  }
  std::string text, where;
  if (name == "auto") {
    const std::string jinja_path = (dir / "chat_template.jinja").string();
    if (fs::exists(jinja_path, ec)) {
      STRATA_ASSIGN_OR_RETURN(text, ReadSmallFile(jinja_path, {.max_bytes = 16ull << 20}));
      where = fmt::format("'{}'", jinja_path);
      f.source = where;
    } else if (config.is_object()) {
      STRATA_ASSIGN_OR_RETURN(text, ChatTemplateText(config, config_path));
      where = fmt::format("'{}' chat_template", config_path);
      f.source = fmt::format("chat_template of '{}'", config_path);
    }
    if (text.empty()) {
      f.source = config.is_object() ? fmt::format("no chat_template in '{}'", config_path)
                                    : fmt::format("no tokenizer_config.json in '{}'", dir_name);
      return f;
    }
  } else if (NamesAFile(name)) {
    const std::string path(name);
    STRATA_ASSIGN_OR_RETURN(text, ReadSmallFile(path, {.max_bytes = 16ull << 20}));
    where = fmt::format("'{}'", path);
    f.source = where;
  } else {
    return InvalidArgumentError(
        fmt::format("chat template '{}' is not one of auto, llama3, chatml, mistral, none, or a "
                    "template file (a path with '/' or ending in .jinja)",
                    Excerpt(name)));
  }
  f.kind = ChatTemplate::kJinja;
  STRATA_ASSIGN_OR_RETURN(f.jinja, ParseTemplate(text, std::move(where)));
  return f;
}

}  // namespace strata::data
