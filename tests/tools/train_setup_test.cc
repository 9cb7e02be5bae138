#include "tools/train_setup.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/units.h"
#include "data/token_dataset.h"
#include "engine/engine.h"
#include "engine/plan/machine_profile.h"
#include "engine/plan/plan_choice.h"
#include "engine/plan/planner.h"
#include "gpu/device.h"
#include "gpu/pinned_memory.h"
#include "io/io_backend.h"
#include "tools/device_select.h"
#include "tools/model_spec.h"

namespace strata::tools {
namespace {

TEST(TrainSetup, DefaultFlagsBecomeTheEngineOptions) {
  const TrainFlags f;
  auto o = TrainOptionsFromFlags(f, {});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->engine.precision, DType::kBF16);
  EXPECT_EQ(o->engine.micro_batch.batch_size, 1);
  EXPECT_EQ(o->engine.micro_batch.seq_len, 64);
  EXPECT_EQ(o->engine.grad_accum_steps, 8);
  EXPECT_FLOAT_EQ(o->engine.grad_clip_norm, 1.0f);
  EXPECT_EQ(o->engine.seed, 1337u);
  EXPECT_TRUE(o->engine.overlap);
  EXPECT_EQ(o->engine.placement.param_home, engine::ParamHome::kNvme);
  EXPECT_EQ(o->engine.placement.optimizer_home, engine::OptimizerHome::kNvme);
  EXPECT_EQ(o->engine.placement.nvme_paths, std::vector<std::string>{"."});
  EXPECT_EQ(o->engine.placement.streaming_slots, 0);
  EXPECT_EQ(o->engine.placement.ranks, 1);
  EXPECT_FALSE(o->engine.placement.data_parallel);
  EXPECT_EQ(o->engine.io.kind, io::BackendKind::kAuto);
  EXPECT_EQ(o->engine.io.block_size_bytes, size_t{1} << 20);
  EXPECT_EQ(o->engine.io.queue_depth, 32);
  EXPECT_EQ(o->engine.io.posix_threads, 4);
  EXPECT_TRUE(o->automatic.device_budget);
  EXPECT_EQ(o->engine.placement.device_budget_bytes, 0u);  // until the plan is chosen
  EXPECT_EQ(o->engine.comm, nullptr);
  EXPECT_EQ(o->engine.trace, nullptr);
}

TEST(TrainSetup, PackAndLongExamplesReachTheExampleData) {
  // Token files with flags: examples of 3, 12 (longer than the rows), 4 and 3 tokens.
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("strata_train_setup_sft_" + std::to_string(::getpid()) + ".bin"))
                               .string();
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;
  for (int length : {3, 12, 4, 3, 3, 3, 3, 3, 3, 3}) {
    for (int i = 0; i < length; ++i) {
      tokens.push_back(10 + i);
      flags.push_back(static_cast<uint8_t>((i == 0 ? data::kTokenFlagExampleStart : 0) |
                                           (i > 0 ? data::kTokenFlagInLoss : 0)));
    }
  }
  ASSERT_TRUE(data::WriteTokenFile(path, tokens, flags).ok());
  TrainFlags f;
  f.model = "tiny";
  f.data = {path};
  f.seq_len = 8;
  f.pack = true;
  f.long_examples = "skip";
  auto o = TrainOptionsFromFlags(f, {});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  auto in = OpenModelAndData(*o);
  std::filesystem::remove(path);
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  EXPECT_THAT(in->data.dataset->Describe(),
              ::testing::HasSubstr("packed; 1 longer than 8 tokens skipped"));
}

