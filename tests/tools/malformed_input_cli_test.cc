// Issue 47, as a user with broken or hostile files meets it: `strata` given each minimal case of
// the issue exits 1 with one line naming the file and the key (or its position), writes nothing
// and returns within a few seconds. Each of these crashed (SIGSEGV, SIGABRT, stack overflow),
// hung, or named no file before.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "run_strata.h"
#include "tests/models/hf_test_dir.h"

namespace {

namespace fs = std::filesystem;
using strata::cli_test::Lines;
using strata::cli_test::Result;
using ::testing::HasSubstr;
using ::testing::Not;

class MalformedInputCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_malformed_cli_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "tok");
    Write("a.txt", "ab\n");
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string P(const std::string& name) const { return (dir_ / name).string(); }
  void Write(const std::string& name, const std::string& text) const {
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }
  // `strata ARGS` under a 20 s timeout: a hang shows as exit 124, not as a stuck test.
  // `limits`: shell commands run first in the same shell (ulimit).
  Result Run(const std::string& args, const std::string& limits = "") const {
    Result r{-1, "", ""};
    const std::string err = P("stderr");
    FILE* p = ::popen(
        (limits + "timeout 20 " + std::string(STRATA_BINARY) + " " + args + " 2>" + err).c_str(),
        "r");
    if (p != nullptr) {
      char buf[4096];
      for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) r.out.append(buf, n);
      const int status = ::pclose(p);
      r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    std::ifstream e(err, std::ios::binary);
    r.err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
    EXPECT_NE(r.exit_code, 124) << "hung: " << args;
    return r;
  }
  // Exit 1, one line "strata: error: ..." holding every one of `want`.
  static void ExpectOneLine(const Result& r, const std::vector<std::string>& want) {
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_EQ(Lines(r.err), 1) << r.err;
    EXPECT_THAT(r.err, HasSubstr("strata: error: "));
    for (const std::string& w : want) EXPECT_THAT(r.err, HasSubstr(w));
    EXPECT_LT(r.err.size(), 1000u);
  }
  // `strata tokenize` of a.txt with DIR/tok holding `tokenizer_json`: refused, o.bin not written.
  Result Tokenize(const std::string& tokenizer_json, const std::string& config = "",
                  const std::string& limits = "") {
    Write("tok/tokenizer.json", tokenizer_json);
    if (!config.empty()) Write("tok/tokenizer_config.json", config);
    Result r = Run(fmt::format("tokenize --tokenizer {} --input {} --output {}", P("tok"),
                               P("a.txt"), P("o.bin")),
                   limits);
    EXPECT_FALSE(fs::exists(P("o.bin")));
    return r;
  }

  fs::path dir_;
};

std::string Bpe(const std::string& vocab, const std::string& rest = "") {
  return R"({"model":{"type":"BPE","vocab":)" + vocab + R"(,"merges":[]})" + rest + "}";
}

TEST_F(MalformedInputCliTest, TokenizerIdsOutOfRangeAreOneLineNamingFileAndKey) {
  const std::string file = P("tok/tokenizer.json");
  ExpectOneLine(Tokenize(Bpe(R"({"a":0,"b":2147483647})")), {file, "/model/vocab/b"});
  ExpectOneLine(Tokenize(Bpe(R"({"a":0})", R"(,"added_tokens":[{"id":2147483647,"content":"x"}])")),
                {file, "/added_tokens/0/id"});
  ExpectOneLine(Tokenize(Bpe(R"({"a":0,"b":1000000000})")), {file, "largest token id"});
  ExpectOneLine(Tokenize(Bpe(R"({"a":0,"b":4294967297})")), {file, "/model/vocab/b"});
  ExpectOneLine(Tokenize(Bpe(R"({"a":0,"b":1,"c":2})",
                             R"(,"post_processor":{"type":"TemplateProcessing",)"
                             R"("single":[{"SpecialToken":{"id":"<s>","type_id":0}},)"
                             R"({"Sequence":{"id":"A","type_id":0}}],)"
                             R"("special_tokens":{"<s>":{"id":"<s>","ids":[999999]}}})")),
                {file, "/post_processor/special_tokens/<s>/ids/0"});
  ExpectOneLine(Tokenize(R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[],"unk_token":5}})"),
                {file, "/model/unk_token: must be a string"});
}

// An id of 1e8 made a 3.1 GB id table; under 1 GB of address space the refusal still comes (and
// a well-formed file still tokenizes, so the limit is not what refuses).
TEST_F(MalformedInputCliTest, ALargeIdIsRefusedWithinOneGigabyteOfAddressSpace) {
  const std::string limits = "ulimit -v 1000000; ";
  for (const char* id : {"100000000", "1000000000"}) {
    ExpectOneLine(Tokenize(Bpe(std::string(R"({"a":0,"b":)") + id + "}"), "", limits),
                  {P("tok/tokenizer.json"), std::string("largest token id ") + id});
  }
  Write("tok/tokenizer.json", Bpe(R"({"a":0,"b":1})"));
  const Result ok = Run(fmt::format("tokenize --tokenizer {} --input {} --output {}", P("tok"),
                                    P("a.txt"), P("o.bin")),
                        limits);
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(fs::exists(P("o.bin")));
}

