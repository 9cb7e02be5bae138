// The host 4-bit quantization and dequantization (quantize_4bit.h): bitsandbytes' CUDA kernels
// (csrc/kernels.cu) emulated in fp32, one rounding per operation as the kernels compute them.
#include "models/ops/quantize_4bit.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "models/ops/parallel.h"
#include "models/ops/quantize_4bit_math.h"

namespace strata::models::ops {
namespace {

// NF4: bitsandbytes functional.get_4bit_type("nf4") (= csrc/kernels.cu nf4_dequantization_lut),
// the normal-float quantiles of QLoRA, the decimals bitsandbytes writes, rounded to fp32.
constexpr std::array<float, 16> kNf4Map = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

// FP4: bitsandbytes functional.get_4bit_type("fp4"): the e2m1 values of the codes s e e m (bias
// 2; 0b001 the subnormal 0.0625) [0, 0.0625, 8, 12, 4, 6, 2, 3], the same negated for s = 1 (its
// "-0" is the Python int 0, so +0.0), divided in fp32 by their absolute maximum 12. They equal
// csrc/kernels.cu's fp4_dequantization_lut literals (0.005208333333f, 0.66666667f, ...) in fp32.
constexpr std::array<float, 16> kFp4Map = {
    0.0f,             // 0b0000: 0
    0x1.555556p-8f,   // 0b0001: 0.0625 / 12
    0x1.555556p-1f,   // 0b0010: 8 / 12
    1.0f,             // 0b0011: 12 / 12
    0x1.555556p-2f,   // 0b0100: 4 / 12
    0.5f,             // 0b0101: 6 / 12
    0x1.555556p-3f,   // 0b0110: 2 / 12
    0.25f,            // 0b0111: 3 / 12
    0.0f,             // 0b1000: "-0" / 12
    -0x1.555556p-8f,  // 0b1001: -0.0625 / 12
    -0x1.555556p-1f,  // 0b1010: -8 / 12
    -1.0f,            // 0b1011: -12 / 12
    -0x1.555556p-2f,  // 0b1100: -4 / 12
    -0.5f,            // 0b1101: -6 / 12
    -0x1.555556p-3f,  // 0b1110: -2 / 12
    -0.25f,           // 0b1111: -3 / 12
};

// bitsandbytes functional.create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
// for i in 0..6, the midpoints of torch.linspace(0.1, 1, 2^i + 1, dtype=float32) times 10^(i-6)
// (fp32), each with its negation, then 0 and 1.0, sorted. Generated once with torch from that
// formula; tests/python/test_quantize_4bit.py re-derives it and compares.
constexpr std::array<float, 256> kDynamicMap8 = {
    -0x1.fc6666p-1f,  -0x1.f53332p-1f,  -0x1.eep-1f,      -0x1.e6ccccp-1f,  -0x1.df9998p-1f,
    -0x1.d86666p-1f,  -0x1.d13334p-1f,  -0x1.cap-1f,      -0x1.c2ccccp-1f,  -0x1.bb9998p-1f,
    -0x1.b46666p-1f,  -0x1.ad3332p-1f,  -0x1.a6p-1f,      -0x1.9eccccp-1f,  -0x1.979998p-1f,
    -0x1.906666p-1f,  -0x1.893334p-1f,  -0x1.82p-1f,      -0x1.7acccep-1f,  -0x1.73999ap-1f,
    -0x1.6c6668p-1f,  -0x1.653334p-1f,  -0x1.5ep-1f,      -0x1.56cccep-1f,  -0x1.4f999ap-1f,
    -0x1.486666p-1f,  -0x1.413334p-1f,  -0x1.3ap-1f,      -0x1.32ccccp-1f,  -0x1.2b999ap-1f,
    -0x1.246668p-1f,  -0x1.1d3334p-1f,  -0x1.16p-1f,      -0x1.0eccccp-1f,  -0x1.07999ap-1f,
    -0x1.006666p-1f,  -0x1.f26668p-2f,  -0x1.e4p-2f,      -0x1.d59998p-2f,  -0x1.c73334p-2f,
    -0x1.b8ccccp-2f,  -0x1.aa6664p-2f,  -0x1.9cp-2f,      -0x1.8d9998p-2f,  -0x1.7f3334p-2f,
    -0x1.70ccccp-2f,  -0x1.626664p-2f,  -0x1.54p-2f,      -0x1.459998p-2f,  -0x1.373334p-2f,
    -0x1.28ccccp-2f,  -0x1.1a6668p-2f,  -0x1.0cp-2f,      -0x1.fb3334p-3f,  -0x1.de6668p-3f,
    -0x1.c1999ap-3f,  -0x1.a4ccccp-3f,  -0x1.88p-3f,      -0x1.6b3332p-3f,  -0x1.4e6666p-3f,
    -0x1.31999ap-3f,  -0x1.14ccccp-3f,  -0x1.fp-4f,       -0x1.b66668p-4f,  -0x1.93d70ap-4f,
    -0x1.8851eap-4f,  -0x1.7ccccep-4f,  -0x1.7147aep-4f,  -0x1.65c29p-4f,   -0x1.5a3d7p-4f,
    -0x1.4eb85p-4f,   -0x1.433334p-4f,  -0x1.37ae14p-4f,  -0x1.2c28f6p-4f,  -0x1.20a3d6p-4f,
    -0x1.151ebap-4f,  -0x1.09999ap-4f,  -0x1.fc28f4p-5f,  -0x1.e51ebap-5f,  -0x1.ce147ap-5f,
    -0x1.b70a3ep-5f,  -0x1.ap-5f,       -0x1.88f5c2p-5f,  -0x1.71eb86p-5f,  -0x1.5ae146p-5f,
    -0x1.43d70ap-5f,  -0x1.2ccccep-5f,  -0x1.15c28ep-5f,  -0x1.fd70a4p-6f,  -0x1.cf5c26p-6f,
    -0x1.a147aep-6f,  -0x1.733334p-6f,  -0x1.451eb8p-6f,  -0x1.170a3ep-6f,  -0x1.d1eb86p-7f,
    -0x1.75c29p-7f,   -0x1.3e76c8p-7f,  -0x1.2c083p-7f,   -0x1.19999ap-7f,  -0x1.072b02p-7f,
    -0x1.e978d4p-8f,  -0x1.c49ba6p-8f,  -0x1.9fbe76p-8f,  -0x1.7ae148p-8f,  -0x1.56041ap-8f,
    -0x1.3126e8p-8f,  -0x1.0c49bap-8f,  -0x1.ced914p-9f,  -0x1.851eb8p-9f,  -0x1.3b645ap-9f,
    -0x1.e353f8p-10f, -0x1.4fdf3ap-10f, -0x1.eecbfep-11f, -0x1.b3d07cp-11f, -0x1.78d5p-11f,
    -0x1.3dd982p-11f, -0x1.02de02p-11f, -0x1.8fc506p-12f, -0x1.19ce0ap-12f, -0x1.47ae16p-13f,
    -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840cp-16f, -0x1.040bfep-17f,
    -0x1.b43528p-19f, -0x1.27476ep-21f, 0x0p+0f,          0x1.27476ep-21f,  0x1.b43528p-19f,
    0x1.040bfep-17f,  0x1.64840cp-16f,  0x1.6f0068p-15f,  0x1.15df66p-14f,  0x1.743e96p-14f,
    0x1.47ae16p-13f,  0x1.19ce0ap-12f,  0x1.8fc506p-12f,  0x1.02de02p-11f,  0x1.3dd982p-11f,
    0x1.78d5p-11f,    0x1.b3d07cp-11f,  0x1.eecbfep-11f,  0x1.4fdf3ap-10f,  0x1.e353f8p-10f,
    0x1.3b645ap-9f,   0x1.851eb8p-9f,   0x1.ced914p-9f,   0x1.0c49bap-8f,   0x1.3126e8p-8f,
    0x1.56041ap-8f,   0x1.7ae148p-8f,   0x1.9fbe76p-8f,   0x1.c49ba6p-8f,   0x1.e978d4p-8f,
    0x1.072b02p-7f,   0x1.19999ap-7f,   0x1.2c083p-7f,    0x1.3e76c8p-7f,   0x1.75c29p-7f,
    0x1.d1eb86p-7f,   0x1.170a3ep-6f,   0x1.451eb8p-6f,   0x1.733334p-6f,   0x1.a147aep-6f,
    0x1.cf5c26p-6f,   0x1.fd70a4p-6f,   0x1.15c28ep-5f,   0x1.2ccccep-5f,   0x1.43d70ap-5f,
    0x1.5ae146p-5f,   0x1.71eb86p-5f,   0x1.88f5c2p-5f,   0x1.ap-5f,        0x1.b70a3ep-5f,
    0x1.ce147ap-5f,   0x1.e51ebap-5f,   0x1.fc28f4p-5f,   0x1.09999ap-4f,   0x1.151ebap-4f,
    0x1.20a3d6p-4f,   0x1.2c28f6p-4f,   0x1.37ae14p-4f,   0x1.433334p-4f,   0x1.4eb85p-4f,
    0x1.5a3d7p-4f,    0x1.65c29p-4f,    0x1.7147aep-4f,   0x1.7ccccep-4f,   0x1.8851eap-4f,
    0x1.93d70ap-4f,   0x1.b66668p-4f,   0x1.fp-4f,        0x1.14ccccp-3f,   0x1.31999ap-3f,
    0x1.4e6666p-3f,   0x1.6b3332p-3f,   0x1.88p-3f,       0x1.a4ccccp-3f,   0x1.c1999ap-3f,
    0x1.de6668p-3f,   0x1.fb3334p-3f,   0x1.0cp-2f,       0x1.1a6668p-2f,   0x1.28ccccp-2f,
    0x1.373334p-2f,   0x1.459998p-2f,   0x1.54p-2f,       0x1.626664p-2f,   0x1.70ccccp-2f,
    0x1.7f3334p-2f,   0x1.8d9998p-2f,   0x1.9cp-2f,       0x1.aa6664p-2f,   0x1.b8ccccp-2f,
    0x1.c73334p-2f,   0x1.d59998p-2f,   0x1.e4p-2f,       0x1.f26668p-2f,   0x1.006666p-1f,
    0x1.07999ap-1f,   0x1.0eccccp-1f,   0x1.16p-1f,       0x1.1d3334p-1f,   0x1.246668p-1f,
    0x1.2b999ap-1f,   0x1.32ccccp-1f,   0x1.3ap-1f,       0x1.413334p-1f,   0x1.486666p-1f,
    0x1.4f999ap-1f,   0x1.56cccep-1f,   0x1.5ep-1f,       0x1.653334p-1f,   0x1.6c6668p-1f,
    0x1.73999ap-1f,   0x1.7acccep-1f,   0x1.82p-1f,       0x1.893334p-1f,   0x1.906666p-1f,
    0x1.979998p-1f,   0x1.9eccccp-1f,   0x1.a6p-1f,       0x1.ad3332p-1f,   0x1.b46666p-1f,
    0x1.bb9998p-1f,   0x1.c2ccccp-1f,   0x1.cap-1f,       0x1.d13334p-1f,   0x1.d86666p-1f,
    0x1.df9998p-1f,   0x1.e6ccccp-1f,   0x1.eep-1f,       0x1.f53332p-1f,   0x1.fc6666p-1f,
    0x1p+0f,
};

constexpr int64_t kPartAlign = 16;

constexpr int64_t AlignUp(int64_t x) { return CeilDiv(x, kPartAlign) * kPartAlign; }

// dQuantizeNF4 (csrc/kernels.cu): the decision tree of the midpoints between neighbouring NF4
// values, bitsandbytes' fp32 literals; a value on a midpoint takes the lower code, NaN code 0.
// Each literal is rounded once from its decimal, as nvcc rounds bitsandbytes' own (four of these
// decimals are exact fp32 midpoints printed short: float32(double(decimal)) is one ulp off).
uint8_t QuantizeNf4(float x) {
  if (x > 0.03979014977812767f) {
    if (x > 0.3893125355243683f) {
      if (x > 0.6427869200706482f) return x > 0.8614784181118011f ? 0b1111 : 0b1110;
      return x > 0.5016634166240692f ? 0b1101 : 0b1100;
    }
    if (x > 0.2035212516784668f) return x > 0.2920137718319893f ? 0b1011 : 0b1010;
    return x > 0.1202552504837513f ? 0b1001 : 0b1000;
  }
  if (x > -0.33967943489551544f) {
    if (x > -0.13791173323988914f) return x > -0.045525018125772476f ? 0b0111 : 0b0110;
    return x > -0.23460740596055984f ? 0b0101 : 0b0100;
  }
  if (x > -0.6106329262256622f) return x > -0.4599952697753906f ? 0b0011 : 0b0010;
  return x > -0.8480964004993439f ? 0b0001 : 0b0000;
}

// dQuantizeFP4 (csrc/kernels.cu): the sign bit 0b1000 for x < 0 (so -0.0 gets none), then the
// tree of midpoints on |x|, bitsandbytes' fp32 literals (the e2m1 midpoints divided by 12).
uint8_t QuantizeFp4(float x) {
  const uint8_t sign = x < 0.0f ? 0b1000 : 0;
  const float a = std::fabs(x);
  uint8_t magnitude;
  if (a > 0.29166667f) {
    if (a > 0.583333f) {
      magnitude = a > 0.8333333f ? 0b0011 : 0b0010;
    } else {
      magnitude = a > 0.4166667f ? 0b0101 : 0b0100;
    }
  } else if (a > 0.0859375f) {
    magnitude = a > 0.20833333f ? 0b0111 : 0b0110;
  } else {
    magnitude = a > 0.00260417f ? 0b0001 : 0b0000;
  }
  return magnitude + sign;
}

// dQuantize<0> (csrc/kernels.cu) over the ascending dynamic map: a binary search from pivot 127
// in steps 64, 32, ..., 1 (x > value moves up), which leaves the last value visited and the
// values bracketing it (the map's ends when the search never turned); then the neighbour on x's
// side is taken if x is past their fp32 midpoint (strictly), else the value visited.
uint8_t QuantizeDynamic8(float x) {
  const std::array<float, 256>& code = kDynamicMap8;
  int pivot = 127, upper_pivot = 255, lower_pivot = 0;
  float lower = -1.0f, upper = 1.0f;
  float val = code[pivot];
  for (int step = 64; step > 0; step >>= 1) {
    if (x > val) {
      lower_pivot = pivot;
      lower = val;
      pivot += step;
    } else {
      upper_pivot = pivot;
      upper = val;
      pivot -= step;
    }
    val = code[pivot];
  }
  if (upper_pivot == 255) upper = code[upper_pivot];
  if (lower_pivot == 0) lower = code[lower_pivot];
  if (x > val) {
    const float midpoint = quant4::FlushedProduct(upper + val, 0.5f);
    return static_cast<uint8_t>(x > midpoint ? upper_pivot : pivot);
  }
  const float midpoint = quant4::FlushedProduct(lower + val, 0.5f);
  return static_cast<uint8_t>(x < midpoint ? lower_pivot : pivot);
}

// One block of kQuantizeBlockwise / kQuantizeBlockwiseSmall: `count` values of a block of
// `block_size` (a partial last block is padded with zeros, which take part in the maximum and,
// for an odd count, give the last byte's low nibble). absmax = fmaxf over the flushed |x| from
// -FLT_MAX (NaN ignored); scale = 1.0f / absmax (correctly rounded: bitsandbytes' fast-math
// build has rcp.approx here, see quantize_4bit.h), flushed; each value normalized as x * scale
// (flushed). Returns absmax; normalized[0, block_size) receives the normalized values.
float NormalizeBlock(const float* x, int64_t count, int64_t block_size, float* normalized) {
  float absmax = -std::numeric_limits<float>::max();
  for (int64_t i = 0; i < count; ++i) {
    absmax = std::fmax(absmax, quant4::FlushSubnormal(std::fabs(x[i])));
  }
  if (count < block_size) absmax = std::fmax(absmax, 0.0f);
  const float scale = quant4::FlushSubnormal(1.0f / absmax);
  for (int64_t i = 0; i < block_size; ++i) {
    normalized[i] = quant4::FlushedProduct(i < count ? x[i] : 0.0f, scale);
  }
  return absmax;
}

float LoadF32(const std::byte* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void StoreF32(std::byte* p, float v) { std::memcpy(p, &v, sizeof v); }

// The double-quantization offset: the mean of the fp32 absmax values, summed in index order in
// double, divided by their count in double, rounded once to fp32.
float MeanOf(const std::vector<float>& absmax) {
  double sum = 0;
  for (float a : absmax) sum += a;
  return static_cast<float>(sum / static_cast<double>(absmax.size()));
}

}  // namespace

namespace quant4 {

std::array<float, 16> DequantTable(Quant4Type type) {
  std::array<float, 16> table;
  const std::span<const float, 16> map = Quant4Map(type);
  std::copy(map.begin(), map.end(), table.begin());
  if (type == Quant4Type::kFp4) table[8] = -0.0f;
  return table;
}

}  // namespace quant4

std::string_view Quant4TypeName(Quant4Type type) {
  return type == Quant4Type::kNf4 ? "nf4" : "fp4";
}

StatusOr<Quant4Type> ParseQuant4Type(std::string_view name) {
  if (name == "nf4") return Quant4Type::kNf4;
  if (name == "fp4") return Quant4Type::kFp4;
  return InvalidArgumentError("unknown 4-bit quantization type \"" + std::string(name) +
                              "\" (choices: nf4, fp4)");
}

std::span<const float, 16> Quant4Map(Quant4Type type) {
  return type == Quant4Type::kNf4 ? std::span<const float, 16>(kNf4Map)
                                  : std::span<const float, 16>(kFp4Map);
}

std::span<const float, 256> DynamicMap8() { return kDynamicMap8; }

Quant4Layout MakeQuant4Layout(int64_t n, Quant4Params params) {
  STRATA_CHECK_MSG(n >= 1, "MakeQuant4Layout: n = " + std::to_string(n) + ", need n >= 1");
  Quant4Layout l;
  l.n = n;
  l.params = params;
  l.blocks = CeilDiv(n, kQuant4BlockSize);
  l.codes_offset = 0;
  l.codes_bytes = CeilDiv(n, 2);
  l.absmax_offset = AlignUp(l.codes_bytes);
  if (!params.double_quant) {
    l.absmax_bytes = l.blocks * static_cast<int64_t>(sizeof(float));
    l.total_bytes = AlignUp(l.absmax_offset + l.absmax_bytes);
    return l;
  }
  l.nested_blocks = CeilDiv(l.blocks, kQuant4NestedBlockSize);
  l.absmax_bytes = l.blocks;
  l.nested_absmax_offset = AlignUp(l.absmax_offset + l.absmax_bytes);
  l.nested_absmax_bytes = l.nested_blocks * static_cast<int64_t>(sizeof(float));
  l.offset_offset = AlignUp(l.nested_absmax_offset + l.nested_absmax_bytes);
  l.total_bytes = AlignUp(l.offset_offset + static_cast<int64_t>(sizeof(float)));
  return l;
}

void Quantize4bit(const Quant4Layout& layout, const float* x, std::byte* record) {
  STRATA_CHECK(layout.n >= 1);
  const int64_t n = layout.n;
  const bool nf4 = layout.params.type == Quant4Type::kNf4;
  std::memset(record, 0, static_cast<size_t>(layout.total_bytes));
  auto* codes = reinterpret_cast<uint8_t*>(record + layout.codes_offset);

  // The 4-bit codes and each block's fp32 absmax (kept for double quantization).
  std::vector<float> absmax(static_cast<size_t>(layout.blocks));
  ParallelRows(layout.blocks, kQuant4BlockSize, [&](int64_t b0, int64_t b1) {
    float normalized[kQuant4BlockSize];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * kQuant4BlockSize;
      const int64_t count = std::min(kQuant4BlockSize, n - begin);
      absmax[b] = NormalizeBlock(x + begin, count, kQuant4BlockSize, normalized);
      for (int64_t j = 0; j < CeilDiv(count, 2); ++j) {
        const float hi = normalized[2 * j], lo = normalized[2 * j + 1];
        codes[begin / 2 + j] = nf4 ? static_cast<uint8_t>(QuantizeNf4(hi) << 4 | QuantizeNf4(lo))
                                   : static_cast<uint8_t>(QuantizeFp4(hi) << 4 | QuantizeFp4(lo));
      }
    }
  });
  if (!layout.params.double_quant) {
    for (int64_t b = 0; b < layout.blocks; ++b) {
      StoreF32(record + layout.absmax_offset + 4 * b, absmax[b]);
    }
    return;
  }

