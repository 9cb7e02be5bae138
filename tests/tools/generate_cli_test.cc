// `strata generate` and `strata eval` on a byte-level Llama checkpoint the test trains: sampling
// is deterministic for a seed, greedy decoding continues the prompt by exactly the requested
// number of tokens, and bad requests are one-line errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "run_strata.h"

namespace {

namespace fs = std::filesystem;
using strata::cli_test::Lines;
using strata::cli_test::Result;
using strata::cli_test::RunStrata;
using ::testing::HasSubstr;

class GenerateCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("strata_generate_cli_" + std::to_string(::getpid())));
    fs::create_directories(*dir_);
    const std::string text = (*dir_ / "text.txt").string();
    std::string line = "to be or not to be, that is the question.\n";
    std::string all;
    for (int i = 0; i < 200; ++i) all += line;
    FILE* f = std::fopen(text.c_str(), "w");
    std::fwrite(all.data(), 1, all.size(), f);
    std::fclose(f);
    tokens_ = new std::string((*dir_ / "tokens.bin").string());
    const Result tok = RunStrata("tokenize --byte-level --input " + text + " --output " + *tokens_);
    ASSERT_EQ(tok.exit_code, 0) << tok.err;
    const Result train = RunStrata(
        "train --model llama-tiny --device host --data " + *tokens_ + " --seq-len 32 --steps 20 " +
        "--eval-every 0 --sample-bytes 0 --log-every 0 --offload-params host " +
        "--offload-optimizer host --save-dir " + (*dir_ / "ck").string());
    ASSERT_EQ(train.exit_code, 0) << train.out << train.err;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
    delete tokens_;
  }
  std::string Checkpoint() const { return (*dir_ / "ck").string(); }

  static fs::path* dir_;
  static std::string* tokens_;
};
fs::path* GenerateCliTest::dir_ = nullptr;
std::string* GenerateCliTest::tokens_ = nullptr;

TEST_F(GenerateCliTest, GreedyDecodingContinuesThePromptByTheRequestedTokens) {
  const Result r = RunStrata("generate --device host --checkpoint " + Checkpoint() +
                             " --prompt 'to be' --max-new-tokens 7 --temperature 0");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_EQ(r.out.size(), 5u + 7u + 1u) << r.out;  // prompt, 7 byte tokens, newline
  EXPECT_EQ(r.out.substr(0, 5), "to be");
}

TEST_F(GenerateCliTest, SamplingIsDeterministicForASeed) {
  const std::string args = "generate --device host --checkpoint " + Checkpoint() +
                           " --prompt 'to' --max-new-tokens 16 --temperature 1 --top-k 20 ";
  const Result a = RunStrata(args + "--seed 7");
  const Result b = RunStrata(args + "--seed 7");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
}

TEST_F(GenerateCliTest, EvalOfTheCheckpointCountsEveryFullWindow) {
  const Result r = RunStrata("eval --device host --checkpoint " + Checkpoint() + " --data " +
                             *tokens_ + " --seq-len 32 --max-tokens 100 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["windows"], 3);  // (100 - 1) / 32 full windows
  EXPECT_EQ(j["tokens"], 96);
  EXPECT_GT(j["loss"].get<double>(), 0.0);
  EXPECT_NEAR(j["perplexity"].get<double>(), std::exp(j["loss"].get<double>()), 1e-9);
}

TEST_F(GenerateCliTest, BadRequestsAreOneLineErrors) {
  const Result both = RunStrata("generate --checkpoint " + Checkpoint() + " --model-dir " +
                                dir_->string() + " --prompt x");
  EXPECT_EQ(both.exit_code, 1);
  EXPECT_EQ(Lines(both.err), 1) << both.err;
  EXPECT_THAT(both.err, HasSubstr("exactly one of --model-dir"));
  const Result too_long = RunStrata("eval --device host --checkpoint " + Checkpoint() + " --data " +
                                    *tokens_ + " --seq-len 4096");
  EXPECT_EQ(too_long.exit_code, 1);
  EXPECT_THAT(too_long.err, HasSubstr("exceeds the model's context of 64"));
}

}  // namespace
