// llm.c token files: writing, opening (shards, globs), reading across shard boundaries, training
// and evaluation windows, every bad input's one-line error, and OpenTrainingData's choice of
// source.
#include "data/token_dataset.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/text_dataset.h"
#include "tests/data/training_data_options.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

using testing::Opts;

void ExpectOneLineNaming(const Status& s, const std::string& path);

class TokenDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("strata_token_dataset_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes raw bytes: a header of the given ints (padded to 256) and then `payload`.
  std::string WriteRaw(const std::string& name, std::vector<int32_t> header,
                       const std::string& payload) const {
    header.resize(kTokenFileHeaderInts, 0);
    std::ofstream out(Path(name), std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), header.size() * 4);
    out.write(payload.data(), static_cast<std::streamsize>(payload.size()));
    return Path(name);
  }

  std::string Write(const std::string& name, const std::vector<int32_t>& tokens) const {
    const Status s = WriteTokenFile(Path(name), tokens);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return Path(name);
  }

  static std::vector<int32_t> Ramp(int n, int32_t first, int32_t step = 1) {
    std::vector<int32_t> v(n);
    for (int i = 0; i < n; ++i) v[i] = first + i * step;
    return v;
  }

  static std::vector<int32_t> ReadAll(const TokenDataset& d) {
    std::vector<int32_t> out(d.num_tokens());
    d.Read(0, d.num_tokens(), out.data());
    return out;
  }

  static std::string FileBytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  fs::path dir_;
};

TEST_F(TokenDatasetTest, TokensBelow65536AreWrittenAsVersion1Uint16AndReadBack) {
  const std::vector<int32_t> tokens = {0, 1, 65535, 300, 7, 50256};
  const std::string path = Write("a.bin", tokens);
  const std::string bytes = FileBytes(path);
  ASSERT_EQ(bytes.size(), 1024u + 2 * tokens.size());
  int32_t header[256];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 6);
  for (int i = 3; i < 256; ++i) EXPECT_EQ(header[i], 0) << i;
  for (size_t i = 0; i < tokens.size(); ++i) {
    uint16_t t;
    std::memcpy(&t, bytes.data() + 1024 + 2 * i, 2);
    EXPECT_EQ(t, tokens[i]) << i;
  }
  auto d = TokenDataset::Open({path}, 65536);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->num_tokens(), 6);
  EXPECT_EQ(d->max_token_bytes(), 2);
  EXPECT_EQ(ReadAll(*d), tokens);
}

TEST_F(TokenDatasetTest, ATokenOf65536OrMoreMakesTheFileVersion2Uint32) {
  const std::vector<int32_t> tokens = {5, 65536, 128255, 0, 151935};
  const std::string path = Write("a.bin", tokens);
  const std::string bytes = FileBytes(path);
  ASSERT_EQ(bytes.size(), 1024u + 4 * tokens.size());
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[1], 2);
  EXPECT_EQ(header[2], 5);
  auto d = TokenDataset::Open({path}, 151936);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->max_token_bytes(), 4);
  EXPECT_EQ(ReadAll(*d), tokens);
}

TEST_F(TokenDatasetTest, AnEmptyTokenListIsAValidFileOfZeroTokens) {
  const std::string path = Write("empty.bin", {});
  EXPECT_EQ(fs::file_size(path), 1024u);
  auto d = TokenDataset::Open({path}, 10);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->num_tokens(), 0);
}

// --- per-token flags (header[3] == 1) ---

