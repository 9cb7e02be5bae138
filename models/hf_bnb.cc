#include "models/hf_bnb.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstring>

#include "base/untrusted_text.h"

namespace strata::models {
namespace {

using json = nlohmann::json;

// bitsandbytes' blocksize (quantize_4bit's default) and nested blocksize (compress_statistics:
// quantize_blockwise(blocksize=256)), the only ones the ops implement.
static_assert(ops::kQuant4BlockSize == 64 && ops::kQuant4NestedBlockSize == 256);

std::string ShapeString(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// torch's dtype names as bitsandbytes writes them (str(torch.bfloat16).strip("torch.")).
std::string_view TorchName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
  }
  return "float32";
}

std::optional<DType> FromTorchName(std::string_view name) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    if (TorchName(d) == name) return d;
  }
  return std::nullopt;
}

class QuantConfigFields {
 public:
  QuantConfigFields(const json& j, const std::string& path) : j_(j), path_(path) {}
  Status Error(std::string_view key, std::string_view what) const {
    return InvalidArgumentError(
        fmt::format("{}: field 'quantization_config.{}' {}", path_, key, what));
  }
  const json* Find(std::string_view key) const {
    const auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  // The bool at `key` (or at its transformers-internal "_key" twin), `fallback` when absent.
  StatusOr<bool> Bool(std::string_view key, bool fallback) const {
    const json* v = Find(key);
    if (v == nullptr) v = Find(fmt::format("_{}", key));
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) {
      return Error(key, fmt::format("must be true or false, got {}", JsonExcerpt(*v)));
    }
    return v->get<bool>();
  }
  StatusOr<std::string> String(std::string_view key, std::string fallback) const {
    const json* v = Find(key);
    if (v == nullptr) return fallback;
    if (!v->is_string())
      return Error(key, fmt::format("must be a string, got {}", JsonExcerpt(*v)));
    return v->get<std::string>();
  }

 private:
  const json& j_;
  const std::string& path_;
};

// quant_state's keys (bitsandbytes functional.py QuantState.valid_qs_keys, the non-tensor ones).
constexpr std::string_view kQuantStateKeys[] = {"quant_type",   "blocksize",        "dtype",
                                                "shape",        "nested_blocksize", "nested_dtype",
                                                "nested_offset"};

}  // namespace

StatusOr<std::optional<ops::Quant4Params>> ParseBnbQuantizationConfig(const nlohmann::json& config,
                                                                      const std::string& path) {
  const auto it = config.find("quantization_config");
  if (it == config.end() || it->is_null()) return std::optional<ops::Quant4Params>();
  if (!it->is_object()) {
    return InvalidArgumentError(fmt::format(
        "{}: field 'quantization_config' must be an object, got {}", path, JsonExcerpt(*it)));
  }
  const QuantConfigFields f(*it, path);
  // transformers' AutoQuantizationConfig takes a config without quant_method but with
  // load_in_4bit / load_in_8bit as bitsandbytes'.
  const bool has_load_flag = f.Find("load_in_4bit") || f.Find("_load_in_4bit") ||
                             f.Find("load_in_8bit") || f.Find("_load_in_8bit");
  STRATA_ASSIGN_OR_RETURN(const std::string method,
                          f.String("quant_method", has_load_flag ? "bitsandbytes" : ""));
  if (method != "bitsandbytes") {
    return f.Error("quant_method",
                   method.empty()
                       ? std::string("is missing")
                       : fmt::format("'{}' is not supported (Strata reads bitsandbytes 4-bit "
                                     "directories: quant_method \"bitsandbytes\", load_in_4bit)",
                                     Excerpt(method)));
  }
  STRATA_ASSIGN_OR_RETURN(const bool load_8bit, f.Bool("load_in_8bit", false));
  if (load_8bit) {
    return f.Error("load_in_8bit",
                   "is true: 8-bit bitsandbytes weights (LLM.int8) are not supported; a 4-bit "
                   "directory (load_in_4bit, nf4 or fp4) is");
  }
  STRATA_ASSIGN_OR_RETURN(const bool load_4bit, f.Bool("load_in_4bit", false));
  if (!load_4bit) {
    return f.Error("load_in_4bit", "is not true: no bitsandbytes quantization Strata reads");
  }
  ops::Quant4Params params;
  STRATA_ASSIGN_OR_RETURN(const std::string type, f.String("bnb_4bit_quant_type", "fp4"));
  auto parsed_type = ops::ParseQuant4Type(type);
  if (!parsed_type.ok()) {
    return f.Error("bnb_4bit_quant_type",
                   fmt::format("'{}' is not supported (nf4 or fp4)", Excerpt(type)));
  }
  params.type = *parsed_type;
  STRATA_ASSIGN_OR_RETURN(params.double_quant, f.Bool("bnb_4bit_use_double_quant", false));
  STRATA_ASSIGN_OR_RETURN(const std::string storage, f.String("bnb_4bit_quant_storage", "uint8"));
  if (storage != "uint8") {
    return f.Error(
        "bnb_4bit_quant_storage",
        fmt::format("'{}' is not supported (uint8, bitsandbytes' default)", Excerpt(storage)));
  }
  return std::optional<ops::Quant4Params>(params);
}

