// The CLI's wording of the engine's errors (tools/option_flags.h): backticked option names become
// the flags that set them; anything else is left as written.
#include "tools/option_flags.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace strata::tools {
namespace {

TEST(InFlagTerms, BacktickedOptionsBecomeTheirFlags) {
  EXPECT_EQ(InFlagTerms("raise `device_budget` to at least 3.25 GiB or lower `micro_batch`"),
            "raise --device-budget to at least 3.25 GiB or lower --micro-batch-size/--seq-len");
  EXPECT_EQ(InFlagTerms("use `param_home host|nvme` and `update_during_backward off`"),
            "use --offload-params host|nvme and --update-during-backward off");
  EXPECT_EQ(InFlagTerms("`grad_accum_steps` must be >= 1"), "--grad-accum-steps must be >= 1");
}

TEST(InFlagTerms, NamesWithoutAFlagAndPlainTextStayAsWritten) {
  EXPECT_EQ(InFlagTerms("raise `speculation_backup_bytes`"), "raise `speculation_backup_bytes`");
  EXPECT_EQ(InFlagTerms("no option here"), "no option here");
  EXPECT_EQ(InFlagTerms("an unpaired ` backtick"), "an unpaired ` backtick");
  EXPECT_EQ(InFlagTerms(""), "");
  EXPECT_EQ(FlagOfOption("nvme_paths"), "--nvme-path");
  EXPECT_EQ(FlagOfOption("seed"), "");
}

// The error of a number option's check as the command line prints it (after "--flag: "), or ""
// when the value passes.
std::string Refusal(const std::string& value, bool positive) {
  CLI::App app;
  double x = 1.0;
  app.add_option("--x", x)->check(positive ? PositiveNumber() : NonNegativeNumber());
  try {
    app.parse(std::vector<std::string>{value, "--x"});  // CLI11 reads the vector back to front
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  return "";
}

TEST(NumberChecks, SayWhatTheValueMustBeInOneShortLine) {
  EXPECT_EQ(Refusal("0.5", true), "");
  EXPECT_EQ(Refusal("3", false), "");
  EXPECT_EQ(Refusal("0", false), "");
  EXPECT_EQ(Refusal("0", true), "--x: must be > 0, got 0");
  EXPECT_EQ(Refusal("-1", true), "--x: must be > 0, got -1");
  EXPECT_EQ(Refusal("-1e-9", false), "--x: must be >= 0, got -1e-9");
  EXPECT_EQ(Refusal("inf", true), "--x: inf is not a finite number");
  EXPECT_EQ(Refusal("nan", false), "--x: nan is not a finite number");
  EXPECT_EQ(Refusal("1e400", true), "--x: 1e400 is not a finite number");
  EXPECT_EQ(Refusal("3x", true), "--x: 3x is not a number");
}

}  // namespace
}  // namespace strata::tools
