// Reading bitsandbytes 4-bit directories (models/hf_bnb.h, HfCheckpoint on a directory whose
// config.json has a bitsandbytes quantization_config): tiny Llama directories whose projections
// the test stores by hand as bitsandbytes' parts (random codes and block scales, the JSON
// quant_state written as text), read back dequantized and as packed records, and every refusal.
#include "models/hf_bnb.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "models/base_quant.h"
#include "models/hf_checkpoint.h"
#include "models/llama.h"
#include "models/ops/quantize_4bit.h"
#include "tests/models/hf_test_dir.h"

namespace strata::models {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using namespace testing;  // NOLINT: the test-directory helpers

constexpr std::string_view kNf4Config =
    R"(, "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": true,
  "load_in_8bit": false, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true,
  "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
  "llm_int8_skip_modules": null, "llm_int8_threshold": 6.0})";
constexpr std::string_view kFp4Config =
    R"(, "quantization_config": {"quant_method": "bitsandbytes", "_load_in_4bit": true,
  "_load_in_8bit": false, "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": false})";

// A tiny Llama stored as a bitsandbytes 4-bit directory: `file` is what is written (each
// projection replaced by its parts), `expected` the model's tensors with the values a reader
// must return (a projection's dequantized as models/ops/quantize_4bit.h defines it).
struct BnbDir {
  LlamaTestShape shape;
  ops::Quant4Params params;
  std::string config;
  std::vector<TestTensor> file;
  std::vector<TestTensor> expected;
  // The record of each projection as ReadQuantizedTensor must return it, by name.
  std::map<std::string, std::vector<std::byte>> records;

  TestTensor& File(const std::string& name) {
    for (TestTensor& t : file) {
      if (t.name == name) return t;
    }
    ADD_FAILURE() << "no tensor " << name;
    return file.front();
  }
  void Remove(const std::string& name) {
    std::erase_if(file, [&](const TestTensor& t) { return t.name == name; });
  }
  void Write(const std::string& dir, int num_shards = 0) const {
    WriteModelDir(dir, config, file, num_shards);
  }
};

std::vector<float> Bytes(std::string_view text) {
  std::vector<float> v;
  for (char c : text) v.push_back(static_cast<float>(static_cast<uint8_t>(c)));
  return v;
}

std::string QuantStateText(ops::Quant4Params p, const std::vector<int64_t>& shape, float offset,
                           std::string_view dtype = "bfloat16") {
  std::string s =
      fmt::format(R"({{"quant_type": "{}", "blocksize": 64, "dtype": "{}", "shape": [{}, {}])",
                  p.type == ops::Quant4Type::kNf4 ? "nf4" : "fp4", dtype, shape[0], shape[1]);
  if (p.double_quant) {
    s += fmt::format(
        R"(, "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": {:.17g})",
        static_cast<double>(offset));
  }
  return s + "}";
}

