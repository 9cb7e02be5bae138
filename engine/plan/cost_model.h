// The cost model: the predicted time of one training step of a plan (engine/plan/planner.h) on a
// machine (engine/plan/machine_profile.h), its parts, what bounds it, and tokens/s.
//
// It models the schedule the engine runs (docs/ARCHITECTURE.md, "One training step"; the plan's
// Schedule, engine/plan/planner.h), in steady state (a step whose forward overlaps the previous
// step's CPU update), with these times, for a = grad_accum_steps micro-batches and a step of
// `loads` uses of every streamed block: 2a micro-batch-major (forward and backward of every
// micro-batch), 2 layer-major (every micro-batch through a block while it is loaded, once per
// pass):
//
//   compute    (6 P + 12 L T C) tokens / bf16 rate with every block recomputing: forward +
//              recomputed forward + backward, the forward 1/4 of it, the backward with its
//              recomputed forward 3/4. Blocks that keep their activations (activation
//              checkpointing, Plan::Block::keeps_activations) skip their recomputed forward: with
//              a fraction k of the blocks that can keep keeping (layers alike), the recomputed
//              forward is (1 - k)/4 of that figure and the compute (3 + (1 - k))/4 of it (in
//              FLOPs a recomputed forward is a third of the model FLOPs, 2 P + 4 L T C: the
//              rate counts the model FLOPs only).
//   h2d        streamed blocks' 16-bit params x loads, plus the new 16-bit params of resident
//              blocks the CPU updated (once).
//   d2h        gradients of the blocks the CPU updates: micro-batch-major 16-bit (fp32 for a
//              data-parallel rank's partition) every micro-batch; layer-major with device
//              accumulators (Plan::device_grad_accumulators) fp32, 4 B/param, once per step;
//              layer-major data-parallel as micro-batch-major.
//   cpu_optimizer     the CPU-updated params / optimizer_params_per_s of the kind.
//   device_optimizer  the device-updated params x bytes moved per param / device memory rate
//              (fused, memory-bound: reads p32, state, g16 and writes p32, state, p16, so
//              2 (4 + S) + 2 w bytes for S state bytes per param and working width w;
//              AdamW in bf16: 28 B).
//   nvme_read  state (p32 + S) of NVMe-homed CPU blocks, and NVMe-homed streamed params x loads;
//   nvme_write state of NVMe-homed CPU blocks, and their new 16-bit params once.
//
// One step is k phase pairs (a forward and a backward pass over every block) of m micro-batches
// each: micro-batch-major m = 1, k = a; layer-major m = a, k = 1. Blocks are taken as alike, so a
// pass is as long as the longest of its parts summed over the blocks: f = forward of a phase
// (m x one micro-batch's forward compute, or its H2D or NVMe params reads if longer: the prefetch
// overlaps them; each block is loaded once per phase), b = backward of a phase (m x backward
// compute, its H2D, its D2H (the step's d2h / k) or its NVMe reads, the longest):
//
//   U_cpu   = max(cpu_optimizer, nvme_read_state + nvme_write_state)  (the optimizer pipeline
//             reads block b+1, updates b and writes b-1 at once; the drive serves one at a time)
//   U_cpu  -= h x b (blocks - 1) / blocks  with update_during_backward: a block's update starts
//             when its gradient is complete, during the last backward phase after the last
//             block's: micro-batch-major the last micro-batch's backward, layer-major the whole
//             backward pass (a x one backward); h = 1/2 for host state (a backup copy first moves
//             as many bytes), 1 for NVMe state, and with NVMe at most optimizer_buffers / blocks
//             of U_cpu
//   first   = max(device_optimizer + f, U_cpu + f / blocks)   the first forward phase: the
//             device update runs after the backward and before the next forward on the compute
//             stream; the CPU updates blocks in forward order from the end of the backward and
//             block j's forward waits only on block j's update, so the forward ends one block
//             after the CPU round does
//   period  = first + b + (k - 1) (f + b)
//   step    = max(period, h2d, d2h, nvme_read + nvme_write)  (each link's total busy time)
//
// With one micro-batch the two schedules are the same plan and the same prediction.
//
// The bound is the term that sets the step: "cpu_optimizer" (or "nvme" when the state I/O sets
// U_cpu), "device_optimizer", "compute", "h2d", "d2h" or "nvme".
//
// Not modelled: data-parallel collectives (a plan with ranks > 1 is predicted for its own
// partition's host work, with a note), offloaded activations' copies (a x (blocks - 1) boundary
// activations each way per step in either schedule; a note gives their bytes), the first step
// (no update to overlap), fold and host-side latencies, and contention between the CPU update and
// the gradient fold.
//
// Use by the planner (placement by predicted time): make candidate plans with MakePlan, and
// call PredictStep(plan, CostInputsOf(...), profile) on each; the smallest step_s wins.
//
// Thread-safety: pure functions on values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "engine/plan/machine_profile.h"
#include "engine/plan/planner.h"