TEST(TrainSetup, FlagsReachTheirOptionStruct) {
  TrainFlags f;
  f.precision = "fp16";
  f.device_budget = "64MiB";
  f.prefetch_depth = 2;
  f.offload_params = "host";
  f.offload_optimizer = "host";
  f.io_backend = "posix";
  f.io_block_size = "8KiB";
  f.io_queue_depth = 1;
  f.io_threads = 1;
  f.no_overlap = true;
  f.copy_bandwidth = 25e9;
  f.tensorboard_dir = "/tmp/tb";
  f.fp16_hysteresis = 2;
  auto o = TrainOptionsFromFlags(f, {});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->engine.precision, DType::kF16);
  EXPECT_FALSE(o->automatic.device_budget);
  EXPECT_EQ(o->engine.placement.device_budget_bytes, 64 * kMiB);
  EXPECT_EQ(o->engine.placement.streaming_slots, 3);
  EXPECT_EQ(o->engine.placement.param_home, engine::ParamHome::kHost);
  EXPECT_EQ(o->engine.io.kind, io::BackendKind::kPosix);
  EXPECT_EQ(o->engine.io.block_size_bytes, 8 * kKiB);
  EXPECT_EQ(o->engine.io.queue_depth, 1);
  EXPECT_EQ(o->engine.io.posix_threads, 1);
  EXPECT_FALSE(o->engine.overlap);
  EXPECT_EQ(o->engine.loss_scaler.hysteresis, 2);
  EXPECT_DOUBLE_EQ(o->device.host.copy_bytes_per_second, 25e9);
  EXPECT_EQ(o->metrics.tensorboard_dir, "/tmp/tb");
}

// The I/O flags are checked by io::ValidateIoBackendOptions alone: its message, after the flag.
TEST(TrainSetup, BadIoRangesAreRefusedByTheIoLibraryNamingTheFlag) {
  struct Case {
    std::string flag;
    void (*set)(TrainFlags*);
    void (*set_io)(io::IoBackendOptions*);
  };
  const Case cases[] = {
      {"--io-queue-depth", [](TrainFlags* f) { f->io_queue_depth = 0; },
       [](io::IoBackendOptions* o) { o->queue_depth = 0; }},
      {"--io-queue-depth", [](TrainFlags* f) { f->io_queue_depth = 4097; },
       [](io::IoBackendOptions* o) { o->queue_depth = 4097; }},
      {"--io-block-size", [](TrainFlags* f) { f->io_block_size = "1000"; },
       [](io::IoBackendOptions* o) { o->block_size_bytes = 1000; }},
      {"--io-block-size", [](TrainFlags* f) { f->io_block_size = "2GiB"; },
       [](io::IoBackendOptions* o) { o->block_size_bytes = size_t{2} << 30; }},
      {"--io-threads", [](TrainFlags* f) { f->io_threads = 300; },
       [](io::IoBackendOptions* o) { o->posix_threads = 300; }},
  };
  for (const Case& c : cases) {
    TrainFlags f;
    c.set(&f);
    io::IoBackendOptions io;
    c.set_io(&io);
    const Status expected = io::ValidateIoBackendOptions(io);
    ASSERT_FALSE(expected.ok()) << c.flag;
    auto o = TrainOptionsFromFlags(f, {});
    ASSERT_FALSE(o.ok()) << c.flag;
    EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument) << c.flag;
    EXPECT_EQ(o.status().message(), c.flag + ": " + expected.message());
  }
  TrainFlags unparsable;
  unparsable.io_block_size = "12XB";
  auto o = TrainOptionsFromFlags(unparsable, {});
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().message().rfind("--io-block-size: ", 0), 0u) << o.status().message();
  TrainFlags memory;
  memory.io_backend = "memory";
  EXPECT_EQ(TrainOptionsFromFlags(memory, {}).status().code(), StatusCode::kInvalidArgument);
}

