#include "base/aligned_buffer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <utility>

namespace strata {
namespace {

// Both allocation paths (aligned_alloc below kLazyZeroBytes, an anonymous mapping from it) give
// aligned, zero-filled, writable memory of the rounded size, and moves hand it over once.
TEST(AlignedBuffer, SmallAndLargeBuffersAreAlignedZeroFilledAndMovable) {
  for (size_t n : {size_t{1}, size_t{4095}, size_t{4097}, kLazyZeroBytes - 1, kLazyZeroBytes,
                   (size_t{3} << 20) + 5}) {
    SCOPED_TRACE(n);
    for (size_t alignment : {size_t{64}, kDirectIoAlignment}) {
      auto b = AlignedBuffer::Allocate(n, alignment);
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % alignment, 0u);
      EXPECT_EQ(b->size_bytes() % alignment, 0u);
      EXPECT_GE(b->size_bytes(), n);
      size_t nonzero = 0;
      for (std::byte x : b->span()) nonzero += x != std::byte{0};
      EXPECT_EQ(nonzero, 0u);
      b->data()[b->size_bytes() - 1] = std::byte{7};
      AlignedBuffer moved = std::move(*b);
      EXPECT_EQ(b->data(), nullptr);
      EXPECT_EQ(moved.data()[moved.size_bytes() - 1], std::byte{7});
      moved = AlignedBuffer();  // releases the first; the empty one releases nothing
      EXPECT_EQ(moved.size_bytes(), 0u);
    }
  }
}

TEST(AlignedBuffer, AlignmentThatIsNotAPowerOfTwoIsInvalid) {
  EXPECT_EQ(AlignedBuffer::Allocate(100, 48).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata
