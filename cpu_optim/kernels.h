// Internal to cpu_optim: the per-ISA kernel table and the fixed partitions that make
// results independent of threading. Not part of the public API; tests and
// benchmarks include it to pin a variant and compare variants with each other.
//
// Each ISA variant (kernels_generic.cc, kernels_avx2.cc, kernels_avx512.cc) compiles
// the same loop bodies (kernels_impl.inc) with its own target flags, and is chosen
// at run time by CPUID, after ggml-org/ggml src/ggml-cpu. The loops use only
// correctly rounded IEEE operations (+ - * / sqrt, no FMA contraction: the library
// is built with -ffp-contract=off) in a fixed order, and every reduction has a fixed
// lane count, so all variants and the scalar reference give the same bits.
//
// The kernels assume the default floating-point environment (round to nearest);
// the fp16/bf16 conversions give the same bits with or without FTZ/DAZ.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#if defined(__AVX512F__)
// The avx512 variant's explicit vector code in kernels_impl.inc (the 8-bit map lookups).
// The intrinsics are always-inline (GCC: gnu_inline, clang: static), so no out-of-line
// AVX-512 copy can reach another variant.
#include <immintrin.h>
#endif

#include "base/dtype.h"
#include "base/status.h"
#include "cpu_optim/adafactor_kernels.h"
#include "cpu_optim/adagrad.h"
#include "cpu_optim/adamw.h"
#include "cpu_optim/adamw8bit.h"
#include "cpu_optim/grad_stats.h"
#include "cpu_optim/lion.h"
#include "cpu_optim/sgd.h"

namespace strata::cpu_optim::internal {

// Every optimizer runs over tiles of this many elements, one oneTBB task each at most.
inline constexpr int64_t kAdamWTileElems = 16384;
inline constexpr int64_t kOptimTileElems = kAdamWTileElems;
// Gradient statistics, in this fixed order of fp64 additions (so sum_squares is
// bit-identical for any thread count, tile size and ISA variant):
//  - chunk c covers elements [c * kStatsChunkElems, (c + 1) * kStatsChunkElems);
//    element i of a chunk is added to lane i % kStatsLanes, in index order, each
//    lane starting at 0; the lanes are combined as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7));
//  - leaf l covers kStatsChunksPerLeaf chunks: 0.0 + chunk0 + chunk1 + ... in order;
//  - the leaves are combined pairwise: sum(first, last) = sum(first, mid) +
//    sum(mid, last), mid = first + (last - first) / 2 (PairwiseLeafSum).
inline constexpr int64_t kStatsChunkElems = 4096;
inline constexpr int64_t kStatsLanes = 8;
inline constexpr int64_t kStatsChunksPerLeaf = 16;
inline constexpr int64_t kStatsLeafElems = kStatsChunkElems * kStatsChunksPerLeaf;
// Plain conversions run over tiles of this many elements.
inline constexpr int64_t kConvertTileElems = 65536;

enum class WeightDecayMode : uint8_t { kNone, kL2, kDecoupled };

// Per-call constants, derived from AdamWConfig/OptimStep in fp64 and rounded to
// fp32 once (as PyTorch computes them in Python floats).
struct AdamWScalars {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float weight_decay;           // kL2: g += weight_decay * p
  float decay;                  // kDecoupled: p *= 1 - lr * weight_decay
  float step_size;              // lr / (1 - beta1^t), or lr
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t), or 1
  float grad_scale;             // negated when maximize
  // torch's lerp(m, g, w), w = one_minus_beta1: lerp_small (w < 0.5) picks
  // m + w * (g - m), else g - (g - m) * lerp_one_minus_w (= 1 - w in fp32).
  bool lerp_small;
  float lerp_one_minus_w;
  WeightDecayMode weight_decay_mode;
  bool amsgrad;
};

// Base pointers of one AdamW call; kernels index them with [begin, end).
struct AdamWBuffers {
  float* master;
  float* m;
  float* v;
  const void* grad;
  DType grad_dtype;
  void* out;  // nullptr: no copy-out
  DType out_dtype;
  float* max_v = nullptr;  // amsgrad's max_exp_avg_sq; nullptr unless amsgrad
};

