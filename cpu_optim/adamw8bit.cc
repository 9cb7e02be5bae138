// The dynamic (tree) quantization maps and their lookup tables, argument checks, and
// the public 8-bit AdamW and block-wise (de)quantization entry points.
#include "cpu_optim/adamw8bit.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <vector>

#include "cpu_optim/kernels.h"
#include "cpu_optim/parallel.h"

namespace strata::cpu_optim {
namespace internal {
namespace {

// Tiles of the threaded loops: whole quantization blocks.
static_assert(kOptimTileElems % kQuantBlockElems == 0);

// One map with everything derived from it.
struct MapTables {
  std::array<float, 256> values{};
  std::array<float, 255> thresholds{};
  std::vector<uint32_t> buckets;
  uint8_t zero_code = 0;
  Quant8Map view{};
};

// 10^-e in fp64 (e = 0..7).
constexpr double kPow10[] = {1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7};

// The map's magnitudes per exponent run E: 10^-E * (0.1 + 0.9 * (k + 1) / 2^F) for the
// F = fraction_bits - E fraction bits, E = 0..fraction_bits (adamw8bit.h).
void AppendTree(int fraction_bits, double sign, std::vector<float>* out) {
  for (int e = 0; e <= fraction_bits; ++e) {
    const int f = fraction_bits - e;
    const double bins = std::ldexp(1.0, f);
    for (int k = 0; k < (1 << f); ++k) {
      const double fraction = 0.1 + 0.9 * (static_cast<double>(k) + 1.0) / bins;
      out->push_back(static_cast<float>(sign * kPow10[e] * fraction));
    }
  }
}

// The smallest float that is nearer to b than to a (a < b adjacent map values),
// ties toward zero: for a positive midpoint, the smallest float above it; for a
// negative one, the smallest float at or above it.
float Threshold(float a, float b) {
  const double mid = (static_cast<double>(a) + static_cast<double>(b)) / 2.0;  // exact
  float t = static_cast<float>(mid);
  if (mid > 0.0 ? static_cast<double>(t) <= mid : static_cast<double>(t) < mid) {
    t = std::nextafter(t, 2.0f);
  }
  return t;
}

// code(y) by the thresholds: the number of thresholds <= y (NaN: zero_code).
uint8_t SearchCode(const MapTables& t, float y) {
  if (std::isnan(y)) return t.zero_code;
  return static_cast<uint8_t>(std::upper_bound(t.thresholds.begin(), t.thresholds.end(), y) -
                              t.thresholds.begin());
}

template <bool kSigned>
void BuildBuckets(MapTables* t) {
  using L = Quant8Layout<kSigned>;
  constexpr uint32_t kLowCount = 1u << L::kShift;
  t->buckets.assign(L::kNumBuckets, 0);
  for (uint32_t s = 0; s < 2; ++s) {
    for (uint32_t key = L::kLo; key <= L::kHi; ++key) {
      // The bucket's magnitudes [first, last]; y = +-magnitude.
      const uint32_t first = key << L::kShift, last = first + kLowCount - 1;
      const float sign = s ? -1.0f : 1.0f;
      const float y_low = sign * std::bit_cast<float>(s ? last : first);
      const float y_high = sign * std::bit_cast<float>(s ? first : last);
      const uint8_t code = SearchCode(*t, y_low);
      STRATA_CHECK(SearchCode(*t, y_high) - code <= 1);  // at most one threshold inside
      uint32_t thr = s ? 0u : kLowCount;                 // never up
      if (code < 255) {
        const uint32_t tb = std::bit_cast<uint32_t>(t->thresholds[code]) & 0x7fffffffu;
        if ((tb >> L::kShift) == key && (t->thresholds[code] < 0.0f) == (s == 1)) {
          const uint32_t low = tb & (kLowCount - 1);
          // Up when y >= threshold: low >= low(T) for y > 0; for y < 0, |y| <= |T|,
          // i.e. not (low >= low(|T|) + 1).
          thr = s ? low + 1 : low;
        }
      }
      t->buckets[(key - L::kLo) + s * L::kPerSign] = code | (thr << 8);
    }
  }
  // The lowest bucket holds no threshold, so that clamping tiny values to it is exact.
  const float lowest_last = std::bit_cast<float>(((L::kLo + 1) << L::kShift) - 1);
  STRATA_CHECK(SearchCode(*t, lowest_last) == t->zero_code);
  STRATA_CHECK(SearchCode(*t, -lowest_last) == t->zero_code);
}

MapTables BuildMap(bool is_signed) {
  std::vector<float> v = {0.0f};
  if (is_signed) {
    AppendTree(6, 1.0, &v);
    AppendTree(6, -1.0, &v);
    v.push_back(1e-7f);  // the negative-zero pattern (adamw8bit.h)
  } else {
    AppendTree(7, 1.0, &v);
  }
  STRATA_CHECK(v.size() == 256);
  std::sort(v.begin(), v.end());
  STRATA_CHECK(std::adjacent_find(v.begin(), v.end()) == v.end());
  MapTables t;
  std::copy(v.begin(), v.end(), t.values.begin());
  t.zero_code = static_cast<uint8_t>(std::find(v.begin(), v.end(), 0.0f) - v.begin());
  for (int j = 0; j < 255; ++j) t.thresholds[j] = Threshold(t.values[j], t.values[j + 1]);
  if (is_signed) {
    BuildBuckets<true>(&t);
  } else {
    BuildBuckets<false>(&t);
  }
  return t;
}

const MapTables& Tables(bool is_signed) {
  static const MapTables* const kSigned = [] {
    auto* t = new MapTables(BuildMap(true));
    t->view = {t->values.data(), t->buckets.data()};
    return t;
  }();
  static const MapTables* const kUnsigned = [] {
    auto* t = new MapTables(BuildMap(false));
    t->view = {t->values.data(), t->buckets.data()};
    return t;
  }();
  return is_signed ? *kSigned : *kUnsigned;
}

Status CheckState(const char* name, int64_t n, std::span<const uint8_t> codes,
                  std::span<const float> absmax) {
  if (static_cast<int64_t>(codes.size()) != n) {
    return InvalidArgumentError(
        fmt::format("AdamW8bit: {} has {} codes but master has {} elements; one code per element",
                    name, codes.size(), n));
  }
  const int64_t blocks = QuantizedAbsmaxCount(n);
  if (static_cast<int64_t>(absmax.size()) != blocks) {
    return InvalidArgumentError(fmt::format(
        "AdamW8bit: {} has {} absmax values but {} elements need {} (one per {} elements)", name,
        absmax.size(), n, blocks, kQuantBlockElems));
  }
  if (n > 0 && (codes.data() == nullptr || absmax.data() == nullptr)) {
    return InvalidArgumentError(
        fmt::format("AdamW8bit: null {} pointer with num_elems {}", name, n));
  }
  return Status::Ok();
}

struct Range {
  const void* p;
  size_t size_bytes;
  const char* name;
};

Status CheckDisjoint(std::string_view what, std::span<const Range> ranges) {
  for (size_t i = 0; i < ranges.size(); ++i) {
    for (size_t j = i + 1; j < ranges.size(); ++j) {
      if (Overlaps(ranges[i].p, ranges[i].size_bytes, ranges[j].p, ranges[j].size_bytes)) {
        return InvalidArgumentError(
            fmt::format("{}: buffers {} and {} overlap", what, ranges[i].name, ranges[j].name));
      }
    }
  }
  return Status::Ok();
}

}  // namespace

const Quant8Map& GetQuant8Map(bool is_signed) { return Tables(is_signed).view; }

Status ValidateAdamW8bit(const AdamWConfig& config, const OptimStep& step, std::span<float> master,
                         QuantizedState m, QuantizedState v, GradView grad, CopyOut copy_out) {
  STRATA_RETURN_IF_ERROR(ValidateAdamWParams(config, step, "AdamW8bit"));
  if (config.amsgrad) {
    return InvalidArgumentError(
        "AdamW8bit: amsgrad is not supported with 8-bit state (AdamW keeps it)");
  }
  const auto n = static_cast<int64_t>(master.size());
  STRATA_RETURN_IF_ERROR(CheckState("m", n, m.codes, m.absmax));
  STRATA_RETURN_IF_ERROR(CheckState("v", n, v.codes, v.absmax));
  // Sizes, dtypes, null master/grad and overlaps of master, grad and copy-out.
  STRATA_RETURN_IF_ERROR(ValidateBuffers("AdamW8bit", master, {}, grad, copy_out));
  if (n == 0) return Status::Ok();
  const Range ranges[] = {
      {master.data(), master.size_bytes(), "master"},
      {m.codes.data(), m.codes.size_bytes(), "m codes"},
      {m.absmax.data(), m.absmax.size_bytes(), "m absmax"},
      {v.codes.data(), v.codes.size_bytes(), "v codes"},
      {v.absmax.data(), v.absmax.size_bytes(), "v absmax"},
      {grad.data, master.size() * SizeOf(grad.dtype), "grad"},
      {copy_out.data, copy_out.data ? master.size() * SizeOf(copy_out.dtype) : 0, "copy_out"}};
  return CheckDisjoint("AdamW8bit", ranges);
}

Status AdamW8bitUpdateWith(const KernelTable& kernels, const AdamWConfig& config,
                           const OptimStep& step, std::span<float> master, QuantizedState m,
                           QuantizedState v, GradView grad, CopyOut copy_out) {
  STRATA_RETURN_IF_ERROR(ValidateAdamW8bit(config, step, master, m, v, grad, copy_out));
  const AdamWScalars s = PrepareAdamW(config, step);
  const AdamW8bitBuffers b{.master = master.data(),
                           .m_codes = m.codes.data(),
                           .m_absmax = m.absmax.data(),
                           .v_codes = v.codes.data(),
                           .v_absmax = v.absmax.data(),
                           .grad = grad.data,
                           .grad_dtype = grad.dtype,
                           .out = copy_out.data,
                           .out_dtype = copy_out.dtype,
                           .m_map = GetQuant8Map(true),
                           .v_map = GetQuant8Map(false)};
  return ParallelForTiles(static_cast<int64_t>(master.size()), kOptimTileElems,
                          [&](int64_t begin, int64_t end) { kernels.adamw8bit(s, b, begin, end); });
}

Status QuantizeBlockwiseWith(const KernelTable& kernels, std::span<const float> in, bool is_signed,
                             QuantizedState out) {
  const auto n = static_cast<int64_t>(in.size());
  STRATA_RETURN_IF_ERROR(CheckState("quantized state", n, out.codes, out.absmax));
  if (n == 0) return Status::Ok();
  if (in.data() == nullptr) return InvalidArgumentError("QuantizeBlockwise: null input");
  const Range ranges[] = {{in.data(), in.size_bytes(), "input"},
                          {out.codes.data(), out.codes.size_bytes(), "codes"},
                          {out.absmax.data(), out.absmax.size_bytes(), "absmax"}};
  STRATA_RETURN_IF_ERROR(CheckDisjoint("QuantizeBlockwise", ranges));
  const Quant8Map& map = GetQuant8Map(is_signed);
  return ParallelForTiles(n, kOptimTileElems, [&](int64_t begin, int64_t end) {
    kernels.quantize8(map, is_signed, in.data(), out.codes.data(), out.absmax.data(), begin, end);
  });
}

Status DequantizeBlockwiseWith(const KernelTable& kernels, ConstQuantizedState state,
                               bool is_signed, std::span<float> out) {
  const auto n = static_cast<int64_t>(out.size());
  STRATA_RETURN_IF_ERROR(CheckState("quantized state", n, state.codes, state.absmax));
  if (n == 0) return Status::Ok();
  if (out.data() == nullptr) return InvalidArgumentError("DequantizeBlockwise: null output");
  const Range ranges[] = {{out.data(), out.size_bytes(), "output"},
                          {state.codes.data(), state.codes.size_bytes(), "codes"},
                          {state.absmax.data(), state.absmax.size_bytes(), "absmax"}};
  STRATA_RETURN_IF_ERROR(CheckDisjoint("DequantizeBlockwise", ranges));
  const Quant8Map& map = GetQuant8Map(is_signed);
  return ParallelForTiles(n, kOptimTileElems, [&](int64_t begin, int64_t end) {
    kernels.dequantize8(map, state.codes.data(), state.absmax.data(), out.data(), begin, end);
  });
}

uint8_t SearchQuant8Code(bool is_signed, float y) { return SearchCode(Tables(is_signed), y); }

}  // namespace internal

int64_t QuantizedAbsmaxCount(int64_t num_elems) {
  return num_elems <= 0 ? 0 : (num_elems + kQuantBlockElems - 1) / kQuantBlockElems;
}

uint8_t QuantizedZeroCode(bool is_signed) { return internal::Tables(is_signed).zero_code; }

std::span<const float> DynamicQuantizationMap(bool is_signed) {
  return internal::Tables(is_signed).values;
}

std::span<const float> QuantizationThresholds(bool is_signed) {
  return internal::Tables(is_signed).thresholds;
}

Status DequantizeBlockwise(ConstQuantizedState state, bool is_signed, std::span<float> out) {
  return internal::DequantizeBlockwiseWith(internal::BestKernelTable(), state, is_signed, out);
}

Status QuantizeBlockwise(std::span<const float> in, bool is_signed, QuantizedState out) {
  return internal::QuantizeBlockwiseWith(internal::BestKernelTable(), in, is_signed, out);
}

Status AdamW8bitUpdate(const AdamWConfig& config, const OptimStep& step, std::span<float> master,
                       QuantizedState m, QuantizedState v, GradView grad, CopyOut copy_out) {
  return internal::AdamW8bitUpdateWith(internal::BestKernelTable(), config, step, master, m, v,
                                       grad, copy_out);
}

}  // namespace strata::cpu_optim
