// `strata tokenize` as a user runs it, with a tiny SentencePiece model trained here: text, and
// instruction data (JSON lines) rendered with a chat template into tokens with flags; and with a
// Llama 3 model directory (a byte-level tokenizer.json from tests/data/hf_tokenizer_files.h and
// a tokenizer_config.json holding Meta's chat template).
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "data/instruction_data.h"
#include "data/token_dataset.h"
#include "data/tokenizer.h"
#include "run_strata.h"
#include "tests/data/hf_tokenizer_files.h"

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

// --output as every command's output file: a symlink is followed (the link stays, its target is
// replaced whole), and /dev/stdout (here a pipe) receives the token file alone, the summary line
// going to stderr.
TEST_F(TokenizeCliTest, OutputThroughASymlinkOrToStdoutIsTheTokenFileAlone) {
  std::ofstream(text_, std::ios::binary) << "abc";
  const std::string target = (dir_ / "target.bin").string();
  const std::string link = (dir_ / "link.bin").string();
  std::ofstream(target) << "old";
  fs::create_symlink("target.bin", link);
  const Result r = RunStrata("tokenize --byte-level --input " + text_ + " --output " + link);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(ReadFile(target).size(), 1024u + 2 * 3);
  EXPECT_THAT(r.out, HasSubstr("wrote '" + link + "'"));

  const Result piped =
      RunStrata("tokenize --byte-level --input " + text_ + " --output /dev/stdout");
  ASSERT_EQ(piped.exit_code, 0) << piped.err;
  EXPECT_EQ(piped.out, ReadFile(target)) << "stdout holds exactly the token file";
  EXPECT_THAT(piped.err, HasSubstr("wrote '/dev/stdout': 3 byte-level tokens"));
}

// --- instruction data (JSONL) ---

// A model directory: a SentencePiece model with ChatML's special tokens, and a
// tokenizer_config.json whose chat_template is `jinja` (none when empty).
std::string MakeChatModel(const fs::path& dir, const std::string& text, const std::string& jinja) {
  fs::create_directories(dir);
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      fmt::format("--input={} --model_prefix={} --vocab_size=70 --model_type=bpe --num_threads=1 "
                  "--minloglevel=2 --user_defined_symbols=<|im_start|>,<|im_end|>",
                  text, (dir / "tokenizer").string()));
  EXPECT_TRUE(status.ok()) << status.ToString();
  if (!jinja.empty()) {
    std::ofstream(dir / "tokenizer_config.json") << "{\"chat_template\": \"" << jinja << "\"}";
  }
  return (dir / "tokenizer.model").string();
}

constexpr const char* kChatmlJinja =
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\\\n' + m['content'] + "
    "'<|im_end|>\\\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant"
    "\\\\n' }}{% endif %}";

TEST_F(TokenizeCliTest, JsonlIsRenderedWithTheTemplateOfTokenizerConfigAndWrittenWithFlags) {
  const std::string model = MakeChatModel(dir_ / "chat", text_, kChatmlJinja);
  const std::string input = (dir_ / "sft.jsonl").string();
  const std::vector<std::string> responses = {"bako dige", "fu", "gebo daku kafi"};
  std::ofstream(input) << R"({"prompt": "dabo", "response": "bako dige"})"
                       << "\n"
                       << R"({"messages": [{"role": "system", "content": "fika"}, )"
                       << R"({"role": "user", "content": "kadi"}, )"
                       << R"({"role": "assistant", "content": "fu"}]})"
                       << "\n\n"
                       << R"({"prompt": "gobe", "response": "gebo daku kafi"})"
                       << "\n";
  const std::string out = (dir_ / "sft.bin").string();
  const Result r =
      RunStrata("tokenize --tokenizer " + model + " --input " + input + " --output " + out);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(Lines(r.out), 1) << r.out;
  EXPECT_THAT(r.out, HasSubstr("chat template jinja (chat_template of '"));
  EXPECT_THAT(r.out, HasSubstr("3 examples"));

  const std::string bytes = ReadFile(out);
  int32_t header[4];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[3], 1);
  const size_t n = static_cast<size_t>(header[2]);
  ASSERT_EQ(bytes.size(), 1024 + 2 * n + n);
  EXPECT_THAT(r.out, HasSubstr(fmt::format("{} tokens,", n)));
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(model).ok());
  // Each example's tokens in the loss decode to its response and <|im_end|>.
  std::vector<std::vector<int>> in_loss;
  size_t in_loss_count = 0;
  for (size_t i = 0; i < n; ++i) {
    uint16_t t;
    std::memcpy(&t, bytes.data() + 1024 + 2 * i, 2);
    const auto flag = static_cast<uint8_t>(bytes[1024 + 2 * n + i]);
    if (flag & 2) in_loss.emplace_back();
    if (i == 0) {
      EXPECT_TRUE(flag & 2);
    }
    if (flag & 1) in_loss.back().push_back(t), ++in_loss_count;
    ASSERT_EQ(flag & ~3, 0) << i;
  }
  ASSERT_EQ(in_loss.size(), 3u);
  for (size_t e = 0; e < 3; ++e) {
    std::string text;
    ASSERT_TRUE(sp.Decode(in_loss[e], &text).ok());
    EXPECT_EQ(text, responses[e] + "<|im_end|>") << e;
  }
  EXPECT_THAT(r.out, HasSubstr(fmt::format("{} tokens in loss", in_loss_count)));
}

