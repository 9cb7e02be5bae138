// The CUDA backend against the gpu::Device contract (gpu/device.h, gpu/cuda/cuda_device.h).
// Needs a GPU (label gpu); without one every test that needs it skips with the reason, and
// the tests of the no-GPU paths run instead.
#include "gpu/cuda/cuda_device.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/trace.h"
#include "gpu/cuda/cublas_loader.h"
#include "gpu/cuda/cuda_gemm.h"
#include "gpu/cuda/cuda_native.h"
#include "gpu/cuda/cuda_status.h"
#include "tests/gpu/cuda_test_util.h"
#include "tests/gpu/pinned_sizes.h"

namespace strata::gpu {
namespace {

using testing::CudaTest;

TEST(CudaDeviceWithoutGpu, CountIsZeroAndCreateSaysWhy) {
  auto n = CudaDeviceCount();
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  if (*n > 0) GTEST_SKIP() << "a GPU is present; this tests the no-GPU path";
  auto dev = CreateCudaDevice({});
  ASSERT_FALSE(dev.ok());
  EXPECT_EQ(dev.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(dev.status().message().find("no"), std::string::npos) << dev.status().message();
  EXPECT_NE(dev.status().message().find("host device"), std::string::npos)
      << dev.status().message();
}

TEST(CudaDeviceWithoutGpu, NegativeOrdinalIsInvalid) {
  CudaDeviceOptions o;
  o.device_ordinal = -1;
  EXPECT_EQ(CreateCudaDevice(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(CudaDeviceWithoutGpu, NativeStreamOfAHostStreamIsAProgrammingError) {
  auto dev = CreateHostDevice({});
  ASSERT_TRUE(dev.ok());
  auto stream = (*dev)->CreateStream("host");
  ASSERT_TRUE(stream.ok());
  EXPECT_DEATH(NativeStream(**stream), "CUDA device");
}

// A kernel's fault is asynchronous: it shows at a later runtime call, often the next launch's
// cudaGetLastError, where the launch check must not blame the kernel being launched. Pure
// mapping of error codes: needs no GPU.
TEST(CudaStatusWithoutGpu, AFaultSeenAtALaunchIsAnEarlierKernelsAndALaunchErrorIsItsOwn) {
  for (const cudaError_t e :
       {cudaErrorIllegalAddress, cudaErrorMisalignedAddress, cudaErrorIllegalInstruction,
        cudaErrorLaunchFailure, cudaErrorAssert, cudaErrorHardwareStackError}) {
    EXPECT_TRUE(cuda::IsStickyKernelFault(e)) << cudaGetErrorName(e);
    const Status s = cuda::LaunchStatus(e, "RmsNormForwardKernel");
    EXPECT_EQ(s.code(), StatusCode::kInternal);
    const std::string want = std::string(
                                 "RmsNormForwardKernel was not launched: an earlier kernel "
                                 "on this device faulted: ") +
                             cudaGetErrorName(e) + " (";
    EXPECT_EQ(s.message().rfind(want, 0), 0u) << s.message();
    EXPECT_NE(s.message().find("CUDA_LAUNCH_BLOCKING=1"), std::string::npos) << s.message();
  }
  EXPECT_TRUE(cuda::LaunchStatus(cudaSuccess, "K").ok());
  for (const cudaError_t e : {cudaErrorInvalidConfiguration, cudaErrorLaunchOutOfResources,
                              cudaErrorMemoryAllocation, cudaErrorNoKernelImageForDevice}) {
    EXPECT_FALSE(cuda::IsStickyKernelFault(e)) << cudaGetErrorName(e);
    const Status s = cuda::LaunchStatus(e, "K");
    EXPECT_EQ(s.message().rfind(std::string("K failed: ") + cudaGetErrorName(e), 0), 0u)
        << s.message();
    EXPECT_EQ(s.code(), cuda::CudaStatus(e, "K").code());
  }
}

TEST_F(CudaTest, DescriptionNamesTheGpuAndVersions) {
  const std::string d = device_->description();
  EXPECT_EQ(device_->kind(), DeviceKind::kCuda);
  EXPECT_EQ(stream_->device_kind(), DeviceKind::kCuda);  // what models/ dispatches on
  EXPECT_NE(d.find("compute capability"), std::string::npos) << d;
  EXPECT_NE(d.find("driver"), std::string::npos) << d;
  EXPECT_NE(d.find("runtime"), std::string::npos) << d;
}

TEST_F(CudaTest, HostThreadsWaitWithBlockingSync) {
  // CreateCudaDevice asked for blocking sync on the primary context; the CUDA 12+ runtime of
  // this build grants it whether or not the context existed before (cuda_device.h, "Waiting").
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  unsigned flags = 0;
  ASSERT_EQ(cudaGetDeviceFlags(&flags), cudaSuccess);
  EXPECT_EQ(flags & cudaDeviceScheduleMask, unsigned{cudaDeviceScheduleBlockingSync}) << flags;
  EXPECT_NE(device_->description().find("host waits block"), std::string::npos)
      << device_->description();
  // A second device over the same (now active) context keeps it so.
  auto again = CreateCudaDevice({});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  ASSERT_EQ(cudaGetDeviceFlags(&flags), cudaSuccess);
  EXPECT_EQ(flags & cudaDeviceScheduleMask, unsigned{cudaDeviceScheduleBlockingSync}) << flags;
  // Events that host threads wait on still order and complete.
  auto event = device_->CreateEvent();
  ASSERT_TRUE(event.ok()) << event.status().ToString();
  ASSERT_TRUE(stream_->Record(**event).ok());
  EXPECT_TRUE((*event)->Synchronize().ok());
  EXPECT_TRUE((*event)->Query());
}

TEST_F(CudaTest, OrdinalPastTheLastGpuIsInvalid) {
  CudaDeviceOptions o;
  o.device_ordinal = 1 << 20;
  auto dev = CreateCudaDevice(o);
  EXPECT_EQ(dev.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dev.status().message().find("visible"), std::string::npos);
}

TEST_F(CudaTest, CopiesOfOddSizesRoundTripAndAreCounted) {
  std::mt19937 rng(1);
  const DeviceCounters before = device_->counters();
  uint64_t moved = 0;
  for (size_t n : {size_t{1}, size_t{3}, size_t{255}, size_t{4097}, size_t{(1 << 20) + 13}}) {
    std::vector<uint8_t> data(n);
    for (auto& b : data) b = static_cast<uint8_t>(rng());
    auto in = device_->AllocatePinned(n, "in");
    auto out = device_->AllocatePinned(n, "out");
    ASSERT_TRUE(in.ok() && out.ok());
    std::memcpy(in->data(), data.data(), n);
    DeviceSpan d = Carve(n);
    ASSERT_TRUE(stream_->CopyH2D(d, in->span().subspan(0, n)).ok());
    ASSERT_TRUE(stream_->CopyD2H(out->span(), d).ok());
    ASSERT_TRUE(stream_->Synchronize().ok());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(out->as<uint8_t>()[i], data[i]) << "size " << n << " byte " << i;
    }
    moved += n;
  }
  const DeviceCounters after = device_->counters();
  EXPECT_EQ(after.bytes_h2d - before.bytes_h2d, moved);
  EXPECT_EQ(after.bytes_d2h - before.bytes_d2h, moved);
}

// A mapping registered with RegisterPinned (what engine/shared_frozen_base.h pins) copies to the
// device and back as AllocatePinned's memory does, and stays the caller's after unpinning.
TEST_F(CudaTest, RegisteredMappingCopiesLikePinnedMemory) {
  const size_t n = 3 * 4096;
  void* map = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  auto* bytes = static_cast<std::byte*>(map);
  for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<std::byte>(i * 7);
  {
    auto pinned = device_->RegisterPinned(bytes, n, "mapping");
    ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
    auto out = device_->AllocatePinned(n, "out");
    ASSERT_TRUE(out.ok());
    DeviceSpan d = Carve(n);
    ASSERT_TRUE(stream_->CopyH2D(d, pinned->span()).ok());
    ASSERT_TRUE(stream_->CopyD2H(out->span(), d).ok());
    ASSERT_TRUE(stream_->Synchronize().ok());
    EXPECT_EQ(std::memcmp(out->data(), bytes, n), 0);
  }
  EXPECT_EQ(bytes[4097], static_cast<std::byte>(4097 * 7));
  munmap(map, n);
}

TEST_F(CudaTest, CopyIntoASmallerSpanIsRejected) {
  auto in = device_->AllocatePinned(8192, "in");
  ASSERT_TRUE(in.ok());
  DeviceSpan d = Carve(100);
  EXPECT_EQ(stream_->CopyH2D(d, in->span()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(stream_->CopyD2H(in->span().subspan(0, 50), d).code(), StatusCode::kInvalidArgument);
}

// A large H2D on one stream, then a D2H of the same bytes on another stream ordered only
// by an event: without the wait, the D2H would read the zero-filled arena.
TEST_F(CudaTest, EventOrdersWorkAcrossStreams) {
  const size_t n = size_t{64} << 20;
  auto src = device_->AllocatePinned(n, "src");
  auto dst = device_->AllocatePinned(n, "dst");
  ASSERT_TRUE(src.ok() && dst.ok());
  for (size_t i = 0; i < n / 4; ++i)
    src->as<uint32_t>()[i] = static_cast<uint32_t>(i * 2654435761u);
  auto d2h_stream = device_->CreateStream("d2h");
  auto ready = device_->CreateEvent();
  ASSERT_TRUE(d2h_stream.ok() && ready.ok());
  DeviceSpan d = Carve(n);
  std::atomic<bool> first_done{false};
  std::atomic<bool> seen_in_order{false};
  ASSERT_TRUE(stream_->CopyH2D(d, src->span()).ok());
  ASSERT_TRUE(stream_
                  ->LaunchHost([&] {
                    std::this_thread::sleep_for(std::chrono::milliseconds(50));
                    first_done = true;
                    return Status::Ok();
                  })
                  .ok());
  ASSERT_TRUE(stream_->Record(**ready).ok());
  ASSERT_TRUE((*d2h_stream)->Wait(**ready).ok());
  ASSERT_TRUE((*d2h_stream)
                  ->LaunchHost([&] {
                    seen_in_order = first_done.load();
                    return Status::Ok();
                  })
                  .ok());
  ASSERT_TRUE((*d2h_stream)->CopyD2H(dst->span(), d).ok());
  ASSERT_TRUE((*d2h_stream)->Synchronize().ok());
  EXPECT_TRUE(seen_in_order);
  EXPECT_TRUE((*ready)->Query());
  EXPECT_TRUE((*ready)->Synchronize().ok());
  EXPECT_EQ(std::memcmp(dst->data(), src->data(), n), 0);
}

TEST_F(CudaTest, FailedHostFunctionIsStickyLaterHostWorkIsSkippedEventsComplete) {
  auto event = device_->CreateEvent();
  ASSERT_TRUE(event.ok());
  auto in = device_->AllocatePinned(4096, "in");
  auto out = device_->AllocatePinned(4096, "out");
  ASSERT_TRUE(in.ok() && out.ok());
  std::memset(in->data(), 0x5a, 4096);
  DeviceSpan d = Carve(4096);
  bool later_ran = false;
  ASSERT_TRUE(
      stream_->LaunchHost([] { return DataLossError("checksum mismatch in bucket 3"); }).ok());
  ASSERT_TRUE(stream_
                  ->LaunchHost([&] {
                    later_ran = true;
                    return Status::Ok();
                  })
                  .ok());
  // Copies are GPU work: they still run after a failed host function.
  ASSERT_TRUE(stream_->CopyH2D(d, in->span()).ok());
  ASSERT_TRUE(stream_->CopyD2H(out->span(), d).ok());
  ASSERT_TRUE(stream_->Record(**event).ok());
  Status s = stream_->Synchronize();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("checksum mismatch in bucket 3"), std::string::npos);
  EXPECT_NE(s.message().find("test"), std::string::npos) << "names the stream: " << s.message();
  EXPECT_FALSE(later_ran);
  EXPECT_TRUE((*event)->Query());
  EXPECT_EQ((*event)->Synchronize().code(), StatusCode::kDataLoss);
  EXPECT_EQ(std::memcmp(out->data(), in->data(), 4096), 0);
  // The error stays: later synchronizations report it again.
  EXPECT_EQ(stream_->Synchronize().code(), StatusCode::kDataLoss);
}

TEST_F(CudaTest, ArenaBudgetExhaustionNamesTheSlot) {
  auto arena = device_->CreateArena(1 << 20);
  ASSERT_TRUE(arena.ok());
  ASSERT_TRUE((*arena)->Carve(500 << 10, "embeddings").ok());
  auto b = (*arena)->Carve(600 << 10, "block 7 slot");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("block 7 slot"), std::string::npos);
  EXPECT_EQ((*arena)->used_bytes(), size_t{500} << 10);  // the peak, 256-byte aligned
}

TEST_F(CudaTest, ArenaLargerThanTheGpuIsResourceExhaustedWithFreeMemory) {
  auto arena = device_->CreateArena(size_t{1} << 50);  // 1 PiB
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(arena.status().message().find("device arena"), std::string::npos);
  EXPECT_NE(arena.status().message().find("free"), std::string::npos);
  // The device is still usable afterwards.
  EXPECT_TRUE(device_->CreateArena(1 << 20).ok());
}

TEST_F(CudaTest, ArenaIsZeroFilled) {
  auto arena = device_->CreateArena(3 << 20);
  ASSERT_TRUE(arena.ok());
  auto span = (*arena)->Carve(3 << 20, "all");
  ASSERT_TRUE(span.ok());
  auto out = device_->AllocatePinned(3 << 20, "out");
  ASSERT_TRUE(out.ok());
  std::memset(out->data(), 0xff, 3 << 20);
  ASSERT_TRUE(stream_->CopyD2H(out->span(), *span).ok());
  ASSERT_TRUE(stream_->Synchronize().ok());
  for (size_t i = 0; i < (3 << 20); ++i) ASSERT_EQ(out->as<uint8_t>()[i], 0) << i;
}

// Issue 26: driver 580 returned a 4 KiB cudaHostAlloc that was not 4 KiB-aligned. Pinned buffers
// are now mapped aligned and registered, so every size is aligned whatever the driver does.
TEST_F(CudaTest, PinnedBuffersOfSmallAndOddSizesAreAlignedZeroedAndReturned) {
  ExpectPinnedBuffersAlignedForEverySize(*device_);
}

TEST_F(CudaTest, PinnedBudgetIsEnforcedAndReturnedOnFree) {
  CudaDeviceOptions o;
  o.pinned_budget_bytes = 1 << 20;
  auto dev = CreateCudaDevice(o);
  ASSERT_TRUE(dev.ok());
  {
    auto a = (*dev)->AllocatePinned(600 << 10, "a");
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 4096, 0u);
    for (size_t i = 0; i < (600 << 10); ++i) ASSERT_EQ(a->as<uint8_t>()[i], 0) << i;
    auto b = (*dev)->AllocatePinned(600 << 10, "gradient bucket");
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(b.status().message().find("gradient bucket"), std::string::npos);
    EXPECT_NE(b.status().message().find("budget"), std::string::npos);
  }
  EXPECT_EQ((*dev)->pinned_used_bytes(), 0u);
  EXPECT_TRUE((*dev)->AllocatePinned(1 << 20, "all").ok());
}

TEST_F(CudaTest, PinningMoreThanTheHostHasSaysHowMuchAndWhy) {
  CudaDeviceOptions o;
  o.pinned_budget_bytes = size_t{1} << 62;
  auto dev = CreateCudaDevice(o);
  ASSERT_TRUE(dev.ok());
  auto a = (*dev)->AllocatePinned(size_t{1} << 52, "master weights");  // 4 PiB
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(a.status().message().find("could not pin 4194304.00 GiB"), std::string::npos)
      << a.status().message();
  EXPECT_NE(a.status().message().find("ulimit -l"), std::string::npos);
  EXPECT_NE(a.status().message().find("master weights"), std::string::npos);
  EXPECT_EQ((*dev)->pinned_used_bytes(), 0u);
}

TEST_F(CudaTest, CublasHandleIsCreatedOncePerStreamAndBoundToIt) {
  auto h1 = CublasHandle(*stream_);
  auto h2 = CublasHandle(*stream_);
  ASSERT_TRUE(h1.ok() && h2.ok()) << h1.status().ToString();
  EXPECT_EQ(*h1, *h2);
  cudaStream_t bound = nullptr;
  auto blas = cuda::Cublas();  // cuBLAS is loaded at run time, not linked
  ASSERT_TRUE(blas.ok()) << blas.status().ToString();
  ASSERT_EQ((*blas)->GetStream(*h1, &bound), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(bound, NativeStream(*stream_));
  auto other = device_->CreateStream("other");
  ASSERT_TRUE(other.ok());
  auto h3 = CublasHandle(**other);
  ASSERT_TRUE(h3.ok());
  EXPECT_NE(*h3, *h1);
}

// ---- Tracing (cuda_device.h "Tracing") ----

// One complete event of a Chrome trace, times in nanoseconds of TraceRecorder::NowNs().
struct TracedSpan {
  std::string name;
  std::string category;
  double begin_ns = 0;
  double end_ns = 0;
};

// The spans recorded on `track`, in time order, read back through the Chrome trace the recorder
// writes (what `strata train --trace` writes).
std::vector<TracedSpan> SpansOn(const trace::TraceRecorder& recorder, int track) {
  const std::string path =
      ::testing::TempDir() + "/strata_cuda_trace_" + std::to_string(::getpid()) + ".json";
  const Status s = recorder.WriteChromeTrace(path);
  EXPECT_TRUE(s.ok()) << s.ToString();
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  std::vector<TracedSpan> out;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] != "X" || e["tid"].get<int>() != track) continue;
    const double ts_us = e["ts"].get<double>(), dur_us = e["dur"].get<double>();
    out.push_back({e["name"].get<std::string>(), e["cat"].get<std::string>(), ts_us * 1e3,
                   (ts_us + dur_us) * 1e3});
  }
  std::sort(out.begin(), out.end(),
            [](const TracedSpan& a, const TracedSpan& b) { return a.begin_ns < b.begin_ns; });
  return out;
}

// How far a span may stray outside the host times around it: the clock anchor's error (half
// its host window, microseconds) plus cudaEventElapsedTime's resolution, with a wide margin.
// A wrong mapping (units, sign, offset) is off by milliseconds or more.
constexpr double kClockToleranceNs = 200'000;

// Every span on its track lies within [before_ns, after_ns] (with the tolerance), lasts a
// positive time, and starts no earlier than the previous one ended.
void ExpectWithinAndNotOverlapping(const std::vector<TracedSpan>& spans, int64_t before_ns,
                                   int64_t after_ns) {
  for (size_t i = 0; i < spans.size(); ++i) {
    const TracedSpan& s = spans[i];
    EXPECT_GT(s.end_ns, s.begin_ns) << s.name;
    EXPECT_GE(s.begin_ns, before_ns - kClockToleranceNs) << s.name;
    EXPECT_LE(s.end_ns, after_ns + kClockToleranceNs) << s.name;
    if (i > 0) {  // 1 ns: the trace file's microsecond doubles round
      EXPECT_GE(s.begin_ns, spans[i - 1].end_ns - 1.0) << s.name << " overlaps its predecessor";
    }
  }
}

// A traced CUDA device (events kept) with a 256 MiB arena. Skips without a GPU.
class TracedCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    STRATA_SKIP_WITHOUT_CUDA();
    CudaDeviceOptions o;
    o.pinned_budget_bytes = size_t{1} << 30;
    o.trace = &recorder_;
    auto dev = CreateCudaDevice(o);
    ASSERT_TRUE(dev.ok()) << dev.status().ToString();
    device_ = std::move(*dev);
    auto arena = device_->CreateArena(size_t{256} << 20);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    arena_ = std::move(*arena);
  }
  void TearDown() override {
    arena_.reset();
    device_.reset();
  }

