// CPU SGD with momentum and Nesterov momentum over fp32 master weights.
//
// Momentum: Polyak, "Some methods of speeding up the convergence of iteration
// methods", 1964, in the form of Sutskever, Martens, Dahl & Hinton, "On the
// importance of initialization and momentum in deep learning", ICML 2013 (also
// for Nesterov momentum), as torch.optim.SGD implements them.
//
// Formulas as torch.optim.SGD (_single_tensor_sgd), per element i, in fp32, in
// exactly this order (t = OptimStep::step):
//
//   g = float(grad[i]) * grad_scale;  if maximize: g = -g
//   weight_decay != 0:  g = g + weight_decay * p
//   momentum != 0:
//     t == 1:  buf = g                                  (torch: clone, no dampening)
//     t > 1:   buf = momentum * buf + (1 - dampening) * g
//     nesterov: g = g + momentum * buf,  else: g = buf
//   p = p - lr * g
//   copy_out[i] = dtype(p)
//
// Buffers: master and momentum_buffer (torch's state name), fp32, num_elems =
// master.size() each. momentum_buffer may be empty when momentum == 0 (it is then
// neither read nor written). At t == 1 its old contents are ignored.
//
// The common contract (units, alignment, ownership, threading, bit-identity across
// threads and ISA variants, errors) is in optimizer.h. SGD-specific errors
// (kInvalidArgument, nothing modified): lr, momentum or weight_decay negative or
// not finite, dampening not finite, nesterov without momentum > 0 and dampening 0,
// momentum != 0 without a momentum_buffer of num_elems.
#pragma once

#include <span>

#include "base/status.h"
#include "cpu_optim/optimizer.h"

namespace strata::cpu_optim {

struct SgdConfig {
  float lr = 1e-3f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;  // L2: g += weight_decay * p
  bool nesterov = false;
  bool maximize = false;  // ascend: the gradient's sign is flipped after unscaling
};

// One SGD step: updates master and (when momentum != 0) momentum_buffer in place
// from grad; writes copy_out when given. See the file comment.
Status SgdUpdate(const SgdConfig& config, const OptimStep& step, std::span<float> master,
                 std::span<float> momentum_buffer, GradView grad, CopyOut copy_out = {});

// The scalar reference: one element at a time on the calling thread, the same
// formulas and fp32 operation order. Same contract and errors. Slow.
Status SgdUpdateReference(const SgdConfig& config, const OptimStep& step, std::span<float> master,
                          std::span<float> momentum_buffer, GradView grad, CopyOut copy_out = {});

}  // namespace strata::cpu_optim
