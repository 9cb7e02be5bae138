#include "tools/deepspeed_keys.h"

#include <algorithm>
#include <string_view>
#include <vector>

namespace strata::tools {
namespace {

using Why = NoopReason;

}  // namespace

std::string_view NoopReasonText(NoopReason w) {
  switch (w) {
    case Why::kComm:
      return "communication between GPUs; one device has none";
    case Why::kPartition:
      return "ZeRO partitioning and bucketing tunables; Strata plans its buffers per block";
    case Why::kParallel:
      return "model, tensor, expert or pipeline parallelism; not in Strata";
    case Why::kFeature:
      return "DeepSpeed features Strata does not have";
    case Why::kMonitor:
      return "services Strata does not log to (it writes --tensorboard-dir, --metrics-jsonl)";
    case Why::kAlways:
      return "what Strata always does (pinned staging, pipelined and overlapped transfers)";
    case Why::kPrecision:
      return "Strata keeps fp32 master weights, fp32 optimizer state and fp32 accumulation";
    case Why::kNone:
      break;
  }
  return "";
}

namespace {

constexpr KeyTreatment M = KeyTreatment::kMapped, S = KeyTreatment::kSection,
                       N = KeyTreatment::kNoop, A = KeyTreatment::kNoopAny;

// clang-format off
constexpr DeepSpeedKey kKeys[] = {
    // Batch, clipping, logging.
    {"train_batch_size", M}, {"train_micro_batch_size_per_gpu", M},
    {"gradient_accumulation_steps", M}, {"gradient_clipping", M}, {"steps_per_print", M},
    {"wall_clock_breakdown", M}, {"dump_state", N, Why::kFeature},
    {"managed_gradient_accumulation", N, Why::kFeature},
    // Optimizer and scheduler: their params are checked per type.
    {"optimizer", S}, {"optimizer.type", M}, {"optimizer.params", M},
    {"optimizer.legacy_fusion", N, Why::kFeature},
    {"scheduler", S}, {"scheduler.type", M}, {"scheduler.params", M},
    {"zero_allow_untested_optimizer", N, Why::kFeature},
    {"zero_force_ds_cpu_optimizer", N, Why::kFeature},
    // Communication.
    {"communication_data_type", N, Why::kComm}, {"gradient_allreduce_op", N, Why::kComm},
    {"prescale_gradients", N, Why::kComm}, {"gradient_predivide_factor", N, Why::kComm},
    {"sparse_gradients", N, Why::kComm}, {"disable_allgather", N, Why::kComm},
    {"seq_parallel_communication_data_type", N, Why::kComm}, {"comms_config", A, Why::kComm},
    {"comms_logger", S, Why::kComm}, {"comms_logger.enabled", N, Why::kComm},
    {"comms_logger.verbose", N, Why::kComm}, {"comms_logger.prof_all", N, Why::kComm},
    {"comms_logger.debug", N, Why::kComm}, {"comms_logger.prof_ops", N, Why::kComm},
    // Precision.
    {"fp16", S}, {"fp16.enabled", M}, {"fp16.loss_scale", M}, {"fp16.initial_scale_power", M},
    {"fp16.loss_scale_window", M}, {"fp16.hysteresis", M}, {"fp16.consecutive_hysteresis", M},
    {"fp16.min_loss_scale", M}, {"fp16.auto_cast", N, Why::kAlways},
    {"fp16.fp16_master_weights_and_grads", N, Why::kPrecision},
    {"bf16", S}, {"bf16.enabled", M}, {"bf16.immediate_grad_update", N, Why::kAlways},
    {"bf16.check_grad_overflow", N, Why::kAlways},
    {"bf16.bf16_master_weights_and_grads", N, Why::kPrecision},
    {"bf16.bf16_optimizer_states", N, Why::kPrecision},
    // The bf16 section's old name (DeepSpeed's BFLOAT16_OLD), read the same way.
    {"bfloat16", S}, {"bfloat16.enabled", M}, {"bfloat16.immediate_grad_update", N, Why::kAlways},
    {"bfloat16.check_grad_overflow", N, Why::kAlways},
    {"bfloat16.bf16_master_weights_and_grads", N, Why::kPrecision},
    {"bfloat16.bf16_optimizer_states", N, Why::kPrecision},
    {"amp", A, Why::kFeature}, {"torch_autocast", A, Why::kAlways},
    {"data_types", S, Why::kPrecision}, {"data_types.grad_accum_dtype", N, Why::kPrecision},
    // ZeRO.
    {"zero_optimization", S}, {"zero_optimization.stage", M},
    {"zero_optimization.offload_param", S}, {"zero_optimization.offload_optimizer", S},
    {"zero_optimization.offload_param.device", M}, {"zero_optimization.offload_param.nvme_path", M},
    {"zero_optimization.offload_param.pin_memory", M},
    {"zero_optimization.offload_param.buffer_count", M},
    {"zero_optimization.offload_param.buffer_size", N, Why::kPartition},
    {"zero_optimization.offload_param.max_in_cpu", N, Why::kPartition},
    {"zero_optimization.offload_optimizer.device", M},
    {"zero_optimization.offload_optimizer.nvme_path", M},
    {"zero_optimization.offload_optimizer.pin_memory", M},
    {"zero_optimization.offload_optimizer.buffer_count", M},
    {"zero_optimization.offload_optimizer.ratio", M},
    {"zero_optimization.offload_optimizer.fast_init", N, Why::kAlways},
    {"zero_optimization.offload_optimizer.pipeline", N, Why::kAlways},
    {"zero_optimization.offload_optimizer.pipeline_read", N, Why::kAlways},
    {"zero_optimization.offload_optimizer.pipeline_write", N, Why::kAlways},
    {"zero_optimization.offload_optimizer.super_offload", N, Why::kFeature},
    {"zero_optimization.offload_optimizer.convert_grad_on_cpu", N, Why::kAlways},
    {"zero_optimization.offload_optimizer.cpuadam_cores_perc", N, Why::kFeature},
    {"zero_optimization.cpu_offload", M}, {"zero_optimization.cpu_offload_param", M},
    {"zero_optimization.cpu_offload_use_pin_memory", M},
    {"zero_optimization.allgather_partitions", N, Why::kComm},
    {"zero_optimization.allgather_bucket_size", N, Why::kComm},
    {"zero_optimization.overlap_comm", N, Why::kComm},
    {"zero_optimization.reduce_scatter", N, Why::kComm},
    {"zero_optimization.reduce_bucket_size", N, Why::kComm},
    {"zero_optimization.use_multi_rank_bucket_allreduce", N, Why::kComm},
    {"zero_optimization.round_robin_gradients", N, Why::kComm},
    {"zero_optimization.zero_hpz_partition_size", N, Why::kComm},
    {"zero_optimization.zero_quantized_weights", N, Why::kComm},
    {"zero_optimization.zero_quantized_gradients", N, Why::kComm},
    {"zero_optimization.zero_quantized_nontrainable_weights", N, Why::kComm},
    {"zero_optimization.zeropp_loco_param", A, Why::kComm},
    {"zero_optimization.mics_shard_size", N, Why::kComm},
    {"zero_optimization.mics_hierarchical_params_gather", N, Why::kComm},
    {"zero_optimization.stage3_use_all_reduce_for_fetch_params", N, Why::kComm},
    {"zero_optimization.stage3_allgather_sequential", N, Why::kComm},
    {"zero_optimization.contiguous_gradients", N, Why::kPartition},
    {"zero_optimization.compute_grad_norm", N, Why::kAlways},
    {"zero_optimization.load_from_fp32_weights", N, Why::kAlways},
    {"zero_optimization.grad_hooks", N, Why::kAlways},
    {"zero_optimization.parameter_alignment", N, Why::kPartition},
    {"zero_optimization.stage3_max_live_parameters", N, Why::kPartition},
    {"zero_optimization.stage3_max_reuse_distance", N, Why::kPartition},
    {"zero_optimization.stage3_prefetch_bucket_size", N, Why::kPartition},
    {"zero_optimization.stage3_param_persistence_threshold", N, Why::kPartition},
    {"zero_optimization.stage3_model_persistence_threshold", N, Why::kPartition},
    {"zero_optimization.stage3_module_granularity_threshold", N, Why::kPartition},
    {"zero_optimization.stage3_partition_stream_chunk_size", N, Why::kPartition},
    {"zero_optimization.sub_group_size", N, Why::kPartition},
    {"zero_optimization.elastic_checkpoint", N, Why::kFeature},
    {"zero_optimization.stage3_gather_16bit_weights_on_model_save", N, Why::kAlways},
    {"zero_optimization.stage3_gather_fp16_weights_on_model_save", N, Why::kAlways},
    {"zero_optimization.log_trace_cache_warnings", N, Why::kFeature},
    {"zero_optimization.ignore_unused_parameters", N, Why::kAlways},
    {"zero_optimization.save_muon_momentum_buffer_in_memory", N, Why::kFeature},
    {"zero_optimization.legacy_stage1", N, Why::kFeature},
    {"zero_optimization.memory_efficient_linear", N, Why::kAlways},
    {"zero_optimization.pipeline_loading_checkpoint", N, Why::kFeature},
    {"zero_optimization.override_module_apply", N, Why::kFeature},
    {"zero_optimization.enable_sanity_checks", N, Why::kFeature},
    {"zero_optimization.zenflow", A, Why::kFeature},
    {"zero_optimization.leaf_module", A, Why::kFeature},
    // NVMe I/O.
    {"aio", S}, {"aio.block_size", M}, {"aio.queue_depth", M}, {"aio.thread_count", M},
    {"aio.intra_op_parallelism", M}, {"aio.single_submit", N, Why::kAlways},
    {"aio.overlap_events", N, Why::kAlways}, {"aio.use_gds", M},
    // Activation checkpointing: Strata checkpoints at block boundaries always.
    {"activation_checkpointing", S}, {"activation_checkpointing.cpu_checkpointing", M},
    {"activation_checkpointing.partition_activations", N, Why::kParallel},
    {"activation_checkpointing.contiguous_memory_optimization", N, Why::kAlways},
    {"activation_checkpointing.number_checkpoints", N, Why::kAlways},
    {"activation_checkpointing.synchronize_checkpoint_boundary", N, Why::kAlways},
    {"activation_checkpointing.profile", N, Why::kFeature},
    // Monitors.
    {"tensorboard", S}, {"tensorboard.enabled", M}, {"tensorboard.output_path", M},
    {"tensorboard.job_name", M},
    {"csv_monitor", S}, {"csv_monitor.enabled", M}, {"csv_monitor.output_path", M},
    {"csv_monitor.job_name", M},
    {"wandb", S, Why::kMonitor}, {"wandb.enabled", N, Why::kMonitor}, {"wandb.group", N, Why::kMonitor},
    {"wandb.team", N, Why::kMonitor}, {"wandb.project", N, Why::kMonitor},
    {"comet", S, Why::kMonitor}, {"comet.enabled", N, Why::kMonitor}, {"comet.workspace", N, Why::kMonitor},
    {"comet.project", N, Why::kMonitor}, {"comet.samples_log_interval", N, Why::kMonitor},
    {"comet.experiment_name", N, Why::kMonitor}, {"comet.api_key", N, Why::kMonitor},
    {"comet.experiment_key", N, Why::kMonitor}, {"comet.online", N, Why::kMonitor},
    {"comet.mode", N, Why::kMonitor},
    {"flops_profiler", S, Why::kFeature}, {"flops_profiler.enabled", N, Why::kFeature},
    {"flops_profiler.profile_step", N, Why::kFeature},
    {"flops_profiler.module_depth", N, Why::kFeature},
    {"flops_profiler.top_modules", N, Why::kFeature}, {"flops_profiler.detailed", N, Why::kFeature},
    {"flops_profiler.output_file", N, Why::kFeature},
    // Checkpointing (Strata's own: --save-dir).
    {"checkpoint", S, Why::kFeature}, {"checkpoint.tag_validation", N, Why::kFeature},
    {"checkpoint.load_universal", N, Why::kFeature},
    {"checkpoint.use_node_local_storage", N, Why::kFeature},
    {"checkpoint.parallel_write", A, Why::kFeature},
    // Whole features, accepted with their contents.
    {"tensor_parallel", A, Why::kParallel}, {"expert_parallel", A, Why::kParallel},
    {"pipeline", A, Why::kParallel}, {"hybrid_engine", A, Why::kFeature},
    {"sparse_attention", A, Why::kFeature}, {"autotuning", A, Why::kFeature},
    {"data_efficiency", A, Why::kFeature}, {"curriculum_learning", A, Why::kFeature},
    {"elasticity", A, Why::kFeature}, {"compression_training", A, Why::kFeature},
    {"compile", A, Why::kFeature}, {"nebula", A, Why::kFeature}, {"eigenvalue", A, Why::kFeature},
    {"progressive_layer_drop", A, Why::kFeature}, {"quantize_training", A, Why::kFeature},
    {"weight_quantization", A, Why::kFeature}, {"timers", A, Why::kFeature},
    {"disable_python_gc", N, Why::kFeature}, {"dataloader_drop_last", N, Why::kFeature},
    {"memory_breakdown", N, Why::kFeature}, {"graph_harvesting", N, Why::kFeature},
    {"use_data_before_expert_parallel_", N, Why::kParallel},
    // Strata's own section.
    {"strata", S}, {"strata.io_backend", M}, {"strata.device", M}, {"strata.device_budget", M},
    {"strata.model", M}, {"strata.data", M}, {"strata.pack", M}, {"strata.long_examples", M},
    {"strata.objective", M}, {"strata.beta", M}, {"strata.label_smoothing", M},
    {"strata.simpo_gamma", M}, {"strata.rpo_alpha", M}, {"strata.cpo_alpha", M},
    {"strata.steps", M}, {"strata.seq_len", M},
    {"strata.seed", M}, {"strata.warmup_steps", M}, {"strata.eval_every", M},
    {"strata.eval_batches", M}, {"strata.sample_bytes", M}, {"strata.summary_json", M},
    {"strata.copy_bandwidth", M}, {"strata.io_queue_depth", M}, {"strata.io_block_size", M},
    {"strata.io_threads", M}, {"strata.update_during_backward", M}, {"strata.schedule", M},
    {"strata.activation_checkpointing", M},
    {"strata.lora", S}, {"strata.lora.rank", M}, {"strata.lora.alpha", M},
    {"strata.lora.targets", M}, {"strata.lora.dropout", M}, {"strata.lora.init", M},
    {"strata.lora.base_quant", M}, {"strata.lora.base_double_quant", M},
};
// clang-format on

size_t EditDistance(std::string_view a, std::string_view b);

}  // namespace

const DeepSpeedKey* FindDeepSpeedKey(std::string_view path) {
  for (const DeepSpeedKey& k : kKeys) {
    if (k.path == path) return &k;
  }
  return nullptr;
}

std::vector<std::string_view> DeepSpeedKeysUnder(std::string_view section) {
  std::vector<std::string_view> out;
  for (const DeepSpeedKey& k : kKeys) {
    std::string_view p = k.path;
    if (section.empty()) {
      if (p.find('.') == std::string_view::npos) out.push_back(p);
    } else if (p.size() > section.size() + 1 && p.substr(0, section.size()) == section &&
               p[section.size()] == '.' &&
               p.substr(section.size() + 1).find('.') == std::string_view::npos) {
      out.push_back(p.substr(section.size() + 1));
    }
  }
  return out;
}

namespace {

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1] ? 1u : 0u)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::vector<std::string_view> NearestKeys(std::string_view key,
                                          const std::vector<std::string_view>& candidates,
                                          size_t count) {
  std::vector<std::pair<size_t, size_t>> by_distance;  // (distance, index)
  for (size_t i = 0; i < candidates.size(); ++i) {
    by_distance.emplace_back(EditDistance(key, candidates[i]), i);
  }
  std::stable_sort(by_distance.begin(), by_distance.end());
  std::vector<std::string_view> out;
  for (size_t i = 0; i < by_distance.size() && i < count; ++i) {
    out.push_back(candidates[by_distance[i].second]);
  }
  return out;
}

std::string_view NearestKey(std::string_view key, const std::vector<std::string_view>& candidates) {
  std::string_view best;
  size_t best_distance = std::max<size_t>(3, key.size() / 3) + 1;
  for (std::string_view c : candidates) {
    const size_t d = EditDistance(key, c);
    if (d < best_distance) best_distance = d, best = c;
  }
  return best;
}

}  // namespace strata::tools
