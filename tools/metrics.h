// Training metrics of `strata train` as files that TensorBoard, scripts and spreadsheets read:
//   - a TensorBoard event file (--tensorboard-dir DIR):
//     DIR/events.out.tfevents.<unix seconds>.<hostname>.<pid>.0, the name TensorBoard's loader
//     picks up ("tfevents" in the name). Its records are TensorBoard `Event` protos
//     (tools/tensorboard_event.proto, serialized with Debian's libprotobuf) in TFRecord framing:
//       uint64 length (little endian), uint32 masked CRC-32C of those 8 bytes,
//       data, uint32 masked CRC-32C of the data,
//     with mask(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8: TensorFlow's record format
//     (RecordWriter::WriteRecord in tensorflow/core/lib/io/record_writer.cc, crc32c::Mask in
//     tensorflow/core/lib/hash/crc32c.h). CRC-32C is the Castagnoli polynomial 0x1EDC6F41
//     (reflected, init and final XOR 0xFFFFFFFF) of RFC 3720 section 12.1 (iSCSI; test vectors
//     in its appendix B.4), computed by Boost.CRC. The first record is file_version
//     "brain.Event:2"; then one Event with a Summary of simple_value scalars per Record call.
//   - JSON lines (--metrics-jsonl FILE): one object per Record call,
//     {"step":3,"wall_time":1700000000.5,"train/loss":2.51,...}; non-finite values are null.
//     Appended to an existing file (a resumed run continues it).
//   - CSV (--metrics-csv-dir DIR), as DeepSpeed's csv_monitor lays it out: one file per tag,
//     DIR/<tag with '/' and ' ' replaced by '_'>.csv ("train/loss" -> train_loss.csv), header
//     "step,<tag>", then one "step,value" row per Record call that carries the tag. Appended; the
//     header is written only when the file is new or empty. The files of the tags in
//     MetricsOptions::csv_tags are opened by Create; any other tag's with its first value.
// A file the writer created that holds no record when it is destroyed (a run refused or stopped
// before its first record; a tag that never got a value) is removed, with the directories it
// created for it that are left empty: a run that recorded nothing leaves nothing behind.
// Every sink is flushed to the kernel (fflush, not fsync) at the end of each Record call, so a
// crash of the process loses nothing recorded and a live run is visible while it trains.
//
// Units: wall_time in seconds since the Unix epoch; steps are the caller's (1-based optimizer
// steps in `strata train`). Values are doubles; the event file stores them as float.
// Thread-safety: a MetricsWriter is not thread-safe; one thread records. The free functions are
// pure.
// Errors: a directory or file that cannot be created or written is a Status naming the flag and
// the path (kInvalidArgument for a path that is not a directory, otherwise the errno's code).
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "base/trace.h"
#include "engine/engine.h"

namespace strata::tools {

// CRC-32C (Castagnoli) of `data`: "123456789" -> 0xE3069283.
uint32_t Crc32c(std::string_view data);
// TFRecord's masked CRC: rotate right by 15 bits, add 0xa282ead8 (mod 2^32).
uint32_t MaskCrc32c(uint32_t crc);
// One TFRecord holding `data` (16 + data.size() bytes), framed as above.
std::string FrameTfRecord(std::string_view data);

struct MetricsOptions {
  std::string tensorboard_dir;  // empty: no event file; created (with parents) if missing
  std::string jsonl_path;       // empty: no JSON lines; its directory must exist
  std::string csv_dir;          // empty: no CSV; created (with parents) if missing
  // Tags whose CSV files Create opens (so that a file that cannot be written, a directory in its
  // place, fails before training); ignored without csv_dir.
  std::vector<std::string> csv_tags;
  // Clock and identity for the event file's name; 0 / empty = now, gethostname(), getpid().
  // (Tests set them to get a predictable name.)
  int64_t file_unix_seconds = 0;
  std::string hostname;
  int64_t pid = 0;
};

// One named value. Tags use TensorBoard's '/' grouping: "train/loss", "time/compute".
struct Scalar {
  std::string tag;
  double value = 0;
};

class MetricsWriter {
 public:
  // Creates the directories and opens every sink that `options` names (writing the event file's
  // file_version record) and the CSV files of options.csv_tags, so that a bad path fails here,
  // before training. All paths empty: a writer whose Record does nothing. On an error what it
  // created is removed again.
  static StatusOr<std::unique_ptr<MetricsWriter>> Create(const MetricsOptions& options);
  // Closes the sinks and removes the files it created that hold no record (see above).
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // Writes `scalars` at `step` to every sink (one Event, one JSON line, one row per CSV tag) and
  // flushes them. wall_time_seconds: seconds since the Unix epoch. Errors name the sink's flag
  // and path; after an error the sinks may hold a partial record.
  Status Record(int64_t step, double wall_time_seconds, std::span<const Scalar> scalars);