TEST(TrainSetup, RanksDeriveAccumulationStepsAndOnlyRankZeroWritesOutputs) {
  TrainFlags f;
  f.micro_batch_size = 2;
  f.global_batch_size = 16;
  f.summary_json = "/tmp/s.json";
  f.trace = "/tmp/t.json";
  f.metrics_jsonl = "/tmp/m.jsonl";
  f.nvme_paths = {"/nvme/{rank}", "/nvme{local_rank}"};
  const RankInfo rank1{.ranks = 2, .rank = 1, .local_rank = 3, .data_parallel = true};
  auto o = TrainOptionsFromFlags(f, rank1);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->flags.grad_accum_steps, 4);  // 16 / (2 x 2 ranks)
  EXPECT_EQ(o->engine.grad_accum_steps, 4);
  EXPECT_TRUE(o->flags.summary_json.empty());
  EXPECT_TRUE(o->flags.trace.empty());
  EXPECT_TRUE(o->metrics.jsonl_path.empty());
  EXPECT_EQ(o->engine.placement.nvme_paths, (std::vector<std::string>{"/nvme/1", "/nvme3"}));
  EXPECT_EQ(o->engine.placement.ranks, 2);
  EXPECT_EQ(o->engine.placement.rank, 1);
  EXPECT_TRUE(o->engine.placement.data_parallel);
  EXPECT_EQ(o->device.cuda_device_ordinal, 3);

  auto rank0 = TrainOptionsFromFlags(f, {.ranks = 2, .rank = 0, .data_parallel = true});
  ASSERT_TRUE(rank0.ok());
  EXPECT_EQ(rank0->flags.summary_json, "/tmp/s.json");

  f.global_batch_size = 6;  // not a multiple of 2 x 2
  auto bad = TrainOptionsFromFlags(f, rank1);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--global-batch-size 6"), std::string::npos);
}

// A DeepSpeed file's train_batch_size is the global batch: a --micro-batch-size that overrides
// the file's keeps it (the accumulation is derived again, as DeepSpeed derives it), and a
// --grad-accum-steps that contradicts it is refused rather than silently replaced.
TEST(TrainSetup, AConfigFilesTrainBatchSizeHoldsOverTheFlagsThatOverrideTheFile) {
  TrainFlags f;  // what {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4} sets
  f.global_batch_size = 32;
  f.global_batch_from_config = true;
  f.micro_batch_size = 4;
  f.grad_accum_steps = 8;
  auto o = TrainOptionsFromFlags(f, {});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->flags.grad_accum_steps, 8);
  f.micro_batch_size = 8;  // --micro-batch-size 8 after --config
  o = TrainOptionsFromFlags(f, {});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->flags.grad_accum_steps, 4);
  EXPECT_EQ(o->engine.grad_accum_steps, 4);
  // Two ranks (the launcher's world unknown to the file): 32 = 8 x 2 ranks x 2.
  o = TrainOptionsFromFlags(f, {.ranks = 2, .rank = 0, .data_parallel = true});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->flags.grad_accum_steps, 2);
  f.micro_batch_size = 5;
  auto bad = TrainOptionsFromFlags(f, {});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "the --config file's train_batch_size 32 is not a multiple of micro-batch size 5 x 1 "
            "rank: pick a multiple of 5");
  f.micro_batch_size = 8;
  f.grad_accum_steps = 8;  // --grad-accum-steps 8
  f.grad_accum_given = true;
  bad = TrainOptionsFromFlags(f, {});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "--grad-accum-steps 8 contradicts the --config file's train_batch_size 32: "
            "micro-batch size 8 x 1 rank x 8 accumulation steps is 64; give one of them");
  f.grad_accum_steps = 4;  // agrees
  EXPECT_TRUE(TrainOptionsFromFlags(f, {}).ok());
}

TEST(TrainSetup, TheUpdateDuringBackwardIsAutoWithOneRankAndRefusedWithRanks) {
  TrainFlags f;
  auto one = TrainOptionsFromFlags(f, {});
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  // auto: off until the plan choice decides (by predicted time, with one rank and overlap:
  // engine/plan/plan_choice.h, tested in tests/engine/plan/plan_choice_test.cc).
  EXPECT_FALSE(one->engine.update_during_backward);
  EXPECT_TRUE(one->automatic.update_during_backward);
  f.update_during_backward = "on";
  EXPECT_TRUE(TrainOptionsFromFlags(f, {})->engine.update_during_backward);
  EXPECT_FALSE(TrainOptionsFromFlags(f, {})->automatic.update_during_backward);
  f.update_during_backward = "off";
  EXPECT_FALSE(TrainOptionsFromFlags(f, {})->engine.update_during_backward);
  EXPECT_FALSE(TrainOptionsFromFlags(f, {})->automatic.update_during_backward);
  const RankInfo two{.ranks = 2, .rank = 0, .data_parallel = true};
  f.update_during_backward = "auto";
  auto ranks = TrainOptionsFromFlags(f, two);
  ASSERT_TRUE(ranks.ok()) << ranks.status().ToString();
  EXPECT_FALSE(ranks->engine.update_during_backward);
  f.update_during_backward = "on";
  auto bad = TrainOptionsFromFlags(f, two);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--update-during-backward on needs one rank"),
            std::string::npos)
      << bad.status().ToString();
  f.update_during_backward = "auto";
  f.eager_update = true;
  auto old = TrainOptionsFromFlags(f, {});
  ASSERT_FALSE(old.ok());
  EXPECT_NE(old.status().message().find("replaced by --update-during-backward on"),
            std::string::npos);
}