// `quant_dtype`: the quant_state's dtype, what bitsandbytes dequantizes to (each expected value
// rounded to it, to nearest even).
BnbDir MakeBnbDir(const LlamaTestShape& s, ops::Quant4Params p, uint64_t seed,
                  std::string_view quant_dtype = "bfloat16") {
  BnbDir d;
  d.shape = s;
  d.params = p;
  d.config = LlamaConfigText(s, std::string(p.double_quant ? kNf4Config : kFp4Config));
  if (p.type != (p.double_quant ? ops::Quant4Type::kNf4 : ops::Quant4Type::kFp4)) {
    ADD_FAILURE() << "MakeBnbDir writes nf4 with double quantization or fp4 without";
  }
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "BF16", seed);
  std::mt19937_64 rng(seed + 1);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.01f, 2.0f);
  const std::span<const float, 16> map = ops::Quant4Map(p.type);
  const std::span<const float, 256> map8 = ops::DynamicMap8();
  for (TestTensor& t : tensors) {
    if (!(t.block >= 1 && t.block <= s.L && t.shape.size() == 2)) {
      d.file.push_back(t);
      d.expected.push_back(t);
      continue;
    }
    const int64_t n = t.num_elems();
    const ops::Quant4Layout l = ops::MakeQuant4Layout(n, p);
    const int64_t blocks = (n + 63) / 64, nested_blocks = (blocks + 255) / 256;
    std::vector<uint8_t> codes((n + 1) / 2);
    for (auto& c : codes) c = static_cast<uint8_t>(byte(rng));
    if (n % 2 == 1) codes.back() &= 0xf0;  // bitsandbytes leaves the unused low nibble 0
    std::vector<float> absmax(blocks), q(blocks), nested(nested_blocks);
    const float offset = scale(rng);
    for (auto& x : nested) x = scale(rng);
    for (int64_t b = 0; b < blocks; ++b) {
      if (p.double_quant) {
        q[b] = static_cast<float>(byte(rng));
        const float scaled = map8[static_cast<int>(q[b])] * nested[b / 256];
        absmax[b] = scaled + offset;
      } else {
        absmax[b] = scale(rng);
      }
    }
    // What the dequantization multiplies by (quantize_4bit.h): the quant_map, but FP4's code 8
    // is -0.0. Products of these magnitudes are normal: no flush to zero applies.
    std::vector<float> table(map.begin(), map.end());
    if (p.type == ops::Quant4Type::kFp4) table[8] = -0.0f;
    TestTensor e = t;
    for (int64_t i = 0; i < n; ++i) {
      const int code = i % 2 == 0 ? codes[i / 2] >> 4 : codes[i / 2] & 15;
      const float v = table[code] * absmax[i / 64];
      e.values[i] = quant_dtype == "bfloat16"  ? Bf16ToFloat(FloatToBf16(v))
                    : quant_dtype == "float16" ? HalfToFloat(FloatToHalf(v))
                                               : v;
    }
    e.dtype = "F32";
    d.expected.push_back(e);

    // The record: codes, absmax (u8 or fp32), nested_absmax, offset, zero padding.
    std::vector<std::byte> record(l.total_bytes, std::byte{0});
    std::memcpy(record.data() + l.codes_offset, codes.data(), codes.size());
    for (int64_t b = 0; b < blocks; ++b) {
      if (p.double_quant) {
        record[l.absmax_offset + b] = static_cast<std::byte>(static_cast<uint8_t>(q[b]));
      } else {
        std::memcpy(record.data() + l.absmax_offset + 4 * b, &absmax[b], 4);
      }
    }
    if (p.double_quant) {
      std::memcpy(record.data() + l.nested_absmax_offset, nested.data(), 4 * nested_blocks);
      std::memcpy(record.data() + l.offset_offset, &offset, 4);
    }
    d.records[t.name] = std::move(record);

    auto part = [&](std::string name, std::vector<int64_t> shape, std::string dtype,
                    std::vector<float> values) {
      TestTensor x(std::move(name), std::move(shape), -1);
      x.dtype = std::move(dtype);
      x.values = std::move(values);
      d.file.push_back(std::move(x));
    };
    std::vector<float> code_values(codes.begin(), codes.end());
    part(t.name, {static_cast<int64_t>(codes.size()), 1}, "U8", code_values);
    part(t.name + ".absmax", {blocks}, p.double_quant ? "U8" : "F32", p.double_quant ? q : absmax);
    part(t.name + ".quant_map", {16}, "F32", std::vector<float>(map.begin(), map.end()));
    if (p.double_quant) {
      part(t.name + ".nested_absmax", {nested_blocks}, "F32", nested);
      part(t.name + ".nested_quant_map", {256}, "F32",
           std::vector<float>(map8.begin(), map8.end()));
    }
    const std::string state = QuantStateText(p, t.shape, offset, quant_dtype);
    part(fmt::format("{}.quant_state.bitsandbytes__{}", t.name,
                     p.type == ops::Quant4Type::kNf4 ? "nf4" : "fp4"),
         {static_cast<int64_t>(state.size())}, "U8", Bytes(state));
  }
  return d;
}

constexpr ops::Quant4Params kNf4Double{ops::Quant4Type::kNf4, true};
constexpr ops::Quant4Params kFp4Plain{ops::Quant4Type::kFp4, false};

// Odd sizes: C = 17 and I = 23 make gate/up/down hold an odd number of values (a half-used last
// byte) and every tensor a partial last block of 64.
LlamaTestShape OddShape() {
  LlamaTestShape s;
  s.C = 17;
  s.I = 23;
  return s;
}

void ExpectBlocksBitEqual(const HfCheckpoint& ck, const std::vector<TestTensor>& tensors) {
  for (int b = 0; b < ck.num_blocks(); ++b) {
    const std::vector<float> want = ExpectedChunk(tensors, b);
    ASSERT_EQ(ck.block_num_params(b), static_cast<int64_t>(want.size())) << "block " << b;
    std::vector<float> got(want.size(), -12345.0f);
    ASSERT_TRUE(ck.ReadBlock(b, got).ok()) << b;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
          << "block " << b << " element " << i << ": " << got[i] << " vs " << want[i];
    }
  }
}

void ExpectOneLineError(const Status& s, StatusCode code, const std::vector<std::string>& parts) {
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), code) << s.ToString();
  EXPECT_THAT(s.message(), Not(HasSubstr("\n")));
  for (const std::string& p : parts) EXPECT_THAT(s.message(), HasSubstr(p));
}

