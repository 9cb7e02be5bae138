// Owning, aligned host memory (default 4 KiB: usable for O_DIRECT I/O).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "base/status.h"

namespace strata {

inline constexpr size_t kDirectIoAlignment = 4096;
inline constexpr size_t kLazyZeroBytes = size_t{1} << 20;

// Move-only. Contents are zero-filled at allocation. Not thread-safe itself; the
// memory may be shared between threads under the caller's synchronization.
// From kLazyZeroBytes up (with an alignment of at most a page) the memory is an anonymous
// mapping: the kernel zero-fills each page when it is first touched, so a multi-GiB buffer costs
// nothing until it is used (and the first use, often a parallel loop, pays in parallel) instead of
// a single-threaded memset at allocation.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // kResourceExhausted when the allocation fails; kInvalidArgument when alignment
  // is not a power of two. size_bytes is rounded up to a multiple of alignment.
  static StatusOr<AlignedBuffer> Allocate(size_t size_bytes, size_t alignment = kDirectIoAlignment);
  AlignedBuffer(AlignedBuffer&& o) noexcept { *this = std::move(o); }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  std::byte* data() const { return data_; }
  size_t size_bytes() const { return size_bytes_; }
  std::span<std::byte> span() const { return {data_, size_bytes_}; }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }

 private:
  void Release();

  std::byte* data_ = nullptr;
  size_t size_bytes_ = 0;
  bool mapped_ = false;  // an anonymous mapping (munmap), else aligned_alloc (free)
};

}  // namespace strata