namespace strata::engine {

// What the plan does not say about the model.
struct CostInputs {
  int num_layers = 0;  // L (transformer layers), for attention's 12 L T C FLOPs per token
  int channels = 0;    // C (attention width: heads x head size)
  int grad_accum_steps = 1;
  // EngineOptions::update_during_backward: the CPU update may start during the last backward
  // phase (engine/update_speculation.h), assumed to stand. With a layer-major plan this must
  // equal the plan's held_micro_batches.
  bool update_during_backward = false;
};

// Seconds per step each part keeps its resource busy.
struct StepParts {
  double compute_s = 0;
  double h2d_s = 0;
  double d2h_s = 0;
  double cpu_optimizer_s = 0;
  double device_optimizer_s = 0;
  double nvme_read_s = 0;
  double nvme_write_s = 0;
};

struct StepPrediction {
  std::string schedule;  // ScheduleName of the plan's: "micro-batch-major" or "layer-major"
  double step_s = 0;
  double tokens_per_s = 0;
  std::string bound;  // "compute", "h2d", "d2h", "cpu_optimizer", "device_optimizer", "nvme"
  StepParts parts;
  double model_flops = 0;  // per step, recomputation not counted
  // Per step: the recomputed forwards' FLOPs the kept activations save (model_flops / 3, a
  // forward's 2P + 4LTC of 6P + 12LTC, x the fraction of the blocks that can keep which do), and
  // those still recomputed.
  double saved_recompute_flops = 0;
  double recompute_flops = 0;
  double tokens_per_step = 0;
  uint64_t h2d_bytes = 0;  // per step
  uint64_t d2h_bytes = 0;
  uint64_t nvme_read_bytes = 0;
  uint64_t nvme_write_bytes = 0;
  // Assumptions the prediction had to make, one line each (a rate scaled from AdamW's for a kind
  // the profile does not list, a data-parallel plan, fp32 compute at the bf16 rate).
  std::vector<std::string> notes;
};

// The parts' names, in StepParts order, and their values: {"compute", 0.21}, ...
std::vector<std::pair<std::string_view, double>> PartList(const StepParts& parts);

// Bytes one update moves per parameter on the device for a plan's optimizer: 2 (4 + S) + 2 w
// (S: the plan's optimizer state bytes per parameter; w: the working precision's width).
double DeviceOptimizerBytesPerParam(const Plan& plan);

// The CPU optimizer's rate, params per second, for `optimizer` ("adamw", ... as --optimizer)
// with `state_bytes_per_param` of state: the profile's figure for the kind, or else AdamW's
// (or the first kind listed) scaled by the bytes one update moves (4 + S read and written,
// plus a 16-bit gradient and copy-out), with a note saying so. 0 without a host section.
double CpuOptimizerParamsPerSecond(const MachineProfile& profile, const std::string& optimizer,
                                   double state_bytes_per_param, std::string* note);

// The prediction. Errors: kInvalidArgument for num_layers, channels or grad_accum_steps below
// 1 (or 0 layers with channels), or a layer-major plan made for another grad_accum_steps;
// kFailedPrecondition naming the profile section the plan needs
// and lacks ("device" for any plan: compute runs there; "pcie" when anything crosses it; "host"
// when the CPU updates any block; "nvme" when anything lives on NVMe).
StatusOr<StepPrediction> PredictStep(const Plan& plan, const CostInputs& inputs,
                                     const MachineProfile& profile);

// One line: "step 0.87 s (9400 tokens/s, micro-batch-major), bound by cpu_optimizer: compute
// 0.21 s, ..."
std::string DescribePrediction(const StepPrediction& prediction);

}  // namespace strata::engine
