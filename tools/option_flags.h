// The engine's and the plan's errors name their options, not the CLI's flags: the C++ package and
// Python reach the engine without flags. An option appears in a message in backticks
// (`device_budget`, `param_home host|nvme`). The CLI reports such a message in its own terms: each
// backticked option name becomes the flag that sets it (--device-budget, --offload-params
// host|nvme); names without a flag are left as they are.
//
// Thread-safety: pure functions.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <string_view>

namespace strata::tools {

// Checks of a number option's value for CLI11's `check`: "--lr: must be > 0, got -1" and
// "--save-every: must be >= 0, got -1"; a value that is not finite is refused as main.cc refuses
// it ("--lr: inf is not a finite number"). CLI11's own CLI::PositiveNumber and
// CLI::NonNegativeNumber are ranges up to DBL_MAX, whose error printed all of its 309 digits
// (and "Value 0 not in range 0.000000 to ..." for PositiveNumber, whose bound is DBL_MIN).
CLI::Validator PositiveNumber();
CLI::Validator NonNegativeNumber();

// `message` with every `option` (backticked, optionally followed by values inside the backticks)
// replaced by the flag spelling, e.g. "raise `device_budget` to at least 3.25 GiB" -> "raise
// --device-budget to at least 3.25 GiB".
std::string InFlagTerms(std::string_view message);

// The flag that sets engine option `option` ("device_budget" -> "--device-budget"), or "" when
// no flag sets it.
std::string_view FlagOfOption(std::string_view option);

}  // namespace strata::tools
