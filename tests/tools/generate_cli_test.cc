// `strata generate` and `strata eval` on a byte-level Llama checkpoint the test trains: sampling
// is deterministic for a seed, greedy decoding continues the prompt by exactly the requested
// number of tokens, and bad requests are one-line errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
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

// A byte-level tokenizer.json over the 256 bytes, id = byte (GPT-2's bytes_to_unicode for the
// vocabulary's strings, no merges) whose decoder strips the first token's leading space, as Llama
// 2's and Mistral's do: the model's own byte ids, decoded as transformers decodes them.
std::string StrippingByteTokenizerJson() {
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : 256 + extra++;
    std::string utf8;
    if (cp < 0x80) {
      utf8 = std::string(1, static_cast<char>(cp));
    } else {
      utf8 = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
    }
    vocab[utf8] = b;
  }
  const nlohmann::ordered_json byte_level = {{"type", "ByteLevel"},
                                             {"add_prefix_space", false},
                                             {"trim_offsets", false},
                                             {"use_regex", false}};
  const nlohmann::ordered_json j = {
      {"version", "1.0"},
      {"added_tokens", nlohmann::ordered_json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer", byte_level},
      {"post_processor", nullptr},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {byte_level, {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"vocab", vocab},
        {"merges", nlohmann::ordered_json::array()}}}};
  return j.dump();
}

void WriteText(const fs::path& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr) << path;
  std::fwrite(text.data(), 1, text.size(), f);
  std::fclose(f);
}

// The ids that end a generation are transformers' generate()'s: generation_config.json's
// eos_token_id (a list: Gemma 3's <end_of_turn>, Llama 3's <|eot_id|>), else config.json's; and
// the continuation is decoded with the prompt, so a decoder that strips a leading space keeps
// the one between prompt and continuation.
TEST_F(GenerateCliTest, StopsAtTheModelsEndIdsAndKeepsTheSpaceAfterThePrompt) {
  const std::string dir = (*dir_ / "hf").string();
  Result r = RunStrata("export --checkpoint " + Checkpoint() + " --hf-dir " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string prompt = "to be or not to be, that is the";
  const std::string generate = "generate --device host --model-dir " + dir + " --prompt '" +
                               prompt + "' --max-new-tokens 9 --temperature 0";
  const Result plain = RunStrata(generate);  // bytes, no tokenizer, no end ids
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  ASSERT_EQ(plain.out.size(), prompt.size() + 9 + 1) << plain.out;
  const std::string continuation = plain.out.substr(prompt.size(), 9);
  // The trained model continues " question": the test needs a continuation that starts with a
  // space.
  ASSERT_EQ(continuation[0], ' ') << continuation;

  WriteText(fs::path(dir) / "tokenizer.json", StrippingByteTokenizerJson());
  r = RunStrata(generate);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, plain.out);  // the space after the prompt kept

  // The fourth byte of the continuation as an end id, beside one no model emits: the text stops
  // before its first occurrence.
  const auto end = static_cast<unsigned char>(continuation[3]);
  const std::string stopped = prompt + continuation.substr(0, continuation.find(continuation[3]));
  WriteText(fs::path(dir) / "generation_config.json",
            "{\"eos_token_id\": [255, " + std::to_string(end) + "]}");
  r = RunStrata(generate);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, stopped + "\n");
  // Without generation_config.json, config.json's single id.
  fs::remove(fs::path(dir) / "generation_config.json");
  std::ifstream in(fs::path(dir) / "config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["eos_token_id"] = end;
  WriteText(fs::path(dir) / "config.json", config.dump());
  r = RunStrata(generate);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, stopped + "\n");
  // A malformed generation_config.json: one line naming it and the key.
  WriteText(fs::path(dir) / "generation_config.json", R"({"eos_token_id": ["<eos>"]})");
  r = RunStrata(generate);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(Lines(r.err), 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("generation_config.json: eos_token_id holds \"<eos>\""));
}

// Sampling settings not given as flags come from generation_config.json as transformers reads
// it (do_sample false: greedy), and the model's context bounds prompt and continuation: a prompt
// past it is refused, a continuation stops at it with a note (a huge --max-new-tokens included).
TEST_F(GenerateCliTest, TakesGenerationConfigsSamplingAndStopsAtTheContext) {
  const std::string dir = (*dir_ / "hf_sampling").string();
  Result r = RunStrata("export --checkpoint " + Checkpoint() + " --hf-dir " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  fs::remove(fs::path(dir) / "generation_config.json");
  const std::string generate =
      "generate --device host --model-dir " + dir + " --prompt 'to be' --max-new-tokens 12 ";
  const Result greedy = RunStrata(generate + "--temperature 0");
  ASSERT_EQ(greedy.exit_code, 0) << greedy.err;
  const Result sampled = RunStrata(generate + "--temperature 1 --top-k 20 --top-p 0.9 --seed 7");
  ASSERT_EQ(sampled.exit_code, 0) << sampled.err;

  WriteText(fs::path(dir) / "generation_config.json", R"({"do_sample": false})");
  r = RunStrata(generate + "--seed 7");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, greedy.out);
  WriteText(fs::path(dir) / "generation_config.json",
            R"({"do_sample": true, "temperature": 1.0, "top_k": 20, "top_p": 0.9,
                "num_beams": 3})");
  r = RunStrata(generate + "--seed 7");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, sampled.out);
  EXPECT_THAT(r.err, HasSubstr("note: " + dir +
                               "/generation_config.json: num_beams 3 is not "
                               "applied"));
  r = RunStrata(generate + "--seed 7 --temperature 0");  // a flag over the file
  EXPECT_EQ(r.out, greedy.out);
  WriteText(fs::path(dir) / "generation_config.json", R"({"top_p": 2})");
  r = RunStrata(generate);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(Lines(r.err), 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("generation_config.json: top_p = 2 is outside [0, 1]"));
  fs::remove(fs::path(dir) / "generation_config.json");

  // llama-tiny's context is 64 tokens (bytes here).
  const std::string prompt(60, 'a');
  for (const char* n : {"10", "2147483647"}) {
    r = RunStrata("generate --device host --model-dir " + dir + " --prompt " + prompt +
                  " --temperature 0 --max-new-tokens " + n);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out.size(), 64u + 1u) << r.out;
    EXPECT_THAT(r.err, HasSubstr("stopped after 4 new tokens at the model's context of 64"));
  }
  r = RunStrata("generate --device host --model-dir " + dir + " --prompt " + std::string(65, 'a'));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(Lines(r.err), 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("the prompt is 65 tokens, more than the model's context of 64"));
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
