// tools/metrics: CRC-32C against RFC 3720's vectors, TFRecord framing read back with an
// independent bit-by-bit CRC, the event file's bytes against TensorBoard's wire format written out
// by hand, and the JSON lines and CSV files parsed back value by value.
#include "tools/metrics.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tools/tensorboard_event.pb.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;

// Bit-at-a-time CRC-32C (reflected polynomial 0x82F63B78), the test's own reference for Boost.
uint32_t ReferenceCrc32c(std::string_view data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : data) {
    crc ^= byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

uint64_t ReadLittleEndian(std::string_view bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    v |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  }
  return v;
}

// Splits a file's bytes into TFRecord payloads, checking both CRCs of every record.
std::vector<std::string> ReadRecords(const std::string& bytes) {
  std::vector<std::string> records;
  size_t pos = 0;
  while (pos < bytes.size()) {
    EXPECT_GE(bytes.size() - pos, 16u) << "truncated record at " << pos;
    if (bytes.size() - pos < 16) break;
    const std::string_view header(bytes.data() + pos, 8);
    const uint64_t length = ReadLittleEndian(header);
    EXPECT_EQ(ReadLittleEndian(std::string_view(bytes.data() + pos + 8, 4)),
              MaskCrc32c(ReferenceCrc32c(header)))
        << "length CRC at " << pos;
    EXPECT_LE(pos + 16 + length, bytes.size());
    if (pos + 16 + length > bytes.size()) break;
    const std::string data = bytes.substr(pos + 12, length);
    EXPECT_EQ(ReadLittleEndian(std::string_view(bytes.data() + pos + 12 + length, 4)),
              MaskCrc32c(ReferenceCrc32c(data)))
        << "data CRC at " << pos;
    records.push_back(data);
    pos += 16 + length;
  }
  return records;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

class MetricsFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("strata_metrics_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  MetricsOptions Options() const {
    MetricsOptions o;
    o.tensorboard_dir = (dir_ / "tb" / "job").string();
    o.jsonl_path = (dir_ / "metrics.jsonl").string();
    o.csv_dir = (dir_ / "csv" / "job").string();
    o.file_unix_seconds = 1700000000;
    o.hostname = "testhost";
    o.pid = 4242;
    return o;
  }

  fs::path dir_;
};

TEST(Crc32c, MatchesRfc3720Vectors) {
  // RFC 3720 (iSCSI), appendix B.4.
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(Crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(descending), 0x113FDB5Cu);
  // The usual check value of CRC-32C.
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
}

TEST(Crc32c, AgreesWithTheBitwiseReferenceOnOddLengths) {
  std::string data;
  uint32_t x = 12345;
  for (int n = 0; n < 1000; ++n) {
    x = x * 1664525u + 1013904223u;
    data.push_back(static_cast<char>(x >> 24));
    if (n % 37 == 0 || n < 20) {
      ASSERT_EQ(Crc32c(data), ReferenceCrc32c(data)) << "length " << n;
    }
  }
}

TEST(MaskCrc32c, RotatesRightBy15AndAddsTheDelta) {
  EXPECT_EQ(MaskCrc32c(0), 0xa282ead8u);
  EXPECT_EQ(MaskCrc32c(1), 0xa284ead8u);            // bit 0 -> bit 17
  EXPECT_EQ(MaskCrc32c(0x80000000u), 0xa283ead8u);  // bit 31 -> bit 16
  EXPECT_EQ(MaskCrc32c(0x00008000u), 0xa282ead9u);  // bit 15 -> bit 0
  EXPECT_EQ(MaskCrc32c(0xFFFFFFFFu), 0xa282ead7u);  // the sum wraps
}

TEST(FrameTfRecord, ReadsBackForEmptySmallAndMultiByteLengths) {
  for (size_t size : {0u, 1u, 255u, 256u, 70001u}) {
    std::string data(size, '\0');
    for (size_t i = 0; i < size; ++i) data[i] = static_cast<char>(i * 31 + 7);
    const std::string framed = FrameTfRecord(data);
    ASSERT_EQ(framed.size(), size + 16);
    EXPECT_EQ(ReadLittleEndian(std::string_view(framed).substr(0, 8)), size);
    const std::vector<std::string> records = ReadRecords(framed);
    ASSERT_EQ(records.size(), 1u) << size;
    EXPECT_EQ(records[0], data) << size;
  }
}