TEST(HfBnb, ReadsAnNf4DoubleQuantDirectoryDequantizedToFp32) {
  TempDir tmp;
  BnbDir d = MakeBnbDir(OddShape(), kNf4Double, 1);
  d.Write(tmp.path());
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ASSERT_TRUE((*ck)->base_quant().has_value());
  EXPECT_EQ((*ck)->base_quant()->type, ops::Quant4Type::kNf4);
  EXPECT_TRUE((*ck)->base_quant()->double_quant);
  EXPECT_EQ((*ck)->block_dtypes(1)[1], formats::TensorDType::U8());  // q_proj's codes
  ExpectBlocksBitEqual(**ck, d.expected);
}

// ReadBlockSkippingQuantized: the 16-bit tensors as ReadBlock gives them, the 4-bit ones' elements
// untouched (what the QLoRA base reads beside ReadQuantizedTensor's records).
// bitsandbytes' dequantize_4bit returns its quant_state's dtype, which MatMul4Bit then casts to
// the compute dtype: fp32 reads get each value rounded to that dtype first (before, the fp32
// product itself), and every weight of a model must share it.
TEST(HfBnb, DequantizesToTheQuantStatesDtypeAndRefusesMixedOnes) {
  for (const char* dtype : {"float16", "float32", "bfloat16"}) {
    TempDir tmp;
    BnbDir d = MakeBnbDir(OddShape(), kNf4Double, 7, dtype);
    d.Write(tmp.path());
    auto ck = HfCheckpoint::Open(tmp.path());
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    const std::string_view name = dtype;
    EXPECT_EQ((*ck)->base_quant()->dtype, name == "float16"   ? DType::kF16
                                          : name == "float32" ? DType::kF32
                                                              : DType::kBF16);
    ExpectBlocksBitEqual(**ck, d.expected);
  }
  TempDir tmp;
  BnbDir d = MakeBnbDir(OddShape(), kNf4Double, 7);
  const std::string state_name =
      "model.layers.1.mlp.down_proj.weight.quant_state.bitsandbytes__nf4";
  TestTensor& state = d.File(state_name);
  std::string text(state.values.begin(), state.values.end());
  const size_t at = text.find("bfloat16");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 8, "float16");
  state.values = Bytes(text);
  state.shape = {static_cast<int64_t>(text.size())};
  d.Write(tmp.path());
  ExpectOneLineError(HfCheckpoint::Open(tmp.path()).status(), StatusCode::kInvalidArgument,
                     {state_name, "says dtype fp16", "bf16", "one type"});
}

TEST(HfBnb, ReadBlockSkippingQuantizedLeavesThe4BitTensorsUntouched) {
  TempDir tmp;
  BnbDir d = MakeBnbDir(OddShape(), kNf4Double, 1);
  d.Write(tmp.path());
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  for (int b = 0; b < (*ck)->num_blocks(); ++b) {
    std::vector<float> all((*ck)->block_num_params(b)), some(all.size(), -12345.0f);
    ASSERT_TRUE((*ck)->ReadBlock(b, all).ok());
    ASSERT_TRUE((*ck)->ReadBlockSkippingQuantized(b, some).ok());
    int64_t skipped = 0;
    for (const HfTensor& t : HfBlockTensors((*ck)->config(), b)) {
      const bool quantized = HfBaseQuantized((*ck)->config(), b, t);
      for (int64_t i = t.chunk_offset; i < t.chunk_offset + t.num_elems; ++i) {
        if (quantized) {
          ASSERT_EQ(some[i], -12345.0f) << t.name;
        } else {
          ASSERT_EQ(std::memcmp(&some[i], &all[i], 4), 0) << t.name;
        }
      }
      skipped += quantized ? 1 : 0;
    }
    EXPECT_EQ(skipped > 0, b >= 1 && b + 1 < (*ck)->num_blocks()) << "block " << b;
  }
}

TEST(HfBnb, ReadsAnFp4DirectoryWithFp32BlockScalesFromShards) {
  TempDir tmp;
  BnbDir d = MakeBnbDir(OddShape(), kFp4Plain, 2);
  d.Write(tmp.path(), /*num_shards=*/3);  // parts of one weight land in different shards
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ASSERT_TRUE((*ck)->base_quant().has_value());
  EXPECT_EQ((*ck)->base_quant()->type, ops::Quant4Type::kFp4);
  EXPECT_FALSE((*ck)->base_quant()->double_quant);
  ExpectBlocksBitEqual(**ck, d.expected);
}

