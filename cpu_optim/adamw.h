// CPU AdamW / Adam over fp32 master weights, as in ZeRO-Offload: fp16/bf16 (or
// fp32) gradients land in host memory and update fp32 master weights and moments,
// optionally writing the new weights back as fp16/bf16 for the next forward pass.
//
// Adam: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015.
// AdamW: Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
//
// Formulas as torch.optim.AdamW (decoupled_weight_decay) and torch.optim.Adam
// (L2), per element i, in fp32, in exactly this order (t = AdamWStep::step):
//
//   g = float(grad[i]) * grad_scale
//   Adam (L2), weight_decay != 0:     g = g + weight_decay * p
//   AdamW,     weight_decay != 0:     p = p * (1 - lr * weight_decay)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + ((1 - beta2) * g) * g
//   denom = sqrt(v) / sqrt(1 - beta2^t) + eps            (bias_correction)
//           sqrt(v) / 1 + eps                            (no bias_correction)
//   p = p - ((lr / (1 - beta1^t)) * m) / denom           (lr without bias_correction)
//   copy_out[i] = dtype(p)        (round to nearest even, NaN kept, as base/dtype.h)
//
// The per-call scalars (1 - beta1, 1 - beta2, 1 - lr * weight_decay,
// lr / (1 - beta1^t), sqrt(1 - beta2^t)) are computed in fp64 and rounded to fp32
// once, as PyTorch computes them in Python floats. The results equal PyTorch's in
// exact arithmetic, not bit for bit (PyTorch writes m as a lerp and may use FMA).
//
// Units: every length is num_elems (elements, not bytes); master, m, v and the
// gradient have master.size() elements. Alignment: none required (aligned buffers
// are faster). Ownership: the caller owns every buffer; nothing is retained after
// the call returns. No buffers are allocated (oneTBB allocates its task objects).
//
// Threading: the work runs on the calling thread and oneTBB workers (in the
// caller's task_arena, so tbb::task_arena / tbb::global_control bound it), in tiles
// of a fixed size; each element is computed independently, so the results are
// bit-identical whatever the thread count and tile size, and equal to
// AdamWUpdateReference bit for bit on every ISA variant (where a result is NaN it
// is NaN in both; when two NaN operands meet, which payload x86 keeps depends on
// the operand order the compiler chose). Different buffers may be updated concurrently
// from several threads; buffers of one call must not be touched by others until it
// returns.
//
// Errors (nothing is modified): kInvalidArgument when master, m and v differ in
// size, a pointer is null while num_elems > 0, a dtype is unknown, the buffers
// overlap, step < 1, grad_scale is not finite, or a hyper-parameter is one that
// PyTorch rejects (lr, eps or weight_decay negative or not finite, betas outside
// [0, 1)). kResourceExhausted / kInternal if oneTBB fails to run the tasks (the
// buffers may then be partly updated). Non-finite gradients are not an error: the
// caller checks GradStats::nonfinite first (a NaN gradient makes NaN weights).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "base/dtype.h"
#include "base/status.h"

namespace strata::cpu_optim {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = true;  // true: AdamW; false: Adam with L2 (g += wd * p)
  bool bias_correction = true;
};

struct AdamWStep {
  int64_t step = 1;         // t, 1-based, for bias correction
  float grad_scale = 1.0f;  // gradients are multiplied by this first: 1/loss_scale * clip_coef
};

// Read-only gradient view: num_elems elements (given by the call) of dtype at data.
struct GradView {
  const void* data;
  DType dtype;
};

// Optional copy-out of the updated weights: data == nullptr means none; dtype kF16,
// kBF16 or kF32; num_elems elements as the master weights.
struct CopyOut {
  void* data = nullptr;
  DType dtype = DType::kBF16;
};

// Updates master (fp32 weights), m and v (fp32 first and second moments) in place
// from grad, one optimizer step; writes copy_out when given. See the file comment.
Status AdamWUpdate(const AdamWConfig& config, const AdamWStep& step, std::span<float> master,
                   std::span<float> m, std::span<float> v, GradView grad, CopyOut copy_out = {});

// The scalar reference: one element at a time on the calling thread, the same
// formulas and fp32 operation order, conversions by base/dtype.h. Same contract
// and errors. For tests and for checking a new variant; slow.
Status AdamWUpdateReference(const AdamWConfig& config, const AdamWStep& step,
                            std::span<float> master, std::span<float> m, std::span<float> v,
                            GradView grad, CopyOut copy_out = {});

// The kernel variant every cpu_optim function uses on this CPU, chosen once by
// CPUID: "avx512", "avx2" or "generic" (the build's baseline ISA).
std::string_view ActiveKernelName();

}  // namespace strata::cpu_optim
