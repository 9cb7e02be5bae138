// The CUDA backend against the gpu::Device contract (gpu/device.h, gpu/cuda/cuda_device.h).
// Needs a GPU (label gpu); without one every test that needs it skips with the reason, and
// the tests of the no-GPU paths run instead.
#include "gpu/cuda/cuda_device.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "gpu/cuda/cublas_loader.h"
#include "gpu/cuda/cuda_native.h"
#include "tests/gpu/cuda_test_util.h"

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

TEST_F(CudaTest, DescriptionNamesTheGpuAndVersions) {
  const std::string d = device_->description();
  EXPECT_EQ(device_->kind(), DeviceKind::kCuda);
  EXPECT_EQ(stream_->device_kind(), DeviceKind::kCuda);  // what models/ dispatches on
  EXPECT_NE(d.find("compute capability"), std::string::npos) << d;
  EXPECT_NE(d.find("driver"), std::string::npos) << d;
  EXPECT_NE(d.find("runtime"), std::string::npos) << d;
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
  EXPECT_NE(a.status().message().find("cudaHostAlloc"), std::string::npos);
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

}  // namespace
}  // namespace strata::gpu
