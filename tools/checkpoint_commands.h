// Checkpoint parts of the CLI: `strata train` checkpoint flags and stop signals, `strata inspect`
// and `strata export`.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>

#include "base/status.h"
#include "engine/engine.h"

namespace strata::tools {

// --save-dir, --save-every, --keep-last, --resume, --save-on-signal of `strata train`.
struct CheckpointFlags {
  std::string save_dir;
  int64_t save_every = 0;  // 0: only at the end (when save_dir is set)
  int keep_last = 0;       // 0: keep all
  std::string resume;      // a checkpoint dir, a save dir, or "latest" (= the --save-dir)
  bool save_on_signal = false;
};
void AddCheckpointFlags(CLI::App& cmd, CheckpointFlags& f);

// SIGINT / SIGTERM set a flag (and nothing else) that the training loop checks between steps,
// and the start before it (EngineOptions::cancel_requested, the reference pass) between blocks.
// `strata train` installs them before the engine makes its swap files, so that a signal at any
// point of a run removes them (the engine's destructor) and ends in one line.
void InstallStopSignalHandlers();
// The signal that asked to stop (SIGINT, SIGTERM), or 0.
int StopSignal();
// Data parallelism: a signal may reach one rank only (kill of one process, not of mpirun). The
// training loop all-reduces StopSignal() between steps; every rank then adopts the agreed signal
// here, so that all of them save (--save-on-signal) and stop after the same step, and
// StopSignalAgreed() says the job stops together (each rank ends with exit code 130/143, none
// aborts the job). `sig` 0 does nothing.
void AdoptStopSignal(int sig);
bool StopSignalAgreed();
// What a stop requested before the first step (a kCancelled `s` while StopSignal() is set) says
// in the run's words: "stopped by signal N while <what s says>; no step ran". Any other status
// as it is.
Status StoppedBeforeTheFirstStep(Status s);

// Trainer glue. The data position is the data sampler's std::mt19937_64.
struct TrainProgress {
  int64_t step = 0;  // optimizer steps completed
  int64_t tokens_seen = 0;
  const std::mt19937_64* data_rng = nullptr;
  std::string lr_schedule_json = "{}";
  std::string model_json = "{}";
};
// --resume: loads the checkpoint into `engine`, restores *data_rng, returns the step to continue
// from (prints one line saying from where). run_lr_schedule_json: this run's schedule
// (LrScheduleJson); where it differs from the one the checkpoint recorded (another --lr,
// --warmup-steps, --lr-schedule, or --steps, which stretches a decay), a second line names each
// difference: this run's schedule is the one followed. `run`: the options the engine was built
// with; where its optimizer settings differ from the checkpoint's (engine::
// UpdateSettingsDifferences: another --weight-decay, --beta2, --grad-clip or
// --decay-norms-and-biases), a note names each: this run's are used. kInvalidArgument for
// "latest" without --save-dir; the errors of engine::ReadManifest. *tokens_seen (when not null):
// the tokens the run had trained on by then, as its manifest recorded them (a resumed run may
// take another number of tokens per step).
StatusOr<int64_t> ResumeTraining(engine::Engine& engine, const CheckpointFlags& flags,
                                 std::mt19937_64* data_rng, std::string_view run_lr_schedule_json,
                                 const engine::EngineOptions& run, int64_t* tokens_seen = nullptr);
// Saves a checkpoint into --save-dir; returns its directory.
StatusOr<std::string> SaveTraining(engine::Engine& engine, const CheckpointFlags& flags,
                                   const TrainProgress& progress);

// `strata inspect DIR`: lists the tensors of a checkpoint (or of the one `latest` names in a save
// directory) and verifies every file's size and xxh3; the first mismatch is a kDataLoss error.
struct InspectFlags {
  std::string path;
};
void AddInspectFlags(CLI::App& cmd, InspectFlags& f);
Status RunInspect(const InspectFlags& f);

// `strata export --checkpoint DIR --hf-dir OUT [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]`:
// the master weights as a Hugging Face model directory (config.json, safetensors shards with an
// index above the shard size, the tokenizer files the run used) that transformers'
// from_pretrained loads, under the family's own tensor names and layouts (models/hf_export.h).
// `--safetensors OUT` instead: a byte-level GPT's weights as one file under GPT-2 names.
struct ExportFlags {
  std::string checkpoint;
  std::string out;          // --safetensors
  std::string hf_dir;       // --hf-dir
  std::string lora_dir;     // --lora-dir: a LoRA run's adapters as a PEFT adapter directory
  bool merge_lora = false;  // --hf-dir of a LoRA run: the base with the adapters merged
  std::string dtype = "fp32";
  std::string max_shard_size = "5GB";
};
void AddExportFlags(CLI::App& cmd, ExportFlags& f);
Status RunExport(const ExportFlags& f);

}  // namespace strata::tools
