#include "tools/checkpoint_commands.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/file.h"
#include "base/units.h"
#include "base/untrusted_text.h"
#include "data/tokenizer.h"
#include "engine/checkpoint.h"
#include "formats/safetensors.h"
#include "models/gpt_kernels.h"
#include "models/hf_export.h"
#include "models/llama.h"
#include "models/lora_adapter.h"
#include "tools/model_spec.h"
#include "tools/option_flags.h"

namespace strata::tools {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
std::atomic<bool> g_stop_agreed{false};  // AdoptStopSignal's

void OnStopSignal(int sig) { g_stop_signal = sig; }

}  // namespace

void AddCheckpointFlags(CLI::App& cmd, CheckpointFlags& f) {
  cmd.add_option(
      "--save-dir", f.save_dir,
      "Write checkpoints here as step-N directories, with a 'latest' pointer (crash-safe: "
      "temporary name, fsync, rename); also saves after the last step");
  cmd.add_option("--save-every", f.save_every,
                 "Save a checkpoint every N steps; 0 = only at the end")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--keep-last", f.keep_last,
                 "Keep only the newest K checkpoints in --save-dir (never the one 'latest' names); "
                 "0 = keep all")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--resume", f.resume,
                 "Continue exactly from a checkpoint: its directory, a save directory (uses its "
                 "'latest'), or 'latest' (the --save-dir's); --steps is the total");
  cmd.add_flag("--save-on-signal", f.save_on_signal,
               "On SIGINT/SIGTERM finish the current step and save a checkpoint before exiting "
               "(exit code 130/143)");
}

