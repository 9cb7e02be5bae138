// SentencePiece tokenization: a tiny model trained here, with the library's trainer, on text the
// test writes; encode/decode, the token file of a text file and its cache, and the one-line
// error of a tokenizer file that does not load.
#include "data/tokenizer.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sentencepiece_trainer.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "data/dataset.h"
#include "data/token_dataset.h"
#include "tests/data/token_offsets_check.h"
#include "tests/data/training_data_options.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

using testing::Opts;

constexpr int kVocab = 128;

// Words of one to three consonant-vowel syllables, the same list for every seed.
std::vector<std::string> Words() {
  const std::string consonants = "bdfgklmnprstvz", vowels = "aeiou";
  std::mt19937 gen(12345);
  std::vector<std::string> words;
  for (int i = 0; i < 300; ++i) {
    std::string w;
    const int syllables = 1 + static_cast<int>(gen() % 3);
    for (int s = 0; s < syllables; ++s) {
      w += consonants[gen() % consonants.size()];
      w += vowels[gen() % vowels.size()];
    }
    words.push_back(w);
  }
  return words;
}

// Lines of words drawn with a skewed frequency (the repetition a subword model needs).
std::string MakeText(uint32_t seed, int sentences) {
  static const std::vector<std::string> words = Words();
  std::mt19937 gen(seed);
  std::string out;
  for (int s = 0; s < sentences; ++s) {
    const int n = 4 + static_cast<int>(gen() % 8);
    for (int w = 0; w < n; ++w) {
      if (w > 0) out += ' ';
      const size_t a = gen() % words.size(), b = gen() % words.size();
      out += words[std::min(a, b)];
    }
    out += ".\n";
  }
  return out;
}

void WriteFile(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void SetMtime(const fs::path& path, std::chrono::seconds from_now) {
  fs::last_write_time(path, fs::file_time_type::clock::now() + from_now);
}

// A cache is trusted only when dated after its inputs' ctime, in the file system's clock, whose
// ticks may be coarse (4 ms): a cache written in an input's tick is made again. Returns once a
// file written now is dated after every path's ctime, so that the test's next cache is.
void WaitPastCtimes(const fs::path& dir, const std::vector<fs::path>& paths) {
  struct timespec latest {};
  for (const fs::path& p : paths) {
    struct stat st;
    ASSERT_EQ(::stat(p.c_str(), &st), 0) << p;
    if (st.st_ctim.tv_sec > latest.tv_sec ||
        (st.st_ctim.tv_sec == latest.tv_sec && st.st_ctim.tv_nsec > latest.tv_nsec)) {
      latest = st.st_ctim;
    }
  }
  const fs::path probe = dir / "clock.probe";
  for (int tries = 0; tries < 2000; ++tries) {
    WriteFile(probe, "x");
    struct stat st;
    ASSERT_EQ(::stat(probe.c_str(), &st), 0);
    if (st.st_mtim.tv_sec > latest.tv_sec ||
        (st.st_mtim.tv_sec == latest.tv_sec && st.st_mtim.tv_nsec > latest.tv_nsec)) {
      fs::remove(probe);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  FAIL() << "the file system's clock did not move past the inputs' ctime in 2 s";
}

class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("strata_tokenizer_" + std::to_string(::getpid())));
    fs::remove_all(*dir_);
    fs::create_directories(*dir_);
    // The user token cache of these tests (never the real ~/.cache).
    const char* xdg = std::getenv("XDG_CACHE_HOME");
    saved_xdg_ = new std::string(xdg == nullptr ? "" : xdg);
    ::setenv("XDG_CACHE_HOME", (*dir_ / "xdg-cache").c_str(), 1);
    const fs::path corpus = *dir_ / "corpus.txt";
    WriteFile(corpus, MakeText(1, 400));
    // Identity normalization and kept whitespace: decode(encode(x)) == x for text of the
    // corpus' characters on one line.
    const std::string args = fmt::format(
        "--input={} --model_prefix={} --vocab_size={} --model_type=unigram "
        "--character_coverage=1.0 --normalization_rule_name=identity "
        "--remove_extra_whitespaces=false --num_threads=1 --minloglevel=2",
        corpus.string(), (*dir_ / "tiny").string(), kVocab);
    const auto status = sentencepiece::SentencePieceTrainer::Train(args);
    train_error_ = new std::string(status.ok() ? "" : status.ToString());
    model_path_ = new std::string((*dir_ / "tiny.model").string());
  }
  static void TearDownTestSuite() {
    if (saved_xdg_->empty()) {
      ::unsetenv("XDG_CACHE_HOME");
    } else {
      ::setenv("XDG_CACHE_HOME", saved_xdg_->c_str(), 1);
    }
    delete saved_xdg_;
    fs::remove_all(*dir_);
    delete dir_;
    delete model_path_;
    delete train_error_;
  }
  void SetUp() override {
    // A failure (not a skip) in every test when the model could not be trained.
    ASSERT_EQ(*train_error_, "") << "training the SentencePiece model failed";
    work_ = *dir_ / ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::create_directories(work_);
    // A copy per test, so that changing its time does not affect other tests.
    model_ = (work_ / "tokenizer.model").string();
    fs::copy_file(*model_path_, model_);
  }

  // "train.txt" holding MakeText(seed, words), it and the model modified 100 s ago (so that a
  // cache made now is newer than both).
  std::string OldText(int seed, int words) {
    const std::string path = (work_ / "train.txt").string();
    WriteFile(path, MakeText(seed, words));
    SetMtime(path, std::chrono::seconds(-100));
    SetMtime(model_, std::chrono::seconds(-100));
    WaitPastCtimes(work_, {path, model_});
    return path;
  }

  std::unique_ptr<Tokenizer> LoadModel() {
    auto t = Tokenizer::Load(model_);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(*t) : nullptr;
  }

  static std::vector<int32_t> ReadTokens(const std::string& path, int vocab) {
    auto d = TokenDataset::Open({path}, vocab);
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    if (!d.ok()) return {};
    std::vector<int32_t> out(d->num_tokens());
    d->Read(0, d->num_tokens(), out.data());
    return out;
  }

  static fs::path* dir_;
  static std::string* model_path_;
  static std::string* saved_xdg_;
  static std::string* train_error_;
  fs::path work_;
  std::string model_;
};

fs::path* TokenizerTest::dir_ = nullptr;
std::string* TokenizerTest::model_path_ = nullptr;
std::string* TokenizerTest::saved_xdg_ = nullptr;
std::string* TokenizerTest::train_error_ = nullptr;

TEST_F(TokenizerTest, TheTrainedModelHasItsVocabularyAndSpecialIds) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->vocab_size(), kVocab);
  EXPECT_EQ(t->bos_id(), 1);  // SentencePiece's defaults: unk 0, bos 1, eos 2
  EXPECT_EQ(t->eos_id(), 2);
  EXPECT_EQ(t->path(), model_);
  EXPECT_EQ(t->fingerprint(), [&] {
    const std::string bytes = ReadFile(model_);
    return XXH3_64bits(bytes.data(), bytes.size());
  }());
}

TEST_F(TokenizerTest, TokenIdFindsAPieceExactlyAndNothingElse) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->TokenId("<s>"), t->bos_id());
  EXPECT_EQ(t->TokenId("</s>"), t->eos_id());
  EXPECT_EQ(t->TokenId("<unk>"), 0);
  EXPECT_EQ(t->TokenId("no such piece at all"), -1);
  EXPECT_EQ(t->TokenId(""), -1);
}

TEST_F(TokenizerTest, EncodeThenDecodeGivesTheTextBack) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  // A line like the corpus' (newline dropped: SentencePiece trains on lines, so it has no piece
  // for one), unseen words made of its letters, one letter, nothing.
  std::string line = MakeText(99, 1);
  line.pop_back();
  for (const std::string& text :
       {line, std::string("zobavu kiremo tusapi"), std::string("a"), std::string("")}) {
    auto ids = t->Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status().ToString();
    for (int32_t id : *ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, kVocab);
      EXPECT_NE(id, 0) << "unknown piece in '" << text << "'";
    }
    auto back = t->Decode(*ids);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, text);
  }
}

