// TraceRecorder: where the time of a training step goes, per stream and worker thread.
//
// Two uses, one recorder:
//   - a time breakdown by category (compute, h2d, d2h, cpu_optimizer, nvme_read, nvme_write): the
//     busy time of each category, always kept (a few atomic adds per event);
//   - when events are enabled, every event is kept and WriteChromeTrace writes Chrome trace-event
//     JSON ("X" complete events, one track per stream or thread; opens in Perfetto or
//     chrome://tracing), so a user can see what overlaps what.
//
// Format: the Trace Event Format ("traceEvents" array of {"name","cat","ph":"X","ts","dur","pid",
// "tid"}, times in microseconds),
// https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU as read by
// Perfetto's JSON importer; track names go in "thread_name" metadata events.
//
// Thread-safety: every method may be called from any thread at once. An event is recorded when it
// ends (ScopedTraceEvent's destructor or Record); events of one track should not overlap in time
// (a track is one in-order stream or one thread), which the breakdown relies on.
// Ownership: components take a `TraceRecorder*` (not owned; nullptr = no tracing) in their options;
// the recorder must outlive them. Nothing here is process-global.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "base/thread_annotations.h"

namespace strata::trace {

// What a span of time was spent on. kOther is shown in traces but not in the breakdown.
enum class Category : uint8_t {
  kCompute,
  kH2D,
  kD2H,
  kCpuOptimizer,
  kNvmeRead,
  kNvmeWrite,
  kComm,  // collectives between data-parallel ranks
  kOther,
};
inline constexpr int kNumCategories = 8;

// "compute", "h2d", "d2h", "cpu_optimizer", "nvme_read", "nvme_write", "comm", "other": the keys of
// the summary JSON's time breakdown.
std::string_view CategoryName(Category category);

// Busy seconds per category, summed over all tracks (two streams copying at once count twice).
struct Breakdown {
  std::array<double, kNumCategories> seconds{};
  double operator[](Category c) const { return seconds[static_cast<int>(c)]; }
};

class TraceRecorder {
 public:
  // keep_events: keep every event for WriteChromeTrace (memory grows with the run: about 48 bytes
  // per event); false keeps only the breakdown.
  explicit TraceRecorder(bool keep_events);
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  bool keep_events() const { return keep_events_; }

  // A track (one row in the trace viewer): a stream ("h2d", "compute") or a thread
  // ("cpu-optimizer"). Returns its id; the same name gives the same id.
  int RegisterTrack(std::string_view name);

  // Nanoseconds since the recorder was made, on the steady clock.
  int64_t NowNs() const;

  // Records [begin_ns, end_ns) on `track`. `name` must outlive the recorder (a string literal):
  // events keep the pointer.
  void Record(int track, const char* name, Category category, int64_t begin_ns, int64_t end_ns);

  // Busy time per category since construction or the last ResetBreakdown.
  Breakdown breakdown() const;
  void ResetBreakdown();

  // Writes the kept events as Chrome trace-event JSON to `path` (created 0644, replaced whole:
  // WriteOutputFile).
  // kFailedPrecondition when events are not kept; I/O errors name the path.
  Status WriteChromeTrace(const std::string& path) const;

  // Number of events kept (for tests).
  size_t num_events() const;

 private:
  struct Event {
    const char* name;
    int64_t begin_ns;
    int64_t end_ns;
    int track;
    Category category;
  };

  const bool keep_events_;
  const std::chrono::steady_clock::time_point origin_;
  std::array<std::atomic<int64_t>, kNumCategories> busy_ns_{};

  mutable std::mutex mu_;
  std::vector<std::string> tracks_ STRATA_GUARDED_BY(mu_);
  std::deque<Event> events_ STRATA_GUARDED_BY(mu_);
};

// Records the lifetime of a scope as one event. recorder may be null (then it does nothing).
class ScopedTraceEvent {
 public:
  ScopedTraceEvent(TraceRecorder* recorder, int track, const char* name, Category category)
      : recorder_(recorder),
        track_(track),
        name_(name),
        category_(category),
        begin_ns_(recorder ? recorder->NowNs() : 0) {}
  ~ScopedTraceEvent() {
    if (recorder_) recorder_->Record(track_, name_, category_, begin_ns_, recorder_->NowNs());
  }
  ScopedTraceEvent(const ScopedTraceEvent&) = delete;
  ScopedTraceEvent& operator=(const ScopedTraceEvent&) = delete;

 private:
  TraceRecorder* recorder_;
  int track_;
  const char* name_;
  Category category_;
  int64_t begin_ns_;
};

}  // namespace strata::trace