  std::unique_ptr<Stream> MakeStream(const std::string& name) {
    auto s = device_->CreateStream(name);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(*s) : nullptr;
  }
  DeviceSpan Carve(size_t size_bytes) {
    auto s = arena_->Carve(size_bytes, "test");
    STRATA_CHECK_MSG(s.ok(), s.status().ToString());
    return *s;
  }

  trace::TraceRecorder recorder_{/*keep_events=*/true};  // outlives the device
  std::unique_ptr<Device> device_;
  std::unique_ptr<DeviceArena> arena_;
};

TEST_F(TracedCudaTest, CopiesConvertAndHostFunctionsAreTimedOnTheStreamsTrackInOrder) {
  constexpr size_t kBytes = size_t{64} << 20;
  constexpr int64_t kElems = kBytes / 4;
  auto src = device_->AllocatePinned(kBytes, "src");
  auto dst = device_->AllocatePinned(kBytes, "dst");
  ASSERT_TRUE(src.ok() && dst.ok());
  for (int64_t i = 0; i < kElems; ++i) src->as<float>()[i] = static_cast<float>(i % 1000) * 0.5f;
  auto stream = MakeStream("traced");
  ASSERT_TRUE(stream);
  const int track = recorder_.RegisterTrack("traced");
  DeviceSpan f32 = Carve(kBytes);
  DeviceSpan f16 = Carve(kBytes / 2);

  const int64_t before_ns = recorder_.NowNs();
  ASSERT_TRUE(stream->CopyH2D(f32, src->span()).ok());
  ASSERT_TRUE(stream
                  ->LaunchHost([] {
                    std::this_thread::sleep_for(std::chrono::milliseconds(2));
                    return Status::Ok();
                  })
                  .ok());
  ASSERT_TRUE(stream->Convert(f16, DType::kF16, f32, DType::kF32, kElems).ok());
  ASSERT_TRUE(stream->CopyD2H(dst->span(), f32).ok());
  ASSERT_TRUE(stream->Synchronize().ok());
  const int64_t after_ns = recorder_.NowNs();
  ASSERT_EQ(std::memcmp(dst->data(), src->data(), kBytes), 0);

  // Synchronize returned only after every span was recorded.
  const std::vector<TracedSpan> spans = SpansOn(recorder_, track);
  ASSERT_EQ(spans.size(), 4u);
  EXPECT_EQ(spans[0].name, "H2D copy");
  EXPECT_EQ(spans[0].category, "h2d");
  EXPECT_EQ(spans[1].name, "kernel");
  EXPECT_EQ(spans[1].category, "compute");
  EXPECT_EQ(spans[2].name, "convert");
  EXPECT_EQ(spans[2].category, "compute");
  EXPECT_EQ(spans[3].name, "D2H copy");
  EXPECT_EQ(spans[3].category, "d2h");
  ExpectWithinAndNotOverlapping(spans, before_ns, after_ns);
  // 64 MiB cannot cross PCIe/NVLink-C2C faster than 1 TB/s: a copy span shorter than that is
  // mis-scaled. The host function slept 2 ms.
  const double min_copy_ns = static_cast<double>(kBytes) / 1e12 * 1e9;
  EXPECT_GE(spans[0].end_ns - spans[0].begin_ns, min_copy_ns);
  EXPECT_GE(spans[3].end_ns - spans[3].begin_ns, min_copy_ns);
  EXPECT_GE(spans[1].end_ns - spans[1].begin_ns, 2e6);

  const trace::Breakdown b = recorder_.breakdown();
  EXPECT_GT(b[trace::Category::kH2D], 0.0);
  EXPECT_GT(b[trace::Category::kD2H], 0.0);
  EXPECT_GE(b[trace::Category::kCompute], 2e-3);
  EXPECT_NEAR(b[trace::Category::kH2D], (spans[0].end_ns - spans[0].begin_ns) * 1e-9, 1e-6);
  EXPECT_EQ(device_->counters().bytes_h2d, kBytes);
  EXPECT_EQ(device_->counters().bytes_d2h, kBytes);
}

