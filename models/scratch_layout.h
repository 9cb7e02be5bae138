// Byte regions of a block's scratch: the one scratch layout of a family's layer (models/
// gpt_layout.h, models/llama_layout.h), which its host and CUDA backends both use, and the CUDA
// heads' and embeddings' layouts (models/cuda/*_layout.h). Plain C++, always built.
//
// Sizes and offsets in BYTES; every region starts at a multiple of kScratchAlign from the
// scratch's start (the CUDA blocks need the scratch itself so aligned: the engine's arena slots
// are; the host blocks need it aligned to alignof(ComputeType<S>)). Pure, thread-safe.
#pragma once

#include <cstdint>
#include <string>

namespace strata::models {

inline constexpr int64_t kScratchAlign = 256;

// [offset, offset + bytes) of a buffer.
struct Region {
  int64_t offset = 0;
  int64_t bytes = 0;
  int64_t end() const { return offset + bytes; }
};

// A region with its name, for the layout tests' overlap messages.
struct NamedRegion {
  std::string name;
  Region region;
};

// Hands out consecutive regions, each aligned to kScratchAlign.
class RegionCarver {
 public:
  Region Take(int64_t bytes) {
    at_ = (at_ + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
    const Region r{at_, bytes};
    at_ += bytes;
    return r;
  }
  int64_t total() const { return (at_ + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

 private:
  int64_t at_ = 0;
};

// Region r of the scratch at `base` as T* (an address computation: host or device memory).
template <typename T>
T* RegionAt(void* base, const Region& r) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + r.offset);
}

}  // namespace strata::models