TEST_F(TokenDatasetTest, FlagsAreWrittenAfterTheTokensAndReadBackAcrossShards) {
  const std::vector<int32_t> a = {1, 2, 3, 4, 5}, b = {70000, 6, 7};
  const std::vector<uint8_t> fa = {2, 0, 1, 3, 1}, fb = {0, 2, 1};
  ASSERT_TRUE(WriteTokenFile(Path("s0.bin"), a, fa).ok());
  ASSERT_TRUE(WriteTokenFile(Path("s1.bin"), b, fb).ok());
  const std::string bytes = FileBytes(Path("s0.bin"));
  ASSERT_EQ(bytes.size(), 1024u + 2 * a.size() + a.size());
  int32_t header[4];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 5);
  EXPECT_EQ(header[3], 1);
  EXPECT_EQ(bytes.substr(1024 + 10), std::string(fa.begin(), fa.end()));
  EXPECT_EQ(fs::file_size(Path("s1.bin")), 1024u + 4 * 3 + 3);  // uint32 tokens, then flags
  auto d = TokenDataset::Open({Path("s*.bin")}, 80000);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_TRUE(d->has_flags());
  EXPECT_EQ(ReadAll(*d), (std::vector<int32_t>{1, 2, 3, 4, 5, 70000, 6, 7}));
  std::vector<uint8_t> flags(8);
  d->ReadFlags(0, 8, flags.data());
  EXPECT_EQ(flags, (std::vector<uint8_t>{2, 0, 1, 3, 1, 0, 2, 1}));
  std::vector<uint8_t> mid(3);
  d->Slice(2, 8).ReadFlags(2, 3, mid.data());  // global tokens 4..6, across the boundary
  EXPECT_EQ(mid, (std::vector<uint8_t>{1, 0, 2}));
}

TEST_F(TokenDatasetTest, AnLlmcFileWithoutFlagsReadsAsBeforeAndSaysItHasNone) {
  // Bytes as llm.c writes them: header[3] and the rest zero, then uint16 tokens.
  std::string payload;
  for (uint16_t t : {7, 0, 65535, 12}) payload.append(reinterpret_cast<const char*>(&t), 2);
  const std::string path = WriteRaw("llmc.bin", {kTokenFileMagic, 1, 4}, payload);
  auto d = TokenDataset::Open({path}, 65536);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_FALSE(d->has_flags());
  EXPECT_EQ(ReadAll(*d), (std::vector<int32_t>{7, 0, 65535, 12}));
}

// llm.c's Llama 3 files (dev/data/data_common.py's HEADERS_INFO, train_llama3.py): magic
// 20240801, version 7, uint32 tokens. Refused before ("bad magic 20240801"). A token past 2^31 is
// named as the uint32 it is.
TEST_F(TokenDatasetTest, AnLlmcLlama3FileReadsItsUint32Tokens) {
  std::string payload;
  for (uint32_t t : {128000u, 5u, 128255u}) payload.append(reinterpret_cast<const char*>(&t), 4);
  const std::string path = WriteRaw("llama3.bin", {kLlama3TokenFileMagic, 7, 3}, payload);
  auto d = TokenDataset::Open({path}, 128256);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(ReadAll(*d), (std::vector<int32_t>{128000, 5, 128255}));
  const std::string v2 = WriteRaw("llama3v2.bin", {kLlama3TokenFileMagic, 2, 3}, payload);
  auto bad = TokenDataset::Open({v2}, 128256);
  ASSERT_FALSE(bad.ok());
  ExpectOneLineNaming(bad.status(), v2);
  EXPECT_THAT(bad.status().message(), HasSubstr("version 2 at byte offset 4 is not supported"));
  std::string big;
  for (uint32_t t : {1u, 3000000000u}) big.append(reinterpret_cast<const char*>(&t), 4);
  const std::string huge = WriteRaw("huge.bin", {kLlama3TokenFileMagic, 7, 2}, big);
  auto h = TokenDataset::Open({huge}, 128256);
  ASSERT_FALSE(h.ok());
  EXPECT_THAT(h.status().message(), HasSubstr("token 3000000000 at token offset 1"));
}

