// bitsandbytes' 4-bit Hugging Face directories (QLoRA's frozen base, issue 45): the
// quantization_config that transformers' BitsAndBytesConfig(load_in_4bit=True, ...) writes into
// config.json (transformers/utils/quantization_config.py BitsAndBytesConfig.to_dict), and the
// tensors that transformers' save_pretrained stores for each 4-bit weight X.weight
// (bitsandbytes/nn/modules.py Linear4bit._save_to_state_dict: the weight, then
// functional.py QuantState.as_dict(packed=True) under "X.weight."):
//
//   X.weight                                U8 [ceil(n/2), 1]  the packed codes, two per byte
//   X.weight.absmax                         U8 [blocks] with double quantization, else F32 [blocks]
//   X.weight.quant_map                      F32 [16]           ops::Quant4Map(type)
//   X.weight.nested_absmax                  F32 [nested_blocks]  } double quantization only
//   X.weight.nested_quant_map               F32 [256]          } ops::DynamicMap8()
//   X.weight.quant_state.bitsandbytes__nf4  U8 [bytes]: UTF-8 JSON (utils.py pack_dict_to_tensor)
//       {"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [out, in],
//        "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.0123}
//       (the nested_* keys with double quantization only; "__fp4" and "fp4" for fp4)
//
// n = out * in values quantized in row-major order (models/ops/quantize_4bit.h). Which tensors
// are stored this way is HfBaseQuantized's rule (models/hf_config.h). Only what bitsandbytes'
// defaults produce is read: blocksize 64, nested_blocksize 256, uint8 storage; anything else is
// refused by name. The JSON is parsed with base/untrusted_text.h's bounded parser.
//
// Every error is ONE line naming the file and the tensor or field, code kInvalidArgument. Pure
// functions; thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "formats/safetensors.h"
#include "models/ops/quantize_4bit.h"

namespace strata::models {

// config.json's quantization_config (`config` is the parsed file, `path` names it): nullopt when
// absent or null; the 4-bit parameters for quant_method "bitsandbytes" with load_in_4bit true
// (bnb_4bit_quant_type nf4|fp4, default fp4 as transformers'; bnb_4bit_use_double_quant,
// default false). Refused: load_in_8bit (LLM.int8 is not supported), load_in_4bit false, another
// quant_method, a bnb_4bit_quant_storage other than uint8.
StatusOr<std::optional<ops::Quant4Params>> ParseBnbQuantizationConfig(const nlohmann::json& config,
                                                                      const std::string& path);

// quantization_config.llm_int8_skip_modules of a bitsandbytes config (`config` as above): the
// modules transformers leaves in 16 bits (nn.Linear) when it loads the directory, whose weights
// the directory then stores as plain 16-bit tensors (Unsloth's dynamic 4-bit directories keep
// some layers' projections so). Empty when absent or null. Errors: kInvalidArgument naming the
// file and field for anything but a list of strings.
StatusOr<std::vector<std::string>> BnbSkipModules(const nlohmann::json& config,
                                                  const std::string& path);

// The quantization_config transformers writes for BitsAndBytesConfig(load_in_4bit=True,
// bnb_4bit_quant_type, bnb_4bit_use_double_quant, bnb_4bit_compute_dtype=compute_dtype): every
// key of BitsAndBytesConfig.to_dict, with transformers' defaults for the rest.
nlohmann::ordered_json BnbQuantizationConfigJson(ops::Quant4Params params, DType compute_dtype);

// The names of the tensors that store the 4-bit weight `weight_name` ("X.weight").
struct BnbTensorNames {
  std::string codes;  // X.weight itself
  std::string absmax, quant_map, nested_absmax, nested_quant_map;
  std::string quant_state;  // X.weight.quant_state.bitsandbytes__{nf4,fp4}
};
BnbTensorNames BnbNames(std::string_view weight_name, ops::Quant4Type type);

// A stored part found in a directory: the tensor's header and the file it is in; tensor nullptr
// when the directory has no such tensor.
struct BnbPart {
  const formats::SafetensorsTensor* tensor = nullptr;
  std::string path;
};
struct BnbParts {
  BnbPart codes, absmax, quant_map, nested_absmax, nested_quant_map, quant_state;
};
// The largest quant_state JSON accepted, in bytes (bitsandbytes writes ~200).
inline constexpr int64_t kMaxBnbQuantStateBytes = 4096;

// Checks the headers of one 4-bit weight's parts against its layout (ops::MakeQuant4Layout of
// its out * in values and the directory's parameters): each present with bitsandbytes' dtype and
// shape, the nested parts present exactly with double quantization, the quant_state of 2 to
// kMaxBnbQuantStateBytes bytes. `stored_shape` is the weight's (out, in).
Status CheckBnbParts(const BnbParts& parts, const BnbTensorNames& names,
                     const std::vector<int64_t>& stored_shape, const ops::Quant4Layout& layout);

// The stored quant_map (16 values) equals ops::Quant4Map(type), value for value.
Status CheckBnbQuantMap(std::span<const float> values, ops::Quant4Type type,
                        const std::string& path, const std::string& name);
// The stored nested_quant_map (256 values) equals ops::DynamicMap8().
Status CheckBnbNestedQuantMap(std::span<const float> values, const std::string& path,
                              const std::string& name);

// What a quant_state JSON holds beyond what CheckBnbQuantState compares.
struct BnbQuantState {
  DType dtype = DType::kBF16;  // the 16-bit (or fp32) type bitsandbytes dequantizes to
  float nested_offset = 0;     // double quantization: the mean subtracted from the absmax values
};
// Parses and checks a quant_state JSON (`text`, the U8 tensor's bytes): an object with only
// bitsandbytes' keys; quant_type equal to params.type, blocksize 64, dtype float32, float16 or
// bfloat16, shape equal to stored_shape; with params.double_quant nested_blocksize 256,
// nested_dtype float32 and a finite nested_offset, without it none of the nested keys.
StatusOr<BnbQuantState> ParseBnbQuantState(std::string_view text,
                                           const std::vector<int64_t>& stored_shape,
                                           ops::Quant4Params params, const std::string& path,
                                           const std::string& name);

// The quant_state JSON bitsandbytes writes (json.dumps of QuantState.as_dict's non-tensor
// items, in its key order and separators) for a weight of `stored_shape` quantized from `dtype`
// values; nested_offset (finite: STRATA_CHECK) is written with double quantization only, as the
// double bitsandbytes writes (offset.item()) in 17 significant digits ("1.2345678918063641e-02":
// the value of its repr, in a width that does not depend on the value, so that a writer knows
// the tensor's size before it quantizes).
std::string BnbQuantStateJson(ops::Quant4Params params, DType dtype,
                              const std::vector<int64_t>& stored_shape, float nested_offset);

}  // namespace strata::models
