#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#include "base/dtype.h"
#include "gpu/device.h"
#include "gpu/pinned_memory.h"
#include "tests/gpu/pinned_sizes.h"

namespace strata::gpu {
namespace {

TEST(HostDevice, ArenaCarvesWithinItsBudgetAndReportsTheShortfall) {
  auto dev = CreateHostDevice({});
  ASSERT_TRUE(dev.ok());
  auto arena = (*dev)->CreateArena(1000);
  ASSERT_TRUE(arena.ok());
  auto a = (*arena)->Carve(500, "a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*arena)->used_bytes(), 512u);  // 256-byte aligned
  auto b = (*arena)->Carve(600, "block slot");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("block slot"), std::string::npos);
}

TEST(HostDevice, PinnedBudgetIsEnforcedAndReturnedOnFree) {
  HostDeviceOptions o;
  o.pinned_budget_bytes = 8192;
  auto dev = CreateHostDevice(o);
  ASSERT_TRUE(dev.ok());
  {
    auto a = (*dev)->AllocatePinned(5000, "a");
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 4096, 0u);
    auto b = (*dev)->AllocatePinned(1, "bucket");
    EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(b.status().message().find("bucket"), std::string::npos);
  }
  EXPECT_EQ((*dev)->pinned_used_bytes(), 0u);
  EXPECT_TRUE((*dev)->AllocatePinned(8192, "all").ok());
}

// RegisterPinned (a mapping the caller keeps, e.g. a shared-memory object): counted against the
// pinned budget while registered, whole pages only, the memory neither copied nor freed.
TEST(HostDevice, RegisteredMemoryIsCountedAgainstTheBudgetAndLeftToItsOwner) {
  HostDeviceOptions o;
  o.pinned_budget_bytes = 3 * 4096;
  auto dev = CreateHostDevice(o);
  ASSERT_TRUE(dev.ok());
  alignas(4096) static std::byte pages[4 * 4096];
  pages[5] = std::byte{42};
  {
    auto a = (*dev)->RegisterPinned(pages, 2 * 4096, "shared");
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ(a->data(), pages);
    EXPECT_EQ(a->data()[5], std::byte{42});
    EXPECT_EQ((*dev)->pinned_used_bytes(), 2u * 4096);
    auto b = (*dev)->RegisterPinned(pages + 2 * 4096, 2 * 4096, "more");
    EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(b.status().message().find("more"), std::string::npos);
    EXPECT_EQ((*dev)->pinned_used_bytes(), 2u * 4096);
  }
  EXPECT_EQ((*dev)->pinned_used_bytes(), 0u);
  EXPECT_EQ(pages[5], std::byte{42});  // neither freed nor cleared
  EXPECT_EQ((*dev)->RegisterPinned(pages + 1, 4096, "odd").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*dev)->RegisterPinned(pages, 100, "odd").status().code(),
            StatusCode::kInvalidArgument);
}

TEST(HostDevice, PinnedBuffersOfSmallAndOddSizesAreAlignedZeroedAndReturned) {
  auto dev = CreateHostDevice({});
  ASSERT_TRUE(dev.ok());
  ExpectPinnedBuffersAlignedForEverySize(**dev);
}

TEST(PinnedMemory, MappingRoundsToPagesThenToHugePagesFromTwoMebibytes) {
  EXPECT_EQ(PinnedMappingBytes(0), 4096u);
  EXPECT_EQ(PinnedMappingBytes(1), 4096u);
  EXPECT_EQ(PinnedMappingBytes(4096), 4096u);
  EXPECT_EQ(PinnedMappingBytes(4097), 8192u);
  EXPECT_EQ(PinnedMappingBytes((2u << 20) - 4096), (2u << 20) - 4096);
  EXPECT_EQ(PinnedMappingBytes((2u << 20) - 4095), 2u << 20);
  EXPECT_EQ(PinnedMappingBytes((2u << 20) + 1), 4u << 20);
  auto p = MapAlignedHostMemory(3u << 20);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*p) % kPinnedHugeAlignment, 0u);
  (*p)[(4u << 20) - 1] = std::byte{1};  // the whole rounded mapping is ours
  UnmapAlignedHostMemory(*p, 3u << 20);
}