TEST_F(TokenDatasetTest, BadFlagsHeadersSizesAndBitsAreOneLineErrors) {
  const std::string word = WriteRaw("word.bin", {kTokenFileMagic, 1, 1, 2}, std::string(3, '\0'));
  auto w = TokenDataset::Open({word}, 10);
  ASSERT_FALSE(w.ok());
  ExpectOneLineNaming(w.status(), word);
  EXPECT_THAT(w.status().message(), HasSubstr("flags word 2 at byte offset 12"));
  // Flags promised, the flag bytes missing.
  const std::string size = WriteRaw("size.bin", {kTokenFileMagic, 1, 2, 1}, std::string(4, '\0'));
  auto z = TokenDataset::Open({size}, 10);
  ASSERT_FALSE(z.ok());
  ExpectOneLineNaming(z.status(), size);
  EXPECT_THAT(z.status().message(),
              HasSubstr("says 2 tokens (1030 bytes with the header, uint16 tokens and uint8 "
                        "flags) but the file has 1028 bytes"));
  // An unknown bit (bit 3) in the second flag; bit 2 (pair start) is known.
  std::string payload(4, '\0');
  payload += '\x01';
  payload += '\x0d';
  const std::string bits = WriteRaw("bits.bin", {kTokenFileMagic, 1, 2, 1}, payload);
  auto b = TokenDataset::Open({bits}, 10);
  ASSERT_FALSE(b.ok());
  ExpectOneLineNaming(b.status(), bits);
  EXPECT_THAT(b.status().message(), HasSubstr("flags 0x0d of token offset 1 (byte offset 1029)"));
}

TEST_F(TokenDatasetTest, ShardsWithAndWithoutFlagsAreRefused) {
  ASSERT_TRUE(
      WriteTokenFile(Path("a.bin"), std::vector<int32_t>{1, 2}, std::vector<uint8_t>{2, 1}).ok());
  Write("b.bin", {3, 4});
  auto d = TokenDataset::Open({Path("a.bin"), Path("b.bin")}, 10);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  ExpectOneLineNaming(d.status(), Path("b.bin"));
  EXPECT_THAT(d.status().message(), HasSubstr("all shards must agree"));
}

TEST_F(TokenDatasetTest, WritingFlagsOfTheWrongCountOrWithUnknownBitsFailsAndWritesNothing) {
  const std::vector<int32_t> tokens = {1, 2, 3};
  Status s = WriteTokenFile(Path("n.bin"), tokens, std::vector<uint8_t>{1, 1});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("2 flags for 3 tokens"));
  s = WriteTokenFile(Path("n.bin"), tokens, std::vector<uint8_t>{1, 8, 0});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("token offset 1"));
  EXPECT_FALSE(fs::exists(Path("n.bin")));
}

TEST_F(TokenDatasetTest, WritingReplacesAnExistingFileAndLeavesNoTemporaryFile) {
  Write("a.bin", Ramp(100, 0));
  Write("a.bin", Ramp(3, 70000));
  auto d = TokenDataset::Open({Path("a.bin")}, 1 << 20);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(ReadAll(*d), Ramp(3, 70000));
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir_)) {
    ++files;
    EXPECT_EQ(e.path().filename(), "a.bin");
  }
  EXPECT_EQ(files, 1);
}

TEST_F(TokenDatasetTest, WritingANegativeTokenOrIntoAMissingDirectoryFailsAndWritesNothing) {
  const Status neg = WriteTokenFile(Path("neg.bin"), std::vector<int32_t>{1, 2, -3});
  EXPECT_EQ(neg.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(neg.message(), HasSubstr("token -3 at token offset 2"));
  EXPECT_FALSE(fs::exists(Path("neg.bin")));
  const Status missing = WriteTokenFile(Path("no/such/dir/a.bin"), std::vector<int32_t>{1});
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("no/such/dir/a.bin"));
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(TokenDatasetTest, GlobShardsAreConcatenatedInSortedOrder) {
  // Written out of order and with both widths.
  const auto s2 = Ramp(7, 200000);  // uint32
  const auto s0 = Ramp(5, 0);
  const auto s1 = Ramp(3, 1000);
  Write("shard_002.bin", s2);
  Write("shard_000.bin", s0);
  Write("shard_001.bin", s1);
  Write("other.bin", Ramp(4, 9));
  auto d = TokenDataset::Open({Path("shard_*.bin")}, 1 << 20);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->paths(), (std::vector<std::string>{Path("shard_000.bin"), Path("shard_001.bin"),
                                                  Path("shard_002.bin")}));
  std::vector<int32_t> want = s0;
  want.insert(want.end(), s1.begin(), s1.end());
  want.insert(want.end(), s2.begin(), s2.end());
  EXPECT_EQ(ReadAll(*d), want);
}

