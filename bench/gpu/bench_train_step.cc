// One training step of the real engine (engine/engine.h, driven as tools/train_command.cc drives
// it) on the CUDA backend, offloaded against resident, in one program (issue 5, "Benchmarks").
//
//   TrainStep/<preset>/<placement>
//
// <preset>: gpt2-124m (the small case), gpt2-1.5b and gpt-7b (32 layers, 32 heads, C = 4096,
//   context 2048), byte-level vocabulary (256), so gpt2-124m has P = 86,235,648, gpt2-1.5b
//   P = 1,478,019,200 and gpt-7b P = 6,454,648,832 parameters.
// <placement>, in this order for each preset (the plan comes from engine::MakePlan inside
// Engine::Create, as in `strata train`):
//   resident  working params of every block on the GPU (ParamHome::kDevice, device budget
//             128 GiB of which the arena takes only what the plan needs); master weights and
//             Adam state on the host. The no-offload baseline: the engine has no GPU optimizer,
//             so the CPU AdamW and the gradient D2H run here too.
//   device    as resident, with master weights, optimizer state and gradients on the GPU too
//             (OptimizerHome::kDevice: the fused device update, no gradient D2H).
//   resident-udb  as resident, with the CPU update during backward (issue 29; the other cases
//             update after backward): grad_norm and during_backward_share say whether it speculated
//   split     as resident, the first half of the parameters' optimizer on the GPU and the rest
//             on the host (optimizer_device_fraction 0.5), both updating at once.
//   host      every block streamed through three device slots (prefetch depth 2) from pinned
//             host memory; device budget = engine::StreamingMinimumBytes(3 slots), far below
//             the model state; optimizer state on the host.
//   nvme      as host, but working params and optimizer state (p32, m, v) live in the NVMe swap
//             store under $STRATA_BENCH_DIR (default /var/tmp; a real drive, not tmpfs).
//
// Micro-batch: B = 8 sequences of T = 1024 tokens, gradient accumulation 1 (8192 tokens per
// step) for the GPT-2 presets; gpt-7b B = 2 sequences of its full context T = 2048 (4096 tokens:
// ~2.1e14 FLOP per step with the recomputed forward, a few seconds, while its host state needs
// 16 B/param = 103 GB of the machine's 128 GiB, so each case is short; 2 timed steps). A case
// whose plan needs more host memory than /proc/meminfo's MemAvailable (less 4 GiB) is skipped
// with the planner's message (PlacementOptions::host_budget_bytes), not killed by the kernel. The
// GPT's CUDA layer runs fp32 GEMMs with TF32 off (models/cuda), so gpt2-1.5b's forward + backward +
// recomputed forward (8 * P * 8192 = 9.7e13 FLOP plus attention) should take about 2-3 s on an
// H200's fp32 units (~50 TFLOP/s): long enough to hide the CPU AdamW over 1.5e9 parameters (16
// cores, memory-bound) and the 6 GB of parameter H2D per step, short enough that the program stays
// within its time budget.
//
// Memory, gpt2-1.5b: host placements keep p32, m, v and the fp32 gradient accumulators on the
// host (16 B/param = 23.6 GB) plus the pinned 16-bit working params (2 B/param = 3.0 GB); the
// benchmark keeps the initial weights once more (4 B/param = 5.9 GB, see CachedInitModel). The
// nvme placement swaps 14 B/param = 20.7 GB and keeps only the accumulators and pipeline
// buffers on the host. Device: the resident plan needs the 16-bit params (3.0 GB), 49
// boundary activations (B,T,C) fp32 (2.6 GB), scratch and one block's gradients; the streamed
// plans the same less the params plus three slots. The GPU machine has 128 GiB of host memory,
// a 141 GB H200 and a 64 GiB disk.
//
// Per case: Engine::Create, one warm-up step (untimed; its update is flushed), then a fixed
// number of timed steps (UseManualTime: each iteration's time is the wall time of Engine::Step,
// which in steady state includes waiting for the previous step's overlapped CPU update where
// the forward pass needs it), then a Flush. Counters:
//   step_s            median over the timed steps of the Step wall time
//   tokens_per_s      B * T * accumulation / step_s
//   model_TFLOP_per_s engine::ModelFlopsPerToken (engine/plan/model_flops.h: 6 P + 12 L T C per
//                     token, "PaLM", Chowdhery et al. 2022, appendix B; the recomputed forward
//                     of activation checkpointing not counted) x tokens / step_s / 1e12: the
//                     function `strata train`'s MFU and the cost model use; the same formula as
//                     bench/gpu/torch_gpt_baseline.py, the PyTorch baseline of the same shapes.
//   MFU               model_TFLOP_per_s / the GPU's dense bf16 peak: --peak-tflops=X, else the
//                     device.peak_bf16_TFLOPs of --machine=FILE (a machine profile), else
//                     engine::DatasheetPeakBf16Tflops of the device name (the context line
//                     peak_bf16_tflops says which); absent for an unknown GPU.
//                     Against the bf16 peak whatever the kernels compute in: the GPT's CUDA
//                     layer runs fp32 GEMMs (TF32 off), so a small MFU here says how far that
//                     is from what the tensor cores could do.
//   compute, h2d, d2h, cpu_optimizer, nvme_read, nvme_write
//                     busy seconds per step of each part, from the trace::TraceRecorder given to
//                     both the CUDA device (CudaDeviceOptions::trace) and the engine, over the
//                     timed steps and the final flush (whatever the backend records: a part it
//                     does not record reads 0)
//   wall_per_step_s   (sum of the timed Step times + the final Flush) / steps: the wall time of
//                     exactly the work the breakdown covers
//   overlap_efficiency  largest part / wall_per_step_s (docs/ARCHITECTURE.md, "Performance
//                     contract")
//   offload_cost      (host and nvme) step_s / step_s of the same preset's resident case, run
//                     just before in this process
//   h2d_GB, d2h_GB, nvme_read_GB, nvme_write_GB  bytes moved per step (engine counters), 1e9 B
//   loss              of the last step (about ln 256 = 5.5 on the random tokens used here)
//
// Time: the whole program stays under 4 minutes on the H200 machine. gpt2-1.5b runs 3 timed
// steps (2 on NVMe, whose step moves ~44 GB through the drive), gpt2-124m 6, gpt-7b 2.
// scripts/gpu_session.sh runs gpt2-1.5b and gpt-7b, resident and host, with --benchmark_filter.
// After the warm-up a case whose timed steps would, at the warm-up's pace, end past
// $STRATA_BENCH_GRAD_CLIP sets every case's clip threshold (default 1.0; 0 = off).
// $STRATA_BENCH_BUDGET_S (default 210) seconds since the program started is skipped with that
// reason; so is a case that would start when the previous case's duration no longer fits in the
// budget. Without a GPU every case is skipped with the reason (SkipWithError) and the program exits
// 0.
//   bench_train_step [--peak-tflops=989 | --machine=bench/machines/h200.json]
//   [--activation-checkpointing=auto|all|none]   (default auto, as strata train; the counter
//   kept_layers says how many layers kept their activations instead of recomputing them)
//   --benchmark_out=train_step.json
//   --benchmark_out_format=json
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/logging.h"
#include "base/trace.h"
#include "base/units.h"
#include "bench/gpu/bench_common.h"
#include "engine/engine.h"
#include "engine/plan/machine_profile.h"
#include "engine/plan/model_flops.h"
#include "gpu/cuda/cuda_device.h"
#include "models/gpt.h"

