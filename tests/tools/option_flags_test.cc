// The CLI's wording of the engine's errors (tools/option_flags.h): backticked option names become
// the flags that set them; anything else is left as written.
#include "tools/option_flags.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace strata::tools
