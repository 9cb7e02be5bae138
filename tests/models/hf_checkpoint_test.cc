#include "models/hf_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>

#include "tests/models/hf_test_dir.h"

namespace strata::models {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace testing;  // NOLINT: the test-directory helpers

// Reads every block and compares it, element by element and bit for bit (the conversions from
// F32, F16 and BF16 to fp32 are exact), with the chunk the test lays out itself.
void ExpectBlocksEqual(const HfCheckpoint& ck, const std::vector<TestTensor>& tensors) {
  for (int b = 0; b < ck.num_blocks(); ++b) {
    const std::vector<float> want = ExpectedChunk(tensors, b);
    ASSERT_EQ(ck.block_num_params(b), static_cast<int64_t>(want.size())) << "block " << b;
    std::vector<float> got(want.size(), -12345.0f);
    ASSERT_TRUE(ck.ReadBlock(b, got).ok()) << b;
    for (size_t i = 0; i < want.size(); ++i) {
      uint32_t g, w;
      std::memcpy(&g, &got[i], 4);
      std::memcpy(&w, &want[i], 4);
      ASSERT_EQ(g, w) << "block " << b << " element " << i << ": " << got[i] << " vs " << want[i];
    }
  }
}

void ExpectOneLineError(const Status& s, StatusCode code, const std::vector<std::string>& parts) {
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), code) << s.ToString();
  EXPECT_THAT(s.message(), Not(HasSubstr("\n")));
  for (const std::string& p : parts) EXPECT_THAT(s.message(), HasSubstr(p));
}

TEST(HfCheckpoint, ReadsAnUntiedGqaLlamaFromOneF32File) {
  TempDir tmp;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "F32", 1);
  WriteModelDir(tmp.path(), LlamaConfigText(s), tensors);
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ((*ck)->config().family, HfModelConfig::Family::kLlama);
  ASSERT_EQ((*ck)->num_blocks(), s.L + 2);
  EXPECT_EQ((*ck)->block_names(),
            (std::vector<std::string>{"embedding", "layer0", "layer1", "head"}));
  EXPECT_EQ((*ck)->block_num_params(0), int64_t{s.V} * s.C);
  EXPECT_EQ((*ck)->block_num_params(3), int64_t{s.C} + int64_t{s.V} * s.C);
  EXPECT_TRUE((*ck)->companion_files().empty());
  ExpectBlocksEqual(**ck, tensors);
}

TEST(HfCheckpoint, ReadsATiedLlamaFromBf16ShardsWithAnIndexIgnoringItsLmHead) {
  TempDir tmp;
  LlamaTestShape s;
  s.tied = true;
  s.L = 3;
  s.V = 53;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "BF16", 2);
  auto with_extras = tensors;
  // A tied checkpoint may carry lm_head.weight, and older ones rotary buffers: both ignored.
  with_extras.push_back({"lm_head.weight", {s.V, s.C}, -1});
  with_extras.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", {s.hs / 2}, -1});
  FillRandom(with_extras, "BF16", 2);
  WriteModelDir(tmp.path(), LlamaConfigText(s), with_extras, /*num_shards=*/3);
  WriteFile(tmp.path() + "/tokenizer.json", "{}");
  WriteFile(tmp.path() + "/tokenizer.model", "x");
  WriteFile(tmp.path() + "/generation_config.json", R"({"eos_token_id": [1, 106]})");
  WriteFile(tmp.path() + "/chat_template.jinja", "{{ messages }}");
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ((*ck)->weight_files().size(), 3u);
  EXPECT_EQ((*ck)->block_num_params(s.L + 1), s.C);  // the head holds only model.norm
  EXPECT_EQ((*ck)->companion_files(),
            (std::vector<std::string>{
                tmp.path() + "/tokenizer.model", tmp.path() + "/tokenizer.json",
                tmp.path() + "/chat_template.jinja", tmp.path() + "/generation_config.json"}));
  ExpectBlocksEqual(**ck, with_extras);  // the extras belong to block -1: never expected
}

