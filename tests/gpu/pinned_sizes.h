// One check for every device backend: pinned buffers of small and odd sizes are 4 KiB-aligned
// (2 MiB-aligned from 2 MiB), zero-filled, writable to their last byte, usable as a copy source
// and destination, and returned to the budget. Used by the host test (CI) and the CUDA test (gpu).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gpu/device.h"
#include "gpu/pinned_memory.h"

namespace strata::gpu {

inline void ExpectPinnedBuffersAlignedForEverySize(Device& dev) {
  const std::vector<size_t> sizes = {
      1, 7, 4095, 4096, 4097, 12345, 65537, (2u << 20) - 1, 2u << 20, (2u << 20) + 1, 5'000'001};
  auto arena = dev.CreateArena(8u << 20);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  auto stream = dev.CreateStream("copies");
  ASSERT_TRUE(stream.ok()) << stream.status().ToString();
  // Several live at once, so an allocator that packs small requests together would show.
  std::vector<PinnedBuffer> live;
  for (size_t n : sizes) {
    SCOPED_TRACE(::testing::Message() << n << " bytes");
    auto b = dev.AllocatePinned(n, "odd size");
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    const auto at = reinterpret_cast<uintptr_t>(b->data());
    EXPECT_EQ(at % kPinnedAlignment, 0u);
    if (n >= kPinnedHugeAlignment) {
      EXPECT_EQ(at % kPinnedHugeAlignment, 0u);
    }
    EXPECT_GE(b->size_bytes(), n);
    EXPECT_EQ(b->size_bytes() % kPinnedAlignment, 0u);
    const std::byte* p = b->data();
    size_t nonzero = 0;
    for (size_t i = 0; i < b->size_bytes(); ++i) nonzero += p[i] != std::byte{0};
    EXPECT_EQ(nonzero, 0u);
    std::memset(b->data(), 0x5a, b->size_bytes());  // writable to the last byte
    live.push_back(std::move(*b));
  }
  // A round trip through the device from the smallest and an odd-sized buffer.
  for (size_t i : {size_t{0}, size_t{5}}) {
    const size_t n = sizes[i];
    auto dst = (*arena)->Carve(n, "dst");
    ASSERT_TRUE(dst.ok());
    auto back = dev.AllocatePinned(n, "back");
    ASSERT_TRUE(back.ok());
    ASSERT_TRUE((*stream)->CopyH2D(*dst, live[i].span().subspan(0, n)).ok());
    ASSERT_TRUE((*stream)->CopyD2H(back->span().subspan(0, n), *dst).ok());
    ASSERT_TRUE((*stream)->Synchronize().ok());
    EXPECT_EQ(std::memcmp(back->data(), live[i].data(), n), 0);
  }
  live.clear();
  EXPECT_EQ(dev.pinned_used_bytes(), 0u);
}

}  // namespace strata::gpu
