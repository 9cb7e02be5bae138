// The safetensors writer and the validating header parser, on good and hostile input.
#include "formats/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

namespace strata::formats {
namespace {

namespace fs = std::filesystem;

// A file image: 8-byte little-endian length, the header text, then data_bytes zero bytes.
std::vector<std::byte> Image(const std::string& header, size_t data_bytes) {
  std::vector<std::byte> v(8 + header.size() + data_bytes);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) v[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  std::memcpy(v.data() + 8, header.data(), header.size());
  return v;
}

StatusOr<SafetensorsHeader> Parse(const std::string& header, size_t data_bytes) {
  const auto img = Image(header, data_bytes);
  return ParseSafetensorsHeader(img, img.size());
}

void ExpectError(const StatusOr<SafetensorsHeader>& r, StatusCode code, const std::string& needle) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), code) << r.status().ToString();
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().ToString();
}

TEST(SafetensorsHeader, ValidHeaderWithMetadataParses) {
  auto r = Parse(R"({"b":{"dtype":"BF16","shape":[3],"data_offsets":[8,14]},)"
                 R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                 R"("__metadata__":{"format":"pt"}})",
                 14);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->tensors.size(), 2u);
  EXPECT_EQ(r->tensors[0].name, "a");  // sorted by offset
  EXPECT_EQ(r->tensors[1].dtype, DType::kBF16);
  EXPECT_EQ(r->tensors[1].shape, std::vector<int64_t>{3});
  EXPECT_EQ(r->metadata.at("format"), "pt");
  EXPECT_NE(r->Find("b"), nullptr);
  EXPECT_EQ(r->Find("c"), nullptr);
}

TEST(SafetensorsHeader, ScalarAndEmptyTensorsAreAllowed) {
  auto r = Parse(R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
                 R"("e":{"dtype":"F16","shape":[0,5],"data_offsets":[4,4]}})",
                 4);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->Find("s")->num_elems, 1);
  EXPECT_EQ(r->Find("e")->num_elems, 0);
}

TEST(SafetensorsHeader, HostileHeadersAreClearErrors) {
  // Lengths.
  {
    const std::vector<std::byte> tiny(5);
    ExpectError(ParseSafetensorsHeader(tiny, tiny.size()), StatusCode::kDataLoss, "8-byte");
    auto img = Image("{}", 0);
    img[7] = std::byte{0x80};  // header length 2^63 + 2
    ExpectError(ParseSafetensorsHeader(img, img.size()), StatusCode::kDataLoss, "does not fit");
    img = Image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4);
    ExpectError(ParseSafetensorsHeader(std::span(img).first(20), img.size()), StatusCode::kDataLoss,
                "truncated");
  }
  ExpectError(Parse("{\"a\":", 0), StatusCode::kDataLoss, "not a JSON object");
  ExpectError(Parse("[1,2]", 0), StatusCode::kDataLoss, "not a JSON object");
  ExpectError(Parse(R"({"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", 8),
              StatusCode::kInvalidArgument, "'I64' is not supported");
  // A dtype holding DEL is quoted escaped (it was cut, not escaped: safetensors_header_fuzz).
  ExpectError(Parse("{\"a\":{\"dtype\":\"BF1\x7f\",\"shape\":[1],\"data_offsets\":[0,2]}}", 2),
              StatusCode::kInvalidArgument, "safetensors dtype 'BF1\\x7F' is not supported");
  ExpectError(Parse(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
              StatusCode::kDataLoss, "non-negative integer");
  ExpectError(Parse(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4),
              StatusCode::kDataLoss, "non-negative integer");
  ExpectError(
      Parse(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4),
      StatusCode::kDataLoss, "overflows");
  ExpectError(
      Parse(R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,4]}})", 4),
      StatusCode::kDataLoss, "overflows");
  ExpectError(Parse(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4),
              StatusCode::kDataLoss, "not inside the data section");
  ExpectError(Parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4),
              StatusCode::kDataLoss, "not inside the data section");
  ExpectError(Parse(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4),
              StatusCode::kDataLoss, "need 8");
  ExpectError(Parse(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                    R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                    8),
              StatusCode::kDataLoss, "overlap");
  ExpectError(Parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
              StatusCode::kDataLoss, "hole");
  ExpectError(Parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 12),
              StatusCode::kDataLoss, "cover 4");
  ExpectError(Parse(R"({"a\u0001":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4),
              StatusCode::kDataLoss, "printable");
  ExpectError(Parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", 4),
              StatusCode::kDataLoss, "unknown field");
  ExpectError(Parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4),
              StatusCode::kDataLoss, "two non-negative integers");
  ExpectError(Parse(R"({"a":[1]})", 4), StatusCode::kDataLoss, "not a JSON object");
  ExpectError(Parse(R"({"__metadata__":{"k":1}})", 0), StatusCode::kDataLoss, "not a string");
  // Nesting past the limit is refused before anything is built (a 100 MB header of brackets
  // held gigabytes of nodes).
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  ExpectError(Parse(R"({"a":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,4]}})", 4),
              StatusCode::kDataLoss,
              "safetensors header is not a JSON object: JSON nested deeper than 64 levels");
}

