// CPU Lion (EvoLved Sign Momentum) over fp32 master weights and an fp32 momentum.
//
// Lion: Chen, Liang, Huang, Real, Wang, Pham, Dong, Luong, Hsieh, Lu & Le,
// "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023 (arXiv:2302.06675),
// Algorithm 2 (with decoupled weight decay); the reference code is
// google/automl lion/lion_pytorch.py. torch.optim has no Lion; the operation order
// is that reference's, per element i, in fp32 (sign(+-0) = +0,
// sign(NaN) = NaN):
//
//   g = float(grad[i]) * grad_scale;  if maximize: g = -g
//   weight_decay != 0:  p = p * (1 - lr * weight_decay)   (fp64 scalar, rounded once)
//   c = beta1 * m + (1 - beta1) * g
//   p = p - lr * sign(c)
//   m = beta2 * m + (1 - beta2) * g
//   copy_out[i] = dtype(p)
//
// Buffers: master and exp_avg (m; starts at 0), fp32, num_elems = master.size()
// each. Lion needs a learning rate 3-10x smaller and a weight decay 3-10x larger
// than AdamW's (the paper, section 5).
//
// The common contract (units, alignment, ownership, threading, bit-identity across
// threads and ISA variants, errors) is in optimizer.h. Lion-specific errors
// (kInvalidArgument, nothing modified): lr or weight_decay negative or not finite,
// betas outside [0, 1].
#pragma once

#include <span>

#include "base/status.h"
#include "cpu_optim/optimizer.h"

namespace strata::cpu_optim {

struct LionConfig {
  float lr = 1e-4f;
  float beta1 = 0.9f;         // interpolation of the update direction
  float beta2 = 0.99f;        // momentum decay
  float weight_decay = 0.0f;  // decoupled: p *= 1 - lr * weight_decay
  bool maximize = false;      // ascend: the gradient's sign is flipped after unscaling
};

// One Lion step: updates master and exp_avg in place from grad; writes copy_out
// when given. See the file comment.
Status LionUpdate(const LionConfig& config, const OptimStep& step, std::span<float> master,
                  std::span<float> exp_avg, GradView grad, CopyOut copy_out = {});

// The scalar reference: one element at a time on the calling thread, the same
// formulas and fp32 operation order. Same contract and errors. Slow.
Status LionUpdateReference(const LionConfig& config, const OptimStep& step, std::span<float> master,
                           std::span<float> exp_avg, GradView grad, CopyOut copy_out = {});

}  // namespace strata::cpu_optim
