// Deterministic random initialisation shared by the model families: per-block normal streams
// that are a function of (seed, tag) only, on every platform — std::mt19937_64 (whose output
// sequence the standard fixes) seeded through SplitMix64 (Steele, Lea & Flood, "Fast Splittable
// Pseudorandom Number Generators", 2014), and our own Box-Muller transform (Box & Muller, 1958)
// on 53-bit uniforms instead of std::normal_distribution, whose output is
// implementation-defined.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>

#include "base/host_device.h"

namespace strata::models::init {

// Host and device: the CUDA LoRA dropout (models/cuda/lora_cuda.cu) draws the host's mask.
STRATA_HD inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Block tags of the per-block random streams.
inline constexpr uint64_t kEmbeddingTag = 0;
inline constexpr uint64_t kHeadTag = ~uint64_t{0};
inline uint64_t LayerTag(int layer_index) { return 1 + static_cast<uint64_t>(layer_index); }

// Standard normal samples of the stream (seed, tag). Not thread-safe; one per block.
class NormalSampler {
 public:
  NormalSampler(uint64_t seed, uint64_t tag) : gen_(SplitMix64(seed ^ SplitMix64(tag))) {}

  double Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = Uniform();  // (0, 1): log(u1) is finite
    const double u2 = Uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

 private:
  double Uniform() { return (static_cast<double>(gen_() >> 11) + 0.5) * 0x1.0p-53; }

  std::mt19937_64 gen_;
  bool has_spare_ = false;
  double spare_ = 0;
};

// out[i] = float(stddev * N(0, 1)) for n elements, in order.
inline void FillNormal(NormalSampler& rng, double stddev, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(stddev * rng.Next());
}

}  // namespace strata::models::init
