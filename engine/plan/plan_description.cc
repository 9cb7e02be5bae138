// Plan::Describe (engine/plan/planner.h): the plan in plain words, one tier per line.
#include <fmt/format.h>
#include <tbb/info.h>

#include <algorithm>
#include <string>
#include <utility>

#include "base/units.h"
#include "engine/plan/planner.h"

namespace strata::engine {
namespace {

// Plan::Describe's parts, one tier (or two short ones) each, in the order they print.

// Appends one line of Plan::Describe's text.
template <typename... T>
void AddLine(std::string* s, fmt::format_string<T...> format, T&&... args) {
  *s += fmt::format(format, std::forward<T>(args)...);
  *s += '\n';
}

// The model, its state per param, the ranks and the frozen chunks.
void DescribeModel(const Plan& p, std::string* s) {
  const size_t w = SizeOf(p.precision);
  AddLine(s, "plan: {} params in {} blocks, {} working precision, micro-batch {}x{}",
          p.model_params, p.blocks.size(), DTypeName(p.precision), p.shape.batch_size,
          p.shape.seq_len);
  AddLine(s, "  model state {} ({:.2f} B/param: p{} + g{} + p32 + {} state {:.2f} B/param)",
          FormatBytes(p.model_state_bytes),
          static_cast<double>(p.model_state_bytes) / static_cast<double>(p.model_params), w * 8,
          w * 8, p.optimizer_name,
          static_cast<double>(p.optimizer_state_bytes) / static_cast<double>(p.model_params));
  if (p.ranks > 1) {
    AddLine(
        s,
        "  ranks    {} data-parallel ranks (ZeRO), figures for rank {}: it keeps its partition "
        "(1/{}) of the master weights, optimizer state, host gradients and working-params homes; "
        "the device holds whole blocks",
        p.ranks, p.rank, p.ranks);
  }
  if (p.frozen_params > 0) {
    const int64_t chunks = std::count_if(p.blocks.begin(), p.blocks.end(),
                                         [](const Plan::Block& b) { return b.frozen_params > 0; });
    const int resident = p.num_frozen_resident();
    // An encoded chunk (a 4-bit base) is smaller than the working precision's.
    const bool encoded = p.frozen_bytes != static_cast<uint64_t>(p.frozen_params) * w;
    AddLine(s,
            "  frozen   {} params ({}, {}) never trained: no gradient, master weights or optimizer "
            "state; {}",
            p.frozen_params, FormatBytes(p.frozen_bytes),
            encoded ? fmt::format("{:.2f} bits/param encoded, {} compute",
                                  8.0 * static_cast<double>(p.frozen_bytes) /
                                      static_cast<double>(p.frozen_params),
                                  DTypeName(p.precision))
                    : std::string(DTypeName(p.precision)),
            resident == chunks ? fmt::format("all {} chunks resident", chunks)
                               : fmt::format("{} of {} chunks resident, the rest streamed from {}",
                                             resident, chunks, ParamHomeName(p.param_home)));
  }
}

// The device tier: its total, the resident and streamed blocks, and its regions (the resident
// params and slots in the line above; the device optimizer's as two totals).
void DescribeDevice(const Plan& p, std::string* s) {
  std::string resident, streamed;
  for (const auto& b : p.blocks) {
    if (b.num_params > 0) (b.resident ? resident : streamed) += (b.name + " ");
  }
  AddLine(s, "  device   {} of {} budget: {} resident blocks, {} streaming slots of {}",
          FormatBytes(p.device_total_bytes), FormatBytes(p.device_budget_bytes), p.num_resident(),
          p.streaming_slots, FormatBytes(p.slot_bytes));
  if (!resident.empty()) AddLine(s, "           resident: {}", resident);
  if (!streamed.empty()) {
    AddLine(s, "           streamed per use from {}: {}", ParamHomeName(p.param_home), streamed);
  }
  uint64_t optimizer_state_on_device = 0, gradients_on_device = 0;
  for (const auto& r : p.device_regions) {
    if (r.device_optimizer) {
      (r.label.rfind("gradient ", 0) == 0 ? gradients_on_device : optimizer_state_on_device) +=
          r.size_bytes;
      continue;
    }
    if (r.label.rfind("resident params", 0) == 0 || r.label.rfind("streaming slot", 0) == 0 ||
        r.label.rfind("kept activations", 0) == 0)
      continue;
    AddLine(s, "           {:>10}  {}", FormatBytes(r.size_bytes), r.label);
  }
  if (optimizer_state_on_device > 0) {
    AddLine(s,
            "           {:>10}  master weights and {} state of the blocks optimized on the device",
            FormatBytes(optimizer_state_on_device), p.optimizer_name);
    AddLine(s, "           {:>10}  their gradients", FormatBytes(gradients_on_device));
  }
}

// The pinned tier, and how copies overlap compute.
void DescribePinnedAndOverlap(const Plan& p, std::string* s) {
  AddLine(s, "  pinned   {}: {}{} gradient landing buckets of {}{}", FormatBytes(p.pinned_bytes),
          p.param_home == ParamHome::kNvme ? "NVMe staging, " : "working params home, ",
          p.host_grad_buckets, FormatBytes(p.grad_bucket_bytes),
          p.optimizer_buffer_bytes > 0
              ? fmt::format(", {} optimizer pipeline buffers of {}", p.optimizer_buffers,
                            FormatBytes(p.optimizer_buffer_bytes))
              : "");
  if (p.streaming_slots > 0) {
    AddLine(
        s,
        "  overlap  prefetch {} block{} ahead of compute; gradients stream D2H through {} device "
        "buckets;",
        p.prefetch_depth, p.prefetch_depth == 1 ? "" : "s", p.device_grad_buckets);
  } else {
    AddLine(s, "  overlap  every block resident; gradients stream D2H through {} device buckets;",
            p.device_grad_buckets);
  }
}

// Where the optimizer runs: the blocks updated on the device, the CPU's share and its cores.
void DescribeOptimizer(const Plan& p, std::string* s) {
  if (p.device_optimizer_params > 0) {
    std::string on_device;
    for (const auto& b : p.blocks) {
      if (b.optimizer_on_device) on_device += b.name + " ";
    }
    AddLine(
        s,
        "  optim    on the device for {} of {} params ({:.0f}%): fused kernels update {}once the "
        "gradient norm is known; their gradients never leave the device",
        p.device_optimizer_params, p.model_params, 100 * p.optimizer_device_fraction(), on_device);
  }
  if (!p.has_cpu_optimizer()) return;
  AddLine(s,
          "           the CPU optimizer updates {}blocks in forward order ({}) while the next "
          "forward pass runs; block b's forward waits only on block b's update",
          p.device_optimizer_params > 0 ? "the other " : "",
          p.optimizer_buffer_bytes > 0
              ? fmt::format("NVMe pipeline: read b+1, update b, write b-1 through {} buffers",
                            p.optimizer_buffers)
              : "state in host memory");
  // How the host's cores are divided (issue 29): one oneTBB arena, no binding (binding measured
  // no faster on the H200 machine's single NUMA node).
  AddLine(s,
          "  cpu      {} cores in one oneTBB arena: the gradient fold (during backward) and the "
          "block "
          "updates (after it, or during it with `update_during_backward`) each run parallel inside "
          "it; the driving, prefetch and NVMe threads mostly wait on copies and I/O",
          tbb::info::default_concurrency());
}

// Offloaded activations, activation checkpointing (when blocks can keep their activations) and
// the layer-major schedule, when the plan has them.
void DescribeActivationsAndSchedule(const Plan& p, std::string* s) {
  const int keeping = p.num_keeping_activations(), recomputing = p.num_recomputing();
  if (keeping + recomputing > 0) {
    std::string kept;
    if (keeping > 0) {
      std::string names;
      for (const auto& b : p.blocks) {
        if (b.keeps_activations) names += " " + b.name;
      }
      kept = fmt::format("; {} keep their forward's activations on the device ({}{}):{}", keeping,
                         FormatBytes(p.kept_activation_bytes()),
                         p.held_micro_batches > 1
                             ? fmt::format(" for {} micro-batches", p.held_micro_batches)
                             : "",
                         names);
    }
    AddLine(s,
            "  recompute {} of {} blocks recompute their forward in backward (activation "
            "checkpointing {}){}",
            recomputing, keeping + recomputing,
            ActivationCheckpointingName(p.activation_checkpointing), kept);
  }
  if (p.offload_activations) {
    AddLine(s, "           boundary activations: {} of {} in pinned host memory, {} on the device",
            (p.blocks.size() - 1) * p.held_micro_batches,
            FormatBytes(p.device_regions[2].size_bytes / (2 * p.held_micro_batches)),
            2 * p.held_micro_batches);
  }
  if (p.layer_major()) {
    AddLine(
        s,
        "  schedule layer-major over {} micro-batches: every micro-batch through a block before "
        "the next; each block's params loaded once per pass, its gradient {}",
        p.held_micro_batches,
        p.device_grad_accumulators
            ? "summed over the micro-batches on the device (fp32) and sent D2H once per step"
            : "reduce-scattered per micro-batch (data parallel)");
  }
}

// The host and NVMe tiers.
void DescribeHostAndNvme(const Plan& p, std::string* s) {
  const std::string grads =
      p.host_grad16_params == p.model_params ? fmt::format("{} gradients", DTypeName(p.precision))
      : p.host_grad16_params == 0
          ? std::string("fp32 gradient accumulators")
          : fmt::format("gradients ({} params {}, the rest fp32 accumulators)",
                        p.host_grad16_params, DTypeName(p.precision));
  const std::string state = fmt::format("fp32 master weights, {} state", p.optimizer_name);
  AddLine(s, "  host     {}: {} {}{}{}", FormatBytes(p.host_bytes), grads,
          FormatBytes(p.host_grad_bytes),
          p.optimizer_home == OptimizerHome::kHost ? ", " + state : "",
          p.speculation_backup_bytes > 0 ? fmt::format(", the update during backward's backup {}",
                                                       FormatBytes(p.speculation_backup_bytes))
                                         : "");
  if (p.nvme_bytes > 0) {
    AddLine(s, "  nvme     {}: {}{}", FormatBytes(p.nvme_bytes),
            p.optimizer_home == OptimizerHome::kNvme ? state : "",
            p.param_home == ParamHome::kNvme
                ? (p.optimizer_home == OptimizerHome::kNvme ? ", working params" : "working params")
                : "");
  }
}

}  // namespace

std::string Plan::Describe() const {
  std::string s;
  DescribeModel(*this, &s);
  DescribeDevice(*this, &s);
  DescribePinnedAndOverlap(*this, &s);
  DescribeOptimizer(*this, &s);
  DescribeActivationsAndSchedule(*this, &s);
  DescribeHostAndNvme(*this, &s);
  return s;
}

}  // namespace strata::engine
