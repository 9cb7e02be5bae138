// `strata train --config FILE`: a JSON training config in the DeepSpeed layout
// (https://www.deepspeed.ai/docs/config-json/), restricted to the keys that have a meaning for
// Strata, plus a "strata" section for what DeepSpeed has no key for.
//
// Accepted keys (JSON path -> TrainFlags field; anything else is rejected by its path):
//   train_micro_batch_size_per_gpu          -> micro_batch_size            integer >= 1
//   gradient_accumulation_steps             -> grad_accum_steps            integer >= 1
//   train_batch_size                        (one process: must equal micro-batch * accumulation;
//                                            when one of them is missing it is derived, when both
//                                            are, micro-batch = train_batch_size, accumulation 1)
//   gradient_clipping                       -> grad_clip                   number >= 0 (0 = off)
//   steps_per_print                         -> log_every                   integer >= 0
//   fp16.enabled, bf16.enabled              -> precision: "fp16" / "bf16"; both present and false
//                                              -> "fp32"; both true is an error
//   fp16.loss_scale                         0 = dynamic (default), > 0 = this static scale
//   fp16.initial_scale_power                -> fp16_initial_scale = 2^p     integer 0..24
//   fp16.loss_scale_window                  -> fp16_scale_window           integer >= 1
//   fp16.min_loss_scale                     -> fp16_min_scale              number > 0
//   optimizer.type                          -> optimizer: "AdamW" | "Adam" | "AdamW8bit" |
//                                            "Adafactor" | "Lion" | "SGD" | "Adagrad"
//                                            (case-insensitive). As in DeepSpeed, "Adam" means
//                                            decoupled weight decay (AdamW) unless
//                                            optimizer.params.adam_w_mode is false (then L2).
//   optimizer.params.lr                     -> lr (peak of the warmup + cosine schedule) > 0
//   optimizer.params.betas                  -> adam_beta1, adam_beta2      [b1, b2], each in [0, 1)
//   optimizer.params.eps                    -> adam_eps                    number >= 0
//   optimizer.params.weight_decay           -> weight_decay                number >= 0
//   optimizer.params.bias_correction        -> adam_bias_correction        bool
//   optimizer.params.adam_w_mode            bool (type "Adam" only)
//   optimizer.params.momentum               -> momentum                    number >= 0 (SGD only)
//   zero_optimization.stage                 3 only (Strata partitions and streams parameters,
//                                            gradients and optimizer state like ZeRO-3)
//   zero_optimization.offload_optimizer.device      "cpu" -> "host", "nvme"; -> offload_optimizer
//   zero_optimization.offload_param.device          "cpu" -> "host", "nvme", "none" -> "device";
//                                                    -> offload_params
//   zero_optimization.offload_{optimizer,param}.nvme_path   string or array of strings
//                                            -> nvme_paths (both sections must agree if both set)
//   zero_optimization.offload_{optimizer,param}.pin_memory  bool; accepted for compatibility:
//                                            Strata always stages transfers in pinned memory
//   aio.block_size                          -> io_block_size   bytes (integer or "1MiB"),
//                                              a multiple of 4096, at most 1 GiB
//   aio.queue_depth                         -> io_queue_depth  integer 1..4096
//   aio.thread_count                        -> io_threads      integer 1..256 (posix backend)
//   strata.io_backend                       "auto" | "uring" | "posix"
//   strata.device                           "auto" | "host" | "cuda"
//   strata.device_budget                    size string ("8GiB", "auto") or a byte count
//   strata.model, strata.data, strata.summary_json               strings
//   strata.steps, strata.seq_len, strata.seed, strata.warmup_steps, strata.eval_every,
//   strata.eval_batches, strata.sample_bytes                     integers (ranges as the flags)
//   strata.copy_bandwidth                   number >= 0 (bytes/s, host device only)
//
// The block `strata iobench --sweep` prints
//   {"aio": {"block_size": N, "queue_depth": N, "thread_count": N},
//    "strata": {"io_backend": "uring"|"posix"}}
// is a complete config on its own.
//
// Precedence: the file is applied first, then every flag given explicitly on the command line
// (AddTrainFlags registers --config before all other flags, and CLI11 runs option callbacks in
// registration order), so flags override the file and unset flags keep the file's values.
//
// Errors (all kInvalidArgument except a missing/unreadable file): the message starts with the
// file name and names the JSON path of the offending key:
//   "run.json: unknown key 'zero_optimization.offload_param.foo'; accepted: device, nvme_path,
//    pin_memory"
//   "run.json: 'aio.queue_depth' must be an integer in 1..4096, got 0"
//   "run.json: malformed JSON at line 3, column 5: ..."
// kNotFound / kPermissionDenied (via ErrnoToStatus) when the file cannot be opened. On error
// *flags may be partly updated; callers stop.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <string>
#include <string_view>

#include "base/status.h"
#include "tools/train_command.h"

namespace strata::tools {

// Reads the file at `path` and applies it onto *flags (see above).
Status ApplyTrainConfigFile(const std::string& path, TrainFlags* flags);

// Applies JSON text; `source` names it in error messages (normally the file name).
Status ApplyTrainConfigText(std::string_view text, std::string_view source, TrainFlags* flags);

}  // namespace strata::tools
