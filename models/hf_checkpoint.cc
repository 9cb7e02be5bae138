#include "models/hf_checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "base/file.h"
#include "base/unique_fd.h"
#include "base/untrusted_text.h"
#include "cpu_optim/grad_stats.h"
#include "models/hf_bnb.h"

namespace strata::models {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxIndexBytes = 100'000'000;

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Buffers Hugging Face saves with some checkpoints that are not parameters.
bool IsIgnoredBuffer(std::string_view name) {
  return EndsWith(name, ".attn.bias") || EndsWith(name, ".attn.masked_bias") ||
         EndsWith(name, "rotary_emb.inv_freq") || name == "attn.bias" || name == "attn.masked_bias";
}

// A shard name in an index must be a plain file name inside the model directory.
bool PlainFileName(std::string_view name) {
  if (name.empty() || name.size() > 255 || name == "." || name == "..") return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return u >= 0x20 && u != 0x7f && c != '/' && c != '\\';
  });
}

// OpenSafetensorsFile rejects a dtype other than F32/F16/BF16 without naming the tensor; this
// names it by reading the header's JSON again. Returns `original` when it finds nothing better.
Status NameUnsupportedDtype(const std::string& path, const Status& original) {
  if (original.code() != StatusCode::kInvalidArgument) return original;
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  uint8_t len[8];
  if (!fd.valid() || ::pread(fd.get(), len, 8, 0) != 8) return original;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n > formats::kMaxSafetensorsHeaderBytes) return original;
  std::string text(n, '\0');
  if (::pread(fd.get(), text.data(), n, 8) != static_cast<ssize_t>(n)) return original;
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return original;
  for (const auto& [name, entry] : j.items()) {
    if (name == "__metadata__" || !entry.is_object()) continue;
    const auto dt = entry.find("dtype");
    if (dt == entry.end() || !dt->is_string()) continue;
    const std::string& d = dt->get_ref<const std::string&>();
    if (d != "F32" && d != "F16" && d != "BF16") {
      return InvalidArgumentError(
          fmt::format("{}: tensor '{}' has dtype {} (F32, F16 and BF16 are supported)", path,
                      Excerpt(name, 120), Excerpt(d, 120)));
    }
  }
  return original;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// GPT-2 checkpoints may store the GPT2Model's names without the "transformer." prefix; a Gemma 3
// multimodal directory stores its language model's "model.X" as "language_model.model.X" (or,
// since transformers 4.52, "model.language_model.X") and lm_head as "language_model.lm_head".
std::vector<std::string> CandidateNames(const HfModelConfig& config, const std::string& name) {
  std::vector<std::string> out = {name};
  constexpr std::string_view kPrefix = "transformer.";
  if (config.family == HfModelConfig::Family::kGpt2 && name.starts_with(kPrefix)) {
    out.push_back(name.substr(kPrefix.size()));
  }
  constexpr std::string_view kModel = "model.";
  if (config.gemma3_multimodal) {
    if (name.starts_with(kModel)) {
      out.push_back("language_model." + name);
      out.push_back("model.language_model." + name.substr(kModel.size()));
    } else {
      out.push_back("language_model." + name);
    }
  }
  return out;
}

// The vision tower and projector of a Gemma 3 multimodal directory: present, never read.
bool IsVisionTensor(const HfModelConfig& config, std::string_view name) {
  if (!config.gemma3_multimodal) return false;
  for (std::string_view p : {"vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                             "model.multi_modal_projector."}) {
    if (name.starts_with(p)) return true;
  }
  return false;
}

}  // namespace

StatusOr<std::map<std::string, std::string>> ParseSafetensorsIndex(std::string_view text,
                                                                   std::string_view index_path) {
  StatusOr<json> parsed = ParseJsonBounded(text);
  if (!parsed.ok()) {
    return InvalidArgumentError(fmt::format("{}: {}", index_path, parsed.status().message()));
  }
  const json& j = *parsed;
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    return InvalidArgumentError(
        fmt::format("{}: not a JSON object with a \"weight_map\" object", index_path));
  }
  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, shard] : j["weight_map"].items()) {
    if (!shard.is_string() || !PlainFileName(shard.get_ref<const std::string&>())) {
      return InvalidArgumentError(
          fmt::format("{}: weight_map entry of tensor '{}' must be a plain file name in the "
                      "directory, got {}",
                      index_path, Excerpt(tensor, 120), JsonExcerpt(shard, 120)));
    }
    weight_map[tensor] = shard.get<std::string>();
  }
  return weight_map;
}

