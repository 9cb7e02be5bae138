// `strata tokenize` as a user runs it, with a tiny SentencePiece model trained here.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "run_strata.h"

namespace {

namespace fs = std::filesystem;
using strata::cli_test::Lines;
using strata::cli_test::Result;
using strata::cli_test::RunStrata;
using ::testing::HasSubstr;

// Lines of words of two consonant-vowel syllables.
std::string MakeText(uint32_t seed, int lines) {
  const std::string consonants = "bdfgklmnprstvz", vowels = "aeiou";
  std::mt19937 gen(seed);
  std::string out;
  for (int l = 0; l < lines; ++l) {
    const int n = 3 + static_cast<int>(gen() % 6);
    for (int w = 0; w < n; ++w) {
      if (w > 0) out += ' ';
      for (int s = 0; s < 2; ++s) {
        out += consonants[gen() % 5];  // few consonants: frequent syllables
        out += vowels[gen() % vowels.size()];
      }
    }
    out += ".\n";
  }
  return out;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class TokenizeCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_tokenize_cli_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    text_ = (dir_ / "text.txt").string();
    std::ofstream(text_) << MakeText(1, 300);
    const auto status = sentencepiece::SentencePieceTrainer::Train(
        fmt::format("--input={} --model_prefix={} --vocab_size=60 --model_type=bpe --num_threads=1 "
                    "--minloglevel=2",
                    text_, (dir_ / "tok").string()));
    ASSERT_TRUE(status.ok()) << status.ToString();
    model_ = (dir_ / "tok.model").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path dir_;
  std::string text_;
  std::string model_;
};

TEST_F(TokenizeCliTest, WritesTheTokensOfTheTextAsAnLlmcTokenFile) {
  const std::string out = (dir_ / "train.bin").string();
  const Result r =
      RunStrata("tokenize --tokenizer " + model_ + " --input " + text_ + " --output " + out);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  // The expected ids, from the library directly: BOS, then the whole file.
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(model_).ok());
  std::vector<int> ids;
  ASSERT_TRUE(sp.Encode(ReadFile(text_), &ids).ok());
  ids.insert(ids.begin(), sp.bos_id());

  const std::string bytes = ReadFile(out);
  ASSERT_EQ(bytes.size(), 1024 + 2 * ids.size());
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], static_cast<int32_t>(ids.size()));
  for (size_t i = 0; i < ids.size(); ++i) {
    uint16_t t;
    std::memcpy(&t, bytes.data() + 1024 + 2 * i, 2);
    ASSERT_EQ(t, ids[i]) << i;
  }
  EXPECT_EQ(Lines(r.out), 1) << r.out;
  EXPECT_THAT(r.out, HasSubstr(fmt::format("{} tokens", ids.size())));
  const double per_token =
      static_cast<double>(fs::file_size(text_)) / static_cast<double>(ids.size() - 1);
  EXPECT_THAT(r.out, HasSubstr(fmt::format("{:.3f} bytes/token", per_token)));
}

TEST_F(TokenizeCliTest, ATokenizerThatDoesNotLoadIsOneLineNamingItAndWritesNothing) {
  const std::string bad = (dir_ / "bad.model").string();
  std::ofstream(bad) << "not a model";
  const std::string out = (dir_ / "train.bin").string();
  const Result r =
      RunStrata("tokenize --tokenizer " + bad + " --input " + text_ + " --output " + out);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(Lines(r.err), 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("tokenizer file '" + bad + "'"));
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(TokenizeCliTest, AMissingInputIsOneLineNamingItAndWritesNothing) {
  const std::string missing = (dir_ / "missing.txt").string();
  const std::string out = (dir_ / "train.bin").string();
  const Result r =
      RunStrata("tokenize --tokenizer " + model_ + " --input " + missing + " --output " + out);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(Lines(r.err), 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("'" + missing + "'"));
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(TokenizeCliTest, AnOutputThatIsTheInputIsRefused) {
  const std::string before = ReadFile(text_);
  const Result r =
      RunStrata("tokenize --tokenizer " + model_ + " --input " + text_ + " --output " + text_);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("is the input file"));
  EXPECT_EQ(ReadFile(text_), before);
}

TEST_F(TokenizeCliTest, ByteLevelWritesEveryByteAsATokenAndNeedsNoTokenizer) {
  std::ofstream(text_, std::ios::binary) << std::string("a\xff\n\x01z", 5);
  const std::string out = (dir_ / "bytes.bin").string();
  const Result r = RunStrata("tokenize --byte-level --input " + text_ + " --output " + out);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string bytes = ReadFile(out);
  ASSERT_EQ(bytes.size(), 1024u + 2 * 5);
  const uint16_t want[5] = {'a', 0xff, '\n', 1, 'z'};
  for (int i = 0; i < 5; ++i) {
    uint16_t t;
    std::memcpy(&t, bytes.data() + 1024 + 2 * i, 2);
    EXPECT_EQ(t, want[i]) << i;
  }
  const Result neither = RunStrata("tokenize --input " + text_ + " --output " + out + ".2");
  EXPECT_EQ(neither.exit_code, 1);
  EXPECT_THAT(neither.err, HasSubstr("--byte-level"));
  EXPECT_FALSE(fs::exists(out + ".2"));
}

}  // namespace
