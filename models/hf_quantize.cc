#include "models/hf_quantize.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "base/file.h"
#include "base/untrusted_text.h"
#include "cpu_optim/grad_stats.h"
#include "formats/safetensors.h"
#include "models/hf_bnb.h"
#include "models/hf_export.h"

namespace strata::models {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kPieceElems = int64_t{1} << 20;  // elements converted and appended per piece
constexpr uint64_t kMaxConfigBytes = 16 << 20;

// One tensor of IN and the tensors it becomes in OUT (one, or a 4-bit weight's parts in
// BnbNames order: codes, absmax, quant_map, [nested_absmax, nested_quant_map], quant_state).
struct Planned {
  int block = 0;
  HfTensor tensor;
  formats::TensorDType stored = DType::kF32;
  bool quantized = false;
  DType quantized_from = DType::kBF16;  // the 16-bit type its values are rounded to
  ops::Quant4Layout layout;
  std::vector<formats::SafetensorsWriter::TensorSpec> outputs;
  uint64_t size_bytes = 0;
  int shard = 0;
};

uint64_t SpecBytes(const formats::SafetensorsWriter::TensorSpec& spec) {
  uint64_t n = 1;
  for (int64_t d : spec.shape) n *= static_cast<uint64_t>(d);
  return n * spec.dtype.size();
}

Planned Plan(const HfModelConfig& config, int block, HfTensor tensor, formats::TensorDType stored,
             ops::Quant4Params params) {
  Planned p;
  p.block = block;
  p.stored = stored;
  p.quantized = HfBaseQuantized(config, block, tensor);
  if (!p.quantized) {
    p.outputs.push_back({tensor.name, stored, tensor.shape});
  } else {
    // bitsandbytes quantizes the tensor as loaded: fp16 stays fp16, the rest is bf16.
    p.quantized_from = stored == DType::kF16 ? DType::kF16 : DType::kBF16;
    p.layout = ops::MakeQuant4Layout(tensor.num_elems, params);
    const BnbTensorNames names = BnbNames(tensor.name, params.type);
    const auto u8 = formats::TensorDType::U8();
    const int64_t state_bytes = static_cast<int64_t>(
        BnbQuantStateJson(params, p.quantized_from, tensor.shape, 0.0f).size());
    p.outputs.push_back({names.codes, u8, {p.layout.codes_bytes, 1}});
    p.outputs.push_back({names.absmax, params.double_quant ? u8 : DType::kF32, {p.layout.blocks}});
    p.outputs.push_back({names.quant_map, DType::kF32, {16}});
    if (params.double_quant) {
      p.outputs.push_back({names.nested_absmax, DType::kF32, {p.layout.nested_blocks}});
      p.outputs.push_back({names.nested_quant_map, DType::kF32, {256}});
    }
    p.outputs.push_back({names.quant_state, u8, {state_bytes}});
  }
  for (const auto& spec : p.outputs) p.size_bytes += SpecBytes(spec);
  p.tensor = std::move(tensor);
  return p;
}

// The parts of a 4-bit weight, appended in Plan's order.
class QuantizedTensorWriter {
 public:
  explicit QuantizedTensorWriter(ops::Quant4Params params) : params_(params) {}