TEST_F(TracedCudaTest, EachStreamHasItsOwnTrackAndTheHarvesterRecordsWithoutASynchronize) {
  constexpr size_t kBytes = size_t{16} << 20;
  auto src = device_->AllocatePinned(kBytes, "src");
  ASSERT_TRUE(src.ok());
  auto h2d = MakeStream("h2d");
  auto d2h = MakeStream("d2h");
  auto ready = device_->CreateEvent();
  ASSERT_TRUE(h2d && d2h && ready.ok());
  DeviceSpan d = Carve(kBytes);
  const int64_t before_ns = recorder_.NowNs();
  ASSERT_TRUE(h2d->CopyH2D(d, src->span()).ok());
  ASSERT_TRUE(h2d->Record(**ready).ok());
  ASSERT_TRUE(d2h->Wait(**ready).ok());
  ASSERT_TRUE(d2h->CopyD2H(src->span(), d).ok());
  ASSERT_TRUE(d2h->Record(**ready).ok());
  ASSERT_TRUE((*ready)->Synchronize().ok());  // an event wait, not a stream Synchronize
  const int64_t after_ns = recorder_.NowNs();
  // The harvester thread records completed spans on its own (it polls every millisecond).
  for (int i = 0; i < 5000 && recorder_.num_events() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const std::vector<TracedSpan> up = SpansOn(recorder_, recorder_.RegisterTrack("h2d"));
  const std::vector<TracedSpan> down = SpansOn(recorder_, recorder_.RegisterTrack("d2h"));
  ASSERT_EQ(up.size(), 1u);
  ASSERT_EQ(down.size(), 1u);
  EXPECT_EQ(up[0].category, "h2d");
  EXPECT_EQ(down[0].category, "d2h");
  ExpectWithinAndNotOverlapping(up, before_ns, after_ns);
  ExpectWithinAndNotOverlapping(down, before_ns, after_ns);
  // The D2H waited for the H2D's event: on the GPU's one clock it starts after the H2D ended
  // (up to the error of two anchors, should the anchor have been renewed in between).
  EXPECT_GE(down[0].begin_ns, up[0].end_ns - 50'000);
}

TEST_F(TracedCudaTest, ComputeSpanTimesKernelsLaunchedOnTheNativeStream) {
  constexpr int kN = 4096;  // SGEMM of 2 N^3 = 137 GFLOP
  auto stream = MakeStream("compute");
  ASSERT_TRUE(stream);
  const int track = recorder_.RegisterTrack("compute");
  DeviceSpan a = Carve(size_t{kN} * kN * 4), b = Carve(size_t{kN} * kN * 4);
  DeviceSpan c = Carve(size_t{kN} * kN * 4), h = Carve(size_t{kN} * kN * 2);
  const int64_t before_ns = recorder_.NowNs();
  {
    ScopedComputeSpan span(*stream, "test gemm");
    ASSERT_TRUE(cuda::Gemm(*stream, false, false, kN, kN, kN, 1.0f, a.data, kN, b.data, kN, 0.0f,
                           c.data, kN, DType::kF32, DType::kF32)
                    .ok());
    // A Stream operation inside an open span is part of it, not a span of its own.
    ASSERT_TRUE(stream->Convert(h, DType::kF16, c, DType::kF32, int64_t{kN} * kN).ok());
    ScopedComputeSpan nested(*stream, "nested");  // spans do not nest: records nothing
  }
  ASSERT_TRUE(stream->Synchronize().ok());
  const int64_t after_ns = recorder_.NowNs();
  const std::vector<TracedSpan> spans = SpansOn(recorder_, track);
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].name, "test gemm");
  EXPECT_EQ(spans[0].category, "compute");
  ExpectWithinAndNotOverlapping(spans, before_ns, after_ns);
  // No GPU does fp32 GEMM (TF32 off) at 1 PFLOP/s: a shorter span is mis-scaled or empty.
  const double min_ns = 2.0 * kN * kN * kN / 1e15 * 1e9;
  EXPECT_GE(spans[0].end_ns - spans[0].begin_ns, min_ns);
  EXPECT_GT(recorder_.breakdown()[trace::Category::kCompute], min_ns * 1e-9);
  // After the span closed, Stream operations are timed on their own again.
  ASSERT_TRUE(stream->Convert(h, DType::kF16, c, DType::kF32, 1000).ok());
  ASSERT_TRUE(stream->Synchronize().ok());
  EXPECT_EQ(SpansOn(recorder_, track).size(), 2u);
}

