// Preference data -> tokens with per-token flags (data/token_dataset.h): TRL's preference
// formats (JSON lines of a prompt and a chosen and a rejected completion), each pair written as
// two examples, its chosen side then its rejected side, for DPO-style training
// (data/preference_dataset.h reads them back as pairs).
//
// Input, one JSON object per line (blank lines skipped), in one of TRL's three forms:
//   standard        {"prompt": "...", "chosen": "...", "rejected": "..."}, optional
//                   "system": "..."; each side is the messages system (if given), user prompt,
//                   assistant completion, as instruction data reads prompt/response
//   conversational  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
//                   (a side usually one assistant message); optional "system": "..." is put
//                   before the prompt's messages when they hold no system message
//   implicit prompt {"chosen": [messages], "rejected": [messages]} without "prompt": the prompt
//                   is the longest run of whole messages both begin with (TRL's extract_prompt);
//                   it must leave each side at least one message
// Messages are instruction data's (data/instruction_data.h: a role string, a content string or,
// for an assistant message with "tool_calls", none); optional "tools": [...] reaches the
// template on both sides. A completion (a side's own messages, after the prompt) needs an
// assistant message, and every assistant message of it a content holding a non-whitespace
// character (Python's str.isspace()) or tool calls.
//
// Each side, the prompt's messages followed by the side's own, is rendered with the chat template
// as instruction data renders a conversation (data/chat_render.h), except that only the side's
// own assistant messages count in the loss: assistant turns inside the prompt (earlier turns of a
// conversation) are context, as TRL's DPO trainer has them; and the text before the completion is
// encoded apart from the rest (PromptEncoding::kApart), as TRL's DPO trainer encodes prompt and
// completions, so both sides share the prompt's tokens.
//
// Flags: kTokenFlagInLoss on the completion's tokens in the loss; the chosen side's first token
// kTokenFlagExampleStart | kTokenFlagPairStart; the rejected side's first token
// kTokenFlagExampleStart. The file holds pair after pair in line order: chosen, rejected,
// chosen, rejected, ...
//
// Thread-safety: plain functions; the tokenizer and the format are only read (by several threads
// in TokenizePreferenceFile).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "data/chat_format.h"
#include "data/instruction_data.h"
#include "data/tokenizer.h"

namespace strata::data {

// One line's pair: each side's whole conversation (the prompt's messages, then the side's own),
// and the line's "tools" on both (null when it has none).
struct PreferencePair {
  InstructionExample chosen;
  InstructionExample rejected;
  // How many leading messages of each side are the prompt (the same messages on both sides,
  // the system message put in by "system" included); the loss counts the assistant messages
  // from this index on.
  size_t prompt_messages = 0;
};

// The pair of one JSON line (see the input above). Errors (kInvalidArgument, one line without the
// file and line number: the caller adds them): not JSON, not an object; no "chosen" or no
// "rejected" ("no \"rejected\""); a line of instruction data ("messages" or "response" without
// "chosen"); "prompt", "chosen" or "rejected" neither a string nor a list, or "system" not a
// string, "tools" not a list; strings and lists of messages mixed within the line; no "prompt"
// with string sides; a message as instruction data refuses it; an implicit prompt that leaves a
// side without a message; a completion without messages, with a blank assistant message or
// without an assistant message ("the chosen completion is empty ...").
StatusOr<PreferencePair> ParsePreferenceLine(std::string_view line);

struct RenderedPair {
  RenderedExample chosen;
  RenderedExample rejected;
};

// Renders both sides of `pair` with `format` (the rules are instruction_data.h's; the loss from
// pair.prompt_messages on) and flags them (above). Errors: RenderExample's; kInvalidArgument for
// a side none of whose tokens after its first is in the loss (a target, predicted from the tokens
// before it: "the rejected completion renders to no token in the loss").
StatusOr<RenderedPair> RenderPreferencePair(const ChatFormat& format, const Tokenizer& tokenizer,
                                            const PreferencePair& pair);

// A whole JSONL file, its pairs one after another (each chosen side, then its rejected side).
struct PreferenceTokens {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;  // kTokenFlag* bits, one per token
  int64_t pairs = 0;
  int64_t tokens_in_loss = 0;  // tokens with kTokenFlagInLoss, both sides
};

// Reads `jsonl_path` and renders every line, `threads` lines at a time (0: one per core; oneTBB
// inside): the result is the same whatever the number, the pairs in line order. Errors: the
// first line's in line order, one line naming the file and line number ("'prefs.jsonl' line 4:
// no \"rejected\""): ParsePreferenceLine's and RenderPreferencePair's; the errno-mapped code of
// reading the file; kInvalidArgument for a file without pairs.
StatusOr<PreferenceTokens> TokenizePreferenceFile(const Tokenizer& tokenizer,
                                                  const ChatFormat& format,
                                                  const std::string& jsonl_path, int threads = 0);

// Whether the JSONL file at `jsonl_path` is preference data rather than instruction data: its
// first non-blank line is a JSON object with "chosen" (a line that is not one says instruction
// data, whose reader then names it). Reads up to that line only. Errors: the errno-mapped code
// of opening or reading the file (a FIFO or a device is refused without being opened).
StatusOr<bool> IsPreferenceFile(const std::string& jsonl_path);

}  // namespace strata::data
