// Byte sizes with units. GB means 1e9 bytes and GiB 2^30; output says which.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace strata {

inline constexpr uint64_t kKiB = 1ull << 10;
inline constexpr uint64_t kMiB = 1ull << 20;
inline constexpr uint64_t kGiB = 1ull << 30;

// Parses a size in bytes: "4096", "1e9", "512MiB", "8GiB", "1.5GB", "64KiB", "2TiB", "100B".
// Units (case-sensitive as written, 'B' optional after K/M/G/T only for the binary
// forms "KiB".."TiB"): B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers
// of 1024). Errors (kInvalidArgument, message names the text and the accepted forms):
// empty, malformed, negative, unknown unit, a fractional byte count, overflow. Zero
// parses as 0; callers that need a positive size check it themselves.
StatusOr<uint64_t> ParseSize(std::string_view text);

// "1.50 GiB", "312.0 MiB", "4.0 KiB", "512 B": binary units, for sizes of memory.
std::string FormatBytes(uint64_t size_bytes);
// FormatBytes rounded up at the digits it shows, for a size the user must give at least or a
// shortfall ("raise to at least 57.0 MiB" rounded to nearest was 3.5 KiB short).
std::string FormatBytesUp(uint64_t size_bytes);

// "2.41 GB/s": decimal units for throughput.
std::string FormatRate(double bytes_per_second);

// Rounds up to a multiple of `alignment` (a power of two).
constexpr uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) & ~(alignment - 1);
}

}  // namespace strata
