// Runs the real `strata` binary (STRATA_BINARY, set by CMake) as a user would, for the CLI tests.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace strata::cli_test {

struct Result {
  int exit_code;
  std::string out;  // stdout
  std::string err;  // stderr
};

// `args` go through the shell (`strata ARGS 2>tmpfile`): quote accordingly. `shell_prefix`, when
// given, runs first in the same shell ("ulimit -v 1048576; ").
inline Result RunStrata(const std::string& args, const std::string& shell_prefix = "") {
  const auto dir = std::filesystem::temp_directory_path();
  const std::string err_file = (dir / ("strata_cli_err_" + std::to_string(::getpid()))).string();
  const std::string cmd = shell_prefix + std::string(STRATA_BINARY) + " " + args + " 2>" + err_file;
  Result r{-1, "", ""};
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream e(err_file);
  r.err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
  std::filesystem::remove(err_file);
  return r;
}

inline int Lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

}  // namespace strata::cli_test