TEST_F(MalformedInputCliTest, DeeplyNestedTokenizerComponentsAreOneLineSayingTheLimit) {
  std::string deep;
  for (int i = 0; i < 30000; ++i) deep += R"({"type":"Sequence","decoders":[)";
  deep += R"({"type":"Fuse"})";
  for (int i = 0; i < 30000; ++i) deep += "]}";
  ExpectOneLine(Tokenize(Bpe(R"({"a":0})", ",\"decoder\":" + deep)),
                {P("tok/tokenizer.json"), "the limit", "/decoder/"});
}

TEST_F(MalformedInputCliTest, ANulEosTokenIsBlamedOnTheConfigAndPrintedEscaped) {
  const Result r = Tokenize(Bpe(R"({"a":0,"b":1})"), R"({"eos_token":"\u0000"})");
  ExpectOneLine(
      r, {"tokenizer_config.json '" + P("tok/tokenizer_config.json") + "'", "/eos_token '\\x00'"});
  EXPECT_EQ(r.err.find('\0'), std::string::npos);
}

TEST_F(MalformedInputCliTest, ADeeplyNestedConfigJsonFieldIsOneLineNamingFileAndKey) {
  fs::create_directories(dir_ / "model");
  Write("model/config.json", R"({"model_type": "llama", "vocab_size": )" +
                                 std::string(100000, '[') + std::string(100000, ']') + "}");
  ExpectOneLine(
      Run(fmt::format("eval --model-dir {} --data {} --seq-len 8", P("model"), P("x.bin"))),
      {P("model") + "/config.json", "/vocab_size", "the limit"});
}

TEST_F(MalformedInputCliTest, MachineProfilesWithBadValuesAreOneLineNamingFileAndKey) {
  const std::string flags = "estimate --model gpt2-1.5b --micro-batch-size 8 --seq-len 1024";
  Write("deep.json", R"({"device": {"name": "x", "memory_GiB": 80, "bf16_TFLOPs": )" +
                         std::string(100000, '[') + std::string(100000, ']') +
                         R"(, "memory_GBps": 4000}})");
  ExpectOneLine(Run(flags + " --machine " + P("deep.json")),
                {P("deep.json"), "/device/bf16_TFLOPs", "the limit"});
  const std::string host = R"("optimizer_params_per_s": {"adamw": 1e9})";
  for (const auto& [json, key] : std::vector<std::pair<std::string, std::string>>{
           {R"({"pcie": {"h2d_GBps": 5e-324, "d2h_GBps": 40}})", "pcie.h2d_GBps"},
           {R"({"host": {"cores": 0.5, "memory_GiB": 64, )" + host + "}}", "host.cores"},
           {R"({"host": {"cores": 8, "memory_GiB": 1e20, )" + host + "}}", "host.memory_GiB"}}) {
    Write("p.json", json);
    const Result r = Run(flags + " --machine " + P("p.json"));
    ExpectOneLine(r, {P("p.json"), key, "plausible range"});
    EXPECT_THAT(r.err, Not(HasSubstr("--device-budget")));
  }
}

TEST_F(MalformedInputCliTest, AnEpsOfADeepSpeedConfigIsTheFilesKeyNotAFlag) {
  Write("ds.json", R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "eps": 1e308}}})");
  const Result r = Run("train --config " + P("ds.json") + " --steps 1");
  ExpectOneLine(r, {P("ds.json"), "'optimizer.params.eps'", "fits fp32"});
  EXPECT_THAT(r.err, Not(HasSubstr("--optimizer")));
}

TEST_F(MalformedInputCliTest, AFifoAsEvalDataIsRefusedWithoutHanging) {
  using namespace strata::models::testing;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "F32", 1);
  WriteModelDir(P("model"), LlamaConfigText(s), tensors);
  ASSERT_EQ(::mkfifo(P("fifo").c_str(), 0600), 0);
  const Result r = Run(fmt::format("eval --model-dir {} --data {} --seq-len 8 --device host",
                                   P("model"), P("fifo")));
  ExpectOneLine(r, {P("fifo"), "is a FIFO, not a regular file"});
}

TEST_F(MalformedInputCliTest, EvalOfTooFewTokensNamesTheFileNotATrainingSplit) {
  using namespace strata::models::testing;
  LlamaTestShape s;
  auto tensors = LlamaTestTensors(s);
  FillRandom(tensors, "F32", 1);
  WriteModelDir(P("model"), LlamaConfigText(s), tensors);
  // An llm.c token file of 3 tokens: fewer than one window of 8 + 1.
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520, header[1] = 1, header[2] = 3;
  std::ofstream out(P("short.bin"), std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), 1024);
  const uint16_t tokens[3] = {1, 2, 3};
  out.write(reinterpret_cast<const char*>(tokens), sizeof tokens);
  out.close();
  const Result r = Run(fmt::format("eval --model-dir {} --data {} --seq-len 8 --device host",
                                   P("model"), P("short.bin")));
  ExpectOneLine(r, {"token file '" + P("short.bin") + "'", "no full window"});
  EXPECT_THAT(r.err, Not(HasSubstr("training split")));
}

}  // namespace
