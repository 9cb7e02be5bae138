// The bookkeeping behind the CUDA backend's tracing (gpu/cuda/cuda_device.cc), kept free of
// CUDA types so that it is unit-tested on a host without a GPU (tests/gpu/timed_spans_test.cc).
//
// A traced stream times each copy, conversion and compute span with a pair of CUDA timing
// events recorded before and after it on the stream. The GPU stamps the events when the stream
// reaches them; a harvester later reads the elapsed time between a clock anchor and each event
// (cudaEventElapsedTime, milliseconds) and turns it into TraceRecorder::NowNs() time through the
// anchor (ClockAnchor). SpanQueue holds a stream's spans, in stream order, from enqueue until
// they are recorded, and the stream's pool of event pairs.
#pragma once

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "base/status.h"
#include "base/thread_annotations.h"
#include "base/trace.h"

namespace strata::gpu {

// Where the GPU's timer stands on the host clock. An anchor is a timing event recorded on an
// otherwise idle stream and waited for: the GPU stamped it at some instant in [before_ns,
// after_ns], the host times (TraceRecorder::NowNs) read just before cudaEventRecord and just
// after cudaEventSynchronize returned. The anchor's host time is the midpoint of that window,
// so its error is at most uncertainty_ns = (after_ns - before_ns) / 2, rounded up: Cristian's
// algorithm (F. Cristian, "Probabilistic clock synchronization", Distributed Computing 3(3),
// 1989), where of several tries the narrowest window wins.
struct ClockAnchor {
  int64_t host_ns = 0;
  int64_t uncertainty_ns = 0;

  // before_ns <= after_ns (STRATA_CHECKed: NowNs is monotonic).
  static ClockAnchor FromWindow(int64_t before_ns, int64_t after_ns) {
    STRATA_CHECK(before_ns <= after_ns);
    const int64_t width = after_ns - before_ns;
    return {before_ns + width / 2, (width + 1) / 2};
  }

  // The host time of a GPU event `ms_after_anchor` milliseconds after the anchor event (what
  // cudaEventElapsedTime(anchor, event) returns; it resolves about 0.5 us). Rounded to the
  // nearest nanosecond.
  int64_t HostNs(double ms_after_anchor) const {
    return host_ns + std::llround(ms_after_anchor * 1e6);
  }
};

// The spans of one stream, in stream order, from enqueue until the harvester records them, and
// the stream's pool of timing-event pairs.
//
//   GPU span: bracketed by an event pair taken from the pool (AcquirePair). Pushed open when the
//     begin event is recorded and the end is still to come (a compute span around kernels the
//     caller launches; CloseGpu ends it), or closed when both are recorded (a copy). A closed,
//     timed GPU span is ready to be recorded once its end event has completed, which only the
//     backend can tell; its pair goes back to the pool when it is popped.
//   Host span: a LaunchHost function, timed on the host by the callback that runs it, which
//     calls FinishHost(ran, begin, end); ran == false (skipped after an error) records nothing.
//   A span closed untimed (CloseGpu(id, false), FinishHost(id, false, ...)) is popped unrecorded.
//
// Pair: the backend's pair of event handles (copyable). Anchor: what the backend needs to map a
// GPU span's events to host time (a shared handle to the ClockAnchor in use when the span
// began). Nothing here calls the backend: the caller creates and destroys the events.
//
// One harvester at a time (ClaimHarvest/TryClaimHarvest ... ReleaseHarvest) reads Front(),
// records, pops and serializes the track; any thread may push, close, finish and acquire at any
// time. The claim is not a lock held across CUDA calls: it is a flag, waited for on a condition
// variable, so a second harvester (a Synchronize on another thread) waits for the first.
// Thread-safe.
template <typename Pair, typename Anchor>
class SpanQueue {
 public:
  struct Span {
    uint64_t id = 0;
    const char* name = nullptr;  // must outlive the TraceRecorder (a string literal)
    trace::Category category = trace::Category::kOther;
    bool is_gpu = false;
    bool closed = false;  // GPU: end event recorded (or given up); host: the function returned
                          // or was skipped
    bool timed = false;   // closed and to be recorded: GPU: both events recorded; host: ran
    Pair pair{};          // GPU only
    Anchor anchor{};      // GPU only
    int64_t begin_ns = 0, end_ns = 0;  // host only: TraceRecorder::NowNs() times
  };