TEST(HostDevice, EventOrdersWorkAcrossStreams) {
  HostDeviceOptions o;
  o.copy_bytes_per_second = 1e6;  // a 20 KB copy takes 20 ms
  auto dev = CreateHostDevice(o);
  auto arena = (*dev)->CreateArena(1 << 20);
  auto h2d = (*dev)->CreateStream("h2d");
  auto compute = (*dev)->CreateStream("compute");
  EXPECT_EQ((*compute)->device_kind(), DeviceKind::kHost);  // what models/ dispatches on
  auto ready = (*dev)->CreateEvent();
  auto src = (*dev)->AllocatePinned(20000, "src");
  std::memset(src->data(), 7, 20000);
  auto dst = *(*arena)->Carve(20000, "dst");
  ASSERT_TRUE((*h2d)->CopyH2D(dst, src->span().subspan(0, 20000)).ok());
  ASSERT_TRUE((*h2d)->Record(**ready).ok());
  ASSERT_TRUE((*compute)->Wait(**ready).ok());
  std::atomic<int> seen{-1};
  ASSERT_TRUE((*compute)
                  ->LaunchHost([&] {
                    int ok = 1;
                    for (int i = 0; i < 20000; ++i) ok &= dst.data[i] == std::byte{7};
                    seen = ok;
                    return Status::Ok();
                  })
                  .ok());
  ASSERT_TRUE((*compute)->Synchronize().ok());
  EXPECT_EQ(seen.load(), 1);
  EXPECT_EQ((*dev)->counters().bytes_h2d, 20000u);
}

TEST(HostDevice, ErrorsAreStickyAndEventsStillComplete) {
  auto dev = CreateHostDevice({});
  auto s = (*dev)->CreateStream("compute");
  auto e = (*dev)->CreateEvent();
  int ran = 0;
  ASSERT_TRUE((*s)->LaunchHost([] { return InternalError("kernel failed"); }).ok());
  ASSERT_TRUE((*s)->LaunchHost([&] {
                    ++ran;
                    return Status::Ok();
                  })
                  .ok());
  ASSERT_TRUE((*s)->Record(**e).ok());
  const Status st = (*e)->Synchronize();
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("kernel failed"), std::string::npos);
  EXPECT_EQ(ran, 0);
  EXPECT_EQ((*s)->Synchronize().code(), StatusCode::kInternal);
}

// A kernel whose scratch allocation throws (std::bad_alloc under ulimit -v) fails its stream as an
// error would: on the worker thread the throw reached std::terminate, which aborted the process
// and left the run's swap files behind.
TEST(HostDevice, AKernelThatThrowsFailsItsStreamNotTheProcess) {
  auto dev = CreateHostDevice({});
  auto s = (*dev)->CreateStream("compute");
  (*s)->SetWorkLabel("block 2 forward");
  ASSERT_TRUE((*s)->LaunchHost([]() -> Status { throw std::bad_alloc(); }).ok());
  const Status st = (*s)->Synchronize();
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(st.message().rfind("block 2 forward failed on stream 'compute': out of host memory", 0),
            0u)
      << st.message();
}