TEST(HfBnb, ReadsMoreThan256BlocksWithTwoNestedBlocks) {
  TempDir tmp;
  LlamaTestShape s = OddShape();
  s.I = 1001;  // gate/up/down: 17017 values, 266 blocks of 64, 2 nested blocks of 256
  s.L = 1;
  BnbDir d = MakeBnbDir(s, kNf4Double, 3);
  d.Write(tmp.path());
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ExpectBlocksBitEqual(**ck, d.expected);
}

TEST(HfBnb, ReadQuantizedTensorReturnsTheStoredPartsInTheRecordLayout) {
  for (const ops::Quant4Params p : {kNf4Double, kFp4Plain}) {
    TempDir tmp;
    BnbDir d = MakeBnbDir(OddShape(), p, 4);
    d.Write(tmp.path(), 2);
    auto ck = HfCheckpoint::Open(tmp.path());
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    const HfModelConfig& config = (*ck)->config();
    int checked = 0;
    for (int b = 0; b < (*ck)->num_blocks(); ++b) {
      for (const HfTensor& t : HfBlockTensors(config, b)) {
        const ops::Quant4Layout l = ops::MakeQuant4Layout(t.num_elems, p);
        std::vector<std::byte> record(l.total_bytes, std::byte{0x5a});
        const Status s = (*ck)->ReadQuantizedTensor(b, t.chunk_offset, l, record);
        if (!HfBaseQuantized(config, b, t)) {
          ExpectOneLineError(s, StatusCode::kInvalidArgument, {"no 4-bit tensor"});
          continue;
        }
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_EQ(record, d.records.at(t.name)) << t.name;
        ++checked;
      }
    }
    EXPECT_EQ(checked, 7 * d.shape.L);
  }
}

TEST(HfBnb, ReadQuantizedTensorRefusesAnotherLayoutOrBufferSize) {
  TempDir tmp;
  BnbDir d = MakeBnbDir(OddShape(), kNf4Double, 5);
  d.Write(tmp.path());
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const HfTensor q = HfBlockTensors((*ck)->config(), 1)[1];
  ASSERT_EQ(q.name, "model.layers.0.self_attn.q_proj.weight");
  const ops::Quant4Layout l = ops::MakeQuant4Layout(q.num_elems, kNf4Double);
  std::vector<std::byte> record(l.total_bytes);
  ExpectOneLineError((*ck)->ReadQuantizedTensor(
                         1, q.chunk_offset, ops::MakeQuant4Layout(q.num_elems, kFp4Plain), record),
                     StatusCode::kInvalidArgument, {"q_proj.weight", "fp4"});
  ExpectOneLineError(
      (*ck)->ReadQuantizedTensor(1, q.chunk_offset,
                                 ops::MakeQuant4Layout(q.num_elems + 1, kNf4Double), record),
      StatusCode::kInvalidArgument, {"q_proj.weight"});
  std::vector<std::byte> short_record(l.total_bytes - 16);
  ExpectOneLineError((*ck)->ReadQuantizedTensor(1, q.chunk_offset, l, short_record),
                     StatusCode::kInvalidArgument, {"q_proj.weight", "buffer"});
  ExpectOneLineError((*ck)->ReadQuantizedTensor(1, q.chunk_offset + 1, l, record),
                     StatusCode::kInvalidArgument, {"no 4-bit tensor"});
  ExpectOneLineError((*ck)->ReadQuantizedTensor(9, q.chunk_offset, l, record),
                     StatusCode::kInvalidArgument, {"out of range"});
}

TEST(HfBnb, APlainDirectoryHasNoBaseQuantization) {
  TempDir tmp;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "BF16", 6);
  WriteModelDir(tmp.path(), LlamaConfigText(s, R"(, "quantization_config": null)"), tensors);
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_FALSE((*ck)->base_quant().has_value());
  const HfTensor q = HfBlockTensors((*ck)->config(), 1)[1];
  const ops::Quant4Layout l = ops::MakeQuant4Layout(q.num_elems, kNf4Double);
  std::vector<std::byte> record(l.total_bytes);
  ExpectOneLineError((*ck)->ReadQuantizedTensor(1, q.chunk_offset, l, record),
                     StatusCode::kInvalidArgument, {"no 4-bit tensor", "is 16-bit"});
}

// Each case: a good directory changed one way, and what the one-line error must name.
struct Refusal {
  std::string what;
  std::function<void(BnbDir&)> change;
  std::vector<std::string> message;
  ops::Quant4Params params = kNf4Double;
  StatusCode code = StatusCode::kInvalidArgument;
};

constexpr const char* kQ = "model.layers.1.self_attn.q_proj.weight";
constexpr const char* kDown = "model.layers.0.mlp.down_proj.weight";