TEST_F(TokenizerTest, FrequentWordsTakeFewerTokensThanBytes) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  const std::vector<std::string> words = Words();
  std::string text;
  for (int i = 0; i < 10; ++i) text += (i ? " " : "") + words[i];
  auto ids = t->Encode(text);
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  EXPECT_LT(ids->size() * 2, text.size());
}

TEST_F(TokenizerTest, DecodeRejectsAnIdOutsideTheVocabulary) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  for (int32_t bad : {kVocab, -1}) {
    auto text = t->Decode(std::vector<int32_t>{5, bad});
    ASSERT_FALSE(text.ok());
    EXPECT_EQ(text.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(text.status().message(), HasSubstr(fmt::format("id {} at position 1", bad)));
  }
}

TEST_F(TokenizerTest, AFileThatIsNotAModelIsAOneLineErrorNamingIt) {
  const fs::path bad = work_ / "not_a_model.model";
  WriteFile(bad, "this is not a serialized SentencePiece model\n\x01\x02\xff");
  auto t = Tokenizer::Load(bad.string());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("tokenizer file '" + bad.string() + "'"));
  EXPECT_THAT(t.status().message(), Not(HasSubstr("\n")));
  // A truncated real model.
  const fs::path cut = work_ / "cut.model";
  const std::string model = ReadFile(model_);
  WriteFile(cut, model.substr(0, model.size() / 2));
  auto c = Tokenizer::Load(cut.string());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(fmt::format("'{}'", cut.string())));
  EXPECT_THAT(c.status().message(), Not(HasSubstr("\n")));
}

TEST_F(TokenizerTest, AMissingTokenizerFileIsNotFoundNamingIt) {
  const std::string missing = (work_ / "missing.model").string();
  auto t = Tokenizer::Load(missing);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(t.status().message(), HasSubstr("'" + missing + "'"));
  EXPECT_THAT(t.status().message(), Not(HasSubstr("\n")));
}

TEST_F(TokenizerTest, ATextFileIsOneDocumentWithBosFirst) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  const std::string text = MakeText(2, 20);
  WriteFile(work_ / "doc.txt", text);
  auto ids = TokenizeTextFile(*t, (work_ / "doc.txt").string());
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  auto whole = t->Encode(text);
  ASSERT_TRUE(whole.ok());
  ASSERT_EQ(ids->size(), whole->size() + 1);
  EXPECT_EQ((*ids)[0], 1);
  for (size_t i = 0; i < whole->size(); ++i) ASSERT_EQ((*ids)[i + 1], (*whole)[i]) << i;
}

// A tokenizer_config.json beside the model decides as LlamaTokenizer reads it: add_bos_token
// false drops the BOS, add_eos_token true ends the document with the EOS (before, both were
// ignored), and the text cache is another file.
TEST_F(TokenizerTest, TokenizerConfigBesideTheModelDecidesBosAndEos) {
  const std::string text = MakeText(2, 20);
  const std::string text_path = (work_ / "doc.txt").string();
  WriteFile(text_path, text);
  auto plain = LoadModel();
  ASSERT_NE(plain, nullptr);
  auto whole = plain->Encode(text);
  ASSERT_TRUE(whole.ok());
  WriteFile(work_ / "tokenizer_config.json", R"({"add_bos_token": false, "add_eos_token": true})");
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  EXPECT_FALSE(t->adds_bos());
  EXPECT_TRUE(t->adds_eos());
  auto ids = TokenizeTextFile(*t, text_path);
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  std::vector<int32_t> want = *whole;
  want.push_back(t->eos_id());
  EXPECT_EQ(*ids, want);
  EXPECT_NE(TokenCachePath(text_path, *t), TokenCachePath(text_path, *plain));
  WriteFile(work_ / "tokenizer_config.json", R"({"add_bos_token": 1})");
  auto bad = Tokenizer::Load(model_);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("/add_bos_token: must be true or false"), std::string::npos)
      << bad.status().message();
  EXPECT_NE(bad.status().message().find("tokenizer_config.json"), std::string::npos);
}

