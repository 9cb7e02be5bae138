// LoRA's adapters (models/lora.h; Hu et al. 2021) on the CUDA backend: the device counterparts of
// LoraForward and LoraBackward, called by the families' CUDA layers (llama_cuda.cu, gpt_cuda.cu)
// after each targeted base product. Same rounding points as the host functions (the top of
// models/lora.h), the thin products (rank r) through the ops library's cuBLASLt products
// (ops.cuh Products: S inputs and outputs, fp32 accumulation), and the same dropout mask: each
// element's keep draw is LoraStreamUniform evaluated on the device from the site's
// LoraDropoutStream, so a CUDA run drops exactly the elements a host run drops. The element-wise
// steps (dropout, the scaled add into the product's columns, the scaled output gradient, the
// masked input gradient) are one kernel each, one thread per element.
//
// Conventions (as ops.cuh): `a` holds DEVICE pointers (adapters, dadapters, scratch of
// LoraScratchBytes<S>(layout, rows) bytes, 256-byte aligned, carved by CarveLoraScratch); x, y,
// dy, dx device memory of S; everything is enqueued on mm.stream in order, nothing allocated or
// synchronised; kInvalidArgument for a null pointer of an active call, launch and cuBLAS errors
// as Status. Deterministic on one GPU (no atomics); not bit-identical to the host (summation
// order), within the rounding of S. Thread-safety: one thread per stream; concurrent calls must
// not share scratch or outputs. An inactive `a` (no adapters) or a product no site targets
// enqueues nothing.
#pragma once

#include <cstdint>

#include "base/status.h"
#include "models/lora.h"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::cuda {

// y (rows, ld), columns [col, col + out) of every site of `product`: y += s dropout(x) A^T B^T.
// x (rows, in) is the product's input.
template <typename S>
Status LoraCudaForward(const ops::cuda::Products<S>& mm, const LoraLayerArgs<S>& a, int product,
                       const S* x, int64_t rows, S* y, int64_t ld);

// For every site of `product`: its dA and dB (in a.dadapters, OVERWRITTEN) from dy (rows, ld),
// the gradient of the product's output, and x (rows, in); dx (rows, in) += the gradient through
// the adapter (dx already holds the base product's input gradient).
template <typename S>
Status LoraCudaBackward(const ops::cuda::Products<S>& mm, const LoraLayerArgs<S>& a, int product,
                        const S* x, const S* dy, int64_t rows, int64_t ld, S* dx);

}  // namespace strata::models::cuda