void SetState(BnbDir& d, const std::string& weight, const std::string& text,
              const std::string& type = "nf4") {
  TestTensor& t = d.File(weight + ".quant_state.bitsandbytes__" + type);
  t.values = Bytes(text);
  t.shape = {static_cast<int64_t>(text.size())};
}

std::string StateWith(const std::string& key, const std::string& value, int64_t out = 16,
                      int64_t in = 17) {
  nlohmann::ordered_json j = {{"quant_type", "nf4"},     {"blocksize", 64},
                              {"dtype", "bfloat16"},     {"shape", {out, in}},
                              {"nested_blocksize", 256}, {"nested_dtype", "float32"},
                              {"nested_offset", 0.5}};
  if (value == "<absent>") {
    j.erase(key);
  } else {
    j[key] = nlohmann::ordered_json::parse(value);
  }
  return j.dump();
}

std::vector<Refusal> Refusals() {
  return {
      {"a truncated part: the codes one byte short",
       [](BnbDir& d) {
         TestTensor& t = d.File(kDown);
         t.values.pop_back();
         t.shape[0] -= 1;
       },
       {kDown, "U8 [195, 1]", "U8 [196, 1]", "packed 4-bit codes"}},
      {"a truncated part: the absmax one block short",
       [](BnbDir& d) {
         TestTensor& t = d.File(std::string(kQ) + ".absmax");
         t.values.pop_back();
         t.shape[0] -= 1;
       },
       {std::string(kQ) + ".absmax", "U8 [4]", "U8 [5]"}},
      {"absmax in fp32 with double quantization",
       [](BnbDir& d) { d.File(std::string(kQ) + ".absmax").dtype = "F32"; },
       {std::string(kQ) + ".absmax", "F32 [5]", "needs U8 [5]"}},
      {"a quant_map other than nf4's",
       [](BnbDir& d) { d.File(std::string(kQ) + ".quant_map").values[3] += 1e-6f; },
       {std::string(kQ) + ".quant_map", "a quant_map other than bitsandbytes' nf4 table",
        "value 3"}},
      {"fp4's quant_map in an nf4 directory",
       [](BnbDir& d) {
         const auto fp4 = ops::Quant4Map(ops::Quant4Type::kFp4);
         d.File(std::string(kQ) + ".quant_map").values.assign(fp4.begin(), fp4.end());
       },
       {"a quant_map other than bitsandbytes' nf4 table"}},
      {"a nested_quant_map other than the dynamic map",
       [](BnbDir& d) { d.File(std::string(kQ) + ".nested_quant_map").values[200] = 0.5f; },
       {std::string(kQ) + ".nested_quant_map", "signed dynamic 8-bit map", "value 200"}},
      {"blocksize 128",
       [](BnbDir& d) { SetState(d, kQ, StateWith("blocksize", "128")); },
       {std::string(kQ) + ".quant_state.bitsandbytes__nf4", "blocksize 128 is not supported"}},
      {"nested_blocksize 512",
       [](BnbDir& d) { SetState(d, kQ, StateWith("nested_blocksize", "512")); },
       {"nested_blocksize 512 is not supported"}},
      {"a JSON shape other than the weight's",
       [](BnbDir& d) { SetState(d, kQ, StateWith("shape", "[17, 16]")); },
       {kQ, "shape [17,16] is not the weight's [16, 17]"}},
      {"a JSON dtype torch does not have",
       [](BnbDir& d) { SetState(d, kQ, StateWith("dtype", "\"float8\"")); },
       {"dtype 'float8'"}},
      {"a JSON quant_type other than the config's",
       [](BnbDir& d) { SetState(d, kQ, StateWith("quant_type", "\"fp4\"")); },
       {"quant_type 'fp4' is not config.json's bnb_4bit_quant_type 'nf4'"}},
      {"a JSON key bitsandbytes does not write",
       [](BnbDir& d) { SetState(d, kQ, StateWith("group_size", "64")); },
       {"key 'group_size'"}},
      {"a JSON without nested_offset",
       [](BnbDir& d) { SetState(d, kQ, StateWith("nested_offset", "<absent>")); },
       {"key 'nested_offset' is missing"}},
      {"a nested_offset beyond fp32",
       [](BnbDir& d) { SetState(d, kQ, StateWith("nested_offset", "1e39")); },
       {"nested_offset must be a finite fp32 number"}},
      {"a quant_state that is not JSON",
       [](BnbDir& d) { SetState(d, kQ, "{\"quant_type\": \"nf4\""); },
       {std::string(kQ) + ".quant_state.bitsandbytes__nf4", "malformed JSON"}},
      {"a missing nested_absmax",
       [](BnbDir& d) { d.Remove(std::string(kQ) + ".nested_absmax"); },
       {std::string(kQ) + ".nested_absmax' is missing", "double quantization"}},
      {"a missing quant_state",
       [](BnbDir& d) { d.Remove(std::string(kQ) + ".quant_state.bitsandbytes__nf4"); },
       {std::string(kQ) + ".quant_state.bitsandbytes__nf4' is missing"}},
      {"an fp4 quant_state in an nf4 directory",
       [](BnbDir& d) {
         d.File(std::string(kQ) + ".quant_state.bitsandbytes__nf4").name =
             std::string(kQ) + ".quant_state.bitsandbytes__fp4";
       },
       {std::string(kQ) + ".quant_state.bitsandbytes__nf4' is missing"}},
      {"nested parts without double quantization",
       [](BnbDir& d) {
         TestTensor extra(std::string(kQ) + ".nested_absmax", {1}, -1);
         extra.values = {1.0f};
         d.file.push_back(extra);
       },
       {std::string(kQ) + ".nested_absmax' is present", "bnb_4bit_use_double_quant false"},
       kFp4Plain},
      {"a projection stored in 16 bits",
       [](BnbDir& d) {
         const std::string w = kDown;
         for (const char* suffix : {".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map",
                                    ".quant_state.bitsandbytes__nf4"}) {
           d.Remove(w + suffix);
         }
         TestTensor& t = d.File(w);
         t.dtype = "BF16";
         t.shape = {17, 23};
         t.values.assign(17 * 23, 0.5f);
       },
       {kDown, "is stored BF16, not 4-bit", "llm_int8_skip_modules"}},
      {"an LM head stored 4-bit",
       [](BnbDir& d) {
         TestTensor& t = d.File("lm_head.weight");
         t.dtype = "U8";
         t.shape = {37 * 17 / 2 + 1, 1};
         t.values.assign(t.shape[0], 7.0f);
       },
       {"lm_head.weight", "is stored 4-bit (U8)", "LM head in 16 bits"}},
      {"load_in_8bit",
       [](BnbDir& d) {
         d.config =
             LlamaConfigText(d.shape, R"(, "quantization_config": {"quant_method": "bitsandbytes",
             "load_in_8bit": true, "load_in_4bit": false})");
       },
       {"config.json", "quantization_config.load_in_8bit", "LLM.int8", "not supported"}},
      {"another quant_method",
       [](BnbDir& d) {
         d.config = LlamaConfigText(
             d.shape, R"(, "quantization_config": {"quant_method": "gptq", "bits": 4})");
       },
       {"quantization_config.quant_method", "'gptq' is not supported"}},
      {"a quant storage other than uint8",
       [](BnbDir& d) {
         d.config =
             LlamaConfigText(d.shape, R"(, "quantization_config": {"quant_method": "bitsandbytes",
             "load_in_4bit": true, "bnb_4bit_quant_type": "nf4",
             "bnb_4bit_use_double_quant": true, "bnb_4bit_quant_storage": "bfloat16"})");
       },
       {"quantization_config.bnb_4bit_quant_storage", "'bfloat16' is not supported"}},
      {"a quant type bitsandbytes does not have",
       [](BnbDir& d) {
         d.config =
             LlamaConfigText(d.shape, R"(, "quantization_config": {"quant_method": "bitsandbytes",
             "load_in_4bit": true, "bnb_4bit_quant_type": "int4"})");
       },
       {"quantization_config.bnb_4bit_quant_type", "'int4' is not supported"}},
  };
}

