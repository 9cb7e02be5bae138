// Preference data: token files whose flags mark pairs read as micro-batches of whole pairs, one
// pair per two rows or packed, checked position by position (tokens, targets, positions,
// sequences, pair ids) on hand-made files; odd micro-batch sizes, long pairs refused, truncated
// or skipped, the held-out split at a pair boundary, sampling from the rng, malformed pair
// orders refused naming file and token, and OpenTrainingData's choice of them.
#include "data/preference_dataset.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "data/dataset.h"
#include "data/example_dataset.h"
#include "data/token_dataset.h"
#include "tests/data/training_data_options.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kVocab = 1 << 20;
constexpr int32_t I = kIgnoreTarget;
constexpr int32_t P = 7;  // the pad id of the tests

// Pair p's side s of length n: tokens 1000 * (first + p + 1) + 100 * s + i; its first n / 2
// (rounded down) tokens prompt, the rest in the loss; the chosen side's first token starts the
// pair and an example, the rejected side's an example.
struct Tokens {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> flags;
};
Tokens MakePairs(const std::vector<std::pair<int, int>>& lengths, int first = 0) {
  Tokens out;
  for (size_t p = 0; p < lengths.size(); ++p) {
    for (int s = 0; s < 2; ++s) {
      const int n = s == 0 ? lengths[p].first : lengths[p].second;
      for (int i = 0; i < n; ++i) {
        out.tokens.push_back(1000 * (first + static_cast<int>(p) + 1) + 100 * s + i);
        uint8_t f = i >= n / 2 ? kTokenFlagInLoss : 0;
        if (i == 0) f |= kTokenFlagExampleStart | (s == 0 ? kTokenFlagPairStart : 0);
        out.flags.push_back(f);
      }
    }
  }
  return out;
}

class PreferenceDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("strata_preference_dataset_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  std::string Write(const std::string& name, const Tokens& t) const {
    const Status s = WriteTokenFile(Path(name), t.tokens, t.flags);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return Path(name);
  }
  TokenDataset Open(const std::vector<std::string>& paths) const {
    auto d = TokenDataset::Open(paths, kVocab);
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    return *d;
  }
  TokenDataset Open(const std::string& name, const Tokens& t) const {
    return Open({Write(name, t)});
  }
  // `train` as the training split, one small pair as validation.
  StatusOr<PreferenceDataset> Create(const Tokens& train, const PreferenceBatchOptions& o) const {
    return PreferenceDataset::Create(Open("train.bin", train), Open("val.bin", MakePairs({{2, 2}})),
                                     o, "test");
  }

  fs::path dir_;
};

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

// sequences is -1 exactly where the target is ignored.
void ExpectSequencesFollowTargets(const Batch& b) {
  ASSERT_EQ(b.sequences.size(), b.targets.size());
  for (size_t i = 0; i < b.targets.size(); ++i) {
    EXPECT_EQ(b.sequences[i] == -1, b.targets[i] == I) << i;
  }
}