TEST_F(TokenDatasetTest, PatternsAreTakenInTheOrderGiven) {
  Write("a.bin", Ramp(2, 10));
  Write("b.bin", Ramp(2, 20));
  auto d = TokenDataset::Open({Path("b.bin"), Path("a.bin")}, 100);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(ReadAll(*d), (std::vector<int32_t>{20, 21, 10, 11}));
}

TEST_F(TokenDatasetTest, EveryReadAcrossShardBoundariesMatchesTheConcatenation) {
  // Shards of 1, 0, 4, 2 and 5 tokens (an empty one in the middle), mixed widths.
  const std::vector<std::vector<int32_t>> shards = {
      {7}, {}, {100, 70000, 101, 102}, {3, 4}, {90000, 5, 6, 8, 9}};
  std::vector<std::string> paths;
  std::vector<int32_t> all;
  for (size_t i = 0; i < shards.size(); ++i) {
    paths.push_back(Write(fmt::format("s{}.bin", i), shards[i]));
    all.insert(all.end(), shards[i].begin(), shards[i].end());
  }
  auto d = TokenDataset::Open(paths, 90001);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_EQ(d->num_tokens(), static_cast<int64_t>(all.size()));
  for (int64_t offset = 0; offset <= d->num_tokens(); ++offset) {
    for (int64_t n = 0; offset + n <= d->num_tokens(); ++n) {
      std::vector<int32_t> got(n + 1, -1);
      d->Read(offset, n, got.data());
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(got[i], all[offset + i]) << "offset " << offset << " n " << n << " i " << i;
      }
      EXPECT_EQ(got[n], -1) << "wrote past n at offset " << offset << " n " << n;
    }
  }
}

TEST_F(TokenDatasetTest, ASliceReadsItsRangeAcrossShards) {
  Write("a.bin", Ramp(5, 0));
  Write("b.bin", Ramp(5, 5));
  auto d = TokenDataset::Open({Path("a.bin"), Path("b.bin")}, 100);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const TokenDataset s = d->Slice(3, 8);
  EXPECT_EQ(s.num_tokens(), 5);
  EXPECT_EQ(ReadAll(s), Ramp(5, 3));
  const TokenDataset ss = s.Slice(1, 3);
  EXPECT_EQ(ReadAll(ss), (std::vector<int32_t>{4, 5}));
}

TEST_F(TokenDatasetTest, LocateNamesTheFileAndIndexOfATokenOfASliceAcrossShards) {
  Write("a.bin", Ramp(5, 0));
  Write("empty.bin", {});
  Write("b.bin", Ramp(5, 5));
  auto d = TokenDataset::Open({Path("a.bin"), Path("empty.bin"), Path("b.bin")}, 100);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->Locate(0).path, Path("a.bin"));
  EXPECT_EQ(d->Locate(4).index, 4);
  EXPECT_EQ(d->Locate(5).path, Path("b.bin"));  // the empty file holds no token
  EXPECT_EQ(d->Locate(5).index, 0);
  const TokenDataset s = d->Slice(3, 8);
  EXPECT_EQ(s.Locate(1).path, Path("a.bin"));
  EXPECT_EQ(s.Locate(1).index, 4);
  EXPECT_EQ(s.Locate(4).path, Path("b.bin"));
  EXPECT_EQ(s.Locate(4).index, 2);
}

TEST_F(TokenDatasetTest, EvalWindowsAreConsecutiveWindowsFromTheStart) {
  // 3 shards so that windows cross boundaries.
  Write("a.bin", Ramp(4, 0));
  Write("b.bin", Ramp(5, 4));
  Write("c.bin", Ramp(4, 9));  // 13 tokens: 0..12
  auto d = TokenDataset::Open({Path("?.bin")}, 100);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const int T = 3;
  ASSERT_EQ(d->num_windows(T), 4);  // (13 - 1) / 3
  for (int64_t i = 0; i < 4; ++i) {
    std::vector<int32_t> tokens(T), targets(T);
    d->EvalWindow(i, T, tokens.data(), targets.data());
    for (int t = 0; t < T; ++t) {
      EXPECT_EQ(tokens[t], i * T + t) << i;
      EXPECT_EQ(targets[t], i * T + t + 1) << i;
    }
  }
}