// TRL's preference data (the first line has "chosen"): each pair its chosen side, then its
// rejected side, the pair start on the chosen side's first token, each side's completion and its
// <|im_end|> in the loss and nothing of the prompt.
TEST_F(TokenizeCliTest, PreferenceJsonlIsWrittenAsPairsOfChosenThenRejectedWithPairStarts) {
  const std::string model = MakeChatModel(dir_ / "chat_pref", text_, kChatmlJinja);
  const std::string input = (dir_ / "prefs.jsonl").string();
  std::ofstream(input) << R"({"prompt": "dabo", "chosen": "bako dige", "rejected": "fu"})"
                       << "\n\n"
                       << R"({"prompt": [{"role": "user", "content": "kadi"}, )"
                       << R"({"role": "assistant", "content": "gobe"}, )"
                       << R"({"role": "user", "content": "dabo"}], )"
                       << R"("chosen": [{"role": "assistant", "content": "gebo daku"}], )"
                       << R"("rejected": [{"role": "assistant", "content": "kafi"}]})"
                       << "\n";
  const std::vector<std::string> completions = {"bako dige", "fu", "gebo daku", "kafi"};
  const std::string out = (dir_ / "prefs.bin").string();
  const Result r =
      RunStrata("tokenize --tokenizer " + model + " --input " + input + " --output " + out);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(Lines(r.out), 1) << r.out;
  EXPECT_THAT(r.out, HasSubstr("tokenized preference data '" + input + "'"));
  EXPECT_THAT(r.out, HasSubstr(": 2 pairs, "));

  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(model).ok());
  auto file = strata::data::TokenDataset::Open({out}, sp.GetPieceSize());
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  ASSERT_TRUE(file->has_flags());
  const auto n = static_cast<size_t>(file->num_tokens());
  std::vector<int32_t> tokens(n);
  std::vector<uint8_t> flags(n);
  file->Read(0, static_cast<int64_t>(n), tokens.data());
  file->ReadFlags(0, static_cast<int64_t>(n), flags.data());
  std::vector<std::vector<int>> in_loss;  // per example
  std::vector<bool> pair_start;
  for (size_t i = 0; i < n; ++i) {
    if (i == 0) {
      ASSERT_TRUE(flags[i] & strata::data::kTokenFlagExampleStart);
    }
    if (flags[i] & strata::data::kTokenFlagExampleStart) {
      in_loss.emplace_back();
      pair_start.push_back((flags[i] & strata::data::kTokenFlagPairStart) != 0);
    } else {
      ASSERT_EQ(flags[i] & strata::data::kTokenFlagPairStart, 0) << i;
    }
    if (flags[i] & strata::data::kTokenFlagInLoss) in_loss.back().push_back(tokens[i]);
  }
  EXPECT_EQ(pair_start, (std::vector<bool>{true, false, true, false}));
  ASSERT_EQ(in_loss.size(), 4u);
  for (size_t e = 0; e < 4; ++e) {
    std::string text;
    ASSERT_TRUE(sp.Decode(in_loss[e], &text).ok());
    EXPECT_EQ(text, completions[e] + "<|im_end|>") << e;
  }
}

