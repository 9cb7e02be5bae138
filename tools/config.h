// `strata train --config FILE`: a DeepSpeed configuration file, taken as it is
// (https://www.deepspeed.ai/docs/config-json/), plus a "strata" section for what DeepSpeed has no
// key for. Every key DeepSpeed documents is one of:
//   mapped   it sets what it sets in DeepSpeed (the README's table, and the list below);
//   a no-op  accepted, and named in one "config: ..." line that RunTrain prints, grouped by why it
//            has no meaning here (communication and partitioning tunables on one device, features
//            Strata does not have, logging services it does not write to);
// and a key DeepSpeed does not know is rejected. Every problem of a file is reported in one error,
// one line per problem, each naming its JSON path.
//
// What a file means follows DeepSpeed, not Strata's flag defaults:
//   precision      fp16 / bf16 when that section says "enabled": true, else fp32;
//   placement      zero_optimization.offload_param.device cpu -> params in pinned host memory,
//                  nvme -> on NVMe, none or absent (or a stage below 3, where DeepSpeed ignores
//                  offload_param) -> every block resident on the device; offload_optimizer.device
//                  cpu -> host, nvme -> NVMe (stage 3 only, as DeepSpeed), none or absent (or
//                  stage 0) -> the device, as DeepSpeed (--offload-optimizer device: fused update
//                  kernels there; a note says so);
//   learning rate  scheduler.type WarmupLR / WarmupDecayLR / WarmupCosineLR with their params
//                  (tools/lr_schedule.h); an optimizer section and no scheduler: the constant
//                  optimizer.params.lr; neither section: Strata's own schedule;
//   fp16 scaling   dynamic from 2^initial_scale_power (16), window 1000, hysteresis 2, min 1
//                  unless given; loss_scale > 0 is a static scale;
//   aio            a present section fills its missing keys with DeepSpeed's defaults (block 1 MiB,
//                  queue depth 8, 1 thread); thread_count (old name) or intra_op_parallelism (new)
//                  is parallelism within each request: posix worker threads, and on io_uring
//                  queue_depth x threads pieces in flight, as DeepSpeed keeps in flight.
//   monitors       tensorboard / csv_monitor with "enabled": true write under
//                  output_path/job_name (--tensorboard-dir, --metrics-csv-dir);
//   batch          train_batch_size = micro-batch x accumulation (one process), checked or derived.
// Flags given on the command line override the file (AddTrainFlags registers --config first and
// CLI11 runs option callbacks in registration order).
//
// The "strata" section: io_backend ("auto" | "uring" | "posix"), device ("auto" | "host" |
// "cuda"), device_budget (size string, "auto" or bytes), model, data, summary_json (strings),
// steps, seq_len, seed, warmup_steps, eval_every, eval_batches, sample_bytes (integers),
// copy_bandwidth (bytes/s, host device only), io_queue_depth, io_block_size, io_threads (Strata's
// own I/O settings, unscaled: what `strata iobench --sweep` prints), update_during_backward
// ("on" | "off" | "auto", or a boolean), schedule ("auto" | "layer-major" | "micro-batch-major",
// --schedule).
//
// Errors (kInvalidArgument, except kNotFound / kPermissionDenied for a file that cannot be read):
//   "run.json: unknown key 'zero_optimization.overlap_com' (did you mean 'overlap_comm'?)"
//   "run.json: 3 problems:\n  'aio.queue_depth' must be an integer in 1..4096, got 0\n  ..."
//   "run.json: malformed JSON: parse error at line 3, column 5: ..."
// On error *flags may be partly updated; callers stop.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <string>
#include <string_view>

#include "base/status.h"
#include "tools/train_command.h"

namespace strata::tools {

// Reads the file at `path` and applies it onto *flags (see above); notes go to flags->config_notes.
Status ApplyTrainConfigFile(const std::string& path, TrainFlags* flags);

// Applies JSON text; `source` names it in error messages (normally the file name).
Status ApplyTrainConfigText(std::string_view text, std::string_view source, TrainFlags* flags);

}  // namespace strata::tools
