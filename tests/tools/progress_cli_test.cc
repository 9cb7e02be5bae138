// `strata train`'s progress output as a user sees it: the real binary under a pseudo-terminal
// (the live line) and under pipes (plain lines only).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pty.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "run_strata.h"

namespace {

struct PtyRun {
  int exit_code = -1;
  std::string terminal;  // every byte the pseudo-terminal got, output post-processing off
};

// Runs `strata args...` with stdin, stdout and stderr on a new pseudo-terminal of `columns`
// columns, or with stdout to `stdout_file` when that is not empty. Reads until the child
// closes the terminal.
PtyRun RunOnTerminal(const std::vector<std::string>& args, int columns,
                     const std::string& stdout_file = "") {
  std::vector<std::string> argv_storage = {STRATA_BINARY};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);

  PtyRun run;
  winsize ws{};
  ws.ws_row = 24;
  ws.ws_col = static_cast<unsigned short>(columns);
  int master = -1;
  const pid_t pid = ::forkpty(&master, nullptr, nullptr, &ws);
  if (pid < 0) return run;
  if (pid == 0) {
    // Bytes as the program wrote them: no "\n" -> "\r\n".
    termios t{};
    if (::tcgetattr(STDIN_FILENO, &t) == 0) {
      t.c_oflag &= ~static_cast<tcflag_t>(OPOST);
      ::tcsetattr(STDIN_FILENO, TCSANOW, &t);
    }
    if (!stdout_file.empty()) {
      const int fd = ::open(stdout_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (fd < 0 || ::dup2(fd, STDOUT_FILENO) < 0) ::_exit(126);
      ::close(fd);
    }
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(master, buf, sizeof buf);
    if (n > 0) {
      run.terminal.append(buf, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;  // EIO once the child's side is closed
    }
  }
  ::close(master);
  int status = 0;
  ::waitpid(pid, &status, 0);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

// The live line's draws: text from a `\r` to the `\x1b[K` that ends it, and what follows.
struct Draw {
  size_t pos;  // of the '\r'
  std::string text;
  bool newline;  // a '\n' right after the `\x1b[K`
};
std::vector<Draw> Draws(const std::string& s) {
  std::vector<Draw> draws;
  size_t pos = 0;
  while ((pos = s.find('\r', pos)) != std::string::npos) {
    const size_t end = s.find("\x1b[K", pos);
    if (end == std::string::npos) break;
    const std::string text = s.substr(pos + 1, end - pos - 1);
    if (!text.empty() && text.find('\n') == std::string::npos) {
      draws.push_back({pos, text, s.compare(end + 3, 1, "\n") == 0});
    }
    pos = end + 3;
  }
  return draws;
}

// Five slow steps of the tiny model (copies throttled to 2 MB/s: well over 0.1 s a step, so
// every step is redrawn), state in host memory; micro-batch-major, whose 8 loads of every block
// per step keep the step slow (layer-major's 2 may not).
std::vector<std::string> FiveSteps(const std::string& log_every) {
  return {"train",
          "--data",
          STRATA_DATA,
          "--model",
          "tiny",
          "--seq-len",
          "16",
          "--steps",
          "5",
          "--eval-every",
          "0",
          "--sample-bytes",
          "0",
          "--log-every",
          log_every,
          "--device",
          "host",
          "--copy-bandwidth",
          "2e6",
          "--offload-params",
          "host",
          "--offload-optimizer",
          "host",
          "--schedule",
          "micro-batch-major"};
}

bool StartsWith(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

TEST(ProgressCli, OnATerminalTheLiveLineIsRedrawnInPlaceAndEndsWithANewline) {
  const int columns = 200;
  const PtyRun run = RunOnTerminal(FiveSteps("5"), columns);
  ASSERT_EQ(run.exit_code, 0) << run.terminal;
  const std::vector<Draw> draws = Draws(run.terminal);
  ASSERT_GE(draws.size(), 3u) << run.terminal;
  // In-place redraws: consecutive draws of "step N/5" with no newline between them.
  int in_place = 0;
  for (size_t i = 0; i + 1 < draws.size(); ++i) {
    const std::string between = run.terminal.substr(draws[i].pos, draws[i + 1].pos - draws[i].pos);
    if (between.find('\n') == std::string::npos && StartsWith(draws[i].text, "step ") &&
        StartsWith(draws[i + 1].text, "step ")) {
      ++in_place;
    }
  }
  EXPECT_GE(in_place, 2) << run.terminal;
  for (const Draw& d : draws) {
    EXPECT_LT(static_cast<int>(d.text.size()), columns) << d.text;
    EXPECT_NE(d.text.find("/5 | loss "), std::string::npos) << d.text;
  }
  // --log-every 5: step 1 is committed (kept in the scrollback), 2..4 are redrawn in place.
  EXPECT_TRUE(StartsWith(draws.front().text, "step 1/5 |")) << draws.front().text;
  EXPECT_TRUE(draws.front().newline);
  const Draw& last = draws.back();
  EXPECT_TRUE(StartsWith(last.text, "step 5/5 |")) << last.text;
  EXPECT_NE(last.text.find("ETA 0s"), std::string::npos) << last.text;
  EXPECT_TRUE(last.newline) << "the progress must end with a newline";
  // Both stdout and stderr are the terminal: the plain lines would repeat the live line.
  EXPECT_EQ(run.terminal.find("step     1/5 |"), std::string::npos) << run.terminal;
  // The closing line starts on its own line, after the finished progress line.
  const size_t done = run.terminal.find("done: 5 steps");
  ASSERT_NE(done, std::string::npos) << run.terminal;
  ASSERT_GT(done, last.pos);
  EXPECT_EQ(run.terminal[done - 1], '\n');
  EXPECT_EQ(run.terminal.find('\r', last.pos + 1), std::string::npos)
      << "nothing is drawn after the progress is finished";
}

TEST(ProgressCli, WithLogEveryZeroTheLiveLineIsNeverCommittedButStillEndsBeforeTheSummary) {
  const PtyRun run = RunOnTerminal(FiveSteps("0"), 200);
  ASSERT_EQ(run.exit_code, 0) << run.terminal;
  const std::vector<Draw> draws = Draws(run.terminal);
  ASSERT_GE(draws.size(), 3u) << run.terminal;
  for (size_t i = 0; i + 1 < draws.size(); ++i) EXPECT_FALSE(draws[i].newline) << draws[i].text;
  EXPECT_TRUE(StartsWith(draws.back().text, "step 5/5 |")) << draws.back().text;
  EXPECT_TRUE(draws.back().newline);
  const size_t done = run.terminal.find("done: 5 steps");
  ASSERT_NE(done, std::string::npos) << run.terminal;
  EXPECT_GT(done, draws.back().pos);
  EXPECT_EQ(run.terminal[done - 1], '\n');
}

TEST(ProgressCli, ValidationLinesClearTheLiveLineAndItIsRedrawnAfter) {
  std::vector<std::string> args = FiveSteps("0");
  *(std::find(args.begin(), args.end(), "--eval-every") + 1) = "2";
  args.insert(args.end(), {"--eval-batches", "1"});
  const PtyRun run = RunOnTerminal(args, 200);
  ASSERT_EQ(run.exit_code, 0) << run.terminal;
  for (const char* step : {"2", "4"}) {
    const std::string val = std::string("step     ") + step + " | val loss ";
    const size_t at = run.terminal.find(val);
    ASSERT_NE(at, std::string::npos) << val << run.terminal;
    ASSERT_GE(at, 4u);
    EXPECT_EQ(run.terminal.substr(at - 4, 4), "\r\x1b[K") << "not cleared before " << val;
    const size_t eol = run.terminal.find('\n', at);
    ASSERT_NE(eol, std::string::npos);
    // Redrawn after: the next draw shows the step the validation followed.
    EXPECT_EQ(run.terminal.compare(eol + 1, 9, std::string("\rstep ") + step + "/5"), 0)
        << run.terminal.substr(eol + 1, 40);
  }
}

TEST(ProgressCli, OnANarrowTerminalTheLiveLineIsCutToTheWidth) {
  const int columns = 40;
  const PtyRun run = RunOnTerminal(FiveSteps("2"), columns);
  ASSERT_EQ(run.exit_code, 0) << run.terminal;
  const std::vector<Draw> draws = Draws(run.terminal);
  ASSERT_GE(draws.size(), 5u) << run.terminal;
  for (const Draw& d : draws) {
    EXPECT_LT(static_cast<int>(d.text.size()), columns) << d.text;
    EXPECT_TRUE(StartsWith(d.text, "step ")) << d.text;
    EXPECT_EQ(d.text.find("nvme"), std::string::npos) << d.text;  // cut before the bytes
  }
  // --log-every 2: steps 1, 2, 4 and 5 committed.
  std::vector<std::string> committed;
  for (const Draw& d : draws) {
    if (d.newline) committed.push_back(d.text.substr(0, d.text.find(" |")));
  }
  EXPECT_EQ(committed, (std::vector<std::string>{"step 1/5", "step 2/5", "step 4/5", "step 5/5"}));
}

TEST(ProgressCli, StdoutToAFileGetsThePlainLinesWhileTheTerminalGetsTheLiveLine) {
  const auto log =
      std::filesystem::temp_directory_path() / ("strata_progress_" + std::to_string(::getpid()));
  const PtyRun run = RunOnTerminal(FiveSteps("2"), 120, log.string());
  std::ifstream in(log);
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(log);
  ASSERT_EQ(run.exit_code, 0) << run.terminal << out;
  EXPECT_EQ(out.find('\r'), std::string::npos) << out;
  EXPECT_EQ(out.find('\x1b'), std::string::npos) << out;
  for (const char* line : {"\nstep     1/5 | loss ", "\nstep     2/5 | loss ",
                           "\nstep     4/5 | loss ", "\nstep     5/5 | loss "}) {
    EXPECT_NE(out.find(line), std::string::npos) << line << "\n" << out;
  }
  EXPECT_EQ(out.find("step     3/5"), std::string::npos) << out;
  EXPECT_NE(out.find("\ndone: 5 steps"), std::string::npos) << out;
  // stderr, the terminal, has the live line and nothing else from the run.
  const std::vector<Draw> draws = Draws(run.terminal);
  ASSERT_GE(draws.size(), 2u) << run.terminal;
  EXPECT_TRUE(StartsWith(draws.back().text, "step 5/5 |")) << draws.back().text;
  EXPECT_TRUE(draws.back().newline);
  EXPECT_EQ(run.terminal.find("done:"), std::string::npos) << run.terminal;
}

TEST(ProgressCli, WithoutATerminalOnlyPlainLinesAndNoControlCharacters) {
  std::string args;
  for (const std::string& a : FiveSteps("2")) args += " '" + a + "'";
  const strata::cli_test::Result r = strata::cli_test::RunStrata(args);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const std::string* s : {&r.out, &r.err}) {
    EXPECT_EQ(s->find('\r'), std::string::npos) << *s;
    EXPECT_EQ(s->find('\x1b'), std::string::npos) << *s;
  }
  int progress_lines = 0;
  size_t pos = 0;
  while ((pos = r.out.find("\nstep ", pos)) != std::string::npos) {
    ++progress_lines;
    ++pos;
  }
  EXPECT_EQ(progress_lines, 4) << r.out;  // steps 1, 2, 4, 5
  EXPECT_NE(r.out.find("\nstep     5/5 | loss "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("ETA"), std::string::npos) << r.out;
}

}  // namespace