TEST_F(TracedCudaTest, DestroyingAStreamRightAfterEnqueueStillRecordsEverything) {
  constexpr size_t kBytes = size_t{64} << 20;
  auto src = device_->AllocatePinned(kBytes, "src");
  ASSERT_TRUE(src.ok());
  DeviceSpan d = Carve(kBytes);
  const int64_t before_ns = recorder_.NowNs();
  {
    auto stream = MakeStream("short-lived");
    ASSERT_TRUE(stream);
    // More spans than the stream's initial pool of 64 event pairs: unless the harvester keeps
    // up, the pool grows.
    for (int i = 0; i < 100; ++i) {
      ASSERT_TRUE(stream->CopyH2D(d, src->span().subspan(0, kBytes / 100)).ok());
    }
    ASSERT_TRUE(stream->CopyH2D(d, src->span()).ok());
    ASSERT_TRUE(stream->CopyD2H(src->span(), d).ok());
  }  // destroyed with the copies in flight, no Synchronize
  const int64_t after_ns = recorder_.NowNs();
  const std::vector<TracedSpan> spans = SpansOn(recorder_, recorder_.RegisterTrack("short-lived"));
  ASSERT_EQ(spans.size(), 102u);
  EXPECT_EQ(spans[100].name, "H2D copy");
  EXPECT_EQ(spans[101].name, "D2H copy");
  ExpectWithinAndNotOverlapping(spans, before_ns, after_ns);
}

