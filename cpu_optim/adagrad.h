// CPU Adagrad over fp32 master weights and an fp32 sum of squared gradients.
//
// Adagrad: Duchi, Hazan & Singer, "Adaptive Subgradient Methods for Online Learning
// and Stochastic Optimization", JMLR 12, 2011.
//
// Formulas as torch.optim.Adagrad (_single_tensor_adagrad, dense gradients), per
// element i, in fp32, in exactly this order (t = OptimStep::step):
//
//   g = float(grad[i]) * grad_scale;  if maximize: g = -g
//   weight_decay != 0:  g = g + weight_decay * p
//   clr = lr / (1 + (t - 1) * lr_decay)             (fp64, rounded to fp32 once)
//   state_sum = state_sum + g * g
//   std = sqrt(state_sum) + eps
//   p = p - (clr * g) / std
//   copy_out[i] = dtype(p)
//
// Buffers: master and state_sum (torch's state name), fp32, num_elems =
// master.size() each. The caller initialises state_sum to
// initial_accumulator_value before the first step (torch does so when it creates
// the state); the field is here so that the config carries torch's full set of
// hyper-parameters, and it is validated as torch does.
//
// The common contract (units, alignment, ownership, threading, bit-identity across
// threads and ISA variants, errors) is in optimizer.h. Adagrad-specific errors
// (kInvalidArgument, nothing modified): lr, lr_decay, weight_decay,
// initial_accumulator_value or eps negative or not finite.
#pragma once

#include <span>

#include "base/status.h"
#include "cpu_optim/optimizer.h"

namespace strata::cpu_optim {

struct AdagradConfig {
  float lr = 1e-2f;
  float lr_decay = 0.0f;
  float weight_decay = 0.0f;  // L2: g += weight_decay * p
  float initial_accumulator_value = 0.0f;
  float eps = 1e-10f;
  bool maximize = false;  // ascend: the gradient's sign is flipped after unscaling
};

// One Adagrad step: updates master and state_sum in place from grad; writes
// copy_out when given. See the file comment.
Status AdagradUpdate(const AdagradConfig& config, const OptimStep& step, std::span<float> master,
                     std::span<float> state_sum, GradView grad, CopyOut copy_out = {});

// The scalar reference: one element at a time on the calling thread, the same
// formulas and fp32 operation order, conversions by base/dtype.h. Same contract
// and errors. For tests and for checking a new variant; slow.
Status AdagradUpdateReference(const AdagradConfig& config, const OptimStep& step,
                              std::span<float> master, std::span<float> state_sum, GradView grad,
                              CopyOut copy_out = {});

}  // namespace strata::cpu_optim
