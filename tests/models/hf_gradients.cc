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
//
// With --preference P.json --objective dpo|ipo|simpo [--beta B] [--label-smoothing E]
// [--simpo-gamma G] [--rpo-alpha A | --cpo-alpha A] [--metrics-out M.json]
// (tests/python/test_preference.py): instead of the token file's windows, the step runs one
// engine::PreferenceObjective (engine/preference_objective.h) over the micro-batches of P.json, one
// per entry (gradient accumulation = their count):
//
//   {"micro_batches": [{"tokens": [B T ints], "targets": [B T ints, -1 = ignored],
//                       "sequences": [B T ints: -1, or 2 k / 2 k + 1 where the target belongs to
//                                     the chosen / rejected completion of the entry's pair k],
//                       "pairs": n,
//                       "reference_logps": [2 n doubles, optional]}, ...]}
//
// The reference's completion log-probabilities (summed for dpo, averaged over the completion's
// targets for ipo; simpo has none): with --lora-init the engine's frozen reference, the base with
// the adapters off (then the file must not give them); without it the file's reference_logps when
// given, else those of the initial weights (Engine::EvaluateTargetLosses before the step: the
// policy is then its own reference). --metrics-out writes {"loss" (the step's), "pairs",
// "rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin", "logps_chosen",
// "logps_rejected", "nll_loss"} (engine::PreferenceMetrics). The gradient file is written as
// without it.
#include <fmt/format.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/file.h"
#include "base/untrusted_text.h"
#include "data/token_dataset.h"
#include "engine/engine.h"
#include "engine/preference_objective.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "models/hf_checkpoint.h"
#include "models/hf_export.h"
#include "models/llama.h"
#include "models/lora_adapter.h"

namespace strata {
namespace {

using Json = nlohmann::json;

struct Args {
  std::string model_dir, data, output, lora_init;
  int seq_len = 0, micro_batch_size = 0;
  double lora_dropout = -1;  // < 0: the adapter's
  uint64_t seed = 1337;
  // --preference: its file, --objective and the loss's options, --metrics-out.
  std::string preference, objective, metrics_out;
  engine::PreferenceOptions preference_options;
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
    } else if (flag == "--preference") {
      a.preference = value;
    } else if (flag == "--objective") {
      a.objective = value;
      STRATA_ASSIGN_OR_RETURN(a.preference_options.loss, engine::ParsePreferenceLoss(value));
    } else if (flag == "--beta") {
      a.preference_options.beta = std::stod(value);
    } else if (flag == "--label-smoothing") {
      a.preference_options.label_smoothing = std::stod(value);
    } else if (flag == "--simpo-gamma") {
      a.preference_options.simpo_gamma = std::stod(value);
    } else if (flag == "--rpo-alpha" || flag == "--cpo-alpha") {
      a.preference_options.nll_alpha = std::stod(value);
    } else if (flag == "--metrics-out") {
      a.metrics_out = value;
    } else {
      return InvalidArgumentError(fmt::format("unknown flag '{}'", flag));
    }
  }
  const bool preference = !a.preference.empty();
  if (a.model_dir.empty() || (a.data.empty() && !preference) || a.output.empty() || a.seq_len < 1 ||
      a.micro_batch_size < 1) {
    return InvalidArgumentError(
        "usage: hf_gradients --model-dir D (--data F | --preference P.json --objective O) "
        "--seq-len T --micro-batch-size B --output O");
  }
  if (preference && !a.data.empty()) {
    return InvalidArgumentError("--data and --preference exclude each other");
  }
  if (preference != !a.objective.empty()) {
    return InvalidArgumentError("--preference and --objective go together");
  }
  if (!preference && !a.metrics_out.empty()) {
    return InvalidArgumentError("--metrics-out needs --preference");
  }
  if (preference) STRATA_RETURN_IF_ERROR(engine::CheckPreferenceOptions(a.preference_options));
  return a;
}

