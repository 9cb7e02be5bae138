#include "gpu/pinned_memory.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdint>

#include "base/logging.h"
#include "base/units.h"

namespace strata::gpu {

namespace {

size_t RoundUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace

size_t PinnedMappingBytes(size_t size_bytes) {
  const size_t pages = RoundUp(size_bytes == 0 ? 1 : size_bytes, kPinnedAlignment);
  return pages >= kPinnedHugeAlignment ? RoundUp(pages, kPinnedHugeAlignment) : pages;
}

StatusOr<std::byte*> MapAlignedHostMemory(size_t size_bytes) {
  const size_t length = PinnedMappingBytes(size_bytes);
  const bool huge = length >= kPinnedHugeAlignment;
  // A huge-aligned region: map one alignment more than needed, then give back the head and tail.
  const size_t reserve = huge ? length + kPinnedHugeAlignment : length;
  void* p = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return ErrnoToStatus(errno,
                         fmt::format("mapping {} of host memory to pin", FormatBytes(length)));
  }
  auto* base = static_cast<std::byte*>(p);
  if (!huge) return base;
  const uintptr_t at = reinterpret_cast<uintptr_t>(base);
  const size_t head = RoundUp(at, kPinnedHugeAlignment) - at;
  if (head > 0) munmap(base, head);
  const size_t tail = reserve - head - length;
  if (tail > 0) munmap(base + head + length, tail);
  std::byte* aligned = base + head;
  // Advice only: a kernel without transparent huge pages keeps 4 KiB pages.
  madvise(aligned, length, MADV_HUGEPAGE);
  return aligned;
}

void UnmapAlignedHostMemory(std::byte* data, size_t size_bytes) {
  if (data == nullptr) return;
  if (munmap(data, PinnedMappingBytes(size_bytes)) != 0) {
    STRATA_LOG_WARNING("{}", ErrnoToStatus(errno, "munmap of a pinned mapping").message());
  }
}

}  // namespace strata::gpu
