// offload_mlp: a user-defined Model (mlp_model.h) trained by the Strata engine, built against
// the installed package (find_package(Strata), Strata::engine).
//
//   offload_mlp NVME_DIR [STEPS]
//
// The parameters live on NVMe and stream through a device budget the engine's plan entry chooses
// (`auto`: for this small model the streaming minimum, two slots); the fp32 master weights and
// Adam's moments live on NVMe too (a private swap directory inside NVME_DIR, removed at exit). The
// device is the host backend, so this runs on any Linux machine. Prints the plan, the loss every 10
// steps and the NVMe traffic; exits 0 when the evaluation loss fell below half its initial value
// and the parameters really went through NVMe, 1 otherwise, 2 on an error.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "engine/engine.h"
#include "engine/plan/plan_choice.h"
#include "engine/plan/planner.h"
#include "engine/version.h"
#include "gpu/device.h"
#include "mlp_model.h"

namespace {

using strata::engine::Engine;
using strata::engine::MicroBatch;

int Fail(const std::string& what, const strata::Status& status) {
  std::fprintf(stderr, "offload_mlp: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: %s NVME_DIR [STEPS]\n", argv[0]);
    return 2;
  }
  const int steps = argc == 3 ? std::atoi(argv[2]) : 150;
  if (steps < 1) {
    std::fprintf(stderr, "offload_mlp: STEPS must be a positive number\n");
    return 2;
  }
  // The headers and the loaded library must be the same release (engine/version.h).
  if (strata::engine::VersionString() != STRATA_ENGINE_VERSION_STRING) {
    std::fprintf(stderr, "offload_mlp: built against Strata %s, running with %s\n",
                 STRATA_ENGINE_VERSION_STRING,
                 std::string(strata::engine::VersionString()).c_str());
    return 2;
  }

  offload_mlp::MlpRegressor model(offload_mlp::MlpConfig{});
  auto device = strata::gpu::CreateHostDevice({});
  if (!device.ok()) return Fail("host device", device.status());

  strata::engine::EngineOptions o;
  o.precision = strata::DType::kBF16;  // working params, activations and gradients
  o.micro_batch = {/*batch_size=*/8, /*seq_len=*/16};
  o.optimizer.adamw().lr = 1e-3f;
  o.grad_clip_norm = 1.0f;
  o.placement.param_home = strata::engine::ParamHome::kNvme;
  o.placement.optimizer_home = strata::engine::OptimizerHome::kNvme;
  o.placement.nvme_paths = {argv[1]};
  // The plan, chosen once by the engine's one planning entry (engine/plan/plan_choice.h): the
  // device budget left auto (here the streaming minimum: every block streams from NVMe), the rest
  // as set above. A machine profile (engine/plan/machine_profile.h) instead of nullptr would let it
  // choose the homes by predicted time too (request.automatic.param_home, optimizer_home).
  strata::engine::PlanRequest request;
  request.precision = o.precision;
  request.micro_batch = o.micro_batch;
  request.optimizer = o.optimizer;
  request.placement = o.placement;
  request.automatic.device_budget = true;
  auto choice = strata::engine::ChoosePlan(model, request, /*machine=*/nullptr);
  if (!choice.ok()) return Fail("ChoosePlan", choice.status());
  o.placement = choice->placement;  // the options the plan was made for
  auto created = Engine::Create(&model, device->get(), o, std::move(choice->plan));
  if (!created.ok()) return Fail("Engine::Create", created.status());
  Engine& engine = **created;
  std::printf("Strata %s, %s\n%s", std::string(strata::engine::VersionString()).c_str(),
              model.description().c_str(), engine.plan().Describe().c_str());
  std::printf("I/O backend: %s\n", std::string(engine.io_backend_name()).c_str());

  // Sample ids are the tokens and the targets (mlp_model.h); a fixed batch measures progress.
  const int64_t n = o.micro_batch.tokens();
  std::mt19937 rng(42);
  std::uniform_int_distribution<int32_t> sample(0, model.vocab_size() - 1);
  std::vector<int32_t> eval_ids(n);
  for (auto& id : eval_ids) id = sample(rng);
  const MicroBatch eval{eval_ids, eval_ids};
  auto initial = engine.EvaluateLoss(eval, o.micro_batch);
  if (!initial.ok()) return Fail("EvaluateLoss", initial.status());
  std::printf("initial evaluation loss %.5f\n", *initial);

  std::vector<int32_t> ids(n);
  for (int step = 1; step <= steps; ++step) {
    for (auto& id : ids) id = sample(rng);
    const MicroBatch batch{ids, ids};
    auto result = engine.Step({&batch, 1});
    if (!result.ok()) return Fail("step " + std::to_string(step), result.status());
    if (step % 10 == 0 || step == 1) {
      std::printf("step %4d  loss %.5f  grad norm %.4f\n", step, result->loss, result->grad_norm);
    }
  }
  auto final_loss = engine.EvaluateLoss(eval, o.micro_batch);
  if (!final_loss.ok()) return Fail("EvaluateLoss", final_loss.status());
  const auto c = engine.counters();
  std::printf("final evaluation loss %.5f (%.1f%% of the initial)\n", *final_loss,
              100.0 * *final_loss / *initial);
  std::printf("NVMe read %.1f MiB, written %.1f MiB; device peak %.2f MiB\n",
              c.nvme_bytes_read / 1048576.0, c.nvme_bytes_written / 1048576.0,
              c.device_peak_bytes / 1048576.0);
  if (c.nvme_bytes_read == 0 || c.nvme_bytes_written == 0) {
    std::fprintf(stderr, "offload_mlp: no NVMe traffic: the offload did not happen\n");
    return 1;
  }
  if (!(*final_loss < 0.5f * *initial)) {
    std::fprintf(stderr, "offload_mlp: the loss did not fall below half its initial value\n");
    return 1;
  }
  return 0;
}