StatusOr<std::vector<std::string>> BnbSkipModules(const nlohmann::json& config,
                                                  const std::string& path) {
  std::vector<std::string> modules;
  const auto q = config.find("quantization_config");
  if (q == config.end() || !q->is_object()) return modules;
  const QuantConfigFields f(*q, path);
  const json* v = f.Find("llm_int8_skip_modules");
  if (v == nullptr) return modules;
  if (!v->is_array()) {
    return f.Error("llm_int8_skip_modules",
                   fmt::format("must be a list of module names, got {}", JsonExcerpt(*v)));
  }
  for (const json& m : *v) {
    if (!m.is_string()) {
      return f.Error("llm_int8_skip_modules",
                     fmt::format("must be a list of module names, holds {}", JsonExcerpt(m)));
    }
    modules.push_back(m.get<std::string>());
  }
  return modules;
}

nlohmann::ordered_json BnbQuantizationConfigJson(ops::Quant4Params params, DType compute_dtype) {
  // BitsAndBytesConfig.to_dict's keys; PretrainedConfig writes them sorted.
  nlohmann::ordered_json j;
  j["_load_in_4bit"] = true;
  j["_load_in_8bit"] = false;
  j["bnb_4bit_compute_dtype"] = TorchName(compute_dtype);
  j["bnb_4bit_quant_storage"] = "uint8";
  j["bnb_4bit_quant_type"] = ops::Quant4TypeName(params.type);
  j["bnb_4bit_use_double_quant"] = params.double_quant;
  j["llm_int8_enable_fp32_cpu_offload"] = false;
  j["llm_int8_has_fp16_weight"] = false;
  j["llm_int8_skip_modules"] = nullptr;
  j["llm_int8_threshold"] = 6.0;
  j["load_in_4bit"] = true;
  j["load_in_8bit"] = false;
  j["quant_method"] = "bitsandbytes";
  return j;
}

BnbTensorNames BnbNames(std::string_view weight_name, ops::Quant4Type type) {
  const std::string w(weight_name);
  return {
      .codes = w,
      .absmax = w + ".absmax",
      .quant_map = w + ".quant_map",
      .nested_absmax = w + ".nested_absmax",
      .nested_quant_map = w + ".nested_quant_map",
      .quant_state = fmt::format("{}.quant_state.bitsandbytes__{}", w, ops::Quant4TypeName(type))};
}

Status CheckBnbParts(const BnbParts& parts, const BnbTensorNames& names,
                     const std::vector<int64_t>& stored_shape, const ops::Quant4Layout& layout) {
  const bool dq = layout.params.double_quant;
  const std::string shape_text = ShapeString(stored_shape);
  // A part with the given dtype and shape; `why` says what it holds, for the message.
  auto check = [&](const BnbPart& part, const std::string& name, formats::TensorDType dtype,
                   const std::vector<int64_t>& shape, std::string_view why) -> Status {
    if (part.tensor == nullptr) {
      return InvalidArgumentError(
          fmt::format("{}: tensor '{}' is missing: the 4-bit weight '{}' {} stores {} in it",
                      part.path, name, names.codes, shape_text, why));
    }
    const formats::SafetensorsTensor& t = *part.tensor;
    if (!(t.dtype == dtype) || t.shape != shape) {
      return InvalidArgumentError(fmt::format(
          "{}: tensor '{}' is {} {}; the 4-bit weight '{}' {} needs {} {} ({})", part.path, name,
          formats::SafetensorsDTypeName(t.dtype), ShapeString(t.shape), names.codes, shape_text,
          formats::SafetensorsDTypeName(dtype), ShapeString(shape), why));
    }
    return Status::Ok();
  };
  STRATA_RETURN_IF_ERROR(check(parts.codes, names.codes, formats::TensorDType::U8(),
                               {layout.codes_bytes, 1},
                               "its packed 4-bit codes, two per byte, in uint8 storage"));
  STRATA_RETURN_IF_ERROR(check(parts.absmax, names.absmax,
                               dq ? formats::TensorDType::U8() : DType::kF32, {layout.blocks},
                               dq ? "the absmax of each block of 64, 8-bit with double quantization"
                                  : "the absmax of each block of 64"));
  STRATA_RETURN_IF_ERROR(
      check(parts.quant_map, names.quant_map, DType::kF32, {16}, "the 16 values of the codes"));
  if (dq) {
    STRATA_RETURN_IF_ERROR(check(parts.nested_absmax, names.nested_absmax, DType::kF32,
                                 {layout.nested_blocks},
                                 "the absmax of each block of 256 absmax values (double "
                                 "quantization, config.json's bnb_4bit_use_double_quant)"));
    STRATA_RETURN_IF_ERROR(check(parts.nested_quant_map, names.nested_quant_map, DType::kF32, {256},
                                 "the 256 values of the absmax codes (double quantization)"));
  } else {
    for (const auto& [part, name] : {std::pair{&parts.nested_absmax, &names.nested_absmax},
                                     std::pair{&parts.nested_quant_map, &names.nested_quant_map}}) {
      if (part->tensor != nullptr) {
        return InvalidArgumentError(
            fmt::format("{}: tensor '{}' is present but config.json's quantization_config has "
                        "bnb_4bit_use_double_quant false (config and weights disagree)",
                        part->path, *name));
      }
    }
  }
  const BnbPart& qs = parts.quant_state;
  if (qs.tensor == nullptr) {
    return InvalidArgumentError(
        fmt::format("{}: tensor '{}' is missing: the 4-bit weight '{}' {} stores its quant_state "
                    "JSON in it (bnb_4bit_quant_type {} in config.json)",
                    qs.path, names.quant_state, names.codes, shape_text,
                    ops::Quant4TypeName(layout.params.type)));
  }
  if (!qs.tensor->dtype.is_u8() || qs.tensor->shape.size() != 1 || qs.tensor->num_elems < 2 ||
      qs.tensor->num_elems > kMaxBnbQuantStateBytes) {
    return InvalidArgumentError(
        fmt::format("{}: tensor '{}' is {} {}; a quant_state is U8 [bytes] of JSON, 2 to {} bytes",
                    qs.path, names.quant_state, formats::SafetensorsDTypeName(qs.tensor->dtype),
                    ShapeString(qs.tensor->shape), kMaxBnbQuantStateBytes));
  }
  return Status::Ok();
}

Status CheckBnbQuantMap(std::span<const float> values, ops::Quant4Type type,
                        const std::string& path, const std::string& name) {
  const std::span<const float, 16> want = ops::Quant4Map(type);
  for (size_t i = 0; i < want.size(); ++i) {
    if (i >= values.size() || !(values[i] == want[i])) {
      return InvalidArgumentError(fmt::format(
          "{}: tensor '{}' is a quant_map other than bitsandbytes' {} table (value {} is {}, "
          "the table's {})",
          path, name, ops::Quant4TypeName(type), i, i < values.size() ? values[i] : NAN, want[i]));
    }
  }
  return Status::Ok();
}

Status CheckBnbNestedQuantMap(std::span<const float> values, const std::string& path,
                              const std::string& name) {
  const std::span<const float, 256> want = ops::DynamicMap8();
  for (size_t i = 0; i < want.size(); ++i) {
    if (i >= values.size() || !(values[i] == want[i])) {
      return InvalidArgumentError(fmt::format(
          "{}: tensor '{}' is a nested_quant_map other than bitsandbytes' signed dynamic 8-bit "
          "map (value {} is {}, the map's {})",
          path, name, i, i < values.size() ? values[i] : NAN, want[i]));
    }
  }
  return Status::Ok();
}