StatusOr<std::shared_ptr<HfCheckpoint>> HfCheckpoint::Open(const std::string& dir) {
  std::shared_ptr<HfCheckpoint> ck(new HfCheckpoint());
  ck->dir_ = dir;
  STRATA_ASSIGN_OR_RETURN(ck->config_, ReadHfConfig(dir));
  const HfModelConfig& config = ck->config_;

  // Which files hold the weights; with an index, which file each tensor is in.
  const std::string single_path = dir + "/model.safetensors";
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::map<std::string, std::string> weight_map;  // tensor -> shard file name
  std::vector<std::string> shard_names;
  const bool indexed = !IsRegularFile(single_path) && IsRegularFile(index_path);
  if (!indexed) {
    if (!IsRegularFile(single_path)) {
      return NotFoundError(fmt::format(
          "{}: no model.safetensors and no model.safetensors.index.json in the directory", dir));
    }
    shard_names.push_back("model.safetensors");
  } else {
    STRATA_ASSIGN_OR_RETURN(const std::string text,
                            ReadSmallFile(index_path, {.max_bytes = kMaxIndexBytes}));
    STRATA_ASSIGN_OR_RETURN(weight_map, ParseSafetensorsIndex(text, index_path));
    std::set<std::string> names;
    for (const auto& [tensor, shard] : weight_map) names.insert(shard);
    shard_names.assign(names.begin(), names.end());
  }

  // Open every file and read its header (no tensor data).
  std::map<std::string, std::pair<int, const formats::SafetensorsTensor*>> present;
  for (const std::string& name : shard_names) {
    auto shard = std::make_unique<Shard>();
    shard->path = dir + "/" + name;
    // The Hugging Face hub cache links every file of a snapshot to a blob: follow a link the
    // directory holds (OpenSafetensorsFile itself opens with O_NOFOLLOW).
    std::string open_path = shard->path;
    std::error_code ec;
    if (std::filesystem::is_symlink(open_path, ec)) {
      const auto target = std::filesystem::canonical(open_path, ec);
      if (!ec) open_path = target.string();
    }
    auto file = formats::OpenSafetensorsFile(open_path);
    if (!file.ok()) {
      Status s = NameUnsupportedDtype(open_path, file.status());
      if (open_path != shard->path) s = s.WithContext(shard->path);
      if (indexed && s.code() == StatusCode::kNotFound) {
        std::string first_tensor;
        for (const auto& [tensor, shard_name] : weight_map) {
          if (shard_name == name) {
            first_tensor = tensor;
            break;
          }
        }
        s = NotFoundError(fmt::format("{}: shard '{}' (holding tensor '{}') is missing: {}",
                                      index_path, Excerpt(name, 120), Excerpt(first_tensor, 120),
                                      s.message()));
      }
      return s;
    }
    shard->file = std::move(*file);
    const int index = static_cast<int>(ck->shards_.size());
    for (const formats::SafetensorsTensor& t : shard->file.header.tensors) {
      const auto [it, inserted] = present.emplace(t.name, std::make_pair(index, &t));
      if (!inserted) {
        return InvalidArgumentError(fmt::format("{}: tensor '{}' is also in {}", shard->path,
                                                Excerpt(t.name, 120),
                                                ck->shards_[it->second.first]->path));
      }
    }
    ck->shards_.push_back(std::move(shard));
  }

  // A 4-bit directory (bitsandbytes): which parameters; the Llama families only.
  STRATA_ASSIGN_OR_RETURN(ck->base_quant_,
                          ParseBnbQuantizationConfig(config.raw, dir + "/config.json"));
  std::vector<std::string> skip_modules;
  if (ck->base_quant_) {
    STRATA_RETURN_IF_ERROR(CheckHfBaseQuantizable(config).WithContext(dir + "/config.json"));
    STRATA_ASSIGN_OR_RETURN(skip_modules, BnbSkipModules(config.raw, dir + "/config.json"));
  }

  // Finds the tensor stored under `name`: *found is where (shard and header), false when the
  // directory has no such tensor. An index entry whose shard lacks the tensor is an error.
  auto locate = [&](const std::string& name, Stored* found) -> StatusOr<bool> {
    if (indexed ? !weight_map.contains(name) : !present.contains(name)) return false;
    const auto it = present.find(name);
    if (indexed && (it == present.end() ||
                    ck->shards_[it->second.first]->path != dir + "/" + weight_map[name])) {
      return InvalidArgumentError(
          fmt::format("{}/{}: tensor '{}' is not in the file (the index maps it there)", dir,
                      weight_map[name], name));
    }
    *found = {it->second.first, it->second.second};
    return true;
  };
  const std::string& names_file = indexed ? index_path : single_path;
  std::set<std::string> used;
  // The quant_state dtype of the 4-bit tensors read so far (all must share it) and the first's.
  std::optional<DType> quant_dtype;
  std::string quant_dtype_from;
  // The parts of the 4-bit weight stored as `name` (its codes: `codes`), checked against
  // bitsandbytes' format and the config, their names added to `used`.
  auto open_quantized = [&](const std::string& name, const Stored& codes,
                            const HfTensor& layout) -> StatusOr<Quantized> {
    const ops::Quant4Params params = *ck->base_quant_;
    const BnbTensorNames names = BnbNames(name, params.type);
    BnbParts parts;
    Stored absmax, quant_map, nested_absmax, nested_quant_map, quant_state;
    auto part = [&](const std::string& part_name, Stored* stored, BnbPart* out) -> Status {
      STRATA_ASSIGN_OR_RETURN(const bool found, locate(part_name, stored));
      out->path = found ? ck->shards_[stored->shard]->path : names_file;
      out->tensor = found ? stored->tensor : nullptr;
      if (found) used.insert(part_name);
      return Status::Ok();
    };
    parts.codes = {codes.tensor, ck->shards_[codes.shard]->path};
    STRATA_RETURN_IF_ERROR(part(names.absmax, &absmax, &parts.absmax));
    STRATA_RETURN_IF_ERROR(part(names.quant_map, &quant_map, &parts.quant_map));
    STRATA_RETURN_IF_ERROR(part(names.nested_absmax, &nested_absmax, &parts.nested_absmax));
    STRATA_RETURN_IF_ERROR(
        part(names.nested_quant_map, &nested_quant_map, &parts.nested_quant_map));
    STRATA_RETURN_IF_ERROR(part(names.quant_state, &quant_state, &parts.quant_state));
    Quantized q;
    q.layout = ops::MakeQuant4Layout(layout.num_elems, params);
    STRATA_RETURN_IF_ERROR(CheckBnbParts(parts, names, layout.shape, q.layout));
    q.absmax = absmax;
    if (params.double_quant) q.nested_absmax = nested_absmax;

    std::vector<float> map(ops::kQuant4NestedBlockSize);
    STRATA_RETURN_IF_ERROR(
        ck->ReadStored(quant_map, 0, std::as_writable_bytes(std::span(map).first(16))));
    STRATA_RETURN_IF_ERROR(CheckBnbQuantMap(std::span(map).first(16), params.type,
                                            parts.quant_map.path, names.quant_map));
    if (params.double_quant) {
      STRATA_RETURN_IF_ERROR(
          ck->ReadStored(nested_quant_map, 0, std::as_writable_bytes(std::span(map))));
      STRATA_RETURN_IF_ERROR(
          CheckBnbNestedQuantMap(map, parts.nested_quant_map.path, names.nested_quant_map));
    }
    std::string text(static_cast<size_t>(quant_state.tensor->num_elems), '\0');
    STRATA_RETURN_IF_ERROR(ck->ReadStored(
        quant_state, 0, std::as_writable_bytes(std::span(text.data(), text.size()))));
    STRATA_ASSIGN_OR_RETURN(
        const BnbQuantState state,
        ParseBnbQuantState(text, layout.shape, params, parts.quant_state.path, names.quant_state));
    q.nested_offset = state.nested_offset;
    if (!quant_dtype) {
      quant_dtype = state.dtype;
      quant_dtype_from = names.quant_state;
    } else if (*quant_dtype != state.dtype) {
      return InvalidArgumentError(fmt::format(
          "{}: tensor '{}' says dtype {}, '{}' {}: Strata dequantizes every 4-bit weight of a "
          "model to one type",
          parts.quant_state.path, Excerpt(names.quant_state, 120), DTypeName(state.dtype),
          Excerpt(quant_dtype_from, 120), DTypeName(*quant_dtype)));
    }
    q.layout.params.dtype = state.dtype;
    return q;
  };

  // Every tensor the config implies: where it is, its dtype and shape.
  const int num_blocks = HfNumBlocks(config);
  for (int b = 0; b < num_blocks; ++b) {
    std::vector<Source> sources;
    int64_t num_params = 0;
    for (HfTensor& layout : HfBlockTensors(config, b)) {
      std::string found;
      Stored stored;
      for (const std::string& name : CandidateNames(config, layout.name)) {
        STRATA_ASSIGN_OR_RETURN(const bool here, locate(name, &stored));
        if (here) {
          found = name;
          break;
        }
      }
      if (found.empty()) {
        return InvalidArgumentError(
            indexed
                ? fmt::format("{}: tensor '{}' has no entry in weight_map", index_path, layout.name)
                : fmt::format("{}: tensor '{}' is missing", single_path, layout.name));
      }
      const formats::SafetensorsTensor* tensor = stored.tensor;
      const std::string& path = ck->shards_[stored.shard]->path;
      // A projection llm_int8_skip_modules keeps is stored in 16 bits: the tensor's dtype says
      // which (transformers' rule for matching the names has changed between its versions; a
      // directory it saved stores what its rule chose).
      const bool quantized = ck->base_quant_ && HfBaseQuantized(config, b, layout) &&
                             (tensor->dtype.is_u8() || skip_modules.empty());
      std::optional<Quantized> q;
      if (quantized) {
        if (!tensor->dtype.is_u8()) {
          return InvalidArgumentError(fmt::format(
              "{}: tensor '{}' is stored {}, not 4-bit, and the quantization_config's "
              "llm_int8_skip_modules names no module: a bitsandbytes directory holds every "
              "projection of the layers in 4 bits but those",
              path, found, formats::SafetensorsDTypeName(tensor->dtype)));
        }
        STRATA_ASSIGN_OR_RETURN(q, open_quantized(found, stored, layout));
      } else if (tensor->dtype.is_u8()) {
        return InvalidArgumentError(
            ck->base_quant_
                ? fmt::format("{}: tensor '{}' is stored 4-bit (U8); Strata keeps embeddings, "
                              "norms, biases and the LM head in 16 bits (F32, F16 or BF16)",
                              path, found)
                : fmt::format("{}: tensor '{}' has dtype U8 (F32, F16 and BF16 are supported)",
                              path, found));
      } else if (tensor->shape != layout.shape) {
        return InvalidArgumentError(
            fmt::format("{}: tensor '{}' has shape {}, config.json needs {}", path, found,
                        ShapeString(tensor->shape), ShapeString(layout.shape)));
      }
      used.insert(found);
      num_params += layout.num_elems;
      sources.push_back({std::move(layout), stored.shard, tensor, std::move(q)});
    }
    ck->blocks_.push_back(std::move(sources));
    ck->block_num_params_.push_back(num_params);
    ck->block_names_.push_back(HfBlockName(config, b));
  }
  // What every 4-bit weight dequantizes to (their quant_state's dtype), as bitsandbytes does.
  if (ck->base_quant_ && quant_dtype) ck->base_quant_->dtype = *quant_dtype;

  // Tensors nothing uses: the config and the weights disagree.
  const bool tied = config.family == HfModelConfig::Family::kLlama ? config.llama.tie_embeddings
                                                                   : config.gpt2.tie_embeddings;
  std::vector<std::string> extra;
  std::string extra_file;
  auto check_extra = [&](const std::string& name, const std::string& file) {
    if (used.contains(name) || IsIgnoredBuffer(name) || IsVisionTensor(config, name) ||
        (tied && (name == "lm_head.weight" || name == "language_model.lm_head.weight"))) {
      return;
    }
    if (extra.empty()) extra_file = file;
    extra.push_back(fmt::format("'{}'", Excerpt(name, 120)));
  };
  for (const auto& [name, where] : present) check_extra(name, ck->shards_[where.first]->path);
  for (const auto& [name, shard] : weight_map) {
    if (!present.contains(name)) check_extra(name, index_path);
  }
  if (!extra.empty()) {
    const size_t shown = std::min<size_t>(extra.size(), 8);
    return InvalidArgumentError(fmt::format(
        "{}: {} tensor(s) the config.json model does not have: {}{} (config and weights "
        "disagree)",
        extra_file, extra.size(),
        fmt::join(std::vector<std::string>(extra.begin(), extra.begin() + shown), ", "),
        extra.size() > shown ? ", ..." : ""));
  }

  for (const char* name :
       {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json"}) {
    const std::string path = dir + "/" + name;
    if (IsRegularFile(path)) ck->companion_files_.push_back(path);
  }
  return ck;
}

int64_t HfCheckpoint::block_num_params(int block) const {
  STRATA_CHECK(block >= 0 && block < num_blocks());
  return block_num_params_[block];
}

std::vector<formats::TensorDType> HfCheckpoint::block_dtypes(int block) const {
  STRATA_CHECK(block >= 0 && block < num_blocks());
  std::vector<formats::TensorDType> out;
  for (const Source& src : blocks_[block]) out.push_back(src.tensor->dtype);
  return out;
}

std::vector<std::string> HfCheckpoint::weight_files() const {
  std::vector<std::string> out;
  for (const auto& s : shards_) out.push_back(s->path);
  return out;
}

Status HfCheckpoint::ReadBlock(int block, std::span<float> out) const {
  return ReadBlockImpl(block, out, /*skip_quantized=*/false);
}

Status HfCheckpoint::ReadBlockSkippingQuantized(int block, std::span<float> out) const {
  return ReadBlockImpl(block, out, /*skip_quantized=*/true);
}

Status HfCheckpoint::ReadBlockImpl(int block, std::span<float> out, bool skip_quantized) const {
  if (block < 0 || block >= num_blocks()) {
    return InvalidArgumentError(
        fmt::format("{}: block {} out of range [0, {})", dir_, block, num_blocks()));
  }
  if (static_cast<int64_t>(out.size()) != block_num_params_[block]) {
    return InvalidArgumentError(fmt::format("{}: block {} has {} parameters, the buffer {}", dir_,
                                            block_names_[block], block_num_params_[block],
                                            out.size()));
  }
  std::vector<std::byte> staging;  // 16-bit file data; a 4-bit tensor's record
  std::vector<float> rows;         // fp32 rows of a transposed tensor
  for (const Source& src : blocks_[block]) {
    if (src.quantized) {
      if (skip_quantized) continue;
      const ops::Quant4Layout& layout = src.quantized->layout;
      staging.resize(static_cast<size_t>(layout.total_bytes));
      STRATA_RETURN_IF_ERROR(ReadRecord(src, staging));
      ops::Dequantize4bit<float>(layout, staging.data(), out.data() + src.layout.chunk_offset);
      continue;
    }
    const Shard& shard = *shards_[src.shard];
    const formats::SafetensorsTensor& t = *src.tensor;
    const int64_t elem_bytes = static_cast<int64_t>(t.dtype.size());
    float* dst = out.data() + src.layout.chunk_offset;
    auto read = [&](int64_t first_elem, int64_t num_elems, std::byte* into) -> Status {
      return formats::ReadTensorBytes(  // its errors name the shard's path and the tensor
          shard.file, t, static_cast<uint64_t>(first_elem * elem_bytes),
          std::span<std::byte>(into, static_cast<size_t>(num_elems * elem_bytes)));
    };
    // Reads elements [first, first + n) as fp32 into `to`.
    auto read_f32 = [&](int64_t first, int64_t n, float* to) -> Status {
      if (t.dtype == DType::kF32) return read(first, n, reinterpret_cast<std::byte*>(to));
      staging.resize(static_cast<size_t>(n * elem_bytes));
      STRATA_RETURN_IF_ERROR(read(first, n, staging.data()));
      return cpu_optim::ConvertToF32(staging.data(), t.dtype.dtype(), to, n);
    };
    if (!src.layout.transposed) {
      const int64_t piece = kStagingBytes / elem_bytes;
      for (int64_t e = 0; e < t.num_elems; e += piece) {
        STRATA_RETURN_IF_ERROR(read_f32(e, std::min(piece, t.num_elems - e), dst + e));
      }
      continue;
    }
    // Stored (R, K), chunk (K, R): read whole rows, scatter them as columns.
    const int64_t R = t.shape[0], K = t.shape[1];
    const int64_t piece_rows = std::max<int64_t>(1, kStagingBytes / (K * 4));
    for (int64_t r0 = 0; r0 < R; r0 += piece_rows) {
      const int64_t nr = std::min(piece_rows, R - r0);
      rows.resize(static_cast<size_t>(nr * K));
      STRATA_RETURN_IF_ERROR(read_f32(r0 * K, nr * K, rows.data()));
      for (int64_t k = 0; k < K; ++k) {
        float* col = dst + k * R + r0;
        for (int64_t r = 0; r < nr; ++r) col[r] = rows[r * K + k];
      }
    }
  }
  return Status::Ok();
}

Status HfCheckpoint::ReadStored(const Stored& part, uint64_t offset_bytes,
                                std::span<std::byte> out) const {
  const Shard& shard = *shards_[part.shard];
  // Its errors name the shard's path and the tensor.
  return formats::ReadTensorBytes(shard.file, *part.tensor, offset_bytes, out);
}

Status HfCheckpoint::ReadRecord(const Source& src, std::span<std::byte> record) const {
  const Quantized& q = *src.quantized;
  const ops::Quant4Layout& l = q.layout;
  std::fill(record.begin(), record.end(), std::byte{0});
  STRATA_RETURN_IF_ERROR(
      ReadStored({src.shard, src.tensor}, 0, record.subspan(l.codes_offset, l.codes_bytes)));
  STRATA_RETURN_IF_ERROR(ReadStored(q.absmax, 0, record.subspan(l.absmax_offset, l.absmax_bytes)));
  if (l.params.double_quant) {
    STRATA_RETURN_IF_ERROR(ReadStored(
        q.nested_absmax, 0, record.subspan(l.nested_absmax_offset, l.nested_absmax_bytes)));
    std::memcpy(record.data() + l.offset_offset, &q.nested_offset, sizeof(float));
  }
  return Status::Ok();
}

bool HfCheckpoint::HoldsQuantized(int block, int64_t chunk_offset) const {
  if (block < 0 || block >= num_blocks()) return false;
  for (const Source& s : blocks_[block]) {
    if (s.layout.chunk_offset == chunk_offset) return s.quantized.has_value();
  }
  return false;
}

Status HfCheckpoint::ReadQuantizedTensor(int block, int64_t chunk_offset,
                                         const ops::Quant4Layout& layout,
                                         std::span<std::byte> record) const {
  if (block < 0 || block >= num_blocks()) {
    return InvalidArgumentError(
        fmt::format("{}: block {} out of range [0, {})", dir_, block, num_blocks()));
  }
  const Source* src = nullptr;
  for (const Source& s : blocks_[block]) {
    if (s.layout.chunk_offset == chunk_offset) src = &s;
  }
  if (src == nullptr || !src->quantized) {
    return InvalidArgumentError(fmt::format(
        "{}: block {} has no 4-bit tensor at element {} of its chunk{}", dir_, block_names_[block],
        chunk_offset, src == nullptr ? "" : fmt::format(" ('{}' is 16-bit)", src->layout.name)));
  }
  const ops::Quant4Layout& want = src->quantized->layout;
  if (layout.n != want.n || layout.params.type != want.params.type ||
      layout.params.double_quant != want.params.double_quant ||
      layout.total_bytes != want.total_bytes) {
    return InvalidArgumentError(
        fmt::format("{}: tensor '{}' is {} values {}{}, the layout asked for {} values {}{}", dir_,
                    src->layout.name, want.n, ops::Quant4TypeName(want.params.type),
                    want.params.double_quant ? " with double quantization" : "", layout.n,
                    ops::Quant4TypeName(layout.params.type),
                    layout.params.double_quant ? " with double quantization" : ""));
  }
  if (static_cast<int64_t>(record.size()) != want.total_bytes) {
    return InvalidArgumentError(
        fmt::format("{}: tensor '{}' has a record of {} bytes, the buffer {}", dir_,
                    src->layout.name, want.total_bytes, record.size()));
  }
  return ReadRecord(*src, record);
}

}  // namespace strata::models