  // Path of the event file; empty without --tensorboard-dir.
  const std::string& event_file() const { return event_path_; }

 private:
  struct FileCloser {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  using File = std::unique_ptr<std::FILE, FileCloser>;

  explicit MetricsWriter(const MetricsOptions& options) : options_(options) {}
  Status WriteEvent(std::string_view serialized_event);
  Status OpenCsv(const std::string& tag);
  Status WriteCsv(int64_t step, const Scalar& scalar);
  // Records `path` (a file or a directory this writer is about to create) for the destructor.
  void WillCreate(const std::string& path, bool is_directory);

  MetricsOptions options_;
  std::string event_path_;
  File events_;
  File jsonl_;
  struct CsvFile {
    File file;
    bool header_due = false;  // new or empty: "step,<tag>" goes before the first row
  };
  std::map<std::string, CsvFile> csv_files_;  // by tag, opened by Create or with a first value
  bool recorded_ = false;                     // a Record call has written every sink
  // What this writer created, in order: removed in reverse by the destructor when it holds no
  // record (a file still empty, or the event file when nothing was recorded; a directory empty).
  std::vector<std::pair<std::string, bool>> created_;  // path, is a directory
};

// Turns what the training loop already keeps (the step's result, running totals of the engine's
// byte counters and of the trace breakdown) into the scalars of one optimizer step, and hands them
// to a MetricsWriter. A step's bytes and times are the growth of the totals since the previous
// record: times since the previous RecordStep (so a timed Flush before an evaluation or a
// checkpoint counts in the next step), bytes since the previous RecordStep, RecordEvaluation or
// SkipBytes (an evaluation's or a checkpoint's traffic is not charged to the next step).
//
// Tags per step: train/loss, train/lr, train/grad_norm, train/loss_scale,
// train/tokens_per_second (tokens of the step / time/step), train/skipped (0 or 1), bytes/h2d,
// bytes/d2h, bytes/nvme_read, bytes/nvme_write (bytes moved), time/<category> for each
// trace::Category except kOther (busy seconds, summed over tracks), time/step (seconds of the
// timed engine calls). Per evaluation: val/loss. Preference training adds train/rewards/chosen,
// train/rewards/rejected, train/rewards/accuracies, train/rewards/margins, train/logps/chosen and
// train/logps/rejected per step, and the same under val/ per evaluation (TRL's names).
// Thread-safety: not thread-safe, like the writer. Errors: the writer's.
class TrainMetrics {
 public:
  // Running totals the training loop keeps; the constructor takes them as they are before the
  // first step.
  struct Totals {
    engine::EngineCounters counters;
    trace::Breakdown parts;   // busy seconds per category, cumulative
    double step_seconds = 0;  // seconds in timed engine calls, cumulative
  };
  // writer: not owned, outlives this; may be null (then nothing is recorded).
  TrainMetrics(MetricsWriter* writer, const Totals& start) : writer_(writer), last_(start) {}

  bool enabled() const { return writer_ != nullptr; }

  // Records optimizer step `step` (1-based). lr: the learning rate the step used;
  // tokens: tokens the step trained on; totals: the running totals after the step; extra:
  // further scalars of the step (preference training's rewards/*, logps/*), written after them.
  Status RecordStep(int64_t step, const engine::StepResult& result, double lr, int64_t tokens,
                    const Totals& totals, std::span<const Scalar> extra = {});
  // Records a validation loss at `step`. counters: the engine's counters after the evaluation;
  // the bytes moved since the last record (the evaluation's, and those of a Flush before it) are
  // skipped, not charged to the next step. Time totals are not touched (evaluation is not timed).
  // extra: further validation scalars, written after val/loss.
  Status RecordEvaluation(int64_t step, double val_loss, const engine::EngineCounters& counters,
                          std::span<const Scalar> extra = {});

  // After a checkpoint (and the Flush before it): the bytes moved since the last record are
  // skipped, as an evaluation's are, not charged to the next step.
  void SkipBytes(const engine::EngineCounters& counters) { last_.counters = counters; }

  // The tags RecordStep writes before its `extra` scalars, in order (train/loss ... time/step).
  static std::vector<std::string> StepTags();

  // The scalars RecordStep would write (for tests).
  static std::vector<Scalar> StepScalars(const engine::StepResult& result, double lr,
                                         int64_t tokens, const Totals& before, const Totals& after);

 private:
  MetricsWriter* writer_;
  Totals last_;
};

// Seconds since the Unix epoch, now (system clock).
double UnixSecondsNow();

}  // namespace strata::tools