TEST_F(TokenDatasetTest, NumWindowsCountsOnlyFullWindowsWithinMaxTokens) {
  Write("a.bin", Ramp(13, 0));
  auto d = TokenDataset::Open({Path("a.bin")}, 100);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->num_windows(12), 1);  // 13 = T + 1 tokens: one window
  EXPECT_EQ(d->num_windows(13), 0);  // a window needs T + 1 tokens
  EXPECT_EQ(d->num_windows(4), 3);   // 0..4, 4..8, 8..12
  EXPECT_EQ(d->num_windows(4, 12), 2);
  EXPECT_EQ(d->num_windows(4, 9), 2);
  EXPECT_EQ(d->num_windows(4, 8), 1);
  EXPECT_EQ(d->num_windows(4, 1000), 3);
  EXPECT_EQ(d->num_windows(1), 12);
}

TEST_F(TokenDatasetTest, TrainBatchesAreWindowsAtOffsetsDrawnFromTheRng) {
  std::vector<int32_t> all;
  std::mt19937 gen(7);
  for (int s = 0; s < 3; ++s) {
    auto shard = Ramp(0, 0);
    for (int i = 0; i < 37 + s; ++i) shard.push_back(static_cast<int32_t>(gen() % 50000));
    Write(fmt::format("s{}.bin", s), shard);
    all.insert(all.end(), shard.begin(), shard.end());
  }
  auto d = TokenDataset::Open({Path("s*.bin")}, 50000);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const int B = 5, T = 9;
  std::mt19937_64 rng(42), reference(42);
  Batch batch;
  const auto& tokens = batch.tokens;
  const auto& targets = batch.targets;
  for (int step = 0; step < 20; ++step) {
    d->SampleTrainBatch(rng, B, T, &batch);
    ASSERT_TRUE(batch.positions.empty());
    ASSERT_EQ(tokens.size(), static_cast<size_t>(B * T));
    ASSERT_EQ(targets.size(), static_cast<size_t>(B * T));
    for (int b = 0; b < B; ++b) {
      const uint64_t o = reference() % (all.size() - T);
      for (int t = 0; t < T; ++t) {
        ASSERT_EQ(tokens[b * T + t], all[o + t]) << step << " " << b << " " << t;
        ASSERT_EQ(targets[b * T + t], all[o + t + 1]) << step << " " << b << " " << t;
      }
    }
  }
  EXPECT_EQ(rng, reference);  // the data position is the rng state
}

TEST_F(TokenDatasetTest, TheLastWindowOffsetReachesTheLastToken) {
  Write("a.bin", Ramp(4, 0));
  auto d = TokenDataset::Open({Path("a.bin")}, 10);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  std::mt19937_64 rng(1);
  Batch batch;
  d->SampleTrainBatch(rng, 1, 3, &batch);  // 4 tokens, T = 3: one position
  EXPECT_EQ(batch.tokens, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(batch.targets, (std::vector<int32_t>{1, 2, 3}));
}

// --- bad input: one line, naming the file (and offset) ---

void ExpectOneLineNaming(const Status& s, const std::string& path) {
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("'" + path + "'"));
  EXPECT_THAT(s.message(), Not(HasSubstr("\n")));
}

TEST_F(TokenDatasetTest, AGlobThatMatchesNothingIsAnErrorNamingIt) {
  Write("a.bin", Ramp(4, 0));
  auto d = TokenDataset::Open({Path("a.bin"), Path("train_*.bin")}, 10);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  ExpectOneLineNaming(d.status(), Path("train_*.bin"));
  EXPECT_THAT(d.status().message(), HasSubstr("matches no file"));
}

TEST_F(TokenDatasetTest, AMissingFileIsNotFoundNamingIt) {
  auto d = TokenDataset::Open({Path("missing.bin")}, 10);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kNotFound);
  ExpectOneLineNaming(d.status(), Path("missing.bin"));
}

TEST_F(TokenDatasetTest, AFileShorterThanTheHeaderIsAnErrorGivingItsSize) {
  {
    std::ofstream out(Path("short.bin"), std::ios::binary);
    const int32_t magic = kTokenFileMagic;
    out.write(reinterpret_cast<const char*>(&magic), 4);
    out.write(std::string(1019, '\0').data(), 1019);  // 1023 bytes
  }
  auto d = TokenDataset::Open({Path("short.bin")}, 10);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  ExpectOneLineNaming(d.status(), Path("short.bin"));
  EXPECT_THAT(d.status().message(), HasSubstr("has 1023 bytes"));
  EXPECT_THAT(d.status().message(), HasSubstr("1024-byte header"));
  std::ofstream(Path("zero.bin")).close();
  auto z = TokenDataset::Open({Path("zero.bin")}, 10);
  ASSERT_FALSE(z.ok());
  EXPECT_THAT(z.status().message(), HasSubstr("has 0 bytes"));
}

TEST_F(TokenDatasetTest, ABadMagicIsAnErrorGivingTheMagicFound) {
  const std::string path = WriteRaw("magic.bin", {20240521, 1, 2}, std::string(4, '\0'));
  auto d = TokenDataset::Open({path}, 10);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  ExpectOneLineNaming(d.status(), path);
  EXPECT_THAT(d.status().message(), HasSubstr("bad magic 20240521 at byte offset 0"));
}

TEST_F(TokenDatasetTest, AnUnsupportedVersionIsAnErrorGivingIt) {
  const std::string path = WriteRaw("version.bin", {kTokenFileMagic, 3, 1}, std::string(4, '\0'));
  auto d = TokenDataset::Open({path}, 10);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  ExpectOneLineNaming(d.status(), path);
  EXPECT_THAT(d.status().message(), HasSubstr("version 3 at byte offset 4 is not supported"));
}

TEST_F(TokenDatasetTest, ACountThatDisagreesWithTheSizeIsAnErrorGivingBoth) {
  // 10 uint16 tokens claimed, 9 present.
  const std::string few = WriteRaw("few.bin", {kTokenFileMagic, 1, 10}, std::string(18, '\0'));
  auto d = TokenDataset::Open({few}, 10);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  ExpectOneLineNaming(d.status(), few);
  EXPECT_THAT(d.status().message(),
              HasSubstr("the header says 10 tokens (1044 bytes with the header, uint16 tokens) "
                        "but the file has 1042 bytes"));
  // Version 2 with a spare byte.
  const std::string more = WriteRaw("more.bin", {kTokenFileMagic, 2, 2}, std::string(9, '\0'));
  auto m = TokenDataset::Open({more}, 10);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("1032 bytes with the header, uint32 tokens"));
  EXPECT_THAT(m.status().message(), HasSubstr("the file has 1033 bytes"));
  // A negative count.
  const std::string neg = WriteRaw("neg.bin", {kTokenFileMagic, 1, -1}, "");
  auto n = TokenDataset::Open({neg}, 10);
  ASSERT_FALSE(n.ok());
  EXPECT_THAT(n.status().message(), HasSubstr("the header says -1 tokens"));
}

TEST_F(TokenDatasetTest, ATokenAtOrAboveTheVocabularyIsAnErrorNamingFileAndOffset) {
  Write("a.bin", Ramp(100, 0, 0));  // all zeros: fine
  std::vector<int32_t> b(70000, 3);
  b[68000] = 50257;  // in the second 64Ki chunk of the scan
  Write("b.bin", b);
  auto d = TokenDataset::Open({Path("a.bin"), Path("b.bin")}, 50257);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  ExpectOneLineNaming(d.status(), Path("b.bin"));
  EXPECT_THAT(d.status().message(),
              HasSubstr("token 50257 at token offset 68000 (byte offset 137024) is not below the "
                        "vocabulary size 50257"));
  EXPECT_TRUE(TokenDataset::Open({Path("a.bin"), Path("b.bin")}, 50258).ok());
  // uint32 tokens too.
  Write("c.bin", {1, 2, 100000, 200000});
  auto c = TokenDataset::Open({Path("c.bin")}, 150000);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("token 200000 at token offset 3 (byte offset 1036)"));
}