// The model of --model-dir, with the adapters of --lora-init over its frozen weights when given.
struct LoadedModel {
  std::unique_ptr<engine::Model> model;
  const models::LoraLayout* lora = nullptr;  // owned by model; null without --lora-init
  models::LoraConfig lora_config;
};

StatusOr<LoadedModel> LoadModel(const Args& a, std::shared_ptr<models::HfCheckpoint> checkpoint) {
  const models::HfModelConfig& config = checkpoint->config();
  LoadedModel out;
  auto with_lora = [&](auto m) -> Status {
    STRATA_RETURN_IF_ERROR(m->EnableLora(out.lora_config));
    out.lora = m->lora();
    STRATA_ASSIGN_OR_RETURN(
        auto init, models::OpenLoraAdapter(a.lora_init, config, out.lora_config, *out.lora));
    m->SetLoraInit(std::move(init));
    out.model = std::move(m);
    return Status::Ok();
  };
  if (!a.lora_init.empty()) {
    STRATA_ASSIGN_OR_RETURN(auto adapter, models::ReadLoraAdapterConfig(a.lora_init));
    out.lora_config = adapter.lora;
    if (a.lora_dropout >= 0) out.lora_config.dropout = a.lora_dropout;
    if (config.family == models::HfModelConfig::Family::kLlama) {
      STRATA_ASSIGN_OR_RETURN(auto llama, models::LlamaModel::Create(config.llama, checkpoint));
      STRATA_RETURN_IF_ERROR(with_lora(std::move(llama)));
    } else {
      STRATA_ASSIGN_OR_RETURN(auto gpt, models::GptModel::Create(config.gpt2, {}, checkpoint));
      STRATA_RETURN_IF_ERROR(with_lora(std::move(gpt)));
    }
  } else if (config.family == models::HfModelConfig::Family::kLlama) {
    STRATA_ASSIGN_OR_RETURN(out.model, models::LlamaModel::Create(config.llama, checkpoint));
  } else {
    STRATA_ASSIGN_OR_RETURN(out.model, models::GptModel::Create(config.gpt2, {}, checkpoint));
  }
  return out;
}

// One micro-batch of --preference's file (the format in the header comment).
struct PreferenceMicroBatch {
  std::vector<int32_t> tokens, targets, sequences;  // (B, T) each
  int pairs = 0;
  std::vector<double> reference_logps;  // 2 pairs, or empty: not given
};

// `count` integers of j[key] into *out; kInvalidArgument naming `what` and the key otherwise.
Status ReadInts(const Json& j, const char* key, size_t count, const std::string& what,
                std::vector<int32_t>* out) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_array() || it->size() != count) {
    return InvalidArgumentError(
        fmt::format("{}: \"{}\" must be an array of {} integers", what, key, count));
  }
  out->clear();
  for (const Json& v : *it) {
    if (!v.is_number_integer() || v.get<int64_t>() < std::numeric_limits<int32_t>::min() ||
        v.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return InvalidArgumentError(
          fmt::format("{}: \"{}\" holds {}, not an int32", what, key, v.dump()));
    }
    out->push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  return Status::Ok();
}