TEST_F(PreferenceDatasetTest, UnpackedGroupsHoldHalfAsManyPairsAsRowsChosenThenRejected) {
  // T = 6, B = 4: group 0 holds pairs 0 and 1, group 1 pair 2 and two rows of padding.
  auto d = Create(MakePairs({{3, 4}, {2, 5}, {6, 3}}),
                  {.seq_len = 6, .micro_batch_size = 4, .pad_id = P});
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->train_groups(), 2);
  EXPECT_EQ(d->train_pairs(), 3);
  Batch b;
  d->TrainGroup(0, &b);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{1000, 1001, 1002, P,    P,    P,  //
                                            1100, 1101, 1102, 1103, P,    P,  //
                                            2000, 2001, P,    P,    P,    P,  //
                                            2100, 2101, 2102, 2103, 2104, P}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{1001, 1002, I,    I,    I, I,  //
                                             I,    1102, 1103, I,    I, I,  //
                                             2001, I,    I,    I,    I, I,  //
                                             I,    2102, 2103, 2104, I, I}));
  // Pad tokens at position 0, each a one-token example of its own.
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 0, 0, 0, 0, 1, 2, 3, 0, 0,  //
                                               0, 1, 0, 0, 0, 0, 0, 1, 2, 3, 4, 0}));
  EXPECT_EQ(b.sequences, (std::vector<int32_t>{0,  0,  -1, -1, -1, -1,  //
                                               -1, 1,  1,  -1, -1, -1,  //
                                               2,  -1, -1, -1, -1, -1,  //
                                               -1, 3,  3,  3,  -1, -1}));
  EXPECT_EQ(b.pair_ids, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(b.pairs(), 2);
  d->TrainGroup(1, &b);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{3000, 3001, 3002, 3003, 3004, 3005,  //
                                            3100, 3101, 3102, P,    P,    P,     //
                                            P,    P,    P,    P,    P,    P,     //
                                            P,    P,    P,    P,    P,    P}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{I,    I,    3003, 3004, 3005, I,  //
                                             3101, 3102, I,    I,    I,    I,  //
                                             I,    I,    I,    I,    I,    I,  //
                                             I,    I,    I,    I,    I,    I}));
  EXPECT_EQ(b.sequences, (std::vector<int32_t>{-1, -1, 0,  0,  0,  -1,  //
                                               1,  1,  -1, -1, -1, -1,  //
                                               -1, -1, -1, -1, -1, -1,  //
                                               -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(b.pair_ids, (std::vector<int64_t>{2}));
  ExpectPositionsInvariant(b, 6);
  EXPECT_EQ(d->train_stats().tokens, 3 + 4 + 2 + 5 + 6 + 3);
  EXPECT_EQ(d->train_stats().tokens_in_loss, 2 + 2 + 1 + 3 + 3 + 2);
  EXPECT_EQ(d->train_tokens(), d->train_stats().tokens);
}

TEST_F(PreferenceDatasetTest, PackedSidesFillRowsGreedilyAndAPairThatDoesNotFitStartsAGroup) {
  // T = 8, B = 2. Group 0: row 0 [3 + 4], row 1 [2 + 5]. Group 1: pair 2's 6 and 3 take a row
  // each. Pair 3's chosen 4 would fit after the 3, its rejected 4 then in no row: group 2.
  auto d = Create(MakePairs({{3, 4}, {2, 5}, {6, 3}, {4, 4}}),
                  {.seq_len = 8, .micro_batch_size = 2, .pack = true, .pad_id = P});
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->train_groups(), 3);
  Batch b;
  d->TrainGroup(0, &b);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{1000, 1001, 1002, 1100, 1101, 1102, 1103, P,  //
                                            2000, 2001, 2100, 2101, 2102, 2103, 2104, P}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 0,  //
                                               0, 1, 0, 1, 2, 3, 4, 0}));
  // A side's last token predicts nothing: never the next side's first.
  EXPECT_EQ(b.targets, (std::vector<int32_t>{1001, 1002, I, I, 1102, 1103, I, I,  //
                                             2001, I, I, 2102, 2103, 2104, I, I}));
  EXPECT_EQ(b.sequences, (std::vector<int32_t>{0, 0, -1, -1, 1, 1, -1, -1,  //
                                               2, -1, -1, 3, 3, 3, -1, -1}));
  EXPECT_EQ(b.pair_ids, (std::vector<int64_t>{0, 1}));
  d->TrainGroup(1, &b);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{3000, 3001, 3002, 3003, 3004, 3005, P, P,  //
                                            3100, 3101, 3102, P, P, P, P, P}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 0, 0,  //
                                               0, 1, 2, 0, 0, 0, 0, 0}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{I, I, 3003, 3004, 3005, I, I, I,  //
                                             3101, 3102, I, I, I, I, I, I}));
  EXPECT_EQ(b.sequences, (std::vector<int32_t>{-1, -1, 0, 0, 0, -1, -1, -1,  //
                                               1, 1, -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(b.pair_ids, (std::vector<int64_t>{2}));
  d->TrainGroup(2, &b);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{4000, 4001, 4002, 4003, 4100, 4101, 4102, 4103,  //
                                            P, P, P, P, P, P, P, P}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 3,  //
                                               0, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{I, 4002, 4003, I, I, 4102, 4103, I,  //
                                             I, I, I, I, I, I, I, I}));
  EXPECT_EQ(b.sequences, (std::vector<int32_t>{-1, 0, 0, -1, -1, 1, 1, -1,  //
                                               -1, -1, -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(b.pair_ids, (std::vector<int64_t>{3}));
  ExpectPositionsInvariant(b, 8);
  EXPECT_THAT(d->Describe(), HasSubstr("test: 5 pairs (train 4, val 1) in 4 micro-batches of 2 "
                                       "rows of 8 tokens (train 3, val 1), packed;"));
}

TEST_F(PreferenceDatasetTest, AnOddMicroBatchSizeIsRefusedUnpackedAndTakenPacked) {
  const Tokens pairs = MakePairs({{3, 4}, {2, 5}});
  auto odd = Create(pairs, {.seq_len = 8, .micro_batch_size = 3});
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(odd.status().message(), HasSubstr("--micro-batch-size 3 is odd"));
  auto zero = Create(pairs, {.seq_len = 8, .micro_batch_size = 0, .pack = true});
  ASSERT_FALSE(zero.ok());
  EXPECT_THAT(zero.status().message(), HasSubstr("--micro-batch-size"));
  // Packed, three rows: both pairs in one group (rows [3 + 4], [2 + 5], padding).
  auto packed = Create(pairs, {.seq_len = 8, .micro_batch_size = 3, .pack = true});
  ASSERT_TRUE(packed.ok()) << packed.status().ToString();
  EXPECT_EQ(packed->train_groups(), 1);
  Batch b;
  packed->TrainGroup(0, &b);
  EXPECT_EQ(b.tokens.size(), 24u);
  EXPECT_EQ(b.pair_ids, (std::vector<int64_t>{0, 1}));
  ExpectPositionsInvariant(b, 8);
  ExpectSequencesFollowTargets(b);
}

TEST_F(PreferenceDatasetTest, ALongPairIsRefusedNamingItsFileAndNumberInIt) {
  // Two files: a.bin's pairs fit; b.bin's pair 1 has a rejected side of 9 tokens.
  const std::string a = Write("a.bin", MakePairs({{3, 4}, {2, 2}}));
  const Tokens b_pairs = MakePairs({{3, 3}, {4, 9}}, 2);
  const std::string b = Write("b.bin", b_pairs);
  const PreferenceBatchOptions o{
      .seq_len = 8, .micro_batch_size = 2, .long_examples = LongExamples::kRefuse};
  auto d = PreferenceDataset::CreateHeldOut(Open({a, b}), 0.5, o, "a.bin and b.bin");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d.status().message(),
            fmt::format("'{}': pair 1 (token 6) has a rejected side of 9 tokens, longer than "
                        "--seq-len 8; pass --long-examples truncate or skip",
                        b));
  // Packed one row per micro-batch: the sides must fit one row together.
  auto shared = Create(
      MakePairs({{3, 3}, {5, 4}}),
      {.seq_len = 8, .micro_batch_size = 1, .pack = true, .long_examples = LongExamples::kRefuse});
  ASSERT_FALSE(shared.ok());
  EXPECT_THAT(shared.status().message(),
              HasSubstr(fmt::format("'{}': pair 1 (token 6) has sides of 5 and 4 tokens",
                                    Path("train.bin"))));
  EXPECT_THAT(shared.status().message(), Not(HasSubstr("\n")));
}

TEST_F(PreferenceDatasetTest, SkippedPairsAreLeftOutAndPairIdsCountTheOthers) {
  auto d = Create(
      MakePairs({{3, 4}, {12, 2}, {2, 3}}),
      {.seq_len = 8, .micro_batch_size = 2, .long_examples = LongExamples::kSkip, .pad_id = P});
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->train_stats().pairs, 3);
  EXPECT_EQ(d->train_stats().skipped, 1);
  EXPECT_EQ(d->train_pairs(), 2);
  Batch b;
  d->TrainGroup(1, &b);
  EXPECT_EQ(b.pair_ids, (std::vector<int64_t>{1}));
  EXPECT_EQ(b.tokens[0], 3000);  // the third pair of the file
  EXPECT_THAT(d->Describe(), HasSubstr("; 1 longer than 8 tokens a side skipped"));
}

TEST_F(PreferenceDatasetTest, TruncationCutsEachSideAndLeavesOutAPairLeftWithoutATarget) {
  // T = 4: pair 0's rejected 6 is cut to 4 (its loss from token 3 on: one target left); pair 1's
  // rejected 12 is cut to 4 tokens, all prompt: no target, left out.
  auto d = Create(MakePairs({{3, 6}, {3, 12}, {2, 2}}),
                  {.seq_len = 4, .micro_batch_size = 2, .pad_id = P});
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->train_stats().truncated, 1);
  EXPECT_EQ(d->train_stats().no_target, 1);
  EXPECT_EQ(d->train_pairs(), 2);
  Batch b;
  d->TrainGroup(0, &b);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{1000, 1001, 1002, P, 1100, 1101, 1102, 1103}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{1001, 1002, I, I, I, I, 1103, I}));
  EXPECT_EQ(b.sequences, (std::vector<int32_t>{0, 0, -1, -1, -1, -1, 1, -1}));
  d->TrainGroup(1, &b);
  EXPECT_EQ(b.tokens[0], 3000);
  EXPECT_EQ(b.pair_ids, (std::vector<int64_t>{1}));
  EXPECT_THAT(d->Describe(), HasSubstr("1 truncated to 4 tokens a side"));
  EXPECT_THAT(d->Describe(), HasSubstr("1 with a side without a target in the loss skipped"));
}

