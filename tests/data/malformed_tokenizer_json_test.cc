// Tokenizer directories a broken or hostile user would hand in (issue 47): every one is refused
// by Tokenizer::Load with one line naming the file and the JSON pointer of the value, fast, and
// without sizing anything from an id out of range. Each case crashed, hung or was silently
// wrong before.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "data/tokenizer.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

class MalformedTokenizerJsonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_malformed_tokenizer_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes `json` as DIR/tokenizer.json (and `config` as tokenizer_config.json when given) and
  // loads it. A hang fails the test through its ctest TIMEOUT (CMakeLists.txt), not a clock here:
  // wall time on a loaded CI machine says nothing about the parser.
  StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& json,
                                            const std::string& config = "") {
    std::ofstream(dir_ / "tokenizer.json", std::ios::binary) << json;
    if (!config.empty()) std::ofstream(dir_ / "tokenizer_config.json", std::ios::binary) << config;
    return Tokenizer::Load(dir_.string());
  }
  std::string JsonPath() const { return (dir_ / "tokenizer.json").string(); }

  // The refusal of `t`: kInvalidArgument, one line, naming tokenizer.json and `pointer`.
  void ExpectRefused(const StatusOr<std::unique_ptr<Tokenizer>>& t, const std::string& pointer) {
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), StartsWith("tokenizer.json '" + JsonPath() + "': "));
    EXPECT_THAT(t.status().message(), HasSubstr(pointer));
    EXPECT_THAT(t.status().message(), Not(HasSubstr("\n")));
    EXPECT_THAT(t.status().message(), Not(HasSubstr("json.exception")));
    EXPECT_LT(t.status().message().size(), 600u);
  }

  fs::path dir_;
};

std::string Bpe(const std::string& vocab, const std::string& rest = "") {
  return R"({"model":{"type":"BPE","vocab":)" + vocab + R"(,"merges":[]})" + rest + "}";
}

// A component nested `depth` deep: {"type":"Sequence","KEY":[ ... {"type":"LEAF"} ... ]}.
std::string NestedSequence(const std::string& key, const std::string& leaf, int depth) {
  std::string s;
  for (int i = 0; i < depth; ++i) s += R"({"type":"Sequence",")" + key + R"(":[)";
  s += leaf;
  for (int i = 0; i < depth; ++i) s += "]}";
  return s;
}

TEST_F(MalformedTokenizerJsonTest, AVocabularyIdOfIntMaxIsRefusedNotACrash) {
  auto t = Load(Bpe(R"({"a":0,"b":2147483647})"));
  ExpectRefused(t, "/model/vocab/b");
  EXPECT_THAT(t.status().message(), HasSubstr("2147483647"));
}

TEST_F(MalformedTokenizerJsonTest, AnAddedTokenIdOfIntMaxIsRefusedNotACrash) {
  auto t = Load(Bpe(R"({"a":0,"b":1})",
                    R"(,"added_tokens":[{"id":2147483647,"content":"<s>","special":true}])"));
  ExpectRefused(t, "/added_tokens/0/id");
}

TEST_F(MalformedTokenizerJsonTest, ALargeIdIsRefusedBeforeAnyTableIsSizedFromIt) {
  for (const char* id : {"1000000000", "100000000"}) {
    auto t = Load(Bpe(std::string(R"({"a":0,"b":)") + id + "}"));
    ExpectRefused(t, "the largest token id " + std::string(id));
    EXPECT_THAT(t.status().message(), HasSubstr("65536"));
  }
}

TEST_F(MalformedTokenizerJsonTest, IdsOfTwoToThe32AndMoreAreRefusedNotWrapped) {
  ExpectRefused(Load(Bpe(R"({"a":0,"b":4294967297})")), "/model/vocab/b");
  ExpectRefused(Load(Bpe(R"({"a":0,"b":-1})")), "/model/vocab/b");
  ExpectRefused(Load(Bpe(R"({"a":0,"b":1.5})")), "/model/vocab/b");
  ExpectRefused(Load(Bpe(R"({"a":0})", R"(,"added_tokens":[{"id":4294967297,"content":"x"}])")),
                "/added_tokens/0/id");
}

TEST_F(MalformedTokenizerJsonTest, DeeplyNestedComponentsAreRefusedSayingTheLimit) {
  for (const auto& [top, key, leaf] :
       {std::tuple{"decoder", "decoders", R"({"type":"Fuse"})"},
        std::tuple{"normalizer", "normalizers", R"({"type":"NFC"})"},
        std::tuple{"post_processor", "processors", R"({"type":"ByteLevel"})"},
        std::tuple{"pre_tokenizer", "pretokenizers", R"({"type":"ByteLevel"})"}}) {
    for (int depth : {30000, 100000}) {
      auto t = Load(
          Bpe(R"({"a":0})", std::string(",\"") + top + "\":" + NestedSequence(key, leaf, depth)));
      ExpectRefused(t, "nested deeper than 64 levels (the limit)");
    }
    // Shallow enough for the JSON limit, too deep for components.
    auto t =
        Load(Bpe(R"({"a":0})", std::string(",\"") + top + "\":" + NestedSequence(key, leaf, 20)));
    ExpectRefused(t, std::string("/") + top + "/" + key + "/0/" + key);
    EXPECT_THAT(t.status().message(), HasSubstr("Sequence nested deeper than 16 (the limit)"));
  }
}

