#include "engine/checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/file.h"
#include "base/json_fields.h"
#include "base/untrusted_text.h"
#include "engine/optimizer_json.h"
#include "engine/plan/optimizer_state.h"
#include "formats/safetensors.h"

namespace strata::engine {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxManifestBytes = 16 << 20;

// How a file of a checkpoint is read: a symlink is refused, and a file that is not a regular
// file or is larger than `max_bytes` is a damaged checkpoint (kDataLoss).
constexpr ReadSmallFileOptions OwnFileOptions(uint64_t max_bytes) {
  return {.max_bytes = max_bytes, .follow_symlinks = false, .unusable_code = StatusCode::kDataLoss};
}

}  // namespace

int64_t CheckpointStepOfName(std::string_view name) {
  constexpr std::string_view kPrefix = "step-";
  // More than 18 digits: no int64 step count, and the sum below would overflow.
  if (!name.starts_with(kPrefix) || name.size() == kPrefix.size() ||
      name.size() > kPrefix.size() + 18) {
    return -1;
  }
  int64_t n = 0;
  for (const char c : name.substr(kPrefix.size())) {
    if (c < '0' || c > '9') return -1;
    n = n * 10 + (c - '0');
  }
  return n;
}

namespace {

// The optimizer object of a manifest: OptimizerToJson plus the `strata train --optimizer` name.
json OptimizerManifestJson(const cpu_optim::AnyOptimizer& optimizer) {
  json j = OptimizerToJson(optimizer);
  j["name"] = OptimizerFlagName(optimizer);
  return j;
}

}  // namespace

bool IsPlainFileName(std::string_view name) {
  if (name.empty() || name.size() > 255 || name[0] == '.') return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
}

std::string UpdateSettingsDifferences(const Manifest& saved,
                                      const cpu_optim::AnyOptimizer& optimizer,
                                      float grad_clip_norm, bool decay_norms_and_biases) {
  json a = OptimizerToJson(saved.optimizer), b = OptimizerToJson(optimizer);
  a.erase("lr"), b.erase("lr");
  a.erase("kind"), b.erase("kind");
  // Numbers as the fp32 values they are ("0.1", not 0.10000000149011612).
  auto text = [](const json* v) {
    if (v == nullptr) return std::string("(none)");
    if (v->is_number_float()) return fmt::format("{}", static_cast<float>(v->get<double>()));
    return v->dump();
  };
  std::vector<std::string> parts;
  auto compare = [&](const std::string& key, const json* x, const json* y) {
    if (x != nullptr && y != nullptr && text(x) == text(y)) return;
    parts.push_back(fmt::format("{} {} -> {}", key, text(x), text(y)));
  };
  json keys = a;
  keys.update(b);
  for (const auto& [key, unused] : keys.items()) {
    compare(key, a.contains(key) ? &a[key] : nullptr, b.contains(key) ? &b[key] : nullptr);
  }
  const json clip_a = saved.grad_clip_norm, clip_b = grad_clip_norm;
  compare("grad_clip_norm", &clip_a, &clip_b);
  const json decay_a = saved.decay_norms_and_biases, decay_b = decay_norms_and_biases;
  compare("decay_norms_and_biases", &decay_a, &decay_b);
  return fmt::format("{}", fmt::join(parts, ", "));
}

std::string SerializeManifest(const Manifest& m) {
  json files = json::array();
  for (const auto& f : m.files) {
    files.push_back(
        {{"name", f.name}, {"size_bytes", f.size_bytes}, {"xxh3", fmt::format("{:016x}", f.xxh3)}});
  }
  const auto object_or_empty = [](const std::string& text) {
    json j = json::parse(text, nullptr, false);
    return j.is_object() ? j : json::object();
  };
  json j = {
      {"format", "strata-checkpoint"},
      {"format_version", m.format_version},
      {"precision", m.precision},
      {"model",
       {{"description", m.model_description},
        {"block_names", m.block_names},
        {"block_num_params", m.block_num_params},
        {"vocab_size", m.vocab_size},
        {"max_seq_len", m.max_seq_len},
        {"config", object_or_empty(m.trainer.model_json)}}},
      {"engine",
       {{"steps", m.engine_steps},
        {"adam_steps", m.adam_steps},
        {"loss_scale", m.loss_scaler.scale},
        {"loss_scaler_clean_steps", m.loss_scaler.clean_steps},
        {"loss_scaler_overflows", m.loss_scaler.overflows},
        {"loss_scaler_hysteresis_left", m.loss_scaler.hysteresis_left},
        {"grad_clip_norm", m.grad_clip_norm},
        {"decay_norms_and_biases", m.decay_norms_and_biases},
        {"ranks", m.ranks}}},
      {"optimizer", OptimizerManifestJson(m.optimizer)},
      {"trainer",
       {{"step", m.trainer.step},
        {"tokens_seen", m.trainer.tokens_seen},
        {"data_rng", m.trainer.data_rng},
        {"sample_rng", m.trainer.sample_rng},
        {"lr_schedule", object_or_empty(m.trainer.lr_schedule_json)}}},
      {"files", files},
  };
  return j.dump(2) + "\n";
}