TEST_F(TokenizeCliTest, ABadPreferenceLineIsOneLineNamingItAndWritesNothing) {
  const std::string model = MakeChatModel(dir_ / "chat_bad", text_, kChatmlJinja);
  const std::string out = (dir_ / "bad.bin").string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"prompt": "dabo", "chosen": "fu"})", "line 2: no \"rejected\""},
      {R"({"prompt": "dabo", "response": "fu"})",
       "line 2: instruction data (\"messages\" or \"response\"), not a preference pair"},
  };
  for (const auto& [line, expected] : cases) {
    const std::string input = (dir_ / "bad.jsonl").string();
    std::ofstream(input) << R"({"prompt": "dabo", "chosen": "bako", "rejected": "fu"})"
                         << "\n"
                         << line << "\n";
    const Result r =
        RunStrata("tokenize --tokenizer " + model + " --input " + input + " --output " + out);
    EXPECT_EQ(r.exit_code, 1) << line;
    EXPECT_EQ(Lines(r.err), 1) << r.err;
    EXPECT_THAT(r.err, HasSubstr("'" + input + "' " + expected));
    EXPECT_FALSE(fs::exists(out));
  }
}

// The whole path: JSON lines rendered into a flagged token file, then trained on, packed and not:
// the engine takes the ignored targets and the per-example positions, and the run counts only
// the response tokens in its loss (tokens_in_loss below every token it saw, above zero).
TEST_F(TokenizeCliTest, TrainingOnTokenizedInstructionDataCountsOnlyTheResponsesInItsLoss) {
  const std::string model = MakeChatModel(dir_ / "chat_train", text_, kChatmlJinja);
  const std::string input = (dir_ / "train.jsonl").string();
  {
    std::ofstream in(input);
    for (int i = 0; i < 40; ++i) {
      in << R"({"prompt": "dabo kadi gobe", "response": ")" << (i % 2 ? "bako dige" : "fu")
         << "\"}\n";
    }
  }
  const std::string data = (dir_ / "train.bin").string();
  const Result tok =
      RunStrata("tokenize --tokenizer " + model + " --input " + input + " --output " + data);
  ASSERT_EQ(tok.exit_code, 0) << tok.out << tok.err;
  const int steps = 3, accum = 2, batch = 2, seq = 32;
  for (const char* pack : {"--pack", ""}) {
    SCOPED_TRACE(*pack ? "packed" : "one example per row");
    const std::string summary = (dir_ / "summary.json").string();
    const Result r = RunStrata(fmt::format(
        "train --model llama-tiny --device host --data {} {} --seq-len {} --micro-batch-size {} "
        "--grad-accum-steps {} --steps {} --eval-every 0 --sample-bytes 0 --log-every 0 "
        "--offload-params host "
        "--offload-optimizer host --summary-json {}",
        data, pack, seq, batch, accum, steps, summary));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    std::ifstream in(summary);
    const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t at = json.find("\"tokens_in_loss\":");
    ASSERT_NE(at, std::string::npos) << json;
    const long long in_loss = std::atoll(json.c_str() + at + 17);
    EXPECT_GT(in_loss, 0) << json;
    EXPECT_LT(in_loss, steps * accum * batch * seq / 2) << json;
    EXPECT_EQ(json.find("nan"), std::string::npos) << json;
  }
}

