#include "models/hf_export.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>

#include "formats/safetensors.h"
#include "models/hf_checkpoint.h"
#include "models/llama_kernels.h"
#include "models/lora_adapter.h"
#include "tests/models/hf_test_dir.h"

namespace strata::models {
namespace {

using ::testing::HasSubstr;
using namespace testing;  // NOLINT: the test-directory helpers
namespace fs = std::filesystem;

std::function<Status(int, std::span<float>)> Reader(const HfCheckpoint& ck) {
  return [&ck](int b, std::span<float> out) { return ck.ReadBlock(b, out); };
}

// Every tensor of every safetensors file in `dir`: name -> (dtype, shape, raw data bytes).
struct RawTensor {
  formats::TensorDType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::string bytes;
  std::string file;
};
std::map<std::string, RawTensor> ReadAllTensors(const std::string& dir) {
  std::map<std::string, RawTensor> out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    auto f = formats::OpenSafetensorsFile(entry.path().string());
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    if (!f.ok()) continue;
    EXPECT_EQ(f->header.metadata.at("format"), "pt");
    for (const auto& t : f->header.tensors) {
      std::string bytes(t.size_bytes(), '\0');
      EXPECT_TRUE(
          formats::ReadTensorBytes(*f, t, 0, std::as_writable_bytes(std::span(bytes))).ok());
      EXPECT_FALSE(out.contains(t.name)) << t.name;
      out[t.name] = {t.dtype, t.shape, std::move(bytes), entry.path().filename().string()};
    }
  }
  return out;
}

TEST(HfExport, Fp32ImportThenExportIsByteIdenticalForEveryFamilyAndLayout) {
  struct Case {
    std::string name, config;
    std::vector<TestTensor> tensors;
    int shards;
  };
  LlamaTestShape llama;
  LlamaTestShape llama_tied;
  llama_tied.tied = true;
  Gpt2TestShape gpt2_untied;
  gpt2_untied.tied = false;
  std::vector<Case> cases = {
      {"llama untied GQA", LlamaConfigText(llama), LlamaTestTensors(llama), 0},
      {"llama tied", LlamaConfigText(llama_tied), LlamaTestTensors(llama_tied), 3},
      {"gpt2 tied", Gpt2ConfigText(Gpt2TestShape()), Gpt2TestTensors(Gpt2TestShape()), 0},
      {"gpt2 untied", Gpt2ConfigText(gpt2_untied), Gpt2TestTensors(gpt2_untied), 2}};
  for (Case& c : cases) {
    SCOPED_TRACE(c.name);
    TempDir tmp;
    const std::string in = tmp.path() + "/in", out = tmp.path() + "/out";
    FillRandom(c.tensors, "F32", 11);
    WriteModelDir(in, c.config, c.tensors, c.shards);
    auto ck = HfCheckpoint::Open(in);
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    ASSERT_TRUE(
        WriteHfDirectory(out, (*ck)->config(), Reader(**ck), DType::kF32, uint64_t{5} << 30, {})
            .ok());
    EXPECT_TRUE(fs::exists(out + "/model.safetensors"));
    EXPECT_FALSE(fs::exists(out + "/model.safetensors.index.json"));
    const auto a = ReadAllTensors(in), b = ReadAllTensors(out);
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [name, t] : a) {
      ASSERT_TRUE(b.contains(name)) << name;
      EXPECT_EQ(b.at(name).dtype, DType::kF32) << name;
      EXPECT_EQ(b.at(name).shape, t.shape) << name;
      EXPECT_TRUE(b.at(name).bytes == t.bytes) << name << " differs";
    }
    // And the export imports again, to the same chunks.
    auto again = HfCheckpoint::Open(out);
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    for (int blk = 0; blk < (*ck)->num_blocks(); ++blk) {
      std::vector<float> x((*ck)->block_num_params(blk)), y(x.size());
      ASSERT_TRUE((*ck)->ReadBlock(blk, x).ok());
      ASSERT_TRUE((*again)->ReadBlock(blk, y).ok());
      EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0) << blk;
    }
  }
}

