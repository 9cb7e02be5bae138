// The CUDA device backend: gpu::Device over the CUDA runtime.
//
//   Stream  -> a cudaStream_t created with cudaStreamNonBlocking (never synchronizes
//              with the legacy default stream), owned by the Stream object.
//   Event   -> a cudaEvent_t created with cudaEventDisableTiming (ordering only).
//   Arena   -> ONE cudaMalloc of the whole budget at CreateArena, zero-filled,
//              carved by DeviceArena (256-byte aligned slots); freed with the arena.
//              Peak use = used_bytes(), since nothing is freed.
//   Pinned  -> cudaHostAlloc (portable, page-locked, DMA-able) counted against the
//              pinned budget; a failed pin returns kResourceExhausted saying how much
//              could not be pinned and why. There is no fallback to pageable memory:
//              a pageable source would silently serialize every copy.
//
// Streams: CopyH2D/CopyD2H are cudaMemcpyAsync on the stream (pinned host memory
// only, so they are truly asynchronous) and count bytes into counters(). Convert
// launches the kernels of gpu/cuda/cuda_kernels.cuh. Record/Wait are
// cudaEventRecord/cudaStreamWaitEvent: cross-stream order comes only from events.
// LaunchHost runs its function with cudaLaunchHostFunc in stream order on a CUDA
// runtime thread; the function must not call the CUDA API (a CUDA rule for host
// functions) and should be short, since the stream waits for it. A non-OK result
// becomes the stream's sticky error: later LaunchHost functions on that stream
// are skipped (not run), while copies, kernels and event records still execute,
// so events still complete. Stream::Synchronize and Event::Synchronize return the
// first CUDA error (cudaStreamSynchronize/cudaEventSynchronize) or the sticky error.
// Event::Synchronize reports the sticky error of the stream that last recorded it,
// as of the moment the wait returns (it may include a failure of host work that
// was enqueued after the record).
//
// Threading: Device methods are thread-safe. Each call that launches work makes
// the device's ordinal current on the calling thread (cudaSetDevice), so streams
// may be driven from any host thread; one thread per stream keeps order obvious.
// Destroying a stream synchronizes it first; destroy streams and events before
// the device, and pinned buffers only after the copies using them completed.
//
// Tracing: with options.trace set, each stream records its LaunchHost functions
// (category compute) on a track named after the stream, timed on the host
// callback thread. Copies and kernels are not traced here: they run on the GPU's
// clock, and timing them would need an event pair per operation (use Nsight Systems).
#pragma once

#include <cstddef>
#include <memory>

#include "base/status.h"
#include "base/trace.h"
#include "gpu/device.h"

namespace strata::gpu {

struct CudaDeviceOptions {
  int device_ordinal = 0;  // as cudaSetDevice counts (after CUDA_VISIBLE_DEVICES)
  size_t pinned_budget_bytes = size_t{1} << 40;
  // Not owned; must outlive the device. nullptr: no tracing.
  trace::TraceRecorder* trace = nullptr;
};

// Opens GPU `device_ordinal`. kUnavailable when there is no driver or no such GPU
// (the message says how many GPUs there are and what to do), kInvalidArgument for a
// negative ordinal, other codes for CUDA runtime failures (see cuda_status.h).
StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions& options);

// Number of CUDA GPUs the runtime sees. 0 (and OK) when there is no NVIDIA driver,
// the driver is too old for this runtime, or no GPU is visible
// (cudaErrorNoDevice / cudaErrorInsufficientDriver); other failures are errors.
// For `--device auto`.
StatusOr<int> CudaDeviceCount();

}  // namespace strata::gpu