  // Rounds `values` (p.tensor.num_elems) to p.quantized_from, quantizes and appends every part.
  Status Append(const Planned& p, const float* values, formats::SafetensorsWriter& writer) {
    const ops::Quant4Layout& l = p.layout;
    rounded_.resize(static_cast<size_t>(l.n));
    for (int64_t i = 0; i < l.n; ++i) {
      const float v = values[i];
      rounded_[i] = p.quantized_from == DType::kF16 ? HalfToFloat(FloatToHalf(v))
                                                    : Bf16ToFloat(FloatToBf16(v));
      // Checked after the rounding: a finite value past the 16-bit type's range becomes inf.
      if (!std::isfinite(rounded_[i])) {
        return InvalidArgumentError(fmt::format(
            "tensor '{}' holds a value that is not finite in {} ({}) at element {}: its 4-bit "
            "block scale would not be finite",
            p.tensor.name, DTypeName(p.quantized_from), v, i));
      }
    }
    record_.assign(static_cast<size_t>(l.total_bytes), std::byte{0});
    ops::Quantize4bit(l, rounded_.data(), record_.data());
    const std::span<const std::byte> record(record_);
    STRATA_RETURN_IF_ERROR(writer.Append(record.subspan(l.codes_offset, l.codes_bytes)));
    STRATA_RETURN_IF_ERROR(writer.Append(record.subspan(l.absmax_offset, l.absmax_bytes)));
    STRATA_RETURN_IF_ERROR(writer.Append(std::as_bytes(ops::Quant4Map(params_.type))));
    float offset = 0;
    if (params_.double_quant) {
      STRATA_RETURN_IF_ERROR(
          writer.Append(record.subspan(l.nested_absmax_offset, l.nested_absmax_bytes)));
      STRATA_RETURN_IF_ERROR(writer.Append(std::as_bytes(ops::DynamicMap8())));
      std::memcpy(&offset, record_.data() + l.offset_offset, sizeof offset);
      if (!std::isfinite(offset) || offset < 0) {
        return InvalidArgumentError(fmt::format(
            "tensor '{}': the mean of its block scales is {} (values too large for fp32 sums)",
            p.tensor.name, offset));
      }
    }
    const std::string state = BnbQuantStateJson(params_, p.quantized_from, p.tensor.shape, offset);
    if (static_cast<int64_t>(state.size()) != p.outputs.back().shape[0]) {
      return InternalError(fmt::format("tensor '{}': quant_state of {} bytes, planned {}",
                                       p.tensor.name, state.size(), p.outputs.back().shape[0]));
    }
    return writer.Append(std::as_bytes(std::span(state.data(), state.size())));
  }

 private:
  ops::Quant4Params params_;
  std::vector<float> rounded_;
  std::vector<std::byte> record_;
};

// config.json: IN's text, key order kept, with the quantization_config.
StatusOr<std::string> QuantizedConfigJson(const std::string& in_dir, ops::Quant4Params params,
                                          DType compute_dtype) {
  const std::string path = in_dir + "/config.json";
  STRATA_ASSIGN_OR_RETURN(const std::string text,
                          ReadSmallFile(path, {.max_bytes = kMaxConfigBytes}));
  auto parsed = ParseOrderedJsonBounded(text);
  if (!parsed.ok()) return parsed.status().WithContext(path);
  if (!parsed->is_object()) return InvalidArgumentError(fmt::format("{}: not a JSON object", path));
  (*parsed)["quantization_config"] = BnbQuantizationConfigJson(params, compute_dtype);
  return parsed->dump(2) + "\n";
}

Status WriteInto(const std::string& tmp, const HfCheckpoint& in, std::vector<Planned>& plan,
                 int num_shards, ops::Quant4Params params, const std::string& config_text,
                 int64_t max_block) {
  auto shard_name = [num_shards](int shard) { return HfShardFileName(shard, num_shards); };
  auto create_shard = [&](int shard) -> StatusOr<formats::SafetensorsWriter> {
    std::vector<formats::SafetensorsWriter::TensorSpec> specs;
    for (const Planned& p : plan) {
      if (p.shard == shard) specs.insert(specs.end(), p.outputs.begin(), p.outputs.end());
    }
    return formats::SafetensorsWriter::Create(tmp + "/" + shard_name(shard), std::move(specs),
                                              {{"format", "pt"}});
  };
  auto finish_shard = [&](formats::SafetensorsWriter& w, int shard) {
    return FinishHfShard(w, tmp + "/" + shard_name(shard));
  };

  // One block in memory at a time; each tensor converted or quantized as it is appended.
  std::vector<float> chunk(static_cast<size_t>(max_block));
  std::vector<std::byte> staging;
  QuantizedTensorWriter quantized(params);
  std::optional<formats::SafetensorsWriter> writer;
  int current = -1;
  size_t next = 0;
  for (int b = 0; b < in.num_blocks(); ++b) {
    const std::span<float> block(chunk.data(), static_cast<size_t>(in.block_num_params(b)));
    STRATA_RETURN_IF_ERROR(in.ReadBlock(b, block));
    for (; next < plan.size() && plan[next].block == b; ++next) {
      const Planned& p = plan[next];
      if (p.shard != current) {
        if (writer) STRATA_RETURN_IF_ERROR(finish_shard(*writer, current));
        current = p.shard;
        STRATA_ASSIGN_OR_RETURN(auto w, create_shard(current));
        writer.emplace(std::move(w));
      }
      const float* src = block.data() + p.tensor.chunk_offset;
      if (p.quantized) {
        STRATA_RETURN_IF_ERROR(quantized.Append(p, src, *writer));
        continue;
      }
      // Llama-family chunks hold every tensor as stored (no transposes): convert back in pieces.
      const DType dtype = p.stored.dtype();
      for (int64_t e = 0; e < p.tensor.num_elems; e += kPieceElems) {
        const int64_t count = std::min(kPieceElems, p.tensor.num_elems - e);
        staging.resize(static_cast<size_t>(count) * SizeOf(dtype));
        STRATA_RETURN_IF_ERROR(cpu_optim::ConvertFromF32(src + e, staging.data(), dtype, count));
        STRATA_RETURN_IF_ERROR(writer->Append(staging));
      }
    }
  }
  if (writer) STRATA_RETURN_IF_ERROR(finish_shard(*writer, current));

  if (num_shards > 1) {
    uint64_t total = 0;
    nlohmann::ordered_json index = {{"metadata", nlohmann::ordered_json::object()},
                                    {"weight_map", nlohmann::ordered_json::object()}};
    for (const Planned& p : plan) {
      total += p.size_bytes;
      for (const auto& spec : p.outputs) index["weight_map"][spec.name] = shard_name(p.shard);
    }
    index["metadata"]["total_size"] = total;
    STRATA_RETURN_IF_ERROR(
        WriteNewFile(tmp + "/model.safetensors.index.json", index.dump(2) + "\n", 0644));
  }
  STRATA_RETURN_IF_ERROR(WriteNewFile(tmp + "/config.json", config_text, 0644));
  for (const std::string& from : in.companion_files()) {
    STRATA_RETURN_IF_ERROR(
        CopyNewFile(from, tmp + "/" + fs::path(from).filename().string(), "model file"));
  }
  return FsyncDirectory(tmp);
}

}  // namespace

