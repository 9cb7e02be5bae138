// What instruction data (data/instruction_data.h) and preference data (data/preference_data.h)
// share: the checks of a conversation's messages, the rendering of a conversation with a chat
// template into tokens with flags (the rules are instruction_data.h's), and the JSONL reader that
// renders a file's lines on several threads and appends them in line order.
//
// Thread-safety: the functions only read the tokenizer and the format; an ExampleEncoder belongs
// to one thread at a time (TokenizeJsonlLines keeps one per thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "data/chat_format.h"
#include "data/instruction_data.h"
#include "data/tokenizer.h"

namespace strata::data {

// Whether `s` holds no character but whitespace as Python's str.isspace() defines it (ASCII
// \t \n \v \f \r and space, U+001C..U+001F, U+0085, U+00A0, U+1680, U+2000..U+200A, U+2028,
// U+2029, U+202F, U+205F, U+3000): what Jinja's `| trim` leaves empty.
bool IsBlankText(std::string_view s);

// `s` without ASCII whitespace at either end: what a blank JSON line is.
std::string_view TrimAsciiSpace(std::string_view s);

// One JSON line parsed, keeping each object's keys in order; values nested deeper than
// kMaxJsonDepth (base/untrusted_text.h) are discarded as they are met, so nothing deep is built.
// Errors: kInvalidArgument "not valid JSON" (or "... (nested deeper than 64 levels, the limit)"),
// without the file and line.
StatusOr<nlohmann::ordered_json> ParseJsonLine(std::string_view line);

// What CheckMessage found.
struct MessageKind {
  bool assistant = false;
  // An assistant message with neither a content holding a non-whitespace character nor tool
  // calls: an empty response.
  bool empty_assistant = false;
};

// Checks one message of a conversation (instruction_data.h's input): an object with a "role"
// string and a "content" string, the content absent or null only for an assistant message with
// "tool_calls". `what` names the message in errors ("message 2", "message 0 of \"chosen\"").
// Errors: kInvalidArgument, one line without the file and line.
StatusOr<MessageKind> CheckMessage(const nlohmann::ordered_json& m, std::string_view what);

// A {"role": role, "content": content} message.
nlohmann::ordered_json ChatMessage(std::string_view role, std::string content);

// What rendering a run of examples with one format and tokenizer keeps: the special tokens cut
// out of a rendering (instruction_data.h) and the tokenizer's encode cache. One per thread.
class ExampleEncoder {
 public:
  ExampleEncoder(const ChatFormat& format, const Tokenizer& tokenizer);
  ~ExampleEncoder();
  ExampleEncoder(ExampleEncoder&&) noexcept;
  ExampleEncoder& operator=(ExampleEncoder&&) noexcept;

  struct SpecialCut {
    std::string text;
    int32_t id = 0;
  };
  const std::vector<SpecialCut>& cuts() const { return cuts_; }
  EncodeCache* cache() const { return cache_.get(); }

 private:
  std::vector<SpecialCut> cuts_;
  std::unique_ptr<EncodeCache> cache_;
};

// How a rendered conversation's text becomes tokens.
enum class PromptEncoding {
  // The whole text at once (instruction data: TRL's SFTTrainer encodes the conversation whole).
  kWhole,
  // The text before the first counted span (the prompt and the generation prompt) encoded on its
  // own, then the rest: a preference pair's prompt is then the same tokens on both sides and no
  // token of it is in the loss, as TRL's DPOTrainer encodes prompt and completions apart. A
  // template that writes the completion right after the prompt's text (no special token or
  // newline between) would otherwise let BPE merge across the boundary.
  kApart,
};

// Renders `example` as RenderExample does (instruction_data.h), except that only the assistant
// messages at index first_loss_message or later count in the loss (a preference pair's
// completion after its prompt; 0: every assistant message), its text encoded as
// `prompt_encoding` says (the none template encodes each content apart anyway). `encoder` was
// made for `format` and `tokenizer`. Errors: RenderExample's, and kInvalidArgument for an
// example without messages.
StatusOr<RenderedExample> RenderConversation(
    const ChatFormat& format, const Tokenizer& tokenizer, InstructionExample example,
    size_t first_loss_message, ExampleEncoder& encoder,
    PromptEncoding prompt_encoding = PromptEncoding::kWhole);

// A JSONL file's lines rendered, one after another.
struct JsonlTokens {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;  // kTokenFlag* bits, one per token
  int64_t lines = 0;           // non-blank lines rendered
  int64_t examples = 0;        // rendered examples (a line may give several)
  int64_t tokens_in_loss = 0;  // tokens with kTokenFlagInLoss
};

// One non-blank line (without its newline) rendered into its examples, in order, with the
// calling thread's encoder; an error is one line without the file and line number.
using RenderJsonlLine =
    std::function<StatusOr<std::vector<RenderedExample>>(std::string_view line, ExampleEncoder&)>;

// Reads `jsonl_path` and renders every non-blank line with `render`, `threads` lines at a time
// (0: one per core; oneTBB inside): the result is the same whatever the number, the lines'
// examples in line order. `what` names the data in errors ("instruction data"). Errors: the
// first line's in line order, prefixed "'<path>' line N: "; the errno-mapped code of opening or
// reading the file (a FIFO or a device is refused without being opened). A file without a
// non-blank line gives no tokens (lines == 0): the caller decides.
StatusOr<JsonlTokens> TokenizeJsonlLines(const ChatFormat& format, const Tokenizer& tokenizer,
                                         const std::string& jsonl_path, std::string_view what,
                                         int threads, const RenderJsonlLine& render);

}  // namespace strata::data
