// `strata train`: its flags (TrainFlags, tools/train_flags.h) defined on the command line, and
// the run: flags -> options (tools/train_setup.h), the plan, the training loop
// (tools/train_loop.h) with progress, evaluation, sampling and the summary JSON.
#pragma once

#include <CLI/CLI.hpp>

#include "base/status.h"
#include "tools/train_flags.h"

namespace strata::tools {

void AddTrainFlags(CLI::App& cmd, TrainFlags& f);
// Runs the whole job; a non-OK Status is printed by main as one line.
Status RunTrain(const TrainFlags& f);

}  // namespace strata::tools
