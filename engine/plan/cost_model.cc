#include "engine/plan/cost_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "engine/plan/model_flops.h"

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

namespace {

// PredictStep's parts, in the order it runs them (cost_model.h has the model they implement).

// The step's phases (cost_model.h): a micro-batches a step, m a phase, k phase pairs a step
// (micro-batch-major m = 1, k = a; layer-major m = a, k = 1).
struct Phases {
  double a = 1;
  double m = 1;
  double k = 1;
};

Phases PhasesOf(const Plan& plan, const CostInputs& in) {
  Phases ph;
  ph.a = in.grad_accum_steps;
  ph.m = plan.layer_major() ? ph.a : 1;
  ph.k = ph.a / ph.m;
  return ph;
}

// The inputs, and the profile's device section every plan needs.
Status CheckPredictionInputs(const Plan& plan, const CostInputs& in,
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
  return Status::Ok();
}

// What the prediction assumes of a data-parallel, fp32 or activation-offloading plan.
void AddAssumptionNotes(const Plan& plan, const CostInputs& in, double a,
                        std::vector<std::string>* notes) {
  const double w = static_cast<double>(SizeOf(plan.precision));
  if (plan.ranks > 1 || plan.data_parallel) {
    notes->push_back(fmt::format(
        "data parallel ({} ranks): the host work of rank {}'s partitions is predicted; the "
        "collectives are not modelled",
        plan.ranks, plan.rank));
  }
  if (plan.precision == DType::kF32) {
    notes->push_back("fp32 working precision: compute is predicted at the profile's bf16 rate");
  }
  if (plan.offload_activations) {
    // a x (blocks - 1) boundary activations of B x T x C each way per step, in either schedule.
    const double act_bytes = a * static_cast<double>(plan.blocks.size() - 1) *
                             static_cast<double>(plan.shape.tokens()) * in.channels * w;
    notes->push_back(fmt::format(
        "offloaded activations not modelled: about {:.3g} GB D2H and as much H2D per step, beside "
        "the params and gradients",
        act_bytes / 1e9));
  }
}

// Bytes a step moves by link and home, and the params each optimizer updates.
struct StepTraffic {
  double streamed_bytes_per_use = 0;  // 16-bit params of streamed blocks, one use each
  double nvme_param_bytes_per_use = 0;
  double resident_upload_bytes = 0;  // new params of resident CPU-updated blocks, once a step
  double grad_bytes_per_mb = 0;
  double cpu_params = 0, device_params = 0;
  double nvme_state_bytes = 0;    // read and written once a step
  double nvme_copyout_bytes = 0;  // new 16-bit params written once a step
  // Per step.
  double h2d_bytes = 0, d2h_bytes = 0, nvme_read_bytes = 0, nvme_write_bytes = 0;
};

StepTraffic TrafficOf(const Plan& plan, const Phases& ph) {
  const double w = static_cast<double>(SizeOf(plan.precision));
  const double state_bpp = StateBytesPerParam(plan);
  const bool dp = plan.ranks > 1 || plan.data_parallel;
  // Host gradients of a data-parallel rank arrive as its fp32 reduce-scattered partition.
  const double grad_w = dp ? 4.0 : w;
  StepTraffic t;
  for (const Plan::Block& b : plan.blocks) {
    // A frozen chunk (LoRA's base) streams like a block's params and is never written.
    if (b.frozen_params > 0 && !b.frozen_resident) {
      t.streamed_bytes_per_use += static_cast<double>(b.frozen_bytes);
      if (plan.param_home == ParamHome::kNvme) {
        t.nvme_param_bytes_per_use += static_cast<double>(b.frozen_bytes);
      }
    }
    if (b.num_params == 0) continue;
    const double whole = static_cast<double>(b.num_params);
    const double own = dp ? static_cast<double>(b.partition.own_elems) : whole;
    if (b.optimizer_on_device) {
      t.device_params += whole;
      continue;
    }
    t.cpu_params += own;
    t.grad_bytes_per_mb += own * grad_w;
    if (plan.optimizer_home == OptimizerHome::kNvme) t.nvme_state_bytes += own * (4 + state_bpp);
    if (b.resident) {
      t.resident_upload_bytes += whole * w;
    } else {
      t.streamed_bytes_per_use += whole * w;
      if (plan.param_home == ParamHome::kNvme) {
        t.nvme_param_bytes_per_use += own * w;
        t.nvme_copyout_bytes += own * w;
      }
    }
  }
  const double uses = 2 * ph.k;  // a forward and a backward load per phase pair
  t.h2d_bytes = t.streamed_bytes_per_use * uses + t.resident_upload_bytes;
  // Layer-major with device accumulators: a block's fp32 sum once per step; else every
  // micro-batch's gradient.
  t.d2h_bytes = plan.device_grad_accumulators ? t.cpu_params * 4 : t.grad_bytes_per_mb * ph.a;
  t.nvme_read_bytes = t.nvme_state_bytes + t.nvme_param_bytes_per_use * uses;
  t.nvme_write_bytes = t.nvme_state_bytes + t.nvme_copyout_bytes;
  return t;
}

// The profile's sections the traffic needs.
Status CheckProfileSections(const StepTraffic& t, const MachineProfile& profile) {
  if ((t.h2d_bytes > 0 || t.d2h_bytes > 0) && !profile.pcie) {
    return MissingSection("pcie", "the plan copies params or gradients between host and device");
  }
  if (t.cpu_params > 0 && !profile.host) {
    return MissingSection("host", "the plan updates blocks on the CPU");
  }
  if ((t.nvme_read_bytes > 0 || t.nvme_write_bytes > 0) && !profile.nvme) {
    return MissingSection("nvme", "the plan keeps params or optimizer state on NVMe");
  }
  return Status::Ok();
}

// Rates in flops, bytes or params per second (1 for a link the plan does not use).
struct Rates {
  double flops = 0, h2d = 1, d2h = 1, read = 1, write = 1, cpu = 0;
};

// The profile's rates; a note when the CPU rate is scaled from another optimizer's.
Rates RatesOf(const Plan& plan, const StepTraffic& t, const MachineProfile& profile,
              std::vector<std::string>* notes) {
  Rates r;
  r.flops = profile.device->bf16_TFLOPs * 1e12;
  r.h2d = profile.pcie ? profile.pcie->h2d_GBps * 1e9 : 1;
  r.d2h = profile.pcie ? profile.pcie->d2h_GBps * 1e9 : 1;
  r.read = profile.nvme ? profile.nvme->read_GBps * 1e9 : 1;
  r.write = profile.nvme ? profile.nvme->write_GBps * 1e9 : 1;
  std::string rate_note;
  r.cpu = t.cpu_params > 0 ? CpuOptimizerParamsPerSecond(profile, plan.optimizer_name,
                                                         StateBytesPerParam(plan), &rate_note)
                           : 0;
  if (!rate_note.empty()) notes->push_back(rate_note);
  return r;
}

// The fraction of the blocks that can keep their activations which recompute their forward in
// backward; 1 when none can (every block's backward recomputes, as the compute term assumes).
double RecomputedFraction(const Plan& plan) {
  const int keeping = plan.num_keeping_activations(), recomputing = plan.num_recomputing();
  if (keeping + recomputing == 0) return 1.0;
  return static_cast<double>(recomputing) / static_cast<double>(keeping + recomputing);
}

// Seconds each part keeps its resource busy over the step.
StepParts PartsOf(const Plan& plan, const StepTraffic& t, const Rates& r, double compute_flops,
                  const MachineProfile& profile) {
  const double w = static_cast<double>(SizeOf(plan.precision));
  StepParts p;
  p.compute_s = compute_flops / r.flops;
  p.h2d_s = t.h2d_bytes / r.h2d;
  p.d2h_s = t.d2h_bytes / r.d2h;
  p.cpu_optimizer_s = t.cpu_params > 0 ? t.cpu_params / r.cpu : 0;
  p.device_optimizer_s = t.device_params * UpdateBytesPerParam(StateBytesPerParam(plan), w) /
                         (profile.device->memory_GBps * 1e9);
  p.nvme_read_s = t.nvme_read_bytes / r.read;
  p.nvme_write_s = t.nvme_write_bytes / r.write;
  return p;
}

// The step's timeline (cost_model.h's f, b, U_cpu, first and period) and the times it is the
// longest of.
struct StepTimeline {
  // One phase's forward and backward parts, each block loaded once.
  double fwd_compute = 0, bwd_compute = 0, fwd_h2d = 0, bwd_d2h = 0, nvme_params_per_use_s = 0;
  double f = 0, bwd = 0;    // a phase's forward and backward: the longest of their parts
  double nvme_state_s = 0;  // the CPU-updated state's trip through the drive
  double cpu_chain = 0, gpu_chain = 0;
  double period = 0;
  double nvme_total = 0;  // nvme_read + nvme_write
  double step_s = 0;
};

// U_cpu: the CPU round (the update, or the state's trip through the drive when that is longer),
// less what runs during the last backward phase with the update during backward.
double CpuRound(const Plan& plan, const CostInputs& in, const StepTraffic& t, const StepParts& p,
                const StepTimeline& tl) {
  double u_cpu = std::max(p.cpu_optimizer_s, tl.nvme_state_s);
  const double blocks = std::max<size_t>(plan.blocks.size(), 1);
  if (in.update_during_backward && u_cpu > 0) {
    // The update during backward starts after the last block's gradient of the last phase is
    // complete: the rest of that backward phase is the window (micro-batch-major: the last
    // micro-batch's backward; layer-major: the whole backward pass, every block's gradient being
    // complete after its a backwards). A backup copy of host state first moves as many bytes as
    // the update (half the rate); with NVMe only the pipeline's buffers' worth of blocks can run
    // before the verdict, without a state copy.
    const double window = tl.bwd * (blocks - 1) / blocks;
    const double host_state = t.nvme_state_bytes > 0 ? 1.0 : 0.5;
    double ahead = window * host_state;
    if (t.nvme_state_bytes > 0 || t.nvme_param_bytes_per_use > 0) {
      ahead = std::min(ahead, u_cpu * plan.optimizer_buffers / blocks);
    }
    u_cpu = std::max(0.0, u_cpu - ahead);
  }
  return u_cpu;
}

StepTimeline TimelineOf(const Plan& plan, const CostInputs& in, const Phases& ph,
                        const StepTraffic& t, const Rates& r, const StepParts& p) {
  StepTimeline tl;
  // One phase's forward and backward (m micro-batches through every block, each block loaded
  // once), each as long as its longest overlapped part.
  tl.nvme_params_per_use_s = t.nvme_param_bytes_per_use / r.read;
  // compute_s is (3 + recomputed) quarters of the all-recomputing figure (cost_model.h).
  const double recomputed = RecomputedFraction(plan);
  tl.fwd_compute = p.compute_s / ((3 + recomputed) * ph.a);
  tl.bwd_compute = (2 + recomputed) * tl.fwd_compute;
  tl.fwd_h2d = t.streamed_bytes_per_use / r.h2d;
  tl.f = std::max({ph.m * tl.fwd_compute, tl.fwd_h2d, tl.nvme_params_per_use_s});
  tl.bwd_d2h = (plan.layer_major() ? t.d2h_bytes : t.grad_bytes_per_mb) / r.d2h;
  tl.bwd = std::max({ph.m * tl.bwd_compute, tl.fwd_h2d, tl.bwd_d2h, tl.nvme_params_per_use_s});
  tl.nvme_state_s = t.nvme_state_bytes / r.read + t.nvme_state_bytes / r.write;
  const double u_cpu = CpuRound(plan, in, t, p, tl);
  const double blocks = std::max<size_t>(plan.blocks.size(), 1);
  // The last block's forward waits for its update, then for its upload when resident.
  tl.cpu_chain = u_cpu > 0 ? u_cpu + tl.f / blocks + t.resident_upload_bytes / r.h2d / blocks : 0;
  tl.gpu_chain = p.device_optimizer_s + tl.f;
  const double first = std::max(tl.gpu_chain, tl.cpu_chain);
  tl.period = first + tl.bwd + (ph.k - 1) * (tl.f + tl.bwd);
  tl.nvme_total = p.nvme_read_s + p.nvme_write_s;
  tl.step_s = std::max({tl.period, p.h2d_s, p.d2h_s, tl.nvme_total});
  return tl;
}

// The term that sets the step (cost_model.h).
std::string BoundOf(const Phases& ph, const StepParts& p, const StepTimeline& tl) {
  if (tl.step_s == tl.period) {
    if (tl.cpu_chain > tl.gpu_chain) {
      return tl.nvme_state_s > p.cpu_optimizer_s ? "nvme" : "cpu_optimizer";
    }
    // The GPU chain: the device update, or whichever of compute and the links sets the
    // forward and backward phases most.
    const double fb_compute = (tl.fwd_compute + tl.bwd_compute) * ph.a;
    const double fb_h2d = 2 * tl.fwd_h2d * ph.k;
    const double fb_d2h = tl.bwd_d2h * ph.k;
    const double fb_nvme = 2 * tl.nvme_params_per_use_s * ph.k;
    const double top = std::max({fb_compute, fb_h2d, fb_d2h, fb_nvme, p.device_optimizer_s});
    return top == fb_compute             ? "compute"
           : top == p.device_optimizer_s ? "device_optimizer"
           : top == fb_h2d               ? "h2d"
           : top == fb_d2h               ? "d2h"
                                         : "nvme";
  }
  if (tl.step_s == tl.nvme_total) return "nvme";
  if (tl.step_s == p.h2d_s) return "h2d";
  return "d2h";
}

}  // namespace