TEST_F(TracedCudaTest, SpansAfterTheClockAnchorWasRenewedStayOnTheHostClock) {
  constexpr size_t kBytes = size_t{32} << 20;
  auto src = device_->AllocatePinned(kBytes, "src");
  ASSERT_TRUE(src.ok());
  auto stream = MakeStream("slow");
  ASSERT_TRUE(stream);
  DeviceSpan d = Carve(kBytes);
  ASSERT_TRUE(stream->CopyH2D(d, src->span()).ok());
  ASSERT_TRUE(stream->Synchronize().ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // past the 1 s anchor lifetime
  const int64_t before_ns = recorder_.NowNs();
  ASSERT_TRUE(stream->CopyH2D(d, src->span()).ok());
  ASSERT_TRUE(stream->Synchronize().ok());
  const int64_t after_ns = recorder_.NowNs();
  const std::vector<TracedSpan> spans = SpansOn(recorder_, recorder_.RegisterTrack("slow"));
  ASSERT_EQ(spans.size(), 2u);
  ExpectWithinAndNotOverlapping({spans[1]}, before_ns, after_ns);
  EXPECT_GE(spans[1].begin_ns - spans[0].end_ns, 2.5e9 - kClockToleranceNs);
}

TEST(CudaDeviceTracing, WithoutARecorderNothingIsRecordedWithOneTheSameWorkIs) {
  STRATA_SKIP_WITHOUT_CUDA();
  trace::TraceRecorder recorder(/*keep_events=*/true);
  for (const bool traced : {false, true}) {
    CudaDeviceOptions o;
    o.pinned_budget_bytes = size_t{64} << 20;
    o.trace = traced ? &recorder : nullptr;
    auto dev = CreateCudaDevice(o);
    ASSERT_TRUE(dev.ok()) << dev.status().ToString();
    auto arena = (*dev)->CreateArena(size_t{8} << 20);
    auto pinned = (*dev)->AllocatePinned(size_t{8} << 20, "p");
    auto stream = (*dev)->CreateStream(traced ? "with" : "without");
    ASSERT_TRUE(arena.ok() && pinned.ok() && stream.ok());
    DeviceSpan d = *(*arena)->Carve(size_t{8} << 20, "d");
    ASSERT_TRUE((*stream)->CopyH2D(d, pinned->span()).ok());
    {
      ScopedComputeSpan span(**stream, "untraced span");  // a no-op without a recorder
      ASSERT_TRUE((*stream)->Convert(d, DType::kF16, d, DType::kF32, 1000).ok());
    }
    ASSERT_TRUE((*stream)->LaunchHost([] { return Status::Ok(); }).ok());
    ASSERT_TRUE((*stream)->CopyD2H(pinned->span(), d).ok());
    ASSERT_TRUE((*stream)->Synchronize().ok());
    EXPECT_EQ(recorder.num_events(), traced ? 4u : 0u) << (traced ? "traced" : "untraced");
  }
}

}  // namespace
}  // namespace strata::gpu