TEST_F(PreferenceDatasetTest, PackedIntoOneRowBothSidesAreCutToShareIt) {
  // T = 8, B = 1: sides of 6 and 5 share the row as 4 and 4 (the chosen side keeps
  // max(T - 5, T / 2) = 4); sides of 2 and 9 as 2 and 6.
  auto d = Create(MakePairs({{6, 5}, {2, 9}}),
                  {.seq_len = 8, .micro_batch_size = 1, .pack = true, .pad_id = P});
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->train_stats().truncated, 2);
  Batch b;
  d->TrainGroup(0, &b);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{1000, 1001, 1002, 1003, 1100, 1101, 1102, 1103}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{I, I, 1003, I, I, 1102, 1103, I}));
  d->TrainGroup(1, &b);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{2000, 2001, 2100, 2101, 2102, 2103, 2104, 2105}));
  EXPECT_EQ(b.sequences, (std::vector<int32_t>{0, -1, -1, -1, -1, 1, 1, -1}));
}

TEST_F(PreferenceDatasetTest, TheHeldOutSplitIsTheLastPairsWithTheirOwnPairIds) {
  std::vector<std::pair<int, int>> lengths(10, {3, 3});
  auto d = PreferenceDataset::CreateHeldOut(Open("pairs.bin", MakePairs(lengths)), 0.8,
                                            {.seq_len = 4, .micro_batch_size = 2}, "pairs");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->train_pairs(), 8);
  EXPECT_EQ(d->val_pairs(), 2);
  EXPECT_EQ(d->val_groups(), 2);
  Batch b;
  d->ValGroup(1, &b);
  EXPECT_EQ(b.tokens[0], 10000);  // pair 9 of the file
  EXPECT_EQ(b.pair_ids, (std::vector<int64_t>{1}));
  d->ValBatch(0, 2, 2, 4, &b);  // group 0 * 2 / 2
  EXPECT_EQ(b.tokens[0], 9000);
  d->ValBatch(1, 2, 2, 4, &b);  // group 1 * 2 / 2
  EXPECT_EQ(b.tokens[0], 10000);
  auto one = PreferenceDataset::CreateHeldOut(Open("one.bin", MakePairs({{3, 3}})), 0.9,
                                              {.seq_len = 4, .micro_batch_size = 2}, "one");
  ASSERT_FALSE(one.ok());
  EXPECT_THAT(one.status().message(), HasSubstr("one has 1 pair: too few"));
}