  // Adds pairs to the pool (the backend created their events).
  void AddPairs(const std::vector<Pair>& pairs) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.insert(free_.end(), pairs.begin(), pairs.end());
  }
  // A pair from the pool; nullopt when it is empty (the backend then grows it with AddPairs).
  std::optional<Pair> AcquirePair() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return std::nullopt;
    Pair p = free_.back();
    free_.pop_back();
    return p;
  }
  // Returns a pair that was acquired but never pushed (the enqueue failed).
  void ReleasePair(const Pair& pair) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(pair);
  }
  size_t free_pairs() const {
    std::lock_guard<std::mutex> lock(mu_);
    return free_.size();
  }

  // Appends a GPU span whose begin event is recorded; closed: its end event too. Returns its id
  // (for CloseGpu when pushed open).
  uint64_t PushGpu(const char* name, trace::Category category, const Pair& pair,
                   const Anchor& anchor, bool closed) {
    Span s;
    s.name = name;
    s.category = category;
    s.is_gpu = true;
    s.closed = closed;
    s.timed = closed;
    s.pair = pair;
    s.anchor = anchor;
    return Push(std::move(s));
  }
  // Ends open GPU span `id`: timed when its end event was recorded, false when that failed (the
  // span is then dropped). Ignored for a span that Clear() discarded.
  void CloseGpu(uint64_t id, bool timed) {
    std::lock_guard<std::mutex> lock(mu_);
    if (id < front_id_) return;
    Span& s = At(id);
    STRATA_CHECK(s.is_gpu && !s.closed);
    s.closed = true;
    s.timed = timed;
  }
  // The event pair of open GPU span `id` (open spans are never popped).
  Pair OpenGpuPair(uint64_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    const Span& s = At(id);
    STRATA_CHECK(s.is_gpu && !s.closed);
    return s.pair;
  }
  // Appends a host span, open until FinishHost(id, ...).
  uint64_t PushHost(const char* name, trace::Category category) {
    Span s;
    s.name = name;
    s.category = category;
    return Push(std::move(s));
  }
  // Ignored for a span that Clear() discarded.
  void FinishHost(uint64_t id, bool ran, int64_t begin_ns, int64_t end_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    if (id < front_id_) return;
    Span& s = At(id);
    STRATA_CHECK(!s.is_gpu && !s.closed);
    s.closed = true;
    s.timed = ran;
    s.begin_ns = begin_ns;
    s.end_ns = end_ns;
  }

  // The oldest span when it is closed; nullopt when the queue is empty or the oldest span is
  // still open (spans behind it wait: stream order). Harvester only.
  std::optional<Span> Front() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (spans_.empty() || !spans_.front().closed) return std::nullopt;
    return spans_.front();
  }
  // Removes the oldest span (which Front() returned); a GPU span's pair goes back to the pool.
  // The span (and its Anchor) is destroyed after the lock is released. Harvester only.
  void PopFront() {
    Span gone;
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_CHECK(!spans_.empty());
    gone = std::move(spans_.front());
    if (gone.is_gpu) free_.push_back(gone.pair);
    spans_.pop_front();
    ++front_id_;
  }
  // Discards every span, open or not (their pairs are not returned: the backend is about to
  // destroy all events). Later CloseGpu/FinishHost calls for them are ignored. Harvester only.
  void Clear() {
    std::deque<Span> gone;
    std::lock_guard<std::mutex> lock(mu_);
    front_id_ += spans_.size();
    gone.swap(spans_);
    free_.clear();
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return spans_.size();
  }

  void ClaimHarvest() {
    std::unique_lock<std::mutex> lock(mu_);
    harvest_cv_.wait(lock, [&] { return !harvesting_; });
    harvesting_ = true;
  }
  bool TryClaimHarvest() {
    std::lock_guard<std::mutex> lock(mu_);
    if (harvesting_) return false;
    harvesting_ = true;
    return true;
  }
  void ReleaseHarvest() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      harvesting_ = false;
    }
    harvest_cv_.notify_all();
  }

  // [begin_ns, end_ns) moved so that it starts no earlier than the previous span of this track
  // ended and ends no earlier than it starts: the track's spans never overlap, even where two
  // spans were mapped through different anchors (each off by up to its uncertainty) or one was
  // timed on the host. Harvester only (not synchronized).
  std::pair<int64_t, int64_t> Serialize(int64_t begin_ns, int64_t end_ns) {
    begin_ns = std::max(begin_ns, last_end_ns_);
    end_ns = std::max(end_ns, begin_ns);
    last_end_ns_ = end_ns;
    return {begin_ns, end_ns};
  }

 private:
  uint64_t Push(Span s) {
    std::lock_guard<std::mutex> lock(mu_);
    s.id = front_id_ + spans_.size();
    spans_.push_back(std::move(s));
    return spans_.back().id;
  }
  Span& At(uint64_t id) STRATA_REQUIRES(mu_) {
    STRATA_CHECK(id >= front_id_ && id - front_id_ < spans_.size());
    return spans_[id - front_id_];
  }
  const Span& At(uint64_t id) const STRATA_REQUIRES(mu_) {
    STRATA_CHECK(id >= front_id_ && id - front_id_ < spans_.size());
    return spans_[id - front_id_];
  }

  mutable std::mutex mu_;
  std::condition_variable harvest_cv_;
  std::deque<Span> spans_ STRATA_GUARDED_BY(mu_);
  uint64_t front_id_ STRATA_GUARDED_BY(mu_) = 0;  // id of spans_.front()
  std::vector<Pair> free_ STRATA_GUARDED_BY(mu_);
  bool harvesting_ STRATA_GUARDED_BY(mu_) = false;
  int64_t last_end_ns_ = 0;  // harvester only
};

}  // namespace strata::gpu