TEST_F(TokenizerTest, TheCacheIsATokenFileBesideTheTextNamedByTheTokenizerHash) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  const std::string text_path = OldText(3, 50);
  const std::string want_path = TokenCachePath(text_path, *t);
  ASSERT_EQ(want_path.size(), text_path.size() + 1 + 16 + 7) << want_path;  // .<16 hex>.tokens
  EXPECT_TRUE(want_path.starts_with(text_path + ".") && want_path.ends_with(".tokens"));
  EXPECT_NE(want_path, fmt::format("{}.{:016x}.tokens", text_path, t->fingerprint()));
  bool reused = true;
  auto cache = TokenizeTextFileCached(*t, text_path, &reused);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  EXPECT_EQ(*cache, want_path);
  EXPECT_FALSE(reused);
  auto ids = TokenizeTextFile(*t, text_path);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ReadTokens(*cache, kVocab), *ids);
}

TEST_F(TokenizerTest, ACacheNewerThanBothInputsIsReusedAsIs) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  const std::string text_path = OldText(4, 50);
  bool reused = true;
  auto first = TokenizeTextFileCached(*t, text_path, &reused);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_FALSE(reused);
  // Replace the cache with other tokens, newer than both inputs: a reuse keeps them.
  ASSERT_TRUE(WriteTokenFile(*first, std::vector<int32_t>{7, 8, 9}).ok());
  auto second = TokenizeTextFileCached(*t, text_path, &reused);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_TRUE(reused);
  EXPECT_EQ(*second, *first);
  EXPECT_EQ(ReadTokens(*second, kVocab), (std::vector<int32_t>{7, 8, 9}));
}

// A cache cut short (a full disk under another tool, a truncation) is newer than its inputs but
// its header no longer describes its size: made again rather than refused when opened.
TEST_F(TokenizerTest, ATruncatedCacheIsMadeAgain) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  const std::string text_path = OldText(9, 50);
  bool reused = true;
  auto cache = TokenizeTextFileCached(*t, text_path, &reused);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  EXPECT_TRUE(TokenFileLooksWhole(*cache));
  fs::resize_file(*cache, fs::file_size(*cache) - 3);
  EXPECT_FALSE(TokenFileLooksWhole(*cache));
  auto again = TokenizeTextFileCached(*t, text_path, &reused);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_FALSE(reused);
  auto ids = TokenizeTextFile(*t, text_path);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ReadTokens(*again, kVocab), *ids);
}

TEST_F(TokenizerTest, ACacheOlderThanTheTextOrTheTokenizerIsMadeAgain) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  const std::string text_path = OldText(5, 50);
  bool reused = true;
  auto cache = TokenizeTextFileCached(*t, text_path, &reused);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  // The text changes after the cache was made.
  WriteFile(text_path, MakeText(6, 30));
  SetMtime(*cache, std::chrono::seconds(-50));
  auto again = TokenizeTextFileCached(*t, text_path, &reused);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_FALSE(reused);
  auto ids = TokenizeTextFile(*t, text_path);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ReadTokens(*again, kVocab), *ids);
  // The tokenizer file is touched after the cache: made again too.
  SetMtime(text_path, std::chrono::seconds(-100));
  SetMtime(*cache, std::chrono::seconds(-50));
  SetMtime(model_, std::chrono::seconds(-10));
  ASSERT_TRUE(WriteTokenFile(*cache, std::vector<int32_t>{7}).ok());
  SetMtime(*cache, std::chrono::seconds(-50));
  auto third = TokenizeTextFileCached(*t, text_path, &reused);
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  EXPECT_FALSE(reused);
  EXPECT_EQ(ReadTokens(*third, kVocab), *ids);
  // Another text put in place with an older mtime (cp -p, tar, rsync -a): its ctime is new, so
  // the cache is made again (before, an mtime older than the cache's kept the old tokens).
  SetMtime(model_, std::chrono::seconds(-100));
  auto fresh = TokenizeTextFileCached(*t, text_path, &reused);
  ASSERT_TRUE(fresh.ok());
  WriteFile(text_path, MakeText(8, 40));
  SetMtime(text_path, std::chrono::seconds(-1000));
  auto copied = TokenizeTextFileCached(*t, text_path, &reused);
  ASSERT_TRUE(copied.ok()) << copied.status().ToString();
  EXPECT_FALSE(reused);
  auto copied_ids = TokenizeTextFile(*t, text_path);
  ASSERT_TRUE(copied_ids.ok());
  EXPECT_EQ(ReadTokens(*copied, kVocab), *copied_ids);
}

