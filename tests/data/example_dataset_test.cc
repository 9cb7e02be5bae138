// Example data: token files with per-token flags read as rows of whole examples, one per row or
// packed; padding, truncation and skipping, targets that stop at example ends and follow the
// loss flags, positions that restart at each example; OpenTrainingData's choice of them.
#include "data/example_dataset.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/token_dataset.h"
#include "tests/data/training_data_options.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kVocab = 1 << 20;
constexpr int32_t I = kIgnoreTarget;

// Example e of length n: tokens 1000 * (e + 1) + i; the first half (rounded down) is prompt,
// the rest in the loss.
struct Examples {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;
};
Examples MakeExamples(const std::vector<int>& lengths, int first = 0) {
  Examples out;
  for (size_t e = 0; e < lengths.size(); ++e) {
    for (int i = 0; i < lengths[e]; ++i) {
      out.tokens.push_back(1000 * (first + static_cast<int>(e) + 1) + i);
      uint8_t f = i >= lengths[e] / 2 ? kTokenFlagInLoss : 0;
      if (i == 0) f |= kTokenFlagExampleStart;
      out.flags.push_back(f);
    }
  }
  return out;
}

class ExampleDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("strata_example_dataset_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  TokenDataset Open(const std::string& name, const Examples& ex) {
    const Status s = WriteTokenFile(Path(name), ex.tokens, ex.flags);
    EXPECT_TRUE(s.ok()) << s.ToString();
    auto d = TokenDataset::Open({Path(name)}, kVocab);
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    return *d;
  }

  // Every row of the validation split, in order (ValBatch with one row per batch element).
  static Batch AllValRows(const ExampleDataset& d, int seq_len) {
    Batch b;
    d.ValBatch(0, 1, static_cast<int>(d.val_stats().rows), seq_len, &b);
    return b;
  }

  fs::path dir_;
};

// The positions invariant of data::Batch, row by row.
void ExpectPositionsInvariant(const Batch& b, int T) {
  ASSERT_EQ(b.positions.size(), b.tokens.size());
  for (size_t r = 0; r * T < b.positions.size(); ++r) {
    const int32_t* p = b.positions.data() + r * T;
    EXPECT_EQ(p[0], 0) << "row " << r;
    for (int t = 1; t < T; ++t) {
      EXPECT_TRUE(p[t] == 0 || p[t] == p[t - 1] + 1) << "row " << r << " t " << t;
    }
  }
}

TEST_F(ExampleDatasetTest, OneExamplePerRowIsPaddedWithIgnoredTargetsAtPositionZero) {
  const TokenDataset train = Open("train.bin", MakeExamples({4}));
  const TokenDataset val = Open("val.bin", MakeExamples({3, 6}));
  auto d = ExampleDataset::Create(train, val, {.seq_len = 6, .pad_id = 7}, "test");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->val_stats().rows, 2);
  const Batch b = AllValRows(*d, 6);
  // Example 1: 1000 1001 1002, the last two in the loss; then padding.
  // Example 2: 2000..2005, 2003..2005 in the loss.
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{1000, 1001, 1002, 7, 7, 7,  //
                                            2000, 2001, 2002, 2003, 2004, 2005}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{1001, 1002, I, I, I, I,  //
                                             I, I, 2003, 2004, 2005, I}));
  // Each pad token at position 0: max(positions) + 1 is the longest example, 6 here.
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 0, 0, 0, 0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(d->val_stats().tokens_in_loss, 5);
  EXPECT_EQ(d->val_tokens(), 9);
}

TEST_F(ExampleDatasetTest, PackedRowsRestartPositionsAndNeverPredictAcrossExamples) {
  // T = 8: [3 + 4] (the 2 does not fit), [2 + 6], [9 truncated to 8].
  const TokenDataset train = Open("train.bin", MakeExamples({5}));
  const TokenDataset val = Open("val.bin", MakeExamples({3, 4, 2, 6, 9}));
  auto d = ExampleDataset::Create(train, val, {.seq_len = 8, .pack = true, .pad_id = 0}, "t");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->val_stats().rows, 3);
  EXPECT_EQ(d->val_stats().truncated, 1);
  const Batch b = AllValRows(*d, 8);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{1000, 1001, 1002, 2000, 2001, 2002, 2003, 0,  //
                                            3000, 3001, 4000, 4001, 4002, 4003, 4004, 4005,
                                            5000, 5001, 5002, 5003, 5004, 5005, 5006, 5007}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 0,  //
                                               0, 1, 0, 1, 2, 3, 4, 5,  //
                                               0, 1, 2, 3, 4, 5, 6, 7}));
  // In the loss: from position length / 2 on. The last token of each example (and of the
  // truncated one within the row) predicts nothing.
  EXPECT_EQ(b.targets, (std::vector<int32_t>{1001, 1002, I, I,    2002, 2003, I,    I,  //
                                             3001, I,    I, I,    4003, 4004, 4005, I,  //
                                             I,    I,    I, 5004, 5005, 5006, 5007, I}));
  ExpectPositionsInvariant(b, 8);
  EXPECT_THAT(d->Describe(), HasSubstr("packed; 1 truncated to 8 tokens"));
}