TEST(TrainSetup, TheScheduleFlagParsesAndABadValueIsOneLineNamingIt) {
  TrainFlags f;  // --schedule auto, 8 micro-batches
  auto o = TrainOptionsFromFlags(f, {});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->automatic.schedule);
  EXPECT_EQ(o->engine.placement.schedule, engine::Schedule::kMicroBatchMajor);  // until chosen
  f.schedule = "layer-major";
  o = TrainOptionsFromFlags(f, {});
  ASSERT_TRUE(o.ok());
  EXPECT_FALSE(o->automatic.schedule);
  EXPECT_EQ(o->engine.placement.schedule, engine::Schedule::kLayerMajor);
  f.schedule = "micro-batch-major";
  EXPECT_EQ(TrainOptionsFromFlags(f, {})->engine.placement.schedule,
            engine::Schedule::kMicroBatchMajor);
  f.schedule = "sideways";
  auto bad = TrainOptionsFromFlags(f, {});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(),
            "--schedule 'sideways' is not one of auto, layer-major, micro-batch-major");
}

struct ScheduleRun {
  TrainOptions options;
  ModelSpec spec;
  std::unique_ptr<engine::Model> model;
  engine::PlanChoice choice;
  std::string line;  // the choice's schedule reason
};

ScheduleRun ChooseScheduleFor(const TrainFlags& f, const engine::MachineProfile* machine) {
  ScheduleRun run;
  auto o = TrainOptionsFromFlags(f, {});
  EXPECT_TRUE(o.ok()) << o.status().ToString();
  run.options = *o;
  auto spec = ResolveModelSpec(f.model, f.model_dir, /*config_only=*/true);
  EXPECT_TRUE(spec.ok());
  run.spec = *spec;
  auto model = BuildModel(run.spec, /*load_weights=*/false);
  EXPECT_TRUE(model.ok());
  run.model = std::move(*model);
  auto choice = ChooseTrainPlan(*run.model, run.spec, machine, &run.options, /*compare=*/true);
  EXPECT_TRUE(choice.ok()) << choice.status().ToString();
  if (choice.ok()) run.choice = std::move(*choice);
  run.line = run.choice.schedule_reason;
  return run;
}

TEST(TrainSetup, AutoScheduleIsLayerMajorWhenItsPlanFitsAndElseMicroBatchMajor) {
  TrainFlags f;
  f.model = "tiny";
  f.seq_len = 16;
  f.grad_accum_steps = 4;
  // A budget that holds four micro-batches: layer-major.
  f.device_budget = "64MiB";
  ScheduleRun run = ChooseScheduleFor(f, nullptr);
  EXPECT_EQ(run.options.engine.placement.schedule, engine::Schedule::kLayerMajor);
  EXPECT_NE(run.line.find("schedule: layer-major (auto: its plan of 4 micro-batches fits"),
            std::string::npos)
      << run.line;
  EXPECT_EQ(run.choice.plan.held_micro_batches, 4);
  EXPECT_EQ(run.choice.plan.schedule, engine::Schedule::kLayerMajor);

  // --device-budget auto is the micro-batch-major plan's (the tiny model's: its streaming
  // minimum, one micro-batch's activations), which four micro-batches do not fit.
  f.device_budget = "auto";
  run = ChooseScheduleFor(f, nullptr);
  EXPECT_EQ(run.options.engine.placement.schedule, engine::Schedule::kMicroBatchMajor);
  EXPECT_NE(run.line.find("schedule: micro-batch-major (auto: the layer-major plan"),
            std::string::npos)
      << run.line;
  EXPECT_NE(run.line.find("does not fit"), std::string::npos) << run.line;
  EXPECT_EQ(std::count(run.line.begin(), run.line.end(), '\n'), 1) << run.line;

  // A budget that holds micro-batch-major's streaming minimum (one micro-batch's activations)
  // and not four micro-batches'.
  f.device_budget = std::to_string(
      engine::StreamingMinimumBytes(*run.model, DType::kBF16, {1, 16}, 2, false, 1, false, 1));
  run = ChooseScheduleFor(f, nullptr);
  EXPECT_EQ(run.options.engine.placement.schedule, engine::Schedule::kMicroBatchMajor);
  EXPECT_NE(run.line.find("does not fit"), std::string::npos) << run.line;

  // Given, or one micro-batch: nothing to say.
  f.device_budget = "auto";
  f.schedule = "micro-batch-major";
  EXPECT_EQ(ChooseScheduleFor(f, nullptr).line, "");
  f.schedule = "auto";
  f.grad_accum_steps = 1;
  run = ChooseScheduleFor(f, nullptr);
  EXPECT_EQ(run.line, "");
  EXPECT_EQ(run.options.engine.placement.schedule, engine::Schedule::kMicroBatchMajor);
}