namespace strata::engine {
namespace {

using Clock = std::chrono::steady_clock;

const Clock::time_point g_program_start = Clock::now();

std::string BenchDir() {
  const char* dir = std::getenv("STRATA_BENCH_DIR");
  return dir != nullptr && *dir != '\0' ? dir : "/var/tmp";
}

double BudgetSeconds() {
  const char* s = std::getenv("STRATA_BENCH_BUDGET_S");
  const double v = s != nullptr ? std::atof(s) : 0.0;
  return v > 0 ? v : 210.0;
}

// The clip threshold of every case: STRATA_BENCH_GRAD_CLIP (0 = off), default 1.0 (EngineOptions').
float GradClip() {
  const char* s = std::getenv("STRATA_BENCH_GRAD_CLIP");
  return s != nullptr && *s != '\0' ? static_cast<float>(std::atof(s)) : 1.0f;
}

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Preset {
  const char* name;
  MicroBatchShape micro_batch;
  int grad_accum_steps;
  int timed_steps;       // resident and host placements
  int timed_steps_nvme;  // nvme placement
  // Every layer block starts from layer 0's initial weights (see CachedInitModel).
  bool replicate_layer_init = false;
};
constexpr Preset kPresets[] = {
    {"gpt2-124m", {8, 1024}, 1, 6, 6},
    {"gpt2-1.5b", {8, 1024}, 1, 3, 2},
    {"gpt-7b", {2, 2048}, 1, 2, 2, /*replicate_layer_init=*/true},
};

// The GPU's dense bf16 peak in TFLOP/s: --peak-tflops, else the --machine profile's, else by
// name; 0 when unknown.
double g_peak_tflops = 0;
// Which layers recompute their forward in backward, as `strata train --activation-checkpointing`
// (default auto: the layers whose activations the budget left by the plan holds keep them).
ActivationCheckpointing g_checkpointing = ActivationCheckpointing::kAuto;
std::string g_peak_source;

// MemAvailable of /proc/meminfo in bytes; 0 when unreadable.
uint64_t HostMemAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

enum class Placement { kResident, kResidentDuringBackward, kDevice, kSplit, kHost, kNvme };
constexpr Placement kPlacements[] = {Placement::kResident, Placement::kResidentDuringBackward,
                                     Placement::kDevice,   Placement::kSplit,
                                     Placement::kHost,     Placement::kNvme};
const char* PlacementName(Placement p) {
  switch (p) {
    case Placement::kResident:
      return "resident";
    case Placement::kResidentDuringBackward:
      return "resident-udb";
    case Placement::kDevice:
      return "device";
    case Placement::kSplit:
      return "split";
    case Placement::kHost:
      return "host";
    case Placement::kNvme:
      return "nvme";
  }
  return "?";
}

constexpr uint64_t kSeed = 1337;

// The GPT of a preset, whose initial master weights are computed once, on every core, and
// copied out by InitParams; everything else is GptModel's. GptModel::InitParams is a serial
// Box-Muller sampler (about 20 s for gpt2-1.5b on one core) that Engine::Create calls block by
// block; the copies are bit-identical to it. Memory: 4 bytes per parameter. With
// `replicate_layers` (gpt-7b, whose 26 GB copy would not fit beside its 103 GB of host state)
// only the embedding, layer 0 and the head are computed, and every layer starts from layer 0's
// weights: the same distribution (GPT-2's init depends on the depth, not the layer index), not
// the same values as GptModel's, which a throughput benchmark does not need.
class CachedInitModel final : public ForwardingModel {
 public:
  static StatusOr<std::unique_ptr<CachedInitModel>> Create(const std::string& preset,
                                                           bool replicate_layers) {
    STRATA_ASSIGN_OR_RETURN(models::GptShape shape, models::GptPreset(preset));
    STRATA_ASSIGN_OR_RETURN(auto gpt, models::GptModel::Create(shape));
    std::unique_ptr<CachedInitModel> m(new CachedInitModel(preset, std::move(gpt)));
    m->replicate_layers_ = replicate_layers;
    const int n = m->gpt_->num_blocks();
    m->init_.resize(n);
    std::vector<int> computed;
    for (int b = 0; b < n; ++b) {
      if (m->CacheIndex(b) != b) continue;
      m->init_[b].resize(m->gpt_->block_num_params(b));
      computed.push_back(b);
    }
    std::atomic<size_t> next{0};
    std::vector<std::thread> workers;
    const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned i = 0; i < threads; ++i) {
      workers.emplace_back([&] {
        for (size_t k = next++; k < computed.size(); k = next++) {
          m->gpt_->InitParams(computed[k], kSeed, m->init_[computed[k]]).IgnoreError();
        }
      });
    }
    for (auto& w : workers) w.join();
    return m;
  }