TEST(HfExport, GptNamesWithoutPrefixComeBackWithIt) {
  TempDir tmp;
  Gpt2TestShape s;
  auto tensors = Gpt2TestTensors(s, "");
  FillRandom(tensors, "F16", 12);
  WriteModelDir(tmp.path() + "/in", Gpt2ConfigText(s), tensors);
  auto ck = HfCheckpoint::Open(tmp.path() + "/in");
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ASSERT_TRUE(WriteHfDirectory(tmp.path() + "/out", (*ck)->config(), Reader(**ck), DType::kF16,
                               uint64_t{1} << 30, {})
                  .ok());
  const auto b = ReadAllTensors(tmp.path() + "/out");
  ASSERT_EQ(b.size(), tensors.size());
  EXPECT_TRUE(b.contains("transformer.wte.weight"));
  EXPECT_FALSE(b.contains("lm_head.weight"));  // tied: no lm_head
  // F16 in, F16 out: the same bits.
  for (const TestTensor& t : tensors) {
    const RawTensor& r = b.at("transformer." + t.name);
    ASSERT_EQ(r.bytes.size(), t.values.size() * 2);
    for (size_t i = 0; i < t.values.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, r.bytes.data() + 2 * i, 2);
      ASSERT_EQ(h, FloatToHalf(t.values[i])) << t.name << " " << i;
    }
  }
}

TEST(HfExport, Bf16ExportRoundsEveryValueToNearestEven) {
  TempDir tmp;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "F32", 13);
  WriteModelDir(tmp.path() + "/in", LlamaConfigText(s), tensors);
  auto ck = HfCheckpoint::Open(tmp.path() + "/in");
  ASSERT_TRUE(ck.ok());
  ASSERT_TRUE(WriteHfDirectory(tmp.path() + "/out", (*ck)->config(), Reader(**ck), DType::kBF16,
                               uint64_t{1} << 30, {})
                  .ok());
  const auto b = ReadAllTensors(tmp.path() + "/out");
  for (const TestTensor& t : tensors) {
    const RawTensor& r = b.at(t.name);
    EXPECT_EQ(r.dtype, DType::kBF16);
    ASSERT_EQ(r.bytes.size(), t.values.size() * 2);
    for (size_t i = 0; i < t.values.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, r.bytes.data() + 2 * i, 2);
      // The double reference: the nearest bf16 of the value (ties to even), found by search.
      const double v = t.values[i];
      uint16_t want = FloatToBf16(t.values[i]);
      const double lo = Bf16ToFloat(want), up = Bf16ToFloat(static_cast<uint16_t>(want + 1)),
                   dn = Bf16ToFloat(static_cast<uint16_t>(want - 1));
      EXPECT_LE(std::abs(lo - v), std::abs(up - v));
      EXPECT_LE(std::abs(lo - v), std::abs(dn - v));
      ASSERT_EQ(h, want) << t.name << " " << i;
    }
  }
  auto cfg = ReadHfConfig(tmp.path() + "/out");
  ASSERT_TRUE(cfg.ok());
  EXPECT_EQ(cfg->raw["torch_dtype"], "bfloat16");
}

