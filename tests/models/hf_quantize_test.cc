// Writing bitsandbytes 4-bit directories (models/hf_quantize.h, `strata quantize`): a tiny
// directory written by the test, quantized, then read back by HfCheckpoint -- each projection's
// record equal to ops::Quantize4bit of its values rounded to the 16-bit type, the other tensors
// equal to the input, config.json and the copied files as documented -- and every refusal,
// with nothing left behind.
#include "models/hf_quantize.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "models/hf_bnb.h"
#include "tests/models/hf_test_dir.h"

namespace strata::models {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using namespace testing;  // NOLINT: the test-directory helpers

namespace fs = std::filesystem;

void ExpectOneLineError(const Status& s, StatusCode code, const std::vector<std::string>& parts) {
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), code) << s.ToString();
  EXPECT_THAT(s.message(), Not(HasSubstr("\n")));
  for (const std::string& p : parts) EXPECT_THAT(s.message(), HasSubstr(p));
}

// Entries of `dir` (names), for checking that a refused write left nothing behind.
std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

float Rounded(float v, const std::string& dtype) {
  return dtype == "F16" ? HalfToFloat(FloatToHalf(v)) : Bf16ToFloat(FloatToBf16(v));
}

// Quantizes `in` (a model directory of `tensors`) into out and checks what OUT holds.
void QuantizeAndCheck(const std::string& in_dir, const std::string& out_dir,
                      const std::vector<TestTensor>& tensors, ops::Quant4Params params,
                      uint64_t max_shard_bytes = 5'000'000'000) {
  auto in = HfCheckpoint::Open(in_dir);
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  auto summary = WriteQuantizedHfDirectory(**in, out_dir, {params, max_shard_bytes});
  ASSERT_TRUE(summary.ok()) << summary.status().ToString();
  auto out = HfCheckpoint::Open(out_dir);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_TRUE((*out)->base_quant().has_value());
  EXPECT_EQ((*out)->base_quant()->type, params.type);
  EXPECT_EQ((*out)->base_quant()->double_quant, params.double_quant);
  const HfModelConfig& config = (*out)->config();
  int64_t quantized = 0, kept = 0;
  for (int b = 0; b < (*out)->num_blocks(); ++b) {
    std::vector<float> chunk((*out)->block_num_params(b));
    ASSERT_TRUE((*out)->ReadBlock(b, chunk).ok());
    const std::vector<float> original = ExpectedChunk(tensors, b);
    const std::vector<formats::TensorDType> dtypes = (*out)->block_dtypes(b);
    const std::vector<HfTensor> layout = HfBlockTensors(config, b);
    for (size_t i = 0; i < layout.size(); ++i) {
      const HfTensor& t = layout[i];
      const TestTensor* src = nullptr;
      for (const TestTensor& x : tensors) {
        if (x.name == t.name) src = &x;
      }
      ASSERT_NE(src, nullptr) << t.name;
      if (!HfBaseQuantized(config, b, t)) {
        ++kept;
        EXPECT_EQ(formats::SafetensorsDTypeName(dtypes[i]), src->dtype) << t.name;
        EXPECT_EQ(std::memcmp(chunk.data() + t.chunk_offset, original.data() + t.chunk_offset,
                              4 * t.num_elems),
                  0)
            << t.name;
        continue;
      }
      ++quantized;
      // The record as the op makes it from the values rounded to the 16-bit type.
      std::vector<float> rounded(src->values.size());
      for (size_t k = 0; k < rounded.size(); ++k) rounded[k] = Rounded(src->values[k], src->dtype);
      const ops::Quant4Layout l = ops::MakeQuant4Layout(t.num_elems, params);
      std::vector<std::byte> want(l.total_bytes), got(l.total_bytes);
      ops::Quantize4bit(l, rounded.data(), want.data());
      ASSERT_TRUE((*out)->ReadQuantizedTensor(b, t.chunk_offset, l, got).ok()) << t.name;
      EXPECT_EQ(got, want) << t.name;
      // Read back as bitsandbytes dequantizes it: to the quant_state's dtype, the 16-bit type.
      ops::Quant4Layout read = l;
      read.params.dtype = src->dtype == "F16" ? DType::kF16 : DType::kBF16;
      EXPECT_EQ((*out)->base_quant()->dtype, read.params.dtype);
      std::vector<float> dequantized(t.num_elems);
      ops::Dequantize4bit<float>(read, want.data(), dequantized.data());
      EXPECT_EQ(std::memcmp(chunk.data() + t.chunk_offset, dequantized.data(), 4 * t.num_elems), 0)
          << t.name;
    }
  }
  EXPECT_EQ(summary->tensors_quantized, quantized);
  EXPECT_EQ(summary->tensors_kept, kept);
  EXPECT_GT(quantized, 0);
}