// A directory whose llm_int8_skip_modules keeps a projection in 16 bits (Unsloth's dynamic
// 4-bit directories do): that tensor is read as stored, it holds no record, and the others stay
// 4-bit. A skip list that is not a list of names is refused naming the field.
TEST(HfBnb, AProjectionTheSkipListKeepsIsStored16BitAndReadSo) {
  TempDir tmp;
  BnbDir d = MakeBnbDir(OddShape(), kNf4Double, 9);
  const std::string null_list = R"("llm_int8_skip_modules": null)";
  const size_t at = d.config.find(null_list);
  ASSERT_NE(at, std::string::npos);
  d.config.replace(at, null_list.size(),
                   R"("llm_int8_skip_modules": ["lm_head", "model.layers.0.mlp.down_proj"])");
  const std::string w = kDown;
  for (const char* suffix : {".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map",
                             ".quant_state.bitsandbytes__nf4"}) {
    d.Remove(w + suffix);
  }
  TestTensor* kept = nullptr;
  for (TestTensor& t : d.expected) {
    if (t.name == w) kept = &t;
  }
  ASSERT_NE(kept, nullptr);
  kept->dtype = "BF16";
  for (size_t i = 0; i < kept->values.size(); ++i) {
    kept->values[i] = static_cast<float>(static_cast<int>(i % 13) - 6) * 0.125f;  // exact in bf16
  }
  d.File(w) = *kept;
  d.Write(tmp.path());
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ExpectBlocksBitEqual(**ck, d.expected);
  const HfModelConfig& config = (*ck)->config();
  int quantized = 0, plain = 0;
  for (const HfTensor& t : HfBlockTensors(config, 1)) {
    if (!HfBaseQuantized(config, 1, t)) continue;
    const bool holds = (*ck)->HoldsQuantized(1, t.chunk_offset);
    EXPECT_EQ(holds, t.name != w) << t.name;
    (holds ? quantized : plain) += 1;
    if (holds) continue;
    // Read with the 16-bit tensors, and no record there.
    std::vector<float> some((*ck)->block_num_params(1), -12345.0f);
    ASSERT_TRUE((*ck)->ReadBlockSkippingQuantized(1, some).ok());
    for (int64_t i = 0; i < t.num_elems; ++i) {
      ASSERT_EQ(some[t.chunk_offset + i], kept->values[i]) << i;
    }
    const ops::Quant4Layout l = ops::MakeQuant4Layout(t.num_elems, kNf4Double);
    std::vector<std::byte> record(l.total_bytes);
    ExpectOneLineError((*ck)->ReadQuantizedTensor(1, t.chunk_offset, l, record),
                       StatusCode::kInvalidArgument, {"is 16-bit"});
  }
  EXPECT_EQ(quantized, 6);
  EXPECT_EQ(plain, 1);
  EXPECT_TRUE((*ck)->HoldsQuantized(2, HfBlockTensors(config, 2)[1].chunk_offset));
  EXPECT_FALSE((*ck)->HoldsQuantized(0, 0));  // the embedding
  EXPECT_FALSE((*ck)->HoldsQuantized(99, 0));

  // A QLoRA model over the directory keeps that projection in the working precision and the
  // others' records as stored: its decoded layers are ReadBlock's values rounded to bf16, bit for
  // bit, and the layer with the kept projection is the larger.
  auto source = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(source.ok());
  auto m =
      LlamaModel::Create(config.llama, std::shared_ptr<const WeightSource>(std::move(*source)));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_TRUE((*m)->EnableLora({.rank = 2, .alpha = 4, .targets = {"q_proj"}}).ok());
  ASSERT_TRUE((*m)->EnableBaseQuant(kNf4Double).ok());
  EXPECT_GT((*m)->block_frozen_bytes(1, DType::kBF16), (*m)->block_frozen_bytes(2, DType::kBF16));
  for (int b : {1, 2}) {
    std::vector<std::byte> chunk((*m)->block_frozen_bytes(b, DType::kBF16));
    ASSERT_TRUE((*m)->InitFrozenChunk(b, 0, DType::kBF16, chunk).ok());
    std::vector<float> got((*ck)->block_num_params(b)), want(got.size());
    DecodeLayerChunkToF32((*m)->EncodedLayout(b, DType::kBF16), DType::kBF16, chunk.data(),
                          got.data());
    ASSERT_TRUE((*ck)->ReadBlock(b, want).ok());
    for (size_t i = 0; i < want.size(); ++i) {
      const float rounded = Bf16ToFloat(FloatToBf16(want[i]));
      ASSERT_EQ(std::memcmp(&got[i], &rounded, 4), 0) << "block " << b << " element " << i;
    }
  }

  const size_t list = d.config.find(R"(["lm_head")");
  d.config.replace(list, std::string(R"(["lm_head", "model.layers.0.mlp.down_proj"])").size(),
                   R"(["lm_head", 7])");
  TempDir bad;
  d.Write(bad.path());
  ExpectOneLineError(HfCheckpoint::Open(bad.path()).status(), StatusCode::kInvalidArgument,
                     {"config.json", "quantization_config.llm_int8_skip_modules", "module names"});
}

