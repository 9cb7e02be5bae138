// CPU Adafactor over fp32 master weights: a factored second moment (one fp32 value
// per row and per column of a matrix instead of one per weight) and no first moment
// by default, so the optimizer state of an (r, c) weight is r + c floats.
//
// Adafactor: Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear
// Memory Cost", ICML 2018 (relative step size, update clipping, the beta2 schedule
// 1 - t^decay_rate). Options and formulas as Hugging Face transformers' Adafactor
// (the reference users know), per tensor, with t = OptimStep::step:
//
//   g = float(grad) * grad_scale;  if maximize: g = -g
//   lr_t = relative_step ? min(warmup_init ? 1e-6 * t : 1e-2, 1 / sqrt(t)) : lr
//   scale_parameter:  lr_t = lr_t * max(eps2, RMS(p))     (RMS of p before the step)
//   beta2t = 1 - t^decay_rate
//   u = g * g + eps1                                        (fp32, per element)
//   factored (shape has >= 2 dims; the tensor is the (rows, cols) matrix with
//             rows = prod(shape[:-1]), cols = shape[-1], row-major):
//     R[i] = beta2t * R[i] + (1 - beta2t) * mean_j u[i, j]     (exp_avg_sq_row)
//     C[j] = beta2t * C[j] + (1 - beta2t) * mean_i u[i, j]     (exp_avg_sq_col)
//     update = (rsqrt(R[i] / mean(R)) * rsqrt(C[j])) * g
//   not factored:
//     V = beta2t * V + (1 - beta2t) * u;   update = rsqrt(V) * g   (exp_avg_sq)
//   update = update * (lr_t / max(1, RMS(update) / clip_threshold))
//   beta1 > 0:  M = beta1 * M + (1 - beta1) * update;  update = M    (exp_avg)
//   weight_decay != 0:  p = p * (1 - weight_decay * lr_t)
//   p = p - update;  copy_out = dtype(p)
//
// RMS(x) = sqrt(sum(x^2) / num_elems) over the whole tensor; rsqrt(x) = 1 / sqrt(x),
// two correctly rounded fp32 operations.
//
// Numerics. Per-call scalars (lr_t, beta2t, 1 - beta2t, 1 - beta1, the decay, the
// clipped step size lr_t / max(1, ...)) are computed in fp64 and rounded to fp32
// once. Element-wise arithmetic is fp32, each operation correctly rounded and never
// fused into an FMA. Every reduction is an fp64 sum of fp32 values in a fixed order
// that depends on the shape alone (kernels.h documents it): the row and column
// means, mean(R), RMS(p) and RMS(update); means are rounded to fp32 once. Results
// therefore do not depend on thread count or ISA variant and equal
// AdafactorUpdateReference bit for bit. Against transformers (which sums in fp32 in
// torch's order, and applies the clipping and lr_t as two roundings, and the decay as
// p + (-weight_decay * lr_t) * p) results agree to a few ulp per step.
//
// Difference from transformers: a tensor of more than two dimensions is factored as
// the matrix above (one column factor for all leading indices); transformers keeps
// one column factor per index of shape[:-2]. 2-D tensors are factored identically.
//
// State (fp32, caller-owned, zero before the first step; AdafactorStateElems gives
// the total): factored: exp_avg_sq_row (rows) and exp_avg_sq_col (cols); not
// factored: exp_avg_sq (num_elems); beta1 > 0: exp_avg (num_elems) too. A span the
// configuration does not use must be empty.
//
// Scratch: unlike the other optimizers, a factored step allocates fp64 partial sums
// of about num_elems / 64 + rows + cols values (kResourceExhausted if that fails);
// a non-factored step allocates nothing.
//
// The common contract (units, alignment, ownership, fused unscale, copy-out,
// threading, bit-identity, non-finite gradients) is in optimizer.h. Errors
// (kInvalidArgument, nothing modified): prod(shape) != master.size() or a negative
// dimension; a state span of the wrong size (or a non-empty unused one); null or
// overlapping buffers; unknown dtypes; step < 1; grad_scale not finite; lr, eps1,
// eps2 or weight_decay negative or not finite; clip_threshold not finite or <= 0;
// decay_rate not finite or > 0; beta1 outside [0, 1); warmup_init without
// relative_step (as transformers).
#pragma once

#include <cstdint>
#include <span>

#include "base/status.h"
#include "cpu_optim/optimizer.h"

namespace strata::cpu_optim {

struct AdafactorConfig {
  float lr = 1e-3f;     // used when !relative_step
  float eps1 = 1e-30f;  // added to g^2
  float eps2 = 1e-3f;   // lower bound of RMS(p) in scale_parameter
  float clip_threshold = 1.0f;
  float decay_rate = -0.8f;  // beta2t = 1 - t^decay_rate
  float beta1 = 0.0f;        // 0: no first moment (no exp_avg state)
  float weight_decay = 0.0f;
  bool relative_step = false;    // lr_t = min(1e-2 or 1e-6 * t, 1 / sqrt(t))
  bool scale_parameter = false;  // lr_t *= max(eps2, RMS(p))
  bool warmup_init = false;      // relative_step's 1e-6 * t warm-up; needs relative_step
  bool maximize = false;         // ascend: the gradient's sign is flipped after unscaling
};

// The state of one tensor; see the file comment for which spans are used.
struct AdafactorState {
  std::span<float> exp_avg_sq_row = {};  // factored: rows
  std::span<float> exp_avg_sq_col = {};  // factored: cols
  std::span<float> exp_avg_sq = {};      // not factored: num_elems
  std::span<float> exp_avg = {};         // beta1 > 0: num_elems
};

// Whether a tensor of this shape keeps a factored second moment: shape.size() >= 2.
bool AdafactorFactored(std::span<const int64_t> shape);

// Total fp32 state elements of one tensor: (rows + cols, or num_elems) + (num_elems
// when beta1 > 0). Shapes are not validated here (a negative dimension gives 0).
int64_t AdafactorStateElems(const AdafactorConfig& config, std::span<const int64_t> shape);

// One Adafactor step of one tensor of the given shape (row-major, prod(shape) ==
// master.size(); an empty shape is a scalar): updates master and the state in place
// from grad; writes copy_out when given. See the file comment.
Status AdafactorUpdate(const AdafactorConfig& config, const OptimStep& step,
                       std::span<const int64_t> shape, std::span<float> master,
                       const AdafactorState& state, GradView grad, CopyOut copy_out = {});

// The scalar reference: plain loops on the calling thread, the same formulas, fp32
// operation order and fixed summation order. Same contract and errors. Slow.
Status AdafactorUpdateReference(const AdafactorConfig& config, const OptimStep& step,
                                std::span<const int64_t> shape, std::span<float> master,
                                const AdafactorState& state, GradView grad, CopyOut copy_out = {});

}  // namespace strata::cpu_optim
