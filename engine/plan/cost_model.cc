#include "engine/plan/cost_model.h"

#include <fmt/format.h>

#include <algorithm>

#include "base/dtype.h"

namespace strata::engine {
namespace {

// Bytes one update moves per parameter with S state bytes and gradient / copy-out width w.
double UpdateBytesPerParam(double state_bytes_per_param, double w) {
  return 2 * (4 + state_bytes_per_param) + 2 * w;
}

double StateBytesPerParam(const Plan& plan) {
  return plan.model_params > 0 ? static_cast<double>(plan.optimizer_state_bytes) /
                                     static_cast<double>(plan.model_params)
                               : 0;
}

Status MissingSection(std::string_view section, std::string_view why) {
  return FailedPreconditionError(fmt::format(
      "the machine profile has no \"{}\" section, and {}; measure this machine with `strata "
      "doctor --machine-profile FILE` or add the section",
      section, why));
}

}  // namespace

std::vector<std::pair<std::string_view, double>> PartList(const StepParts& p) {
  return {{"compute", p.compute_s},
          {"h2d", p.h2d_s},
          {"d2h", p.d2h_s},
          {"cpu_optimizer", p.cpu_optimizer_s},
          {"device_optimizer", p.device_optimizer_s},
          {"nvme_read", p.nvme_read_s},
          {"nvme_write", p.nvme_write_s}};
}

double DeviceOptimizerBytesPerParam(const Plan& plan) {
  return UpdateBytesPerParam(StateBytesPerParam(plan), static_cast<double>(SizeOf(plan.precision)));
}

double CpuOptimizerParamsPerSecond(const MachineProfile& profile, const std::string& optimizer,
                                   double state_bytes_per_param, std::string* note) {
  if (!profile.host || profile.host->optimizer_params_per_s.empty()) return 0;
  const auto& rates = profile.host->optimizer_params_per_s;
  if (auto it = rates.find(optimizer); it != rates.end()) return it->second;
  // AdamW's rate, else the first kind listed, scaled by the bytes an update moves (the update
  // is memory-bound on the host as on the device). The reference's state: AdamW's 8 B, Lion's
  // 4, Adagrad's 4, SGD's 4 (momentum), Adam's 8; others assumed 8.
  auto state_of = [](const std::string& kind) {
    if (kind == "lion" || kind == "adagrad" || kind == "sgd") return 4.0;
    if (kind == "adamw8bit") return 2.0;
    return 8.0;
  };
  auto ref = rates.find("adamw");
  if (ref == rates.end()) ref = rates.begin();
  const double rate = ref->second * UpdateBytesPerParam(state_of(ref->first), 2) /
                      UpdateBytesPerParam(state_bytes_per_param, 2);
  if (note) {
    *note = fmt::format(
        "the profile has no CPU rate for {}: {}'s {:.3g} params/s scaled by the bytes an update "
        "moves ({:.0f} vs {:.0f} B/param) = {:.3g} params/s",
        optimizer, ref->first, ref->second, UpdateBytesPerParam(state_bytes_per_param, 2),
        UpdateBytesPerParam(state_of(ref->first), 2), rate);
  }
  return rate;
}

StatusOr<StepPrediction> PredictStep(const Plan& plan, const CostInputs& in,
                                     const MachineProfile& profile) {
  if (in.num_layers < 1 || in.channels < 1 || in.grad_accum_steps < 1) {
    return InvalidArgumentError(fmt::format(
        "cost model: num_layers {}, channels {} and grad_accum_steps {} must all be 1 or more",
        in.num_layers, in.channels, in.grad_accum_steps));
  }
  if (plan.layer_major() && plan.held_micro_batches != in.grad_accum_steps) {
    return InvalidArgumentError(fmt::format(
        "cost model: the layer-major plan holds {} micro-batches, the inputs say {} per step",
        plan.held_micro_batches, in.grad_accum_steps));
  }
  if (!profile.device) {
    return MissingSection("device", "every plan computes on the device (its bf16 rate is needed)");
  }
  StepPrediction out;
  out.schedule = std::string(
      ScheduleName(plan.layer_major() ? Schedule::kLayerMajor : Schedule::kMicroBatchMajor));
  const double a = in.grad_accum_steps;
  // Micro-batches per phase (a forward or backward pass over the blocks) and phases per step:
  // micro-batch-major 1 and a, layer-major a and 1.
  const double m = plan.layer_major() ? a : 1;
  const double k = a / m;
  const double w = static_cast<double>(SizeOf(plan.precision));
  const double state_bpp = StateBytesPerParam(plan);
  const bool dp = plan.ranks > 1 || plan.data_parallel;
  // Host gradients of a data-parallel rank arrive as its fp32 reduce-scattered partition.
  const double grad_w = dp ? 4.0 : w;
  if (dp) {
    out.notes.push_back(fmt::format(
        "data parallel ({} ranks): the host work of rank {}'s partitions is predicted; the "
        "collectives are not modelled",
        plan.ranks, plan.rank));
  }
  if (plan.precision == DType::kF32) {
    out.notes.push_back("fp32 working precision: compute is predicted at the profile's bf16 rate");
  }
  if (plan.offload_activations) {
    // a x (blocks - 1) boundary activations of B x T x C each way per step, in either schedule.
    const double act_bytes = a * static_cast<double>(plan.blocks.size() - 1) *
                             static_cast<double>(plan.shape.tokens()) * in.channels * w;
    out.notes.push_back(fmt::format(
        "offloaded activations not modelled: about {:.3g} GB D2H and as much H2D per step, beside "
        "the params and gradients",
        act_bytes / 1e9));
  }

  // Bytes per step by link and home.
  double streamed_bytes_per_use = 0;  // 16-bit params of streamed blocks, one use each
  double nvme_param_bytes_per_use = 0;
  double resident_upload_bytes = 0;  // new params of resident CPU-updated blocks, once a step
  double grad_bytes_per_mb = 0;
  double cpu_params = 0, device_params = 0;
  double nvme_state_bytes = 0;    // read and written once a step
  double nvme_copyout_bytes = 0;  // new 16-bit params written once a step
  for (const Plan::Block& b : plan.blocks) {
    // A frozen chunk (LoRA's base) streams like a block's params and is never written.
    if (b.frozen_params > 0 && !b.frozen_resident) {
      streamed_bytes_per_use += static_cast<double>(b.frozen_params) * w;
      if (plan.param_home == ParamHome::kNvme) {
        nvme_param_bytes_per_use += static_cast<double>(b.frozen_params) * w;
      }
    }
    if (b.num_params == 0) continue;
    const double whole = static_cast<double>(b.num_params);
    const double own = dp ? static_cast<double>(b.partition.own_elems) : whole;
    if (b.optimizer_on_device) {
      device_params += whole;
      continue;
    }
    cpu_params += own;
    grad_bytes_per_mb += own * grad_w;
    if (plan.optimizer_home == OptimizerHome::kNvme) nvme_state_bytes += own * (4 + state_bpp);
    if (b.resident) {
      resident_upload_bytes += whole * w;
    } else {
      streamed_bytes_per_use += whole * w;
      if (plan.param_home == ParamHome::kNvme) {
        nvme_param_bytes_per_use += own * w;
        nvme_copyout_bytes += own * w;
      }
    }
  }
  const double uses = 2 * k;  // a forward and a backward load per phase pair
  const double h2d_bytes = streamed_bytes_per_use * uses + resident_upload_bytes;
  // Layer-major with device accumulators: a block's fp32 sum once per step; else every
  // micro-batch's gradient.
  const double d2h_bytes = plan.device_grad_accumulators ? cpu_params * 4 : grad_bytes_per_mb * a;
  const double nvme_read_bytes = nvme_state_bytes + nvme_param_bytes_per_use * uses;
  const double nvme_write_bytes = nvme_state_bytes + nvme_copyout_bytes;
  out.h2d_bytes = static_cast<uint64_t>(h2d_bytes);
  out.d2h_bytes = static_cast<uint64_t>(d2h_bytes);
  out.nvme_read_bytes = static_cast<uint64_t>(nvme_read_bytes);
  out.nvme_write_bytes = static_cast<uint64_t>(nvme_write_bytes);

  if ((h2d_bytes > 0 || d2h_bytes > 0) && !profile.pcie) {
    return MissingSection("pcie", "the plan copies params or gradients between host and device");
  }
  if (cpu_params > 0 && !profile.host) {
    return MissingSection("host", "the plan updates blocks on the CPU");
  }
  if ((nvme_read_bytes > 0 || nvme_write_bytes > 0) && !profile.nvme) {
    return MissingSection("nvme", "the plan keeps params or optimizer state on NVMe");
  }

  // Rates in bytes or params per second.
  const double flops_rate = profile.device->bf16_TFLOPs * 1e12;
  const double h2d_rate = profile.pcie ? profile.pcie->h2d_GBps * 1e9 : 1;
  const double d2h_rate = profile.pcie ? profile.pcie->d2h_GBps * 1e9 : 1;
  const double read_rate = profile.nvme ? profile.nvme->read_GBps * 1e9 : 1;
  const double write_rate = profile.nvme ? profile.nvme->write_GBps * 1e9 : 1;
  std::string rate_note;
  const double cpu_rate = cpu_params > 0 ? CpuOptimizerParamsPerSecond(profile, plan.optimizer_name,
                                                                       state_bpp, &rate_note)
                                         : 0;
  if (!rate_note.empty()) out.notes.push_back(rate_note);

  const double T = plan.shape.seq_len;
  out.tokens_per_step = static_cast<double>(plan.shape.tokens()) * a;
  // Frozen params cost the forward and the activation gradient (4 flops per param and token),
  // not the weight gradient.
  out.model_flops =
      (6.0 * static_cast<double>(plan.model_params) +
       4.0 * static_cast<double>(plan.frozen_params) + 12.0 * in.num_layers * T * in.channels) *
      out.tokens_per_step;

  StepParts& p = out.parts;
  p.compute_s = out.model_flops / flops_rate;
  p.h2d_s = h2d_bytes / h2d_rate;
  p.d2h_s = d2h_bytes / d2h_rate;
  p.cpu_optimizer_s = cpu_params > 0 ? cpu_params / cpu_rate : 0;
  p.device_optimizer_s =
      device_params * UpdateBytesPerParam(state_bpp, w) / (profile.device->memory_GBps * 1e9);
  p.nvme_read_s = nvme_read_bytes / read_rate;
  p.nvme_write_s = nvme_write_bytes / write_rate;

  // One phase's forward and backward (m micro-batches through every block, each block loaded
  // once), each as long as its longest overlapped part.
  const double nvme_params_per_use_s = nvme_param_bytes_per_use / read_rate;
  const double fwd_compute = p.compute_s / (4 * a), bwd_compute = 3 * fwd_compute;
  const double fwd_h2d = streamed_bytes_per_use / h2d_rate;
  const double f = std::max({m * fwd_compute, fwd_h2d, nvme_params_per_use_s});
  const double bwd_d2h = (plan.layer_major() ? d2h_bytes : grad_bytes_per_mb) / d2h_rate;
  const double bwd = std::max({m * bwd_compute, fwd_h2d, bwd_d2h, nvme_params_per_use_s});
  // The CPU round: the update, or the state's trip through the drive when that is longer.
  const double nvme_state_s = nvme_state_bytes / read_rate + nvme_state_bytes / write_rate;
  double u_cpu = std::max(p.cpu_optimizer_s, nvme_state_s);
  const double blocks = std::max<size_t>(plan.blocks.size(), 1);
  if (in.update_during_backward && u_cpu > 0) {
    // The update during backward starts after the last block's gradient of the last phase is
    // complete: the rest of that backward phase is the window (micro-batch-major: the last
    // micro-batch's backward; layer-major: the whole backward pass, every block's gradient being
    // complete after its a backwards). A backup copy of host state first moves as many bytes as
    // the update (half the rate); with NVMe only the pipeline's buffers' worth of blocks can run
    // before the verdict, without a state copy.
    const double window = bwd * (blocks - 1) / blocks;
    const double host_state = nvme_state_bytes > 0 ? 1.0 : 0.5;
    double ahead = window * host_state;
    if (nvme_state_bytes > 0 || nvme_param_bytes_per_use > 0) {
      ahead = std::min(ahead, u_cpu * plan.optimizer_buffers / blocks);
    }
    u_cpu = std::max(0.0, u_cpu - ahead);
  }
  // The last block's forward waits for its update, then for its upload when resident.
  const double cpu_chain =
      u_cpu > 0 ? u_cpu + f / blocks + resident_upload_bytes / h2d_rate / blocks : 0;
  const double gpu_chain = p.device_optimizer_s + f;
  const double first = std::max(gpu_chain, cpu_chain);
  const double period = first + bwd + (k - 1) * (f + bwd);
  const double nvme_total = p.nvme_read_s + p.nvme_write_s;
  out.step_s = std::max({period, p.h2d_s, p.d2h_s, nvme_total});
  out.tokens_per_s = out.tokens_per_step / out.step_s;

  if (out.step_s == period) {
    if (cpu_chain > gpu_chain) {
      out.bound = nvme_state_s > p.cpu_optimizer_s ? "nvme" : "cpu_optimizer";
    } else {
      // The GPU chain: the device update, or whichever of compute and the links sets the
      // forward and backward phases most.
      const double fb_compute = (fwd_compute + bwd_compute) * a;
      const double fb_h2d = 2 * fwd_h2d * k;
      const double fb_d2h = bwd_d2h * k;
      const double fb_nvme = 2 * nvme_params_per_use_s * k;
      const double top = std::max({fb_compute, fb_h2d, fb_d2h, fb_nvme, p.device_optimizer_s});
      out.bound = top == fb_compute             ? "compute"
                  : top == p.device_optimizer_s ? "device_optimizer"
                  : top == fb_h2d               ? "h2d"
                  : top == fb_d2h               ? "d2h"
                                                : "nvme";
    }
  } else if (out.step_s == nvme_total) {
    out.bound = "nvme";
  } else if (out.step_s == p.h2d_s) {
    out.bound = "h2d";
  } else {
    out.bound = "d2h";
  }
  return out;
}

std::string DescribePrediction(const StepPrediction& pr) {
  std::string parts;
  for (const auto& [name, s] : PartList(pr.parts)) {
    if (s <= 0) continue;
    parts += fmt::format("{}{} {:.3g} s", parts.empty() ? "" : ", ", name, s);
  }
  return fmt::format("step {:.3g} s ({:.0f} tokens/s, {}), bound by {}: {}", pr.step_s,
                     pr.tokens_per_s, pr.schedule, pr.bound, parts);
}

}  // namespace strata::engine
