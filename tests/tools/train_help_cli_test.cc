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

}  // namespace