TEST(HfQuantize, WritesANf4DoubleQuantDirectoryThatReadsBackAsTheOpQuantizedIt) {
  TempDir tmp;
  LlamaTestShape s;
  s.C = 17;  // odd sizes: partial blocks, a half-used last byte
  s.I = 23;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "BF16", 1);
  const std::string in = tmp.path() + "/in", out = tmp.path() + "/out";
  WriteModelDir(in, LlamaConfigText(s, R"(, "torch_dtype": "bfloat16", "my_key": [1, 2])"),
                tensors);
  WriteFile(in + "/tokenizer.json", "{\"t\": 1}");
  WriteFile(in + "/chat_template.jinja", "{{ messages }}");
  QuantizeAndCheck(in, out, tensors, {ops::Quant4Type::kNf4, true});
  EXPECT_EQ(Entries(out), (std::vector<std::string>{"chat_template.jinja", "config.json",
                                                    "model.safetensors", "tokenizer.json"}));
  EXPECT_EQ(ReadFileBytes(out + "/tokenizer.json"), "{\"t\": 1}");
  // config.json: the input's keys in their order, the quantization_config last.
  const auto config = nlohmann::ordered_json::parse(ReadFileBytes(out + "/config.json"));
  EXPECT_EQ(config["my_key"], nlohmann::ordered_json::parse("[1, 2]"));
  EXPECT_EQ(config.begin().key(), "architectures");
  EXPECT_EQ((--config.end()).key(), "quantization_config");
  const auto& qc = config["quantization_config"];
  EXPECT_EQ(qc["quant_method"], "bitsandbytes");
  EXPECT_EQ(qc["load_in_4bit"], true);
  EXPECT_EQ(qc["_load_in_4bit"], true);
  EXPECT_EQ(qc["bnb_4bit_quant_type"], "nf4");
  EXPECT_EQ(qc["bnb_4bit_use_double_quant"], true);
  EXPECT_EQ(qc["bnb_4bit_compute_dtype"], "bfloat16");
}

TEST(HfQuantize, RoundsFp32ToBf16AndKeepsFp16AsItIs) {
  for (const std::string dtype : {"F32", "F16"}) {
    SCOPED_TRACE(dtype);
    TempDir tmp;
    LlamaTestShape s;
    s.tied = true;
    auto tensors = LlamaTestTensors(s);
    FillRandom(tensors, dtype, 2);
    const std::string in = tmp.path() + "/in", out = tmp.path() + "/out";
    WriteModelDir(in, LlamaConfigText(s), tensors, /*num_shards=*/2);
    QuantizeAndCheck(in, out, tensors, {ops::Quant4Type::kFp4, false});
    // The quant_state says which 16-bit type the values were rounded to.
    auto ck = formats::OpenSafetensorsFile(out + "/model.safetensors");
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    const auto* state =
        ck->header.Find("model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__fp4");
    ASSERT_NE(state, nullptr);
    std::string text(state->num_elems, '\0');
    ASSERT_TRUE(formats::ReadTensorBytes(
                    *ck, *state, 0, std::as_writable_bytes(std::span(text.data(), text.size())))
                    .ok());
    EXPECT_EQ(text, fmt::format(R"({{"quant_type": "fp4", "blocksize": 64, "dtype": "{}", )"
                                R"("shape": [{}, {}]}})",
                                dtype == "F16" ? "float16" : "bfloat16", s.I, s.C));
  }
}

