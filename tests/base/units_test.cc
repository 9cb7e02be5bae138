#include "base/units.h"

#include <gtest/gtest.h>

namespace strata {
namespace {

TEST(ParseSize, AcceptsBinaryAndDecimalUnits) {
  EXPECT_EQ(*ParseSize("4096"), 4096u);
  EXPECT_EQ(*ParseSize("1e9"), 1000000000u);
  EXPECT_EQ(*ParseSize("512MiB"), 512u << 20);
  EXPECT_EQ(*ParseSize("8GiB"), 8ull << 30);
  EXPECT_EQ(*ParseSize("2GB"), 2000000000u);
  EXPECT_EQ(*ParseSize("1.5KiB"), 1536u);
  EXPECT_EQ(*ParseSize("64KB"), 64000u);
  EXPECT_EQ(*ParseSize("0"), 0u);
}

TEST(ParseSize, RejectsMalformedInputWithAMessageNamingIt) {
  for (const char* bad : {"", "abc", "12XB", "-5", "1.5", "1e", "GiB", "1..2MiB", "1e30TiB"}) {
    auto r = ParseSize(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(std::string("'") + bad + "'"), std::string::npos);
  }
  // A control character in the text is quoted escaped (found by parse_size_fuzz: "1\05GB").
  const auto r = ParseSize(std::string{'1', '\0', '5', 'G', 'B'});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().rfind("bad size '1\\x005GB': unknown unit '\\x005GB';", 0), 0u)
      << r.status().message();
  EXPECT_EQ(ParseSize("1G\tB").status().message().find('\t'), std::string::npos);
}

TEST(FormatBytes, SaysWhichUnit) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(3 * kGiB / 2), "1.50 GiB");
  EXPECT_EQ(FormatBytes(312 * kMiB), "312.0 MiB");
}

// FormatBytesUp never shows less than the size (a minimum the user must give); FormatBytes rounds
// to nearest.
TEST(FormatBytesUp, RoundsUpAtTheShownDigit) {
  EXPECT_EQ(FormatBytes(57 * kMiB - 3584), "57.0 MiB");
  EXPECT_EQ(FormatBytesUp(57 * kMiB - 3584), "57.0 MiB");
  EXPECT_EQ(FormatBytesUp(57 * kMiB + 1), "57.1 MiB");
  EXPECT_EQ(FormatBytes(57 * kMiB + 1), "57.0 MiB");
  EXPECT_EQ(FormatBytesUp(kGiB), "1.00 GiB");
  EXPECT_EQ(FormatBytesUp(kGiB + 1), "1.01 GiB");
  EXPECT_EQ(FormatBytesUp(1023), "1023 B");
  EXPECT_EQ(FormatBytesUp(1025), "1.1 KiB");
}

}  // namespace
}  // namespace strata