// A text whose directory cannot hold the cache (a read-only dataset mount; here a directory
// squats on the cache's name, which even root cannot replace) is cached in the user cache
// directory, named by its absolute path, and reused from there.
TEST_F(TokenizerTest, ACacheThatCannotSitBesideTheTextGoesToTheUserCache) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  const std::string text_path = OldText(10, 50);
  fs::create_directories(fs::path(TokenCachePath(text_path, *t)) / "squatter");
  const std::string user_path = UserTokenCachePath(text_path, *t);
  EXPECT_EQ(fs::path(user_path).parent_path(), *dir_ / "xdg-cache" / "strata" / "tokens");
  EXPECT_TRUE(fs::path(user_path).filename().string().starts_with("train.txt."));
  bool reused = true;
  std::string note;
  auto cache = TokenizeTextFileCached(*t, text_path, &reused, &note);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  EXPECT_EQ(*cache, user_path);
  EXPECT_FALSE(reused);
  EXPECT_THAT(note, HasSubstr("in the user cache: "));
  EXPECT_THAT(note, HasSubstr(TokenCachePath(text_path, *t)));
  auto ids = TokenizeTextFile(*t, text_path);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ReadTokens(*cache, kVocab), *ids);
  auto again = TokenizeTextFileCached(*t, text_path, &reused, &note);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, user_path);
  EXPECT_TRUE(reused);
  EXPECT_THAT(note, HasSubstr("in the user cache"));
  // The text changes: its user cache is made again.
  WriteFile(text_path, MakeText(11, 30));
  SetMtime(*cache, std::chrono::seconds(-50));
  auto changed = TokenizeTextFileCached(*t, text_path, &reused, &note);
  ASSERT_TRUE(changed.ok()) << changed.status().ToString();
  EXPECT_FALSE(reused);
  auto changed_ids = TokenizeTextFile(*t, text_path);
  ASSERT_TRUE(changed_ids.ok());
  EXPECT_EQ(ReadTokens(*changed, kVocab), *changed_ids);
  // The directory can hold a cache again: the fresh user cache is still reused, not made again.
  // (A cache written in the same clock tick as the text is not trusted, and this one may have
  // been: it is dated a second later, as a cache written after the text would be.)
  fs::remove_all(TokenCachePath(text_path, *t));
  SetMtime(*changed, std::chrono::seconds(1));
  auto later = TokenizeTextFileCached(*t, text_path, &reused, &note);
  ASSERT_TRUE(later.ok()) << later.status().ToString();
  EXPECT_EQ(*later, user_path);
  EXPECT_TRUE(reused);
}

TEST_F(TokenizerTest, TheUserCacheIsNamedByTheTextsAbsolutePath) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  const fs::path a = work_ / "a" / "train.txt", b = work_ / "b" / "train.txt";
  fs::create_directories(a.parent_path());
  fs::create_directories(b.parent_path());
  WriteFile(a, MakeText(12, 20));
  WriteFile(b, MakeText(13, 20));
  EXPECT_NE(UserTokenCachePath(a.string(), *t), UserTokenCachePath(b.string(), *t));
  const fs::path cwd = fs::current_path();
  fs::current_path(work_);
  const std::string relative = UserTokenCachePath("a/train.txt", *t);
  fs::current_path(cwd);
  EXPECT_EQ(relative, UserTokenCachePath(a.string(), *t));
}