StatusOr<QuantizeHfSummary> WriteQuantizedHfDirectory(const HfCheckpoint& in,
                                                      const std::string& out_dir,
                                                      const QuantizeHfOptions& options) {
  const HfModelConfig& config = in.config();
  if (const auto q = in.base_quant()) {
    return InvalidArgumentError(fmt::format(
        "{}: already a 4-bit directory (config.json's quantization_config: bitsandbytes {}{})",
        in.dir(), ops::Quant4TypeName(q->type), q->double_quant ? ", double quantization" : ""));
  }
  STRATA_RETURN_IF_ERROR(CheckHfBaseQuantizable(config).WithContext(in.dir()));
  if (config.gemma3_multimodal) {
    return InvalidArgumentError(fmt::format(
        "{}: a Gemma 3 multimodal directory (model_type gemma3): quantizing it would drop its "
        "vision tower; quantize a gemma3_text directory of its language model",
        in.dir()));
  }
  if (options.max_shard_bytes == 0) return InvalidArgumentError("max_shard_bytes must be positive");

  QuantizeHfSummary summary;
  std::vector<Planned> plan;
  int64_t max_block = 0;
  uint64_t shard_bytes = 0;
  bool first_quantized = true;
  for (int b = 0; b < in.num_blocks(); ++b) {
    max_block = std::max(max_block, in.block_num_params(b));
    const std::vector<formats::TensorDType> dtypes = in.block_dtypes(b);
    std::vector<HfTensor> tensors = HfBlockTensors(config, b);
    for (size_t i = 0; i < tensors.size(); ++i) {
      summary.bytes_before += static_cast<uint64_t>(tensors[i].num_elems) * dtypes[i].size();
      Planned p = Plan(config, b, std::move(tensors[i]), dtypes[i], options.params);
      if (summary.num_shards == 0 ||
          (shard_bytes > 0 && shard_bytes + p.size_bytes > options.max_shard_bytes)) {
        ++summary.num_shards;
        shard_bytes = 0;
      }
      p.shard = summary.num_shards - 1;
      shard_bytes += p.size_bytes;
      summary.bytes_after += p.size_bytes;
      if (p.quantized) {
        ++summary.tensors_quantized;
        if (first_quantized) summary.quantized_from = p.quantized_from;
        first_quantized = false;
      } else {
        ++summary.tensors_kept;
      }
      plan.push_back(std::move(p));
    }
  }
  STRATA_ASSIGN_OR_RETURN(const std::string config_text,
                          QuantizedConfigJson(in.dir(), options.params, summary.quantized_from));
  STRATA_RETURN_IF_ERROR(
      WriteDirectoryAtomically(out_dir, "export of 4-bit weights", [&](const std::string& tmp) {
        return WriteInto(tmp, in, plan, summary.num_shards, options.params, config_text, max_block);
      }));
  return summary;
}

}  // namespace strata::models