  const std::string& preset() const { return preset_; }
  const models::GptShape& shape() const { return gpt_->shape(); }

  Status InitParams(int block, uint64_t seed, std::span<float> out) const override {
    if (seed != kSeed) return gpt_->InitParams(block, seed, out);
    const std::vector<float>& init = init_[CacheIndex(block)];
    STRATA_CHECK(out.size() == init.size());
    std::memcpy(out.data(), init.data(), out.size_bytes());
    return Status::Ok();
  }

 private:
  CachedInitModel(std::string preset, std::unique_ptr<models::GptModel> gpt)
      : ForwardingModel(gpt.get()), preset_(std::move(preset)), gpt_(std::move(gpt)) {}
  std::string preset_;
  // The block whose cached weights `block` starts from: itself, or layer 0 (block 1) for every
  // layer block (1..L) when replicating.
  int CacheIndex(int block) const {
    const int layers = gpt_->shape().num_layers;
    return replicate_layers_ && block >= 1 && block <= layers ? 1 : block;
  }

  std::unique_ptr<models::GptModel> gpt_;
  bool replicate_layers_ = false;
  std::vector<std::vector<float>> init_;  // per block, InitParams(block, kSeed); empty if unused
};

// The model of the preset running now; the previous preset's is released first.
StatusOr<CachedInitModel*> ModelFor(const Preset& preset) {
  static std::unique_ptr<CachedInitModel> model;
  if (!model || model->preset() != preset.name) {
    model.reset();
    STRATA_ASSIGN_OR_RETURN(model,
                            CachedInitModel::Create(preset.name, preset.replicate_layer_init));
  }
  return model.get();
}

// Wall seconds of the last case that ran (setup included), for the next case's budget check.
double g_last_case_s = 0;

// step_s of each preset's resident case, for offload_cost.
double g_resident_step_s[std::size(kPresets)] = {};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void Skip(benchmark::State& state, const std::string& why) { state.SkipWithError(why.c_str()); }

void BM_TrainStep(benchmark::State& state, int preset_index, Placement placement) {
  const Preset& preset = kPresets[preset_index];
  gpu::bench::GpuContext& ctx = gpu::bench::Gpu();
  if (!ctx.device) return Skip(state, ctx.why_not);
  const auto t_case = Clock::now();
  const double budget = BudgetSeconds();
  if (Since(g_program_start) + g_last_case_s > budget) {
    return Skip(state, fmt::format("time budget: {:.0f} s since the program started, the previous "
                                   "case took {:.0f} s, the budget is {:.0f} s "
                                   "(STRATA_BENCH_BUDGET_S)",
                                   Since(g_program_start), g_last_case_s, budget));
  }
  struct CaseTimer {  // records this case's duration for the next case's check
    Clock::time_point t0;
    ~CaseTimer() { g_last_case_s = Since(t0); }
  } case_timer{t_case};
  auto model_or = ModelFor(preset);
  if (!model_or.ok()) return Skip(state, model_or.status().ToString());
  CachedInitModel& model = **model_or;
  const MicroBatchShape mb = preset.micro_batch;
  const int accum = preset.grad_accum_steps;

  // Declared before the device and the engine, which record into it until they are destroyed.
  trace::TraceRecorder recorder(/*keep_events=*/false);
  gpu::CudaDeviceOptions dopt;
  dopt.trace = &recorder;
  auto device = gpu::CreateCudaDevice(dopt);
  if (!device.ok()) return Skip(state, device.status().ToString());

  EngineOptions o;
  o.precision = DType::kBF16;
  o.micro_batch = mb;
  o.grad_accum_steps = accum;
  o.optimizer.adamw().lr = 1e-4f;
  o.grad_clip_norm = GradClip();
  o.seed = kSeed;
  o.trace = &recorder;
  PlacementOptions& p = o.placement;
  p.activation_checkpointing = g_checkpointing;
  switch (placement) {
    case Placement::kResident:
    case Placement::kResidentDuringBackward:
    case Placement::kDevice:
    case Placement::kSplit:
      o.update_during_backward = placement == Placement::kResidentDuringBackward;
      p.param_home = ParamHome::kDevice;
      p.optimizer_home =
          placement == Placement::kDevice ? OptimizerHome::kDevice : OptimizerHome::kHost;
      p.optimizer_device_fraction = placement == Placement::kSplit ? 0.5 : 0;
      p.device_budget_bytes = 128 * kGiB;
      break;
    case Placement::kHost:
    case Placement::kNvme:
      p.param_home = placement == Placement::kHost ? ParamHome::kHost : ParamHome::kNvme;
      p.optimizer_home =
          placement == Placement::kHost ? OptimizerHome::kHost : OptimizerHome::kNvme;
      p.streaming_slots = 3;
      p.device_budget_bytes = StreamingMinimumBytes(model, o.precision, mb, p.streaming_slots);
      break;
  }
  // The planner refuses (kResourceExhausted, saying what is short) a plan that needs more host
  // memory than is available now, the initial weights above already taken; 4 GiB are left for
  // the rest of the process and the system.
  if (const uint64_t avail = HostMemAvailableBytes(); avail > 8 * kGiB) {
    p.host_budget_bytes = avail - 4 * kGiB;
  }
  if (placement == Placement::kNvme) {
    p.nvme_paths = {BenchDir()};
    std::error_code ec;
    const auto space = std::filesystem::space(BenchDir(), ec);
    if (ec) {
      return Skip(state, fmt::format("cannot stat the swap directory {}: {} (set "
                                     "STRATA_BENCH_DIR to a directory on a local drive)",
                                     BenchDir(), ec.message()));
    }
    p.nvme_capacity_bytes = space.available;  // the planner says what is short
  }

  auto engine_or = Engine::Create(&model, device->get(), o);
  if (!engine_or.ok()) return Skip(state, engine_or.status().ToString());
  Engine& e = **engine_or;

  std::mt19937_64 rng(7);
  std::vector<std::vector<int32_t>> tokens(accum), targets(accum);
  std::vector<MicroBatch> batch(accum);
  for (int i = 0; i < accum; ++i) {
    tokens[i].resize(mb.tokens());
    targets[i].resize(mb.tokens());
    for (auto& t : tokens[i]) t = static_cast<int32_t>(rng() % model.vocab_size());
    for (auto& t : targets[i]) t = static_cast<int32_t>(rng() % model.vocab_size());
    batch[i] = {tokens[i], targets[i]};
  }

  const int steps = placement == Placement::kNvme ? preset.timed_steps_nvme : preset.timed_steps;
  const auto t_warm = Clock::now();
  if (auto r = e.Step(batch); !r.ok()) return Skip(state, "warm-up step: " + r.status().ToString());
  if (Status s = e.Flush(); !s.ok()) return Skip(state, "warm-up flush: " + s.ToString());
  const double warm_s = Since(t_warm);
  const double elapsed = Since(g_program_start);
  if (elapsed + warm_s * (steps + 1) > budget) {
    return Skip(state,
                fmt::format("time budget: the warm-up step took {:.1f} s, so {} timed steps would "
                            "end past {:.0f} s since the program started ({:.0f} s now; "
                            "STRATA_BENCH_BUDGET_S)",
                            warm_s, steps, budget, elapsed));
  }

  const trace::Breakdown before = recorder.breakdown();
  const EngineCounters c0 = e.counters();
  std::vector<double> step_s;
  StepResult last;
  bool failed = false;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    auto r = e.Step(batch);
    const double dt = Since(t0);
    if (!r.ok()) {
      Skip(state, r.status().ToString());
      failed = true;
      break;
    }
    last = *r;
    step_s.push_back(dt);
    state.SetIterationTime(dt);
  }
  if (failed) return;
  const auto t_flush = Clock::now();
  if (Status s = e.Flush(); !s.ok()) return Skip(state, "flush: " + s.ToString());
  const double flush_s = Since(t_flush);
  const trace::Breakdown after = recorder.breakdown();
  const EngineCounters c1 = e.counters();

