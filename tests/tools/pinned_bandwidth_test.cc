// MeasurePinnedBandwidth on the host backend (the CUDA run is `strata doctor` on a GPU machine):
// it moves the bytes it says, reports positive rates that a throttled link cannot beat, and
// refuses a zero size or zero repetitions by name.
#include "tools/pinned_bandwidth.h"

#include <gtest/gtest.h>

namespace strata::tools {
namespace {

TEST(PinnedBandwidth, MovesTheBytesItReportsAndNeverBeatsAThrottledLink) {
  gpu::HostDeviceOptions o;
  o.copy_bytes_per_second = 400e6;
  auto device = gpu::CreateHostDevice(o);
  ASSERT_TRUE(device.ok());
  constexpr size_t kBytes = size_t{1} << 20;
  constexpr int kReps = 3;
  auto bw = MeasurePinnedBandwidth(**device, kBytes, kReps);
  ASSERT_TRUE(bw.ok()) << bw.status().ToString();
  EXPECT_EQ(bw->size_bytes, kBytes);
  EXPECT_EQ(bw->repetitions, kReps);
  // Each direction is throttled to 400 MB/s: no measurement can be faster (10% for clock reads).
  EXPECT_GT(bw->h2d_bytes_per_second, 0);
  EXPECT_GT(bw->d2h_bytes_per_second, 0);
  EXPECT_GT(bw->both_bytes_per_second, 0);
  EXPECT_LE(bw->h2d_bytes_per_second, 1.1 * o.copy_bytes_per_second);
  EXPECT_LE(bw->d2h_bytes_per_second, 1.1 * o.copy_bytes_per_second);
  EXPECT_LE(bw->both_bytes_per_second, 2.2 * o.copy_bytes_per_second);
  // Warm-up round trip (H2D twice) + 3 x (H2D, D2H, H2D + D2H).
  const gpu::DeviceCounters c = (*device)->counters();
  EXPECT_EQ(c.bytes_h2d, (2 + 2 * kReps) * kBytes);
  EXPECT_EQ(c.bytes_d2h, (1 + 2 * kReps) * kBytes);
  // Everything it took was given back.
  EXPECT_EQ((*device)->pinned_used_bytes(), 0u);
}

TEST(PinnedBandwidth, RefusesAZeroSizeOrNoRepetitions) {
  auto device = gpu::CreateHostDevice({});
  ASSERT_TRUE(device.ok());
  auto zero = MeasurePinnedBandwidth(**device, 0, 3);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("zero"), std::string::npos);
  auto none = MeasurePinnedBandwidth(**device, 4096, 0);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("repetitions"), std::string::npos);
}

TEST(PinnedBandwidth, ABudgetTooSmallForTheBuffersIsReportedNotCrashed) {
  gpu::HostDeviceOptions o;
  o.pinned_budget_bytes = 4096;
  auto device = gpu::CreateHostDevice(o);
  ASSERT_TRUE(device.ok());
  auto bw = MeasurePinnedBandwidth(**device, size_t{1} << 20, 1);
  ASSERT_FALSE(bw.ok());
  EXPECT_EQ(bw.status().code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace strata::tools
