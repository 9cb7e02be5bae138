// Shared by the CUDA backend tests: skip without a GPU, move data in and out.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu/cuda/cuda_device.h"
#include "gpu/device.h"

namespace strata::gpu::testing {

// Empty when a CUDA GPU is usable; otherwise why not (for GTEST_SKIP).
inline std::string NoCudaReason() {
  auto n = CudaDeviceCount();
  if (!n.ok()) return "no usable CUDA runtime: " + n.status().message();
  if (*n == 0) return "no CUDA device (cudaGetDeviceCount: no NVIDIA driver or no GPU visible)";
  return "";
}

#define STRATA_SKIP_WITHOUT_CUDA()                                                            \
  do {                                                                                        \
    if (const std::string reason = ::strata::gpu::testing::NoCudaReason(); !reason.empty()) { \
      GTEST_SKIP() << reason;                                                                 \
    }                                                                                         \
  } while (0)

// A CUDA device with a 256 MiB arena and one stream. Skips without a GPU.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    STRATA_SKIP_WITHOUT_CUDA();
    CudaDeviceOptions o;
    o.pinned_budget_bytes = size_t{1} << 30;
    auto dev = CreateCudaDevice(o);
    ASSERT_TRUE(dev.ok()) << dev.status().ToString();
    device_ = std::move(*dev);
    auto arena = device_->CreateArena(size_t{256} << 20);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    arena_ = std::move(*arena);
    auto stream = device_->CreateStream("test");
    ASSERT_TRUE(stream.ok()) << stream.status().ToString();
    stream_ = std::move(*stream);
  }
  void TearDown() override {
    stream_.reset();
    arena_.reset();
    device_.reset();
  }

  DeviceSpan Carve(size_t size_bytes) {
    auto s = arena_->Carve(size_bytes, "test");
    STRATA_CHECK_MSG(s.ok(), s.status().ToString());
    return *s;
  }

  // Copies `values` into dst (H2D through a pinned staging buffer) and waits.
  template <typename T>
  void Upload(DeviceSpan dst, const std::vector<T>& values) {
    const size_t n = values.size() * sizeof(T);
    auto pinned = device_->AllocatePinned(std::max<size_t>(n, 1), "upload");
    ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
    if (n) std::memcpy(pinned->data(), values.data(), n);
    ASSERT_TRUE(stream_->CopyH2D(dst, pinned->span().subspan(0, n)).ok());
    ASSERT_TRUE(stream_->Synchronize().ok());
  }

  // Copies num_elems elements of src back (D2H) after the stream's work so far.
  template <typename T>
  std::vector<T> Download(DeviceSpan src, size_t num_elems) {
    std::vector<T> out(num_elems);
    const size_t n = num_elems * sizeof(T);
    auto pinned = device_->AllocatePinned(std::max<size_t>(n, 1), "download");
    EXPECT_TRUE(pinned.ok()) << pinned.status().ToString();
    if (!pinned.ok()) return out;
    Status s = stream_->CopyD2H(pinned->span(), src.subspan(0, n));
    if (s.ok()) s = stream_->Synchronize();
    EXPECT_TRUE(s.ok()) << s.ToString();
    if (n) std::memcpy(out.data(), pinned->data(), n);
    return out;
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<DeviceArena> arena_;
  std::unique_ptr<Stream> stream_;
};

}  // namespace strata::gpu::testing
