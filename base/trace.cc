#include "base/trace.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "base/file.h"

namespace strata::trace {

std::string_view CategoryName(Category category) {
  switch (category) {
    case Category::kCompute:
      return "compute";
    case Category::kH2D:
      return "h2d";
    case Category::kD2H:
      return "d2h";
    case Category::kCpuOptimizer:
      return "cpu_optimizer";
    case Category::kNvmeRead:
      return "nvme_read";
    case Category::kNvmeWrite:
      return "nvme_write";
    case Category::kComm:
      return "comm";
    case Category::kOther:
      return "other";
  }
  return "other";
}

TraceRecorder::TraceRecorder(bool keep_events)
    : keep_events_(keep_events), origin_(std::chrono::steady_clock::now()) {}

int TraceRecorder::RegisterTrack(std::string_view name) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < tracks_.size(); ++i) {
    if (tracks_[i] == name) return static_cast<int>(i);
  }
  tracks_.emplace_back(name);
  return static_cast<int>(tracks_.size() - 1);
}

int64_t TraceRecorder::NowNs() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              origin_)
      .count();
}

void TraceRecorder::Record(int track, const char* name, Category category, int64_t begin_ns,
                           int64_t end_ns) {
  if (end_ns < begin_ns) end_ns = begin_ns;
  busy_ns_[static_cast<int>(category)].fetch_add(end_ns - begin_ns, std::memory_order_relaxed);
  if (!keep_events_) return;
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back({name, begin_ns, end_ns, track, category});
}

Breakdown TraceRecorder::breakdown() const {
  Breakdown b;
  for (int i = 0; i < kNumCategories; ++i) {
    b.seconds[i] = static_cast<double>(busy_ns_[i].load(std::memory_order_relaxed)) * 1e-9;
  }
  return b;
}

void TraceRecorder::ResetBreakdown() {
  for (auto& ns : busy_ns_) ns.store(0, std::memory_order_relaxed);
}

size_t TraceRecorder::num_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

Status TraceRecorder::WriteChromeTrace(const std::string& path) const {
  if (!keep_events_) {
    return FailedPreconditionError(
        "this trace recorder keeps no events (made with keep_events "
        "false): nothing to write to " +
        path);
  }
  nlohmann::json events = nlohmann::json::array();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < tracks_.size(); ++i) {
      events.push_back({{"name", "thread_name"},
                        {"ph", "M"},
                        {"pid", 1},
                        {"tid", i},
                        {"args", {{"name", tracks_[i]}}}});
      // Keeps the tracks in registration order in the viewer.
      events.push_back({{"name", "thread_sort_index"},
                        {"ph", "M"},
                        {"pid", 1},
                        {"tid", i},
                        {"args", {{"sort_index", i}}}});
    }
    for (const Event& e : events_) {
      events.push_back({{"name", e.name},
                        {"cat", CategoryName(e.category)},
                        {"ph", "X"},
                        {"ts", static_cast<double>(e.begin_ns) * 1e-3},
                        {"dur", static_cast<double>(e.end_ns - e.begin_ns) * 1e-3},
                        {"pid", 1},
                        {"tid", e.track}});
    }
  }
  const std::string text =
      nlohmann::json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump();
  // Whole or not at all (base/file.h): a crash mid-write leaves the previous trace, not a part.
  return WriteOutputFile(path, text, "trace file");
}

}  // namespace strata::trace