StatusOr<Manifest> ParseManifest(std::string_view text) {
  // Bounded: a value nested millions deep overflowed the stack of the dump() that keeps the
  // model's config as text.
  StatusOr<json> parsed = ParseJsonBounded(text);
  if (!parsed.ok()) {
    return DataLossError(
        fmt::format("manifest is not a JSON object: {}", parsed.status().message()));
  }
  const json& j = *parsed;
  if (!j.is_object()) return DataLossError("manifest is not a JSON object");
  Manifest m;
  const JsonFields top(j, "manifest", "manifest");
  STRATA_ASSIGN_OR_RETURN(std::string format, top.String("format"));
  if (format != "strata-checkpoint") {
    return DataLossError(
        fmt::format("manifest format '{}' is not strata-checkpoint", Excerpt(format, 40)));
  }
  STRATA_ASSIGN_OR_RETURN(int64_t version, top.Int("format_version", 0, INT32_MAX));
  if (version != kCheckpointFormatVersion && version != 1) {
    return FailedPreconditionError(
        fmt::format("checkpoint format version {} is not one this strata reads (1 to {})", version,
                    kCheckpointFormatVersion));
  }
  m.format_version = static_cast<int>(version);
  STRATA_ASSIGN_OR_RETURN(m.precision, top.String("precision"));
  if (m.precision != "fp32" && m.precision != "fp16" && m.precision != "bf16") {
    return DataLossError(
        fmt::format("manifest precision '{}' is not fp32, fp16 or bf16", Excerpt(m.precision, 20)));
  }

  STRATA_ASSIGN_OR_RETURN(const json* model, top.Get("model", json::value_t::object));
  const JsonFields mf(*model, "manifest", "model");
  STRATA_ASSIGN_OR_RETURN(m.model_description, mf.String("description"));
  STRATA_ASSIGN_OR_RETURN(const json* names, mf.Get("block_names", json::value_t::array));
  STRATA_ASSIGN_OR_RETURN(const json* sizes, mf.Get("block_num_params", json::value_t::array));
  if (names->size() != sizes->size() || names->empty() || names->size() > 1'000'000) {
    return DataLossError(fmt::format(
        "manifest: model.block_names ({}) and model.block_num_params ({}) differ or are empty",
        names->size(), sizes->size()));
  }
  for (size_t b = 0; b < names->size(); ++b) {
    if (!(*names)[b].is_string() || !(*sizes)[b].is_number_unsigned() ||
        (*sizes)[b].get<uint64_t>() > (uint64_t{1} << 48)) {
      return DataLossError(fmt::format("manifest: model block {} has a bad name or size", b));
    }
    m.block_names.push_back((*names)[b].get<std::string>());
    m.block_num_params.push_back(static_cast<int64_t>((*sizes)[b].get<uint64_t>()));
  }
  STRATA_ASSIGN_OR_RETURN(int64_t vocab, mf.Int("vocab_size", 1, INT32_MAX));
  STRATA_ASSIGN_OR_RETURN(int64_t seq, mf.Int("max_seq_len", 1, INT32_MAX));
  m.vocab_size = static_cast<int>(vocab);
  m.max_seq_len = static_cast<int>(seq);
  STRATA_ASSIGN_OR_RETURN(m.trainer.model_json, mf.ObjectText("config"));

  STRATA_ASSIGN_OR_RETURN(const json* eng, top.Get("engine", json::value_t::object));
  const JsonFields ef(*eng, "manifest", "engine");
  STRATA_ASSIGN_OR_RETURN(m.engine_steps, ef.Int("steps", 0, INT64_MAX));
  STRATA_ASSIGN_OR_RETURN(m.adam_steps, ef.Int("adam_steps", 0, m.engine_steps));
  STRATA_ASSIGN_OR_RETURN(m.loss_scaler.scale, ef.Float("loss_scale"));
  if (!(m.loss_scaler.scale > 0) || !std::isfinite(m.loss_scaler.scale)) {
    return DataLossError("manifest: engine.loss_scale is not a positive finite number");
  }
  STRATA_ASSIGN_OR_RETURN(m.loss_scaler.clean_steps,
                          ef.Int("loss_scaler_clean_steps", 0, INT64_MAX));
  STRATA_ASSIGN_OR_RETURN(m.loss_scaler.overflows, ef.Int("loss_scaler_overflows", 0, INT64_MAX));
  if (eng->contains("loss_scaler_hysteresis_left")) {
    STRATA_ASSIGN_OR_RETURN(int64_t left, ef.Int("loss_scaler_hysteresis_left", 0, INT32_MAX));
    m.loss_scaler.hysteresis_left = static_cast<int>(left);
  }
  STRATA_ASSIGN_OR_RETURN(m.grad_clip_norm, ef.Float("grad_clip_norm"));
  m.decay_norms_and_biases = true;  // before weight decay groups every element was decayed
  if (eng->contains("decay_norms_and_biases")) {
    STRATA_ASSIGN_OR_RETURN(m.decay_norms_and_biases, ef.Bool("decay_norms_and_biases"));
  }
  if (eng->contains("ranks")) {
    STRATA_ASSIGN_OR_RETURN(int64_t ranks, ef.Int("ranks", 1, 1 << 20));
    m.ranks = static_cast<int>(ranks);
  }

  STRATA_ASSIGN_OR_RETURN(const json* opt, top.Get("optimizer", json::value_t::object));
  if (version == 1) {
    // Version 1 held AdamW or Adam only, with these fields.
    const JsonFields of(*opt, "manifest", "optimizer");
    cpu_optim::AdamWConfig& c = m.optimizer.adamw();
    STRATA_ASSIGN_OR_RETURN(c.lr, of.Float("lr"));
    STRATA_ASSIGN_OR_RETURN(c.beta1, of.Float("beta1"));
    STRATA_ASSIGN_OR_RETURN(c.beta2, of.Float("beta2"));
    STRATA_ASSIGN_OR_RETURN(c.eps, of.Float("eps"));
    STRATA_ASSIGN_OR_RETURN(c.weight_decay, of.Float("weight_decay"));
    STRATA_ASSIGN_OR_RETURN(c.decoupled_weight_decay, of.Bool("decoupled_weight_decay"));
    STRATA_ASSIGN_OR_RETURN(c.bias_correction, of.Bool("bias_correction"));
    m.optimizer.kind = c.decoupled_weight_decay ? cpu_optim::OptimizerKind::kAdamW
                                                : cpu_optim::OptimizerKind::kAdam;
  } else {
    STRATA_ASSIGN_OR_RETURN(m.optimizer, OptimizerFromJson(*opt, "manifest: optimizer"));
  }
  STRATA_ASSIGN_OR_RETURN(const json* tr, top.Get("trainer", json::value_t::object));
  const JsonFields tf(*tr, "manifest", "trainer");
  STRATA_ASSIGN_OR_RETURN(m.trainer.step, tf.Int("step", 0, INT64_MAX));
  STRATA_ASSIGN_OR_RETURN(m.trainer.tokens_seen, tf.Int("tokens_seen", 0, INT64_MAX));
  STRATA_ASSIGN_OR_RETURN(m.trainer.data_rng, tf.String("data_rng"));
  STRATA_ASSIGN_OR_RETURN(m.trainer.sample_rng, tf.String("sample_rng"));
  STRATA_ASSIGN_OR_RETURN(m.trainer.lr_schedule_json, tf.ObjectText("lr_schedule"));

  STRATA_ASSIGN_OR_RETURN(const json* files, top.Get("files", json::value_t::array));
  if (files->size() > 64) return DataLossError("manifest: more than 64 files");
  for (size_t i = 0; i < files->size(); ++i) {
    const JsonFields ff((*files)[i], "manifest", fmt::format("files[{}]", i));
    ManifestFile f;
    STRATA_ASSIGN_OR_RETURN(f.name, ff.String("name"));
    if (!IsPlainFileName(f.name) || f.name == kManifestFileName) {
      return DataLossError(
          fmt::format("manifest: files[{}].name '{}' is not a plain file name of this checkpoint",
                      i, Excerpt(f.name, 80)));
    }
    for (const auto& other : m.files) {
      if (other.name == f.name) {
        return DataLossError(
            fmt::format("manifest: file '{}' is listed twice", Excerpt(f.name, 80)));
      }
    }
    STRATA_ASSIGN_OR_RETURN(int64_t size, ff.Int("size_bytes", 0, INT64_MAX));
    f.size_bytes = static_cast<uint64_t>(size);
    STRATA_ASSIGN_OR_RETURN(f.xxh3, ff.Hex64("xxh3"));
    m.files.push_back(std::move(f));
  }
  return m;
}

