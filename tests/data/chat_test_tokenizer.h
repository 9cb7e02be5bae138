// The tiny SentencePiece model the instruction and preference data tests render with: BPE over
// generated syllables, the chat templates' special tokens as user-defined symbols and byte
// fallback, without a dummy prefix or normalization, so decoding the ids gives the rendered text
// back exactly.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace strata::data::testing {

// Lines of three to eight words of two consonant-vowel syllables.
inline std::string MakeSyllableText(int lines) {
  const std::string consonants = "bdfgklmnprst", vowels = "aeiou";
  std::mt19937 gen(4);
  std::string out;
  for (int l = 0; l < lines; ++l) {
    const int n = 3 + static_cast<int>(gen() % 6);
    for (int w = 0; w < n; ++w) {
      if (w > 0) out += ' ';
      for (int s = 0; s < 2; ++s) {
        out += consonants[gen() % consonants.size()];
        out += vowels[gen() % vowels.size()];
      }
    }
    out += ".\n";
  }
  return out;
}

// Trains the model into dir/tok.model (dir/text.txt its text); a failure fails the test.
inline void TrainChatTestTokenizer(const std::filesystem::path& dir) {
  const std::string text = (dir / "text.txt").string();
  std::ofstream(text) << MakeSyllableText(400);
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      fmt::format("--input={} --model_prefix={} --vocab_size=330 --model_type=bpe --num_threads=1 "
                  "--minloglevel=2 --byte_fallback=true --add_dummy_prefix=false "
                  "--normalization_rule_name=identity --remove_extra_whitespaces=false "
                  "--user_defined_symbols=<|begin_of_text|>,<|start_header_id|>,<|end_header_id|>,"
                  "<|eot_id|>,<|im_start|>,<|im_end|>",
                  text, (dir / "tok").string()));
  ASSERT_TRUE(status.ok()) << status.ToString();
}

// A test suite over that model: trained once per suite into a temporary directory (removed
// after the suite), loaded fresh for each test as tok_. Enc: a text's ids.
class ChatTokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::filesystem::path(std::filesystem::temp_directory_path() /
                                     ("strata_chat_tokenizer_" + std::to_string(::getpid())));
    std::filesystem::create_directories(*dir_);
    TrainChatTestTokenizer(*dir_);
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    auto t = Tokenizer::Load((*dir_ / "tok.model").string());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tok_ = std::move(*t);
  }
  std::vector<int32_t> Enc(std::string_view text) const {
    auto ids = tok_->Encode(text);
    EXPECT_TRUE(ids.ok());
    return *ids;
  }

  inline static std::filesystem::path* dir_ = nullptr;
  std::unique_ptr<Tokenizer> tok_;
};

}  // namespace strata::data::testing
