// Runs the real `strata` binary: `strata train --help` prints its options in sections (CLI11
// option groups, tools/train_command.cc TrainHelpGroups), every option in one of them.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "run_strata.h"

namespace {

using strata::cli_test::Result;
using strata::cli_test::RunStrata;

TEST(TrainHelpCli, EveryOptionIsInOneSectionAndTheSectionsPrintInOrder) {
  const Result r = RunStrata("train --help");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> expected = {"Data",
                                             "Preference training",
                                             "Model",
                                             "Batch and steps",
                                             "Optimizer",
                                             "Placement and memory",
                                             "I/O (NVMe)",
                                             "LoRA",
                                             "Logging and outputs",
                                             "Checkpoints"};
  const std::regex header(R"(^([A-Z][A-Za-z /()]*):\s*$)");
  const std::regex option(R"(^\s+(?:-[A-Za-z], )?(--[a-z0-9-]+))");
  std::istringstream in(r.out);
  std::string line, section;
  std::vector<std::string> sections;
  std::map<std::string, std::string> section_of;
  for (std::smatch m; std::getline(in, line);) {
    if (std::regex_match(line, m, header)) {
      section = m[1];
      sections.push_back(section);
    } else if (std::regex_search(line, m, option)) {
      section_of[m[1]] = section;
    }
  }
  // The default section (CLI11's "OPTIONS") keeps only --help and --config.
  for (const auto& [flag, in_section] : section_of) {
    if (flag == "--help" || flag == "--config") continue;
    EXPECT_NE(std::find(expected.begin(), expected.end(), in_section), expected.end())
        << flag << " is under '" << in_section << "'\n"
        << r.out;
  }
  EXPECT_GE(section_of.size(), 60u) << r.out;
  for (const char* flag : {"--data", "--device-budget", "--lora-rank", "--save-dir", "--lr",
                           "--nvme-path", "--summary-json", "--schedule", "--steps"}) {
    EXPECT_TRUE(section_of.count(flag)) << flag << "\n" << r.out;
  }
  std::vector<std::string> printed;
  for (const std::string& s : sections) {
    if (std::find(expected.begin(), expected.end(), s) != expected.end()) printed.push_back(s);
  }
  EXPECT_EQ(printed, expected) << r.out;
  EXPECT_EQ(section_of["--data"], "Data");
  EXPECT_EQ(section_of["--offload-optimizer"], "Placement and memory");
  EXPECT_EQ(section_of["--lora-alpha"], "LoRA");
  EXPECT_EQ(section_of["--beta"], "Preference training");
  EXPECT_EQ(section_of["--rpo-alpha"], "Preference training");
  EXPECT_EQ(section_of["--keep-last"], "Checkpoints");
}

// A flag error points to the help of the subcommand being read, and a number option given
// "nan" or "inf" is refused by name (CLI11 reads both as numbers and a range check passes NaN:
// `--lr nan` trained at the default rate).
TEST(TrainHelpCli, FlagErrorsPointToTheirSubcommandsHelpAndNonFiniteNumbersAreRefused) {
  for (const std::string sub : {"train", "doctor", "iobench", "inspect", "generate"}) {
    const Result r = RunStrata(sub + " --no-such-flag");
    EXPECT_EQ(r.exit_code, 1) << sub;
    EXPECT_NE(r.err.find("(see 'strata " + sub + " --help')"), std::string::npos) << r.err;
  }
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"train --lr nan --steps 1", "--lr: nan is not a finite number (see 'strata train --help')"},
      {"train --weight-decay -nan --steps 1", "--weight-decay: -nan is not a finite number"},
      {"train --grad-clip inf --steps 1", "--grad-clip: inf is not a finite number"},
      {"doctor --probe-seconds nan", "--probe-seconds: nan is not a finite number"},
      {"generate --model-dir x --prompt x --temperature NaN",
       "--temperature: NaN is not a finite"}};
  for (const auto& [args, message] : cases) {
    const Result r = RunStrata(args);
    EXPECT_EQ(r.exit_code, 1) << args;
    EXPECT_NE(r.err.find(message), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace
