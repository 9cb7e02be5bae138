// A fuzz target's scratch file, for parsers that read a path: one file in a directory of this
// process's own (`strata_<target>_<pid>` under the temporary directory), removed at exit. The
// first call fixes the path; later calls return it.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

namespace strata::fuzz {

inline const std::string& ScratchFile(std::string_view target, std::string_view file_name) {
  static std::filesystem::path dir;
  static const std::string path = [&] {
    dir = std::filesystem::temp_directory_path() /
          ("strata_" + std::string(target) + "_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    });
    return (dir / std::string(file_name)).string();
  }();
  return path;
}

}  // namespace strata::fuzz