StatusOr<StepPrediction> PredictStep(const Plan& plan, const CostInputs& in,
                                     const MachineProfile& profile) {
  STRATA_RETURN_IF_ERROR(CheckPredictionInputs(plan, in, profile));
  StepPrediction out;
  out.schedule = std::string(
      ScheduleName(plan.layer_major() ? Schedule::kLayerMajor : Schedule::kMicroBatchMajor));
  const Phases ph = PhasesOf(plan, in);
  AddAssumptionNotes(plan, in, ph.a, &out.notes);

  const StepTraffic traffic = TrafficOf(plan, ph);
  out.h2d_bytes = static_cast<uint64_t>(traffic.h2d_bytes);
  out.d2h_bytes = static_cast<uint64_t>(traffic.d2h_bytes);
  out.nvme_read_bytes = static_cast<uint64_t>(traffic.nvme_read_bytes);
  out.nvme_write_bytes = static_cast<uint64_t>(traffic.nvme_write_bytes);
  STRATA_RETURN_IF_ERROR(CheckProfileSections(traffic, profile));
  const Rates rates = RatesOf(plan, traffic, profile, &out.notes);

  out.tokens_per_step = static_cast<double>(plan.shape.tokens()) * ph.a;
  // Frozen params cost the forward and the activation gradient (4 flops per param and token),
  // not the weight gradient (engine/plan/model_flops.h).
  const std::optional<int64_t> per_token = ModelFlopsPerToken({.trained_params = plan.model_params,
                                                               .frozen_params = plan.frozen_params,
                                                               .num_layers = in.num_layers,
                                                               .attention_width = in.channels,
                                                               .seq_len = plan.shape.seq_len});
  if (!per_token) {
    return InvalidArgumentError(fmt::format(
        "cost model: the model FLOPs of {} params, {} frozen, {} layers of width {} at {} tokens "
        "do not fit in 63 bits",
        plan.model_params, plan.frozen_params, in.num_layers, in.channels, plan.shape.seq_len));
  }
  out.model_flops = static_cast<double>(*per_token) * out.tokens_per_step;
  // A recomputed forward is a third of the model FLOPs (2P + 4LTC of 6P + 12LTC). The profile's
  // rate is the model FLOPs over a step in which every block recomputes (4 thirds of them run),
  // so the compute time is that of (3 + recomputed) quarters of the model FLOPs at that rate.
  const double recomputed = RecomputedFraction(plan);
  out.recompute_flops = out.model_flops / 3 * recomputed;
  out.saved_recompute_flops = out.model_flops / 3 * (1 - recomputed);
  out.parts = PartsOf(plan, traffic, rates, out.model_flops * (3 + recomputed) / 4, profile);

  const StepTimeline timeline = TimelineOf(plan, in, ph, traffic, rates, out.parts);
  out.step_s = timeline.step_s;
  out.tokens_per_s = out.tokens_per_step / out.step_s;
  out.bound = BoundOf(ph, out.parts, timeline);
  return out;
}

std::string DescribePrediction(const StepPrediction& pr) {
  std::string parts;
  for (const auto& [name, s] : PartList(pr.parts)) {
    if (s <= 0) continue;
    parts += fmt::format("{}{} {:.3g} s", parts.empty() ? "" : ", ", name, s);
  }
  return fmt::format("step {:.3g} s ({:.0f} tokens/s, {}), bound by {}: {}{}", pr.step_s,
                     pr.tokens_per_s, pr.schedule, pr.bound, parts,
                     pr.saved_recompute_flops > 0
                         ? fmt::format("; kept activations save {:.3g} TFLOP of recomputed "
                                       "forward per step",
                                       pr.saved_recompute_flops / 1e12)
                         : "");
}

}  // namespace strata::engine
