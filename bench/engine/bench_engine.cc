// One training step of the offload engine against the largest of its parts
// (docs/ARCHITECTURE.md, "Performance contract"): GPU compute, H2D, D2H, CPU optimizer, NVMe read
// and write. Runs on the host backend, whose H2D/D2H copies are throttled to a PCIe-like rate
// scaled to what the emulated "GPU" (the CPU) computes, with params and optimizer state on NVMe in
// a real file under $STRATA_BENCH_DIR (default /var/tmp; tmpfs would measure memory, not a drive).
//
// Each benchmark runs the same model, data and placement twice per configuration: the
// overlapped engine and the sequential pipeline (EngineOptions::overlap = false). Counters per
// step, in seconds: compute, h2d, d2h, cpu_optimizer, nvme_read, nvme_write (busy time from
// the trace recorder), and
//   overlap_efficiency = largest part / step time (1.0 = every other part hidden under it);
//   bound_vs_sequential = largest part of the sequential run (measured without contention in
//     the same process, just before) / this run's step time: a figure the overlapped run
//     cannot flatter by slowing its parts down through contention for the CPU.
// Iterations are steps; time is wall time (UseRealTime); the update a step leaves running is
// waited for inside the timed region of the next step, and the last one before reporting.
//
// BM_UpdateDuringBackward/during:d/clip_x100:c: the CPU update during backward (issue 29) off and
// on, with clipping at c / 100, params resident, optimizer state in host memory, copies throttled
// to 2 GB/s, one micro-batch of 16 tokens (so the CPU update is a large share of the step).
// Counters: step_s, during_backward_share (parameters whose update ran during backward and stood
// / parameters updated), rollback_steps (over the timed steps), tokens_per_s. On the host backend
// the emulated GPU computes on the same cores as the CPU update, so the update during backward
// competes with backward for them; on a GPU machine it does not.
//
// BM_Schedule/layer_major:l/during:d/config:c: the micro-batch-major (l = 0) and layer-major
// (l = 1) schedules (issue 32) with 8 micro-batches per step, the update during backward off or
// on. Config 0 (bound by the copies): micro-batches of 1 x 64 tokens,
// params streamed from pinned host memory (the budget holds each schedule's fixed regions, 3
// slots and two resident layers), state in host memory, copies throttled to 200 MB/s. Config 1
// (bound by the CPU round): micro-batches of 1 x 8 tokens, params resident, master weights and
// AdamW state on NVMe (the round reads, updates and writes every block's state), copies at
// 2 GB/s. Counters: step_s, tokens_per_s, h2d_bytes and grad_d2h_bytes per step (the engine's
// counters), and exposed_update_share = (step_s - the largest of compute, h2d and d2h) / the CPU
// round's busy time (cpu_optimizer + nvme_read + nvme_write; cpu_optimizer also holds the
// gradient fold), clamped to [0, 1]: how much of the round the step does not hide.
//
// BM_OptimizerState/optimizer:i compares the optimizers' state traffic (issue 16): the same
// model with working params in pinned host memory and the master weights and optimizer state on
// NVMe, one micro-batch per step (so compute is short and the NVMe pipeline bounds the step),
// overlapped, for adamw (fp32 m, v: 12 B/param each way with the master weights), adamw8bit
// (8-bit codes: about 6 B/param) and adafactor (factored second moment: about 4 B/param).
// Counters: nvme_read_bytes and nvme_write_bytes per step (the engine's counters), step_s and
// the time breakdown as BM_TrainStep's.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>

#include "base/logging.h"
#include "base/trace.h"
#include "base/units.h"
#include "engine/engine.h"
#include "gpu/device.h"
#include "models/gpt.h"