StatusOr<BnbQuantState> ParseBnbQuantState(std::string_view text,
                                           const std::vector<int64_t>& stored_shape,
                                           ops::Quant4Params params, const std::string& path,
                                           const std::string& name) {
  auto error = [&](std::string_view what) {
    return InvalidArgumentError(
        fmt::format("{}: tensor '{}' (quant_state JSON): {}", path, name, what));
  };
  auto parsed = ParseJsonBounded(text);
  if (!parsed.ok()) return error(parsed.status().message());
  const json& j = *parsed;
  if (!j.is_object()) return error(fmt::format("not a JSON object: {}", JsonExcerpt(j)));
  for (const auto& [key, value] : j.items()) {
    bool known = false;
    for (std::string_view k : kQuantStateKeys) known = known || key == k;
    if (!known) {
      return error(
          fmt::format("key '{}' is not one of bitsandbytes' quant_state keys", Excerpt(key)));
    }
  }
  auto find = [&](std::string_view key) -> const json* {
    const auto it = j.find(key);
    return it == j.end() ? nullptr : &*it;
  };
  auto need = [&](std::string_view key) -> StatusOr<const json*> {
    const json* v = find(key);
    if (v == nullptr) return error(fmt::format("key '{}' is missing", key));
    return v;
  };
  auto need_int = [&](std::string_view key, int64_t want, std::string_view what) -> Status {
    STRATA_ASSIGN_OR_RETURN(const json* v, need(key));
    if (!v->is_number_integer()) {
      return error(fmt::format("{} must be an integer, got {}", key, JsonExcerpt(*v)));
    }
    if (v->get<int64_t>() != want) {
      return error(
          fmt::format("{} {} is not supported ({} only: {})", key, JsonExcerpt(*v), want, what));
    }
    return Status::Ok();
  };
  auto need_string = [&](std::string_view key) -> StatusOr<std::string> {
    STRATA_ASSIGN_OR_RETURN(const json* v, need(key));
    if (!v->is_string()) {
      return error(fmt::format("{} must be a string, got {}", key, JsonExcerpt(*v)));
    }
    return v->get<std::string>();
  };

  STRATA_ASSIGN_OR_RETURN(const std::string type, need_string("quant_type"));
  if (type != ops::Quant4TypeName(params.type)) {
    return error(fmt::format("quant_type '{}' is not config.json's bnb_4bit_quant_type '{}'",
                             Excerpt(type), ops::Quant4TypeName(params.type)));
  }
  STRATA_RETURN_IF_ERROR(
      need_int("blocksize", ops::kQuant4BlockSize, "bitsandbytes' default for 4-bit weights"));
  BnbQuantState state;
  STRATA_ASSIGN_OR_RETURN(const std::string dtype, need_string("dtype"));
  const std::optional<DType> d = FromTorchName(dtype);
  if (!d) {
    return error(fmt::format("dtype '{}' is not float32, float16 or bfloat16", Excerpt(dtype)));
  }
  state.dtype = *d;
  STRATA_ASSIGN_OR_RETURN(const json* shape, need("shape"));
  bool shape_ok = shape->is_array() && shape->size() == stored_shape.size();
  for (size_t i = 0; shape_ok && i < stored_shape.size(); ++i) {
    shape_ok = (*shape)[i].is_number_integer() && (*shape)[i].get<int64_t>() == stored_shape[i];
  }
  if (!shape_ok) {
    return error(fmt::format("shape {} is not the weight's {} (config.json's model)",
                             JsonExcerpt(*shape), ShapeString(stored_shape)));
  }
  if (!params.double_quant) {
    for (std::string_view key : {"nested_blocksize", "nested_dtype", "nested_offset"}) {
      if (find(key) != nullptr) {
        return error(
            fmt::format("has '{}' but config.json's bnb_4bit_use_double_quant is false", key));
      }
    }
    return state;
  }
  STRATA_RETURN_IF_ERROR(need_int("nested_blocksize", ops::kQuant4NestedBlockSize,
                                  "bitsandbytes' blocksize for double quantization"));
  STRATA_ASSIGN_OR_RETURN(const std::string nested_dtype, need_string("nested_dtype"));
  if (nested_dtype != "float32") {
    return error(fmt::format("nested_dtype '{}' is not float32", Excerpt(nested_dtype)));
  }
  STRATA_ASSIGN_OR_RETURN(const json* offset, need("nested_offset"));
  if (!offset->is_number() || !std::isfinite(static_cast<float>(offset->get<double>()))) {
    return error(
        fmt::format("nested_offset must be a finite fp32 number, got {}", JsonExcerpt(*offset)));
  }
  // bitsandbytes reads it back as torch.tensor(float(x)): fp32, rounded to nearest.
  state.nested_offset = static_cast<float>(offset->get<double>());
  return state;
}

std::string BnbQuantStateJson(ops::Quant4Params params, DType dtype,
                              const std::vector<int64_t>& stored_shape, float nested_offset) {
  std::string out = fmt::format(R"({{"quant_type": "{}", "blocksize": {}, "dtype": "{}", )"
                                R"("shape": [{}])",
                                ops::Quant4TypeName(params.type), ops::kQuant4BlockSize,
                                TorchName(dtype), fmt::join(stored_shape, ", "));
  if (params.double_quant) {
    // The double bitsandbytes writes (offset.item()), in 17 significant digits: the same value
    // as its repr, in a width that does not depend on it.
    STRATA_CHECK(std::isfinite(nested_offset));
    out += fmt::format(R"(, "nested_blocksize": {}, "nested_dtype": "float32", )"
                       R"("nested_offset": {:.16e})",
                       ops::kQuant4NestedBlockSize, static_cast<double>(nested_offset));
  }
  return out + "}";
}

}  // namespace strata::models
