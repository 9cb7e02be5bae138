#include "data/chat_render.h"

#include <fmt/format.h>
#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <optional>
#include <utility>

#include "base/file.h"
#include "base/untrusted_text.h"
#include "data/token_dataset.h"

namespace strata::data {
namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kWhitespace = " \t\n\r\f\v";

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

// A message's content as a string: absent or null only for an assistant with tool calls ("").
StatusOr<std::string_view> Content(const ojson& m, std::string_view role, std::string_view what,
                                   bool tool_calls) {
  const auto it = m.find("content");
  if (it == m.end() || it->is_null()) {
    if (role == "assistant" && tool_calls) return std::string_view();
    return InvalidArgumentError(fmt::format("{} has no \"content\" string", what));
  }
  if (!it->is_string()) {
    return InvalidArgumentError(fmt::format("{}'s \"content\" is not a string", what));
  }
  return std::string_view(it->get_ref<const std::string&>());
}

// [begin, end) byte ranges of the rendered text that the loss takes.
using Span = std::pair<size_t, size_t>;

// A content no template writes itself and no text begins with: where a turn rendered with it
// parts from the turn rendered with the real content is where the content starts.
constexpr std::string_view kContentMark = "\x01";

size_t CommonPrefix(std::string_view a, std::string_view b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

std::string_view TrimTrailingAsciiSpace(std::string_view s) {
  return s.substr(0, s.find_last_not_of(" \t\n\r") + 1);  // npos + 1 == 0: all blank
}

// One example's renders: the context (the format's variables, the messages, the tools) built
// once, the messages moved in; a prefix render holds the later messages aside and puts them back.
class TemplateRenderer {
 public:
  TemplateRenderer(const ChatFormat& format, InstructionExample example)
      : format_(format), context_(format.variables) {
    num_messages_ = example.messages.size();
    roles_.reserve(num_messages_);
    for (const ojson& m : example.messages) roles_.push_back(m["role"] == "assistant");
    context_["messages"] = std::move(example.messages);
    // As transformers' apply_chat_template passes them: always defined, None when not given
    // (a template's `tools is defined` is true, `tools is not none` false).
    context_["tools"] = std::move(example.tools);
    context_["documents"] = nullptr;
    context_["add_generation_prompt"] = false;
  }

  // Whether a message before `k` is an assistant's.
  bool AssistantBefore(size_t k) const {
    for (size_t i = 0; i < k && i < num_messages_; ++i) {
      if (roles_[i]) return true;
    }
    return false;
  }

  StatusOr<std::string> Render(size_t num_messages, bool add_generation_prompt,
                               std::vector<Span>* generation) {
    KeepMessages(num_messages);
    context_["add_generation_prompt"] = add_generation_prompt;
    STRATA_ASSIGN_OR_RETURN(RenderedChat r,
                            format_.jinja->Render(context_, ChatRenderOptions{.now = format_.now}));
    if (generation != nullptr) *generation = std::move(r.generation_spans);
    return std::move(r.text);
  }

  // The spans of `whole` of the assistant messages from first_loss_message on, by prefix
  // renders (instruction_data.h).
  StatusOr<std::vector<Span>> SpansFromPrefixes(const std::string& whole,
                                                size_t first_loss_message) {
    std::vector<Span> spans;
    size_t from = 0;
    for (size_t k = first_loss_message; k < num_messages_; ++k) {
      if (!roles_[k]) continue;
      STRATA_ASSIGN_OR_RETURN(const std::string prompt, Render(k, true, nullptr));
      STRATA_ASSIGN_OR_RETURN(const std::string turn, Render(k + 1, false, nullptr));
      size_t turn_start = CommonPrefix(prompt, turn);
      const bool agrees = turn_start == prompt.size();
      if (!agrees) {
        // The template renders the messages before the turn differently once the turn follows
        // (Mistral v3 moves the system message into the last user message), or its generation
        // prompt is not how a turn begins (DeepSeek-R1's "<think>\n"): the turn starts where
        // its own content does, where it parts from the turn rendered with a content no
        // template writes (an empty one lost a content's first bytes when they equal what
        // follows the content, the '<' of "<b>" before "<|end|>"). A turn that does not show its
        // content (a tool call alone) starts where it parts from the same turn as a plain answer
        // (its tool calls left out), so that what the template writes for the calls
        // ("[TOOL_CALLS]") is the model's to learn.
        STRATA_ASSIGN_OR_RETURN(std::string marked,
                                RenderWithContent(k, kContentMark, false, k + 1));
        turn_start = CommonPrefix(turn, marked);
        if (turn_start == turn.size()) {
          STRATA_ASSIGN_OR_RETURN(marked, RenderWithContent(k, kContentMark, true, k + 1));
          turn_start = CommonPrefix(turn, marked);
        }
      }
      const std::string_view text =
          TrimTrailingAsciiSpace(std::string_view(turn).substr(turn_start));
      // Whether the whole conversation begins with the prompt: a template that writes something
      // before the last user message only (Mistral's tools) renders the earlier turns' prompts
      // otherwise there, and their turns are then found by their text, not after the prompt.
      const size_t prompt_in_whole = CommonPrefix(whole, prompt);
      const bool in_place = agrees && prompt_in_whole == prompt.size();
      size_t start = std::max(from, prompt_in_whole), end = start;
      const std::string_view at_start = std::string_view(whole).substr(start);
      // The turn rendered as the last message may end with what the template writes after the
      // last message only (Phi-3's eos_token when no generation prompt follows), which the whole
      // conversation has at its end, after its own last message: then the turn is the rest.
      std::string_view before_tail;
      if (in_place && !at_start.starts_with(text)) {
        before_tail = text.substr(0, text.size() - TailOf(text, whole).size());
      }
      if (in_place && at_start.starts_with(text)) {
        end = start + text.size();
      } else if (in_place && !before_tail.empty() && before_tail.size() < text.size() &&
                 at_start.starts_with(before_tail)) {
        end = start + TrimTrailingAsciiSpace(before_tail).size();
      } else {
        // The longest suffix of the turn's text found from where the prompt stops agreeing (or,
        // where it does not agree, from the previous turn's end) on: whether a suffix of length
        // n occurs is monotone in n (a suffix of an occurring string occurs).
        const size_t search = in_place ? start : from;
        size_t lo = 0, hi = text.size(), at = std::string::npos;
        while (lo < hi) {
          const size_t n = (lo + hi + 1) / 2;
          if (const size_t pos = whole.find(text.substr(text.size() - n), search);
              pos != std::string::npos) {
            lo = n;
            at = pos;
          } else {
            hi = n - 1;
          }
        }
        if (lo == 0) {
          return InvalidArgumentError(fmt::format(
              "message {} (assistant) is found nowhere in the conversation {} renders: give the "
              "template {{% generation %}} blocks or choose --chat-template",
              k, format_.jinja->where()));
        }
        // Where the prompt is in place, the turn starts after it; elsewhere at its own text, or
        // where the prompt agrees with the turn, where the conversation shows the turn's content,
        // when that is before the text found (Qwen3 strips the leading newlines of a last turn's
        // content, the whole conversation keeps them in an earlier turn).
        if (!in_place) {
          start = at;
          if (agrees) {
            STRATA_ASSIGN_OR_RETURN(const std::string marked,
                                    RenderWithContent(k, kContentMark, false, num_messages_));
            start = std::min(at, std::max(from, CommonPrefix(whole, marked)));
          }
        }
        end = at + lo;
      }
      spans.push_back({start, end});
      from = end;
    }
    return spans;
  }

  // The longest suffix of what the template writes for no messages and no generation prompt
  // (its text after the last message, Phi-3's eos_token; before the first, a BOS) that both
  // `turn` and `whole` end with; "" when there is none or the template fails without messages.
  std::string_view TailOf(std::string_view turn, std::string_view whole) {
    if (!empty_render_) {
      auto r = Render(0, false, nullptr);
      empty_render_ = r.ok() ? std::move(*r) : std::string();
    }
    std::string_view tail = *empty_render_;
    while (!tail.empty() && !(turn.ends_with(tail) && whole.ends_with(tail))) {
      tail.remove_prefix(1);
    }
    return tail;
  }

  // Messages [0, num_messages) (num_messages > k) with message k's content `content_text` (its
  // other fields kept, but its tool calls when drop_tool_calls).
  StatusOr<std::string> RenderWithContent(size_t k, std::string_view content_text,
                                          bool drop_tool_calls, size_t num_messages) {
    KeepMessages(num_messages);
    ojson& message = context_["messages"][k];
    const ojson saved = message;
    message["content"] = content_text;
    if (drop_tool_calls) message.erase("tool_calls");
    auto r = Render(num_messages, false, nullptr);
    context_["messages"][k] = saved;
    return r;
  }

 private:
  // The context's messages become [0, n): the later ones set aside, or put back.
  void KeepMessages(size_t n) {
    auto& messages = context_["messages"].get_ref<ojson::array_t&>();
    while (messages.size() > n) {
      aside_.push_back(std::move(messages.back()));
      messages.pop_back();
    }
    while (messages.size() < n) {
      messages.push_back(std::move(aside_.back()));
      aside_.pop_back();
    }
  }

  const ChatFormat& format_;
  ojson context_;
  size_t num_messages_ = 0;
  std::vector<bool> roles_;                  // per message: an assistant's
  std::vector<ojson> aside_;                 // the messages a prefix render leaves out, last first
  std::optional<std::string> empty_render_;  // Render(0, false): TailOf's, made once
};

using SpecialCut = ExampleEncoder::SpecialCut;

// The special tokens the template may write that the tokenizer's Encode would not make from their
// text (a SentencePiece model's control symbols): cut out of the rendering and given their ids.
std::vector<SpecialCut> SpecialCuts(const ChatFormat& format, const Tokenizer& tokenizer) {
  std::vector<std::string> candidates;
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    const auto it = format.variables.find(key);
    if (it != format.variables.end() && it->is_string()) candidates.push_back(*it);
  }
  if (format.kind == ChatTemplate::kMistral) candidates.insert(candidates.end(), {"<s>", "</s>"});
  std::vector<SpecialCut> cuts;
  for (const std::string& c : candidates) {
    const int id = tokenizer.TokenId(c);
    if (c.empty() || id < 0) continue;
    auto ids = tokenizer.Encode(c);
    if (ids.ok() && ids->size() == 1 && (*ids)[0] == id) continue;  // Encode makes it
    cuts.push_back({c, id});
  }
  return cuts;
}

// EncodeWithOffsets of `text`, with the special cuts given their ids; spans into `text`.
StatusOr<EncodedText> EncodeRendered(const Tokenizer& tokenizer, std::string_view text,
                                     const std::vector<SpecialCut>& cuts, EncodeCache* cache) {
  if (cuts.empty()) return tokenizer.EncodeWithOffsets(text, cache);
  EncodedText out;
  size_t at = 0;
  auto encode_until = [&](size_t end) -> Status {
    if (end == at) return Status::Ok();
    STRATA_ASSIGN_OR_RETURN(EncodedText part,
                            tokenizer.EncodeWithOffsets(text.substr(at, end - at), cache));
    for (size_t i = 0; i < part.ids.size(); ++i) {
      out.ids.push_back(part.ids[i]);
      out.spans.push_back({part.spans[i].begin + at, part.spans[i].end + at});
    }
    return Status::Ok();
  };
  while (at < text.size()) {
    size_t next = std::string_view::npos;
    const SpecialCut* cut = nullptr;
    for (const SpecialCut& c : cuts) {
      const size_t pos = text.find(c.text, at);
      if (pos < next || (pos == next && cut != nullptr && c.text.size() > cut->text.size())) {
        next = pos;
        cut = &c;
      }
    }
    if (cut == nullptr) break;
    STRATA_RETURN_IF_ERROR(encode_until(next));
    out.ids.push_back(cut->id);
    out.spans.push_back({next, next + cut->text.size()});
    at = next + cut->text.size();
  }
  STRATA_RETURN_IF_ERROR(encode_until(text.size()));
  return out;
}

}  // namespace