TEST(HostDevice, ConvertMatchesScalarConversionsIncludingInPlace) {
  auto dev = CreateHostDevice({});
  auto arena = (*dev)->CreateArena(1 << 16);
  auto s = (*dev)->CreateStream("compute");
  auto buf = *(*arena)->Carve(4 * 1001, "x");
  float* f = buf.as<float>();
  std::vector<float> ref(1001);
  for (int i = 0; i < 1001; ++i)
    ref[i] = f[i] = std::ldexp(1.0f + i * 0.37f, (i % 40) - 20) * (i % 3 ? 1 : -1);
  f[5] = INFINITY;
  ref[5] = INFINITY;
  ASSERT_TRUE((*s)->Convert(buf, DType::kF16, buf, DType::kF32, 1001, 2.0f).ok());
  ASSERT_TRUE((*s)->Synchronize().ok());
  const auto* h = buf.as<uint16_t>();
  for (int i = 0; i < 1001; ++i) ASSERT_EQ(h[i], FloatToHalf(ref[i] * 2.0f)) << i;
}

TEST(HostDevice, TracesCopiesAndKernelsPerStreamWithTheirCategories) {
  trace::TraceRecorder recorder(/*keep_events=*/true);
  HostDeviceOptions o;
  o.trace = &recorder;
  auto dev = CreateHostDevice(o);
  ASSERT_TRUE(dev.ok());
  auto arena = (*dev)->CreateArena(1 << 16);
  auto h2d = (*dev)->CreateStream("h2d");
  auto compute = (*dev)->CreateStream("compute");
  auto pinned = (*dev)->AllocatePinned(4096, "p");
  auto d = *(*arena)->Carve(4096, "d");
  ASSERT_TRUE((*h2d)->CopyH2D(d, pinned->span()).ok());
  ASSERT_TRUE((*compute)
                  ->LaunchHost([] {
                    std::this_thread::sleep_for(std::chrono::milliseconds(5));
                    return Status::Ok();
                  })
                  .ok());
  ASSERT_TRUE((*compute)->CopyD2H(pinned->span(), d).ok());
  ASSERT_TRUE((*h2d)->Synchronize().ok());
  ASSERT_TRUE((*compute)->Synchronize().ok());
  EXPECT_EQ(recorder.num_events(), 3u);  // event records and waits are not traced
  const trace::Breakdown b = recorder.breakdown();
  EXPECT_GE(b[trace::Category::kCompute], 0.005);
  EXPECT_GT(b[trace::Category::kH2D], 0.0);
  EXPECT_GT(b[trace::Category::kD2H], 0.0);     // by operation, not by stream
  EXPECT_EQ(recorder.RegisterTrack("h2d"), 0);  // one track per stream, in creation order
  EXPECT_EQ(recorder.RegisterTrack("compute"), 1);
}

TEST(HostDevice, DelayingModeKeepsStreamOrderAndEventOrdering) {
  HostDeviceOptions o;
  o.max_random_delay_us = 2000;
  o.random_delay_seed = 42;
  auto dev = CreateHostDevice(o);
  ASSERT_TRUE(dev.ok());
  auto arena = (*dev)->CreateArena(1 << 16);
  auto h2d = (*dev)->CreateStream("h2d");
  auto compute = (*dev)->CreateStream("compute");
  auto ready = (*dev)->CreateEvent();
  auto src = (*dev)->AllocatePinned(4096, "src");
  auto dst = *(*arena)->Carve(4096, "dst");
  std::vector<int> seen;
  for (int round = 0; round < 20; ++round) {
    std::memset(src->data(), round, 4096);
    ASSERT_TRUE((*h2d)->CopyH2D(dst, src->span()).ok());
    ASSERT_TRUE((*h2d)->Record(**ready).ok());
    ASSERT_TRUE((*compute)->Wait(**ready).ok());
    ASSERT_TRUE((*compute)
                    ->LaunchHost([&seen, dst] {
                      seen.push_back(static_cast<int>(dst.data[4095]));
                      return Status::Ok();
                    })
                    .ok());
    ASSERT_TRUE((*compute)->Synchronize().ok());  // src is rewritten next round
  }
  std::vector<int> expected(20);
  for (int i = 0; i < 20; ++i) expected[i] = i;
  EXPECT_EQ(seen, expected);
  HostDeviceOptions bad;
  bad.max_random_delay_us = -1;
  EXPECT_EQ(CreateHostDevice(bad).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::gpu
