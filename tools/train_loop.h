// `strata train`'s loop, after the setup (tools/train_setup.h): the steps with their progress
// line, metrics, wall_clock_breakdown lines, periodic validation and checkpoints; then the last
// update's flush, the final validation, the master weights' hash, the sample and the time lines.
// The caller writes the summary from the outcome.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "base/status.h"
#include "base/trace.h"
#include "data/dataset.h"
#include "engine/engine.h"
#include "engine/preference_objective.h"
#include "tools/metrics.h"
#include "tools/model_spec.h"
#include "tools/train_setup.h"

namespace strata::tools {

// What the loop uses; not owned, all outlive the call.
struct TrainLoopInputs {
  const TrainOptions* options = nullptr;
  engine::Engine* engine = nullptr;
  const engine::Model* model = nullptr;
  const data::TrainingData* data = nullptr;
  const ModelSpec* spec = nullptr;           // written into checkpoints
  trace::TraceRecorder* recorder = nullptr;  // the engine's and the device's
  MetricsWriter* metrics = nullptr;          // may be null: no metrics
  // For MFU (engine/plan/model_flops.h): the model FLOPs per token, and the dense bf16 peak of
  // one device in TFLOP/s (the --machine profile's device.peak_bf16_TFLOPs; 0: unknown, no MFU).
  int64_t model_flops_per_token = 0;
  double peak_bf16_TFLOPs = 0;
};

// What the summary reports (tools/train_command.cc).
struct TrainOutcome {
  int64_t start_step = 0;  // from --resume, else 0
  float loss_first = 0;    // NaN when no step ran
  float loss_last = 0;
  float val_loss = 0;  // NaN without --eval-every
  int64_t skipped = 0;
  // Targets the loss counted (other than data::kIgnoreTarget) over the global batches of the
  // steps run (every rank draws the whole global batch, so each counts the job's total).
  int64_t tokens_in_loss = 0;
  double train_seconds = 0;  // wall time of the steps, evaluation excluded
  double tokens_per_second = 0;
  // tokens_per_second's model FLOP utilisation per device; nullopt without a device peak.
  std::optional<double> mfu;
  // Busy seconds per part over the timed engine calls (steps and their flushes), and their sum.
  trace::Breakdown parts;
  double step_seconds = 0;
  std::string last_checkpoint;      // empty when none was saved
  uint64_t master_hash = 0;         // xxh3 of the master weights
  engine::EngineCounters counters;  // after the last flush, before the final validation
  // Preference training: the last step's metrics and the final validation's (loss_* and
  // val_loss are then the preference loss).
  std::optional<engine::PreferenceMetrics> train_preference, val_preference;
};

// The largest part / step time: 1.0 when everything else hides under the largest part.
double OverlapEfficiency(const trace::Breakdown& parts, double step_seconds);

// Runs steps from the checkpoint's (--resume) or 0 to --steps, on the calling thread; prints to
// stdout. Errors: the engine's, the metrics writer's, a checkpoint's, writing the trace; and
// kCancelled when a stop signal arrived (after the checkpoint --save-on-signal asks for).
StatusOr<TrainOutcome> RunTrainLoop(const TrainLoopInputs& in);

}  // namespace strata::tools