// `strata eval` of a flagged file scores whole examples and only their responses: its loss is
// what training's validation reports for the same file and weights (the validation batches
// chosen here cover every row once: 8 rows, --eval-batches 4 of 2), and its target count is the
// responses' tokens. A plain-window reading of the same file would score the prompts too.
TEST_F(TokenizeCliTest, EvalOfInstructionDataIsTheTrainingValidationLossOverTheResponses) {
  const auto jsonl = [&](const std::string& name, int n, int offset) {
    const std::string path = (dir_ / name).string();
    std::ofstream out(path);
    for (int i = 0; i < n; ++i) {
      // {"prompt": "Q: <digit>\n", "response": "A: <digit>\n"}, JSON escapes written out.
      out << "{\"prompt\": \"Q: " << (i + offset) % 7
          << "\\n\", \"response\": \"A: " << (i + offset) % 5 << "\\n\"}\n";
    }
    return path;
  };
  const std::string train = (dir_ / "sft_train.bin").string(),
                    val = (dir_ / "sft_val.bin").string();
  for (const auto& [in, out] : {std::pair{jsonl("sft_train.jsonl", 40, 0), train},
                                std::pair{jsonl("sft_val.jsonl", 8, 3), val}}) {
    const Result tok = RunStrata("tokenize --byte-level --input " + in + " --output " + out);
    ASSERT_EQ(tok.exit_code, 0) << tok.out << tok.err;
  }
  const std::string summary = (dir_ / "sft_summary.json").string(),
                    save = (dir_ / "sft_ckpt").string();
  const Result r = RunStrata(fmt::format(
      "train --model llama-tiny --device host --data {} --val-data {} --seq-len 32 "
      "--micro-batch-size 2 --grad-accum-steps 2 --steps 4 --eval-every 4 --eval-batches 4 "
      "--sample-bytes 0 --log-every 0 --offload-params host --offload-optimizer host "
      "--save-dir {} --summary-json {}",
      train, val, save, summary));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json s = nlohmann::json::parse(ReadFile(summary));
  const Result e = RunStrata(fmt::format(
      "eval --checkpoint {} --data {} --seq-len 32 --micro-batch-size 2 --json", save, val));
  ASSERT_EQ(e.exit_code, 0) << e.out << e.err;
  const nlohmann::json got = nlohmann::json::parse(e.out.substr(e.out.rfind('{')));
  // The training run reports its float mean; eval prints the double it rounds from.
  EXPECT_NEAR(got["loss"].get<double>(), s["val_loss"].get<double>(),
              1e-6 * s["val_loss"].get<double>())
      << e.out;
  // "A: d\n" of each of the 8 examples: 5 response bytes in the loss ("Q: d\n" predicts none).
  EXPECT_EQ(got["tokens"].get<int64_t>(), 8 * 5) << e.out;
  EXPECT_EQ(got["windows"].get<int64_t>(), 8) << e.out;
  const Result capped = RunStrata(
      fmt::format("eval --checkpoint {} --data {} --seq-len 32 --max-tokens 64", save, val));
  EXPECT_NE(capped.exit_code, 0);
  EXPECT_THAT(capped.err, HasSubstr("drop --max-tokens"));
}

// A byte-level model's instruction data: the `none` template over bytes, the response bytes (no
// EOS: bytes have none) in the loss; a template that needs special tokens is refused.
TEST_F(TokenizeCliTest, ByteLevelJsonlIsPromptThenResponseBytesWithTheResponseInTheLoss) {
  const std::string input = (dir_ / "bytes.jsonl").string();
  std::ofstream(input) << R"({"prompt": "Q: hi\n", "response": "A: yo\n"})"
                       << "\n";
  const std::string out = (dir_ / "bytes.bin").string();
  const Result r = RunStrata("tokenize --byte-level --input " + input + " --output " + out);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string bytes = ReadFile(out);
  const std::string text = "Q: hi\nA: yo\n";
  ASSERT_EQ(bytes.size(), 1024 + 3 * text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    uint16_t t;
    std::memcpy(&t, bytes.data() + 1024 + 2 * i, 2);
    EXPECT_EQ(t, static_cast<unsigned char>(text[i])) << i;
    const auto flag = static_cast<uint8_t>(bytes[1024 + 2 * text.size() + i]);
    EXPECT_EQ(flag, (i == 0 ? 2 : 0) | (i >= 6 ? 1 : 0)) << i;
  }
  const Result chatml = RunStrata("tokenize --byte-level --chat-template chatml --input " + input +
                                  " --output " + out + ".2");
  EXPECT_NE(chatml.exit_code, 0);
  EXPECT_THAT(chatml.err, HasSubstr("use --chat-template none"));
  EXPECT_FALSE(fs::exists(out + ".2"));
}