TEST_F(PreferenceDatasetTest, SamplingDrawsOneGroupPerBatchFromTheRng) {
  std::vector<std::pair<int, int>> lengths;
  for (int p = 0; p < 20; ++p) lengths.push_back({2 + p % 3, 3 + p % 2});
  auto d = Create(MakePairs(lengths), {.seq_len = 8, .micro_batch_size = 4, .pad_id = P});
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_EQ(d->train_groups(), 10);
  std::mt19937_64 rng(42), replay(42);
  for (int step = 0; step < 16; ++step) {
    Batch sampled, want;
    d->SampleTrainBatch(rng, 4, 8, &sampled);
    d->TrainGroup(static_cast<int64_t>(replay() % 10), &want);
    EXPECT_EQ(sampled.tokens, want.tokens) << step;
    EXPECT_EQ(sampled.targets, want.targets) << step;
    EXPECT_EQ(sampled.sequences, want.sequences) << step;
    EXPECT_EQ(sampled.pair_ids, want.pair_ids) << step;
    ExpectSequencesFollowTargets(sampled);
    ExpectPositionsInvariant(sampled, 8);
  }
  EXPECT_EQ(rng, replay);  // one draw per batch
}

TEST_F(PreferenceDatasetTest, SequencesThatDoNotAlternateAsPairsAreRefusedNamingFileAndToken) {
  const PreferenceBatchOptions o{.seq_len = 8, .micro_batch_size = 2};
  const auto refused = [&](Tokens t, const std::string& expected) {
    const std::string path = Write("bad.bin", t);
    auto d = PreferenceDataset::Create(Open({path}), Open("val.bin", MakePairs({{2, 2}})), o, "t");
    ASSERT_FALSE(d.ok()) << expected;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(d.status().message(), HasSubstr("'" + path + "' token " + expected));
    EXPECT_THAT(d.status().message(), Not(HasSubstr("\n")));
  };
  Tokens t = MakePairs({{2, 2}, {2, 2}});
  t.flags[2] |= kTokenFlagPairStart;  // pair 0's rejected side begins a pair
  refused(t, "2: a pair begins before the pair begun at");
  t = MakePairs({{2, 2}, {2, 2}});
  t.flags[0] &= ~kTokenFlagPairStart;
  refused(t, "0: the data begins with a sequence that begins no preference pair");
  t = MakePairs({{2, 2}, {2, 2}});
  t.flags[4] &= ~kTokenFlagPairStart;  // pair 1's chosen side: a third sequence of pair 0
  refused(t, "4: a third sequence in the pair begun at");
  t = MakePairs({{2, 2}, {2, 2}});
  t.tokens.resize(6);
  t.flags.resize(6);
  refused(t, "4: the pair begun here has no rejected sequence");
  t = MakePairs({{2, 2}, {2, 2}});
  t.flags[5] |= kTokenFlagPairStart;
  refused(t, "5: flags 0x05 begin a pair (bit 2) but no example (bit 1)");
}

