// Which chat template renders instruction data, and the variables it is rendered with: the
// model's own Jinja template (tokenizer_config.json's chat_template, a chat_template.jinja beside
// it, or a file the user names), a built-in one by name, or none.
//
// Built-in templates (Jinja text in chat_format.cc, each assistant turn inside
// {% generation %} ... {% endgeneration %}, so the loss takes exactly those characters):
//   llama3   <|begin_of_text|>, then per message:
//              <|start_header_id|> ROLE <|end_header_id|> "\n\n" CONTENT|trim <|eot_id|>
//            [loss: an assistant's CONTENT|trim and its <|eot_id|>] — Meta-Llama-3-*-Instruct.
//   chatml   per message: <|im_start|> ROLE "\n" CONTENT <|im_end|> "\n"
//            [loss: an assistant's CONTENT and its <|im_end|>] — Qwen2 / Qwen2.5 without their
//            default system line.
//   mistral  <s>, then per user/assistant pair: "[INST] " USER " [/INST]" ASSISTANT </s>
//            (Mistral's BOS and EOS pieces, written as text: a built-in reads no tokenizer
//            files), a leading system message put before the first user's text as
//            SYSTEM "\n\n" USER;
//            roles must alternate user, assistant, ... (raise_exception otherwise)
//            [loss: ASSISTANT and its eos_token] — Mistral-7B-Instruct-v0.1 / v0.2.
//   none     no template: the BOS id when the tokenizer has one, then each message's CONTENT,
//            each assistant's followed by the EOS id [loss: an assistant's CONTENT and its EOS];
//            each content encoded on its own (the byte-level models' instruction format).
//
// Thread-safety: a ChatFormat is immutable once resolved and may be shared by threads (the
// template's Render is const).
#pragma once

#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "base/status.h"
#include "data/chat_template.h"

namespace strata::data {

enum class ChatTemplate { kNone, kLlama3, kChatml, kMistral, kJinja };

// "none", "llama3", "chatml", "mistral", "jinja" (the model's own or a file's).
std::string_view ChatTemplateName(ChatTemplate kind);

// The Jinja text of a built-in template (llama3, chatml, mistral; see above); empty for the
// others.
std::string_view BuiltinChatTemplate(ChatTemplate kind);

struct ChatFormat {
  ChatTemplate kind = ChatTemplate::kNone;
  // How it was chosen, for the output line ("named", "chat_template of
  // 'dir/tokenizer_config.json'",
  // "'dir/chat_template.jinja'", "no chat_template beside 'dir/tokenizer.json'").
  std::string source;
  // Every kind but kNone: the parsed template (shared: a ChatFormat is copied freely).
  std::shared_ptr<const JinjaTemplate> jinja;
  // The template's variables besides messages, add_generation_prompt and tools, as transformers
  // passes them: bos_token, eos_token, unk_token, pad_token (tokenizer_config.json's, else the
  // tokenizer's BOS/EOS pieces), then the --chat-template-kwargs object's keys (which win).
  nlohmann::ordered_json variables = nlohmann::ordered_json::object();
  // strftime_now's clock for every render made with this format (ChatRenderOptions::now): read
  // once when it is resolved, so that the prefix renders that find an example's loss spans, and
  // both sides of a preference pair, show the same time (a clock that ticked between them put a
  // prompt in the loss).
  std::time_t now = 0;
};

// The format `name` names, for the tokenizer at `tokenizer_path` (a tokenizer.json,
// tokenizer.model or a directory holding one; its directory is where tokenizer_config.json and
// chat_template.jinja are looked for):
//   "auto"   the model's own template: chat_template.jinja in that directory, else
//            tokenizer_config.json's chat_template (a string, or the entry named "default" of a
//            list of {"name", "template"}); none when neither exists (or it is null);
//   "llama3", "chatml", "mistral"  the built-in template; "none" no template (neither reads the
//            model's files: the variables are the kwargs alone);
//   anything else  a path to a Jinja template file (a name with a '/' or ending in ".jinja").
// kwargs_json: "" or a JSON object whose keys become template variables (Qwen3's
// {"enable_thinking": false}).
// Errors (one line, naming the file and, for a template, the line in it): kInvalidArgument for
// an unknown name, a tokenizer_config.json that is not a JSON object or whose chat_template is
// neither a string nor such a list, a template the engine cannot parse (JinjaTemplate::Parse),
// kwargs that are not a JSON object; the errno-mapped code of reading a file.
StatusOr<ChatFormat> ResolveChatFormat(std::string_view name, const std::string& tokenizer_path,
                                       std::string_view kwargs_json = "");

}  // namespace strata::data
