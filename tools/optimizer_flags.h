// `strata train --optimizer` and its hyper-parameters -> the engine's optimizer, and the
// learning-rate schedule (linear warmup, cosine decay to 10 % of the peak). Every function is
// pure (reads only its arguments) and thread-safe; rates are per step, unitless.
#pragma once

#include <cstdint>
#include <string_view>

#include "base/status.h"
#include "cpu_optim/any_optimizer.h"
#include "tools/lr_schedule.h"
#include "tools/train_command.h"

namespace strata::tools {

// The peak learning rate of --optimizer when --lr is not given, chosen on the default run (the
// small GPT on tinyshakespeare, 300 steps): 3e-3 for adamw, adam and adamw8bit; 1.5e-3 for
// adafactor (no first moment: a noisier update wants a smaller step); 3e-4 for lion (sign
// updates, as its paper advises 3-10x below AdamW's); 0.1 for sgd; 1e-2 for adagrad.
double DefaultLearningRate(std::string_view optimizer);
// f.lr, or DefaultLearningRate(f.optimizer) when it is 0.
double PeakLearningRate(const TrainFlags& f);
// The engine's optimizer from --optimizer and its hyper-parameters (lr = the schedule's first).
// kInvalidArgument naming an unknown optimizer or a hyper-parameter it rejects.
StatusOr<cpu_optim::AnyOptimizer> BuildOptimizer(const TrainFlags& f);
// The schedule of --lr-schedule and its parameters (tools/lr_schedule.h); kInvalidArgument
// naming a bad schedule or warmup type.
StatusOr<LrSchedule> MakeLrSchedule(const TrainFlags& f);
// The schedule's rate at 0-based step `step` (LearningRateAt of MakeLrSchedule; flags already
// validated).
float LearningRate(const TrainFlags& f, int64_t step);

}  // namespace strata::tools
