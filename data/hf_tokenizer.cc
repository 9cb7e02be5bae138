#include "data/hf_tokenizer.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <limits>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "base/file.h"
#include "base/untrusted_text.h"
#include "data/hf_tokenizer_json.h"

namespace strata::data {

namespace {

using hf::AddedToken;
using hf::DecoderStep;
using hf::NormalizerStep;
using hf::PrependScheme;
using hf::PreTokenizerStep;
using hf::Span;

// Where LastSafeCut may cut (hf_tokenizer.h).
enum class CutKind { kNone, kBeforeLetterAfterNewline, kAfterNewline };

// A pre-token's ids, per Encode call.
using WordCache =
    std::unordered_map<std::string, std::vector<int32_t>, hf::StringHash, std::equal_to<>>;
constexpr size_t kMaxCachedWords = 1 << 16;
constexpr size_t kMaxCachedWordBytes = 64;

// A WordCache kept across calls (HfTokenizer::NewEncodeCache).
struct HfEncodeCache final : EncodeCache {
  WordCache words;
};

// What one Encode call carries through pre-tokenization.
struct EncodeState {
  WordCache* cache;
  std::vector<int32_t>* ids;
  bool at_text_start;  // the segment starts the text (Metaspace prepend_scheme "first")
  bool continues;      // the segment continues a cut: no prefix at its start
  // EncodeWithOffsets: each id's bytes of the text; null for Encode.
  std::vector<TokenSpan>* spans = nullptr;
  std::vector<Span> piece_spans;  // scratch: a pre-token's tokens' bytes of the pre-token
};

// A part of the text: an added token's id, or text (added_id -1).
struct Segment {
  size_t begin, end;
  int added_id;
};

std::string ReplaceAll(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  for (size_t hit; (hit = s.find(from, pos)) != std::string_view::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out.append(to);
  }
  out.append(s, pos);
  return out;
}

// ---- Alignments (EncodeWithOffsets): a string made from the text, and per byte of it the bytes
// of the text it came from. Begins and ends are non-decreasing along the string, so the bytes a
// run [b, e) of it came from are [align[b].begin, align[e - 1].end). ----

// The text's bytes [offset, offset + s.size()) as themselves.
void IdentityAligned(std::string_view s, size_t offset, std::string* out,
                     std::vector<Span>* align) {
  out->assign(s);
  align->resize(s.size());
  for (size_t i = 0; i < s.size(); ++i) (*align)[i] = {offset + i, offset + i + 1};
}

// Where, in the text, position `i` (<= size) of an aligned string lies: the begin of byte i, or
// past the last byte; `fallback` for an empty string.
size_t AlignedPosition(const std::vector<Span>& align, size_t i, size_t fallback) {
  if (i < align.size()) return align[i].begin;
  return align.empty() ? fallback : align.back().end;
}

// `prefix` inserted at the start of a non-empty aligned string: empty, before its first byte.
void PrependAligned(std::string_view prefix, std::string* s, std::vector<Span>* align) {
  const size_t at = AlignedPosition(*align, 0, 0);
  s->insert(0, prefix);
  align->insert(align->begin(), prefix.size(), Span{at, at});
}

// ReplaceAll on an aligned string: each byte of a replacement comes from the bytes it replaced.
void ReplaceAligned(std::string_view s, const Span* align, std::string_view from,
                    std::string_view to, std::string* out, std::vector<Span>* out_align) {
  out->clear();
  out_align->clear();
  size_t pos = 0;
  auto copy = [&](size_t end) {
    out->append(s, pos, end - pos);
    out_align->insert(out_align->end(), align + pos, align + end);
  };
  for (size_t hit; (hit = s.find(from, pos)) != std::string_view::npos; pos = hit + from.size()) {
    copy(hit);
    out->append(to);
    out_align->insert(out_align->end(), to.size(),
                      Span{align[hit].begin, align[hit + from.size() - 1].end});
  }
  copy(s.size());
}

// The patterns whose cut point (before a letter after "<non-space>\n") is proven in
// hf_tokenizer.h: GPT-2's, Llama 3's and Qwen 2's.
bool IsKnownPattern(const std::string& p) {
  static const char* kLlama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static const char* kQwen2 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  return p == hf::kGpt2Pattern || p == kLlama3 || p == kQwen2;
}

// UTF-8 with each invalid sequence replaced by U+FFFD (Rust's String::from_utf8_lossy).
std::string Lossy(std::string_view bytes) {
  std::string out;
  while (!bytes.empty()) {
    const size_t bad = hf::FindInvalidUtf8(bytes);
    if (bad == std::string_view::npos) {
      out.append(bytes);
      break;
    }
    out.append(bytes.substr(0, bad));
    out.append("\xEF\xBF\xBD");
    size_t skip = 1;  // the lead byte and the continuation bytes that followed it
    while (bad + skip < bytes.size() && skip < 3 &&
           (static_cast<unsigned char>(bytes[bad + skip]) & 0xC0) == 0x80 &&
           static_cast<unsigned char>(bytes[bad]) >= 0xC2) {
      ++skip;
    }
    bytes.remove_prefix(bad + skip);
  }
  return out;
}

}  // namespace

struct HfTokenizer::Impl {
  hf::TokenizerJson config;
  std::vector<std::string> id_to_token;
  std::vector<bool> has_token;
  hf::Vocab added_ids;
  std::array<std::vector<int>, 256> added_by_first_byte;  // longest first
  int vocab_size = 0, bos = -1, eos = -1;
  bool add_bos = false, add_eos = false;  // adds_bos(), adds_eos()
  CutKind cut = CutKind::kNone;
  bool nfc = false;
  // EncodeWithOffsets' fast path (byte-level BPE, no normalizer, no prefix space): each id's
  // bytes (empty: none, e.g. a character outside the byte table), so that Encode's cached ids
  // whose bytes spell the text out in order are their own spans.
  bool tiles = false;
  std::vector<std::string> id_bytes;

