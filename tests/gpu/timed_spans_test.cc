// The CUDA backend's tracing bookkeeping (gpu/cuda/timed_spans.h) on the host: the GPU-to-host
// clock mapping and the per-stream span queue. No GPU needed; the CUDA side that feeds it is
// tested in cuda_device_test.cc (label gpu).
#include "gpu/cuda/timed_spans.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

namespace strata::gpu {
namespace {

using trace::Category;

// Pairs and anchors as plain ints: the queue never looks inside them.
using Queue = SpanQueue<int, int>;

TEST(ClockAnchor, TakesTheMidpointOfTheWindowAndHalfItsWidthRoundedUp) {
  const ClockAnchor a = ClockAnchor::FromWindow(1'000, 1'051);
  EXPECT_EQ(a.host_ns, 1'025);
  EXPECT_EQ(a.uncertainty_ns, 26);  // the GPU stamp is in [1000, 1051]: |1025 - t| <= 26
  const ClockAnchor b = ClockAnchor::FromWindow(7, 7);
  EXPECT_EQ(b.host_ns, 7);
  EXPECT_EQ(b.uncertainty_ns, 0);
  // Both ends of the window are within the uncertainty of the midpoint.
  for (int64_t w : {0, 1, 2, 3, 999, 1000, 123457}) {
    const ClockAnchor c = ClockAnchor::FromWindow(5'000, 5'000 + w);
    EXPECT_LE(c.host_ns - 5'000, c.uncertainty_ns) << w;
    EXPECT_LE(5'000 + w - c.host_ns, c.uncertainty_ns) << w;
    EXPECT_LE(2 * c.uncertainty_ns, w + 1) << w;  // and no wider than needed
  }
}

TEST(ClockAnchor, MapsElapsedMillisecondsToNanosecondsAfterTheAnchor) {
  const ClockAnchor a{1'000'000, 10};
  // Elapsed times cudaEventElapsedTime can return: float milliseconds, including the sub-
  // microsecond steps of its 0.5 us resolution, up to the 1 s anchor lifetime and beyond.
  // Reference: exact rational k / 2^20 ms, rounded half away from zero, in long double.
  for (int64_t k :
       {int64_t{0}, int64_t{1}, int64_t{524}, int64_t{525}, int64_t{1} << 20, int64_t{3} << 19,
        int64_t{1'048'576'000}, int64_t{2'147'483'647}, int64_t{-1'000}}) {
    const float ms = static_cast<float>(std::ldexp(static_cast<double>(k), -20));
    const long double exact_ns = static_cast<long double>(ms) * 1'000'000.0L;
    const int64_t want = 1'000'000 + std::llround(exact_ns);
    EXPECT_EQ(a.HostNs(ms), want) << "k = " << k << ", ms = " << ms;
  }
  EXPECT_EQ(a.HostNs(1.5), 2'500'000);
  EXPECT_EQ(a.HostNs(0.0005), 1'000'500);  // half a microsecond
  EXPECT_EQ(a.HostNs(1000.0), 1'001'000'000);
}

TEST(SpanQueue, PairsComeFromThePoolAndReturnWhenTheirSpanIsPopped) {
  Queue q;
  EXPECT_FALSE(q.AcquirePair().has_value());  // empty pool: the backend grows it
  q.AddPairs({10, 11});
  EXPECT_EQ(q.free_pairs(), 2u);
  const auto p1 = q.AcquirePair();
  const auto p2 = q.AcquirePair();
  ASSERT_TRUE(p1 && p2);
  EXPECT_NE(*p1, *p2);
  EXPECT_FALSE(q.AcquirePair().has_value());
  q.ReleasePair(*p2);  // an enqueue that failed
  EXPECT_EQ(q.free_pairs(), 1u);
  q.PushGpu("H2D copy", Category::kH2D, *p1, /*anchor=*/3, /*closed=*/true);
  EXPECT_EQ(q.free_pairs(), 1u);  // in flight
  ASSERT_TRUE(q.Front().has_value());
  EXPECT_EQ(q.Front()->pair, *p1);
  EXPECT_EQ(q.Front()->anchor, 3);
  q.PopFront();
  EXPECT_EQ(q.free_pairs(), 2u);
  EXPECT_EQ(q.size(), 0u);
}

TEST(SpanQueue, SpansLeaveInStreamOrderAndAnOpenSpanHoldsBackTheOnesBehindIt) {
  Queue q;
  q.AddPairs({2, 1});
  ASSERT_EQ(q.AcquirePair(), 1);
  ASSERT_EQ(q.AcquirePair(), 2);
  const uint64_t copy = q.PushGpu("H2D copy", Category::kH2D, 1, 0, /*closed=*/true);
  const uint64_t span = q.PushGpu("layer forward", Category::kCompute, 2, 0, /*closed=*/false);
  const uint64_t host = q.PushHost("kernel", Category::kCompute);
  EXPECT_LT(copy, span);
  EXPECT_LT(span, host);
  EXPECT_EQ(q.OpenGpuPair(span), 2);

  auto front = q.Front();
  ASSERT_TRUE(front.has_value());
  EXPECT_EQ(front->id, copy);
  EXPECT_TRUE(front->is_gpu && front->timed);
  EXPECT_STREQ(front->name, "H2D copy");
  EXPECT_EQ(front->category, Category::kH2D);
  q.PopFront();

  EXPECT_FALSE(q.Front().has_value());  // the compute span is still open
  q.FinishHost(host, /*ran=*/true, 500, 900);
  EXPECT_FALSE(q.Front().has_value());  // the host span finished, but behind the open one
  q.CloseGpu(span, /*timed=*/true);
  front = q.Front();
  ASSERT_TRUE(front.has_value());
  EXPECT_EQ(front->id, span);
  EXPECT_TRUE(front->timed);
  EXPECT_STREQ(front->name, "layer forward");
  q.PopFront();

  front = q.Front();
  ASSERT_TRUE(front.has_value());
  EXPECT_EQ(front->id, host);
  EXPECT_FALSE(front->is_gpu);
  EXPECT_TRUE(front->timed);
  EXPECT_EQ(front->begin_ns, 500);
  EXPECT_EQ(front->end_ns, 900);
  q.PopFront();
  EXPECT_FALSE(q.Front().has_value());
  EXPECT_EQ(q.free_pairs(), 2u);
}

TEST(SpanQueue, UntimedSpansAreClosedButMarkedNotToBeRecorded) {
  Queue q;
  q.AddPairs({1});
  ASSERT_EQ(q.AcquirePair(), 1);
  const uint64_t gpu = q.PushGpu("layer backward", Category::kCompute, 1, 0, /*closed=*/false);
  const uint64_t host = q.PushHost("kernel", Category::kCompute);
  q.CloseGpu(gpu, /*timed=*/false);         // the end event could not be recorded
  q.FinishHost(host, /*ran=*/false, 0, 0);  // skipped after an earlier error
  ASSERT_TRUE(q.Front().has_value());
  EXPECT_FALSE(q.Front()->timed);
  q.PopFront();
  ASSERT_TRUE(q.Front().has_value());
  EXPECT_FALSE(q.Front()->timed);
  q.PopFront();
  EXPECT_EQ(q.size(), 0u);
  EXPECT_EQ(q.free_pairs(), 1u);
}

TEST(SpanQueue, ClearDiscardsEverythingAndLaterClosesAreIgnored) {
  Queue q;
  q.AddPairs({1, 2, 3});
  const uint64_t open_gpu = q.PushGpu("embedding forward", Category::kCompute, 1, 0, false);
  const uint64_t open_host = q.PushHost("kernel", Category::kCompute);
  q.Clear();
  EXPECT_EQ(q.size(), 0u);
  EXPECT_EQ(q.free_pairs(), 0u);        // the backend destroys every event next
  q.FinishHost(open_host, true, 1, 2);  // a host function that ran after its stream died
  q.CloseGpu(open_gpu, true);
  EXPECT_EQ(q.size(), 0u);
  EXPECT_FALSE(q.Front().has_value());
  // Ids keep counting: a span pushed now is not confused with a discarded one.
  const uint64_t next = q.PushHost("kernel", Category::kCompute);
  EXPECT_GT(next, open_host);
  q.FinishHost(next, true, 3, 4);
  ASSERT_TRUE(q.Front().has_value());
  EXPECT_EQ(q.Front()->id, next);
}

TEST(SpanQueue, SerializeKeepsATracksSpansFromOverlapping) {
  Queue q;
  EXPECT_EQ(q.Serialize(10, 20), std::make_pair(int64_t{10}, int64_t{20}));
  EXPECT_EQ(q.Serialize(15, 30), std::make_pair(int64_t{20}, int64_t{30}));  // starts late
  EXPECT_EQ(q.Serialize(25, 28), std::make_pair(int64_t{30}, int64_t{30}));  // inside: empty
  EXPECT_EQ(q.Serialize(40, 35), std::make_pair(int64_t{40}, int64_t{40}));  // inverted
  EXPECT_EQ(q.Serialize(50, 60), std::make_pair(int64_t{50}, int64_t{60}));  // a gap stays
}

TEST(SpanQueue, ASecondHarvesterWaitsForTheFirst) {
  Queue q;
  ASSERT_TRUE(q.TryClaimHarvest());
  EXPECT_FALSE(q.TryClaimHarvest());
  std::atomic<bool> released{false};
  std::atomic<bool> saw_released{false};
  std::thread second([&] {
    q.ClaimHarvest();
    saw_released = released.load();
    q.ReleaseHarvest();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let it block in ClaimHarvest
  released = true;
  q.ReleaseHarvest();
  second.join();
  EXPECT_TRUE(saw_released);
  EXPECT_TRUE(q.TryClaimHarvest());  // free again
  q.ReleaseHarvest();
}

// One thread pushes and finishes host spans while another harvests: every span comes out once,
// in push order.
TEST(SpanQueue, ConcurrentPushAndHarvestKeepOrderAndLoseNothing) {
  Queue q;
  constexpr int kSpans = 20000;
  std::thread producer([&] {
    for (int i = 0; i < kSpans; ++i) {
      const uint64_t id = q.PushHost("kernel", Category::kCompute);
      q.FinishHost(id, true, 2 * i, 2 * i + 1);
    }
  });
  std::vector<int64_t> begins;
  begins.reserve(kSpans);
  while (static_cast<int>(begins.size()) < kSpans) {
    if (!q.TryClaimHarvest()) continue;
    while (auto s = q.Front()) {
      begins.push_back(s->begin_ns);
      q.PopFront();
    }
    q.ReleaseHarvest();
  }
  producer.join();
  ASSERT_EQ(begins.size(), size_t{kSpans});
  for (int i = 0; i < kSpans; ++i) ASSERT_EQ(begins[i], 2 * i) << i;
  EXPECT_EQ(q.size(), 0u);
}

}  // namespace
}  // namespace strata::gpu