TEST(HfBnb, EveryRefusalIsOneLineNamingTheFileAndTensor) {
  for (const Refusal& r : Refusals()) {
    SCOPED_TRACE(r.what);
    TempDir tmp;
    BnbDir d = MakeBnbDir(OddShape(), r.params, 7);
    r.change(d);
    d.Write(tmp.path());
    auto ck = HfCheckpoint::Open(tmp.path());
    ASSERT_FALSE(ck.ok()) << r.what;
    ExpectOneLineError(ck.status(), r.code, r.message);
    EXPECT_THAT(ck.status().message(), HasSubstr(tmp.path())) << r.what;
  }
}

TEST(HfBnb, ATruncatedFileIsDataLossNamingIt) {
  TempDir tmp;
  BnbDir d = MakeBnbDir(OddShape(), kNf4Double, 8);
  d.Write(tmp.path());
  const std::string path = tmp.path() + "/model.safetensors";
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(std::filesystem::file_size(path) - 9)), 0);
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_FALSE(ck.ok());
  ExpectOneLineError(ck.status(), StatusCode::kDataLoss, {path});
}

TEST(HfBnb, AGpt2DirectoryWithAQuantizationConfigIsRefusedByName) {
  TempDir tmp;
  Gpt2TestShape s;
  auto tensors = Gpt2TestTensors(s);
  FillRandom(tensors, "F16", 9);
  WriteModelDir(tmp.path(), Gpt2ConfigText(s, std::string(kNf4Config)), tensors);
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_FALSE(ck.ok());
  ExpectOneLineError(ck.status(), StatusCode::kInvalidArgument,
                     {"config.json", "gpt2 (GPT2LMHeadModel)"});
}

