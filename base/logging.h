// Logging through spdlog's default logger (stderr). Library code logs sparingly:
// backend choices once, warnings about fallbacks. Levels are set by tools/.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

namespace strata {

enum class LogLevel { kDebug, kInfo, kWarning, kError, kOff };

// Sets the level and a compact "[strata] level: message" pattern on stderr.
// Thread-safe; called by tools/ at start.
void SetLogLevel(LogLevel level);

}  // namespace strata

#define STRATA_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define STRATA_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define STRATA_LOG_WARNING(...) ::spdlog::warn(__VA_ARGS__)
#define STRATA_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