StatusOr<std::string> ResolveCheckpointDir(const std::string& path) {
  struct stat st;
  const std::string manifest = path + "/" + kManifestFileName;
  if (::lstat(manifest.c_str(), &st) == 0) return path;
  const std::string latest = path + "/" + kLatestFileName;
  if (::lstat(latest.c_str(), &st) != 0) {
    return NotFoundError(
        fmt::format("'{}' is neither a checkpoint (no {}) nor a save directory (no '{}' file)",
                    path, kManifestFileName, kLatestFileName));
  }
  STRATA_ASSIGN_OR_RETURN(std::string name, ReadSmallFile(latest, OwnFileOptions(4096)));
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (!IsPlainFileName(name)) {
    return DataLossError(fmt::format("'{}' names '{}', which is not a checkpoint directory name",
                                     latest, Excerpt(name, 80)));
  }
  return path + "/" + name;
}

StatusOr<Manifest> ReadManifest(const std::string& dir) {
  const std::string path = dir + "/" + kManifestFileName;
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, OwnFileOptions(kMaxManifestBytes)));
  auto m = ParseManifest(text);
  if (!m.ok()) return m.status().WithContext(path);
  return m;
}

Status CheckFileAgainstManifest(const std::string& path, const ManifestFile& listed,
                                uint64_t size_bytes, uint64_t xxh3) {
  if (size_bytes != listed.size_bytes) {
    return DataLossError(
        fmt::format("'{}' is {} bytes, the manifest says {} (truncated or extended)", path,
                    size_bytes, listed.size_bytes));
  }
  if (xxh3 != listed.xxh3) {
    return DataLossError(
        fmt::format("'{}': xxh3 {:016x} does not match the manifest's {:016x} (the file is "
                    "corrupted)",
                    path, xxh3, listed.xxh3));
  }
  return Status::Ok();
}

