// Internal to engine/: the CUDA launchers behind engine/device_optimizer.h (built only with the
// CUDA backend, STRATA_HAVE_CUDA). Each enqueues one grid-stride kernel on `stream` and returns
// the launch's Status (cudaGetLastError); the arguments were checked by device_optimizer.cc.
//
// The per-call scalars are cpu_optim's own (cpu_optim/kernels.h Prepare*: fp64 from the config,
// rounded to fp32 once) and are passed by value; the buffers are device pointers, indexed
// [0, num_elems), with the meaning of cpu_optim's AdamWBuffers / StateBuffers (out nullptr: no
// copy-out). Per element the kernels run cpu_optim's loops (cpu_optim/kernels_impl.inc) with
// correctly rounded intrinsics (__fadd_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn) that nvcc never
// contracts into an FMA, and base/dtype.h's conversions (host and device code), so the
// results equal cpu_optim's bit for bit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "base/dtype.h"
#include "base/status.h"
#include "cpu_optim/kernels.h"

namespace strata::engine::cuda {

Status LaunchAdamWUpdate(cudaStream_t stream, const cpu_optim::internal::AdamWScalars& s,
                         const cpu_optim::internal::AdamWBuffers& b, int64_t num_elems);
Status LaunchAdagradUpdate(cudaStream_t stream, const cpu_optim::internal::AdagradScalars& s,
                           const cpu_optim::internal::StateBuffers& b, int64_t num_elems);
Status LaunchLionUpdate(cudaStream_t stream, const cpu_optim::internal::LionScalars& s,
                        const cpu_optim::internal::StateBuffers& b, int64_t num_elems);
Status LaunchSgdUpdate(cudaStream_t stream, const cpu_optim::internal::SgdScalars& s,
                       const cpu_optim::internal::StateBuffers& b, int64_t num_elems);

// Writes the statistics record (device_optimizer.cc StatsHeader, then one fp64 sum per leaf of
// cpu_optim::internal::kStatsLeafElems elements) at `record`: one block per leaf, each summing its
// leaf in cpu_optim's fixed order (8 lanes per chunk, lanes combined in a fixed tree, chunks in
// order). num_elems == 0 writes the header alone.
Status LaunchGradStats(cudaStream_t stream, const void* grad, DType dtype, int64_t num_elems,
                       float scale, std::byte* record);

// acc[i] = overwrite ? float(grad[i]) : acc[i] + float(grad[i]).
Status LaunchGradAccumulate(cudaStream_t stream, float* acc, const void* grad, DType dtype,
                            int64_t num_elems, bool overwrite);

}  // namespace strata::engine::cuda