TEST(HfCheckpoint, ReadsATiedGpt2InF16WithAndWithoutTheTransformerPrefix) {
  for (const std::string prefix : {"transformer.", ""}) {
    TempDir tmp;
    Gpt2TestShape s;
    auto tensors = Gpt2TestTensors(s, prefix);
    auto with_buffers = tensors;
    with_buffers.push_back({prefix + "h.0.attn.bias", {1, 1, s.max_pos, s.max_pos}, -1});
    with_buffers.push_back({prefix + "h.1.attn.masked_bias", {}, -1});
    FillRandom(with_buffers, "F16", 3);
    WriteModelDir(tmp.path(), Gpt2ConfigText(s), with_buffers);
    auto ck = HfCheckpoint::Open(tmp.path());
    ASSERT_TRUE(ck.ok()) << prefix << ": " << ck.status().ToString();
    EXPECT_EQ((*ck)->block_num_params(s.L + 1), 2 * s.C);  // tied: ln_f only
    ExpectBlocksEqual(**ck, with_buffers);
  }
}

TEST(HfCheckpoint, TransposesTheUntiedGpt2LmHeadIntoTheHeadChunk) {
  TempDir tmp;
  Gpt2TestShape s;
  s.tied = false;
  auto tensors = Gpt2TestTensors(s);
  FillRandom(tensors, "F32", 4);
  WriteModelDir(tmp.path(), Gpt2ConfigText(s), tensors, /*num_shards=*/2);
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ExpectBlocksEqual(**ck, tensors);
  // Spot check of the layout itself: lm_head_w (C, V)[c, v] = lm_head.weight (V, C)[v, c].
  std::vector<float> head((*ck)->block_num_params(s.L + 1));
  ASSERT_TRUE((*ck)->ReadBlock(s.L + 1, head).ok());
  const std::vector<float>& lm = tensors.back().values;
  EXPECT_EQ(head[2 * s.C + 5 * s.V + 7], lm[7 * s.C + 5]);
}

TEST(HfCheckpoint, ReadsTensorsLargerThanTheStagingInPiecesWithOddRemainders) {
  TempDir tmp;
  Gpt2TestShape s;
  s.tied = false;
  s.C = 8;
  s.H = 2;
  s.L = 1;
  // 2.4M elements: 2 pieces of BF16 (2M elements each) and 3 transposed pieces of 131072 rows.
  s.V = 300'007;
  auto tensors = Gpt2TestTensors(s);
  FillRandom(tensors, "F32", 5);
  for (TestTensor& t : tensors) {
    if (t.name == "transformer.wte.weight" || t.name == "lm_head.weight") {
      t.dtype = "BF16";
      for (float& v : t.values) v = Bf16ToFloat(FloatToBf16(v));
    }
  }
  WriteModelDir(tmp.path(), Gpt2ConfigText(s), tensors);
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ASSERT_GT(int64_t{s.V} * s.C * 2, HfCheckpoint::kStagingBytes);
  ExpectBlocksEqual(**ck, tensors);
}

TEST(HfCheckpoint, FollowsSymlinksLikeTheHubCacheSnapshots) {
  TempDir tmp;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "F16", 9);
  WriteModelDir(tmp.path() + "/blobs", LlamaConfigText(s), tensors, /*num_shards=*/2);
  const std::string snap = tmp.path() + "/snapshots/abc";
  std::filesystem::create_directories(snap);
  for (const char* f :
       {"config.json", "model.safetensors.index.json", "w-0.safetensors", "w-1.safetensors"}) {
    std::filesystem::create_symlink(tmp.path() + "/blobs/" + f, snap + "/" + f);
  }
  auto ck = HfCheckpoint::Open(snap);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ExpectBlocksEqual(**ck, tensors);
}

TEST(HfCheckpoint, ReadBlockChecksTheBufferSize) {
  TempDir tmp;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "F32", 6);
  WriteModelDir(tmp.path(), LlamaConfigText(s), tensors);
  auto ck = HfCheckpoint::Open(tmp.path());
  ASSERT_TRUE(ck.ok());
  std::vector<float> small((*ck)->block_num_params(1) - 1);
  EXPECT_EQ((*ck)->ReadBlock(1, small).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*ck)->ReadBlock(9, small).code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// Bad input: one line naming the file and the tensor, before any data is read.

class HfCheckpointBadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    tensors_ = LlamaTestTensors(shape_);
    FillRandom(tensors_, "F32", 7);
  }
  Status Open() { return HfCheckpoint::Open(tmp_.path()).status(); }
  const std::string& dir() const { return tmp_.path(); }

  TempDir tmp_;
  LlamaTestShape shape_;
  std::vector<TestTensor> tensors_;
};

TEST_F(HfCheckpointBadInput, MissingShardFileNamesTheIndexAndTheShard) {
  WriteModelDir(dir(), LlamaConfigText(shape_), tensors_, 2);
  std::filesystem::remove(dir() + "/w-1.safetensors");
  ExpectOneLineError(Open(), StatusCode::kNotFound,
                     {"model.safetensors.index.json", "w-1.safetensors", tensors_[1].name});
}

TEST_F(HfCheckpointBadInput, MissingIndexEntryNamesTheTensor) {
  WriteModelDir(dir(), LlamaConfigText(shape_), tensors_, 2);
  auto index = nlohmann::json::parse(ReadFileBytes(dir() + "/model.safetensors.index.json"));
  index["weight_map"].erase("model.layers.1.mlp.up_proj.weight");
  WriteFile(dir() + "/model.safetensors.index.json", index.dump());
  // The tensor is still in its shard: without an index entry it is also an unexpected tensor,
  // but the missing entry is reported first.
  ExpectOneLineError(
      Open(), StatusCode::kInvalidArgument,
      {"model.safetensors.index.json", "model.layers.1.mlp.up_proj.weight", "weight_map"});
}

TEST_F(HfCheckpointBadInput, IndexEntryPointingAtTheWrongShardNamesBoth) {
  WriteModelDir(dir(), LlamaConfigText(shape_), tensors_, 2);
  auto index = nlohmann::json::parse(ReadFileBytes(dir() + "/model.safetensors.index.json"));
  index["weight_map"][tensors_[0].name] = "w-1.safetensors";  // it is in w-0
  WriteFile(dir() + "/model.safetensors.index.json", index.dump());
  ExpectOneLineError(Open(), StatusCode::kInvalidArgument, {"w-1.safetensors", tensors_[0].name});
}

TEST_F(HfCheckpointBadInput, ShardNameThatIsAPathIsRejected) {
  WriteModelDir(dir(), LlamaConfigText(shape_), tensors_, 2);
  auto index = nlohmann::json::parse(ReadFileBytes(dir() + "/model.safetensors.index.json"));
  index["weight_map"][tensors_[0].name] = "../w-0.safetensors";
  WriteFile(dir() + "/model.safetensors.index.json", index.dump());
  ExpectOneLineError(Open(), StatusCode::kInvalidArgument,
                     {"model.safetensors.index.json", tensors_[0].name, "plain file name"});
}

TEST_F(HfCheckpointBadInput, MissingTensorInASingleFileIsNamed) {
  auto fewer = tensors_;
  fewer.erase(fewer.begin() + 4);  // model.layers.0.self_attn.v_proj.weight
  WriteModelDir(dir(), LlamaConfigText(shape_), fewer);
  ExpectOneLineError(
      Open(), StatusCode::kInvalidArgument,
      {dir() + "/model.safetensors", "model.layers.0.self_attn.v_proj.weight", "missing"});
}

TEST_F(HfCheckpointBadInput, WrongShapeNamesTheTensorAndBothShapes) {
  // k_proj written transposed.
  for (TestTensor& t : tensors_) {
    if (t.name == "model.layers.1.self_attn.k_proj.weight") t.shape = {16, 8};  // needs (8, 16)
  }
  WriteModelDir(dir(), LlamaConfigText(shape_), tensors_);
  ExpectOneLineError(Open(), StatusCode::kInvalidArgument,
                     {dir() + "/model.safetensors", "model.layers.1.self_attn.k_proj.weight",
                      "[16, 8]", "[8, 16]"});
}

TEST_F(HfCheckpointBadInput, UnsupportedDtypeNamesTheTensor) {
  tensors_[2].dtype = "I64";
  WriteModelDir(dir(), LlamaConfigText(shape_), tensors_, 2);
  ExpectOneLineError(Open(), StatusCode::kInvalidArgument,
                     {"w-0.safetensors", tensors_[2].name, "I64"});
}