// --- OpenTrainingData ---

TEST_F(TokenDatasetTest, TokenFilesWithoutValDataHoldOutTheLastTenPercent) {
  Write("a.bin", Ramp(60, 0));
  Write("b.bin", Ramp(40, 60));
  auto data = OpenTrainingData(Opts({Path("a.bin"), Path("b.bin")}, 4, 100));
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  EXPECT_FALSE(data->byte_level);
  EXPECT_EQ(data->tokenizer, nullptr);
  EXPECT_EQ(data->dataset->train_tokens(), 90);
  EXPECT_EQ(data->dataset->val_tokens(), 10);
  Batch batch;
  data->dataset->ValBatch(0, 1, 1, 4, &batch);
  EXPECT_EQ(batch.tokens, (std::vector<int32_t>{90, 91, 92, 93}));  // the first validation window
  EXPECT_THAT(data->dataset->Describe(), HasSubstr("2 token files"));
  EXPECT_THAT(data->dataset->Describe(), HasSubstr("train 90, val 10"));
}

TEST_F(TokenDatasetTest, ValDataNamesTheValidationTokens) {
  Write("train.bin", Ramp(50, 0));
  Write("val.bin", Ramp(20, 1000));
  auto data = OpenTrainingData(Opts({Path("train.bin")}, 4, 2000, {Path("val.bin")}));
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  EXPECT_EQ(data->dataset->train_tokens(), 50);
  EXPECT_EQ(data->dataset->val_tokens(), 20);
  Batch batch;
  data->dataset->ValBatch(1, 2, 1, 4, &batch);  // offset 1 * 16 / 2 = 8
  EXPECT_EQ(batch.tokens, (std::vector<int32_t>{1008, 1009, 1010, 1011}));
  EXPECT_EQ(batch.targets, (std::vector<int32_t>{1009, 1010, 1011, 1012}));
}

TEST_F(TokenDatasetTest, TheBadTokenOfAValidationFileIsReportedAgainstThatFile) {
  Write("train.bin", Ramp(50, 0));
  Write("val.bin", {1, 2, 3, 999});
  auto data = OpenTrainingData(Opts({Path("train.bin")}, 2, 100, {Path("val.bin")}));
  ASSERT_FALSE(data.ok());
  ExpectOneLineNaming(data.status(), Path("val.bin"));
  EXPECT_THAT(data.status().message(), HasSubstr("token offset 3"));
}

TEST_F(TokenDatasetTest, ASplitShorterThanOneWindowIsAnError) {
  Write("a.bin", Ramp(30, 0));  // validation: 3 tokens
  auto data = OpenTrainingData(Opts({Path("a.bin")}, 4, 100));
  ASSERT_FALSE(data.ok());
  EXPECT_EQ(data.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(), HasSubstr("validation split"));
  EXPECT_THAT(data.status().message(), HasSubstr("3 tokens"));
}

TEST_F(TokenDatasetTest, ABinFileWithoutTheMagicIsABadTokenFileNotText) {
  {
    std::ofstream out(Path("text.bin"));
    out << std::string(5000, 'x');
  }
  auto data = OpenTrainingData(Opts({Path("text.bin")}, 4, 256));
  ASSERT_FALSE(data.ok());
  EXPECT_THAT(data.status().message(), HasSubstr("bad magic"));
}