// Every prefix and every single-byte change of a valid file is either parsed into a header whose
// tensors lie inside the file, or rejected: never a crash (run under ASan by the lead's CI).
TEST(SafetensorsHeader, EveryTruncationAndByteFlipIsParsedSafely) {
  const auto img = Image(R"({"w":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]},)"
                         R"("b":{"dtype":"F32","shape":[3],"data_offsets":[12,24]}})",
                         24);
  for (size_t n = 0; n <= img.size(); ++n) {
    auto r = ParseSafetensorsHeader(std::span(img).first(n), n);
    if (n != img.size()) {
      EXPECT_FALSE(r.ok()) << n;
    }
  }
  int accepted = 0;
  for (size_t i = 0; i < img.size() - 24; ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      auto copy = img;
      copy[i] ^= static_cast<std::byte>(1 << bit);
      auto r = ParseSafetensorsHeader(copy, copy.size());
      if (!r.ok()) continue;
      ++accepted;
      for (const auto& t : r->tensors) {
        EXPECT_LE(r->data_offset_bytes + t.end_bytes, copy.size());
      }
    }
  }
  EXPECT_GT(accepted, 0);  // e.g. a flipped letter in a name is still a valid file
}

class SafetensorsFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_st_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(SafetensorsFileTest, WriterStreamsPiecesAndReaderReturnsThem) {
  const std::string path = (dir_ / "a.safetensors").string();
  std::vector<float> a(7);
  std::vector<uint16_t> b(5);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.5f * i - 1;
  for (size_t i = 0; i < b.size(); ++i) b[i] = FloatToBf16(3.0f * i);
  auto w = SafetensorsWriter::Create(
      path, {{"a", DType::kF32, {7}}, {"h.0.b", DType::kBF16, {1, 5}}}, {{"k", "v"}});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const auto ab = std::as_bytes(std::span(a));
  ASSERT_TRUE(w->Append(ab.first(5)).ok());  // pieces need not follow tensor boundaries
  ASSERT_TRUE(w->Append(ab.subspan(5)).ok());
  ASSERT_TRUE(w->Append(std::as_bytes(std::span(b))).ok());
  EXPECT_EQ(w->Append(std::as_bytes(std::span(b))).code(), StatusCode::kFailedPrecondition);
  auto res = w->Finish();
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  uint64_t size = 0;
  auto hash = FileXxh3(path, &size);
  ASSERT_TRUE(hash.ok());
  EXPECT_EQ(size, res->size_bytes);
  EXPECT_EQ(*hash, res->xxh3);
  EXPECT_EQ(fs::status(path).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);

  auto f = OpenSafetensorsFile(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.data_offset_bytes % 8, 0u);
  EXPECT_EQ(f->header.metadata.at("k"), "v");
  const auto* ta = f->header.Find("a");
  const auto* tb = f->header.Find("h.0.b");
  ASSERT_TRUE(ta && tb);
  EXPECT_EQ(tb->shape, (std::vector<int64_t>{1, 5}));
  std::vector<float> a2(7);
  std::vector<uint16_t> b2(5);
  ASSERT_TRUE(ReadTensorBytes(*f, *ta, 0, std::as_writable_bytes(std::span(a2))).ok());
  ASSERT_TRUE(ReadTensorBytes(*f, *tb, 0, std::as_writable_bytes(std::span(b2))).ok());
  EXPECT_EQ(a, a2);
  EXPECT_EQ(b, b2);
  EXPECT_EQ(ReadTensorBytes(*f, *tb, 2, std::as_writable_bytes(std::span(b2))).code(),
            StatusCode::kOutOfRange);

  // Existing files are never overwritten; symlinks are not followed.
  EXPECT_EQ(SafetensorsWriter::Create(path, {}, {}).status().code(), StatusCode::kAlreadyExists);
  fs::create_symlink(path, dir_ / "link");
  EXPECT_FALSE(OpenSafetensorsFile((dir_ / "link").string()).ok());
}