TEST(FrameTfRecord, CorruptedDataNoLongerMatchesItsCrc) {
  std::string framed = FrameTfRecord("brain.Event:2");
  const uint32_t stored = static_cast<uint32_t>(ReadLittleEndian(framed.substr(12 + 13, 4)));
  framed[14] ^= 1;
  EXPECT_NE(stored, MaskCrc32c(Crc32c(framed.substr(12, 13))));
}

TEST_F(MetricsFiles, EventFileIsNamedForTensorBoardAndStartsWithTheFileVersion) {
  auto w = MetricsWriter::Create(Options());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const fs::path expected = dir_ / "tb" / "job" / "events.out.tfevents.1700000000.testhost.4242.0";
  EXPECT_EQ((*w)->event_file(), expected.string());
  // Written and flushed by Create, before any step.
  const std::vector<std::string> records = ReadRecords(ReadFile(expected));
  ASSERT_EQ(records.size(), 1u);
  strata::tensorboard::Event first;
  ASSERT_TRUE(first.ParseFromString(records[0]));
  EXPECT_EQ(first.file_version(), "brain.Event:2");
  EXPECT_GT(first.wall_time(), 1.6e9);
}

TEST_F(MetricsFiles, ScalarEventHasTensorBoardsFieldNumbersAndWireTypes) {
  auto w = MetricsWriter::Create(Options());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const Scalar a{"a", 2.0};
  ASSERT_TRUE((*w)->Record(3, 1.5, std::span(&a, 1)).ok());
  const std::vector<std::string> records = ReadRecords(ReadFile((*w)->event_file()));
  ASSERT_EQ(records.size(), 2u);
  // Event{wall_time(1, fixed64) = 1.5, step(2, varint) = 3,
  //       summary(5, bytes){value(1, bytes){tag(1, bytes) = "a", simple_value(2, fixed32) = 2}}}
  const std::string expected(
      "\x09\x00\x00\x00\x00\x00\x00\xf8\x3f"
      "\x10\x03"
      "\x2a\x0a"
      "\x0a\x08"
      "\x0a\x01"
      "a"
      "\x15\x00\x00\x00\x40",
      23);
  EXPECT_EQ(records[1], expected);
}

TEST_F(MetricsFiles, EveryRecordIsInAllThreeSinksValueByValue) {
  auto w = MetricsWriter::Create(Options());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const std::vector<std::vector<Scalar>> steps = {
      {{"train/loss", 2.75}, {"train/lr", 3e-4}, {"bytes/h2d", 123456789.0}},
      {{"train/loss", 2.5}, {"train/lr", 2.9e-4}, {"bytes/h2d", 0.0}},
      {{"val/loss", 2.625}},
  };
  const std::vector<int64_t> step_numbers = {1, 2, 2};
  for (size_t i = 0; i < steps.size(); ++i) {
    ASSERT_TRUE((*w)->Record(step_numbers[i], 1.7e9 + static_cast<double>(i), steps[i]).ok());
  }

  // Event file: one Event per Record, after the file version.
  const std::vector<std::string> records = ReadRecords(ReadFile((*w)->event_file()));
  ASSERT_EQ(records.size(), steps.size() + 1);
  for (size_t i = 0; i < steps.size(); ++i) {
    strata::tensorboard::Event e;
    ASSERT_TRUE(e.ParseFromString(records[i + 1]));
    EXPECT_EQ(e.step(), step_numbers[i]);
    EXPECT_EQ(e.wall_time(), 1.7e9 + static_cast<double>(i));
    ASSERT_EQ(e.summary().value_size(), static_cast<int>(steps[i].size()));
    for (size_t j = 0; j < steps[i].size(); ++j) {
      EXPECT_EQ(e.summary().value(j).tag(), steps[i][j].tag);
      EXPECT_EQ(e.summary().value(j).simple_value(), static_cast<float>(steps[i][j].value));
    }
  }

  // JSON lines: step and wall_time first, then every tag at full double precision.
  const std::vector<std::string> lines = Lines(ReadFile(dir_ / "metrics.jsonl"));
  ASSERT_EQ(lines.size(), steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto j = nlohmann::json::parse(lines[i]);
    EXPECT_EQ(lines[i].rfind("{\"step\":", 0), 0u) << lines[i];
    EXPECT_EQ(j["step"].get<int64_t>(), step_numbers[i]);
    EXPECT_EQ(j["wall_time"].get<double>(), 1.7e9 + static_cast<double>(i));
    EXPECT_EQ(j.size(), steps[i].size() + 2);
    for (const Scalar& s : steps[i]) EXPECT_EQ(j[s.tag].get<double>(), s.value) << s.tag;
  }

  // CSV: one file per tag, "step,<tag>" then the rows of the records that carry the tag.
  const fs::path csv = dir_ / "csv" / "job";
  EXPECT_EQ(ReadFile(csv / "train_loss.csv"), "step,train/loss\n1,2.75\n2,2.5\n");
  EXPECT_EQ(ReadFile(csv / "val_loss.csv"), "step,val/loss\n2,2.625\n");
  const std::vector<std::string> lr = Lines(ReadFile(csv / "train_lr.csv"));
  ASSERT_EQ(lr.size(), 3u);
  EXPECT_EQ(lr[0], "step,train/lr");
  EXPECT_EQ(std::stod(lr[1].substr(2)), 3e-4);
  EXPECT_EQ(std::stod(lr[2].substr(2)), 2.9e-4);
  EXPECT_EQ(ReadFile(csv / "bytes_h2d.csv"), "step,bytes/h2d\n1,123456789\n2,0\n");
  EXPECT_EQ(std::distance(fs::directory_iterator(csv), fs::directory_iterator()), 4);
}

