// Fuzzes what a bitsandbytes 4-bit directory brings as text (models/hf_bnb.h): the first byte
// picks the parser, the rest is its input.
//   even: a weight's quant_state JSON (the bytes of its U8 tensor), ParseBnbQuantState, for a
//         (64, 48) weight, nf4 with double quantization when bit 1 of the byte is set, else fp4;
//   odd:  config.json's quantization_config, ParseBnbQuantizationConfig and BnbSkipModules of the
//         parsed text.
// Any bytes give a result in range (a 16-bit or fp32 dtype and a finite offset; nf4 or fp4) or a
// one-line error naming the file, never a crash or a sanitizer report.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "base/untrusted_text.h"
#include "models/hf_bnb.h"
#include "tests/fuzz/one_line_message.h"

namespace {

void CheckError(const strata::Status& s, std::string_view path) {
  const std::string& m = s.message();
  if (!strata::fuzz::IsOneCleanLine(m, path)) {
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using strata::models::ops::Quant4Params;
  using strata::models::ops::Quant4Type;
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    const Quant4Params params = (data[0] & 2) ? Quant4Params{Quant4Type::kNf4, true}
                                              : Quant4Params{Quant4Type::kFp4, false};
    const std::vector<int64_t> shape = {64, 48};
    auto state = strata::models::ParseBnbQuantState(text, shape, params, "fuzz/model.safetensors",
                                                    "w.weight");
    if (!state.ok()) {
      CheckError(state.status(), "fuzz/model.safetensors");
      return 0;
    }
    const strata::DType d = state->dtype;
    if (d != strata::DType::kF32 && d != strata::DType::kF16 && d != strata::DType::kBF16) {
      std::abort();
    }
    if (!std::isfinite(state->nested_offset)) std::abort();
    if (!params.double_quant && state->nested_offset != 0) std::abort();
    return 0;
  }
  auto json = strata::ParseJsonBounded(text);
  if (!json.ok()) return 0;  // the JSON parser has its own target (hf_config_json_fuzz)
  auto config = strata::models::ParseBnbQuantizationConfig(*json, "fuzz/config.json");
  if (!config.ok()) {
    CheckError(config.status(), "fuzz/config.json");
    return 0;
  }
  if (*config && (*config)->type != Quant4Type::kNf4 && (*config)->type != Quant4Type::kFp4) {
    std::abort();
  }
  // Its llm_int8_skip_modules: a list of names, or one line naming the file.
  auto skip = strata::models::BnbSkipModules(*json, "fuzz/config.json");
  if (!skip.ok()) CheckError(skip.status(), "fuzz/config.json");
  return 0;
}