  // Double quantization: absmax - offset in 8 bits, blockwise (256) on the dynamic map.
  const float offset = MeanOf(absmax);
  StoreF32(record + layout.offset_offset, offset);
  for (float& a : absmax) a -= offset;
  auto* qabsmax = reinterpret_cast<uint8_t*>(record + layout.absmax_offset);
  ParallelRows(layout.nested_blocks, kQuant4NestedBlockSize, [&](int64_t b0, int64_t b1) {
    float normalized[kQuant4NestedBlockSize];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * kQuant4NestedBlockSize;
      const int64_t count = std::min(kQuant4NestedBlockSize, layout.blocks - begin);
      const float nested_absmax =
          NormalizeBlock(absmax.data() + begin, count, kQuant4NestedBlockSize, normalized);
      StoreF32(record + layout.nested_absmax_offset + 4 * b, nested_absmax);
      for (int64_t j = 0; j < count; ++j) qabsmax[begin + j] = QuantizeDynamic8(normalized[j]);
    }
  });
}

template <typename S>
void Dequantize4bit(const Quant4Layout& layout, const std::byte* record, S* out) {
  STRATA_CHECK(layout.n >= 1);
  const int64_t n = layout.n;
  const std::array<float, 16> table = quant4::DequantTable(layout.params.type);
  const auto* codes = reinterpret_cast<const uint8_t*>(record + layout.codes_offset);
  const auto* qabsmax = reinterpret_cast<const uint8_t*>(record + layout.absmax_offset);
  const float offset = layout.params.double_quant ? LoadF32(record + layout.offset_offset) : 0.0f;
  ParallelRows(layout.blocks, kQuant4BlockSize, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float absmax = layout.params.double_quant
                               ? quant4::NestedAbsmax(kDynamicMap8[qabsmax[b]],
                                                      LoadF32(record + layout.nested_absmax_offset +
                                                              4 * (b / kQuant4NestedBlockSize)),
                                                      offset)
                               : LoadF32(record + layout.absmax_offset + 4 * b);
      const int64_t end = std::min(n, (b + 1) * kQuant4BlockSize);
      for (int64_t i = b * kQuant4BlockSize; i < end; ++i) {
        const uint8_t code = i % 2 == 0 ? codes[i / 2] >> 4 : codes[i / 2] & 0x0F;
        out[i] = FromFloat<S>(quant4::RoundToQuantDType(
            quant4::DequantizedValue(table[code], absmax), layout.params.dtype));
      }
    }
  });
}