TEST_F(MalformedTokenizerJsonTest, ATemplateSpecialTokenIdOutsideTheVocabularyIsRefused) {
  auto t = Load(Bpe(R"({"a":0,"b":1,"<s>":2})",
                    R"(,"post_processor":{"type":"TemplateProcessing",)"
                    R"("single":[{"SpecialToken":{"id":"<s>","type_id":0}},)"
                    R"({"Sequence":{"id":"A","type_id":0}}],)"
                    R"("special_tokens":{"<s>":{"id":"<s>","ids":[999999],"tokens":["<s>"]}}})"));
  ExpectRefused(t, "/post_processor/special_tokens/<s>/ids/0");
  EXPECT_THAT(t.status().message(), HasSubstr("999999"));
}

TEST_F(MalformedTokenizerJsonTest, ATypeErrorNamesTheKeyNotNlohmannsCode) {
  auto t = Load(R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[],"unk_token":5}})");
  ExpectRefused(t, "/model/unk_token: must be a string, got 5");
  ExpectRefused(Load(R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[["a"]]}})"),
                "/model/merges/0");
  ExpectRefused(Load(R"({"model":{"type":"BPE","vocab":[],"merges":[]}})"), "/model/vocab");
  ExpectRefused(
      Load(Bpe(R"({"a":0})", R"(,"decoder":{"type":"Strip","content":" ","start":"x","stop":0})")),
      "/decoder/start");
}

TEST_F(MalformedTokenizerJsonTest, ANulEosTokenInTheConfigIsBlamedOnTheConfigAndPrintedEscaped) {
  auto t = Load(Bpe(R"({"a":0})"), R"({"eos_token":"\u0000"})");
  ASSERT_FALSE(t.ok());
  const std::string config = (dir_ / "tokenizer_config.json").string();
  EXPECT_THAT(t.status().message(), StartsWith("tokenizer_config.json '" + config + "': "));
  EXPECT_THAT(t.status().message(), HasSubstr("/eos_token '\\x00' is not a token of"));
  EXPECT_EQ(t.status().message().find('\0'), std::string::npos);
}

TEST_F(MalformedTokenizerJsonTest, AHugeEosTokenIsQuotedAsABoundedExcerpt) {
  auto t = Load(Bpe(R"({"a":0})"), R"({"eos_token":")" + std::string(10 << 20, 'x') + "\"}");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("/eos_token"));
  EXPECT_THAT(t.status().message(), HasSubstr("(10485760 bytes)"));
  EXPECT_LT(t.status().message().size(), 600u);
}

TEST_F(MalformedTokenizerJsonTest, ATokenizerConfigTypeErrorNamesItsKey) {
  auto t = Load(Bpe(R"({"a":0})"), R"({"bos_token":{"content":7}})");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("tokenizer_config.json '"));
  EXPECT_THAT(t.status().message(), HasSubstr("/bos_token/content: must be a string, got 7"));
}

TEST_F(MalformedTokenizerJsonTest, AFifoAsTokenizerJsonIsRefusedWithoutWaiting) {
  ASSERT_EQ(::mkfifo((dir_ / "tokenizer.json").c_str(), 0600), 0);
  // Opened non-blocking: no writer is needed for the refusal (a blocking open would wait for one
  // forever, and the test would end at its ctest TIMEOUT).
  auto t = Tokenizer::Load((dir_ / "tokenizer.json").string());
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("is a FIFO, not a regular file"));
}

TEST_F(MalformedTokenizerJsonTest, AWellFormedSmallFileStillLoads) {
  auto t = Load(Bpe(R"({"a":0,"b":1,"ab":2,"<s>":3})",
                    R"(,"added_tokens":[{"id":3,"content":"<s>","special":true}],)"
                    R"("post_processor":{"type":"TemplateProcessing",)"
                    R"("single":[{"SpecialToken":{"id":"<s>","type_id":0}},)"
                    R"({"Sequence":{"id":"A","type_id":0}}],)"
                    R"("special_tokens":{"<s>":{"id":"<s>","ids":[3],"tokens":["<s>"]}}})"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->vocab_size(), 4);
  EXPECT_EQ((*t)->bos_id(), 3);
}

}  // namespace
}  // namespace strata::data
