// Instruction data -> tokens with per-token flags (data/token_dataset.h): JSON lines of
// prompt/response pairs or chat conversations, rendered with a chat template (chat_format.h),
// and the mask that says which tokens the loss counts (the assistant turns) and where each
// example starts.
//
// Input, one JSON object per line (blank lines skipped):
//   {"prompt": "...", "response": "..."}            optional "system": "..."; read as the
//                                                    messages system (if given), user, assistant
//   {"messages": [{"role": "...", "content": "..."}, ...]}  optional "tools": [...]
// A role is any string (the template decides which it takes; `none` takes system, user and
// assistant); a content is a string, or absent or null for an assistant message with
// "tool_calls". Every other key of a message (tool_calls, reasoning_content, name, ...) reaches
// the template as it is, in the line's key order. An example needs an assistant message, and
// every assistant message needs a content holding a non-whitespace character (Python's
// str.isspace()) or tool calls.
//
// A template renders the whole conversation once (the variables of ChatFormat::variables,
// messages, tools when the line has them, add_generation_prompt false) and the string is encoded
// whole with Tokenizer::EncodeWithOffsets, as transformers' apply_chat_template(tokenize=True)
// does: with add_special_tokens=False, so the BOS is the template's own (one, where it writes
// bos_token). A special token the tokenizer's Encode would not make from its text (a
// SentencePiece model's control symbols <s>, </s>) is cut out of the string and given its id.
//
// The loss takes the characters of the assistant turns:
//   * a template with {% generation %} blocks: the characters written inside them (TRL's and
//     transformers' assistant masks);
//   * otherwise, per assistant message k, by rendering prefixes. P = messages [0, k) rendered
//     with add_generation_prompt, T = messages [0, k] rendered without it, W = the whole
//     conversation. Where P is a prefix of T (the usual case), the turn's text is T past P,
//     trailing whitespace removed (the newline a template writes after an end-of-turn token is
//     not generated); where W begins with P, it starts after P (not before the previous turn's
//     end) and ends after that text where W holds it there, else
//     after that text less its tail where W holds that there (the tail: the longest suffix of
//     the template rendered with no messages that T and W both end with, what it writes after
//     the last message only: Phi-3's eos_token), else after the longest suffix of it W holds
//     from the start on (a template that renders a turn
//     differently once later turns follow, as Qwen3 drops the reasoning of earlier turns); where
//     W does not begin with P (Mistral writes the tools before the last user message only), the
//     span is the longest suffix of the turn's text W holds after the previous turn, begun where
//     W shows message k's content when that is earlier (W rendered with that content "\x01", see
//     below: Qwen3 strips a last turn's leading newlines, which W keeps in an earlier turn). Where
//     P is not a prefix of T (the template renders the messages before the turn differently
//     once the turn follows: Mistral v3 moves the system message into the last user message;
//     or its generation prompt is not how a turn begins: DeepSeek-R1's "<think>\n"), the turn's
//     text is T past its common prefix with T rendered with message k's content "\x01" (a
//     content no template writes, so that a content's first bytes are never taken for the
//     template's), or where that leaves nothing (tool calls alone) with message k as a plain
//     answer of that content, whitespace-trimmed at its end, and the span is the longest suffix
//     of it W holds after the previous turn. A turn found nowhere is an error naming the
//     message. (So what a template writes between a turn and the next message without a
//     generation prompt, a role header, or after the last message, counts as generated for the
//     last turn; the published templates put their role headers in the generation prompt.)
// A token is in the loss when any byte of its source (EncodeWithOffsets) lies in an assistant
// span: a token straddling a span's edge is a target, since the model must produce it there.
// `none` (no template) encodes each content on its own: see chat_format.h.
//
// Flags: kTokenFlagInLoss on the tokens in the loss (each a target predicted from the tokens
// before it in its example); kTokenFlagExampleStart on each example's first token.
//
// The renderer and the threaded JSONL reader are data/chat_render.h's, shared with preference
// data (data/preference_data.h).
//
// Thread-safety: plain functions; the tokenizer and the format are only read (by several threads
// in TokenizeInstructionFile).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "data/chat_format.h"
#include "data/tokenizer.h"

namespace strata::data {

// One line's conversation: a JSON array of message objects, and the line's "tools" (null when it
// has none).
struct InstructionExample {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  nlohmann::ordered_json tools;
};

// The conversation of one JSON line (see the input above). Errors (kInvalidArgument, without
// the file and line: the caller adds them): not JSON, not an object, neither "messages" nor
// "prompt" and "response", a message that is not an object or has no string role, a content
// that is not a string (or null with tool calls), an empty assistant content, no assistant
// message.
StatusOr<InstructionExample> ParseInstructionLine(std::string_view line);

// One example: tokens and their flags, the same length.
struct RenderedExample {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;  // kTokenFlag* bits
};

// Renders `example` with `format` (above). Errors: kInvalidArgument for the template's
// (raise_exception's message, naming the template and its line), for an assistant turn found
// nowhere in the rendering, for roles `none` does not take; kResourceExhausted for a rendering
// past the engine's limits; EncodeWithOffsets'.
StatusOr<RenderedExample> RenderExample(const ChatFormat& format, const Tokenizer& tokenizer,
                                        const InstructionExample& example);

// A whole JSONL file, its examples one after another.
struct InstructionTokens {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;
  int64_t examples = 0;
  int64_t tokens_in_loss = 0;  // tokens with kTokenFlagInLoss
};

// Reads `jsonl_path` and renders every line, `threads` lines at a time (0: one per core; oneTBB
// inside): the result is the same whatever the number, the examples in line order. Errors: the
// first line's in line order, one line naming the file and line number ("'train.jsonl' line 7:
// ..."): ParseInstructionLine's and RenderExample's; the errno-mapped code of reading the file;
// kInvalidArgument for a file without examples.
StatusOr<InstructionTokens> TokenizeInstructionFile(const Tokenizer& tokenizer,
                                                    const ChatFormat& format,
                                                    const std::string& jsonl_path, int threads = 0);

}  // namespace strata::data