TEST(HfExport, ShardsAboveMaxShardBytesWithAnIndex) {
  TempDir tmp;
  Gpt2TestShape s;
  s.tied = false;
  s.L = 3;
  auto tensors = Gpt2TestTensors(s);
  FillRandom(tensors, "F32", 14);
  WriteModelDir(tmp.path() + "/in", Gpt2ConfigText(s), tensors);
  auto ck = HfCheckpoint::Open(tmp.path() + "/in");
  ASSERT_TRUE(ck.ok());
  // The largest tensors are (V, C) fp32 = 1968 bytes and c_fc (C, 4C) = 2304 bytes: a shard limit
  // of 3000 bytes splits the model into many shards, each tensor whole.
  const uint64_t max_shard = 3000;
  const std::string out = tmp.path() + "/out";
  ASSERT_TRUE(
      WriteHfDirectory(out, (*ck)->config(), Reader(**ck), DType::kF32, max_shard, {}).ok());
  EXPECT_FALSE(fs::exists(out + "/model.safetensors"));
  const auto index = nlohmann::json::parse(ReadFileBytes(out + "/model.safetensors.index.json"));
  const auto b = ReadAllTensors(out);
  ASSERT_EQ(b.size(), tensors.size());
  uint64_t total = 0;
  std::map<std::string, uint64_t> per_file;
  std::set<std::string> files;
  for (const auto& [name, t] : b) {
    total += t.bytes.size();
    per_file[t.file] += t.bytes.size();
    EXPECT_EQ(index["weight_map"][name], t.file) << name;
  }
  EXPECT_EQ(index["weight_map"].size(), b.size());
  EXPECT_EQ(index["metadata"]["total_size"], total);
  const int n = static_cast<int>(per_file.size());
  EXPECT_GT(n, 5);
  for (int k = 1; k <= n; ++k) {
    const std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", k, n);
    ASSERT_TRUE(per_file.contains(name)) << name;
    EXPECT_LE(per_file[name], max_shard) << name;
  }
  for (const TestTensor& t : tensors) {
    const RawTensor& r = b.at(t.name);
    EXPECT_EQ(r.shape, t.shape) << t.name;  // lm_head back to (V, C)
    EXPECT_EQ(std::memcmp(r.bytes.data(), t.values.data(), r.bytes.size()), 0) << t.name;
  }
  auto again = HfCheckpoint::Open(out);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ((*again)->weight_files().size(), static_cast<size_t>(n));
}

TEST(HfExport, ATensorLargerThanTheShardLimitGetsAShardOfItsOwn) {
  TempDir tmp;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "F32", 15);
  WriteModelDir(tmp.path() + "/in", LlamaConfigText(s), tensors);
  auto ck = HfCheckpoint::Open(tmp.path() + "/in");
  ASSERT_TRUE(ck.ok());
  const std::string out = tmp.path() + "/out";
  ASSERT_TRUE(WriteHfDirectory(out, (*ck)->config(), Reader(**ck), DType::kF32, 1, {}).ok());
  const auto b = ReadAllTensors(out);
  std::set<std::string> files;
  for (const auto& [name, t] : b) files.insert(t.file);
  EXPECT_EQ(files.size(), tensors.size());
}

// The tokenizer's files, its chat_template.jinja and generation_config.json (its end-of-turn ids):
// what save_pretrained writes beside the weights, and what a chat model needs to be served.
TEST(HfExport, CopiesTheTokenizerChatTemplateAndGenerationConfig) {
  TempDir tmp;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "F32", 16);
  WriteModelDir(tmp.path() + "/in", LlamaConfigText(s), tensors);
  WriteFile(tmp.path() + "/in/tokenizer.model", std::string("\x0a\x00\xff spm", 7));
  WriteFile(tmp.path() + "/in/tokenizer_config.json", R"({"add_bos_token": true})");
  WriteFile(tmp.path() + "/in/chat_template.jinja",
            "{% for m in messages %}{{ m.content }}{% endfor %}");
  WriteFile(tmp.path() + "/in/generation_config.json", R"({"eos_token_id": [2, 7]})");
  auto ck = HfCheckpoint::Open(tmp.path() + "/in");
  ASSERT_TRUE(ck.ok());
  ASSERT_EQ((*ck)->companion_files().size(), 4u);
  const std::string out = tmp.path() + "/out";
  std::vector<CompanionFile> files((*ck)->companion_files().begin(),
                                   (*ck)->companion_files().end());
  ASSERT_TRUE(
      WriteHfDirectory(out, (*ck)->config(), Reader(**ck), DType::kF32, 1 << 30, files).ok());
  EXPECT_EQ(ReadFileBytes(out + "/tokenizer.model"), std::string("\x0a\x00\xff spm", 7));
  EXPECT_EQ(ReadFileBytes(out + "/tokenizer_config.json"), R"({"add_bos_token": true})");
  EXPECT_EQ(ReadFileBytes(out + "/chat_template.jinja"),
            "{% for m in messages %}{{ m.content }}{% endfor %}");
  EXPECT_EQ(ReadFileBytes(out + "/generation_config.json"), R"({"eos_token_id": [2, 7]})");
  // A file copied under another name (a run's tokenizer trained from my_tok.json is the
  // tokenizer.json transformers reads); two files under one name are refused, nothing written.
  WriteFile(tmp.path() + "/my_tok.json", R"({"model": {}})");
  const std::string renamed = tmp.path() + "/renamed";
  ASSERT_TRUE(WriteHfDirectory(renamed, (*ck)->config(), Reader(**ck), DType::kF32, 1 << 30,
                               {{tmp.path() + "/my_tok.json", "tokenizer.json"}})
                  .ok());
  EXPECT_EQ(ReadFileBytes(renamed + "/tokenizer.json"), R"({"model": {}})");
  EXPECT_FALSE(fs::exists(renamed + "/my_tok.json"));
  const Status twice = WriteHfDirectory(
      tmp.path() + "/twice", (*ck)->config(), Reader(**ck), DType::kF32, 1 << 30,
      {{tmp.path() + "/my_tok.json", "tokenizer.model"}, {tmp.path() + "/in/tokenizer.model"}});
  EXPECT_EQ(twice.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(twice.message(), HasSubstr("as 'tokenizer.model'"));
  EXPECT_FALSE(fs::exists(tmp.path() + "/twice"));
}