// The micro-batches of a --preference file for B rows of T positions. Errors (kInvalidArgument,
// naming the file and the micro-batch): malformed JSON, a missing or mis-sized array, pairs < 1,
// reference_logps not 2 pairs numbers, a sequence id outside [-1, 2 pairs) or on an ignored
// target.
StatusOr<std::vector<PreferenceMicroBatch>> ReadPreferenceFile(const std::string& path, int B,
                                                               int T) {
  STRATA_ASSIGN_OR_RETURN(const std::string text,
                          ReadSmallFile(path, {.max_bytes = uint64_t{1} << 30}));
  auto parsed = ParseJsonBounded(text);
  if (!parsed.ok()) {
    return InvalidArgumentError(fmt::format("'{}': {}", path, parsed.status().message()));
  }
  const Json& root = *parsed;
  if (!root.is_object() || !root.contains("micro_batches") || !root["micro_batches"].is_array() ||
      root["micro_batches"].empty()) {
    return InvalidArgumentError(
        fmt::format("'{}': expected {{\"micro_batches\": [one or more objects]}}", path));
  }
  const size_t n = static_cast<size_t>(B) * T;
  std::vector<PreferenceMicroBatch> out;
  for (const Json& j : root["micro_batches"]) {
    const std::string what = fmt::format("'{}' micro-batch {}", path, out.size());
    if (!j.is_object()) return InvalidArgumentError(what + ": not an object");
    PreferenceMicroBatch mb;
    STRATA_RETURN_IF_ERROR(ReadInts(j, "tokens", n, what, &mb.tokens));
    STRATA_RETURN_IF_ERROR(ReadInts(j, "targets", n, what, &mb.targets));
    STRATA_RETURN_IF_ERROR(ReadInts(j, "sequences", n, what, &mb.sequences));
    if (!j.contains("pairs") || !j["pairs"].is_number_integer() || j["pairs"].get<int64_t>() < 1 ||
        j["pairs"].get<int64_t>() > static_cast<int64_t>(n)) {
      return InvalidArgumentError(what + ": \"pairs\" must be an integer in [1, B T]");
    }
    mb.pairs = j["pairs"].get<int>();
    if (j.contains("reference_logps")) {
      const Json& r = j["reference_logps"];
      if (!r.is_array() || r.size() != 2 * static_cast<size_t>(mb.pairs)) {
        return InvalidArgumentError(
            fmt::format("{}: \"reference_logps\" must hold {} numbers", what, 2 * mb.pairs));
      }
      for (const Json& v : r) {
        if (!v.is_number()) return InvalidArgumentError(what + ": a reference_logps non-number");
        mb.reference_logps.push_back(v.get<double>());
      }
    }
    for (size_t t = 0; t < n; ++t) {
      const int32_t s = mb.sequences[t];
      if (s < -1 || s >= 2 * mb.pairs || (s >= 0 && mb.targets[t] < 0)) {
        return InvalidArgumentError(fmt::format(
            "{}: position {} has sequence {} (target {}): a completion id in [0, {}) on a "
            "target, or -1",
            what, t, s, mb.targets[t], 2 * mb.pairs));
      }
    }
    out.push_back(std::move(mb));
  }
  return out;
}

// The first B windows of --data: one micro-batch.
struct Windows {
  std::vector<int32_t> tokens, targets;
};

StatusOr<Windows> ReadWindows(const Args& a, int vocab_size) {
  const int B = a.micro_batch_size, T = a.seq_len;
  STRATA_ASSIGN_OR_RETURN(auto data, data::TokenDataset::Open({a.data}, vocab_size));
  if (data.num_windows(T, 0) < B) {
    return InvalidArgumentError(fmt::format("'{}' holds fewer than {} windows", a.data, B));
  }
  Windows w;
  w.tokens.resize(static_cast<size_t>(B) * T);
  w.targets.resize(w.tokens.size());
  for (int b = 0; b < B; ++b) {
    data.EvalWindow(b, T, w.tokens.data() + b * T, w.targets.data() + b * T);
  }
  return w;
}