ExampleEncoder::ExampleEncoder(const ChatFormat& format, const Tokenizer& tokenizer)
    : cuts_(SpecialCuts(format, tokenizer)), cache_(tokenizer.NewEncodeCache()) {}
ExampleEncoder::~ExampleEncoder() = default;
ExampleEncoder::ExampleEncoder(ExampleEncoder&&) noexcept = default;
ExampleEncoder& ExampleEncoder::operator=(ExampleEncoder&&) noexcept = default;

namespace {

StatusOr<RenderedExample> RenderTemplate(const ChatFormat& format, const Tokenizer& tokenizer,
                                         InstructionExample example, size_t first_loss_message,
                                         ExampleEncoder& encoder, PromptEncoding prompt_encoding) {
  const size_t num_messages = example.messages.size();
  TemplateRenderer renderer(format, std::move(example));
  std::vector<Span> spans;
  STRATA_ASSIGN_OR_RETURN(const std::string whole, renderer.Render(num_messages, false, &spans));
  if (!format.jinja->has_generation_blocks()) {
    STRATA_ASSIGN_OR_RETURN(spans, renderer.SpansFromPrefixes(whole, first_loss_message));
  } else if (renderer.AssistantBefore(first_loss_message)) {
    // The generation blocks of the assistant turns before first_loss_message do not count: the
    // counted turns start where the whole rendering stops agreeing with messages
    // [0, first_loss_message) rendered with the generation prompt.
    STRATA_ASSIGN_OR_RETURN(const std::string prompt,
                            renderer.Render(first_loss_message, true, nullptr));
    const size_t cut = CommonPrefix(whole, prompt);
    for (Span& s : spans) s.first = std::max(s.first, cut);
  }
  // Spans in order (empty ones dropped), tokens in order of their begins: one pass. A token is
  // in the loss when a byte of it lies in a span (an empty token: when its position does).
  std::erase_if(spans, [](const Span& x) { return x.first >= x.second; });
  // kApart: the text before the first counted span (the prompt, with the generation prompt)
  // encoded on its own, then the rest, so that no token merges across the boundary.
  const size_t apart = prompt_encoding == PromptEncoding::kApart && !spans.empty()
                           ? std::min(spans.front().first, whole.size())
                           : 0;
  const std::string_view text(whole);
  STRATA_ASSIGN_OR_RETURN(EncodedText enc,
                          EncodeRendered(tokenizer, apart > 0 ? text.substr(0, apart) : text,
                                         encoder.cuts(), encoder.cache()));
  if (apart > 0) {
    STRATA_ASSIGN_OR_RETURN(EncodedText rest, EncodeRendered(tokenizer, text.substr(apart),
                                                             encoder.cuts(), encoder.cache()));
    for (size_t i = 0; i < rest.ids.size(); ++i) {
      enc.ids.push_back(rest.ids[i]);
      enc.spans.push_back({rest.spans[i].begin + apart, rest.spans[i].end + apart});
    }
  }
  RenderedExample out;
  out.tokens = std::move(enc.ids);
  out.flags.assign(out.tokens.size(), 0);
  size_t s = 0;
  for (size_t i = 0; i < out.tokens.size(); ++i) {
    const TokenSpan t = enc.spans[i];
    while (s < spans.size() && spans[s].second <= t.begin) ++s;
    if (s == spans.size()) break;
    const bool overlaps = t.begin < t.end ? spans[s].first < t.end : spans[s].first <= t.begin;
    if (overlaps) out.flags[i] = kTokenFlagInLoss;
  }
  if (!out.flags.empty()) out.flags[0] |= kTokenFlagExampleStart;
  return out;
}

// The BOS id, then each content encoded on its own, an assistant's followed by the EOS id (the
// assistant turns from first_loss_message on in the loss, with their EOS).
StatusOr<RenderedExample> RenderNone(const Tokenizer& tokenizer, const InstructionExample& example,
                                     size_t first_loss_message) {
  RenderedExample out;
  auto add = [&](int32_t id, bool in_loss) {
    out.tokens.push_back(id);
    out.flags.push_back(in_loss ? kTokenFlagInLoss : 0);
  };
  if (tokenizer.bos_id() >= 0) add(tokenizer.bos_id(), false);
  for (size_t i = 0; i < example.messages.size(); ++i) {
    const ojson& m = example.messages[i];
    const std::string& role = m["role"].get_ref<const std::string&>();
    if (role != "system" && role != "user" && role != "assistant") {
      return InvalidArgumentError(fmt::format(
          "message {} has the role \"{}\", which the none chat template does not take (system, "
          "user, assistant)",
          i, Excerpt(role)));
    }
    const bool loss = role == "assistant" && i >= first_loss_message;
    if (m.contains("content") && m["content"].is_string()) {
      const std::string& content = m["content"].get_ref<const std::string&>();
      if (!content.empty()) {
        STRATA_ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer.Encode(content));
        for (int32_t id : ids) add(id, loss);
      }
    }
    // Every assistant turn ends with the EOS, in the loss when the turn is: a preference pair's
    // earlier turns (its prompt) render as the same conversation does as instruction data.
    if (role == "assistant" && tokenizer.eos_id() >= 0) add(tokenizer.eos_id(), loss);
  }
  if (!out.flags.empty()) out.flags[0] |= kTokenFlagExampleStart;
  return out;
}

}  // namespace