// Issue 32's case with the H200 profile: gpt-7b at 24 GiB, 16 micro-batches of 2 x 2048; the
// placement left auto is chosen for each schedule.
TEST(TrainSetup, AutoScheduleWithAMachineTakesLayerMajorWhenItsStepIsNotLonger) {
  auto h200 =
      engine::ReadMachineProfile(std::string(STRATA_SOURCE_DIR) + "/bench/machines/h200.json");
  ASSERT_TRUE(h200.ok()) << h200.status().ToString();
  TrainFlags f;
  f.model = "gpt-7b";
  f.micro_batch_size = 2;
  f.seq_len = 2048;
  f.grad_accum_steps = 16;
  f.device_budget = "24GiB";
  ScheduleRun run = ChooseScheduleFor(f, &*h200);
  EXPECT_EQ(run.options.engine.placement.schedule, engine::Schedule::kLayerMajor) << run.line;
  EXPECT_NE(run.line.find("schedule: layer-major (auto: predicted step"), std::string::npos)
      << run.line;
  EXPECT_NE(run.line.find("s micro-batch-major)"), std::string::npos) << run.line;
  // The steps it compared are those of the plans each schedule would run (the choice's
  // comparison, which estimate prints).
  ASSERT_EQ(run.choice.schedules.size(), 2u);
  for (const engine::PlanAlternative& s : run.choice.schedules) {
    ASSERT_TRUE(s.prediction) << s.why_not;
    EXPECT_NE(run.line.find(fmt::format("{:.3g} s {}", s.prediction->step_s, s.name)),
              std::string::npos)
        << run.line;
  }
  EXPECT_EQ(run.choice.plan.schedule, engine::Schedule::kLayerMajor);
}

TEST(TrainSetup, FlagsForTheOtherKindOfDeviceAreRefusedBeforeAnyDeviceIsLookedFor) {
  TrainFlags tf32_on_host;
  tf32_on_host.device = "host";
  tf32_on_host.tf32 = true;
  EXPECT_NE(TrainOptionsFromFlags(tf32_on_host, {}).status().message().find("--tf32"),
            std::string::npos);
  TrainFlags throttled_gpu;
  throttled_gpu.device = "cuda";
  throttled_gpu.copy_bandwidth = 1e9;
  EXPECT_NE(TrainOptionsFromFlags(throttled_gpu, {}).status().message().find("--copy-bandwidth"),
            std::string::npos);
  TrainFlags unknown;
  unknown.device = "tpu";
  EXPECT_EQ(TrainOptionsFromFlags(unknown, {}).status().code(), StatusCode::kInvalidArgument);
  TrainFlags zero_budget;
  zero_budget.device_budget = "0";
  EXPECT_NE(TrainOptionsFromFlags(zero_budget, {}).status().message().find("--device-budget"),
            std::string::npos);
}