TEST_F(ExampleDatasetTest, SkippedExamplesAreLeftOutAndCounted) {
  const TokenDataset train = Open("train.bin", MakeExamples({2, 12, 3}));
  const TokenDataset val = Open("val.bin", MakeExamples({4}));
  ExampleRowOptions o{.seq_len = 4, .pack = true, .long_examples = LongExamples::kSkip};
  auto d = ExampleDataset::Create(train, val, o, "t");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->train_stats().skipped, 1);
  EXPECT_EQ(d->train_stats().rows, 2);  // [2], [3]: 2 + 3 > 4
  EXPECT_EQ(d->train_tokens(), 5);
  EXPECT_THAT(d->Describe(), HasSubstr("1 longer than 4 tokens skipped"));
  // Every training example skipped: an error naming the split.
  const TokenDataset long_only = Open("long.bin", MakeExamples({9, 10}));
  auto e = ExampleDataset::Create(long_only, val, o, "t");
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(e.status().message(), HasSubstr("training split"));
  EXPECT_THAT(e.status().message(), HasSubstr("2 longer skipped"));
}

// A prompt longer than T, truncated, leaves its example no target in the row: the example is
// left out and counted, so that no row trains nothing (a step that drew only such rows would have
// no loss to average). The same for an example without response tokens.
TEST_F(ExampleDatasetTest, ExamplesLeftWithoutATargetAreLeftOutAndCounted) {
  // T = 4: the 12 has its first loss token at 6, the 1 has none; the 10 keeps 5..9 out of
  // its first 4 tokens; the 2 and the 3 keep theirs.
  const TokenDataset train = Open("train.bin", MakeExamples({2, 12, 1, 10, 3}));
  const TokenDataset val = Open("val.bin", MakeExamples({4, 9}));
  for (const bool pack : {false, true}) {
    ExampleRowOptions o{.seq_len = 4, .pack = pack, .long_examples = LongExamples::kTruncate};
    auto d = ExampleDataset::Create(train, val, o, "t");
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->train_stats().no_target, 3);
    EXPECT_EQ(d->train_stats().truncated, 0);  // the long ones were left out, not truncated
    EXPECT_EQ(d->train_stats().rows, 2);       // [2] and [3] (2 + 3 > 4)
    EXPECT_EQ(d->train_tokens(), 5);
    EXPECT_EQ(d->train_stats().tokens_in_loss, 1 + 2);
    EXPECT_EQ(d->val_stats().no_target, 1);  // the 9: loss from 4 on
    EXPECT_THAT(d->Describe(),
                HasSubstr("; 4 without a target in the loss in their first 4 tokens skipped"));
    // Every row has a target in the loss.
    Batch b;
    d->ValBatch(0, 1, static_cast<int>(d->val_stats().rows), 4, &b);
    EXPECT_THAT(b.targets, ::testing::Contains(::testing::Ne(I)));
  }
  // Nothing left: an error that says why.
  const TokenDataset prompts_only = Open("prompts.bin", MakeExamples({12, 1}));
  auto e = ExampleDataset::Create(prompts_only, val, {.seq_len = 4}, "t");
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(e.status().message(),
              HasSubstr("has no example of at most 4 tokens with a target in the loss (2 "
                        "examples, 0 longer skipped, 2 without a target within their first 4 "
                        "tokens)"));
}

// `strata eval` scores one set of files: its refusal names them, not a training split.
TEST_F(ExampleDatasetTest, OneWholeSetNamesItsFilesNotATrainingSplit) {
  ExampleRowOptions o{.seq_len = 4, .pack = true, .long_examples = LongExamples::kSkip};
  const TokenDataset long_only = Open("long.bin", MakeExamples({9, 10}));
  auto e = ExampleDataset::CreateWhole(long_only, o, "token file 'long.bin'");
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(e.status().message(), HasSubstr("token file 'long.bin' has no example of at most 4"));
  EXPECT_THAT(e.status().message(), Not(HasSubstr("split")));
  const TokenDataset ok = Open("ok.bin", MakeExamples({2, 3}));
  auto d = ExampleDataset::CreateWhole(ok, o, "token file 'ok.bin'");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->val_stats().rows, d->train_stats().rows);
}

