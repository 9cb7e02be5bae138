// Types shared by every CPU optimizer of cpu_optim (AdamW/Adam, Adagrad, Lion, SGD).
//
// The common contract of every XxxUpdate(config, step, master, state..., grad,
// copy_out) function and its scalar twin XxxUpdateReference:
//
// - Master weights and optimizer state are fp32, updated in place. The gradient is
//   fp32, fp16 or bf16 (GradView). The updated weights may also be written, in the
//   same pass, to a separate buffer as fp16, bf16 or fp32 (CopyOut): round to
//   nearest even, NaN kept (quiet), overflow to inf, bit for bit base/dtype.h.
// - Unscaling is fused: each gradient element is read as float(grad[i]) *
//   step.grad_scale (1 / loss_scale times a clipping coefficient), then negated
//   when the config says maximize (as torch.optim's maximize=True).
// - Units: every length is num_elems (elements, not bytes), given by master.size();
//   every state buffer, the gradient and the copy-out have that many elements.
//   Alignment: none required (64-byte aligned buffers are faster).
// - Ownership: the caller owns every buffer; nothing is retained after the call and
//   nothing is allocated (oneTBB allocates its task objects).
// - Numerics: per-call scalars (bias corrections, 1 - beta, lr decay, ...) are
//   computed in fp64 from the config and rounded to fp32 once, as torch.optim
//   computes them in Python floats; the per-element arithmetic is fp32 in the
//   operation order of torch.optim's single-tensor (foreach=False) implementation,
//   each operation correctly rounded and never fused into an FMA. Results equal
//   torch's in exact arithmetic and to about 1 ulp in practice (torch may fuse).
// - Threading: the work runs on the calling thread and oneTBB workers in the
//   caller's task_arena (tbb::task_arena, tbb::global_control, or cpu_optim's
//   WorkerArena of threading.h bound it), in fixed tiles; every element is computed
//   independently, so results are bit-identical whatever the thread count and tile
//   size, and equal to the XxxUpdateReference of the same optimizer bit for bit on
//   every ISA variant (where a result is NaN it is NaN in both; which NaN payload
//   x86 keeps when two NaN operands meet depends on the compiler's operand order).
//   Different buffers may be updated concurrently from several threads; buffers of
//   one call must not be touched by others until it returns.
// - Errors (nothing is modified): kInvalidArgument when a buffer has the wrong
//   size, a pointer is null while num_elems > 0, a dtype is unknown, buffers
//   overlap, step < 1, grad_scale is not finite, or a hyper-parameter is one that
//   torch.optim rejects (the message names it). kResourceExhausted / kInternal if
//   oneTBB fails to run its tasks (the buffers may then be partly updated).
//   Non-finite gradients are not an error: the caller checks GradStats::nonfinite
//   (grad_stats.h) first and skips the step; a NaN gradient makes NaN weights.
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace strata::cpu_optim {

// One optimizer step's per-call inputs that are not hyper-parameters.
struct OptimStep {
  int64_t step = 1;         // t, 1-based (bias corrections, lr decay, SGD's first step)
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

}  // namespace strata::cpu_optim