void InstallStopSignalHandlers() {
  struct sigaction sa = {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // interrupted system calls resume; the loop polls the flag
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int StopSignal() { return g_stop_signal; }

void AdoptStopSignal(int sig) {
  if (sig == 0) return;
  if (g_stop_signal == 0) g_stop_signal = sig;
  g_stop_agreed = true;
}

bool StopSignalAgreed() { return g_stop_agreed; }

Status StoppedBeforeTheFirstStep(Status s) {
  if (s.code() != StatusCode::kCancelled || StopSignal() == 0) return s;
  std::string_view what = s.message();
  if (what.starts_with("cancelled ")) what.remove_prefix(std::string_view("cancelled ").size());
  return CancelledError(fmt::format("stopped by signal {} {}; no step ran", StopSignal(), what));
}

namespace {

// "peak_lr 0.003 -> 0.001, total_steps 300 -> 600": the fields of two LrScheduleJson objects that
// differ, next_step aside; "" when none does or the saved one is not an object (an older
// checkpoint's "{}" names nothing).
std::string ScheduleDifferences(std::string_view saved_json, std::string_view run_json) {
  const nlohmann::json saved = nlohmann::json::parse(saved_json, nullptr, false);
  const nlohmann::json run = nlohmann::json::parse(run_json, nullptr, false);
  if (!saved.is_object() || saved.empty() || !run.is_object()) return "";
  std::vector<std::string> parts;
  auto text = [](const nlohmann::json* v) {
    return v == nullptr     ? std::string("(none)")
           : v->is_string() ? v->get<std::string>()
                            : v->dump();
  };
  std::set<std::string> keys;
  for (const auto& [k, v] : saved.items()) keys.insert(k);
  for (const auto& [k, v] : run.items()) keys.insert(k);
  for (const std::string& k : keys) {
    if (k == "next_step") continue;
    const nlohmann::json* a = saved.contains(k) ? &saved[k] : nullptr;
    const nlohmann::json* b = run.contains(k) ? &run[k] : nullptr;
    if (a != nullptr && b != nullptr && *a == *b) continue;
    parts.push_back(fmt::format("{} {} -> {}", k, Excerpt(text(a)), Excerpt(text(b))));
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

}  // namespace

StatusOr<int64_t> ResumeTraining(engine::Engine& engine, const CheckpointFlags& flags,
                                 std::mt19937_64* data_rng, std::string_view run_lr_schedule_json,
                                 const engine::EngineOptions& run, int64_t* tokens_seen) {
  std::string path = flags.resume;
  if (path == "latest") {
    if (flags.save_dir.empty()) {
      return InvalidArgumentError("--resume latest needs --save-dir (the directory with 'latest')");
    }
    path = flags.save_dir;
  }
  // (RunTrain checks the same before building the engine.)
  engine::TrainerState state;
  const auto t0 = std::chrono::steady_clock::now();
  STRATA_RETURN_IF_ERROR(engine.LoadCheckpoint(path, &state).WithContext("--resume"));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::istringstream in(state.data_rng);
  std::mt19937_64 rng;
  in >> rng;
  if (in.fail()) {
    // Validated before use: the engine has loaded, but training does not start.
    return DataLossError(
        fmt::format("--resume '{}': the manifest's data position is not a mt19937_64 state", path));
  }
  *data_rng = rng;
  STRATA_ASSIGN_OR_RETURN(std::string dir, engine::ResolveCheckpointDir(path));
  std::printf("resumed from %s at step %lld (%lld tokens seen), loaded in %.3f s\n", dir.c_str(),
              static_cast<long long>(state.step), static_cast<long long>(state.tokens_seen),
              seconds);
  if (const std::string diff = ScheduleDifferences(state.lr_schedule_json, run_lr_schedule_json);
      !diff.empty()) {
    std::printf(
        "note: this run's learning-rate schedule differs from the checkpoint's (%s); this run's is "
        "followed from step %lld on\n",
        diff.c_str(), static_cast<long long>(state.step + 1));
  }
  // The run's optimizer settings apply from here on (the engine keeps them); say which changed.
  STRATA_ASSIGN_OR_RETURN(engine::Manifest saved, engine::ReadManifest(dir));
  if (const std::string diff = engine::UpdateSettingsDifferences(
          saved, run.optimizer, run.grad_clip_norm, run.decay_norms_and_biases);
      !diff.empty()) {
    std::printf(
        "note: this run's optimizer settings differ from the checkpoint's (%s); this run's are "
        "used from step %lld on\n",
        diff.c_str(), static_cast<long long>(state.step + 1));
  }
  if (tokens_seen != nullptr) *tokens_seen = state.tokens_seen;
  return state.step;
}

StatusOr<std::string> SaveTraining(engine::Engine& engine, const CheckpointFlags& flags,
                                   const TrainProgress& p) {
  engine::TrainerState state;
  state.step = p.step;
  state.tokens_seen = p.tokens_seen;
  std::ostringstream rng;
  rng << *p.data_rng;
  state.data_rng = rng.str();
  state.lr_schedule_json = p.lr_schedule_json;
  state.model_json = p.model_json;
  std::string dir;
  const auto t0 = std::chrono::steady_clock::now();
  STRATA_RETURN_IF_ERROR(
      engine.SaveCheckpoint(flags.save_dir, state, {.keep_last = flags.keep_last}, &dir));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  uint64_t bytes = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    bytes += e.is_regular_file(ec) ? e.file_size(ec) : 0;
  }
  std::printf("checkpoint %s saved: %s in %.3f s\n", dir.c_str(), FormatBytes(bytes).c_str(),
              seconds);
  std::fflush(stdout);
  return dir;
}

void AddInspectFlags(CLI::App& cmd, InspectFlags& f) {
  cmd.add_option("dir", f.path, "A checkpoint directory, or a save directory with 'latest'")
      ->required();
}

Status RunInspect(const InspectFlags& f) {
  STRATA_ASSIGN_OR_RETURN(std::string dir, engine::ResolveCheckpointDir(f.path));
  STRATA_ASSIGN_OR_RETURN(engine::Manifest m, engine::ReadManifest(dir));
  std::printf("checkpoint %s\n", dir.c_str());
  std::printf("  format %d, step %lld, %lld tokens seen, precision %s, loss scale %g\n",
              m.format_version, static_cast<long long>(m.trainer.step),
              static_cast<long long>(m.trainer.tokens_seen), m.precision.c_str(),
              m.loss_scaler.scale);
  std::printf("  model: %s\n", m.model_description.c_str());
  for (const auto& file : m.files) {
    std::printf("%s (%s, xxh3 %016llx)\n", file.name.c_str(), FormatBytes(file.size_bytes).c_str(),
                static_cast<unsigned long long>(file.xxh3));
    if (!file.name.ends_with(".safetensors")) continue;
    auto st = formats::OpenSafetensorsFile(dir + "/" + file.name);
    if (!st.ok()) {
      // Reported, then the checksum pass below names the damaged file.
      std::printf("  header unreadable: %s\n", st.status().message().c_str());
      continue;
    }
    for (const auto& t : st->header.tensors) {
      std::printf("  %-24s %-5s [%s] %llu bytes\n", t.name.c_str(),
                  std::string(formats::SafetensorsDTypeName(t.dtype)).c_str(),
                  fmt::format("{}", fmt::join(t.shape, ", ")).c_str(),
                  static_cast<unsigned long long>(t.size_bytes()));
    }
  }
  STRATA_RETURN_IF_ERROR(engine::VerifyCheckpointFiles(dir, m));
  STRATA_RETURN_IF_ERROR(engine::CheckManifestListsItsFiles(m).WithContext(dir));
  std::printf("verified: %zu files, sizes and xxh3 match the manifest\n", m.files.size());
  return Status::Ok();
}

void AddExportFlags(CLI::App& cmd, ExportFlags& f) {
  cmd.add_option("--checkpoint", f.checkpoint,
                 "A checkpoint directory, or a save directory with 'latest'")
      ->required();
  cmd.add_option("--hf-dir", f.hf_dir,
                 "Output Hugging Face model directory (must not exist or be empty)");
  cmd.add_option("--safetensors", f.out,
                 "Instead: one safetensors file under GPT-2 names (byte-level GPT checkpoints)");
  cmd.add_option("--lora-dir", f.lora_dir,
                 "A LoRA run's adapters as a Hugging Face PEFT adapter directory "
                 "(adapter_config.json, adapter_model.safetensors; must not exist or be empty)");
  cmd.add_flag("--merge-lora", f.merge_lora,
               "With --hf-dir, a LoRA run: the base model with W + (alpha/r) B A merged in");
  cmd.add_option("--dtype", f.dtype, "fp32, bf16 or fp16 (--safetensors: fp32 or bf16)")
      ->capture_default_str();
  cmd.add_option("--max-shard-size", f.max_shard_size,
                 "Largest safetensors shard, e.g. 5GB, 2GiB; above it the weights are sharded "
                 "with an index")
      ->capture_default_str();
}

namespace {

// --lora-dir: the adapters of a LoRA run's layers (blocks 1..L of read_block) as PEFT writes them.
Status ExportLoraAdapters(const ExportFlags& f, const std::string& dir, const engine::Manifest& m,
                          const ModelSpec& spec, const models::LoraLayout& lora,
                          const std::function<Status(int, std::span<float>)>& read_block) {
  const std::string base = spec.model_dir.empty() ? "strata:" + spec.preset : spec.model_dir;
  STRATA_RETURN_IF_ERROR(models::WriteLoraAdapterDir(
      f.lora_dir, spec.config, spec.lora, lora, base,
      [&](int layer, std::span<float> out) { return read_block(layer + 1, out); }));
  std::printf("exported the LoRA adapters (rank %d, step %lld) from %s to %s\n", spec.lora.rank,
              static_cast<long long>(m.trainer.step), dir.c_str(), f.lora_dir.c_str());
  return Status::Ok();
}

Status ExportHfDirectory(const ExportFlags& f) {
  STRATA_ASSIGN_OR_RETURN(DType dtype, ParseDType(f.dtype));
  STRATA_ASSIGN_OR_RETURN(uint64_t max_shard, ParseSize(f.max_shard_size));
  if (max_shard == 0) return InvalidArgumentError("--max-shard-size must be positive");
  STRATA_ASSIGN_OR_RETURN(std::string dir, engine::ResolveCheckpointDir(f.checkpoint));
  STRATA_ASSIGN_OR_RETURN(engine::Manifest m, engine::ReadManifest(dir));
  STRATA_RETURN_IF_ERROR(engine::VerifyCheckpointFiles(dir, m));
  STRATA_ASSIGN_OR_RETURN(ModelSpec spec, ModelSpecFromJson(m.trainer.model_json));
  if (!f.lora_dir.empty() && !spec.lora.enabled()) {
    return InvalidArgumentError(fmt::format(
        "--lora-dir: {} is not a LoRA run (no adapters); export it with --hf-dir", dir));
  }
  if (!f.hf_dir.empty() && spec.lora.enabled() != f.merge_lora) {
    return InvalidArgumentError(
        spec.lora.enabled()
            ? fmt::format("{} is a LoRA run: give --lora-dir DIR for its adapters, or --hf-dir "
                          "DIR --merge-lora for the base with them merged",
                          dir)
            : fmt::format("--merge-lora: {} is not a LoRA run (no adapters to merge)", dir));
  }
  STRATA_ASSIGN_OR_RETURN(auto model, BuildModel(spec, /*load_weights=*/false));
  if (model->num_blocks() != static_cast<int>(m.block_num_params.size())) {
    return DataLossError(fmt::format("{}: the manifest's {} blocks do not match its model ({})",
                                     dir, m.block_num_params.size(), model->description()));
  }
  for (int b = 0; b < model->num_blocks(); ++b) {
    if (m.block_num_params[b] != model->block_num_params(b)) {
      return DataLossError(fmt::format("{}: block {} has {} parameters, its model's has {}", dir, b,
                                       m.block_num_params[b], model->block_num_params(b)));
    }
  }
  STRATA_ASSIGN_OR_RETURN(auto master,
                          formats::OpenSafetensorsFile(dir + "/" + engine::kMasterFile));
  auto read_block = [&](int b, std::span<float> out) -> Status {
    const auto* t = master.header.Find(m.block_names[b]);
    if (!t || t->dtype != DType::kF32 || t->num_elems != static_cast<int64_t>(out.size())) {
      return DataLossError(fmt::format("{}/{}: no F32 tensor '{}' of {} elements", dir,
                                       engine::kMasterFile, m.block_names[b], out.size()));
    }
    return formats::ReadTensorBytes(master, *t, 0, std::as_writable_bytes(out));
  };
  using ReadFn = std::function<Status(int, std::span<float>)>;
  const models::LoraLayout* lora = LoraLayoutOf(*model);
  if (f.merge_lora && spec.model_dir.empty()) {
    return InvalidArgumentError(fmt::format(
        "--merge-lora: {} trained adapters over the random '{}' preset, which no directory "
        "holds; export the adapters with --lora-dir, or train over a Hugging Face directory",
        dir, spec.preset));
  }
  std::vector<float> adapters;
  // --merge-lora: the frozen base (from its directory) with each layer's adapters merged.
  // A 4-bit base (models/base_quant.h) merges as PEFT merges into a 4-bit model: its layers'
  // weights dequantized (as the run computed with them, in its precision), plus the adapters.
  const auto* llama = dynamic_cast<const models::LlamaModel*>(model.get());
  STRATA_ASSIGN_OR_RETURN(const DType run_precision, ParseDType(m.precision));
  std::vector<std::byte> encoded;
  auto read_base = [&](int b, std::span<float> out) -> Status {
    if (!spec.base_quant.has_value() || llama == nullptr ||
        llama->kind(b) != models::DecoderBlock::kLayer) {
      return model->InitFrozenParams(b, /*seed, unused: a directory's*/ 0, out);
    }
    encoded.resize(llama->block_frozen_bytes(b, run_precision));
    STRATA_RETURN_IF_ERROR(llama->InitFrozenChunk(b, 0, run_precision, encoded));
    models::DecodeLayerChunkToF32(llama->EncodedLayout(b, run_precision), run_precision,
                                  encoded.data(), out.data());
    return Status::Ok();
  };
  auto read_merged = [&](int b, std::span<float> out) -> Status {
    STRATA_RETURN_IF_ERROR(read_base(b, out));
    if (model->block_num_params(b) == 0) return Status::Ok();
    adapters.resize(model->block_num_params(b));
    STRATA_RETURN_IF_ERROR(read_block(b, adapters));
    models::MergeLoraLayer(*lora, adapters.data(), out.data());
    return Status::Ok();
  };
  std::vector<models::CompanionFile> tokenizer_files;
  for (models::CompanionFile& file : ExportedTokenizerFiles(spec)) {
    std::error_code ec;
    if (std::filesystem::exists(file.path, ec)) {
      tokenizer_files.push_back(std::move(file));
    } else {
      std::fprintf(stderr, "strata: warning: tokenizer file '%s' of the run is gone; not copied\n",
                   file.path.c_str());
    }
  }
  if (!f.lora_dir.empty()) return ExportLoraAdapters(f, dir, m, spec, *lora, read_block);
  // A run given --tokenizer: its BOS/EOS ids where config.json has none (a preset's has no ids
  // at all), else transformers' generate() would stop on its family's defaults (Llama: 2).
  models::HfModelConfig config = spec.config;
  if (!spec.tokenizer.empty()) {
    if (auto tokenizer = data::Tokenizer::Load(spec.tokenizer); tokenizer.ok()) {
      if (!config.raw.is_object()) config.raw = nlohmann::json::object();
      for (const auto& [key, id] : {std::pair{"bos_token_id", (*tokenizer)->bos_id()},
                                    std::pair{"eos_token_id", (*tokenizer)->eos_id()}}) {
        if (id >= 0 && !config.raw.contains(key)) config.raw[key] = id;
      }
    }
  }
  STRATA_RETURN_IF_ERROR(models::WriteHfDirectory(
      f.hf_dir, config, f.merge_lora ? ReadFn(read_merged) : ReadFn(read_block), dtype, max_shard,
      tokenizer_files));
  std::printf("exported %s (%s, step %lld) from %s to %s\n", model->description().c_str(),
              std::string(DTypeName(dtype)).c_str(), static_cast<long long>(m.trainer.step),
              dir.c_str(), f.hf_dir.c_str());
  return Status::Ok();
}

}  // namespace

namespace {

// Our chunk tensor names -> Hugging Face GPT-2 names (transformers GPT2Model / GPT2LMHeadModel).
// Our weights are (in, out) row-major like HF's Conv1D, so only the LM head (nn.Linear,
// (out, in)) is transposed.
const std::map<std::string, std::string>& LayerNameMap() {
  static const auto* m = new std::map<std::string, std::string>{
      {"ln1_w", "ln_1.weight"},
      {"ln1_b", "ln_1.bias"},
      {"attn_qkv_w", "attn.c_attn.weight"},
      {"attn_qkv_b", "attn.c_attn.bias"},
      {"attn_proj_w", "attn.c_proj.weight"},
      {"attn_proj_b", "attn.c_proj.bias"},
      {"ln2_w", "ln_2.weight"},
      {"ln2_b", "ln_2.bias"},
      {"mlp_fc_w", "mlp.c_fc.weight"},
      {"mlp_fc_b", "mlp.c_fc.bias"},
      {"mlp_proj_w", "mlp.c_proj.weight"},
      {"mlp_proj_b", "mlp.c_proj.bias"},
  };
  return *m;
}

StatusOr<models::GptShape> ShapeFromManifest(const engine::Manifest& m) {
  const auto j = nlohmann::json::parse(m.trainer.model_json, nullptr, false);
  models::GptShape s;
  auto get = [&](const char* key, int* out) -> Status {
    if (!j.is_object() || !j.contains(key) || !j[key].is_number_integer()) {
      return DataLossError(fmt::format(
          "the checkpoint's model config has no integer '{}' (not a GPT checkpoint?)", key));
    }
    const int64_t v = j[key].get<int64_t>();
    if (v < 1 || v > (1 << 24)) return DataLossError(fmt::format("model config {} = {}", key, v));
    *out = static_cast<int>(v);
    return Status::Ok();
  };
  STRATA_RETURN_IF_ERROR(get("vocab_size", &s.vocab_size));
  STRATA_RETURN_IF_ERROR(get("max_seq_len", &s.max_seq_len));
  STRATA_RETURN_IF_ERROR(get("num_layers", &s.num_layers));
  STRATA_RETURN_IF_ERROR(get("num_heads", &s.num_heads));
  STRATA_RETURN_IF_ERROR(get("channels", &s.channels));
  STRATA_RETURN_IF_ERROR(models::ValidateShape(s));
  const int n = s.num_layers + 2;
  bool ok = static_cast<int>(m.block_num_params.size()) == n &&
            m.block_num_params[0] == models::EmbeddingNumParams(s) &&
            m.block_num_params[n - 1] == models::HeadNumParams(s);
  for (int b = 1; ok && b < n - 1; ++b) ok = m.block_num_params[b] == models::LayerNumParams(s);
  if (!ok) return DataLossError("the checkpoint's blocks do not match its GPT model config");
  return s;
}

struct ExportTensor {
  std::string name;
  int block;
  models::TensorInfo info;
  bool transpose = false;  // (C, V) -> (V, C)
};

}  // namespace

namespace {

// The GPT-2 name of every tensor of the checkpoint's blocks, in file order.
StatusOr<std::vector<ExportTensor>> ExportTensors(const models::GptShape& shape) {
  std::vector<ExportTensor> out;
  for (const auto& t : models::EmbeddingTensors(shape)) out.push_back({t.name + ".weight", 0, t});
  for (int l = 0; l < shape.num_layers; ++l) {
    for (const auto& t : models::LayerTensors(shape)) {
      const auto it = LayerNameMap().find(t.name);
      if (it == LayerNameMap().end()) {
        return InternalError(fmt::format("no GPT-2 name for layer tensor '{}'", t.name));
      }
      out.push_back({fmt::format("h.{}.{}", l, it->second), l + 1, t});
    }
  }
  for (const auto& t : models::HeadTensors(shape)) {
    if (t.name == "lnf_w")
      out.push_back({"ln_f.weight", shape.num_layers + 1, t});
    else if (t.name == "lnf_b")
      out.push_back({"ln_f.bias", shape.num_layers + 1, t});
    else if (t.name == "lm_head_w")
      out.push_back({"lm_head.weight", shape.num_layers + 1, t, true});
    else
      return InternalError(fmt::format("no GPT-2 name for head tensor '{}'", t.name));
  }
  return out;
}

// Tensor t's fp32 values from its block's master weights, transposed for lm_head.
std::vector<float> TensorValues(const ExportTensor& t, const std::vector<float>& block) {
  std::vector<float> values(block.begin() + t.info.offset,
                            block.begin() + t.info.offset + t.info.num_elems);
  if (t.transpose) {
    const int64_t rows = t.info.shape[0], cols = t.info.shape[1];
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) values[c * rows + r] = block[t.info.offset + r * cols + c];
    }
  }
  return values;
}

// Writes the tensors' master weights, in `dtype`, through `writer`, reading each block once.
Status WriteExportTensors(const std::vector<ExportTensor>& out, const engine::Manifest& m,
                          const formats::OpenSafetensors& master, DType dtype,
                          formats::SafetensorsWriter& writer) {
  Status status;
  std::vector<float> block;
  int loaded = -1;
  for (const auto& t : out) {
    if (t.block != loaded) {
      const std::string name = m.block_names[t.block];
      const auto* st = master.header.Find(name);
      if (!st || st->dtype != DType::kF32 || st->num_elems != m.block_num_params[t.block]) {
        status = DataLossError(fmt::format("{}: no F32 tensor '{}'", engine::kMasterFile, name));
        break;
      }
      block.resize(st->num_elems);
      status = formats::ReadTensorBytes(master, *st, 0, std::as_writable_bytes(std::span(block)));
      if (!status.ok()) break;
      loaded = t.block;
    }
    if (t.info.offset + t.info.num_elems > static_cast<int64_t>(block.size())) {
      status = InternalError(fmt::format("tensor '{}' lies outside its block", t.name));
      break;
    }
    const std::vector<float> values = TensorValues(t, block);
    if (dtype == DType::kF32) {
      status = writer.Append(std::as_bytes(std::span(values)));
    } else {
      std::vector<uint16_t> half(values.size());
      for (size_t i = 0; i < values.size(); ++i) half[i] = FloatToBf16(values[i]);
      status = writer.Append(std::as_bytes(std::span(half)));
    }
    if (!status.ok()) break;
  }
  return status;
}

}  // namespace

Status RunExport(const ExportFlags& f) {
  if (f.hf_dir.empty() + f.out.empty() + f.lora_dir.empty() != 2) {
    return InvalidArgumentError(
        "give exactly one of --hf-dir DIR, --lora-dir DIR and --safetensors FILE");
  }
  if (f.merge_lora && f.hf_dir.empty()) {
    return InvalidArgumentError("--merge-lora writes a Hugging Face directory: give --hf-dir DIR");
  }
  if (!f.hf_dir.empty() || !f.lora_dir.empty()) return ExportHfDirectory(f);
  STRATA_ASSIGN_OR_RETURN(DType dtype, ParseDType(f.dtype));
  if (dtype == DType::kF16) return InvalidArgumentError("--dtype must be bf16 or fp32");
  // Refused now, not after the whole model is written (the link at the end refuses it too).
  if (struct stat st; ::lstat(f.out.c_str(), &st) == 0) {
    return AlreadyExistsError(
        fmt::format("--safetensors '{}' exists ({}): export never replaces a file, give a new path",
                    f.out, FileTypeName(st.st_mode)));
  }
  STRATA_ASSIGN_OR_RETURN(std::string dir, engine::ResolveCheckpointDir(f.checkpoint));
  STRATA_ASSIGN_OR_RETURN(engine::Manifest m, engine::ReadManifest(dir));
  STRATA_RETURN_IF_ERROR(engine::VerifyCheckpointFiles(dir, m));
  STRATA_ASSIGN_OR_RETURN(models::GptShape shape, ShapeFromManifest(m));
  STRATA_ASSIGN_OR_RETURN(auto master,
                          formats::OpenSafetensorsFile(dir + "/" + engine::kMasterFile));

  STRATA_ASSIGN_OR_RETURN(std::vector<ExportTensor> out, ExportTensors(shape));
  std::vector<formats::SafetensorsWriter::TensorSpec> specs;
  for (const auto& t : out) {
    auto dims = t.info.shape;
    if (t.transpose) std::swap(dims[0], dims[1]);
    specs.push_back({t.name, dtype, dims});
  }
  // A name of this process's own: a leftover of a killed export blocks no later one.
  const std::string tmp = fmt::format("{}.tmp-{}", f.out, ::getpid());
  STRATA_ASSIGN_OR_RETURN(
      auto writer,
      formats::SafetensorsWriter::Create(
          tmp, specs,
          {{"format", "pt"},
           {"source", fmt::format("strata checkpoint {} (step {})", dir, m.trainer.step)}}));
  Status status = WriteExportTensors(out, m, master, dtype, writer);
  if (status.ok()) status = writer.Finish().status();
  // link() does not replace an existing file (rename would).
  if (status.ok() && ::link(tmp.c_str(), f.out.c_str()) != 0) {
    status = ErrnoToStatus(errno, fmt::format("creating '{}'", f.out));
  }
  ::unlink(tmp.c_str());
  if (status.ok()) {  // the new name, durable
    const std::string parent = std::filesystem::path(f.out).parent_path().string();
    status = FsyncDirectory(parent.empty() ? "." : parent);
  }
  if (!status.ok()) return status;
  std::printf("exported %zu tensors (%s) from %s to %s\n", out.size(),
              std::string(DTypeName(dtype)).c_str(), dir.c_str(), f.out.c_str());
  return Status::Ok();
}

}  // namespace strata::tools
