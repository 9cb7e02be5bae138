// base/untrusted_text.h: JSON refused past the nesting limit before anything deep is built,
// and excerpts of a file's values that stay one bounded line without control characters.
#include "base/untrusted_text.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace strata {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string Nested(int depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

TEST(ParseJsonBounded, AcceptsNestingUpToTheLimit) {
  auto j = ParseJsonBounded(Nested(kMaxJsonDepth));
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_TRUE(j->is_array());
}

TEST(ParseJsonBounded, RefusesNestingPastTheLimitSayingTheLimit) {
  auto j = ParseJsonBounded(Nested(kMaxJsonDepth + 1));
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(j.status().message(), HasSubstr("nested deeper than 64 levels (the limit)"));
}

TEST(ParseJsonBounded, RefusesAHundredThousandLevelsNamingWhere) {
  auto j = ParseJsonBounded("{\"a\":" + Nested(100000));
  ASSERT_FALSE(j.ok());
  EXPECT_THAT(j.status().message(), HasSubstr("(the limit) under /a/0/0/0/..."));
  EXPECT_LT(j.status().message().size(), 100u);
}

TEST(ParseJsonBounded, NamesTheSyntaxErrorInOneBoundedLine) {
  // A string with a raw newline: nlohmann quotes the whole token read so far.
  auto j = ParseJsonBounded("{\"a\": \"" + std::string(100000, 'x') + "\n\"}");
  ASSERT_FALSE(j.ok());
  EXPECT_THAT(j.status().message(), HasSubstr("malformed JSON: parse error at line"));
  EXPECT_THAT(j.status().message(), Not(HasSubstr("[json.exception")));
  EXPECT_LT(j.status().message().size(), 400u);
  EXPECT_EQ(j.status().message().find('\n'), std::string::npos);
}

TEST(ParseJsonBounded, RefusesANumberBeyondDoubleRange) {
  auto j = ParseJsonBounded("{\"eps\": 1e999}");
  ASSERT_FALSE(j.ok());
  EXPECT_THAT(j.status().message(), HasSubstr("1e999"));
}

TEST(Excerpt, EscapesNulAndControlCharactersAndBackslashes) {
  EXPECT_EQ(Excerpt(std::string("a\0b\n\x1b[31m\\", 10)), "a\\x00b\\x0A\\x1B[31m\\\\");
}

TEST(Excerpt, KeepsUtf8AndEscapesInvalidBytes) {
  EXPECT_EQ(Excerpt("\xC4\xA0the"), "\xC4\xA0the");
  EXPECT_EQ(Excerpt("\xFF"
                    "a"),
            "\\xFFa");
}

TEST(Excerpt, CutsALongValueAndSaysItsSize) {
  const std::string e = Excerpt(std::string(10 << 20, 'x'));
  EXPECT_LT(e.size(), 100u);
  EXPECT_THAT(e, HasSubstr("... (10485760 bytes)"));
}

TEST(JsonExcerpt, DoesNotRecurseIntoADeepValue) {
  // Built by hand, deeper than a parse would allow: the excerpt stops at the limit.
  nlohmann::json v = 1;
  for (int i = 0; i < 100000; ++i) v = nlohmann::json::array({std::move(v)});
  const std::string e = JsonExcerpt(v);
  EXPECT_LE(e.size(), kExcerptBytes + 3);
  EXPECT_THAT(e, HasSubstr("[[["));
}

TEST(JsonExcerpt, EscapesControlCharactersOfAString) {
  EXPECT_EQ(JsonExcerpt(nlohmann::json(std::string("a\0b", 3))), "\"a\\u0000b\"");
  // DEL, which JSON leaves unescaped (found by tokenizer_json_fuzz: a key holding it was quoted
  // raw into a message), and in an object's key.
  EXPECT_EQ(JsonExcerpt(nlohmann::json(std::string{'a', '\x7f', 'b'})), "\"a\\u007fb\"");
  EXPECT_EQ(JsonExcerpt(nlohmann::json::parse("{\"k\\u007f\": 1}")), "{\"k\\u007f\":1}");
}

TEST(JsonPointerChild, EscapesTildeAndSlash) {
  EXPECT_EQ(JsonPointerChild("/model/vocab", "a/b~c"), "/model/vocab/a~1b~0c");
  EXPECT_EQ(JsonPointerChild("/added_tokens", size_t{3}), "/added_tokens/3");
}

}  // namespace
}  // namespace strata