Status CheckManifestListsItsFiles(const Manifest& manifest) {
  const auto listed = [&](std::string_view name) {
    return std::any_of(manifest.files.begin(), manifest.files.end(),
                       [&](const ManifestFile& f) { return f.name == name; });
  };
  for (const char* name : {kMasterFile, kWorkingFile}) {
    if (!listed(name)) {
      return DataLossError(
          fmt::format("the manifest lists no '{}', which every checkpoint has", name));
    }
  }
  const auto trained =
      std::find_if(manifest.block_num_params.begin(), manifest.block_num_params.end(),
                   [](int64_t n) { return n > 0; });
  if (trained == manifest.block_num_params.end()) return Status::Ok();  // nothing has state
  const cpu_optim::AnyOptimizer& o = manifest.optimizer;
  const std::string optimizer = OptimizerFlagName(o);
  const auto missing = [&](std::string_view section) {
    return DataLossError(fmt::format(
        "the manifest lists no '{}.safetensors', which its {} state needs (a resume refuses it; "
        "export reads only the master weights)",
        section, optimizer));
  };
  if (o.kind == cpu_optim::OptimizerKind::kAdafactor) {
    const auto* c = std::get_if<cpu_optim::AdafactorConfig>(&o.config);
    if (c != nullptr && c->beta1 > 0 && !listed("exp_avg.safetensors")) return missing("exp_avg");
    if (!listed("exp_avg_sq_row.safetensors") && !listed("exp_avg_sq.safetensors")) {
      return missing("exp_avg_sq");
    }
    return Status::Ok();
  }
  const std::vector<std::vector<int64_t>> shapes = {{*trained}};
  for (const cpu_optim::StateSpec& spec : cpu_optim::StateLayout(o, shapes)) {
    if (!listed(spec.name + ".safetensors")) return missing(spec.name);
  }
  return Status::Ok();
}