TEST(HfExport, RefusesANonEmptyOutputDirectoryAndWritesNothing) {
  TempDir tmp;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "F32", 17);
  WriteModelDir(tmp.path() + "/in", LlamaConfigText(s), tensors);
  auto ck = HfCheckpoint::Open(tmp.path() + "/in");
  ASSERT_TRUE(ck.ok());
  const std::string out = tmp.path() + "/out";
  fs::create_directories(out);
  WriteFile(out + "/keep.txt", "mine");
  const Status st = WriteHfDirectory(out, (*ck)->config(), Reader(**ck), DType::kF32, 1 << 30, {});
  EXPECT_EQ(st.code(), StatusCode::kAlreadyExists);
  EXPECT_THAT(st.message(), HasSubstr(out));
  EXPECT_EQ(ReadFileBytes(out + "/keep.txt"), "mine");
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.path()), fs::directory_iterator()), 2);
  // An empty directory is fine: the rename replaces it.
  fs::remove(out + "/keep.txt");
  EXPECT_TRUE(WriteHfDirectory(out, (*ck)->config(), Reader(**ck), DType::kF32, 1 << 30, {}).ok());
  EXPECT_TRUE(fs::exists(out + "/config.json"));
}

TEST(HfExport, AFailingReadLeavesNoOutputAndNoTemporaryDirectory) {
  TempDir tmp;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "F32", 18);
  WriteModelDir(tmp.path() + "/in", LlamaConfigText(s), tensors);
  auto ck = HfCheckpoint::Open(tmp.path() + "/in");
  ASSERT_TRUE(ck.ok());
  const std::string out = tmp.path() + "/out";
  int calls = 0;
  const Status st = WriteHfDirectory(out, (*ck)->config(),
                                     [&](int b, std::span<float> buf) -> Status {
                                       ++calls;
                                       if (b == 2) return DataLossError("block 2 went missing");
                                       return (*ck)->ReadBlock(b, buf);
                                     },
                                     DType::kF32, 1000, {});
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_EQ(calls, 3);
  EXPECT_FALSE(fs::exists(out));
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.path()), fs::directory_iterator()), 1);
  // A missing tokenizer file fails the same way.
  EXPECT_EQ(WriteHfDirectory(out, (*ck)->config(), Reader(**ck), DType::kF32, 1 << 30,
                             {tmp.path() + "/in/tokenizer.model"})
                .code(),
            StatusCode::kNotFound);
  EXPECT_FALSE(fs::exists(out));
}

