#include "base/aligned_buffer.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "base/exceptions.h"
#include "base/units.h"

namespace strata {

StatusOr<AlignedBuffer> AlignedBuffer::Allocate(size_t size_bytes, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return InvalidArgumentError(fmt::format("alignment {} is not a power of two", alignment));
  }
  AlignedBuffer b;
  b.size_bytes_ = AlignUp(size_bytes, alignment);
  if (b.size_bytes_ == 0) return b;
  if (b.size_bytes_ >= kLazyZeroBytes && alignment <= kDirectIoAlignment) {
    void* m =
        mmap(nullptr, b.size_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
      return ResourceExhaustedError(fmt::format("could not allocate {} of host memory{}",
                                                FormatBytes(b.size_bytes_),
                                                ProcessLimitsNote(/*threads=*/false)));
    }
    b.data_ = static_cast<std::byte*>(m);
    b.mapped_ = true;
    return b;
  }
  void* p = std::aligned_alloc(alignment, b.size_bytes_);
  if (p == nullptr) {
    return ResourceExhaustedError(fmt::format("could not allocate {} of host memory{}",
                                              FormatBytes(b.size_bytes_),
                                              ProcessLimitsNote(/*threads=*/false)));
  }
  std::memset(p, 0, b.size_bytes_);
  b.data_ = static_cast<std::byte*>(p);
  return b;
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    Release();
    data_ = std::exchange(o.data_, nullptr);
    size_bytes_ = std::exchange(o.size_bytes_, 0);
    mapped_ = std::exchange(o.mapped_, false);
  }
  return *this;
}

void AlignedBuffer::Release() {
  if (mapped_) {
    munmap(data_, size_bytes_);
  } else {
    std::free(data_);
  }
  data_ = nullptr;
  size_bytes_ = 0;
  mapped_ = false;
}

AlignedBuffer::~AlignedBuffer() { Release(); }

}  // namespace strata
