// Host memory for pinned buffers, aligned by construction. Both device backends take their pinned
// regions from here: the host backend uses the mapping as it is, the CUDA backend page-locks it
// with cudaHostRegister. No backend relies on its allocator returning whole pages
// (cudaHostAlloc does not promise it: on driver 580 a 4 KiB request came back unaligned), so every
// pinned buffer can also be an O_DIRECT buffer and a DMA source, whatever its size.
#pragma once

#include <cstddef>

#include "base/status.h"

namespace strata::gpu {

// 4 KiB: the alignment every pinned buffer has (O_DIRECT's logical block and the x86 page).
inline constexpr size_t kPinnedAlignment = 4096;
// Mappings of at least this size are aligned to it and asked for transparent huge pages
// (fewer TLB misses and faster page-locking for multi-GiB regions).
inline constexpr size_t kPinnedHugeAlignment = size_t{2} << 20;

// The bytes a mapping for `size_bytes` covers: size_bytes rounded up to kPinnedAlignment, or to
// kPinnedHugeAlignment once that is reached. A pure function of size_bytes, so the owner passes
// the requested size back to UnmapAlignedHostMemory. size_bytes 0 maps one page.
size_t PinnedMappingBytes(size_t size_bytes);

// An anonymous private mapping of PinnedMappingBytes(size_bytes): zero-filled, aligned to
// kPinnedAlignment (to kPinnedHugeAlignment, with MADV_HUGEPAGE advised, for large sizes).
// kResourceExhausted naming the size and errno when the kernel refuses. Thread-safe.
StatusOr<std::byte*> MapAlignedHostMemory(size_t size_bytes);

// Returns a mapping made by MapAlignedHostMemory(size_bytes) (the same size_bytes). Thread-safe;
// a failed munmap is logged (it cannot fail for a mapping made here).
void UnmapAlignedHostMemory(std::byte* data, size_t size_bytes);

}  // namespace strata::gpu