// Per-call constants of Adagrad, Lion and SGD (fp64 from the config, rounded once).
struct AdagradScalars {
  float clr;  // lr / (1 + (t - 1) * lr_decay)
  float weight_decay;
  float eps;
  float grad_scale;  // negated when maximize
  bool has_weight_decay;
};

struct LionScalars {
  float lr;
  float decay;  // 1 - lr * weight_decay
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float grad_scale;  // negated when maximize
  bool has_weight_decay;
};

enum class SgdMomentumMode : uint8_t {
  kNone,    // momentum == 0: no buffer
  kInit,    // step 1: buf = g
  kUpdate,  // buf = momentum * buf + (1 - dampening) * g
};

struct SgdScalars {
  float lr;
  float momentum;
  float one_minus_dampening;
  float weight_decay;
  float grad_scale;  // negated when maximize
  bool has_weight_decay;
  bool nesterov;
  SgdMomentumMode momentum_mode;
};

// Base pointers of one Adagrad, Lion or SGD call (one fp32 state buffer each).
struct StateBuffers {
  float* master;
  float* state;  // state_sum, exp_avg or momentum_buffer (nullptr: SGD without momentum)
  const void* grad;
  DType grad_dtype;
  void* out;  // nullptr: no copy-out
  DType out_dtype;
};

// ---- 8-bit block-wise quantization (adamw8bit.h) ----
// The fast quantizer looks the code of y = x * (1 / absmax) up by y's bits u: s = u >> 31,
// a = u & 0x7fffffff (0 when NaN), key = clamp(a >> kShift, kLo, kHi) - kLo (the binade
// and top kMantBits mantissa bits: every bucket holds at most one decision
// threshold), e = buckets[s * kPerSign + key]; then code = (e & 0xff) + ((a's low
// kShift bits >= e >> 8) ^ s): the code at the bucket's lowest y, plus one where y
// is past the bucket's threshold. Built and verified against the thresholds by
// adamw8bit.cc. Buckets below kLo hold no threshold (everything there is the zero
// code); kHi is the bucket of 1.0. The unsigned map has a negative half too (all
// code 0, never touched by v >= 0): the same index arithmetic for both maps keeps
// the lookup a 32-bit-index gather.
template <bool kSigned>
struct Quant8Layout {
  static constexpr int kMantBits = kSigned ? 6 : 7;
  static constexpr int kShift = 23 - kMantBits;
  static constexpr uint32_t kLo = 102u << kMantBits;  // 2^-25
  static constexpr uint32_t kHi = 127u << kMantBits;  // 1.0
  static constexpr uint32_t kPerSign = kHi - kLo + 1;
  static constexpr uint32_t kNumBuckets = 2 * kPerSign;
};

// One quantization map and its lookup tables (static storage, built once).
struct Quant8Map {
  const float* values;      // (256) ascending
  const uint32_t* buckets;  // (Quant8Layout<signed>::kNumBuckets)
};

// Base pointers of one 8-bit AdamW call; kernels index them with [begin, end),
// begin a multiple of kQuantBlockElems; absmax index = element / kQuantBlockElems.
struct AdamW8bitBuffers {
  float* master;
  uint8_t* m_codes;
  float* m_absmax;
  uint8_t* v_codes;
  float* v_absmax;
  const void* grad;
  DType grad_dtype;
  void* out;  // nullptr: no copy-out
  DType out_dtype;
  Quant8Map m_map;  // signed
  Quant8Map v_map;  // unsigned
};