// The plan printed before the engine is created is the plan the engine runs: Engine::Create
// takes the chosen plan and plans nothing; a plan made for other options is refused.
TEST(TrainSetup, TheEngineRunsTheChosenPlanAndPlansNothing) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("strata_train_setup_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (const std::string offload : {"nvme", "host"}) {
    TrainFlags f;
    f.model = "tiny";
    f.seq_len = 16;
    f.grad_accum_steps = 2;
    f.offload_params = offload;
    f.offload_optimizer = offload;
    f.schedule = "micro-batch-major";
    f.nvme_paths = {dir.string()};
    f.io_backend = "posix";
    auto o = TrainOptionsFromFlags(f, {});
    ASSERT_TRUE(o.ok()) << o.status().ToString();
    auto spec = ResolveModelSpec(f.model, f.model_dir);
    ASSERT_TRUE(spec.ok());
    auto model = BuildModel(*spec, /*load_weights=*/true);
    ASSERT_TRUE(model.ok());
    auto choice = ChooseTrainPlan(**model, *spec, nullptr, &*o);
    ASSERT_TRUE(choice.ok()) << choice.status().ToString();
    EXPECT_EQ(o->engine.placement.device_budget_bytes,
              engine::AutoDeviceBudgetBytes(**model, DType::kBF16, {1, 16}, o->engine.placement,
                                            {o->engine.optimizer, 2}));
    const std::string printed = choice->plan.Describe();
    auto device = CreateDeviceFromFlag("host", {});
    ASSERT_TRUE(device.ok());
    const engine::PlanningCounts before = engine::PlanningCountsSoFar();
    auto e = engine::Engine::Create(model->get(), device->get(), o->engine, choice->plan);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    EXPECT_EQ(engine::PlanningCountsSoFar().plans_built, before.plans_built) << "re-planned";
    EXPECT_EQ((*e)->plan().Describe(), printed) << offload;
    e->reset();
    // Options other than the plan's: refused, naming what differs.
    engine::EngineOptions other = o->engine;
    other.placement.device_budget_bytes = engine::AllResidentBytes(**model, DType::kBF16, {1, 16});
    auto refused = engine::Engine::Create(model->get(), device->get(), other, choice->plan);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("the plan was made for"), std::string::npos)
        << refused.status().message();
    // The update during backward the plan did not hold a backup area for: refused too.
    engine::EngineOptions during = o->engine;
    ASSERT_FALSE(choice->plan.update_during_backward);
    during.update_during_backward = true;
    auto no_backup = engine::Engine::Create(model->get(), device->get(), during, choice->plan);
    ASSERT_FALSE(no_backup.ok());
    EXPECT_NE(no_backup.status().message().find("update_during_backward off (options: on"),
              std::string::npos)
        << no_backup.status().message();
    // Without overlap the engine does not run it, and the plan is the one it needs.
    during.overlap = false;
    EXPECT_TRUE(engine::Engine::Create(model->get(), device->get(), during, choice->plan).ok());
  }
  std::filesystem::remove_all(dir);
}

// A device that reports fixed memory figures, as a GPU would (free after the CUDA context, and
// the cuBLAS workspace the compute stream takes beside the arena); nothing else is used.
class FixedMemoryDevice final : public gpu::Device {
 public:
  explicit FixedMemoryDevice(gpu::DeviceMemoryInfo m) : Device(size_t{1} << 30), m_(m) {}
  gpu::DeviceKind kind() const override { return gpu::DeviceKind::kCuda; }
  std::string description() const override { return "fixed memory figures"; }
  StatusOr<std::unique_ptr<gpu::DeviceArena>> CreateArena(size_t) override {
    return InternalError("not used");
  }
  StatusOr<gpu::DeviceMemoryInfo> MemoryInfo() override { return m_; }
  StatusOr<std::unique_ptr<gpu::Stream>> CreateStream(std::string) override {
    return InternalError("not used");
  }
  StatusOr<std::unique_ptr<gpu::Event>> CreateEvent() override { return InternalError("not used"); }

 protected:
  StatusOr<std::byte*> PinnedAlloc(size_t n) override { return gpu::MapAlignedHostMemory(n); }
  void PinnedFree(std::byte* p, size_t n) override { gpu::UnmapAlignedHostMemory(p, n); }

