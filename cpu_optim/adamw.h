// CPU AdamW / Adam over fp32 master weights, as in ZeRO-Offload: fp16/bf16 (or
// fp32) gradients land in host memory and update fp32 master weights and moments,
// optionally writing the new weights back as fp16/bf16 for the next forward pass.
//
// Adam: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015.
// AdamW: Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
//
// AMSGrad: Reddi, Kale & Kumar, "On the Convergence of Adam and Beyond", ICLR 2018.
//
// Formulas as torch.optim.AdamW (decoupled weight decay) and torch.optim.Adam (L2),
// _single_tensor_adam, per element i, in fp32, in exactly this order
// (t = OptimStep::step; w = 1 - beta1 rounded to fp32):
//
//   g = float(grad[i]) * grad_scale;  if maximize: g = -g
//   Adam (L2), weight_decay != 0:     g = g + weight_decay * p
//   AdamW,     weight_decay != 0:     p = p * (1 - lr * weight_decay)
//   m = lerp(m, g, w)                 torch's lerp: m + w * (g - m)          if w < 0.5,
//                                                   g - (g - m) * (1 - w)  otherwise
//   v = beta2 * v + ((1 - beta2) * g) * g
//   amsgrad: vmax = maximum(vmax, v)  (NaN if either is NaN, as torch.maximum)
//   denom = sqrt(amsgrad ? vmax : v) / sqrt(1 - beta2^t) + eps  (bias_correction)
//           sqrt(amsgrad ? vmax : v) / 1 + eps                  (no bias_correction)
//   p = p - ((lr / (1 - beta1^t)) * m) / denom           (lr without bias_correction)
//   copy_out[i] = dtype(p)        (round to nearest even, NaN kept, as base/dtype.h)
//
// The per-call scalars (1 - beta1, 1 - beta2, 1 - lr * weight_decay,
// lr / (1 - beta1^t), sqrt(1 - beta2^t)) are computed in fp64 and rounded to fp32
// once, as PyTorch computes them in Python floats. torch may fuse the lerp into an
// FMA on its vectorized path; this library never fuses, so results agree with
// torch.optim to about 1 ulp per step.
//
// Buffers: master, m (exp_avg), v (exp_avg_sq) and, when amsgrad, max_exp_avg_sq
// (torch's state name; starts at 0 like v): fp32, num_elems = master.size() each.
// max_exp_avg_sq is ignored (may be empty) when amsgrad is false.
//
// The common contract (units, alignment, ownership, threading, bit-identity across
// threads and ISA variants, errors) is in optimizer.h. AdamW-specific errors
// (kInvalidArgument, nothing modified): lr, eps or weight_decay negative or not
// finite, betas outside [0, 1), amsgrad without a max_exp_avg_sq of num_elems.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "base/dtype.h"
#include "base/status.h"
#include "cpu_optim/optimizer.h"

namespace strata::cpu_optim {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = true;  // true: AdamW; false: Adam with L2 (g += wd * p)
  bool bias_correction = true;
  bool amsgrad = false;   // keep and use the running maximum of v (max_exp_avg_sq)
  bool maximize = false;  // ascend: the gradient's sign is flipped after unscaling
};

// Updates master (fp32 weights), m and v (fp32 first and second moments) and, with
// amsgrad, max_exp_avg_sq in place from grad, one optimizer step; writes copy_out
// when given. See the file comment.
Status AdamWUpdate(const AdamWConfig& config, const OptimStep& step, std::span<float> master,
                   std::span<float> m, std::span<float> v, GradView grad, CopyOut copy_out = {},
                   std::span<float> max_exp_avg_sq = {});

// The scalar reference: one element at a time on the calling thread, the same
// formulas and fp32 operation order, conversions by base/dtype.h. Same contract
// and errors. For tests and for checking a new variant; slow.
Status AdamWUpdateReference(const AdamWConfig& config, const OptimStep& step,
                            std::span<float> master, std::span<float> m, std::span<float> v,
                            GradView grad, CopyOut copy_out = {},
                            std::span<float> max_exp_avg_sq = {});

// The kernel variant every cpu_optim function uses on this CPU, chosen once by
// CPUID: "avx512", "avx2" or "generic" (the build's baseline ISA).
std::string_view ActiveKernelName();

}  // namespace strata::cpu_optim