// One ISA variant. Ranges are element indices [begin, end) into the base pointers.
struct KernelTable {
  const char* name;
  void (*adamw)(const AdamWScalars& s, const AdamWBuffers& b, int64_t begin, int64_t end);
  void (*adagrad)(const AdagradScalars& s, const StateBuffers& b, int64_t begin, int64_t end);
  void (*lion)(const LionScalars& s, const StateBuffers& b, int64_t begin, int64_t end);
  void (*sgd)(const SgdScalars& s, const StateBuffers& b, int64_t begin, int64_t end);
  // Sum over [begin, end) of (scale * grad)^2 in fp64: chunks in order, each in
  // kStatsLanes lanes. begin is a multiple of kStatsChunkElems.
  double (*sum_squares)(const void* grad, DType dtype, double scale, int64_t begin, int64_t end);
  // accum[i] = (overwrite ? float(grad[i]) : accum[i] + float(grad[i])); returns the
  // sum of squares of the results as sum_squares does when want_stats, else 0.
  double (*accumulate)(float* accum, const void* grad, DType dtype, bool overwrite, bool want_stats,
                       int64_t begin, int64_t end);
  void (*from_f32)(const float* src, void* dst, DType dst_dtype, int64_t begin, int64_t end);
  void (*to_f32)(const void* src, DType src_dtype, float* dst, int64_t begin, int64_t end);
  // Benchmark roofline, not an optimizer: reads and writes the bytes adamw does
  // (p, m, v, grad -> p, m, v, out) with bit moves only, compiled for the same ISA.
  // Scrambles the buffers (rotates p <- m <- v <- p). b.out must be set.
  void (*adamw_traffic)(const AdamWBuffers& b, int64_t begin, int64_t end);
  // Adafactor (adafactor.h; summation order in adafactor_kernels.h), u = g * g + eps1.
  // Factored, one tile t: row_sums[i - t.row_begin] and col_sums[j - t.col_begin] are
  // the tile's partial sums of u over row i and column j.
  void (*adafactor_sums)(const AdafactorScalars& s, const AdafactorBuffers& b,
                         const AdafactorTile& t, double* row_sums, double* col_sums);
  // Factored: the tile's sum of update^2, update = (row_factor[i] * col_factor[j]) * g.
  double (*adafactor_update_sq)(const AdafactorScalars& s, const AdafactorBuffers& b,
                                const AdafactorTile& t);
  // Factored: p (and exp_avg) from update * step_size; copy-out.
  void (*adafactor_apply)(const AdafactorScalars& s, const AdafactorBuffers& b,
                          const AdafactorTile& t);
  // Not factored, [begin, end) with begin a multiple of kStatsChunkElems: updates
  // exp_avg_sq in place and returns the sum of (rsqrt(V) * g)^2 (adafactor_kernels.h).
  double (*adafactor_vector_sq)(const AdafactorScalars& s, const AdafactorBuffers& b, int64_t begin,
                                int64_t end);
  // Not factored: p (and exp_avg) from rsqrt(V) * g * step_size; copy-out.
  void (*adafactor_vector_apply)(const AdafactorScalars& s, const AdafactorBuffers& b,
                                 int64_t begin, int64_t end);
  // 8-bit block-wise AdamW (adamw8bit.h); begin is a multiple of kQuantBlockElems.
  void (*adamw8bit)(const AdamWScalars& s, const AdamW8bitBuffers& b, int64_t begin, int64_t end);
  // Block-wise quantization of in[begin, end) into codes and absmax (indices as
  // AdamW8bitBuffers), and its inverse; begin is a multiple of kQuantBlockElems.
  void (*quantize8)(const Quant8Map& map, bool is_signed, const float* in, uint8_t* codes,
                    float* absmax, int64_t begin, int64_t end);
  void (*dequantize8)(const Quant8Map& map, const uint8_t* codes, const float* absmax, float* out,
                      int64_t begin, int64_t end);
  // Benchmark roofline of adamw8bit: its bytes (p, m and v codes and absmax, grad ->
  // p, codes, absmax, out) with bit moves only. Scrambles the buffers. b.out must be set.
  void (*adamw8bit_traffic)(const AdamW8bitBuffers& b, int64_t begin, int64_t end);
};

// Every variant this CPU can run, best first; always ends with the generic one.
std::span<const KernelTable* const> SupportedKernelTables();
const KernelTable& BestKernelTable();
// nullptr when the name is unknown or the CPU cannot run it.
const KernelTable* FindKernelTable(std::string_view name);

bool IsValidDType(DType dtype);
// kInvalidArgument for hyper-parameters PyTorch rejects (negative lr, eps or
// weight_decay; betas outside [0, 1)), non-finite values, step < 1; the messages start with
// `optimizer`'s name.
Status ValidateAdamWParams(const AdamWConfig& config, const OptimStep& step,
                           std::string_view optimizer = "AdamW");
// A state buffer and its name for error messages.
struct NamedState {
  std::span<float> data;
  const char* name;
};
// Null pointers, size mismatch, unknown dtypes, overlapping buffers; `optimizer`
// prefixes the messages.
Status ValidateBuffers(std::string_view optimizer, std::span<float> master,
                       std::span<const NamedState> states, GradView grad, CopyOut copy_out);