  int TokenId(std::string_view piece) const;
  void Index();
  CutKind DecideCut() const;
  bool NewlineIsBarrier() const;
  void SplitAdded(std::string_view text, std::vector<Segment>* out) const;
  bool SingleWordOk(std::string_view text, size_t start, size_t stop) const;
  StatusOr<std::string> Normalize(std::string_view s, bool may_prepend) const;
  Status NormalizeAligned(std::string_view s, size_t offset, bool may_prepend, std::string* out,
                          std::vector<Span>* align) const;
  template <bool kOffsets>
  void PreTokenizeFrom(size_t k, std::string_view piece, const Span* align, bool first,
                       EncodeState* st) const;
  // Inlined into PreTokenizeFrom, as GCC did before it became a template: Encode's per-pre-token
  // cost stays what it was.
  template <bool kOffsets>
  [[gnu::always_inline]] inline void SplitThen(size_t k, std::string_view piece, const Span* align,
                                               bool first, EncodeState* st) const;
  void EncodePiece(std::string_view piece, WordCache* cache, std::vector<int32_t>* ids) const;
  void EncodePieceWithSpans(std::string_view piece, const Span* align, EncodeState* st) const;
  template <bool kOffsets>
  Status EncodeInto(std::string_view text, bool continued, std::vector<int32_t>* ids,
                    std::vector<TokenSpan>* spans, WordCache* cache = nullptr) const;
  size_t LastSafeCut(std::string_view text, size_t from) const;
  std::vector<std::string> RunDecoders(std::vector<std::string> tokens) const;
};

int HfTokenizer::Impl::TokenId(std::string_view piece) const {
  if (auto it = added_ids.find(piece); it != added_ids.end()) return it->second;
  const hf::Vocab& v = config.model->vocab();
  auto it = v.find(piece);
  return it == v.end() ? -1 : it->second;
}

// The id -> token table, the added tokens by first byte, and the cut kind.
void HfTokenizer::Impl::Index() {
  vocab_size = config.vocab_size;  // ids checked and bounded by ParseTokenizerJson
  id_to_token.resize(vocab_size);
  has_token.resize(vocab_size);
  for (const auto& [token, id] : config.model->vocab()) id_to_token[id] = token, has_token[id] = 1;
  for (size_t k = 0; k < config.added_tokens.size(); ++k) {
    const AddedToken& t = config.added_tokens[k];
    id_to_token[t.id] = t.content, has_token[t.id] = true;
    added_ids[t.content] = t.id;
    added_by_first_byte[static_cast<unsigned char>(t.content[0])].push_back(static_cast<int>(k));
  }
  for (auto& list : added_by_first_byte) {
    std::stable_sort(list.begin(), list.end(), [&](int a, int b) {
      return config.added_tokens[a].content.size() > config.added_tokens[b].content.size();
    });
  }
  for (const NormalizerStep& n : config.normalizer) nfc = nfc || n.kind == NormalizerStep::kNfc;
  cut = DecideCut();
  tiles = config.model->options().byte_level && config.normalizer.empty();
  for (const PreTokenizerStep& step : config.pre_tokenizer) {
    tiles = tiles && !(step.kind == PreTokenizerStep::kByteLevel && step.add_prefix_space) &&
            step.kind != PreTokenizerStep::kMetaspace;
  }
  if (!tiles) return;
  id_bytes.resize(vocab_size);
  for (const auto& [token, id] : config.model->vocab()) {
    std::string& bytes = id_bytes[id];
    for (size_t i = 0, len = 0; i < token.size(); i += len) {
      const int b = hf::CharToByte(hf::DecodeUtf8(token, i, &len));
      if (b < 0) {
        bytes.clear();
        break;
      }
      bytes.push_back(static_cast<char>(b));
    }
  }
  for (const AddedToken& t : config.added_tokens) id_bytes[t.id] = t.content;
}

// SentencePiece-style: BPE cannot merge across a newline when the newline's token (itself or
// its byte fallback) is in no merge and no other vocabulary entry contains a newline.
bool HfTokenizer::Impl::NewlineIsBarrier() const {
  const hf::BpeModel& m = *config.model;
  for (const auto& [token, id] : m.vocab()) {
    if (token != "\n" && token.find('\n') != std::string::npos) return false;
  }
  int nl = TokenId("\n");
  if (config.model->vocab().count("\n") == 0) {
    auto fb = m.vocab().find("<0x0A>");
    if (!m.options().byte_fallback || fb == m.vocab().end()) return false;
    nl = fb->second;
  }
  return !m.InAnyMerge(nl);
}

CutKind HfTokenizer::Impl::DecideCut() const {
  bool prefixes = false, rstrip = false;
  for (const AddedToken& t : config.added_tokens) {
    if (t.content.find('\n') != std::string::npos) return CutKind::kNone;
    rstrip = rstrip || t.rstrip;
  }
  for (const NormalizerStep& n : config.normalizer) {
    if (n.kind == NormalizerStep::kReplace &&
        (n.a.find('\n') != std::string::npos || n.b.find('\n') != std::string::npos)) {
      return CutKind::kNone;
    }
    prefixes = prefixes || n.kind == NormalizerStep::kPrepend;
  }
  const auto& pre = config.pre_tokenizer;
  for (const PreTokenizerStep& s : pre) {
    prefixes =
        prefixes || (s.kind == PreTokenizerStep::kByteLevel && s.add_prefix_space) ||
        (s.kind == PreTokenizerStep::kMetaspace && s.prepend_scheme != PrependScheme::kNever);
  }
  // After an rstrip token a new segment starts at the cut, and gets a prefix a continued one
  // would not.
  if (rstrip && prefixes) return CutKind::kNone;
  if (config.model->options().byte_level) {
    const PreTokenizerStep& first = pre.front();
    if (first.regex == nullptr || !IsKnownPattern(first.regex->pattern())) return CutKind::kNone;
    if (first.kind == PreTokenizerStep::kSplit &&
        (first.invert || first.behavior != hf::SplitBehavior::kIsolated || pre.size() != 2 ||
         pre.back().add_prefix_space)) {
      return CutKind::kNone;
    }
    return CutKind::kBeforeLetterAfterNewline;
  }
  for (const PreTokenizerStep& s : pre) {
    if (s.kind != PreTokenizerStep::kMetaspace || s.replacement == "\n") return CutKind::kNone;
  }
  return NewlineIsBarrier() ? CutKind::kAfterNewline : CutKind::kNone;
}

// HF's single_word: no word character right before or after the match.
bool HfTokenizer::Impl::SingleWordOk(std::string_view text, size_t start, size_t stop) const {
  size_t len = 0;
  if (start > 0 && hf::IsWordChar(hf::DecodeUtf8(text, hf::PrevCharStart(text, start), &len))) {
    return false;
  }
  return stop >= text.size() || !hf::IsWordChar(hf::DecodeUtf8(text, stop, &len));
}

// HF's AddedVocabulary::find_matches: leftmost-longest matches, single_word, lstrip, rstrip.
void HfTokenizer::Impl::SplitAdded(std::string_view text, std::vector<Segment>* out) const {
  const size_t n = text.size();
  size_t start_offset = 0, pos = 0;
  while (pos < n) {
    const AddedToken* hit = nullptr;
    size_t at = pos;
    for (; at < n && hit == nullptr; ++at) {
      for (int k : added_by_first_byte[static_cast<unsigned char>(text[at])]) {
        const AddedToken& t = config.added_tokens[k];
        if (text.compare(at, t.content.size(), t.content) == 0) {
          hit = &t;
          break;
        }
      }
    }
    if (hit == nullptr) break;
    size_t start = at - 1, stop = start + hit->content.size(), len = 0;
    pos = stop;
    if (hit->single_word && !SingleWordOk(text, start, stop)) continue;
    while (hit->lstrip && start > start_offset) {
      const size_t prev = hf::PrevCharStart(text, start);
      if (!hf::IsWhitespace(hf::DecodeUtf8(text, prev, &len))) break;
      start = prev;
    }
    while (hit->rstrip && stop < n && hf::IsWhitespace(hf::DecodeUtf8(text, stop, &len))) {
      stop += len;
    }
    pos = stop;
    if (start_offset < start) out->push_back({start_offset, start, -1});
    out->push_back({start, stop, hit->id});
    start_offset = stop;
  }
  if (start_offset < n) out->push_back({start_offset, n, -1});
}

StatusOr<std::string> HfTokenizer::Impl::Normalize(std::string_view s, bool may_prepend) const {
  std::string out(s);
  for (const NormalizerStep& step : config.normalizer) {
    switch (step.kind) {
      case NormalizerStep::kPrepend:
        if (may_prepend && !out.empty()) out.insert(0, step.a);
        break;
      case NormalizerStep::kReplace:
        if (out.find(step.a) != std::string::npos) out = ReplaceAll(out, step.a, step.b);
        break;
      case NormalizerStep::kNfc:
        if (!hf::IsNfc(out)) {
          STRATA_ASSIGN_OR_RETURN(out, hf::Nfc(out));
        }
        break;
    }
  }
  return out;
}

// As Normalize, with the alignment of the result to the text (`s` is the text's bytes from
// `offset`): a prefix is empty before the first byte, a replacement comes from what it
// replaced, and a region NFC changed from the whole region.
Status HfTokenizer::Impl::NormalizeAligned(std::string_view s, size_t offset, bool may_prepend,
                                           std::string* out, std::vector<Span>* align) const {
  IdentityAligned(s, offset, out, align);
  std::string next;
  std::vector<Span> next_align;
  for (const NormalizerStep& step : config.normalizer) {
    switch (step.kind) {
      case NormalizerStep::kPrepend:
        if (may_prepend && !out->empty()) PrependAligned(step.a, out, align);
        break;
      case NormalizerStep::kReplace:
        if (out->find(step.a) == std::string::npos) break;
        ReplaceAligned(*out, align->data(), step.a, step.b, &next, &next_align);
        std::swap(*out, next), std::swap(*align, next_align);
        break;
      case NormalizerStep::kNfc: {
        if (hf::IsNfc(*out)) break;
        std::vector<hf::NfcChange> changes;
        STRATA_ASSIGN_OR_RETURN(next, hf::Nfc(*out, &changes));
        next_align.clear();
        size_t src = 0;
        for (const hf::NfcChange& c : changes) {
          next_align.insert(next_align.end(), align->begin() + static_cast<ptrdiff_t>(src),
                            align->begin() + static_cast<ptrdiff_t>(c.from.begin));
          const Span whole = c.from.end > c.from.begin
                                 ? Span{(*align)[c.from.begin].begin, (*align)[c.from.end - 1].end}
                                 : Span{AlignedPosition(*align, c.from.begin, offset),
                                        AlignedPosition(*align, c.from.begin, offset)};
          next_align.insert(next_align.end(), c.to.end - c.to.begin, whole);
          src = c.from.end;
        }
        next_align.insert(next_align.end(), align->begin() + static_cast<ptrdiff_t>(src),
                          align->end());
        STRATA_CHECK(next_align.size() == next.size());
        std::swap(*out, next), std::swap(*align, next_align);
        break;
      }
    }
  }
  return Status::Ok();
}

// Applies pre-tokenizer steps [k, end) to `piece` (`first`: the segment's first piece) and
// encodes each resulting pre-token: depth first, so no list of a segment's pieces is built.
// kOffsets (EncodeWithOffsets): `align` holds the text bytes of each byte of `piece`, and each
// pre-token's tokens get their spans; Encode's instantiation (null `align`) has none of it.
template <bool kOffsets>
void HfTokenizer::Impl::PreTokenizeFrom(size_t k, std::string_view piece, const Span* align,
                                        bool first, EncodeState* st) const {
  if (k == config.pre_tokenizer.size()) {
    if constexpr (kOffsets) {
      EncodePieceWithSpans(piece, align, st);
    } else {
      EncodePiece(piece, st->cache, st->ids);
    }
    return;
  }
  const PreTokenizerStep& step = config.pre_tokenizer[k];
  const bool may_prefix = !(st->continues && first);
  std::string owned;
  [[maybe_unused]] std::conditional_t<kOffsets, std::vector<Span>, std::nullptr_t> owned_align{};
  if (step.kind == PreTokenizerStep::kMetaspace) {
    const std::string& r = step.replacement;
    const bool prepend =
        step.prepend_scheme == PrependScheme::kAlways ||
        (step.prepend_scheme == PrependScheme::kFirst && first && st->at_text_start);
    if constexpr (kOffsets) {
      ReplaceAligned(piece, align, " ", r, &owned, &owned_align);
      if (prepend && may_prefix && owned.compare(0, r.size(), r) != 0) {
        PrependAligned(r, &owned, &owned_align);
      }
      align = owned_align.data();
    } else {
      owned = ReplaceAll(piece, " ", r);
      if (prepend && may_prefix && owned.compare(0, r.size(), r) != 0) owned.insert(0, r);
    }
    piece = owned;
  } else if (step.kind == PreTokenizerStep::kByteLevel && step.add_prefix_space && may_prefix &&
             piece[0] != ' ') {
    if constexpr (kOffsets) {
      owned = piece;
      owned_align.assign(align, align + piece.size());
      PrependAligned(" ", &owned, &owned_align);
      align = owned_align.data();
    } else {
      owned = " ";
      owned += piece;
    }
    piece = owned;
  }
  SplitThen<kOffsets>(k, piece, align, first, st);
}

// Splits `piece` by step k and hands each part to step k + 1.
template <bool kOffsets>
void HfTokenizer::Impl::SplitThen(size_t k, std::string_view piece, const Span* align, bool first,
                                  EncodeState* st) const {
  const PreTokenizerStep& step = config.pre_tokenizer[k];
  auto next = [&](Span s, bool f) {
    const std::string_view part = piece.substr(s.begin, s.end - s.begin);
    if constexpr (kOffsets) {
      PreTokenizeFrom<true>(k + 1, part, align + s.begin, f, st);
    } else {
      PreTokenizeFrom<false>(k + 1, part, nullptr, f, st);
    }
  };
  if ((step.kind == PreTokenizerStep::kByteLevel && step.regex == nullptr) ||
      (step.kind == PreTokenizerStep::kMetaspace && !step.split)) {
    next({0, piece.size()}, first);
    return;
  }
  const bool isolated =
      step.kind == PreTokenizerStep::kByteLevel ||
      (step.kind == PreTokenizerStep::kSplit && step.behavior == hf::SplitBehavior::kIsolated);
  if (isolated && step.regex != nullptr) {  // matches and gaps in order, as found
    size_t prev = 0;
    Span m;
    for (hf::Regex::Matches it(*step.regex, piece); it.Next(&m); prev = m.end) {
      if (m.begin > prev) next({prev, m.begin}, std::exchange(first, false));
      if (m.end > m.begin) next(m, std::exchange(first, false));
    }
    if (prev < piece.size()) next({prev, piece.size()}, first);
    return;
  }
  std::vector<Span> matches, parts;
  hf::SplitBehavior behavior = step.behavior;
  if (step.regex != nullptr) {
    step.regex->FindAll(piece, &matches);
  } else if (step.kind == PreTokenizerStep::kMetaspace) {
    hf::FindLiteral(piece, step.replacement, &matches);
    behavior = hf::SplitBehavior::kMergedWithNext;
  } else {
    hf::FindLiteral(piece, step.literal, &matches);
  }
  hf::SplitByMatches(piece.size(), matches, behavior, step.invert, &parts);
  for (size_t i = 0; i < parts.size(); ++i) next(parts[i], first && i == 0);
}

void HfTokenizer::Impl::EncodePiece(std::string_view piece, WordCache* cache,
                                    std::vector<int32_t>* ids) const {
  if (auto it = cache->find(piece); it != cache->end()) {
    ids->insert(ids->end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t before = ids->size();
  config.model->Encode(piece, ids);
  if (cache->size() < kMaxCachedWords && piece.size() <= kMaxCachedWordBytes) {
    cache->emplace(std::string(piece), std::vector<int32_t>(ids->begin() + before, ids->end()));
  }
}

// A pre-token's ids and their bytes of the text, uncached (EncodeWithOffsets).
void HfTokenizer::Impl::EncodePieceWithSpans(std::string_view piece, const Span* align,
                                             EncodeState* st) const {
  st->piece_spans.clear();
  config.model->EncodeWithSpans(piece, st->ids, &st->piece_spans);
  for (const Span& s : st->piece_spans) {
    st->spans->push_back({align[s.begin].begin, align[s.end - 1].end});
  }
}

// Encode (`continued`: EncodeContinued) into `ids`; kOffsets: EncodeWithOffsets, with `spans`.
template <bool kOffsets>
Status HfTokenizer::Impl::EncodeInto(std::string_view text, bool continued,
                                     std::vector<int32_t>* ids, std::vector<TokenSpan>* spans,
                                     WordCache* cache) const {
  if (const size_t bad = hf::FindInvalidUtf8(text); bad != std::string_view::npos) {
    return InvalidArgumentError(fmt::format("the text is not valid UTF-8 at byte {}", bad));
  }
  std::vector<Segment> segments;
  SplitAdded(text, &segments);
  WordCache local;
  EncodeState st{.cache = cache != nullptr ? cache : &local,
                 .ids = ids,
                 .at_text_start = false,
                 .continues = false,
                 .spans = spans,
                 .piece_spans = {}};
  ids->reserve(ids->size() + text.size() / 3);
  [[maybe_unused]] std::conditional_t<kOffsets, std::string, std::nullptr_t> aligned{};
  [[maybe_unused]] std::conditional_t<kOffsets, std::vector<Span>, std::nullptr_t> align{};
  for (const Segment& seg : segments) {
    if (seg.added_id >= 0) {
      ids->push_back(seg.added_id);
      if constexpr (kOffsets) spans->push_back({seg.begin, seg.end});
      continue;
    }
    st.continues = continued && seg.begin == 0;
    st.at_text_start = !continued && seg.begin == 0;
    const std::string_view raw = text.substr(seg.begin, seg.end - seg.begin);
    if constexpr (kOffsets) {
      STRATA_RETURN_IF_ERROR(NormalizeAligned(raw, seg.begin, !st.continues, &aligned, &align));
      if (!aligned.empty()) PreTokenizeFrom<true>(0, aligned, align.data(), true, &st);
    } else {
      if (config.normalizer.empty()) {
        PreTokenizeFrom<false>(0, raw, nullptr, true, &st);
        continue;
      }
      STRATA_ASSIGN_OR_RETURN(const std::string normalized, Normalize(raw, !st.continues));
      if (!normalized.empty()) PreTokenizeFrom<false>(0, normalized, nullptr, true, &st);
    }
  }
  return Status::Ok();
}

size_t HfTokenizer::Impl::LastSafeCut(std::string_view text, size_t from) const {
  if (cut == CutKind::kNone || text.size() < 3) return 0;
  const size_t lo = std::max<size_t>(from, 2);
  for (size_t p = text.size() - 1; p >= lo; --p) {
    if (text[p - 1] != '\n') continue;
    const auto lead = static_cast<unsigned char>(text[p]);
    if (!added_by_first_byte[lead].empty()) continue;
    const size_t need = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
    if (p + need > text.size() || hf::FindInvalidUtf8(text.substr(p, need)) == 0) continue;
    size_t len = 0;
    const char32_t c = hf::DecodeUtf8(text, p, &len);
    if (nfc && !hf::NfcBoundaryBefore(c)) continue;
    if (cut == CutKind::kBeforeLetterAfterNewline) {
      if (!hf::IsLetter(c)) continue;
      const size_t q = hf::PrevCharStart(text, p - 1);
      if (hf::FindInvalidUtf8(text.substr(q, p - 1 - q)) != std::string_view::npos ||
          hf::IsWhitespace(hf::DecodeUtf8(text, q, &len))) {
        continue;
      }
    }
    return p;
  }
  return 0;
}

namespace {

// HF's ByteLevel decoder: every token's characters as bytes (a token with a character outside
// the table as its own bytes), then lossy UTF-8.
std::string ByteLevelDecode(const std::vector<std::string>& tokens) {
  std::string bytes, token_bytes;
  for (const std::string& t : tokens) {
    token_bytes.clear();
    bool all = true;
    for (size_t i = 0, len = 0; i < t.size() && all; i += len) {
      const int b = hf::CharToByte(hf::DecodeUtf8(t, i, &len));
      all = b >= 0;
      token_bytes.push_back(static_cast<char>(b));
    }
    bytes += all ? token_bytes : t;
  }
  return Lossy(bytes);
}

// HF's ByteFallback decoder: runs of <0xXX> tokens become their bytes when those are UTF-8, else
// one U+FFFD per token.
std::vector<std::string> ByteFallbackDecode(std::vector<std::string> tokens) {
  std::vector<std::string> out;
  std::string pending;
  auto flush = [&] {
    if (pending.empty()) return;
    if (hf::FindInvalidUtf8(pending) == std::string::npos) {
      out.push_back(pending);
    } else {
      for (size_t k = 0; k < pending.size(); ++k) out.emplace_back("\xEF\xBF\xBD");
    }
    pending.clear();
  };
  for (std::string& t : tokens) {
    unsigned value = 0;
    if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
        std::isxdigit(static_cast<unsigned char>(t[3])) &&
        std::isxdigit(static_cast<unsigned char>(t[4]))) {
      value = static_cast<unsigned>(std::stoul(t.substr(3, 2), nullptr, 16));
      pending.push_back(static_cast<char>(value));
      continue;
    }
    flush();
    out.push_back(std::move(t));
  }
  flush();
  return out;
}

// HF's Strip decoder on one token: up to `start` leading and `stop` trailing `content` chars.
std::string StripDecode(const std::string& t, const std::string& content, int start, int stop) {
  size_t b = 0, e = t.size();
  for (int k = 0; k < start && t.compare(b, content.size(), content) == 0 && b < e; ++k) {
    b += content.size();
  }
  for (int k = 0; k < stop && e >= b + content.size() &&
                  t.compare(e - content.size(), content.size(), content) == 0;
       ++k) {
    e -= content.size();
  }
  return t.substr(b, e - b);
}

}  // namespace

std::vector<std::string> HfTokenizer::Impl::RunDecoders(std::vector<std::string> tokens) const {
  for (const DecoderStep& step : config.decoder) {
    switch (step.kind) {
      case DecoderStep::kByteLevel:
        tokens = {ByteLevelDecode(tokens)};
        break;
      case DecoderStep::kReplace:
        for (std::string& t : tokens) t = ReplaceAll(t, step.a, step.b);
        break;
      case DecoderStep::kByteFallback:
        tokens = ByteFallbackDecode(std::move(tokens));
        break;
      case DecoderStep::kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens = {std::move(all)};
        break;
      }
      case DecoderStep::kStrip:
        for (std::string& t : tokens) t = StripDecode(t, step.a, step.start, step.stop);
        break;
      case DecoderStep::kMetaspace:
        // The replacement is a space, except in the first token with a prepend scheme, where
        // it is dropped.
        for (size_t i = 0; i < tokens.size(); ++i) {
          const bool drop = i == 0 && step.prepend_scheme != PrependScheme::kNever;
          tokens[i] = ReplaceAll(tokens[i], step.a, drop ? "" : " ");
        }
        break;
    }
  }
  return tokens;
}

namespace {

std::string OneLine(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

// bos_id/eos_id: tokenizer_config.json beside `path` when it names them, else the template's.
Status ResolveSpecialIds(const std::string& path, HfTokenizer::Impl* impl) {
  const std::string config_path =
      (std::filesystem::path(path).parent_path() / "tokenizer_config.json").string();
  STRATA_ASSIGN_OR_RETURN(const hf::SpecialTokenNames names, hf::ReadTokenizerConfigBeside(path));
  const hf::TokenizerJson& c = impl->config;
  // Without add_bos_token, as transformers' tokenizer(text): the classes whose add_bos_token
  // defaults to true rebuild the post-processor with a BOS (LlamaTokenizerFast's
  // update_post_processor); any other (PreTrainedTokenizerFast, GPT2TokenizerFast, ...) adds what
  // tokenizer.json's post-processor template adds.
  std::string_view cls = names.tokenizer_class;
  if (cls.ends_with("Fast")) cls.remove_suffix(4);
  const bool bos_by_default = cls == "LlamaTokenizer" || cls == "CodeLlamaTokenizer" ||
                              cls == "GemmaTokenizer" || cls == "CohereTokenizer";
  impl->add_bos =
      names.add_bos >= 0 ? names.add_bos == 1 : bos_by_default || !c.template_bos.empty();
  impl->add_eos = names.add_eos == 1;
  struct Which {
    bool named;
    const std::string& name;
    const std::string& template_name;
    int template_id;
    int* out;
    const char* key;
  };
  for (const Which& w :
       {Which{names.has_bos, names.bos, c.template_bos, c.template_bos_id, &impl->bos, "bos_token"},
        Which{names.has_eos, names.eos, c.template_eos, c.template_eos_id, &impl->eos,
              "eos_token"}}) {
    const std::string& name = w.named ? w.name : w.template_name;
    if (name.empty()) continue;
    *w.out = !w.named && w.template_id >= 0 ? w.template_id : impl->TokenId(name);
    if (*w.out < 0 && w.named) {
      return InvalidArgumentError(
          fmt::format("tokenizer_config.json '{}': /{} '{}' is not a token of tokenizer.json '{}'",
                      config_path, w.key, Excerpt(name), path));
    }
    if (*w.out < 0) {
      return InvalidArgumentError(fmt::format(
          "tokenizer.json '{}': /post_processor: the template's special token '{}' (taken as {}) "
          "is not one of its tokens",
          path, Excerpt(name), w.key));
    }
  }
  return Status::Ok();
}

}  // namespace

HfTokenizer::HfTokenizer(std::string path, uint64_t fingerprint, std::unique_ptr<Impl> impl)
    : Tokenizer(std::move(path), fingerprint), impl_(std::move(impl)) {}

HfTokenizer::~HfTokenizer() = default;

StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::Load(const std::string& path) {
  auto bytes = ReadSmallFile(path, {.max_bytes = uint64_t{1} << 30});
  if (!bytes.ok()) return bytes.status().WithContext("tokenizer file");
  auto config = hf::ParseTokenizerJson(*bytes);
  if (!config.ok()) {
    return InvalidArgumentError(fmt::format("tokenizer.json '{}': {}", path,
                                            OneLine(std::string(config.status().message()))));
  }
  auto impl = std::make_unique<Impl>();
  impl->config = std::move(*config);
  for (size_t i = 0; i < impl->config.added_tokens.size(); ++i) {
    const AddedToken& t = impl->config.added_tokens[i];
    if (t.normalized && !impl->config.normalizer.empty()) {
      return InvalidArgumentError(fmt::format(
          "tokenizer.json '{}': /added_tokens/{} ('{}') with normalized: true under a normalizer "
          "is not supported",
          path, i, Excerpt(t.content)));
    }
  }
  impl->Index();
  STRATA_RETURN_IF_ERROR(ResolveSpecialIds(path, impl.get()));
  const uint64_t fingerprint = XXH3_64bits(bytes->data(), bytes->size());
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(path, fingerprint, std::move(impl)));
}

int HfTokenizer::vocab_size() const { return impl_->vocab_size; }
int HfTokenizer::bos_id() const { return impl_->bos; }
int HfTokenizer::eos_id() const { return impl_->eos; }
bool HfTokenizer::adds_bos() const { return impl_->add_bos && impl_->bos >= 0; }
bool HfTokenizer::adds_eos() const { return impl_->add_eos && impl_->eos >= 0; }
int HfTokenizer::TokenId(std::string_view piece) const { return impl_->TokenId(piece); }

StatusOr<std::vector<int32_t>> HfTokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  const Status s = impl_->EncodeInto<false>(text, /*continued=*/false, &ids, nullptr);
  if (!s.ok()) return s.WithContext(fmt::format("tokenizer '{}'", path()));
  return ids;
}