// A Hugging Face model directory as Llama 3 ships it: `auto` finds Meta's template in
// tokenizer_config.json, and the flagged file holds what the library renders, its tokens in the
// loss decoding to each (trimmed) response and its <|eot_id|>.
TEST_F(TokenizeCliTest, ALlama3TokenizerJsonDirectoryRendersJsonlWithTheLlama3Template) {
  namespace hf = strata::data::testing;
  const hf::Model model = hf::ByteLevelModel(hf::kLlama3Specials);
  const fs::path model_dir = dir_ / "Meta-Llama-3-8B-Instruct";
  hf::WriteLlama3Dir(model_dir, model);
  const std::string input = (dir_ / "sft.jsonl").string();
  std::ofstream(input)
      << R"({"prompt": "Who wrote Romeo and Juliet?", "response": " Shakespeare.\n"})"
      << "\n"
      << R"({"messages": [{"role": "system", "content": "Réponds en français."}, )"
      << R"({"role": "user", "content": "Bonjour 👋"}, )"
      << R"({"role": "assistant", "content": "Salut ! Ça va ? 😀"}, )"
      << R"({"role": "user", "content": "Et en russe ?"}, )"
      << R"({"role": "assistant", "content": "Привет, мир! 👍🏽"}]})"
      << "\n";
  const std::vector<std::string> want_in_loss = {"Shakespeare.<|eot_id|>",
                                                 "Salut ! Ça va ? 😀<|eot_id|>",
                                                 "Привет, мир! 👍🏽<|eot_id|>"};
  const std::string out = (dir_ / "sft.bin").string();
  const Result r = RunStrata("tokenize --tokenizer " + model_dir.string() + " --input " + input +
                             " --output " + out);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(Lines(r.out), 1) << r.out;
  EXPECT_THAT(r.out, HasSubstr("chat template jinja (chat_template of '" +
                               (model_dir / "tokenizer_config.json").string() + "')"));
  EXPECT_THAT(r.out, HasSubstr("2 examples"));

  auto tokenizer = strata::data::Tokenizer::Load(model_dir.string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  auto file = strata::data::TokenDataset::Open({out}, (*tokenizer)->vocab_size());
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  ASSERT_TRUE(file->has_flags());
  const auto n = static_cast<size_t>(file->num_tokens());
  std::vector<int32_t> tokens(n);
  std::vector<uint8_t> flags(n);
  file->Read(0, static_cast<int64_t>(n), tokens.data());
  file->ReadFlags(0, static_cast<int64_t>(n), flags.data());
  // What the library renders, token for token.
  auto format = strata::data::ResolveChatFormat("auto", model_dir.string());
  ASSERT_TRUE(format.ok()) << format.status().ToString();
  auto want = strata::data::TokenizeInstructionFile(**tokenizer, *format, input);
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  EXPECT_EQ(tokens, want->tokens);
  EXPECT_EQ(flags, want->flags);
  // Each example starts at <|begin_of_text|>; the in-loss runs are the responses.
  const int32_t bos = model.specials.at("<|begin_of_text|>");
  std::vector<std::vector<int32_t>> runs;
  int examples = 0;
  for (size_t i = 0; i < n; ++i) {
    if (flags[i] & strata::data::kTokenFlagExampleStart) {
      ++examples;
      EXPECT_EQ(tokens[i], bos) << i;
    }
    const bool loss = flags[i] & strata::data::kTokenFlagInLoss;
    if (loss && (i == 0 || !(flags[i - 1] & strata::data::kTokenFlagInLoss))) runs.emplace_back();
    if (loss) runs.back().push_back(tokens[i]);
  }
  EXPECT_EQ(examples, 2);
  ASSERT_EQ(runs.size(), want_in_loss.size());
  for (size_t k = 0; k < runs.size(); ++k) {
    auto text = (*tokenizer)->Decode(runs[k]);
    ASSERT_TRUE(text.ok()) << text.status().ToString();
    EXPECT_EQ(*text, want_in_loss[k]) << k;
  }
}

TEST_F(TokenizeCliTest, AnUnknownOrUnparsableChatTemplateIsRefusedAndWritesNothing) {
  const std::string input = (dir_ / "sft.jsonl").string();
  std::ofstream(input) << R"({"prompt": "dabo", "response": "bako"})"
                       << "\n";
  const std::string out = (dir_ / "sft.bin").string();
  const std::string model =
      MakeChatModel(dir_ / "bad_template", text_,
                    "{% for m in messages %}<start_of_turn>{{ m['content'] }}{% include 'x' %}");
  const Result unknown = RunStrata("tokenize --tokenizer " + model + " --input " + input +
                                   " --output " + out + " --chat-template gemma");
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_EQ(Lines(unknown.err), 1) << unknown.err;
  EXPECT_THAT(unknown.err, HasSubstr("chat template 'gemma' is not one of auto, llama3, chatml, "
                                     "mistral, none"));
  // The model's own template that the engine cannot parse: one line naming the file, the line
  // and the construct.
  const Result unparsable =
      RunStrata("tokenize --tokenizer " + model + " --input " + input + " --output " + out);
  EXPECT_EQ(unparsable.exit_code, 1);
  EXPECT_EQ(Lines(unparsable.err), 1) << unparsable.err;
  EXPECT_THAT(unparsable.err, HasSubstr("tokenizer_config.json' chat_template line 1"));
  EXPECT_THAT(unparsable.err, HasSubstr("include"));
  EXPECT_FALSE(fs::exists(out));
  // Named, the template is used whatever the config says; a bad line names file and line.
  std::ofstream(input, std::ios::app) << R"({"prompt": "dabo"})"
                                      << "\n";
  const Result bad_line = RunStrata("tokenize --tokenizer " + model + " --input " + input +
                                    " --output " + out + " --chat-template none");
  EXPECT_EQ(bad_line.exit_code, 1);
  EXPECT_THAT(bad_line.err, HasSubstr("'" + input + "' line 2: the example has no \"response\""));
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace

// A run trained with --tokenizer exports the tokenizer it trained with, under the name
// transformers reads (tokenizer.model), whether --tokenizer named a file of another name, a
// directory, or the model directory's own file; a tokenizer from elsewhere replaces the model
// directory's; and the checkpoint generates with it without --tokenizer.
TEST_F(TokenizeCliTest, ARunTrainedWithTokenizerExportsTheTokenizerItTrainedWith) {
  const auto path = [&](const std::string& name) { return (dir_ / name).string(); };
  const auto train = [&](const std::string& model_flags, const std::string& tokenizer,
                         const std::string& save) {
    return RunStrata("train " + model_flags + " --device host --data " + text_ + " --tokenizer " +
                     tokenizer + " --steps 2 --seq-len 32 --eval-every 0 " +
                     "--sample-bytes 0 --log-every 0 --save-dir " + path(save));
  };
  // tok.model (the fixture's, 60 pieces), as a file of its own name.
  Result r = train("--model llama-tiny", model_, "ck_file");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  r = RunStrata("export --checkpoint " + path("ck_file") + " --hf-dir " + path("out_file"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(ReadFile(path("out_file/tokenizer.model")), ReadFile(model_));
  EXPECT_FALSE(fs::exists(path("out_file/tok.model")));
  // The preset's config.json has no token ids of its own: the tokenizer's.
  auto tokenizer = strata::data::Tokenizer::Load(model_);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  ASSERT_GE((*tokenizer)->eos_id(), 0);
  const auto config = nlohmann::json::parse(ReadFile(path("out_file/config.json")));
  EXPECT_EQ(config.value("bos_token_id", -1), (*tokenizer)->bos_id()) << config;
  EXPECT_EQ(config.value("eos_token_id", -1), (*tokenizer)->eos_id()) << config;
  r = RunStrata("generate --device host --checkpoint " + path("ck_file") +
                " --prompt 'bada kefi' --max-new-tokens 4 --temperature 0");
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  // The exported directory as the model, with its own tokenizer.model named by --tokenizer.
  r = train("--model-dir " + path("out_file"), path("out_file/tokenizer.model"), "ck_own");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  r = RunStrata("export --checkpoint " + path("ck_own") + " --hf-dir " + path("out_own"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(ReadFile(path("out_own/tokenizer.model")), ReadFile(model_));
  // Another tokenizer (40 pieces) as a directory: it replaces the model directory's.
  fs::create_directories(dir_ / "other");
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      fmt::format("--input={} --model_prefix={} --vocab_size=40 --model_type=bpe --num_threads=1 "
                  "--minloglevel=2",
                  text_, path("other/tokenizer")));
  ASSERT_TRUE(status.ok()) << status.ToString();
  ASSERT_NE(ReadFile(path("other/tokenizer.model")), ReadFile(model_));
  r = train("--model-dir " + path("out_file"), path("other"), "ck_dir");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  r = RunStrata("export --checkpoint " + path("ck_dir") + " --hf-dir " + path("out_dir"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(ReadFile(path("out_dir/tokenizer.model")), ReadFile(path("other/tokenizer.model")));
}
