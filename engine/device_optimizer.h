// The optimizer update on the device (optimizer home "device", issue 28): a block's fp32 master
// weights and optimizer state live in device memory, and one call enqueues the whole update of a
// flat block on a device stream, writing the new 16-bit working params in the same pass, so
// gradients never cross PCIe. Also the two gradient passes that go with it: statistics (sum of
// squares for clipping, inf/NaN for the loss scaler) and accumulation over micro-batches.
//
// Numerics: the results equal cpu_optim's (cpu_optim/optimizer.h, any_optimizer.h, grad_stats.h)
// on the same inputs bit for bit: the per-call scalars come from cpu_optim's own preparation
// (fp64, rounded to fp32 once) and each element runs the fp32 operations of torch.optim's
// single-tensor (foreach=False) formulas in cpu_optim's order, each correctly rounded, never
// fused into an FMA. Where a result is NaN it is NaN in both (the payload may differ, as between
// cpu_optim's ISA variants). Algorithms: AdamW (Loshchilov & Hutter, "Decoupled Weight Decay
// Regularization", ICLR 2019) and Adam with L2 (Kingma & Ba, ICLR 2015), amsgrad (Reddi et al.,
// ICLR 2018); Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023); SGD with
// momentum, dampening and Nesterov (Sutskever et al., ICML 2013) and Adagrad with lr decay
// (Duchi et al., JMLR 2011), all as torch.optim writes them.
//
// Backends (dispatch on Stream::device_kind()):
//   host  device memory is host memory and streams are worker threads: the work is one
//         Stream::LaunchHost function calling cpu_optim's functions on the spans (the emulated
//         device update, what CI tests).
//   cuda  one fused kernel per call on gpu::NativeStream(stream) (engine/cuda/).
//
// Units: num_elems counts elements; spans are in bytes (size_bytes) and must hold at least
// num_elems elements of their dtype (larger spans are allowed; only the first num_elems elements
// are read or written). Alignment: fp32 buffers 4 bytes, fp16/bf16 2 bytes (arena carves are 256).
// Ownership: the caller owns every buffer and keeps it alive, untouched by other work, until the
// stream has completed the enqueued work (record an event after the call and wait on it); nothing
// is allocated and nothing is retained past completion. Thread-safety: the functions may be called
// from any thread; calls on one stream are ordered as the stream orders them.
//
// Errors: every argument is checked before anything is enqueued; on an error nothing is enqueued
// and nothing is modified: kInvalidArgument naming the problem (an optimizer kind that does not run
// on the device, hyper-parameters or a step that cpu_optim rejects, a span too small, a null span
// with num_elems > 0, misaligned or overlapping buffers, an unknown dtype, a state count that does
// not match cpu_optim::StateLayout), kFailedPrecondition for a CUDA stream in a build without the
// CUDA backend. A failed kernel launch comes back as the CUDA error's Status (gpu/cuda/
// cuda_status.h). Errors while the work runs are the stream's sticky error (Stream::Synchronize).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "cpu_optim/any_optimizer.h"
#include "cpu_optim/grad_stats.h"
#include "cpu_optim/optimizer.h"
#include "engine/plan/optimizer_state.h"  // DeviceGradStatsBytes, CheckDeviceOptimizer
#include "gpu/device.h"

namespace strata::engine {

// The buffers of one flat block, all in the memory of the stream's device.
struct DeviceUpdateBuffers {
  int64_t num_elems = 0;
  gpu::DeviceSpan master;  // (num_elems) fp32, updated in place
  // The sections of cpu_optim::StateLayout(optimizer, {{num_elems}}), in that order (exp_avg,
  // exp_avg_sq[, max_exp_avg_sq] | sum | exp_avg | momentum_buffer when momentum != 0), each
  // (num_elems) fp32, updated in place; initialized by the caller (cpu_optim::InitializeState).
  std::vector<gpu::DeviceSpan> state;
  gpu::DeviceSpan grad;  // (num_elems) grad_dtype: fp32, fp16 or bf16; read only
  DType grad_dtype = DType::kBF16;
  // (num_elems) working_dtype (fp32, fp16 or bf16): written with the updated weights rounded to
  // nearest even as base/dtype.h. An empty span (data == nullptr) means no copy-out.
  gpu::DeviceSpan working;
  DType working_dtype = DType::kBF16;
  // Weight decay groups: elements stepped with weight_decay 0, as cpu_optim::UpdateState's
  // no_decay (sorted, disjoint, non-empty, within num_elems; kInvalidArgument otherwise). The
  // CUDA backend launches one kernel per run of elements of one group.
  std::vector<cpu_optim::ElemRange> no_decay;
};

// Enqueues one optimizer step over buffers.num_elems elements on `stream`; the result equals
// cpu_optim::UpdateState(optimizer, step, {{num_elems}}, master, state, grad, working,
// buffers.no_decay) bit for bit.
// Gradients are read as float(grad) * step.grad_scale (then negated with maximize). The caller
// checks the gradient statistics first and skips the step on a non-finite gradient. The work is
// complete when the stream's work enqueued so far is. num_elems == 0 enqueues nothing.
[[nodiscard]] Status EnqueueDeviceUpdate(gpu::Stream& stream,
                                         const cpu_optim::AnyOptimizer& optimizer,
                                         const cpu_optim::OptimStep& step,
                                         const DeviceUpdateBuffers& buffers);

// Enqueues the statistics of num_elems elements of `grad` (dtype fp32, fp16 or bf16, device
// memory) scaled by `scale` (finite; e.g. 1 / loss_scale): writes a record of
// DeviceGradStatsBytes(num_elems) bytes at `stats` (device memory, 8-byte aligned, not overlapping
// grad). The sum of (scale * g)^2 is formed in fp64 in cpu_optim::ComputeGradStats's fixed order:
// 8 lanes per 4096-element chunk, chunks in order per 64Ki-element leaf; the CUDA backend leaves
// the leaf sums in the record and DecodeDeviceGradStats adds them pairwise as cpu_optim does, so
// the decoded statistics equal ComputeGradStats's bit for bit and are the same run to run.
[[nodiscard]] Status EnqueueDeviceGradStats(gpu::Stream& stream, gpu::DeviceSpan grad, DType dtype,
                                            int64_t num_elems, float scale, gpu::DeviceSpan stats);

// The statistics in a record of EnqueueDeviceGradStats once copied to host memory (after the
// stream's work completed): sum_squares, nonfinite (some element was inf or NaN, or the sum
// overflowed: !isfinite(sum_squares), as cpu_optim) and num_elems. kDataLoss when the record is
// shorter than its header says or its header is inconsistent. Pure; thread-safe.
StatusOr<cpu_optim::GradStats> DecodeDeviceGradStats(std::span<const std::byte> record);

// Enqueues gradient accumulation over micro-batches: for i < num_elems,
//   overwrite:  acc[i] = float(grad[i])          (exact)
//   otherwise:  acc[i] = acc[i] + float(grad[i])  (one fp32 rounding)
// bit for bit as cpu_optim::AccumulateGrad. acc is (num_elems) fp32 and grad (num_elems) of dtype
// fp32, fp16 or bf16, both device memory, not overlapping.
[[nodiscard]] Status EnqueueDeviceGradAccumulate(gpu::Stream& stream, gpu::DeviceSpan acc,
                                                 gpu::DeviceSpan grad, DType dtype,
                                                 int64_t num_elems, bool overwrite);

}  // namespace strata::engine