TEST(HfBnbConfig, ParsesTransformersKeysAndDefaults) {
  auto parse = [](const std::string& qc) {
    return ParseBnbQuantizationConfig(
        nlohmann::json::parse("{\"quantization_config\": " + qc + "}"), "c.json");
  };
  auto none = ParseBnbQuantizationConfig(nlohmann::json::parse("{}"), "c.json");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  // transformers' defaults: fp4, no double quantization; quant_method implied by load_in_4bit.
  auto defaults = parse(R"({"load_in_4bit": true})");
  ASSERT_TRUE(defaults.ok()) << defaults.status().ToString();
  EXPECT_EQ((*defaults)->type, ops::Quant4Type::kFp4);
  EXPECT_FALSE((*defaults)->double_quant);
  // What BnbQuantizationConfigJson writes reads back as itself.
  for (const ops::Quant4Params p : {kNf4Double, kFp4Plain}) {
    auto back = parse(BnbQuantizationConfigJson(p, DType::kBF16).dump());
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ((*back)->type, p.type);
    EXPECT_EQ((*back)->double_quant, p.double_quant);
  }
  const auto j = BnbQuantizationConfigJson(kNf4Double, DType::kF16);
  EXPECT_EQ(j["bnb_4bit_compute_dtype"], "float16");
  EXPECT_EQ(j["quant_method"], "bitsandbytes");
  EXPECT_EQ(j.size(), 13u);  // every key of BitsAndBytesConfig.to_dict
  ExpectOneLineError(parse(R"({"load_in_4bit": "yes"})").status(), StatusCode::kInvalidArgument,
                     {"c.json", "quantization_config.load_in_4bit", "true or false"});
  ExpectOneLineError(parse(R"({"quant_method": "bitsandbytes"})").status(),
                     StatusCode::kInvalidArgument, {"quantization_config.load_in_4bit"});
  ExpectOneLineError(parse("[1]").status(), StatusCode::kInvalidArgument,
                     {"'quantization_config' must be an object"});
}

TEST(HfBnbConfig, QuantStateJsonReadsBackWithTheSameOffsetAndAFixedWidth) {
  const std::vector<int64_t> shape = {24, 40};
  for (const float offset : {0.0f, 1e-30f, 0.012345678f, 0.5f, 3.0e5f, 1.0e38f}) {
    const std::string text = BnbQuantStateJson(kNf4Double, DType::kF16, shape, offset);
    EXPECT_EQ(text.size(), BnbQuantStateJson(kNf4Double, DType::kF16, shape, 1.0f).size()) << text;
    auto state = ParseBnbQuantState(text, shape, kNf4Double, "f", "t");
    ASSERT_TRUE(state.ok()) << state.status().ToString();
    EXPECT_EQ(state->nested_offset, offset);
    EXPECT_EQ(state->dtype, DType::kF16);
  }
  const std::string plain = BnbQuantStateJson(kFp4Plain, DType::kBF16, shape, 0);
  EXPECT_EQ(plain,
            R"({"quant_type": "fp4", "blocksize": 64, "dtype": "bfloat16", "shape": [24, 40]})");
  EXPECT_TRUE(ParseBnbQuantState(plain, shape, kFp4Plain, "f", "t").ok());
  ExpectOneLineError(ParseBnbQuantState(plain, shape, kNf4Double, "f", "t").status(),
                     StatusCode::kInvalidArgument, {"f: tensor 't'", "quant_type 'fp4'"});
}

}  // namespace
}  // namespace strata::models