Status ValidateAdamWBuffers(const AdamWConfig& config, std::span<float> master, std::span<float> m,
                            std::span<float> v, std::span<float> max_exp_avg_sq, GradView grad,
                            CopyOut copy_out);
AdamWScalars PrepareAdamW(const AdamWConfig& config, const OptimStep& step);

Status ValidateAdagradParams(const AdagradConfig& config, const OptimStep& step);
AdagradScalars PrepareAdagrad(const AdagradConfig& config, const OptimStep& step);
Status ValidateLionParams(const LionConfig& config, const OptimStep& step);
LionScalars PrepareLion(const LionConfig& config, const OptimStep& step);
Status ValidateSgdParams(const SgdConfig& config, const OptimStep& step);
SgdScalars PrepareSgd(const SgdConfig& config, const OptimStep& step);

// base/dtype.h conversions for the scalar references.
float ReferenceLoad(GradView grad, size_t i);
void ReferenceStore(CopyOut out, size_t i, float p);

// The public functions with a given variant instead of the best one.
Status AdamWUpdateWith(const KernelTable& kernels, const AdamWConfig& config, const OptimStep& step,
                       std::span<float> master, std::span<float> m, std::span<float> v,
                       GradView grad, CopyOut copy_out = {}, std::span<float> max_exp_avg_sq = {});
Status AdagradUpdateWith(const KernelTable& kernels, const AdagradConfig& config,
                         const OptimStep& step, std::span<float> master, std::span<float> state_sum,
                         GradView grad, CopyOut copy_out = {});
Status LionUpdateWith(const KernelTable& kernels, const LionConfig& config, const OptimStep& step,
                      std::span<float> master, std::span<float> exp_avg, GradView grad,
                      CopyOut copy_out = {});
Status SgdUpdateWith(const KernelTable& kernels, const SgdConfig& config, const OptimStep& step,
                     std::span<float> master, std::span<float> momentum_buffer, GradView grad,
                     CopyOut copy_out = {});
Status AdamW8bitUpdateWith(const KernelTable& kernels, const AdamWConfig& config,
                           const OptimStep& step, std::span<float> master, QuantizedState m,
                           QuantizedState v, GradView grad, CopyOut copy_out = {});
Status QuantizeBlockwiseWith(const KernelTable& kernels, std::span<const float> in, bool is_signed,
                             QuantizedState out);
Status DequantizeBlockwiseWith(const KernelTable& kernels, ConstQuantizedState state,
                               bool is_signed, std::span<float> out);
// The tables of the signed (m) or unsigned (v) map.
const Quant8Map& GetQuant8Map(bool is_signed);
// The argument checks of AdamW8bitUpdate (adamw8bit.h).
Status ValidateAdamW8bit(const AdamWConfig& config, const OptimStep& step, std::span<float> master,
                         QuantizedState m, QuantizedState v, GradView grad, CopyOut copy_out);
// The nearest code of y by binary search over the map's thresholds (the scalar
// reference of the bucket lookup).
uint8_t SearchQuant8Code(bool is_signed, float y);
StatusOr<GradStats> ComputeGradStatsWith(const KernelTable& kernels, GradView grad,
                                         int64_t num_elems, float scale = 1.0f);
StatusOr<GradStats> CopyGradWithStatsWith(const KernelTable& kernels, GradView grad, void* dst,
                                          int64_t num_elems);
StatusOr<GradStats> AccumulateGradWith(const KernelTable& kernels, std::span<float> accum,
                                       GradView grad, bool overwrite, bool want_stats);
Status ConvertFromF32With(const KernelTable& kernels, const float* src, void* dst, DType dst_dtype,
                          int64_t num_elems);
Status ConvertToF32With(const KernelTable& kernels, const void* src, DType src_dtype, float* dst,
                        int64_t num_elems);
Status AdafactorUpdateWith(const KernelTable& kernels, const AdafactorConfig& config,
                           const OptimStep& step, std::span<const int64_t> shape,
                           std::span<float> master, const AdafactorState& state, GradView grad,
                           CopyOut copy_out = {});

// True when [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes);

}  // namespace strata::cpu_optim::internal