bool IsBlankText(std::string_view s) { return JinjaTrim(s).empty(); }

std::string_view TrimAsciiSpace(std::string_view s) {
  const size_t first = s.find_first_not_of(kWhitespace);
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(kWhitespace) - first + 1);
}

StatusOr<ojson> ParseJsonLine(std::string_view line) {
  // Nesting is limited: a line is untrusted input like a whole file. One pass (a line is parsed
  // once: this is most of what reading JSONL data costs): values deeper than the limit are
  // discarded as they are met, so nothing deep is ever built.
  bool too_deep = false;
  const ojson::parser_callback_t limit = [&too_deep](int depth, ojson::parse_event_t, ojson&) {
    if (depth <= kMaxJsonDepth) return true;
    too_deep = true;
    return false;
  };
  ojson j = ojson::parse(line.begin(), line.end(), limit, /*allow_exceptions=*/false);
  if (too_deep) {
    return InvalidArgumentError(
        fmt::format("not valid JSON (nested deeper than {} levels, the limit)", kMaxJsonDepth));
  }
  if (j.is_discarded()) return InvalidArgumentError("not valid JSON");
  return j;
}

StatusOr<MessageKind> CheckMessage(const ojson& m, std::string_view what) {
  if (!m.is_object()) return InvalidArgumentError(fmt::format("{} is not an object", what));
  const auto role = m.find("role");
  if (role == m.end() || !role->is_string()) {
    return InvalidArgumentError(fmt::format("{} has no \"role\" string", what));
  }
  const std::string& r = role->get_ref<const std::string&>();
  // An empty list calls no tool: such a message answers nothing (as transformers' templates,
  // which test `message.tool_calls` for truth, render it).
  const auto calls = m.find("tool_calls");
  const bool tool_calls =
      calls != m.end() && !calls->is_null() && !(calls->is_array() && calls->empty());
  STRATA_ASSIGN_OR_RETURN(const std::string_view content, Content(m, r, what, tool_calls));
  MessageKind kind;
  kind.assistant = r == "assistant";
  kind.empty_assistant = kind.assistant && IsBlankText(content) && !tool_calls;
  return kind;
}