TEST_F(MetricsFiles, NonFiniteValuesAreJsonNullsAndStayInTheOtherSinks) {
  auto w = MetricsWriter::Create(Options());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const std::vector<Scalar> s = {{"train/loss", std::numeric_limits<double>::quiet_NaN()},
                                 {"train/grad_norm", std::numeric_limits<double>::infinity()}};
  ASSERT_TRUE((*w)->Record(7, 1.7e9, s).ok());
  const auto j = nlohmann::json::parse(Lines(ReadFile(dir_ / "metrics.jsonl")).at(0));
  EXPECT_TRUE(j["train/loss"].is_null());
  EXPECT_TRUE(j["train/grad_norm"].is_null());
  strata::tensorboard::Event e;
  ASSERT_TRUE(e.ParseFromString(ReadRecords(ReadFile((*w)->event_file())).at(1)));
  EXPECT_TRUE(std::isnan(e.summary().value(0).simple_value()));
  EXPECT_TRUE(std::isinf(e.summary().value(1).simple_value()));
  EXPECT_EQ(ReadFile(dir_ / "csv" / "job" / "train_loss.csv"), "step,train/loss\n7,nan\n");
}

TEST_F(MetricsFiles, TagsWithSpacesAndSlashesNameTheirCsvFileLikeDeepSpeed) {
  MetricsOptions o;
  o.csv_dir = (dir_ / "csv").string();
  auto w = MetricsWriter::Create(o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const Scalar s{"Train/Samples/train loss", 1.25};
  ASSERT_TRUE((*w)->Record(1, 1.7e9, std::span(&s, 1)).ok());
  EXPECT_EQ(ReadFile(dir_ / "csv" / "Train_Samples_train_loss.csv"),
            "step,Train/Samples/train loss\n1,1.25\n");
  EXPECT_TRUE((*w)->event_file().empty());
  EXPECT_FALSE(fs::exists(dir_ / "metrics.jsonl"));
}

TEST_F(MetricsFiles, ASecondRunAppendsToJsonLinesAndCsvWithoutASecondHeader) {
  const Scalar first{"train/loss", 3.0}, second{"train/loss", 2.0};
  {
    auto w = MetricsWriter::Create(Options());
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_TRUE((*w)->Record(1, 1.7e9, std::span(&first, 1)).ok());
  }
  MetricsOptions o = Options();
  o.pid = 4243;  // another process: its own event file
  auto w = MetricsWriter::Create(o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_TRUE((*w)->Record(2, 1.7e9, std::span(&second, 1)).ok());
  EXPECT_EQ(ReadFile(dir_ / "csv" / "job" / "train_loss.csv"), "step,train/loss\n1,3\n2,2\n");
  EXPECT_EQ(Lines(ReadFile(dir_ / "metrics.jsonl")).size(), 2u);
  EXPECT_EQ(ReadRecords(ReadFile((*w)->event_file())).size(), 2u);
}

// A run killed (or out of disk) mid-line leaves a partial last line; the resumed run's lines
// must not be glued onto it. Cut back to the last whole line, the CSV header kept.
TEST_F(MetricsFiles, AResumedRunCutsAPartialLastLineBeforeAppending) {
  const Scalar first{"train/loss", 3.0}, second{"train/loss", 2.0};
  {
    auto w = MetricsWriter::Create(Options());
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_TRUE((*w)->Record(1, 1.7e9, std::span(&first, 1)).ok());
  }
  const fs::path csv = dir_ / "csv" / "job" / "train_loss.csv";
  std::ofstream(dir_ / "metrics.jsonl", std::ios::app) << "{\"step\": 2, \"train/lo";
  std::ofstream(csv, std::ios::app) << "2,2.5";
  MetricsOptions o = Options();
  o.pid = 4243;
  auto w = MetricsWriter::Create(o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_TRUE((*w)->Record(2, 1.7e9, std::span(&second, 1)).ok());
  EXPECT_EQ(ReadFile(csv), "step,train/loss\n1,3\n2,2\n");
  const std::vector<std::string> lines = Lines(ReadFile(dir_ / "metrics.jsonl"));
  ASSERT_EQ(lines.size(), 2u);
  for (const std::string& line : lines) {
    EXPECT_FALSE(nlohmann::json::parse(line, nullptr, false).is_discarded()) << line;
  }
}

// A file that is not Strata's metrics, given by mistake, is refused and left as it was (a notes
// file without a final newline lost its one line as "a partial last line").
TEST_F(MetricsFiles, AFileThatIsNotMetricsIsRefusedUntouched) {
  for (const std::string text : {"all my notes on one line", "{\n  \"a\": 1\n}", "notes\n"}) {
    std::ofstream(dir_ / "notes.txt", std::ios::trunc) << text;
    MetricsOptions o;
    o.jsonl_path = (dir_ / "notes.txt").string();
    auto w = MetricsWriter::Create(o);
    ASSERT_FALSE(w.ok()) << text;
    EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(w.status().message(),
              "--metrics-jsonl '" + o.jsonl_path +
                  "' holds something other than metrics of this kind; it is left as it is: give "
                  "another path");
    EXPECT_EQ(ReadFile(dir_ / "notes.txt"), text);
  }
  // A CSV file of another program in the CSV directory: refused at its tag's first value.
  fs::create_directories(dir_ / "csv2");
  std::ofstream(dir_ / "csv2" / "train_loss.csv") << "name,value";
  MetricsOptions o;
  o.csv_dir = (dir_ / "csv2").string();
  auto w = MetricsWriter::Create(o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const Scalar loss{"train/loss", 3.0};
  const Status s = (*w)->Record(1, 1.7e9, std::span(&loss, 1));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(ReadFile(dir_ / "csv2" / "train_loss.csv"), "name,value");
}

TEST_F(MetricsFiles, AnExistingEventFileIsNeverReplaced) {
  auto first = MetricsWriter::Create(Options());
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = MetricsWriter::Create(Options());  // same seconds, host and pid
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists) << second.status().ToString();
  EXPECT_NE(second.status().message().find("--tensorboard-dir"), std::string::npos);
}

TEST_F(MetricsFiles, UnusablePathsFailAtCreateNamingTheFlagAndThePath) {
  const fs::path file = dir_ / "a_file";
  std::ofstream(file) << "x";
  struct Case {
    std::string flag;
    std::string path;
  };
  const std::vector<Case> cases = {
      {"--tensorboard-dir", (file / "tb").string()},  // under a regular file
      {"--tensorboard-dir", file.string()},           // a regular file
      {"--metrics-jsonl", (dir_ / "missing_dir" / "m.jsonl").string()},
      {"--metrics-csv-dir", (file / "csv").string()},
      {"--metrics-csv-dir", file.string()},
  };
  for (const Case& c : cases) {
    MetricsOptions o;
    if (c.flag == "--tensorboard-dir") o.tensorboard_dir = c.path;
    if (c.flag == "--metrics-jsonl") o.jsonl_path = c.path;
    if (c.flag == "--metrics-csv-dir") o.csv_dir = c.path;
    auto w = MetricsWriter::Create(o);
    ASSERT_FALSE(w.ok()) << c.flag << " " << c.path;
    const std::string m = w.status().message();
    EXPECT_NE(m.find(c.flag + " '" + c.path + "'"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

// What a writer made and never recorded into goes when it does: a run refused or stopped before
// its first step leaves no empty JSONL file, no header-only event file and no empty CSV files,
// nor the directories made for them. What was there before stays.
TEST_F(MetricsFiles, AWriterThatRecordedNothingLeavesNothingItMade) {
  MetricsOptions o = Options();
  o.csv_tags = {"train/loss", "val/loss"};
  {
    auto w = MetricsWriter::Create(o);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    EXPECT_TRUE(fs::exists((*w)->event_file()));
    EXPECT_TRUE(fs::exists(dir_ / "metrics.jsonl"));
    EXPECT_TRUE(fs::exists(dir_ / "csv" / "job" / "val_loss.csv"));
  }
  EXPECT_TRUE(fs::is_empty(dir_));

  // Kept: an earlier run's JSONL and CSV files (even empty ones) and the directories it made.
  fs::create_directories(dir_ / "csv" / "job");
  std::ofstream(dir_ / "metrics.jsonl") << "{\"step\":1}\n";
  std::ofstream(dir_ / "csv" / "job" / "val_loss.csv");
  {
    auto w = MetricsWriter::Create(o);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
  }
  EXPECT_EQ(ReadFile(dir_ / "metrics.jsonl"), "{\"step\":1}\n");
  EXPECT_TRUE(fs::exists(dir_ / "csv" / "job" / "val_loss.csv"));
  EXPECT_FALSE(fs::exists(dir_ / "csv" / "job" / "train_loss.csv"));
  EXPECT_FALSE(fs::exists(dir_ / "tb"));
}

// A writer that recorded keeps its event file and the CSV files of the tags that got values; a
// tag opened by Create that never got one leaves no header-only file.
TEST_F(MetricsFiles, ATagOpenedAtCreateGetsItsHeaderWithItsFirstValue) {
  MetricsOptions o = Options();
  o.csv_tags = {"train/loss", "val/loss"};
  std::string event_file;
  {
    auto w = MetricsWriter::Create(o);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    EXPECT_EQ(ReadFile(dir_ / "csv" / "job" / "train_loss.csv"), "");
    const Scalar loss{"train/loss", 3.0};
    ASSERT_TRUE((*w)->Record(1, 1.7e9, std::span(&loss, 1)).ok());
    event_file = (*w)->event_file();
  }
  EXPECT_EQ(ReadFile(dir_ / "csv" / "job" / "train_loss.csv"), "step,train/loss\n1,3\n");
  EXPECT_FALSE(fs::exists(dir_ / "csv" / "job" / "val_loss.csv"));
  EXPECT_EQ(ReadRecords(ReadFile(event_file)).size(), 2u);
  EXPECT_EQ(Lines(ReadFile(dir_ / "metrics.jsonl")).size(), 1u);
}

// A tag's CSV file that cannot be opened fails at Create, naming it, and the sinks Create had
// made are removed again.
TEST_F(MetricsFiles, ATagsCsvFileThatCannotBeOpenedFailsAtCreate) {
  MetricsOptions o = Options();
  o.csv_tags = {"train/loss", "val/loss"};
  fs::create_directories(dir_ / "csv" / "job" / "val_loss.csv");
  auto w = MetricsWriter::Create(o);
  ASSERT_FALSE(w.ok());
  const std::string path = (dir_ / "csv" / "job" / "val_loss.csv").string();
  EXPECT_EQ(w.status().message().rfind("--metrics-csv-dir: cannot open '" + path + "'", 0), 0u)
      << w.status().ToString();
  EXPECT_FALSE(fs::exists(dir_ / "metrics.jsonl"));
  EXPECT_FALSE(fs::exists(dir_ / "tb"));
  EXPECT_FALSE(fs::exists(dir_ / "csv" / "job" / "train_loss.csv"));
  EXPECT_TRUE(fs::is_directory(path));
}

TEST(TrainMetrics, StepScalarsAreTheDifferencesOfTheRunningTotals) {
  TrainMetrics::Totals before, after;
  before.counters = {
      .bytes_h2d = 1000, .bytes_d2h = 2000, .nvme_bytes_read = 3000, .nvme_bytes_written = 4000};
  after.counters = {
      .bytes_h2d = 1500, .bytes_d2h = 2600, .nvme_bytes_read = 10000, .nvme_bytes_written = 4001};
  for (int i = 0; i < trace::kNumCategories; ++i) {
    before.parts.seconds[i] = 0.5 * i;
    after.parts.seconds[i] = 0.5 * i + 0.125 * (i + 1);
  }
  before.step_seconds = 10.0;
  after.step_seconds = 10.25;
  engine::StepResult r;
  r.loss = 2.5f;
  r.grad_norm = 0.75;
  r.skipped = true;
  r.loss_scale = 1024.0f;
  const std::vector<Scalar> s = TrainMetrics::StepScalars(r, 3e-4, 4096, before, after);
  const std::vector<std::pair<std::string, double>> expected = {
      {"train/loss", 2.5},
      {"train/lr", 3e-4},
      {"train/grad_norm", 0.75},
      {"train/loss_scale", 1024.0},
      {"train/tokens_per_second", 4096 / 0.25},
      {"train/skipped", 1.0},
      {"bytes/h2d", 500.0},
      {"bytes/d2h", 600.0},
      {"bytes/nvme_read", 7000.0},
      {"bytes/nvme_write", 1.0},
      {"time/compute", 0.125},
      {"time/h2d", 0.25},
      {"time/d2h", 0.375},
      {"time/cpu_optimizer", 0.5},
      {"time/nvme_read", 0.625},
      {"time/nvme_write", 0.75},
      {"time/comm", 0.875},
      {"time/step", 0.25},
  };
  ASSERT_EQ(s.size(), expected.size());
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_EQ(s[i].tag, expected[i].first);
    EXPECT_NEAR(s[i].value, expected[i].second, 1e-12 * std::abs(expected[i].second)) << s[i].tag;
  }
}

TEST_F(MetricsFiles, EvaluationTrafficIsNotChargedToTheNextStep) {
  MetricsOptions o;
  o.jsonl_path = (dir_ / "m.jsonl").string();
  auto w = MetricsWriter::Create(o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  TrainMetrics::Totals totals;
  TrainMetrics metrics(w->get(), totals);
  engine::StepResult r;
  totals.counters.bytes_h2d = 100;
  totals.step_seconds = 1.0;
  ASSERT_TRUE(metrics.RecordStep(1, r, 1e-3, 10, totals).ok());
  totals.counters.bytes_h2d = 1100;  // the evaluation moved 1000 bytes
  ASSERT_TRUE(metrics.RecordEvaluation(1, 2.25, totals.counters).ok());
  totals.counters.bytes_h2d = 1130;
  totals.step_seconds = 1.5;
  ASSERT_TRUE(metrics.RecordStep(2, r, 1e-3, 10, totals).ok());
  const std::vector<std::string> lines = Lines(ReadFile(dir_ / "m.jsonl"));
  ASSERT_EQ(lines.size(), 3u);
  const auto step1 = nlohmann::json::parse(lines[0]);
  const auto eval = nlohmann::json::parse(lines[1]);
  const auto step2 = nlohmann::json::parse(lines[2]);
  EXPECT_EQ(step1["bytes/h2d"].get<double>(), 100.0);
  EXPECT_EQ(step1["train/tokens_per_second"].get<double>(), 10.0);
  EXPECT_EQ(eval["val/loss"].get<double>(), 2.25);
  EXPECT_EQ(eval["step"].get<int64_t>(), 1);
  EXPECT_EQ(eval.size(), 3u);  // step, wall_time, val/loss
  EXPECT_EQ(step2["bytes/h2d"].get<double>(), 30.0);
  EXPECT_EQ(step2["time/step"].get<double>(), 0.5);
  EXPECT_EQ(step2["train/tokens_per_second"].get<double>(), 20.0);
}

TEST(TrainMetrics, WithoutAWriterRecordsNothingAndSucceeds) {
  TrainMetrics metrics(nullptr, {});
  EXPECT_FALSE(metrics.enabled());
  EXPECT_TRUE(metrics.RecordStep(1, {}, 1e-3, 10, {}).ok());
  EXPECT_TRUE(metrics.RecordEvaluation(1, 2.0, {}).ok());
}

}  // namespace
}  // namespace strata::tools
