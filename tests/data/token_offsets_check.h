// Checks of Tokenizer::EncodeWithOffsets' contract (data/tokenizer.h), shared by the tokenizer
// tests: the ids are Encode's, the spans are ordered and inside the text, every byte is in a
// span, and the spans have the shape the tokenizer's kind promises.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace strata::data::testing {

enum class SpanShape {
  // The spans are non-empty and follow one another from 0 to the text's end (byte-level BPE).
  kTiles,
  // As kTiles, except for empty spans (an inserted "▁", at the position of the text after it)
  // and runs of equal spans (the byte-fallback tokens of one character).
  kTilesWithPrefixes,
  // Only the general contract: spans may overlap (a run NFC changed).
  kOverlapping,
};

enum class Coverage {
  kEveryByte,
  // Bytes in no span are ASCII whitespace (what libsentencepiece's normalizer folds or strips).
  kAllButWhitespace,
};

// EncodeWithOffsets(text), checked; `what` names the case in failures.
inline EncodedText ExpectOffsetContract(const Tokenizer& t, std::string_view text, SpanShape shape,
                                        const std::string& what,
                                        Coverage coverage = Coverage::kEveryByte) {
  auto enc = t.EncodeWithOffsets(text);
  EXPECT_TRUE(enc.ok()) << what << ": " << enc.status().ToString();
  if (!enc.ok()) return {};
  auto ids = t.Encode(text);
  EXPECT_TRUE(ids.ok()) << what;
  EXPECT_EQ(enc->ids, *ids) << what;
  EXPECT_EQ(enc->spans.size(), enc->ids.size()) << what;
  if (enc->spans.size() != enc->ids.size()) return {};
  std::vector<bool> covered(text.size());
  size_t tiled = 0;  // the end of the last non-empty span (kTiles, kTilesWithPrefixes)
  TokenSpan last{};
  for (size_t i = 0; i < enc->spans.size(); ++i) {
    const TokenSpan s = enc->spans[i];
    const std::string at = what + ", token " + std::to_string(i) + " [" + std::to_string(s.begin) +
                           ", " + std::to_string(s.end) + ")";
    EXPECT_LE(s.begin, s.end) << at;
    EXPECT_LE(s.end, text.size()) << at;
    if (i > 0) {
      EXPECT_LE(enc->spans[i - 1].begin, s.begin) << at;
    }
    for (size_t b = s.begin; b < s.end && b < text.size(); ++b) covered[b] = true;
    switch (shape) {
      case SpanShape::kTiles:
        EXPECT_LT(s.begin, s.end) << at;
        EXPECT_EQ(s.begin, tiled) << at;
        tiled = s.end;
        break;
      case SpanShape::kTilesWithPrefixes:
        if (s.begin == s.end) {
          EXPECT_EQ(s.begin, tiled) << at;
        } else if (!(i > 0 && s == last)) {
          EXPECT_EQ(s.begin, tiled) << at;
          tiled = s.end;
        }
        break;
      case SpanShape::kOverlapping:
        break;
    }
    if (s.begin < s.end) last = s;
  }
  if (shape != SpanShape::kOverlapping) {
    EXPECT_EQ(tiled, text.size()) << what;
  }
  for (size_t b = 0; b < text.size(); ++b) {
    const bool space = text[b] == ' ' || text[b] == '\t' || text[b] == '\n' || text[b] == '\r';
    if (!covered[b] && !(coverage == Coverage::kAllButWhitespace && space)) {
      ADD_FAILURE() << what << ": byte " << b << " is in no token's span";
      break;
    }
  }
  return *enc;
}

inline  // Expects `text` to encode to tokens spelt `pieces` with spans `spans`.
    void
    ExpectSpans(const Tokenizer& t, std::string_view text, const std::vector<std::string>& pieces,
                const std::vector<TokenSpan>& spans) {
  std::vector<int32_t> ids;
  for (const std::string& p : pieces) {
    ids.push_back(t.TokenId(p));
    ASSERT_GE(ids.back(), 0) << "no token '" << p << "'";
  }
  auto enc = t.EncodeWithOffsets(text);
  ASSERT_TRUE(enc.ok()) << enc.status().ToString();
  EXPECT_EQ(enc->ids, ids) << "'" << text << "'";
  ASSERT_EQ(enc->spans.size(), spans.size()) << "'" << text << "'";
  for (size_t i = 0; i < spans.size(); ++i) {
    EXPECT_EQ(enc->spans[i], spans[i])
        << "'" << text << "' token " << i << " '" << pieces[i] << "': [" << enc->spans[i].begin
        << ", " << enc->spans[i].end << ")";
  }
}

}  // namespace strata::data::testing