  const double n = static_cast<double>(step_s.size());
  const double median = Median(step_s);
  double sum = flush_s;
  for (double s : step_s) sum += s;
  const double wall_per_step = sum / n;
  double largest = 0;
  for (int i = 0; i < trace::kNumCategories; ++i) {
    const auto c = static_cast<trace::Category>(i);
    if (c == trace::Category::kOther) continue;
    const double part = (after.seconds[i] - before.seconds[i]) / n;
    state.counters[std::string(trace::CategoryName(c))] = part;
    largest = std::max(largest, part);
  }
  const models::GptShape& sh = model.shape();
  const double tokens_per_step = static_cast<double>(mb.tokens()) * accum;
  const std::optional<int64_t> per_token = ModelFlopsPerToken({.trained_params = model.num_params(),
                                                               .num_layers = sh.num_layers,
                                                               .attention_width = sh.channels,
                                                               .seq_len = mb.seq_len});
  if (!per_token) return Skip(state, "the model FLOPs per token do not fit in 63 bits");
  const double flops = static_cast<double>(*per_token) * tokens_per_step;
  state.counters["step_s"] = median;
  state.counters["wall_per_step_s"] = wall_per_step;
  state.counters["grad_norm"] = last.grad_norm;
  if (c1.params_updated_on_cpu > c0.params_updated_on_cpu) {
    state.counters["during_backward_share"] =
        static_cast<double>(c1.params_updated_during_backward - c0.params_updated_during_backward) /
        static_cast<double>(c1.params_updated_on_cpu - c0.params_updated_on_cpu);
  }
  state.counters["tokens_per_s"] = tokens_per_step / median;
  state.counters["model_TFLOP_per_s"] = flops / median / 1e12;
  if (g_peak_tflops > 0) state.counters["MFU"] = flops / median / 1e12 / g_peak_tflops;
  state.counters["overlap_efficiency"] = largest / wall_per_step;
  state.counters["h2d_GB"] = static_cast<double>(c1.bytes_h2d - c0.bytes_h2d) / n / 1e9;
  state.counters["d2h_GB"] = static_cast<double>(c1.bytes_d2h - c0.bytes_d2h) / n / 1e9;
  state.counters["nvme_read_GB"] =
      static_cast<double>(c1.nvme_bytes_read - c0.nvme_bytes_read) / n / 1e9;
  state.counters["nvme_write_GB"] =
      static_cast<double>(c1.nvme_bytes_written - c0.nvme_bytes_written) / n / 1e9;
  state.counters["loss"] = last.loss;
  state.counters["kept_layers"] = e.plan().num_keeping_activations();
  if (placement == Placement::kResident) {
    g_resident_step_s[preset_index] = median;
  } else if (g_resident_step_s[preset_index] > 0) {
    state.counters["offload_cost"] = median / g_resident_step_s[preset_index];
  }
  const Plan& plan = e.plan();
  state.SetLabel(fmt::format(
      "{} params, B={} T={} x{}; {} of {} blocks resident, prefetch {}; device arena {} of "
      "{} state; {}",
      plan.model_params, mb.batch_size, mb.seq_len, accum, plan.num_resident(), plan.blocks.size(),
      plan.prefetch_depth, FormatBytes(plan.device_total_bytes),
      FormatBytes(plan.model_state_bytes),
      placement == Placement::kNvme
          ? fmt::format("swap {} in {} ({} backend)", FormatBytes(plan.nvme_bytes), BenchDir(),
                        e.io_backend_name())
          : std::string("optimizer state on host")));
}

}  // namespace
}  // namespace strata::engine