StatusOr<std::vector<int32_t>> HfTokenizer::EncodeContinued(std::string_view text) const {
  std::vector<int32_t> ids;
  const Status s = impl_->EncodeInto<false>(text, /*continued=*/true, &ids, nullptr);
  if (!s.ok()) return s.WithContext(fmt::format("tokenizer '{}'", path()));
  return ids;
}

StatusOr<EncodedText> HfTokenizer::EncodeWithOffsets(std::string_view text) const {
  return EncodeWithOffsets(text, nullptr);
}

std::unique_ptr<EncodeCache> HfTokenizer::NewEncodeCache() const {
  return std::make_unique<HfEncodeCache>();
}

StatusOr<EncodedText> HfTokenizer::EncodeWithOffsets(std::string_view text,
                                                     EncodeCache* cache) const {
  WordCache* words = cache != nullptr ? &static_cast<HfEncodeCache*>(cache)->words : nullptr;
  EncodedText out;
  if (impl_->tiles) {
    // Fast path: Encode's (cached) ids, each the next bytes of the text, are their own spans:
    // what the aligned path gives where byte-level tokens tile the text. Where they do not (an
    // lstrip/rstrip token's swallowed whitespace), the aligned path below decides.
    const Status s = impl_->EncodeInto<false>(text, /*continued=*/false, &out.ids, nullptr, words);
    if (!s.ok()) return s.WithContext(fmt::format("tokenizer '{}'", path()));
    out.spans.reserve(out.ids.size());
    size_t pos = 0;
    for (const int32_t id : out.ids) {
      const std::string& bytes = impl_->id_bytes[id];
      if (bytes.empty() || text.compare(pos, bytes.size(), bytes) != 0) break;
      out.spans.push_back({pos, pos + bytes.size()});
      pos += bytes.size();
    }
    if (out.spans.size() == out.ids.size() && pos == text.size()) return out;
    out = EncodedText();
  }
  const Status s = impl_->EncodeInto<true>(text, /*continued=*/false, &out.ids, &out.spans);
  if (!s.ok()) return s.WithContext(fmt::format("tokenizer '{}'", path()));
  return out;
}

size_t HfTokenizer::LastSafeCut(std::string_view text, size_t from) const {
  return impl_->LastSafeCut(text, from);
}

StatusOr<std::string> HfTokenizer::Decode(std::span<const int32_t> ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= impl_->vocab_size || !impl_->has_token[ids[i]]) {
      return InvalidArgumentError(
          fmt::format("tokenizer '{}': id {} at position {} is outside its vocabulary [0, {})",
                      path(), ids[i], i, impl_->vocab_size));
    }
    tokens.push_back(impl_->id_to_token[ids[i]]);
  }
  if (!impl_->config.has_decoder) {
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) joined += (i ? " " : "") + tokens[i];
    return joined;
  }
  std::string text;
  for (const std::string& t : impl_->RunDecoders(std::move(tokens))) text += t;
  return text;
}

}  // namespace strata::data