#define STRATA_INSTANTIATE_DEQUANTIZE_4BIT(S) \
  template void Dequantize4bit<S>(const Quant4Layout&, const std::byte*, S*);
STRATA_INSTANTIATE_DEQUANTIZE_4BIT(float)
STRATA_INSTANTIATE_DEQUANTIZE_4BIT(Bf16)
STRATA_INSTANTIATE_DEQUANTIZE_4BIT(Fp16)
#undef STRATA_INSTANTIATE_DEQUANTIZE_4BIT

#ifndef STRATA_HAVE_CUDA
template <typename S>
Status CudaDequantize4bit(const Quant4Layout&, const std::byte*, S*, gpu::Stream&) {
  return FailedPreconditionError(
      "CudaDequantize4bit: this build has no CUDA backend (built without STRATA_HAVE_CUDA)");
}

#define STRATA_INSTANTIATE_CUDA_DEQUANTIZE_4BIT(S) \
  template Status CudaDequantize4bit<S>(const Quant4Layout&, const std::byte*, S*, gpu::Stream&);
STRATA_INSTANTIATE_CUDA_DEQUANTIZE_4BIT(float)
STRATA_INSTANTIATE_CUDA_DEQUANTIZE_4BIT(Bf16)
STRATA_INSTANTIATE_CUDA_DEQUANTIZE_4BIT(Fp16)
#undef STRATA_INSTANTIATE_CUDA_DEQUANTIZE_4BIT
#endif

}  // namespace strata::models::ops