TEST_F(ExampleDatasetTest, PackedRowsHoldEveryExampleExactlyOnceInFileOrder) {
  std::mt19937 gen(5);
  std::vector<int> lengths;
  for (int i = 0; i < 200; ++i) lengths.push_back(1 + static_cast<int>(gen() % 20));
  const Examples ex = MakeExamples(lengths);
  const int T = 16;
  const TokenDataset val = Open("val.bin", ex);
  auto d = ExampleDataset::Create(Open("train.bin", MakeExamples({3})), val,
                                  {.seq_len = T, .pack = true, .pad_id = 0}, "t");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const Batch b = AllValRows(*d, T);
  ExpectPositionsInvariant(b, T);
  // Read back the examples from the rows: each run of positions from 0.
  std::vector<int32_t> seen;
  int64_t in_loss = 0;
  for (size_t i = 0; i < b.tokens.size(); ++i) {
    if (b.tokens[i] != 0) seen.push_back(b.tokens[i]);
    in_loss += b.targets[i] != kIgnoreTarget;
  }
  // Truncated to T; a one-token example has no target and is left out.
  std::vector<int32_t> expected;
  int64_t no_target = 0;
  for (size_t e = 0; e < lengths.size(); ++e) {
    no_target += lengths[e] == 1;
    for (int i = 0; i < std::min(lengths[e], T) && lengths[e] > 1; ++i) {
      expected.push_back(1000 * static_cast<int32_t>(e + 1) + i);
    }
  }
  ASSERT_GT(no_target, 0);
  EXPECT_EQ(d->val_stats().no_target, no_target);
  EXPECT_EQ(seen, expected);
  EXPECT_EQ(in_loss, d->val_stats().tokens_in_loss);
}

TEST_F(ExampleDatasetTest, TrainRowsAreDrawnUniformlyFromTheRng) {
  const TokenDataset train = Open("train.bin", MakeExamples({2, 3, 4, 5, 6}));
  auto d = ExampleDataset::Create(train, Open("val.bin", MakeExamples({2})), {.seq_len = 6}, "t");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  std::mt19937_64 rng(9), reference(9);
  Batch b;
  for (int step = 0; step < 5; ++step) {
    d->SampleTrainBatch(rng, 3, 6, &b);
    ASSERT_EQ(b.tokens.size(), 18u);
    for (int r = 0; r < 3; ++r) {
      const uint64_t row = reference() % 5;
      EXPECT_EQ(b.tokens[r * 6], static_cast<int32_t>(1000 * (row + 1))) << step << " " << r;
    }
  }
  EXPECT_EQ(rng, reference);
}

TEST_F(ExampleDatasetTest, OpenTrainingDataHoldsOutTheLastTenPercentOfTheExamples) {
  std::vector<int> lengths(20, 3);
  const Examples ex = MakeExamples(lengths);
  ASSERT_TRUE(WriteTokenFile(Path("sft.bin"), ex.tokens, ex.flags).ok());
  TrainingDataOptions o = testing::Opts({Path("sft.bin")}, 8, kVocab);
  o.pack = true;
  auto data = OpenTrainingData(o);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  auto* d = dynamic_cast<const ExampleDataset*>(data->dataset.get());
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->train_stats().examples, 18);
  EXPECT_EQ(d->val_stats().examples, 2);
  EXPECT_EQ(d->val_stats().rows, 1);  // 3 + 3 in one row of 8
  Batch b;
  d->ValBatch(0, 1, 1, 8, &b);
  EXPECT_EQ(b.tokens[0], 19000);
  EXPECT_THAT(d->Describe(), HasSubstr("20 examples (train 18, val 2)"));
  EXPECT_THAT(d->Describe(), HasSubstr("last 10% of the examples held out"));
}

TEST_F(ExampleDatasetTest, ValidationTokensWithoutFlagsAreRefusedForExampleData) {
  const Examples ex = MakeExamples({3, 3, 3});
  ASSERT_TRUE(WriteTokenFile(Path("sft.bin"), ex.tokens, ex.flags).ok());
  ASSERT_TRUE(WriteTokenFile(Path("plain.bin"), std::vector<int32_t>(50, 1)).ok());
  auto data = OpenTrainingData(testing::Opts({Path("sft.bin")}, 4, kVocab, {Path("plain.bin")}));
  ASSERT_FALSE(data.ok());
  EXPECT_EQ(data.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(), HasSubstr("no per-token flags"));
  EXPECT_THAT(data.status().message(), HasSubstr(Path("plain.bin")));
}

TEST_F(ExampleDatasetTest, JsonlTrainingDataIsRefusedWithHowToTokenizeIt) {
  auto data = OpenTrainingData(testing::Opts({Path("sft.jsonl")}, 4, kVocab));
  ASSERT_FALSE(data.ok());
  EXPECT_EQ(data.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(), HasSubstr("strata tokenize"));
}

}  // namespace
}  // namespace strata::data