TEST_F(TokenDatasetTest, TextWithoutATokenizerGivesTheSameBatchesAsTextDatasetLoad) {
  std::string text;
  std::mt19937 gen(3);
  for (int i = 0; i < 3001; ++i) text.push_back(static_cast<char>(gen() % 256));
  {
    std::ofstream out(Path("text.txt"), std::ios::binary);
    out << text;
  }
  const int T = 16, B = 3;
  auto data = OpenTrainingData(Opts({Path("text.txt")}, T, 256));
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  EXPECT_TRUE(data->byte_level);
  auto direct = TextDataset::Load(Path("text.txt"), T);
  ASSERT_TRUE(direct.ok()) << direct.status().ToString();
  EXPECT_EQ(data->dataset->train_tokens(), static_cast<int64_t>(direct->train_bytes()));
  std::mt19937_64 rng_a(11), rng_b(11);
  Batch a, b;
  for (int step = 0; step < 10; ++step) {
    data->dataset->SampleTrainBatch(rng_a, B, T, &a);
    direct->SampleTrainBatch(rng_b, B, T, &b);
    ASSERT_EQ(a.tokens, b.tokens);
    ASSERT_EQ(a.targets, b.targets);
    ASSERT_TRUE(a.positions.empty());
  }
  for (int i = 0; i < 4; ++i) {
    data->dataset->ValBatch(i, 4, B, T, &a);
    direct->ValBatch(i, 4, B, T, &b);
    ASSERT_EQ(a.tokens, b.tokens);
    ASSERT_EQ(a.targets, b.targets);
    ASSERT_TRUE(a.positions.empty());
  }
}

TEST_F(TokenDatasetTest, ATokenFileOfTheSameBytesGivesTheSameBatchesAsByteLevelText) {
  std::string text;
  std::vector<int32_t> tokens;
  std::mt19937 gen(5);
  for (int i = 0; i < 2000; ++i) {
    text.push_back(static_cast<char>(gen() % 256));
    tokens.push_back(static_cast<uint8_t>(text.back()));
  }
  {
    std::ofstream out(Path("text.txt"), std::ios::binary);
    out << text;
  }
  Write("text.bin", tokens);
  const int T = 8, B = 4;
  auto bytes = OpenTrainingData(Opts({Path("text.txt")}, T, 256));
  auto toks = OpenTrainingData(Opts({Path("text.bin")}, T, 256));
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  ASSERT_TRUE(toks.ok()) << toks.status().ToString();
  EXPECT_EQ(bytes->dataset->train_tokens(), toks->dataset->train_tokens());
  EXPECT_EQ(bytes->dataset->val_tokens(), toks->dataset->val_tokens());
  std::mt19937_64 rng_a(9), rng_b(9);
  Batch a, b;
  for (int step = 0; step < 10; ++step) {
    bytes->dataset->SampleTrainBatch(rng_a, B, T, &a);
    toks->dataset->SampleTrainBatch(rng_b, B, T, &b);
    ASSERT_EQ(a.tokens, b.tokens);
    ASSERT_EQ(a.targets, b.targets);
    ASSERT_TRUE(a.positions.empty());
  }
  for (int i = 0; i < 3; ++i) {
    bytes->dataset->ValBatch(i, 3, B, T, &a);
    toks->dataset->ValBatch(i, 3, B, T, &b);
    ASSERT_EQ(a.tokens, b.tokens);
    ASSERT_EQ(a.targets, b.targets);
    ASSERT_TRUE(a.positions.empty());
  }
}

TEST_F(TokenDatasetTest, ByteLevelTextRejectsValDataAndSeveralFiles) {
  {
    std::ofstream out(Path("text.txt"));
    out << std::string(1000, 'a');
  }
  auto val = OpenTrainingData(Opts({Path("text.txt")}, 4, 256, {Path("text.txt")}));
  ASSERT_FALSE(val.ok());
  EXPECT_EQ(val.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(val.status().message(), HasSubstr("needs token files or a tokenizer"));
  auto two = OpenTrainingData(Opts({Path("text.txt"), Path("text.txt")}, 4, 256));
  ASSERT_FALSE(two.ok());
  EXPECT_THAT(two.status().message(), HasSubstr("2 text files"));
}

}  // namespace
}  // namespace strata::data