// A read-only directory: permissions root ignores, so this runs only for other users.
TEST_F(TokenizerTest, AReadOnlyTextDirectoryIsCachedInTheUserCache) {
  if (::geteuid() == 0) GTEST_SKIP() << "root writes into a directory of mode 0555";
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  const std::string text_path = OldText(14, 50);
  fs::permissions(work_, fs::perms::owner_read | fs::perms::owner_exec);
  bool reused = true;
  std::string note;
  auto cache = TokenizeTextFileCached(*t, text_path, &reused, &note);
  fs::permissions(work_, fs::perms::owner_all);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  EXPECT_EQ(*cache, UserTokenCachePath(text_path, *t));
  EXPECT_THAT(note, HasSubstr("ermission denied"));
}

TEST_F(TokenizerTest, WhenNeitherPlaceCanHoldTheCacheBothAreNamed) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  const std::string text_path = OldText(15, 50);
  fs::create_directories(fs::path(TokenCachePath(text_path, *t)) / "squatter");
  const std::string xdg = std::getenv("XDG_CACHE_HOME");
  // The user cache directory's place is a file.
  WriteFile(work_ / "not-a-dir", "x");
  ::setenv("XDG_CACHE_HOME", (work_ / "not-a-dir").c_str(), 1);
  bool reused = true;
  auto no_dir = TokenizeTextFileCached(*t, text_path, &reused);
  // No user cache directory at all.
  ::setenv("XDG_CACHE_HOME", "relative", 1);
  const char* home = std::getenv("HOME");
  const std::string saved_home = home == nullptr ? "" : home;
  ::setenv("HOME", "relative", 1);
  auto none = TokenizeTextFileCached(*t, text_path, &reused);
  ::setenv("HOME", saved_home.c_str(), 1);
  ::setenv("XDG_CACHE_HOME", xdg.c_str(), 1);
  ASSERT_FALSE(no_dir.ok());
  EXPECT_THAT(no_dir.status().message(), HasSubstr(TokenCachePath(text_path, *t)));
  EXPECT_THAT(no_dir.status().message(), HasSubstr("user cache directory"));
  EXPECT_THAT(no_dir.status().message(), HasSubstr("not-a-dir"));
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(), HasSubstr("no user cache directory"));
}

TEST_F(TokenizerTest, TrainingDataFromTextAndATokenizerAreItsTokenizedCache) {
  const std::string text_path = (work_ / "train.txt").string();
  WriteFile(text_path, MakeText(7, 200));
  const int T = 8;
  auto data = OpenTrainingData(Opts({text_path}, T, 256, {}, model_));
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  ASSERT_NE(data->tokenizer, nullptr);
  EXPECT_FALSE(data->byte_level);
  EXPECT_THAT(data->dataset->Describe(), HasSubstr("tokenized by"));
  auto ids = TokenizeTextFile(*data->tokenizer, text_path);
  ASSERT_TRUE(ids.ok());
  const auto n = static_cast<int64_t>(ids->size());
  const int64_t split = static_cast<int64_t>(static_cast<double>(n) * 0.9);
  EXPECT_EQ(data->dataset->train_tokens(), split);
  EXPECT_EQ(data->dataset->val_tokens(), n - split);
  EXPECT_TRUE(fs::exists(TokenCachePath(text_path, *data->tokenizer)));
  std::mt19937_64 rng(3), reference(3);
  Batch batch;
  data->dataset->SampleTrainBatch(rng, 2, T, &batch);
  const auto& tokens = batch.tokens;
  const auto& targets = batch.targets;
  for (int b = 0; b < 2; ++b) {
    const uint64_t o = reference() % static_cast<uint64_t>(split - T);
    for (int i = 0; i < T; ++i) {
      EXPECT_EQ(tokens[b * T + i], (*ids)[o + i]);
      EXPECT_EQ(targets[b * T + i], (*ids)[o + i + 1]);
    }
  }
}

TEST_F(TokenizerTest, ATokenizerLargerThanTheModelVocabularyIsAnError) {
  const std::string text_path = (work_ / "train.txt").string();
  WriteFile(text_path, MakeText(8, 50));
  auto data = OpenTrainingData(Opts({text_path}, 4, kVocab - 1, {}, model_));
  ASSERT_FALSE(data.ok());
  EXPECT_EQ(data.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(), HasSubstr(fmt::format("has {} pieces", kVocab)));
  for (const auto& e : fs::directory_iterator(work_)) {
    EXPECT_NE(e.path().extension(), ".tokens") << "a cache was written: " << e.path();
  }
}

}  // namespace
}  // namespace strata::data

