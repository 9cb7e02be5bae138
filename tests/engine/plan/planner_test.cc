#include "engine/plan/planner.h"

#include <gtest/gtest.h>

#include "base/units.h"
#include "engine/plan/optimizer_state.h"
#include "models/gpt.h"

namespace strata::engine {
namespace {

TEST(Planner, BudgetBelowWorkingParamsStreamsSomeBlocksAndFits) {
  auto model = models::GptModel::Create(*models::GptPreset("small"));
  ASSERT_TRUE(model.ok());
  const MicroBatchShape mb{1, 64};
  PlacementOptions o;
  o.nvme_paths = {"/tmp"};
  const uint64_t minimum = StreamingMinimumBytes(**model, DType::kBF16, mb);
  const uint64_t working = (*model)->num_params() * 2;
  ASSERT_LT(minimum, working);
  o.device_budget_bytes = minimum + (working - minimum) / 2;
  ASSERT_LT(o.device_budget_bytes, 2 * static_cast<uint64_t>((*model)->num_params()));
  auto plan = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_LE(plan->device_total_bytes, o.device_budget_bytes);
  EXPECT_GT(plan->num_resident(), 0);
  EXPECT_LT(plan->num_resident(), (*model)->num_blocks());
  // Midway between the minimum and all-resident, the budget holds the third slot (prefetch two
  // blocks ahead) now that the fixed regions are 16-bit.
  EXPECT_EQ(plan->streaming_slots, 3);
  EXPECT_EQ(plan->prefetch_depth, 2);
  EXPECT_NE(plan->Describe().find("streamed per use from nvme"), std::string::npos);
  EXPECT_NE(plan->Describe().find("gradient buckets (2 x one block"), std::string::npos)
      << plan->Describe();
}

TEST(Planner, AutoDeviceBudgetIsMidwayBetweenStreamingMinimumAndWorkingParams) {
  auto model = models::GptModel::Create(*models::GptPreset("small"));
  ASSERT_TRUE(model.ok());
  const MicroBatchShape mb{1, 64};
  PlacementOptions o;
  o.nvme_paths = {"/tmp"};
  const uint64_t working = (*model)->num_params() * 2;
  const uint64_t minimum2 = StreamingMinimumBytes(**model, DType::kBF16, mb, 2);
  ASSERT_LT(minimum2, working);
  // streaming_slots 0 (the planner decides) sizes the minimum with two slots.
  EXPECT_EQ(AutoDeviceBudgetBytes(**model, DType::kBF16, mb, o),
            minimum2 + (working - minimum2) / 2);
  o.streaming_slots = 4;
  const uint64_t minimum4 = StreamingMinimumBytes(**model, DType::kBF16, mb, 4);
  ASSERT_GT(minimum4, minimum2);
  o.device_budget_bytes = AutoDeviceBudgetBytes(**model, DType::kBF16, mb, o);
  EXPECT_EQ(o.device_budget_bytes, minimum4 + (working - minimum4) / 2);
  auto plan = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_GT(plan->num_resident(), 0);
  EXPECT_LT(plan->num_resident(), (*model)->num_blocks());
  // Two data-parallel ranks pad blocks and add reduce-scatter buffers: a larger minimum.
  o.streaming_slots = 0;
  o.ranks = 2;
  o.data_parallel = true;
  const uint64_t minimum_dp = StreamingMinimumBytes(**model, DType::kBF16, mb, 2, false, 2, true);
  EXPECT_GT(minimum_dp, minimum2);
  EXPECT_EQ(AutoDeviceBudgetBytes(**model, DType::kBF16, mb, o),
            minimum_dp + (working - minimum_dp) / 2);
}

TEST(Planner, AutoDeviceBudgetKeepsEveryBlockWithDeviceHomeAndIsTheMinimumForSmallParams) {
  auto model = models::GptModel::Create(*models::GptPreset("tiny"));
  ASSERT_TRUE(model.ok());
  PlacementOptions o;
  o.param_home = ParamHome::kDevice;
  o.optimizer_home = OptimizerHome::kHost;
  o.offload_activations = true;
  const MicroBatchShape mb{1, 8};
  o.device_budget_bytes = AutoDeviceBudgetBytes(**model, DType::kBF16, mb, o);
  EXPECT_EQ(o.device_budget_bytes, AllResidentBytes(**model, DType::kBF16, mb, true));
  auto plan = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->num_resident(), (*model)->num_blocks());
  // Eight sequences on a tiny model: the activations and logits outweigh the params, and the budget
  // is the streaming minimum itself.
  o.param_home = ParamHome::kHost;
  const MicroBatchShape long_mb{8, 16};
  const uint64_t minimum = StreamingMinimumBytes(**model, DType::kBF16, long_mb, 2, true);
  ASSERT_GT(minimum, static_cast<uint64_t>((*model)->num_params()) * 2);
  EXPECT_EQ(AutoDeviceBudgetBytes(**model, DType::kBF16, long_mb, o), minimum);
}

// The update during backward's backup area (engine/update_speculation.h) is host memory the plan
// counts: max(64 MiB, an eighth of every CPU-optimized block's backup: its state region unless on
// NVMe, its working params unless streamed from NVMe), never more than all of them.
TEST(Planner, TheUpdateDuringBackwardsBackupAreaIsInTheHostTotal) {
  auto model = models::GptModel::Create(*models::GptPreset("gpt2-124m"));
  ASSERT_TRUE(model.ok());
  const MicroBatchShape mb{1, 64};
  PlacementOptions o;
  o.param_home = ParamHome::kHost;
  o.optimizer_home = OptimizerHome::kHost;
  o.device_budget_bytes = 1 << 30;
  auto off = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(off.ok()) << off.status().ToString();
  EXPECT_FALSE(off->update_during_backward);
  EXPECT_EQ(off->speculation_backup_bytes, 0u);

  const cpu_optim::AnyOptimizer adamw;
  uint64_t all = 0;
  for (int b = 0; b < (*model)->num_blocks(); ++b) {
    const uint64_t region = LayoutBlockState(**model, b, adamw).region_bytes;
    const uint64_t params = static_cast<uint64_t>((*model)->block_num_params(b)) * 2;
    all += (region + params + 63) / 64 * 64;
  }
  ASSERT_GT(all / 8, uint64_t{64} << 20);  // the eighth decides
  o.update_during_backward = true;
  auto on = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(on.ok()) << on.status().ToString();
  EXPECT_TRUE(on->update_during_backward);
  EXPECT_EQ(on->speculation_backup_bytes, all / 8);
  EXPECT_EQ(on->host_bytes, off->host_bytes + all / 8);
  EXPECT_EQ(on->pinned_bytes, off->pinned_bytes);
  EXPECT_NE(on->Describe().find("the update during backward's backup " + FormatBytes(all / 8)),
            std::string::npos)
      << on->Describe();

  o.speculation_backup_bytes = 5 * kMiB;  // as asked
  EXPECT_EQ(MakePlan(**model, DType::kBF16, mb, o)->speculation_backup_bytes, 5 * kMiB);
  o.speculation_backup_bytes = 4 * all;  // never more than all
  EXPECT_EQ(MakePlan(**model, DType::kBF16, mb, o)->speculation_backup_bytes, all);
  // A model whose backups are below the 64 MiB floor backs them all up.
  auto small = models::GptModel::Create(*models::GptPreset("small"));
  ASSERT_TRUE(small.ok());
  o.speculation_backup_bytes = 0;
  uint64_t small_all = 0;
  for (int b = 0; b < (*small)->num_blocks(); ++b) {
    small_all += (LayoutBlockState(**small, b, adamw).region_bytes +
                  static_cast<uint64_t>((*small)->block_num_params(b)) * 2 + 63) /
                 64 * 64;
  }
  ASSERT_LT(small_all, uint64_t{64} << 20);
  EXPECT_EQ(MakePlan(**small, DType::kBF16, mb, o)->speculation_backup_bytes, small_all);

  // Optimizer state on NVMe (its pipeline rolls back by not writing) and working params streamed
  // from NVMe: only the resident blocks' working params are backed up.
  o.speculation_backup_bytes = 0;
  o.param_home = ParamHome::kNvme;
  o.optimizer_home = OptimizerHome::kNvme;
  o.nvme_paths = {"/tmp"};
  o.device_budget_bytes = AutoDeviceBudgetBytes(**model, DType::kBF16, mb, o);
  auto nvme = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(nvme.ok()) << nvme.status().ToString();
  ASSERT_GT(nvme->num_resident(), 0);
  ASSERT_LT(nvme->num_resident(), (*model)->num_blocks());
  uint64_t resident = 0;
  for (int b = 0; b < (*model)->num_blocks(); ++b) {
    if (nvme->blocks[b].resident) {
      resident += (static_cast<uint64_t>((*model)->block_num_params(b)) * 2 + 63) / 64 * 64;
    }
  }
  EXPECT_EQ(nvme->speculation_backup_bytes,
            std::min(std::max(uint64_t{64} << 20, resident / 8), resident));

  // The device optimizer leaves no block to back up.
  o.param_home = ParamHome::kDevice;
  o.optimizer_home = OptimizerHome::kDevice;
  o.device_budget_bytes = 8ull << 30;
  auto device = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(device.ok()) << device.status().ToString();
  EXPECT_EQ(device->speculation_backup_bytes, 0u);
}

TEST(Planner, RejectsZeroBudgetAndMissingNvmePath) {
  auto model = models::GptModel::Create(*models::GptPreset("tiny"));
  PlacementOptions o;
  o.device_budget_bytes = 0;
  o.nvme_paths = {"/tmp"};
  EXPECT_EQ(MakePlan(**model, DType::kBF16, {1, 8}, o).status().code(),
            StatusCode::kInvalidArgument);
  o.device_budget_bytes = 1 << 30;
  o.nvme_paths.clear();
  EXPECT_EQ(MakePlan(**model, DType::kBF16, {1, 8}, o).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(Planner, DeviceHomeNeedsEveryBlockResident) {
  auto model = models::GptModel::Create(*models::GptPreset("tiny"));
  PlacementOptions o;
  o.param_home = ParamHome::kDevice;
  o.optimizer_home = OptimizerHome::kHost;
  o.device_budget_bytes = StreamingMinimumBytes(**model, DType::kBF16, {1, 8});
  auto plan = MakePlan(**model, DType::kBF16, {1, 8}, o);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(plan.status().message().find("`param_home device`"), std::string::npos);
}

TEST(Planner, HostBudgetAndNvmeCapacityAreCheckedWithTheShortfall) {
  auto model = models::GptModel::Create(*models::GptPreset("small"));
  ASSERT_TRUE(model.ok());
  const MicroBatchShape mb{1, 64};
  PlacementOptions o;
  o.nvme_paths = {"/tmp"};
  o.device_budget_bytes = 1 << 30;
  auto unlimited = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(unlimited.ok()) << unlimited.status().ToString();
  const uint64_t host_need = unlimited->host_bytes + unlimited->pinned_bytes;
  const uint64_t nvme_need = unlimited->nvme_bytes;
  ASSERT_GT(nvme_need, 0u);

  o.host_budget_bytes = host_need;  // exactly enough
  o.nvme_capacity_bytes = nvme_need;
  EXPECT_TRUE(MakePlan(**model, DType::kBF16, mb, o).ok());

  o.host_budget_bytes = host_need - 1;
  auto host_short = MakePlan(**model, DType::kBF16, mb, o);
  EXPECT_EQ(host_short.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(host_short.status().message().find("host budget"), std::string::npos);
  EXPECT_NE(host_short.status().message().find("1 B short"), std::string::npos)
      << host_short.status().message();

  o.host_budget_bytes = 0;  // unchecked
  o.nvme_capacity_bytes = nvme_need - 4096;
  auto nvme_short = MakePlan(**model, DType::kBF16, mb, o);
  EXPECT_EQ(nvme_short.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(nvme_short.status().message().find("4.0 KiB short"), std::string::npos)
      << nvme_short.status().message();
}

TEST(Planner, SevenBillionShapeFitsAn8GiBDeviceByStreaming) {
  auto model = models::GptModel::Create(*models::GptPreset("gpt-7b"));
  ASSERT_TRUE(model.ok());
  // 12 * layers * channels^2 + embeddings: about 6.5e9 parameters.
  EXPECT_GT((*model)->num_params(), 6'400'000'000);
  EXPECT_LT((*model)->num_params(), 6'600'000'000);
  PlacementOptions o;
  o.nvme_paths = {"/nvme0"};
  o.device_budget_bytes = 8ull << 30;
  auto plan = MakePlan(**model, DType::kBF16, {1, 2048}, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_LE(plan->device_total_bytes, o.device_budget_bytes);
  EXPECT_GT(plan->num_resident(), 0);
  EXPECT_LT(plan->num_resident(), (*model)->num_blocks());  // 12 GiB of bf16 params do not fit
  // Master weights and AdamW state of every block; working params of the streamed ones only (a
  // resident block loads from its pinned copy).
  uint64_t streamed = 0;
  for (const Plan::Block& b : plan->blocks) {
    if (!b.resident) streamed += static_cast<uint64_t>(b.num_params);
  }
  EXPECT_EQ(plan->nvme_bytes, static_cast<uint64_t>((*model)->num_params()) * 12 + streamed * 2);
}

TEST(Planner, DecidesSlotsBucketsAndPipelineBuffersFromTheBudgets) {
  auto model = models::GptModel::Create(*models::GptPreset("small"));
  ASSERT_TRUE(model.ok());
  const MicroBatchShape mb{1, 64};
  PlacementOptions o;
  o.nvme_paths = {"/tmp"};
  // Room for exactly three slots: the planner prefetches two blocks ahead.
  o.device_budget_bytes = StreamingMinimumBytes(**model, DType::kBF16, mb, 3);
  auto plan = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->streaming_slots, 3);
  EXPECT_EQ(plan->prefetch_depth, 2);
  EXPECT_EQ(plan->num_resident(), 0);
  EXPECT_EQ(plan->host_grad_buckets, 3);
  EXPECT_EQ(plan->optimizer_buffers, 3);  // read b+1, update b, write b-1
  EXPECT_EQ(plan->device_total_bytes, o.device_budget_bytes);
  const std::string words = plan->Describe();
  EXPECT_NE(words.find("prefetch 2 blocks ahead"), std::string::npos) << words;
  EXPECT_NE(words.find("read b+1, update b, write b-1 through 3 buffers"), std::string::npos)
      << words;
  // One byte less: two slots.
  o.device_budget_bytes -= 1;
  plan = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->streaming_slots, 2);
  EXPECT_EQ(plan->prefetch_depth, 1);
  // Explicit choices are kept; state in host memory needs one pipeline buffer.
  o.host_grad_buckets = 5;
  o.param_home = ParamHome::kHost;
  o.optimizer_home = OptimizerHome::kHost;
  plan = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->host_grad_buckets, 5);
  EXPECT_EQ(plan->optimizer_buffers, 1);
  EXPECT_EQ(plan->optimizer_buffer_bytes, 0u);
  // Too few slots or buckets is an error that says so.
  o.streaming_slots = 1;
  EXPECT_EQ(MakePlan(**model, DType::kBF16, mb, o).status().code(), StatusCode::kInvalidArgument);
  o.streaming_slots = 0;
  o.host_grad_buckets = 1;
  EXPECT_EQ(MakePlan(**model, DType::kBF16, mb, o).status().code(), StatusCode::kInvalidArgument);
}

TEST(Planner, OffloadedActivationsMoveAllButTwoToPinnedMemory) {
  auto model = models::GptModel::Create(*models::GptPreset("small"));
  ASSERT_TRUE(model.ok());
  const MicroBatchShape mb{4, 64};
  PlacementOptions o;
  o.nvme_paths = {"/tmp"};
  o.device_budget_bytes = 1ull << 30;
  o.param_home = ParamHome::kHost;
  auto kept = MakePlan(**model, DType::kBF16, mb, o);
  o.offload_activations = true;
  auto offloaded = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(kept.ok() && offloaded.ok());
  const uint64_t act = static_cast<uint64_t>((*model)->activation_elems(mb)) * 2;  // bf16
  const int n = (*model)->num_blocks();
  EXPECT_EQ(kept->device_total_bytes - offloaded->device_total_bytes, (n - 3) * act);
  EXPECT_EQ(offloaded->pinned_bytes - kept->pinned_bytes, (n - 1) * AlignUp(act, 4096));
  EXPECT_LT(StreamingMinimumBytes(**model, DType::kBF16, mb, 2, true),
            StreamingMinimumBytes(**model, DType::kBF16, mb, 2, false));
  EXPECT_NE(offloaded->Describe().find("in pinned host memory, 2 on the device"),
            std::string::npos);
}

// Issue 13: blocks compute in the working precision, so a 16-bit plan has no fp32 region at all:
// no staging copy of a block's params, no fp32 block gradients, and activations, activation
// gradients and the last-position logits at half their fp32 size; only the scratch differs
// otherwise (its fp32 statistics, and the head's fp32 (C, V) dWlm accumulator, which only
// 16-bit storage needs: fp32 accumulates in the gradient itself).
TEST(Planner, SixteenBitPlanHasNoFp32RegionsAndHalvesActivations) {
  auto model = models::GptModel::Create(*models::GptPreset("gpt2-124m"));
  ASSERT_TRUE(model.ok());
  const MicroBatchShape mb{4, 256};
  PlacementOptions o;
  o.nvme_paths = {"/tmp"};
  o.device_budget_bytes = 1ull << 30;
  o.param_home = ParamHome::kHost;
  auto bf16 = MakePlan(**model, DType::kBF16, mb, o);
  auto fp32 = MakePlan(**model, DType::kF32, mb, o);
  ASSERT_TRUE(bf16.ok() && fp32.ok()) << bf16.status().ToString() << fp32.status().ToString();
  ASSERT_EQ(bf16->device_regions.size(), fp32->device_regions.size());
  for (const DeviceRegion& r : bf16->device_regions) {
    EXPECT_EQ(r.label.find("fp32"), std::string::npos) << r.label;
    EXPECT_EQ(r.label.find("staging"), std::string::npos) << r.label;
  }
  const uint64_t act = static_cast<uint64_t>((*model)->activation_elems(mb));
  const uint64_t logits = static_cast<uint64_t>((*model)->logits_elems(mb));
  auto region = [](const Plan& p, std::string_view prefix) -> uint64_t {
    for (const DeviceRegion& r : p.device_regions) {
      if (r.label.starts_with(prefix)) return r.size_bytes;
    }
    ADD_FAILURE() << "no region " << prefix;
    return 0;
  };
  const int n = (*model)->num_blocks();
  for (const auto& [p, w] : {std::pair{&*bf16, 2u}, std::pair{&*fp32, 4u}}) {
    EXPECT_EQ(region(*p, "boundary activations"), (n - 1) * act * w);
    EXPECT_EQ(region(*p, "activation gradients"), 2 * act * w);
    EXPECT_EQ(region(*p, "last-position logits (B,V)"), logits * w);
  }
  EXPECT_EQ(logits, static_cast<uint64_t>(mb.batch_size) * (*model)->vocab_size());
  const uint64_t C = act / static_cast<uint64_t>(mb.tokens());
  const uint64_t dwlm_acc = C * (*model)->vocab_size() * 4;
  EXPECT_GE(region(*bf16, "block scratch"), dwlm_acc);
  EXPECT_LT(region(*bf16, "block scratch") - dwlm_acc, region(*fp32, "block scratch"));
  // Everything on the device halves except the fp32 statistics and the dWlm accumulator
  // inside the scratch.
  EXPECT_LT(StreamingMinimumBytes(**model, DType::kBF16, mb) - dwlm_acc,
            StreamingMinimumBytes(**model, DType::kF32, mb) * 51 / 100);
}

// The optimizer on the device: every block resident with its master weights, state and gradient
// in the device budget (AdamW: 4 + 8 B/param, and a 16-bit gradient at one micro-batch), none of
// it on the host or NVMe; a split takes whole blocks from block 0; a short budget says so.
TEST(Planner, TheOptimizerOnTheDeviceAndTheSplitCountTheirStateInTheDeviceBudget) {
  auto model = models::GptModel::Create(*models::GptPreset("small"));
  ASSERT_TRUE(model.ok());
  const MicroBatchShape mb{1, 64};
  PlacementOptions o;
  o.nvme_paths = {"/tmp"};
  o.param_home = ParamHome::kNvme;
  o.optimizer_home = OptimizerHome::kDevice;
  const PlanOptimizer optimizer{{}, 1};
  o.device_budget_bytes = AutoDeviceBudgetBytes(**model, DType::kBF16, mb, o, optimizer);
  auto plan = MakePlan(**model, DType::kBF16, mb, o, optimizer);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->num_resident(), (*model)->num_blocks());
  EXPECT_EQ(plan->device_optimizer_params, plan->model_params);
  EXPECT_FALSE(plan->has_cpu_optimizer());
  EXPECT_EQ(plan->host_grad_bytes, 0u);
  EXPECT_EQ(plan->host_bytes, 0u);  // no master weights, state or gradients on the host
  const uint64_t params = static_cast<uint64_t>(plan->model_params);
  EXPECT_GE(plan->device_total_bytes,
            AllResidentBytes(**model, DType::kBF16, mb) + params * (4 + 8 + 2));
  EXPECT_LE(plan->device_total_bytes, o.device_budget_bytes);
  EXPECT_NE(plan->Describe().find("on the device for"), std::string::npos) << plan->Describe();
  // The fixed regions are still listed one by one (the device gradient buckets among them), the
  // device-optimized blocks' regions summed.
  EXPECT_NE(plan->Describe().find("gradient buckets (2 x one block"), std::string::npos)
      << plan->Describe();
  EXPECT_NE(plan->Describe().find("master weights and adamw state of the blocks optimized"),
            std::string::npos)
      << plan->Describe();
  // One byte short of it: refused, naming the optimizer's share.
  o.device_budget_bytes = plan->device_total_bytes - 1;
  auto short_plan = MakePlan(**model, DType::kBF16, mb, o, optimizer);
  ASSERT_FALSE(short_plan.ok());
  EXPECT_EQ(short_plan.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(short_plan.status().message().find("master weights, state and gradients"),
            std::string::npos)
      << short_plan.status().ToString();
  // Half on the device, the rest on the host: whole blocks in forward order.
  o.optimizer_home = OptimizerHome::kHost;
  o.optimizer_device_fraction = 0.5;
  o.device_budget_bytes = AutoDeviceBudgetBytes(**model, DType::kBF16, mb, o, optimizer);
  plan = MakePlan(**model, DType::kBF16, mb, o, optimizer);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  bool seen_host = false;
  for (const Plan::Block& b : plan->blocks) {
    if (!b.optimizer_on_device) seen_host = true;
    EXPECT_FALSE(seen_host && b.optimizer_on_device) << b.name;
    if (b.optimizer_on_device) {
      EXPECT_TRUE(b.resident) << b.name;
    }
  }
  EXPECT_TRUE(plan->has_cpu_optimizer());
  EXPECT_NEAR(plan->optimizer_device_fraction(), 0.5,
              0.5 * static_cast<double>(plan->max_block_params) / plan->model_params);
  EXPECT_GT(plan->host_bytes, 0u);
  // A fraction outside [0, 1] and a kind that runs on the CPU only are refused by name.
  o.optimizer_device_fraction = 1.5;
  EXPECT_NE(
      MakePlan(**model, DType::kBF16, mb, o, optimizer).status().message().find("is not in [0, 1]"),
      std::string::npos);
  o.optimizer_device_fraction = 0.5;
  const PlanOptimizer adafactor{
      {cpu_optim::OptimizerKind::kAdafactor, cpu_optim::AdafactorConfig{}}, 1};
  EXPECT_NE(MakePlan(**model, DType::kBF16, mb, o, adafactor)
                .status()
                .message()
                .find("adafactor runs on the CPU only"),
            std::string::npos);
}

}  // namespace
}  // namespace strata::engine
