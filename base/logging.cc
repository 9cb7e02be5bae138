#include "base/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace strata {

void SetLogLevel(LogLevel level) {
  static auto logger = [] {
    auto l = spdlog::stderr_color_mt("strata");
    l->set_pattern("[strata] %l: %v");
    spdlog::set_default_logger(l);
    return l;
  }();
  switch (level) {
    case LogLevel::kDebug: logger->set_level(spdlog::level::debug); break;
    case LogLevel::kInfo: logger->set_level(spdlog::level::info); break;
    case LogLevel::kWarning: logger->set_level(spdlog::level::warn); break;
    case LogLevel::kError: logger->set_level(spdlog::level::err); break;
    case LogLevel::kOff: logger->set_level(spdlog::level::off); break;
  }
}

}  // namespace strata