// One preference step over `mbs` on `e`; the step's result and metrics. lora: the reference is
// the engine's frozen one.
StatusOr<engine::StepResult> PreferenceStep(engine::Engine& e, const Args& a, bool lora,
                                            const std::vector<PreferenceMicroBatch>& mbs,
                                            engine::PreferenceMetrics* metrics) {
  const engine::PreferenceOptions& p = a.preference_options;
  const engine::MicroBatchShape shape{a.micro_batch_size, a.seq_len};
  std::vector<engine::MicroBatch> batch;
  std::vector<engine::PreferenceObjective::MicroBatchPairs> pairs;
  for (size_t i = 0; i < mbs.size(); ++i) {
    const PreferenceMicroBatch& mb = mbs[i];
    batch.push_back({mb.tokens, mb.targets});
    std::vector<double> reference;
    if (p.uses_reference() && lora && !mb.reference_logps.empty()) {
      return InvalidArgumentError(fmt::format(
          "'{}' micro-batch {}: reference_logps with --lora-init, whose reference is the base "
          "(adapters off)",
          a.preference, i));
    }
    if (p.uses_reference() && !lora) {
      reference = mb.reference_logps;
      if (reference.empty()) {  // the initial weights' own
        STRATA_ASSIGN_OR_RETURN(const std::vector<float> ce,
                                e.EvaluateTargetLosses(batch.back(), shape));
        STRATA_ASSIGN_OR_RETURN(reference,
                                engine::CompletionLogps(ce, mb.sequences, mb.pairs, p.averaged()));
      }
    }
    pairs.push_back({mb.sequences, mb.pairs, std::move(reference)});
  }
  engine::PreferenceObjective objective(p, /*reference_from_model=*/lora);
  STRATA_RETURN_IF_ERROR(objective.BeginStep(std::move(pairs)));
  STRATA_ASSIGN_OR_RETURN(auto result, e.Step(batch, &objective));
  *metrics = objective.TakeMetrics();
  return result;
}

Status WriteMetrics(const std::string& path, float loss, const engine::PreferenceMetrics& m) {
  const Json j = {{"loss", loss},
                  {"pairs", m.pairs},
                  {"rewards_chosen", m.rewards_chosen},
                  {"rewards_rejected", m.rewards_rejected},
                  {"rewards_accuracy", m.rewards_accuracy},
                  {"rewards_margin", m.rewards_margin},
                  {"logps_chosen", m.logps_chosen},
                  {"logps_rejected", m.logps_rejected},
                  {"nll_loss", m.nll_loss}};
  const std::string text = j.dump() + "\n";
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return InvalidArgumentError(fmt::format("cannot create '{}'", path));
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !written) {
    return InternalError(fmt::format("writing '{}' failed", path));
  }
  return Status::Ok();
}

Status Run(const Args& a) {
  STRATA_ASSIGN_OR_RETURN(auto checkpoint, models::HfCheckpoint::Open(a.model_dir));
  const models::HfModelConfig& config = checkpoint->config();
  STRATA_ASSIGN_OR_RETURN(LoadedModel loaded, LoadModel(a, checkpoint));
  engine::Model* model = loaded.model.get();
  const models::LoraLayout* lora = loaded.lora;
  const bool preference = !a.preference.empty();
  const int B = a.micro_batch_size, T = a.seq_len;
  Windows windows;
  std::vector<PreferenceMicroBatch> pairs;
  if (preference) {
    STRATA_ASSIGN_OR_RETURN(pairs, ReadPreferenceFile(a.preference, B, T));
  } else {
    STRATA_ASSIGN_OR_RETURN(windows, ReadWindows(a, model->vocab_size()));
  }

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
  if (preference) {
    o.grad_accum_steps = static_cast<int>(pairs.size());
    o.placement.objective = {
        .target_weights = true,
        .reference_forward = lora != nullptr && a.preference_options.uses_reference()};
  }
  STRATA_ASSIGN_OR_RETURN(auto device, gpu::CreateHostDevice({}));
  STRATA_ASSIGN_OR_RETURN(auto e, engine::Engine::Create(model, device.get(), o));
  engine::StepResult result;
  if (preference) {
    engine::PreferenceMetrics metrics;
    STRATA_ASSIGN_OR_RETURN(result, PreferenceStep(*e, a, lora != nullptr, pairs, &metrics));
    if (!a.metrics_out.empty()) {
      STRATA_RETURN_IF_ERROR(WriteMetrics(a.metrics_out, result.loss, metrics));
    }
  } else {
    const std::vector<engine::MicroBatch> batch{{windows.tokens, windows.targets}};
    STRATA_ASSIGN_OR_RETURN(result, e->Step(batch));
  }
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
        dir, config, loaded.lora_config, *lora, a.model_dir,
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
