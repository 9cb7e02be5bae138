#include "tools/metrics.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/crc.hpp>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/logging.h"
#include "tools/tensorboard_event.pb.h"

namespace strata::tools {
namespace {

// CRC-32C: polynomial 0x1EDC6F41, reflected input and output, init and final XOR all ones.
using Crc32cEngine = boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true>;

constexpr uint32_t kCrcMaskDelta = 0xa282ead8u;
constexpr const char* kFileVersion = "brain.Event:2";

// errno after a failed stdio call; EIO when the library left it unset.
Status StdioError(std::string_view context) {
  return ErrnoToStatus(errno != 0 ? errno : EIO, context);
}

// A log opened for appending and reading ("a+b": a resumed run's) ends with a whole line: a partial
// last line (a full disk or a kill mid-write) is cut back to the last newline, with a warning, so
// the appended lines stay parseable. Only in a file of this kind, whose first bytes and whose
// partial line's are `record_start`'s (a JSONL record's "{"; a CSV file's header or row): any
// other file is refused, untouched, as not Strata's (a notes file given by mistake lost its last
// line). `what`: "--metrics-jsonl 'PATH'", for the messages.
Status CutPartialLastLine(std::FILE* file, const std::string& what,
                          bool (*record_start)(char first)) {
  const int fd = ::fileno(file);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoToStatus(errno, fmt::format("{}: stat", what));
  off_t end = st.st_size;
  char last = '\n';
  if (end == 0) return Status::Ok();
  char first = 0;
  if (::pread(fd, &first, 1, 0) != 1 || ::pread(fd, &last, 1, end - 1) != 1) {
    return ErrnoToStatus(errno != 0 ? errno : EIO, fmt::format("{}: read", what));
  }
  const auto not_ours = [&] {
    return InvalidArgumentError(
        fmt::format("{} holds something other than metrics of this kind; it is left as it is: "
                    "give another path",
                    what));
  };
  if (!record_start(first)) return not_ours();
  if (last == '\n') return Status::Ok();
  std::array<char, 4096> chunk;
  off_t keep = 0;  // bytes up to and including the last newline
  for (off_t pos = end; pos > 0 && keep == 0;) {
    const off_t from = std::max<off_t>(0, pos - static_cast<off_t>(chunk.size()));
    const ssize_t n = ::pread(fd, chunk.data(), static_cast<size_t>(pos - from), from);
    if (n != pos - from)
      return ErrnoToStatus(errno != 0 ? errno : EIO, fmt::format("{}: read", what));
    for (ssize_t i = n - 1; i >= 0; --i) {
      if (chunk[i] == '\n') {
        keep = from + i + 1;
        break;
      }
    }
    pos = from;
  }
  char partial_first = 0;
  if (::pread(fd, &partial_first, 1, keep) != 1) {
    return ErrnoToStatus(errno != 0 ? errno : EIO, fmt::format("{}: read", what));
  }
  if (!record_start(partial_first)) return not_ours();
  if (::ftruncate(fd, keep) != 0) return ErrnoToStatus(errno, fmt::format("{}: truncate", what));
  STRATA_LOG_WARNING("{}: cut a partial last line ({} bytes) left by an earlier run", what,
                     end - keep);
  return Status::Ok();
}

void AppendLittleEndian(uint64_t value, int num_bytes, std::string* out) {
  for (int i = 0; i < num_bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

// Creates `dir` and its parents; names `flag` in every error. Appends the directories it creates
// to `created`, parents first.
Status MakeDirectory(std::string_view flag, const std::string& dir,
                     std::vector<std::string>* created) {
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec)) {
    return InvalidArgumentError(fmt::format("{} '{}' exists and is not a directory", flag, dir));
  }
  std::vector<std::string> missing;  // deepest first
  for (std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
       !p.empty() && p != p.root_path() && !std::filesystem::exists(p, ec); p = p.parent_path()) {
    if (p.filename().empty()) continue;  // "a/b/": the trailing separator
    missing.push_back(p.string());
  }
  std::filesystem::create_directories(dir, ec);
  if (!std::filesystem::is_directory(dir)) {
    return ErrnoToStatus(ec ? ec.value() : ENOTDIR,
                         fmt::format("{} '{}': cannot create the directory", flag, dir));
  }
  created->insert(created->end(), missing.rbegin(), missing.rend());
  return Status::Ok();
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

std::string HostName() {
  std::array<char, HOST_NAME_MAX + 1> name{};
  if (::gethostname(name.data(), name.size() - 1) != 0 || name[0] == '\0') return "localhost";
  return name.data();
}

// The shortest text that reads back as the same double ("0.1", "2.5e-05", "nan").
std::string FormatValue(double v) { return fmt::format("{}", v); }

// The CSV file of a tag, as DeepSpeed's csv_monitor names it: '/' and ' ' become '_'.
std::string CsvFileName(std::string_view tag) {
  std::string name(tag);
  for (char& c : name) {
    if (c == '/' || c == ' ') c = '_';
  }
  return name + ".csv";
}

}  // namespace

uint32_t Crc32c(std::string_view data) {
  Crc32cEngine crc;
  crc.process_bytes(data.data(), data.size());
  return crc.checksum();
}

uint32_t MaskCrc32c(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + kCrcMaskDelta; }

std::string FrameTfRecord(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  AppendLittleEndian(data.size(), 8, &out);
  AppendLittleEndian(MaskCrc32c(Crc32c(out)), 4, &out);
  out.append(data);
  AppendLittleEndian(MaskCrc32c(Crc32c(data)), 4, &out);
  return out;
}

double UnixSecondsNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

StatusOr<std::unique_ptr<MetricsWriter>> MetricsWriter::Create(const MetricsOptions& options) {
  // On an error `w` is destroyed, removing what it created.
  std::unique_ptr<MetricsWriter> w(new MetricsWriter(options));
  const auto make_directory = [&](std::string_view flag, const std::string& dir) -> Status {
    std::vector<std::string> made;
    STRATA_RETURN_IF_ERROR(MakeDirectory(flag, dir, &made));
    for (const std::string& d : made) w->WillCreate(d, /*is_directory=*/true);
    return Status::Ok();
  };
  if (!options.tensorboard_dir.empty()) {
    STRATA_RETURN_IF_ERROR(make_directory("--tensorboard-dir", options.tensorboard_dir));
    const int64_t seconds = options.file_unix_seconds != 0
                                ? options.file_unix_seconds
                                : static_cast<int64_t>(std::floor(UnixSecondsNow()));
    const std::string host = options.hostname.empty() ? HostName() : options.hostname;
    const int64_t pid = options.pid != 0 ? options.pid : static_cast<int64_t>(::getpid());
    w->event_path_ = (std::filesystem::path(options.tensorboard_dir) /
                      fmt::format("events.out.tfevents.{}.{}.{}.0", seconds, host, pid))
                         .string();
    // "x": never append to, or replace, another run's file.
    w->events_.reset(std::fopen(w->event_path_.c_str(), "wbx"));
    if (!w->events_) {
      return StdioError(fmt::format("--tensorboard-dir: cannot create '{}'", w->event_path_));
    }
    w->WillCreate(w->event_path_, /*is_directory=*/false);
    strata::tensorboard::Event first;
    first.set_wall_time(UnixSecondsNow());
    first.set_file_version(kFileVersion);
    STRATA_RETURN_IF_ERROR(w->WriteEvent(first.SerializeAsString()));
    if (std::fflush(w->events_.get()) != 0) {
      return StdioError(fmt::format("--tensorboard-dir: writing '{}'", w->event_path_));
    }
  }
  if (!options.jsonl_path.empty()) {
    const bool existed = Exists(options.jsonl_path);
    w->jsonl_.reset(std::fopen(options.jsonl_path.c_str(), "a+b"));
    if (!w->jsonl_) {
      return StdioError(
          fmt::format("--metrics-jsonl '{}': cannot open for appending", options.jsonl_path));
    }
    if (!existed) w->WillCreate(options.jsonl_path, /*is_directory=*/false);
    STRATA_RETURN_IF_ERROR(
        CutPartialLastLine(w->jsonl_.get(), fmt::format("--metrics-jsonl '{}'", options.jsonl_path),
                           [](char c) { return c == '{'; }));
  }
  if (!options.csv_dir.empty()) {
    STRATA_RETURN_IF_ERROR(make_directory("--metrics-csv-dir", options.csv_dir));
    // The other tags' files come with their first values; make sure they can.
    if (::access(options.csv_dir.c_str(), W_OK | X_OK) != 0) {
      return StdioError(
          fmt::format("--metrics-csv-dir '{}': cannot write into the directory", options.csv_dir));
    }
    for (const std::string& tag : options.csv_tags) STRATA_RETURN_IF_ERROR(w->OpenCsv(tag));
  }
  return w;
}

MetricsWriter::~MetricsWriter() {
  events_.reset();
  jsonl_.reset();
  csv_files_.clear();
  for (auto it = created_.rbegin(); it != created_.rend(); ++it) {
    const auto& [path, is_directory] = *it;
    std::error_code ec;
    if (is_directory) {
      std::filesystem::remove(path, ec);  // only when empty; ENOTEMPTY otherwise
      continue;
    }
    const bool empty = std::filesystem::file_size(path, ec) == 0 && !ec;
    if (empty || (path == event_path_ && !recorded_)) std::filesystem::remove(path, ec);
  }
}

void MetricsWriter::WillCreate(const std::string& path, bool is_directory) {
  created_.emplace_back(path, is_directory);
}

Status MetricsWriter::WriteEvent(std::string_view serialized_event) {
  const std::string record = FrameTfRecord(serialized_event);
  if (std::fwrite(record.data(), 1, record.size(), events_.get()) != record.size()) {
    return StdioError(fmt::format("--tensorboard-dir: writing '{}'", event_path_));
  }
  return Status::Ok();
}

Status MetricsWriter::OpenCsv(const std::string& tag) {
  if (csv_files_.count(tag) != 0) return Status::Ok();
  const std::string path = (std::filesystem::path(options_.csv_dir) / CsvFileName(tag)).string();
  const bool existed = Exists(path);
  File file(std::fopen(path.c_str(), "a+b"));  // read too: CutPartialLastLine
  if (!file) return StdioError(fmt::format("--metrics-csv-dir: cannot open '{}'", path));
  if (!existed) WillCreate(path, /*is_directory=*/false);
  STRATA_RETURN_IF_ERROR(
      CutPartialLastLine(file.get(), fmt::format("--metrics-csv-dir: '{}'", path),
                         [](char c) { return c == 's' || (c >= '0' && c <= '9'); }));
  struct stat st {};
  if (::fstat(::fileno(file.get()), &st) != 0) {
    return StdioError(fmt::format("--metrics-csv-dir: stat '{}'", path));
  }
  csv_files_.emplace(tag, CsvFile{std::move(file), /*header_due=*/st.st_size == 0});
  return Status::Ok();
}

Status MetricsWriter::WriteCsv(int64_t step, const Scalar& scalar) {
  STRATA_RETURN_IF_ERROR(OpenCsv(scalar.tag));
  CsvFile& csv = csv_files_.at(scalar.tag);
  const std::string path =
      (std::filesystem::path(options_.csv_dir) / CsvFileName(scalar.tag)).string();
  std::string text;
  if (csv.header_due) text = fmt::format("step,{}\n", scalar.tag);
  text += fmt::format("{},{}\n", step, FormatValue(scalar.value));
  if (std::fwrite(text.data(), 1, text.size(), csv.file.get()) != text.size()) {
    return StdioError(fmt::format("--metrics-csv-dir: writing '{}'", path));
  }
  csv.header_due = false;
  return Status::Ok();
}

Status MetricsWriter::Record(int64_t step, double wall_time_seconds,
                             std::span<const Scalar> scalars) {
  recorded_ = true;  // from here the sinks may hold a record, whole or partial: kept
  if (events_) {
    strata::tensorboard::Event event;
    event.set_wall_time(wall_time_seconds);
    event.set_step(step);
    strata::tensorboard::Summary* summary = event.mutable_summary();
    for (const Scalar& s : scalars) {
      strata::tensorboard::Summary::Value* v = summary->add_value();
      v->set_tag(s.tag);
      v->set_simple_value(static_cast<float>(s.value));
    }
    STRATA_RETURN_IF_ERROR(WriteEvent(event.SerializeAsString()));
    if (std::fflush(events_.get()) != 0) {
      return StdioError(fmt::format("--tensorboard-dir: writing '{}'", event_path_));
    }
  }
  if (jsonl_) {
    nlohmann::ordered_json line = nlohmann::ordered_json::object();
    line["step"] = step;
    line["wall_time"] = wall_time_seconds;
    for (const Scalar& s : scalars) {
      line[s.tag] =
          std::isfinite(s.value) ? nlohmann::ordered_json(s.value) : nlohmann::ordered_json();
    }
    const std::string text = line.dump() + "\n";
    if (std::fwrite(text.data(), 1, text.size(), jsonl_.get()) != text.size() ||
        std::fflush(jsonl_.get()) != 0) {
      return StdioError(fmt::format("--metrics-jsonl: writing '{}'", options_.jsonl_path));
    }
  }
  if (!options_.csv_dir.empty()) {
    for (const Scalar& s : scalars) STRATA_RETURN_IF_ERROR(WriteCsv(step, s));
    for (auto& [tag, csv] : csv_files_) {
      if (std::fflush(csv.file.get()) != 0) {
        return StdioError(fmt::format("--metrics-csv-dir: writing the file of '{}' in '{}'", tag,
                                      options_.csv_dir));
      }
    }
  }
  return Status::Ok();
}

std::vector<std::string> TrainMetrics::StepTags() {
  std::vector<std::string> tags;
  for (Scalar& s : StepScalars({}, 0, 0, {}, {})) tags.push_back(std::move(s.tag));
  return tags;
}

std::vector<Scalar> TrainMetrics::StepScalars(const engine::StepResult& result, double lr,
                                              int64_t tokens, const Totals& before,
                                              const Totals& after) {
  const double step_seconds = after.step_seconds - before.step_seconds;
  auto delta = [](uint64_t b, uint64_t a) { return static_cast<double>(a - b); };
  std::vector<Scalar> s = {
      {"train/loss", result.loss},
      {"train/lr", lr},
      {"train/grad_norm", result.grad_norm},
      {"train/loss_scale", result.loss_scale},
      {"train/tokens_per_second",
       step_seconds > 0 ? static_cast<double>(tokens) / step_seconds : 0.0},
      {"train/skipped", result.skipped ? 1.0 : 0.0},
      {"bytes/h2d", delta(before.counters.bytes_h2d, after.counters.bytes_h2d)},
      {"bytes/d2h", delta(before.counters.bytes_d2h, after.counters.bytes_d2h)},
      {"bytes/nvme_read", delta(before.counters.nvme_bytes_read, after.counters.nvme_bytes_read)},
      {"bytes/nvme_write",
       delta(before.counters.nvme_bytes_written, after.counters.nvme_bytes_written)},
  };
  for (int i = 0; i < trace::kNumCategories; ++i) {
    const auto c = static_cast<trace::Category>(i);
    if (c == trace::Category::kOther) continue;
    s.push_back({fmt::format("time/{}", trace::CategoryName(c)),
                 after.parts.seconds[i] - before.parts.seconds[i]});
  }
  s.push_back({"time/step", step_seconds});
  return s;
}

Status TrainMetrics::RecordStep(int64_t step, const engine::StepResult& result, double lr,
                                int64_t tokens, const Totals& totals,
                                std::span<const Scalar> extra) {
  if (writer_ == nullptr) return Status::Ok();
  std::vector<Scalar> scalars = StepScalars(result, lr, tokens, last_, totals);
  scalars.insert(scalars.end(), extra.begin(), extra.end());
  last_ = totals;
  return writer_->Record(step, UnixSecondsNow(), scalars);
}

Status TrainMetrics::RecordEvaluation(int64_t step, double val_loss,
                                      const engine::EngineCounters& counters,
                                      std::span<const Scalar> extra) {
  if (writer_ == nullptr) return Status::Ok();
  last_.counters = counters;
  std::vector<Scalar> scalars = {{"val/loss", val_loss}};
  scalars.insert(scalars.end(), extra.begin(), extra.end());
  return writer_->Record(step, UnixSecondsNow(), scalars);
}

}  // namespace strata::tools