// A multimodal Gemma 3 (Gemma3ForConditionalGeneration): PEFT over transformers 4.52+ names the
// language model's modules model.language_model.layers.N..., and a plain list of target_modules
// would also match the vision tower's q_proj/k_proj/v_proj. The adapter is written with those
// names and a regular expression for the language model's modules; it is read back, and so is
// the layout of PEFT over earlier transformers (language_model.model.layers.N...).
TEST(LoraAdapterDir, AMultimodalGemma3sAdaptersAreItsLanguageModels) {
  const auto config = ParseHfConfig(R"({"architectures": ["Gemma3ForConditionalGeneration"],
      "model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "vocab_size": 64,
      "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8},
      "vision_config": {"model_type": "siglip_vision_model"}})",
                                    "config.json");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  ASSERT_TRUE(config->gemma3_multimodal);
  const LoraConfig lora{.rank = 2, .alpha = 4, .targets = {"q_proj", "v_proj", "down_proj"}};
  const auto layout = MakeLoraLayout(lora, LlamaLoraModules(config->llama), "gemma3");
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  auto value = [](int layer, int64_t i) { return 0.25f * static_cast<float>(layer + 1) + i; };
  TempDir tmp;
  const std::string dir = tmp.path() + "/adapter";
  ASSERT_TRUE(WriteLoraAdapterDir(dir, *config, lora, *layout, "base",
                                  [&](int layer, std::span<float> out) {
                                    for (size_t i = 0; i < out.size(); ++i) {
                                      out[i] = value(layer, static_cast<int64_t>(i));
                                    }
                                    return Status::Ok();
                                  })
                  .ok());
  const auto cfg = nlohmann::json::parse(ReadFileBytes(dir + "/adapter_config.json"));
  const std::string targets = cfg["target_modules"].get<std::string>();
  // PEFT: re.fullmatch(target_modules, module name).
  const std::regex re(targets);
  EXPECT_TRUE(std::regex_match("model.language_model.layers.1.self_attn.q_proj", re)) << targets;
  EXPECT_TRUE(std::regex_match("model.language_model.layers.0.mlp.down_proj", re));
  EXPECT_FALSE(std::regex_match("model.language_model.layers.0.self_attn.k_proj", re));
  EXPECT_FALSE(
      std::regex_match("model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj", re));
  const auto parsed = ReadLoraAdapterConfig(dir);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_THAT(parsed->lora.targets,
              ::testing::UnorderedElementsAre("q_proj", "v_proj", "down_proj"));
  const auto header = ReadAllTensors(dir);
  EXPECT_TRUE(header.contains(
      "base_model.model.model.language_model.layers.1.self_attn.q_proj.lora_A.weight"));
  EXPECT_EQ(header.size(), 2u * 3u * 2u);

  // Read back, with Strata's names and with the earlier layout's.
  for (const bool legacy : {false, true}) {
    SCOPED_TRACE(legacy ? "language_model.model.layers" : "model.language_model.layers");
    std::string from = dir;
    if (legacy) {
      from = tmp.path() + "/legacy";
      fs::create_directories(from);
      fs::copy_file(dir + "/adapter_config.json", from + "/adapter_config.json");
      std::vector<TestTensor> renamed;
      for (const auto& [name, t] : header) {
        TestTensor r(std::regex_replace(name, std::regex("model\\.model\\.language_model\\.layers"),
                                        "model.language_model.model.layers"),
                     t.shape, 0);
        r.values.resize(t.bytes.size() / sizeof(float));
        std::memcpy(r.values.data(), t.bytes.data(), t.bytes.size());
        renamed.push_back(std::move(r));
      }
      std::vector<const TestTensor*> ptrs;
      for (const TestTensor& t : renamed) ptrs.push_back(&t);
      WriteSafetensors(from + "/adapter_model.safetensors", ptrs);
    }
    const auto source = OpenLoraAdapter(from, *config, lora, *layout);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    std::vector<float> chunk(layout->layer_params);
    for (int layer = 0; layer < 2; ++layer) {
      ASSERT_TRUE((*source)->ReadBlock(layer + 1, chunk).ok());
      for (size_t i = 0; i < chunk.size(); ++i) {
        ASSERT_EQ(chunk[i], value(layer, static_cast<int64_t>(i))) << layer << " " << i;
      }
    }
  }
}

}  // namespace
}  // namespace strata::models