namespace strata::data {
namespace {

// ---- EncodeWithOffsets ----

// Trains a Llama-2-like model in `dir`: BPE with byte fallback and libsentencepiece's default
// normalization (nmt_nfkc, extra whitespace removed) on tinyshakespeare's first 200 kB. The
// model's path, or "" when training failed.
std::string TrainByteFallbackModel(const fs::path& dir) {
  fs::create_directories(dir);
  const fs::path corpus = dir / "corpus.txt";
  WriteFile(corpus, ReadFile(STRATA_TINYSHAKESPEARE).substr(0, 200000));
  const std::string args = fmt::format(
      "--input={} --model_prefix={} --vocab_size=600 --model_type=bpe --byte_fallback=true "
      "--character_coverage=1.0 --num_threads=1 --minloglevel=2",
      corpus.string(), (dir / "bf").string());
  return sentencepiece::SentencePieceTrainer::Train(args).ok() ? (dir / "bf.model").string() : "";
}

std::vector<std::string> SentencePieceOffsetTexts() {
  const std::string shakespeare = ReadFile(STRATA_TINYSHAKESPEARE);
  std::vector<std::string> texts = {"Hello world",
                                    "a b",
                                    " leading space",
                                    "trailing space ",
                                    "",
                                    "x",
                                    "\n\nWhat is 2+2?",
                                    "A\n\nB",
                                    "tabs\tand\r\nCRLF",
                                    "Привет, мир!",
                                    "日本語のテキスト",
                                    "Emoji: 👍🏽 🎉 ok",
                                    "e\xCC\x81 = \xC3\xA9",
                                    "\xE2\x82\xAC 5 \xE2\x82\xAC",
                                    MakeText(7, 20)};
  for (size_t at : {size_t{0}, size_t{5000}, size_t{500000}}) {
    texts.push_back(shakespeare.substr(at, 2000));
  }
  return texts;
}

const std::string kSpace = "\xE2\x96\x81";  // ▁

TEST_F(TokenizerTest, OffsetsOfATrainedModelGiveEncodesIdsAndTileTheText) {
  auto t = LoadModel();
  ASSERT_NE(t, nullptr);
  // Identity normalization, whitespace kept: the spans tile the text but for the dummy prefix.
  for (const std::string& text : SentencePieceOffsetTexts()) {
    testing::ExpectOffsetContract(*t, text, testing::SpanShape::kTilesWithPrefixes,
                                  "'" + text + "'");
  }
  const std::vector<std::string> words = Words();
  const std::string text = words[0] + " " + words[1];
  auto enc = t->EncodeWithOffsets(text);
  ASSERT_TRUE(enc.ok());
  ASSERT_FALSE(enc->spans.empty());
  EXPECT_EQ(enc->spans.back().end, text.size());
}

TEST(SentencePieceOffsetsTest, ALlama2LikeModelGivesEncodesIdsAndLibsentencepiecesOffsets) {
  const fs::path dir =
      fs::temp_directory_path() / ("strata_tokenizer_bf_" + std::to_string(::getpid()));
  const std::string model = TrainByteFallbackModel(dir);
  auto loaded = Tokenizer::Load(model);
  fs::remove_all(dir);
  ASSERT_NE(model, "") << "training the SentencePiece model failed";
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const Tokenizer& t = **loaded;
  // NFKC may change text (its tokens then share the changed run's span) and whitespace is
  // folded (leading and repeated whitespace is in no span).
  for (const std::string& text : SentencePieceOffsetTexts()) {
    testing::ExpectOffsetContract(t, text, testing::SpanShape::kOverlapping, "'" + text + "'",
                                  testing::Coverage::kAllButWhitespace);
  }
  testing::ExpectSpans(t, "Hello world", {kSpace + "H", "ell", "o", kSpace + "wor", "ld"},
                       {{0, 1}, {1, 4}, {4, 5}, {5, 9}, {9, 11}});
  // Each byte-fallback token of "€" covers the character ("5" too is a byte here); the dummy
  // prefix is empty.
  testing::ExpectSpans(t, "\xE2\x82\xAC 5",
                       {kSpace, "<0xE2>", "<0x82>", "<0xAC>", kSpace, "<0x35>"},
                       {{0, 0}, {0, 3}, {0, 3}, {0, 3}, {3, 4}, {4, 5}});
  // The newlines fold into the "▁" of "▁B", which covers them.
  testing::ExpectSpans(t, "A\n\nB", {kSpace + "A", kSpace + "B"}, {{0, 1}, {1, 4}});
}

// A model file's pieces reach libsentencepiece's messages ("<piece> is already defined"): the
// error quotes them escaped, for C and Python callers too (not only the CLI's last escape).
TEST(SentencePieceLoadTest, APieceQuotedInTheLibrarysErrorIsEscaped) {
  // ModelProto by hand: repeated SentencePiece pieces = 1 {piece = 1, score = 2, type = 3}.
  auto piece = [](const std::string& text, char type) {
    std::string inner;
    inner.push_back('\x0a');
    inner.push_back(static_cast<char>(text.size()));
    inner.append(text);
    inner.append({'\x15', '\x00', '\x00', '\x80', '\xbf'});  // score -1.0f
    inner.append({'\x18', type});
    std::string out;
    out.push_back('\x0a');
    out.push_back(static_cast<char>(inner.size()));
    return out.append(inner);
  };
  const fs::path dir =
      fs::temp_directory_path() / ("strata_tokenizer_dup_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "dup.model").string();
  std::ofstream(path, std::ios::binary)
      << piece("<unk>", 2) << piece("a\x1b[31m", 1) << piece("a\x1b[31m", 1);
  auto loaded = Tokenizer::Load(path);
  fs::remove_all(dir);
  ASSERT_FALSE(loaded.ok());
  const std::string m = loaded.status().message();
  EXPECT_THAT(m, ::testing::HasSubstr("does not load as a SentencePiece model: a\\x1B[31m is "
                                      "already defined"));
  for (char c : m) EXPECT_FALSE(static_cast<unsigned char>(c) < 0x20 || c == 0x7f) << m;
}

TEST(ByteLevelTokenizerTest, TokenIOfTheTextCoversByteI) {
  const auto t = MakeByteLevelTokenizer();
  const std::string text = "a\xE2\x82\xAC\n";
  const EncodedText enc =
      testing::ExpectOffsetContract(*t, text, testing::SpanShape::kTiles, "byte-level");
  ASSERT_EQ(enc.spans.size(), text.size());
  for (size_t i = 0; i < text.size(); ++i) EXPECT_EQ(enc.spans[i], (TokenSpan{i, i + 1}));
  testing::ExpectOffsetContract(*t, "", testing::SpanShape::kTiles, "byte-level, empty");
}

// A tokenizer that does not override EncodeWithOffsets.
class NoOffsetsTokenizer final : public Tokenizer {
 public:
  NoOffsetsTokenizer() : Tokenizer("plain.model", 0) {}
  int vocab_size() const override { return 256; }
  int bos_id() const override { return -1; }
  int eos_id() const override { return -1; }
  int TokenId(std::string_view) const override { return -1; }
  StatusOr<std::vector<int32_t>> Encode(std::string_view) const override {
    return std::vector<int32_t>{};
  }
  StatusOr<std::string> Decode(std::span<const int32_t>) const override { return std::string(); }
};

TEST(TokenizerOffsetsTest, ATokenizerWithoutOffsetsIsUnimplementedNamingIt) {
  NoOffsetsTokenizer t;
  auto enc = t.EncodeWithOffsets("x");
  ASSERT_FALSE(enc.ok());
  EXPECT_EQ(enc.status().code(), StatusCode::kUnimplemented);
  EXPECT_THAT(enc.status().message(), HasSubstr("plain.model"));
}

}  // namespace
}  // namespace strata::data