TEST_F(PreferenceDatasetTest, OpenTrainingDataOpensPairsAsPreferenceDataAndRefusesMixedSplits) {
  const std::string pairs = Write("pairs.bin", MakePairs({{3, 4}, {2, 5}, {6, 3}, {2, 2}}));
  auto o = testing::Opts({pairs}, 8, kVocab);
  o.micro_batch_size = 2;
  auto data = OpenTrainingData(o);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  ASSERT_NE(data->preference, nullptr);
  EXPECT_EQ(static_cast<const Dataset*>(data->preference), data->dataset.get());
  EXPECT_EQ(data->preference->train_pairs(), 3);
  EXPECT_EQ(data->preference->val_pairs(), 1);
  EXPECT_THAT(data->dataset->Describe(), HasSubstr("the last 10% of the pairs held out"));

  o.micro_batch_size = 0;
  auto no_size = OpenTrainingData(o);
  ASSERT_FALSE(no_size.ok());
  EXPECT_THAT(no_size.status().message(), HasSubstr("--micro-batch-size"));

  // Example data (flags without pair starts) is not preference data, and the two do not mix.
  Tokens examples = MakePairs({{3, 4}, {2, 5}});
  for (auto& f : examples.flags) f &= ~kTokenFlagPairStart;
  const std::string sft = Write("sft.bin", examples);
  auto plain = OpenTrainingData(testing::Opts({sft}, 8, kVocab));
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->preference, nullptr);
  auto mixed = testing::Opts({pairs}, 8, kVocab, {sft});
  mixed.micro_batch_size = 2;
  auto m = OpenTrainingData(mixed);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("holds no preference pairs"));
  auto m2 = OpenTrainingData(testing::Opts({sft}, 8, kVocab, {pairs}));
  ASSERT_FALSE(m2.ok());
  EXPECT_THAT(m2.status().message(), HasSubstr("holds preference pairs but the training data"));
  auto val = testing::Opts({pairs}, 8, kVocab, {Write("val.bin", MakePairs({{2, 2}}))});
  val.micro_batch_size = 2;
  auto v = OpenTrainingData(val);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->preference->train_pairs(), 4);
  EXPECT_EQ(v->preference->val_pairs(), 1);
}

TEST_F(PreferenceDatasetTest, ExampleDataRefusesALongExampleNamingItsFileAndToken) {
  Tokens examples = MakePairs({{3, 4}, {9, 2}});
  for (auto& f : examples.flags) f &= ~kTokenFlagPairStart;
  const std::string path = Write("sft.bin", examples);
  auto d = ExampleDataset::Create(Open({path}), Open({path}),
                                  {.seq_len = 8, .long_examples = LongExamples::kRefuse}, "sft");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().message(),
            fmt::format("'{}': the example at token 7 has 9 tokens, longer than --seq-len 8; "
                        "pass --long-examples truncate or skip",
                        path));
}

}  // namespace
}  // namespace strata::data