Status VerifyCheckpointFiles(const std::string& dir, const Manifest& manifest) {
  for (const auto& f : manifest.files) {
    const std::string path = dir + "/" + f.name;
    uint64_t size = 0;
    STRATA_ASSIGN_OR_RETURN(uint64_t hash, formats::FileXxh3(path, &size));
    STRATA_RETURN_IF_ERROR(CheckFileAgainstManifest(path, f, size, hash));
  }
  return Status::Ok();
}

StatusOr<std::string> CreateCheckpointTempDir(const std::string& save_dir, int64_t step) {
  if (::mkdir(save_dir.c_str(), S_IRWXU) == 0) {
    // A new save directory is durable before the first checkpoint in it is.
    const std::filesystem::path parent = std::filesystem::path(save_dir).parent_path();
    STRATA_RETURN_IF_ERROR(FsyncDirectory(parent.empty() ? std::string(".") : parent.string()));
  } else if (errno != EEXIST) {
    return ErrnoToStatus(errno, fmt::format("creating the save directory '{}'", save_dir));
  }
  struct stat st;
  if (::stat(save_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return InvalidArgumentError(fmt::format("save directory '{}' is not a directory", save_dir));
  }
  return MakeTempDirectory(fmt::format("{}/.tmp-step-{}-XXXXXX", save_dir, step));
}

Status CommitCheckpoint(const std::string& save_dir, const std::string& temp_dir,
                        const Manifest& manifest, int keep_last, std::string* final_dir) {
  STRATA_RETURN_IF_ERROR(
      WriteNewFile(temp_dir + "/" + kManifestFileName, SerializeManifest(manifest), 0600));
  STRATA_RETURN_IF_ERROR(FsyncDirectory(temp_dir));
  const std::string name = fmt::format("step-{}", manifest.trainer.step);
  const std::string target = save_dir + "/" + name;
  // A checkpoint of this step may exist (a save after a resume from it): it is exchanged with
  // the new one in one step (MoveIntoPlace), and removed once `latest` is written.
  std::string displaced;
  STRATA_RETURN_IF_ERROR(MoveIntoPlace(temp_dir, target, &displaced));
  const std::string latest_tmp = save_dir + "/" + kLatestFileName + ".tmp";
  if (::unlink(latest_tmp.c_str()) != 0 && errno != ENOENT) {
    return ErrnoToStatus(errno, fmt::format("removing stale '{}'", latest_tmp));
  }
  Status latest_written = WriteNewFile(latest_tmp, name + "\n", 0600);
  if (latest_written.ok()) {
    latest_written = RenameDurably(latest_tmp, save_dir + "/" + kLatestFileName);
  }
  if (!latest_written.ok()) {
    // The checkpoint is whole in its place; `latest` still names the one before it.
    ::unlink(latest_tmp.c_str());
    return Status(latest_written.code(),
                  fmt::format("checkpoint '{}' is complete but '{}' still names the one before "
                              "(resume from '{}' by name): {}",
                              target, kLatestFileName, target, latest_written.message()));
  }
  if (!displaced.empty()) RemoveTree(displaced);
  if (final_dir) *final_dir = target;

  // Retention and leftovers of interrupted saves.
  if (keep_last > 0) {
    std::vector<std::pair<int64_t, std::string>> complete;
    std::vector<std::string> leftovers;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(save_dir, ec)) {
      const std::string n = e.path().filename().string();
      if (n.rfind(".tmp-step-", 0) == 0 || n.rfind(".old-step-", 0) == 0) {
        leftovers.push_back(e.path().string());
      } else if (const int64_t s = CheckpointStepOfName(n);
                 s >= 0 && n != name && e.is_directory(ec) && !e.is_symlink(ec)) {
        complete.emplace_back(s, e.path().string());
      }
    }
    std::sort(complete.rbegin(), complete.rend());  // newest first
    // `latest` names the new checkpoint, which is not in `complete`; it counts as one kept.
    for (size_t i = keep_last > 0 ? keep_last - 1 : 0; i < complete.size(); ++i) {
      RemoveTree(complete[i].second);
    }
    for (const auto& l : leftovers) RemoveTree(l);
  }
  return Status::Ok();
}

}  // namespace strata::engine