// Two "ranks" writing halves of every tensor give the streaming writer's file, byte for byte.
TEST_F(SafetensorsFileTest, PartWritersFromSeveralProcessesMakeTheStreamingWritersFile) {
  std::vector<float> a(9);
  std::vector<uint16_t> b(6);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.25f * i - 1;
  for (size_t i = 0; i < b.size(); ++i) b[i] = FloatToBf16(2.0f * i + 1);
  const std::vector<SafetensorsWriter::TensorSpec> specs = {{"a", DType::kF32, {9}},
                                                            {"b", DType::kBF16, {2, 3}}};
  const std::map<std::string, std::string> meta = {{"format", "strata"}};
  const std::string whole = (dir_ / "whole.safetensors").string();
  auto w = SafetensorsWriter::Create(whole, specs, meta);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(w->Append(std::as_bytes(std::span(a))).ok());
  ASSERT_TRUE(w->Append(std::as_bytes(std::span(b))).ok());
  ASSERT_TRUE(w->Finish().ok());

  const std::string parts = (dir_ / "parts.safetensors").string();
  EXPECT_EQ(SafetensorsPartWriter::Open(parts, specs, meta).status().code(),
            StatusCode::kNotFound);  // Create comes first
  auto r0 = SafetensorsPartWriter::Create(parts, specs, meta);
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  auto r1 = SafetensorsPartWriter::Open(parts, specs, meta);
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  const auto ab = std::as_bytes(std::span(a)), bb = std::as_bytes(std::span(b));
  // Rank 1 writes its halves first: the order does not matter.
  ASSERT_TRUE(r1->WriteAt(0, 20, ab.subspan(20)).ok());
  ASSERT_TRUE(r1->WriteAt(1, 6, bb.subspan(6)).ok());
  ASSERT_TRUE(r0->WriteAt(0, 0, ab.first(20)).ok());
  ASSERT_TRUE(r0->WriteAt(1, 0, bb.first(6)).ok());
  EXPECT_EQ(r0->WriteAt(1, 8, bb.first(6)).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(r0->WriteAt(2, 0, bb.first(1)).code(), StatusCode::kOutOfRange);
  ASSERT_TRUE(r0->Sync().ok());
  ASSERT_TRUE(r1->Sync().ok());
  uint64_t whole_size = 0, parts_size = 0;
  auto h_whole = FileXxh3(whole, &whole_size);
  auto h_parts = FileXxh3(parts, &parts_size);
  ASSERT_TRUE(h_whole.ok() && h_parts.ok());
  EXPECT_EQ(parts_size, whole_size);
  EXPECT_EQ(*h_parts, *h_whole);
  // Another layout than the file's is refused; an existing file is never created over.
  EXPECT_EQ(SafetensorsPartWriter::Open(parts, {{"a", DType::kF32, {10}}}, meta).status().code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(SafetensorsPartWriter::Create(parts, specs, meta).status().code(),
            StatusCode::kAlreadyExists);
}

// A FIFO or a directory where a checkpoint's data file belongs (inspect and resume hash every
// file first) is refused at once, not waited on for a writer that never comes.
TEST_F(SafetensorsFileTest, HashingAFifoOrADirectoryIsRefusedWithoutWaiting) {
  const std::string fifo = (dir_ / "master.safetensors").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  uint64_t size = 0;
  for (const auto& [path, type] :
       {std::pair{fifo, "a FIFO"}, std::pair{dir_.string(), "a directory"}}) {
    const auto hash = FileXxh3(path, &size);
    EXPECT_EQ(hash.status().code(), StatusCode::kInvalidArgument) << hash.status().ToString();
    EXPECT_EQ(hash.status().message(),
              "file '" + path + "' is " + std::string(type) + ", not a regular file");
  }
}

TEST_F(SafetensorsFileTest, UnfinishedOrShortWritesAreReported) {
  const std::string path = (dir_ / "b.safetensors").string();
  auto w = SafetensorsWriter::Create(path, {{"a", DType::kF32, {4}}}, {});
  ASSERT_TRUE(w.ok());
  const float x[2] = {1, 2};
  ASSERT_TRUE(w->Append(std::as_bytes(std::span(x))).ok());
  EXPECT_EQ(w->Finish().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(SafetensorsWriter::Create((dir_ / "c").string(),
                                      {{"a", DType::kF32, {1}}, {"a", DType::kF32, {1}}}, {})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  // A file cut inside its data section is rejected when opened.
  auto w2 = SafetensorsWriter::Create((dir_ / "d").string(), {{"a", DType::kF32, {4}}}, {});
  const float y[4] = {1, 2, 3, 4};
  ASSERT_TRUE(w2->Append(std::as_bytes(std::span(y))).ok());
  ASSERT_TRUE(w2->Finish().ok());
  fs::resize_file(dir_ / "d", fs::file_size(dir_ / "d") - 1);
  auto f = OpenSafetensorsFile((dir_ / "d").string());
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kDataLoss);
}

// The same tensor name is in several files of a checkpoint (master, exp_avg, working params):
// a read error names the file, not only the tensor.
TEST_F(SafetensorsFileTest, ReadOfAFileTruncatedAfterOpeningNamesTheFile) {
  const std::string path = (dir_ / "exp_avg.safetensors").string();
  auto w = SafetensorsWriter::Create(path, {{"layers.3", DType::kF32, {4}}}, {});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const float x[4] = {1, 2, 3, 4};
  ASSERT_TRUE(w->Append(std::as_bytes(std::span(x))).ok());
  ASSERT_TRUE(w->Finish().ok());
  auto f = OpenSafetensorsFile(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const SafetensorsTensor* t = f->header.Find("layers.3");
  ASSERT_NE(t, nullptr);
  fs::resize_file(path, f->file_size - 5);  // cut after opening: the header is valid
  float back[4];
  const Status s = ReadTensorBytes(*f, *t, 0, std::as_writable_bytes(std::span(back)));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find(std::string("'") + path + "'"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("tensor 'layers.3'"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find(std::string("file ends at byte ") + std::to_string(f->file_size - 5)),
            std::string::npos)
      << s.ToString();
}

}  // namespace
}  // namespace strata::formats