TEST_F(HfCheckpointBadInput, UnexpectedTensorsAreAConfigMismatch) {
  // A checkpoint with a third layer under a config of two.
  LlamaTestShape three = shape_;
  three.L = 3;
  auto more = LlamaTestTensors(three);
  FillRandom(more, "F16", 8);
  WriteModelDir(dir(), LlamaConfigText(shape_), more);
  ExpectOneLineError(
      Open(), StatusCode::kInvalidArgument,
      {dir() + "/model.safetensors", "model.layers.2.input_layernorm.weight", "9 tensor(s)"});
}

TEST_F(HfCheckpointBadInput, DataRangeOutsideTheFileIsDataLossNamingTheFile) {
  WriteModelDir(dir(), LlamaConfigText(shape_), tensors_, 2);
  const std::string shard = dir() + "/w-1.safetensors";
  ASSERT_EQ(::truncate(shard.c_str(), std::filesystem::file_size(shard) - 4), 0);
  ExpectOneLineError(Open(), StatusCode::kDataLoss, {shard});
}

// The index is a user's file: nesting past the limit is refused before anything walks it (a
// shard value 100,000 deep was printed with a recursive dump()), and what the message quotes
// from the file is cut and escaped.
TEST_F(HfCheckpointBadInput, AHostileIndexIsOneCleanLine) {
  WriteModelDir(dir(), LlamaConfigText(shape_), tensors_, 2);
  const std::string index_path = dir() + "/model.safetensors.index.json";
  WriteFile(index_path, R"({"weight_map": {"a": )" + std::string(100000, '[') +
                            std::string(100000, ']') + "}}");
  ExpectOneLineError(Open(), StatusCode::kInvalidArgument,
                     {"model.safetensors.index.json: JSON nested deeper than 64 levels"});
  const std::string deep = std::string(50, '[') + "1" + std::string(50, ']');
  auto r = ParseSafetensorsIndex(R"({"weight_map": {"t\u001b[2J": )" + deep + "}}", "idx.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(
      r.status().message(),
      "idx.json: weight_map entry of tensor 't\\x1B[2J' must be a plain file name in the "
      "directory, got [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]"
      "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]");
  r = ParseSafetensorsIndex(R"({"weight_map": {"t": "w\u007f.safetensors"}})", "idx.json");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr(R"(got "w\u007f.safetensors")"));
  r = ParseSafetensorsIndex(R"({"metadata": {"total_size": 4}, "weight_map": {"t": "w-0.bin"}})",
                            "idx.json");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, (std::map<std::string, std::string>{{"t", "w-0.bin"}}));
  EXPECT_EQ(ParseSafetensorsIndex("{\"weight_map\": \x01}", "idx.json").status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(HfCheckpointBadInput, FileTruncatedAfterOpenIsDataLossAtReadBlock) {
  WriteModelDir(dir(), LlamaConfigText(shape_), tensors_);
  auto ck = HfCheckpoint::Open(dir());
  ASSERT_TRUE(ck.ok());
  const std::string file = dir() + "/model.safetensors";
  ASSERT_EQ(::truncate(file.c_str(), std::filesystem::file_size(file) - 100), 0);
  std::vector<float> head((*ck)->block_num_params(shape_.L + 1));
  ExpectOneLineError((*ck)->ReadBlock(shape_.L + 1, head), StatusCode::kDataLoss,
                     {file, "lm_head.weight"});
}

TEST_F(HfCheckpointBadInput, NoWeightsAndNoConfigAreNotFound) {
  ExpectOneLineError(Open(), StatusCode::kNotFound, {dir() + "/config.json"});
  WriteFile(dir() + "/config.json", LlamaConfigText(shape_));
  ExpectOneLineError(Open(), StatusCode::kNotFound, {dir(), "model.safetensors"});
}

TEST_F(HfCheckpointBadInput, ConfigErrorsNameConfigJson) {
  WriteModelDir(dir(), R"({"model_type": "t5"})", tensors_);
  ExpectOneLineError(Open(), StatusCode::kInvalidArgument,
                     {dir() + "/config.json", "model_type",
                      "llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3_text, gpt2"});
}

}  // namespace
}  // namespace strata::models