int main(int argc, char** argv) {
  using namespace strata::engine;
  strata::SetLogLevel(strata::LogLevel::kWarning);
  benchmark::Initialize(&argc, argv);
  // Our flags, --peak-tflops=X, --machine=FILE and --activation-checkpointing=auto|all|none, taken
  // out before Google Benchmark checks the rest.
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    constexpr std::string_view kPeak = "--peak-tflops=";
    constexpr std::string_view kMachine = "--machine=";
    constexpr std::string_view kCheckpointing = "--activation-checkpointing=";
    if (std::string_view(argv[i]).starts_with(kPeak)) {
      g_peak_tflops = std::atof(argv[i] + kPeak.size());
      g_peak_source = "--peak-tflops";
      if (g_peak_tflops <= 0) {
        std::fprintf(stderr, "bench_train_step: %s: a positive number is needed\n", argv[i]);
        return 2;
      }
    } else if (std::string_view(argv[i]).starts_with(kMachine)) {
      auto profile = ReadMachineProfile(argv[i] + kMachine.size());
      if (!profile.ok()) {
        std::fprintf(stderr, "bench_train_step: %s\n", profile.status().ToString().c_str());
        return 2;
      }
      if (g_peak_source.empty() && profile->device && profile->device->peak_bf16_TFLOPs > 0) {
        g_peak_tflops = profile->device->peak_bf16_TFLOPs;
        g_peak_source = "--machine";
      }
    } else if (std::string_view(argv[i]).starts_with(kCheckpointing)) {
      auto mode = ParseActivationCheckpointing(argv[i] + kCheckpointing.size());
      if (!mode.ok()) {
        std::fprintf(stderr, "bench_train_step: %s\n", mode.status().ToString().c_str());
        return 2;
      }
      g_checkpointing = *mode;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  strata::gpu::bench::GpuContext& ctx = strata::gpu::bench::Gpu();  // context lines first
  if (g_peak_tflops == 0 && ctx.device) {
    g_peak_tflops = DatasheetPeakBf16Tflops(ctx.device->description());
    g_peak_source = "datasheet, by the device name";
  }
  benchmark::AddCustomContext(
      "peak_bf16_tflops",
      g_peak_tflops > 0 ? fmt::format("{:.0f} ({})", g_peak_tflops, g_peak_source)
                        : std::string("unknown (no MFU; give --peak-tflops=X or --machine=FILE)"));
  benchmark::AddCustomContext("activation_checkpointing",
                              std::string(ActivationCheckpointingName(g_checkpointing)));
  benchmark::AddCustomContext("nvme_dir", BenchDir());
  benchmark::AddCustomContext("time_budget_s", fmt::format("{:.0f}", BudgetSeconds()));
  benchmark::AddCustomContext("grad_clip", fmt::format("{:g}", GradClip()));
  benchmark::AddCustomContext("hardware_threads",
                              std::to_string(std::thread::hardware_concurrency()));
  // Resident first in each preset: the offloaded cases report offload_cost against it.
  for (int i = 0; i < static_cast<int>(std::size(kPresets)); ++i) {
    for (Placement pl : kPlacements) {
      const Preset& pr = kPresets[i];
      benchmark::RegisterBenchmark(
          fmt::format("TrainStep/{}/{}", pr.name, PlacementName(pl)).c_str(),
          [i, pl](benchmark::State& s) { BM_TrainStep(s, i, pl); })
          ->Iterations(pl == Placement::kNvme ? pr.timed_steps_nvme : pr.timed_steps)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
