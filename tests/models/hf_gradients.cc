// hf_gradients: the gradient of a Hugging Face model's mean cross-entropy, for the PyTorch
// reference test (tests/python/test_hf_families.py). Reads a model directory, runs one fp32
// engine step (learning rate 0, no clipping) on the first B windows of a token file (window i:
// inputs tokens[i T, i T + T), targets shifted by one), and writes the step's gradient as one
// safetensors file under the model's Hugging Face tensor names and layouts (a tied model's
// embedding holds both contributions).
//
//   hf_gradients --model-dir D --data tokens.bin --seq-len T --micro-batch-size B --output g.st
//
// With --lora-init A (a PEFT adapter directory over D; optional --lora-dropout P and --seed S,
// the engine seed the micro-batch's dropout seed derives from): the step trains the adapters
// over the frozen model, and the output holds their gradient under PEFT's tensor names
// (models/lora_adapter.h).
#include <fmt/format.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "data/token_dataset.h"
#include "engine/engine.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "models/hf_checkpoint.h"
#include "models/hf_export.h"
#include "models/llama.h"
#include "models/lora_adapter.h"

namespace strata {
namespace {

struct Args {
  std::string model_dir, data, output, lora_init;
  int seq_len = 0, micro_batch_size = 0;
  double lora_dropout = -1;  // < 0: the adapter's
  uint64_t seed = 1337;
};

StatusOr<Args> ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--model-dir") {
      a.model_dir = value;
    } else if (flag == "--data") {
      a.data = value;
    } else if (flag == "--output") {
      a.output = value;
    } else if (flag == "--seq-len") {
      a.seq_len = std::stoi(value);
    } else if (flag == "--micro-batch-size") {
      a.micro_batch_size = std::stoi(value);
    } else if (flag == "--lora-init") {
      a.lora_init = value;
    } else if (flag == "--lora-dropout") {
      a.lora_dropout = std::stod(value);
    } else if (flag == "--seed") {
      a.seed = std::stoull(value);
    } else {
      return InvalidArgumentError(fmt::format("unknown flag '{}'", flag));
    }
  }
  if (a.model_dir.empty() || a.data.empty() || a.output.empty() || a.seq_len < 1 ||
      a.micro_batch_size < 1) {
    return InvalidArgumentError(
        "usage: hf_gradients --model-dir D --data F --seq-len T --micro-batch-size B --output O");
  }
  return a;
}

Status Run(const Args& a) {
  STRATA_ASSIGN_OR_RETURN(auto checkpoint, models::HfCheckpoint::Open(a.model_dir));
  const models::HfModelConfig& config = checkpoint->config();
  std::unique_ptr<engine::Model> model;
  const models::LoraLayout* lora = nullptr;
  models::LoraConfig lora_config;
  // LoRA: the family's model with the adapters of --lora-init over its frozen weights.
  auto with_lora = [&](auto m) -> Status {
    STRATA_RETURN_IF_ERROR(m->EnableLora(lora_config));
    lora = m->lora();
    STRATA_ASSIGN_OR_RETURN(auto init,
                            models::OpenLoraAdapter(a.lora_init, config, lora_config, *lora));
    m->SetLoraInit(std::move(init));
    model = std::move(m);
    return Status::Ok();
  };
  if (!a.lora_init.empty()) {
    STRATA_ASSIGN_OR_RETURN(auto adapter, models::ReadLoraAdapterConfig(a.lora_init));
    lora_config = adapter.lora;
    if (a.lora_dropout >= 0) lora_config.dropout = a.lora_dropout;
    if (config.family == models::HfModelConfig::Family::kLlama) {
      STRATA_ASSIGN_OR_RETURN(auto llama, models::LlamaModel::Create(config.llama, checkpoint));
      STRATA_RETURN_IF_ERROR(with_lora(std::move(llama)));
    } else {
      STRATA_ASSIGN_OR_RETURN(auto gpt, models::GptModel::Create(config.gpt2, {}, checkpoint));
      STRATA_RETURN_IF_ERROR(with_lora(std::move(gpt)));
    }
  } else if (config.family == models::HfModelConfig::Family::kLlama) {
    STRATA_ASSIGN_OR_RETURN(model, models::LlamaModel::Create(config.llama, checkpoint));
  } else {
    STRATA_ASSIGN_OR_RETURN(model, models::GptModel::Create(config.gpt2, {}, checkpoint));
  }
  const int B = a.micro_batch_size, T = a.seq_len;
  STRATA_ASSIGN_OR_RETURN(auto data, data::TokenDataset::Open({a.data}, model->vocab_size()));
  if (data.num_windows(T, 0) < B) {
    return InvalidArgumentError(fmt::format("'{}' holds fewer than {} windows", a.data, B));
  }
  std::vector<int32_t> tokens(static_cast<size_t>(B) * T), targets(tokens.size());
  for (int b = 0; b < B; ++b) data.EvalWindow(b, T, tokens.data() + b * T, targets.data() + b * T);

  engine::EngineOptions o;
  o.precision = DType::kF32;
  o.micro_batch = {B, T};
  o.optimizer.adamw().lr = 0;
  o.optimizer.adamw().weight_decay = 0;
  o.grad_clip_norm = 0;
  o.seed = a.seed;
  o.placement.param_home = engine::ParamHome::kDevice;
  o.placement.optimizer_home = engine::OptimizerHome::kHost;
  o.placement.device_budget_bytes = 64ull << 30;
  STRATA_ASSIGN_OR_RETURN(auto device, gpu::CreateHostDevice({}));
  STRATA_ASSIGN_OR_RETURN(auto e, engine::Engine::Create(model.get(), device.get(), o));
  const std::vector<engine::MicroBatch> batch{{tokens, targets}};
  STRATA_ASSIGN_OR_RETURN(auto result, e->Step(batch));
  std::fprintf(stderr, "loss %.9g, gradient norm %.9g\n", result.loss, result.grad_norm);

  // The gradient "weights" as a Hugging Face directory, then its one safetensors file.
  const std::string dir = a.output + ".dir";
  std::filesystem::remove_all(dir);
  auto read_block = [&](int block, std::span<float> out) -> Status {
    STRATA_ASSIGN_OR_RETURN(auto g, e->AccumulatedGradient(block));
    if (g.size() != out.size()) return InternalError("gradient size mismatch");
    std::memcpy(out.data(), g.data(), out.size_bytes());
    return Status::Ok();
  };
  if (lora != nullptr) {
    STRATA_RETURN_IF_ERROR(models::WriteLoraAdapterDir(
        dir, config, lora_config, *lora, a.model_dir,
        [&](int layer, std::span<float> out) { return read_block(layer + 1, out); }));
  } else {
    STRATA_RETURN_IF_ERROR(
        models::WriteHfDirectory(dir, config, read_block, DType::kF32, ~uint64_t{0}, {}));
  }
  std::error_code ec;
  std::filesystem::rename(dir + (lora ? "/adapter_model.safetensors" : "/model.safetensors"),
                          a.output, ec);
  if (ec)
    return InternalError(fmt::format("moving the gradients to '{}': {}", a.output, ec.message()));
  std::filesystem::remove_all(dir);
  return Status::Ok();
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  auto args = strata::ParseArgs(argc, argv);
  strata::Status s = args.ok() ? strata::Run(*args) : args.status();
  if (!s.ok()) {
    std::fprintf(stderr, "hf_gradients: error: %s\n", s.message().c_str());
    return 1;
  }
  return 0;
}