 private:
  gpu::DeviceMemoryInfo m_;
};

// The budget is checked against free memory less what the backend takes beside the arena, so a
// budget in that margin is refused before anything is allocated (not later, by the workspace's
// cudaMalloc), and the advice is a budget that fits.
TEST(TrainSetup, TheDeviceBudgetLeavesRoomForWhatTheBackendTakesBesideTheArena) {
  gpu::DeviceMemoryInfo m;
  m.free_bytes = 10 * kGiB;
  m.total_bytes = 16 * kGiB;
  m.outside_arena_bytes = size_t{32} << 20;
  FixedMemoryDevice device(m);
  engine::Plan plan;
  plan.device_budget_bytes = m.free_bytes - m.outside_arena_bytes;
  plan.device_total_bytes = plan.device_budget_bytes - 4096;
  EXPECT_TRUE(CheckDeviceBudgetFits(device, plan, /*budget_auto=*/false).ok());
  EXPECT_TRUE(CheckDeviceBudgetFits(device, plan, /*budget_auto=*/true).ok());

  plan.device_budget_bytes += 1;  // one byte into the workspace's share: refused
  EXPECT_EQ(CheckDeviceBudgetFits(device, plan, /*budget_auto=*/false).code(),
            StatusCode::kResourceExhausted);
  plan.device_budget_bytes = m.free_bytes;  // all of free memory: was accepted, then failed later
  const Status s = CheckDeviceBudgetFits(device, plan, /*budget_auto=*/false);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "--device-budget is 10.00 GiB of device memory, more than the 9.97 GiB free on the "
            "cuda device (of 16.00 GiB; other processes may hold the rest; 32 MiB more are kept "
            "for the backend's own buffers): give --device-budget 9.96GiB or less, or free the "
            "device");
  // An auto budget is judged by what it planned, not by the budget field.
  EXPECT_TRUE(CheckDeviceBudgetFits(device, plan, /*budget_auto=*/true).ok());
  plan.device_total_bytes = m.free_bytes;
  const Status a = CheckDeviceBudgetFits(device, plan, /*budget_auto=*/true);
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(a.message(), ::testing::StartsWith("--device-budget auto planned 10.00 GiB"));

  // Without a margin (the host backend) the whole of free memory is the arena's.
  m.outside_arena_bytes = 0;
  FixedMemoryDevice host_like(m);
  plan.device_budget_bytes = m.free_bytes;
  EXPECT_TRUE(CheckDeviceBudgetFits(host_like, plan, /*budget_auto=*/false).ok());
}

}  // namespace
// A checkpoint's model description is read back from its manifest, which may be edited: a LoRA
// rank outside 1..65536 is refused, and the recorded base is quoted escaped when it differs.
TEST(TrainSetup, ACheckpointsModelDescriptionIsCheckedAsItIsReadBack) {
  auto spec = ResolveModelSpec("tiny", "", /*config_only=*/true);
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  spec->lora.rank = 4;
  spec->lora.alpha = 8;
  spec->lora.targets = {"attn"};
  nlohmann::json j = nlohmann::json::parse(ModelSpecJson(*spec));
  ASSERT_TRUE(ModelSpecFromJson(j.dump()).ok());
  for (const nlohmann::json& rank :
       {nlohmann::json(0), nlohmann::json(65537), nlohmann::json(int64_t{1} << 40),
        nlohmann::json(uint64_t{1} << 63), nlohmann::json(2.5)}) {
    j["lora"]["rank"] = rank;
    auto r = ModelSpecFromJson(j.dump());
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << rank.dump();
    EXPECT_THAT(r.status().message(), ::testing::HasSubstr("an integer rank (1 to 65536)"))
        << rank.dump();
  }
  j["lora"]["rank"] = 4;
  j["base"] = "preset other\x1b[2J";
  const Status differs = CheckResumeBase(*spec, j.dump(), "ckpt/step-4");
  EXPECT_EQ(differs.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(
      differs.message(),
      ::testing::HasSubstr("its adapters were trained over the base preset other\\x1B[2J; this "
                           "run's base is"));
}

}  // namespace strata::tools