TEST(HfQuantize, ShardsKeepEachWeightsPartsTogetherWithAnIndex) {
  TempDir tmp;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "BF16", 3);
  const std::string in = tmp.path() + "/in", out = tmp.path() + "/out";
  WriteModelDir(in, LlamaConfigText(s), tensors);
  QuantizeAndCheck(in, out, tensors, {ops::Quant4Type::kNf4, true}, /*max_shard_bytes=*/1500);
  const auto index = nlohmann::json::parse(ReadFileBytes(out + "/model.safetensors.index.json"));
  const auto& map = index["weight_map"];
  EXPECT_GT(std::set<std::string>(map.begin(), map.end()).size(), 3u);
  for (const auto& [name, shard] : map.items()) {
    const auto dot = name.find(".weight.");
    if (dot == std::string::npos) continue;
    EXPECT_EQ(shard, map[name.substr(0, dot + 7)]) << name;  // a part beside its codes
  }
}

TEST(HfQuantize, RefusesAnExistingOutputAQuantizedInputGpt2AndNonFiniteValues) {
  TempDir tmp;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "BF16", 4);
  const std::string in = tmp.path() + "/in", out = tmp.path() + "/out";
  WriteModelDir(in, LlamaConfigText(s), tensors);
  auto ck = HfCheckpoint::Open(in);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const ops::Quant4Params nf4{ops::Quant4Type::kNf4, true};

  fs::create_directories(out);
  WriteFile(out + "/keep", "x");
  ExpectOneLineError(WriteQuantizedHfDirectory(**ck, out, {nf4}).status(),
                     StatusCode::kAlreadyExists, {out, "not an empty directory"});
  EXPECT_EQ(Entries(out), std::vector<std::string>{"keep"});
  fs::remove_all(out);

  ASSERT_TRUE(WriteQuantizedHfDirectory(**ck, out, {nf4}).ok());
  auto quantized = HfCheckpoint::Open(out);
  ASSERT_TRUE(quantized.ok()) << quantized.status().ToString();
  ExpectOneLineError(WriteQuantizedHfDirectory(**quantized, tmp.path() + "/again", {nf4}).status(),
                     StatusCode::kInvalidArgument, {out, "already a 4-bit directory"});

  Gpt2TestShape g;
  auto gpt = Gpt2TestTensors(g);
  FillRandom(gpt, "F32", 5);
  WriteModelDir(tmp.path() + "/gpt2", Gpt2ConfigText(g), gpt);
  auto gck = HfCheckpoint::Open(tmp.path() + "/gpt2");
  ASSERT_TRUE(gck.ok());
  ExpectOneLineError(WriteQuantizedHfDirectory(**gck, tmp.path() + "/g4", {nf4}).status(),
                     StatusCode::kInvalidArgument, {"gpt2 (GPT2LMHeadModel)"});

  for (TestTensor& t : tensors) {
    if (t.name == "model.layers.1.mlp.up_proj.weight") t.values[7] = INFINITY;
  }
  WriteModelDir(tmp.path() + "/inf", LlamaConfigText(s), tensors);
  auto ick = HfCheckpoint::Open(tmp.path() + "/inf");
  ASSERT_TRUE(ick.ok());
  ExpectOneLineError(WriteQuantizedHfDirectory(**ick, tmp.path() + "/inf4", {nf4}).status(),
                     StatusCode::kInvalidArgument,
                     {"model.layers.1.mlp.up_proj.weight", "not finite", "element 7"});
  // A finite fp32 value past bf16's range is inf once rounded to the type it is quantized from:
  // refused too (it was quantized as an infinite block scale).
  for (TestTensor& t : tensors) {
    if (t.name != "model.layers.1.mlp.up_proj.weight") continue;
    t.values[7] = 0.5f;
    t.values[9] = 3.4e38f;
    t.dtype = "F32";
  }
  WriteModelDir(tmp.path() + "/big", LlamaConfigText(s), tensors);
  auto bck = HfCheckpoint::Open(tmp.path() + "/big");
  ASSERT_TRUE(bck.ok()) << bck.status().ToString();
  ExpectOneLineError(WriteQuantizedHfDirectory(**bck, tmp.path() + "/big4", {nf4}).status(),
                     StatusCode::kInvalidArgument,
                     {"model.layers.1.mlp.up_proj.weight", "not finite in bf16", "element 9"});
  // Nothing half-written: no output, no temporary directory beside it.
  EXPECT_EQ(Entries(tmp.path()), (std::vector<std::string>{"big", "gpt2", "in", "inf", "out"}));
}

}  // namespace
}  // namespace strata::models