ojson ChatMessage(std::string_view role, std::string content) {
  ojson m = ojson::object();
  m["role"] = role;
  m["content"] = std::move(content);
  return m;
}

StatusOr<RenderedExample> RenderConversation(const ChatFormat& format, const Tokenizer& tokenizer,
                                             InstructionExample example, size_t first_loss_message,
                                             ExampleEncoder& encoder,
                                             PromptEncoding prompt_encoding) {
  if (example.messages.empty()) return InvalidArgumentError("an example without messages");
  if (format.kind == ChatTemplate::kNone || format.jinja == nullptr) {
    return RenderNone(tokenizer, example, first_loss_message);
  }
  return RenderTemplate(format, tokenizer, std::move(example), first_loss_message, encoder,
                        prompt_encoding);
}

StatusOr<JsonlTokens> TokenizeJsonlLines(const ChatFormat& format, const Tokenizer& tokenizer,
                                         const std::string& jsonl_path, std::string_view what,
                                         int threads, const RenderJsonlLine& render) {
  // A FIFO or a device is refused before the stream opens it (which would wait on a FIFO).
  STRATA_RETURN_IF_ERROR(OpenRegularFile(jsonl_path, what).status());
  std::ifstream in(jsonl_path, std::ios::binary);
  if (!in) {
    return ErrnoToStatus(errno ? errno : ENOENT,
                         fmt::format("cannot open {} '{}'", what, jsonl_path));
  }
  // A pipeline over the lines: read in order, parse, render and encode in parallel (each thread
  // with its own encoder: special cuts and tokenizer cache), appended in line order, so the output
  // is the sequential one's byte for byte and the first error in line order is the one returned.
  struct Line {
    int64_t number = 0;
    std::string text;
  };
  struct Done {
    int64_t number = 0;
    StatusOr<std::vector<RenderedExample>> examples = std::vector<RenderedExample>{};
  };
  JsonlTokens out;
  Status failed = Status::Ok();
  int64_t next_number = 0;
  tbb::enumerable_thread_specific<ExampleEncoder> encoders(
      [&] { return ExampleEncoder(format, tokenizer); });
  auto read = [&](tbb::flow_control& fc) -> Line {
    Line l;
    while (std::getline(in, l.text)) {
      l.number = ++next_number;
      if (!TrimAsciiSpace(l.text).empty()) return l;
    }
    fc.stop();
    return l;
  };
  auto render_line = [&](Line l) -> Done {
    return Done{l.number, render(l.text, encoders.local())};
  };
  auto append = [&](Done d) {
    if (!failed.ok()) return;
    if (!d.examples.ok()) {
      const Status& s = d.examples.status();
      failed = Status(s.code(), fmt::format("'{}' line {}: {}", jsonl_path, d.number, s.message()));
      return;
    }
    for (const RenderedExample& e : *d.examples) {
      out.tokens.insert(out.tokens.end(), e.tokens.begin(), e.tokens.end());
      out.flags.insert(out.flags.end(), e.flags.begin(), e.flags.end());
      for (uint8_t f : e.flags) out.tokens_in_loss += (f & kTokenFlagInLoss) != 0;
      ++out.examples;
    }
    ++out.lines;
  };
  tbb::task_arena arena(threads > 0 ? threads : tbb::task_arena::automatic);
  arena.execute([&] {
    tbb::parallel_pipeline(
        static_cast<size_t>(4 * arena.max_concurrency()),
        tbb::make_filter<void, Line>(tbb::filter_mode::serial_in_order, read) &
            tbb::make_filter<Line, Done>(tbb::filter_mode::parallel, render_line) &
            tbb::make_filter<Done, void>(tbb::filter_mode::serial_in_order, append));
  });
  if (!failed.ok()) return failed;
  if (in.bad()) return ErrnoToStatus(errno, fmt::format("reading '{}'", jsonl_path));
  return out;
}

}  // namespace strata::data
