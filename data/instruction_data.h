// Instruction data -> tokens with per-token flags (data/token_dataset.h): JSON lines of
// prompt/response pairs or chat messages, rendered with a chat template, and the mask that says
// which tokens the loss counts (the responses) and where each example starts.
//
// Input, one JSON object per line (blank lines skipped):
//   {"prompt": "...", "response": "..."}            optional "system": "..."; read as the
//                                                    messages system (if given), user, assistant
//   {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
// Every assistant content must hold a non-whitespace character (Python's str.isspace()), and an
// example needs one.
//
// Templates, by name (the literal strings; <|x|> in angle brackets with bars, <s>, </s> and
// [INST] are vocabulary entries emitted as their id through Tokenizer::TokenId; everything else
// is text, encoded piece by piece with Tokenizer::Encode; [loss] marks what counts in the loss):
//   llama3   <|begin_of_text|>, then per message:
//              <|start_header_id|> ROLE <|end_header_id|> "\n\n" CONTENT <|eot_id|>
//            with CONTENT trimmed of leading and trailing whitespace as the template's `| trim`
//            does (Python's str.strip(): Unicode whitespace such as U+3000 and U+00A0 too);
//            [loss] an assistant's CONTENT and its <|eot_id|>. As Meta-Llama-3-*-Instruct.
//   chatml   per message: <|im_start|> ROLE "\n" CONTENT <|im_end|> "\n"
//            preceded, when the first message is not a system message and the format has a
//            default system line (auto only: from the template text), by that system message;
//            no BOS. [loss] an assistant's CONTENT and its <|im_end|>. As Qwen2 / Qwen2.5.
//   mistral  <s>, then per user/assistant pair:
//              "[INST] " USER " [/INST]" ASSISTANT </s>
//            roles must alternate user, assistant, ... from a user; a leading system message is
//            put before the first user's text as SYSTEM "\n\n" USER. When the tokenizer has
//            "[INST]" and "[/INST]" as vocabulary entries (Mistral's v3 tokenizers) they are
//            emitted as ids and " " USER " " encoded between them. [loss] ASSISTANT and its </s>.
//            As Mistral-7B-Instruct-v0.1 / v0.2.
//   none     the BOS id when the tokenizer has one, then every message's CONTENT in order, each
//            assistant's followed by the EOS id when the tokenizer has one. [loss] an
//            assistant's CONTENT and its EOS. For prompt/response: BOS PROMPT RESPONSE EOS.
// Each text piece is encoded on its own, so a prompt and a response never share a token (a
// SentencePiece model's dummy-prefix space starts each piece).
//
// Flags: kTokenFlagInLoss on the tokens marked [loss] (each is a target predicted from the
// tokens before it in its example); kTokenFlagExampleStart on each example's first token.
//
// Thread-safety: plain functions; the tokenizer is only read.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "data/tokenizer.h"

namespace strata::data {

enum class ChatTemplate { kNone, kLlama3, kChatml, kMistral };

// "none", "llama3", "chatml", "mistral".
std::string_view ChatTemplateName(ChatTemplate kind);

// How examples are rendered.
struct ChatFormat {
  ChatTemplate kind = ChatTemplate::kNone;
  // chatml: the content of the system message rendered when an example has none; empty: none.
  std::string default_system;
  // How it was chosen, for the output line (e.g. "named", "chat_template of
  // 'dir/tokenizer_config.json'", "no tokenizer_config.json in 'dir'").
  std::string source;
};

// The family of a Jinja chat template (tokenizer_config.json's chat_template), recognised by
// each family's literal pieces: "<|start_header_id|>" and "<|eot_id|>" (llama3), "<|im_start|>"
// and "<|im_end|>" (chatml; a default system line is taken from a literal
// "<|im_start|>system\n...<|im_end|>" in the text), "[INST]" and " [/INST]" (mistral).
// `where` names the file in errors. Errors: kInvalidArgument "<where>'s chat_template is not
// one Strata renders (llama3, chatml, mistral)...: give --chat-template NAME or none" for no
// family, several, or one it cannot render faithfully (Llama 3.1's dated system preamble,
// ChatML with <think> reasoning, Llama 2's <<SYS>>, Mistral v0.3's "[/INST]" without a space).
StatusOr<ChatFormat> ChatFormatFromJinja(std::string_view jinja, std::string_view where);

// The format named `name`: "llama3", "chatml", "mistral", "none" (as named: chatml without a
// default system line), or "auto": tokenizer_config.json in the tokenizer's directory
// (`tokenizer_path` itself when it is a directory, else its parent) through ChatFormatFromJinja;
// no such file, or one without a chat_template (or a null one) -> none. A chat_template that is
// a list of {"name", "template"} uses the one named "default".
// Errors: kInvalidArgument for an unknown name, a tokenizer_config.json that is not JSON or
// whose chat_template is neither a string nor such a list, and ChatFormatFromJinja's; the
// errno-mapped code of reading the file.
StatusOr<ChatFormat> ResolveChatFormat(std::string_view name, const std::string& tokenizer_path);

enum class ChatRole { kSystem, kUser, kAssistant };

struct ChatMessage {
  ChatRole role = ChatRole::kUser;
  std::string content;  // UTF-8
};

// The messages of one JSON line (see the input above). Errors (kInvalidArgument, without the
// file and line: the caller adds them): not JSON, not an object, neither "messages" nor
// "prompt" and "response", a value that is not a string, an unknown role, an empty response or
// assistant content, no assistant message.
StatusOr<std::vector<ChatMessage>> ParseInstructionLine(std::string_view line);

// One example: tokens and their flags, the same length.
struct RenderedExample {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;  // kTokenFlag* bits
};

// Renders `messages` with `format` (see the templates above). Errors: kInvalidArgument for a
// special token the tokenizer lacks (naming it and the template), for mistral roles out of
// order; Encode's.
StatusOr<RenderedExample> RenderExample(const ChatFormat& format, const Tokenizer& tokenizer,
                                        std::span<const ChatMessage> messages);

// A whole JSONL file, its examples one after another.
struct InstructionTokens {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;
  int64_t examples = 0;
  int64_t tokens_in_loss = 0;  // tokens with kTokenFlagInLoss
};

// Reads `jsonl_path` and renders every line. Errors: each one line naming the file and line
// number ("'train.jsonl' line 7: ..."): ParseInstructionLine's and RenderExample's; the
// errno-mapped code of reading the file; kInvalidArgument for a file without examples.
StatusOr<InstructionTokens> TokenizeInstructionFile(const Tokenizer& tokenizer,
                                                    const ChatFormat& format,
                                                    const std::string& jsonl_path);

}  // namespace strata::data
