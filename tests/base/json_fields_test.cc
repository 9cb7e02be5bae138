// base/json_fields.h: each field read back with its type and range, or one line naming the file
// and the field; no number converted out of range, text from the file escaped.
#include "base/json_fields.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

namespace strata {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

const Json kObject = Json::parse(R"({
  "n": 7, "big": 18446744073709551615, "neg": -3, "f": 3.0, "huge": 1e300, "lr": 6.7e98,
  "s": "ab\u0001c", "b": true, "o": {"x": 1}, "ints": [1, 2, 3], "mixed": [1, 2.5],
  "hex": "00ff00ff00ff00fF", "short_hex": "12zz"
})");

TEST(JsonFields, IntsAreReadInRangeAndAnythingElseIsNamed) {
  const JsonFields f(kObject, "manifest", "engine");
  EXPECT_EQ(*f.Int("n", 0, 10), 7);
  EXPECT_EQ(f.Int("n", 8, 10).status().message(), "manifest: engine.n = 7 is outside [8, 10]");
  EXPECT_EQ(f.Int("n", 8, 10).status().code(), StatusCode::kDataLoss);
  // Beyond int64 and below zero.
  EXPECT_EQ(f.Int("big", 0, INT64_MAX).status().message(),
            "manifest: engine.big = 18446744073709551615 is outside [0, 9223372036854775807]");
  EXPECT_EQ(*f.Int("neg", -5, 0), -3);
  // A float is not an integer, even an integral one, and 1e300 is never converted.
  EXPECT_EQ(f.Int("f", 0, 10).status().message(), "manifest: engine.f is missing or not a number");
  EXPECT_FALSE(f.Int("huge", INT64_MIN, INT64_MAX).ok());
  EXPECT_EQ(f.Int("absent", 0, 1).status().message(),
            "manifest: engine.absent is missing or not a number");
}

TEST(JsonFields, ArraysOfIntsNameTheElement) {
  const JsonFields f(kObject, "state.json", "");
  EXPECT_EQ(*f.Ints("ints", 1, 3, 3), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(f.Ints("ints", 1, 3, 2).status().message(),
            "state.json: ints is not an array of at most 2 integers");
  EXPECT_EQ(f.Ints("ints", 2, 3, 8).status().message(),
            "state.json: ints[0] = 1 is not an integer in [2, 3]");
  EXPECT_EQ(f.Ints("mixed", 0, 9, 8).status().message(),
            "state.json: mixed[1] = 2.5 is not an integer in [0, 9]");
  EXPECT_EQ(f.Ints("n", 0, 9, 8).status().message(), "state.json: n is missing or not an array");
}

TEST(JsonFields, FloatsMustFitFp32) {
  const JsonFields f(kObject, "manifest", "optimizer");
  EXPECT_EQ(*f.Float("n"), 7.0f);
  EXPECT_EQ(*f.Float("f"), 3.0f);
  EXPECT_EQ(f.Float("lr").status().message(), "manifest: optimizer.lr = 6.7e+98 does not fit fp32");
  EXPECT_EQ(f.Float("s").status().message(), "manifest: optimizer.s is missing or not a number");
}

TEST(JsonFields, StringsBoolsObjectsAndHex) {
  const JsonFields f(kObject, "manifest", "files[0]");
  EXPECT_EQ(*f.String("s"),
            "ab\x01"
            "c");  // the value as it is; messages escape it
  EXPECT_TRUE(*f.Bool("b"));
  EXPECT_EQ(*f.ObjectText("o"), R"({"x":1})");
  EXPECT_EQ(*f.Hex64("hex"), 0x00ff00ff00ff00ffull);
  EXPECT_EQ(f.Hex64("short_hex").status().message(),
            "manifest: files[0].short_hex '12zz' is not 16 hex digits");
  EXPECT_EQ(f.Hex64("s").status().message(),
            "manifest: files[0].s 'ab\\x01c' is not 16 hex digits");
  EXPECT_EQ(f.Bool("n").status().message(), "manifest: files[0].n is missing or not a boolean");
}

TEST(JsonFields, NotAnObjectIsNamed) {
  const Json array = Json::array();
  EXPECT_EQ(JsonFields(array, "manifest", "model").String("x").status().message(),
            "manifest: model is not an object");
  EXPECT_EQ(JsonFields(array, "state.json", "").String("x").status().message(),
            "state.json: not a JSON object");
}

}  // namespace
}  // namespace strata
