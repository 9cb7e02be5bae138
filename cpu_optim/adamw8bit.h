// AdamW / Adam with 8-bit block-wise quantized moments, after Dettmers, Lewis,
// Shleifer & Zettlemoyer, "8-bit Optimizers via Block-wise Quantization", ICLR 2022.
// The moments m (exp_avg) and v (exp_avg_sq) are stored as one byte per element
// plus one fp32 absmax per block of kQuantBlockElems elements: 2 B/param of state
// instead of 8, so an NVMe-resident state moves about 12 B/param per step instead
// of 24. Master weights stay fp32.
//
// ---- The quantization maps (dynamic tree quantization, the paper's section 2.2) ----
// A map is 256 fp32 values in [-1, 1] (signed, for m) or [0, 1] (unsigned, for v),
// sorted ascending; a code is an index into it. The values come from the paper's
// bit layout: [sign] [E zero bits] [indicator bit 1] [F fraction bits], value
// = sign * 10^-E * f(k), where k is the fraction bits read as an integer and
// f(k) = 0.1 + 0.9 * (k + 1) / 2^F spaces the 2^F fractions linearly over
// (0.1, 1] (the upper end of each of 2^F equal bins, so that 1 = 10^0 * f(2^F - 1)
// is in the map and absmax is represented exactly). Computed in fp64, rounded to
// fp32 once, at first use.
//  - signed ("dynamic tree"): sign bit, then 7 bits: E = 0..6, F = 6 - E; 127
//    magnitudes per sign, the all-zero pattern is 0, and the one pattern left (the
//    negative zero) carries +1e-7 (the next level of the tree), so that the 256
//    values are distinct. Contains -1, 0, +1; smallest magnitude 1e-7.
//  - unsigned ("dynamic", the paper's variant for v): the sign bit becomes part of
//    the exponent/fraction: 8 bits, E = 0..7, F = 7 - E: 255 values in [1e-7, 1],
//    and the all-zero pattern is 0.
//
// ---- Quantization (block-wise absmax) ----
// Element i belongs to block i / kQuantBlockElems, counted from the start of the
// buffer (callers pass whole tensors or chunks; the last block may be short).
// absmax[b] = max |x| over the block (fp32; +inf if the block holds an inf; if it
// holds a NaN, the NaN whose bits with the sign cleared are largest), r = 1 / absmax[b]
// (one correctly rounded fp32 division per block), and codes[i] is the map value nearest
// to y = x * r (one fp32 multiplication: no division per element, which would bound the
// update's speed). A block whose absmax is below 2^-64 (or 0) is first scaled by 2^64,
// x and absmax both (exact), so that r stays finite for every nonzero absmax. y carries at
// most two roundings (about 1.2e-7 relative), far below the map's steps. Ties (y exactly
// halfway between two map values) go to the value of smaller magnitude (toward zero). y NaN
// gives the zero code: so an all-zero block (0 * inf) and a non-finite block (r = 0 or NaN)
// hold zero codes only.
// Dequantized x = map[codes[i]] * absmax[b] (one fp32 multiplication). A block that held a
// non-finite value therefore dequantizes to NaN (0 * inf or NaN * ...), as the element of an
// fp32 state would: the caller skips steps with non-finite gradients (GradStats::nonfinite
// of grad_stats.h). Quantization is bit-identical on every ISA variant and thread count: it
// is defined by the fp32 operations above and exact comparisons with the 255 decision
// thresholds (the smallest fp32 values that round up, see DynamicQuantizationMap), whatever
// search implements it.
//
// ---- The update ----
// Per block: dequantize m and v as above; the AdamW / Adam formulas of adamw.h
// (AdamWConfig, decoupled_weight_decay, maximize, bias_correction; amsgrad is not
// supported) in fp32, in that operation order, with the dequantized m, v as the
// old moments; the new master weight and the copy-out are computed from the new
// fp32 m, v (not from their quantized form, as the paper's kernels do); then the
// block's new absmax of m and of v, and m, v re-quantized. Unscaling, maximize and
// the 16-bit copy-out are fused as in every optimizer (optimizer.h).
//
// A known hazard of the method (not of this implementation): v ~ g^2 spans twice
// the decades of g, so an element whose |g| is below about 2e-4 of the largest |g|
// in its block has v / absmax under the map's smallest step and its v quantizes to
// 0 while its m does not; its following updates m / (sqrt(v) + eps) are then too
// large. Blocks whose gradients span more than three or four decades (embeddings,
// as the paper notes) are better kept in fp32 state.
//
// ---- State layout ----
// QuantizedState of num_elems = master.size() elements: codes has num_elems bytes
// and absmax QuantizedAbsmaxCount(num_elems) fp32 values. A fresh state is codes =
// QuantizedZeroCode(is_signed) (127 for m, 0 for v) and absmax = 0, which
// dequantizes to m = v = 0, as AdamW's zero-initialized moments.
//
// ---- Contract ----
// Units, alignment (none required), ownership (the caller's; nothing retained),
// threading (oneTBB in the caller's arena, tiles of whole blocks) and bit-identity
// across ISA variants and thread counts as optimizer.h; AdamW8bitUpdate equals
// AdamW8bitUpdateReference bit for bit (where a result is NaN it is NaN in both).
// Errors (kInvalidArgument, nothing modified): the hyper-parameters AdamWUpdate
// rejects, amsgrad, codes of another size than master, absmax of another count
// than QuantizedAbsmaxCount(num_elems), null pointers with num_elems > 0, unknown
// dtypes, overlapping buffers. kResourceExhausted / kInternal if oneTBB fails.
#pragma once

#include <cstdint>
#include <span>

#include "base/status.h"
#include "cpu_optim/adamw.h"
#include "cpu_optim/optimizer.h"

namespace strata::cpu_optim {

// Values per absmax: the paper's block size for the 8-bit optimizers.
inline constexpr int64_t kQuantBlockElems = 2048;

// One 8-bit block-wise quantized state buffer of num_elems values (a view; the
// caller owns the memory).
struct QuantizedState {
  std::span<uint8_t> codes;  // (num_elems) uint8, indices into the map
  std::span<float> absmax;   // (QuantizedAbsmaxCount(num_elems)) fp32, per block
};

// The read-only view of a QuantizedState.
struct ConstQuantizedState {
  ConstQuantizedState() = default;
  ConstQuantizedState(std::span<const uint8_t> codes_in, std::span<const float> absmax_in)
      : codes(codes_in), absmax(absmax_in) {}
  ConstQuantizedState(QuantizedState s)  // NOLINT(google-explicit-constructor)
      : codes(s.codes), absmax(s.absmax) {}
  std::span<const uint8_t> codes;
  std::span<const float> absmax;
};

// ceil(num_elems / kQuantBlockElems); 0 for num_elems <= 0.
int64_t QuantizedAbsmaxCount(int64_t num_elems);

// The code of the map's exact 0, where every element starts: 127 (signed, m) or 0
// (unsigned, v). absmax starts at 0.
uint8_t QuantizedZeroCode(bool is_signed);

// The 256 map values, ascending (see the file comment). Valid for the life of the
// program; thread-safe.
std::span<const float> DynamicQuantizationMap(bool is_signed);

// The 255 decision thresholds of a map: code(y) = the number of j with y >=
// thresholds[j] (y not NaN). thresholds[j] is the smallest fp32 value nearer to
// map[j + 1] than to map[j], ties toward zero. For tests and documentation.
std::span<const float> QuantizationThresholds(bool is_signed);

// state -> fp32: out[i] = map[codes[i]] * absmax[i / kQuantBlockElems]; num_elems =
// out.size(). kInvalidArgument for sizes that do not match (nothing written).
Status DequantizeBlockwise(ConstQuantizedState state, bool is_signed, std::span<float> out);

// fp32 -> state: absmax per block and the nearest codes, as the update re-quantizes
// (bit for bit); num_elems = in.size(). The unsigned map quantizes negative values
// to 0. kInvalidArgument for sizes that do not
// match or overlapping buffers (nothing written).
Status QuantizeBlockwise(std::span<const float> in, bool is_signed, QuantizedState out);

// One AdamW / Adam step on fp32 master weights with 8-bit block-wise m (signed map)
// and v (unsigned map), in place; writes copy_out when given. See the file comment.
Status AdamW8bitUpdate(const AdamWConfig& config, const OptimStep& step, std::span<float> master,
                       QuantizedState m, QuantizedState v, GradView grad, CopyOut copy_out = {});

// The scalar reference: one element at a time on the calling thread, the nearest
// code found by binary search over the thresholds, conversions by base/dtype.h.
// Same contract and errors; slow.
Status AdamW8bitUpdateReference(const AdamWConfig& config, const OptimStep& step,
                                std::span<float> master, QuantizedState m, QuantizedState v,
                                GradView grad, CopyOut copy_out = {});

}  // namespace strata::cpu_optim