namespace strata::engine {
namespace {

std::string BenchDir() {
  const char* dir = std::getenv("STRATA_BENCH_DIR");
  return dir != nullptr && *dir != '\0' ? dir : "/var/tmp";
}

// Random tokens and targets for `count` identical micro-batches of shape mb (kept alive by the
// returned vectors).
struct Batch {
  std::vector<int32_t> tokens, targets;
  std::vector<MicroBatch> micro_batches;
};
std::unique_ptr<Batch> RandomBatch(MicroBatchShape mb, int count) {
  auto b = std::make_unique<Batch>();
  std::mt19937_64 rng(1);
  b->tokens.resize(mb.tokens());
  b->targets.resize(mb.tokens());
  for (auto& t : b->tokens) t = static_cast<int32_t>(rng() % 256);
  for (auto& t : b->targets) t = static_cast<int32_t>(rng() % 256);
  b->micro_batches.assign(count, MicroBatch{b->tokens, b->targets});
  return b;
}

// Two warm-up steps (swap files laid out, page cache settled), then the timed steps of `state`;
// each trace category's busy seconds per step go to state.counters. Returns the wall seconds per
// step and the largest part, or nullopt after SkipWithError.
struct StepTimes {
  double step_s = 0;
  double largest_s = 0;
};
std::optional<StepTimes> TimeSteps(benchmark::State& state, Engine& e,
                                   std::span<const MicroBatch> batch,
                                   trace::TraceRecorder& recorder) {
  for (int i = 0; i < 2; ++i) {
    if (!e.Step(batch).ok()) {
      state.SkipWithError("warm-up step failed");
      return std::nullopt;
    }
  }
  if (!e.Flush().ok()) {
    state.SkipWithError("warm-up flush failed");
    return std::nullopt;
  }
  const trace::Breakdown before = recorder.breakdown();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (auto r = e.Step(batch); !r.ok()) {
      state.SkipWithError(r.status().ToString().c_str());
      return std::nullopt;
    }
  }
  if (!e.Flush().ok()) {
    state.SkipWithError("flush failed");
    return std::nullopt;
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const trace::Breakdown after = recorder.breakdown();
  const double steps = static_cast<double>(state.iterations());
  StepTimes t;
  t.step_s = wall / steps;
  for (int i = 0; i < trace::kNumCategories; ++i) {
    const auto c = static_cast<trace::Category>(i);
    if (c == trace::Category::kOther) continue;
    const double part = (after.seconds[i] - before.seconds[i]) / steps;
    state.counters[std::string(trace::CategoryName(c))] = part;
    t.largest_s = std::max(t.largest_s, part);
  }
  state.counters["step_s"] = t.step_s;
  return t;
}

// The benchmarks' model (the "small" preset's shape: 14 blocks of ~200k params) on a host device
// whose copies run at copy_bps, traced into `recorder`; nullopt after SkipWithError.
struct Setup {
  std::unique_ptr<gpu::Device> device;
  std::unique_ptr<models::GptModel> model;
};
std::optional<Setup> MakeSetup(benchmark::State& state, double copy_bps,
                               trace::TraceRecorder& recorder) {
  gpu::HostDeviceOptions d;
  d.copy_bytes_per_second = copy_bps;
  d.trace = &recorder;
  auto device = gpu::CreateHostDevice(d);
  auto model = models::GptModel::Create({256, 64, 12, 4, 128});
  if (!device.ok() || !model.ok()) {
    state.SkipWithError("could not create the host device or the model");
    return std::nullopt;
  }
  return Setup{std::move(*device), std::move(*model)};
}

// The engine of `setup` with `o`, or null after SkipWithError.
std::unique_ptr<Engine> CreateEngine(benchmark::State& state, const Setup& setup,
                                     const EngineOptions& o) {
  auto engine = Engine::Create(setup.model.get(), setup.device.get(), o);
  if (!engine.ok()) {
    state.SkipWithError(engine.status().ToString().c_str());
    return nullptr;
  }
  return std::move(*engine);
}

// The engine of `setup` with `o`, timed by TimeSteps over o.grad_accum_steps identical random
// micro-batches of o.micro_batch per step, with the engine's counters before and after the
// timed steps; nullopt after SkipWithError.
struct TimedRun {
  std::unique_ptr<Engine> engine;
  StepTimes times;
  EngineCounters before, after;
};
std::optional<TimedRun> RunTimed(benchmark::State& state, const Setup& setup,
                                 const EngineOptions& o, trace::TraceRecorder& recorder) {
  TimedRun run;
  run.engine = CreateEngine(state, setup, o);
  if (!run.engine) return std::nullopt;
  const auto batch = RandomBatch(o.micro_batch, o.grad_accum_steps);
  run.before = run.engine->counters();
  const std::optional<StepTimes> t = TimeSteps(state, *run.engine, batch->micro_batches, recorder);
  if (!t) return std::nullopt;
  run.times = *t;
  run.after = run.engine->counters();
  return run;
}

// bf16, micro-batch mb x accum, swap under BenchDir(), a device budget of three streaming slots
// plus two resident layers, traced into `recorder`; the placement homes are the caller's.
EngineOptions BenchOptions(const Model& model, MicroBatchShape mb, int accum,
                           trace::TraceRecorder& recorder) {
  EngineOptions o;
  o.precision = DType::kBF16;
  o.micro_batch = mb;
  o.grad_accum_steps = accum;
  o.placement.nvme_paths = {BenchDir()};
  o.placement.device_budget_bytes =
      StreamingMinimumBytes(model, o.precision, mb, 3) + 2 * model.block_num_params(1) * 2;
  o.trace = &recorder;
  return o;
}

// The largest part of the last sequential run of each configuration, seconds per step.
double g_sequential_bound[8] = {};

// state.range(0): 1 = overlapped, 0 = sequential; state.range(1): configuration index.
void BM_TrainStep(benchmark::State& state) {
  const bool overlap = state.range(0) != 0;
  const int config = static_cast<int>(state.range(1));
  // 14 blocks of ~200k params (the "small" preset), 4 micro-batches of 2x64 tokens per step:
  // compute, copies, the CPU step and NVMe traffic each take tens to hundreds of milliseconds.
  const MicroBatchShape mb{2, 64};
  constexpr int kAccum = 4;
  const double copy_bps = config == 0 ? 100e6 : 200e6;

  trace::TraceRecorder recorder(/*keep_events=*/false);
  std::optional<Setup> setup = MakeSetup(state, copy_bps, recorder);
  if (!setup) return;
  EngineOptions o = BenchOptions(*setup->model, mb, kAccum, recorder);
  o.optimizer.adamw().lr = 1e-3f;
  o.placement.param_home = ParamHome::kNvme;
  o.placement.optimizer_home = OptimizerHome::kNvme;
  o.overlap = overlap;
  const std::optional<TimedRun> run = RunTimed(state, *setup, o, recorder);
  if (!run) return;
  const Engine& e = *run->engine;
  const StepTimes* t = &run->times;
  const double step_s = t->step_s, largest = t->largest_s;
  state.counters["overlap_efficiency"] = largest / step_s;
  if (!overlap) g_sequential_bound[config] = largest;
  if (overlap && g_sequential_bound[config] > 0) {
    state.counters["bound_vs_sequential"] = g_sequential_bound[config] / step_s;
  }
  state.counters["tokens_per_s"] = static_cast<double>(mb.tokens() * kAccum) / step_s;
  state.SetLabel(fmt::format("{}, copies {:.0f} MB/s, {} resident of {} blocks, prefetch {}",
                             overlap ? "overlapped" : "sequential", copy_bps / 1e6,
                             e.plan().num_resident(), e.plan().blocks.size(),
                             e.plan().prefetch_depth));
}

void BM_OptimizerState(benchmark::State& state) {
  const int which = static_cast<int>(state.range(0));
  const MicroBatchShape mb{1, 64};
  trace::TraceRecorder recorder(/*keep_events=*/false);
  std::optional<Setup> setup = MakeSetup(state, 200e6, recorder);
  if (!setup) return;
  EngineOptions o = BenchOptions(*setup->model, mb, 1, recorder);
  const char* names[3] = {"adamw", "adamw8bit", "adafactor"};
  if (which == 1) {
    o.optimizer = {cpu_optim::OptimizerKind::kAdamW8bit, cpu_optim::AdamWConfig{.lr = 1e-3f}};
  } else if (which == 2) {
    o.optimizer = {cpu_optim::OptimizerKind::kAdafactor, cpu_optim::AdafactorConfig{.lr = 1e-3f}};
  } else {
    o.optimizer.adamw().lr = 1e-3f;
  }
  o.placement.param_home = ParamHome::kHost;
  o.placement.optimizer_home = OptimizerHome::kNvme;
  const std::optional<TimedRun> run = RunTimed(state, *setup, o, recorder);
  if (!run) return;
  Engine& e = *run->engine;
  const EngineCounters &c0 = run->before, &c1 = run->after;
  const double steps = static_cast<double>(state.iterations()) + 2;  // the warm-up's too
  state.counters["nvme_read_bytes"] =
      static_cast<double>(c1.nvme_bytes_read - c0.nvme_bytes_read) / steps;
  state.counters["nvme_write_bytes"] =
      static_cast<double>(c1.nvme_bytes_written - c0.nvme_bytes_written) / steps;
  state.counters["state_bytes_per_param"] = static_cast<double>(e.plan().optimizer_state_bytes) /
                                            static_cast<double>(e.plan().model_params);
  state.SetLabel(fmt::format("{}, {} params, state on NVMe, params in pinned host memory",
                             names[which], e.plan().model_params));
}

// state.range(0): the update during backward off (0) or on (1); state.range(1): the clip threshold
// in hundredths (clipping is on in both).
void BM_UpdateDuringBackward(benchmark::State& state) {
  const bool during = state.range(0) != 0;
  const float clip = static_cast<float>(state.range(1)) / 100.0f;
  // Few tokens per step so the CPU update is a large share of the step, as for a big model whose
  // step is bound by it: params resident, state in host memory, copies (gradients D2H, updated
  // params H2D) throttled to 2 GB/s.
  const MicroBatchShape mb{1, 16};
  constexpr int kAccum = 1;
  trace::TraceRecorder recorder(/*keep_events=*/false);
  std::optional<Setup> setup = MakeSetup(state, 2e9, recorder);
  if (!setup) return;
  EngineOptions o = BenchOptions(*setup->model, mb, kAccum, recorder);
  o.optimizer.adamw().lr = 1e-4f;
  o.grad_clip_norm = clip;
  o.placement.param_home = ParamHome::kDevice;
  o.placement.device_budget_bytes = 1 << 30;
  o.placement.optimizer_home = OptimizerHome::kHost;
  o.update_during_backward = during;
  const std::optional<TimedRun> run = RunTimed(state, *setup, o, recorder);
  if (!run) return;
  Engine& e = *run->engine;
  const EngineCounters &c0 = run->before, &c1 = run->after;
  const StepTimes* t = &run->times;
  const double cpu = static_cast<double>(c1.params_updated_on_cpu - c0.params_updated_on_cpu);
  state.counters["during_backward_share"] =
      cpu > 0 ? static_cast<double>(c1.params_updated_during_backward -
                                    c0.params_updated_during_backward) /
                    cpu
              : 0.0;
  state.counters["rollback_steps"] = static_cast<double>(c1.rollback_steps - c0.rollback_steps);
  state.counters["tokens_per_s"] = static_cast<double>(mb.tokens() * kAccum) / t->step_s;
  state.SetLabel(
      fmt::format("update during backward {}, clip {:g}, {} params, state in host memory",
                  during ? "on" : "off", clip, e.plan().model_params));
}

void BM_Schedule(benchmark::State& state) {
  const Schedule schedule =
      state.range(0) != 0 ? Schedule::kLayerMajor : Schedule::kMicroBatchMajor;
  const bool during = state.range(1) != 0;
  const bool update_bound = state.range(2) != 0;
  const MicroBatchShape mb{1, update_bound ? 8 : 64};
  constexpr int kAccum = 8;
  trace::TraceRecorder recorder(/*keep_events=*/false);
  std::optional<Setup> setup = MakeSetup(state, update_bound ? 2e9 : 200e6, recorder);
  if (!setup) return;
  EngineOptions o = BenchOptions(*setup->model, mb, kAccum, recorder);
  o.optimizer.adamw().lr = 1e-4f;
  o.placement.schedule = schedule;
  o.placement.param_home = update_bound ? ParamHome::kDevice : ParamHome::kHost;
  o.placement.optimizer_home = update_bound ? OptimizerHome::kNvme : OptimizerHome::kHost;
  o.placement.device_budget_bytes =
      update_bound ? (1 << 30)
                   : StreamingMinimumBytes(*setup->model, o.precision, mb, 3, false, 1, false,
                                           schedule == Schedule::kLayerMajor ? kAccum : 1) +
                         2 * setup->model->block_num_params(1) * 2;
  o.update_during_backward = during;
  const std::optional<TimedRun> run = RunTimed(state, *setup, o, recorder);
  if (!run) return;
  Engine& e = *run->engine;
  const EngineCounters &c0 = run->before, &c1 = run->after;
  const StepTimes* t = &run->times;
  const double steps = static_cast<double>(state.iterations()) + 2;  // the warm-up's too
  state.counters["h2d_bytes"] = static_cast<double>(c1.bytes_h2d - c0.bytes_h2d) / steps;
  state.counters["grad_d2h_bytes"] =
      static_cast<double>(c1.grad_bytes_d2h - c0.grad_bytes_d2h) / steps;
  const double others =
      std::max({state.counters["compute"], state.counters["h2d"], state.counters["d2h"]});
  const double update =
      state.counters["cpu_optimizer"] + state.counters["nvme_read"] + state.counters["nvme_write"];
  state.counters["exposed_update_share"] =
      update > 0 ? std::clamp((t->step_s - others) / update, 0.0, 1.0) : 0.0;
  state.counters["tokens_per_s"] = static_cast<double>(mb.tokens() * kAccum) / t->step_s;
  state.SetLabel(
      fmt::format("{}, update during backward {}, {}x{} tokens x {}, {} resident of {} "
                  "blocks",
                  ScheduleName(schedule), during ? "on" : "off", mb.batch_size, mb.seq_len, kAccum,
                  e.plan().num_resident(), e.plan().blocks.size()));
}

// Sequential first so the overlapped run can compare against its parts.
BENCHMARK(BM_TrainStep)
    ->ArgNames({"overlap", "config"})
    ->Args({0, 0})
    ->Args({1, 0})
    ->Args({0, 1})
    ->Args({1, 1})
    ->Iterations(8)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Off and on, interleaved by repetitions (--benchmark_repetitions): clip 1.0 and a threshold the
// norm never reaches (100).
BENCHMARK(BM_UpdateDuringBackward)
    ->ArgNames({"during", "clip_x100"})
    ->ArgsProduct({{0, 1}, {100, 10000}})
    ->Iterations(20)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Both schedules in one run, interleaved by repetitions (--benchmark_repetitions).
BENCHMARK(BM_Schedule)
    ->ArgNames({"layer_major", "during", "config"})
    ->ArgsProduct({{0, 1}, {0, 1}, {0, 1}})
    ->Iterations(6)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_OptimizerState)
    ->ArgNames({"optimizer"})
    ->Args({0})
    ->Args({1})
    ->Args({2})
    ->Iterations(12)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace strata::engine

int main(int argc, char** argv) {
  strata::SetLogLevel(strata::LogLevel::kWarning);
  benchmark::AddCustomContext(
      "backend", "host (emulated device), NVMe swap under " + strata::engine::BenchDir());
  benchmark::AddCustomContext("hardware_threads",
                              std::to_string(std::thread::hardware_concurrency()));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
