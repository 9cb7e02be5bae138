#include "base/units.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>

#include "base/untrusted_text.h"

namespace strata {

StatusOr<uint64_t> ParseSize(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError(
        fmt::format("bad size '{}': {}; write a byte count with an optional unit, e.g. 4096, 1e9, "
                    "512MiB, 8GiB, 2GB (GB = 1e9 bytes, GiB = 2^30)",
                    Excerpt(text), why));
  };
  if (text.empty()) return bad("it is empty");
  size_t i = 0;
  while (i < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.' || text[i] == 'e' ||
          text[i] == 'E' || text[i] == '+' || (text[i] == '-' && i > 0))) {
    ++i;
  }
  // "1e9" vs a unit starting with 'E' (none exists): digits/exponent consumed above.
  std::string_view number = text.substr(0, i);
  std::string_view unit = text.substr(i);
  if (!number.empty() && text[0] == '-') return bad("it is negative");
  if (number.empty()) return bad(text[0] == '-' ? "it is negative" : "it has no number");
  double value = 0;
  auto [ptr, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
  if (ec != std::errc() || ptr != number.data() + number.size() || !std::isfinite(value)) {
    return bad("the number is malformed");
  }
  if (value < 0) return bad("it is negative");
  double mult;
  if (unit.empty() || unit == "B")
    mult = 1;
  else if (unit == "KB" || unit == "kB")
    mult = 1e3;
  else if (unit == "MB")
    mult = 1e6;
  else if (unit == "GB")
    mult = 1e9;
  else if (unit == "TB")
    mult = 1e12;
  else if (unit == "KiB")
    mult = static_cast<double>(kKiB);
  else if (unit == "MiB")
    mult = static_cast<double>(kMiB);
  else if (unit == "GiB")
    mult = static_cast<double>(kGiB);
  else if (unit == "TiB")
    mult = static_cast<double>(kGiB) * 1024.0;
  else
    return bad(fmt::format("unknown unit '{}'", Excerpt(unit)));
  double bytes = value * mult;
  if (bytes >= 18446744073709551615.0) return bad("it is too large");
  if (bytes != std::floor(bytes)) return bad("it is not a whole number of bytes");
  return static_cast<uint64_t>(bytes);
}

std::string FormatBytes(uint64_t n) {
  const double d = static_cast<double>(n);
  if (n >= kGiB) return fmt::format("{:.2f} GiB", d / kGiB);
  if (n >= kMiB) return fmt::format("{:.1f} MiB", d / kMiB);
  if (n >= kKiB) return fmt::format("{:.1f} KiB", d / kKiB);
  return fmt::format("{} B", n);
}

std::string FormatBytesUp(uint64_t n) {
  const double d = static_cast<double>(n);
  const auto up = [](double x, double scale) { return std::ceil(x * scale) / scale; };
  if (n >= kGiB) return fmt::format("{:.2f} GiB", up(d / kGiB, 100));
  if (n >= kMiB) return fmt::format("{:.1f} MiB", up(d / kMiB, 10));
  if (n >= kKiB) return fmt::format("{:.1f} KiB", up(d / kKiB, 10));
  return fmt::format("{} B", n);
}

std::string FormatRate(double bps) {
  if (bps >= 1e9) return fmt::format("{:.2f} GB/s", bps / 1e9);
  if (bps >= 1e6) return fmt::format("{:.1f} MB/s", bps / 1e6);
  if (bps >= 1e3) return fmt::format("{:.1f} kB/s", bps / 1e3);
  return fmt::format("{:.0f} B/s", bps);
}

}  // namespace strata
