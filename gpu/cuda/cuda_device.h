// The CUDA device backend: gpu::Device over the CUDA runtime.
//
//   Stream  -> a cudaStream_t created with cudaStreamNonBlocking (never synchronizes
//              with the legacy default stream), owned by the Stream object.
//   Event   -> a cudaEvent_t created with cudaEventBlockingSync | cudaEventDisableTiming
//              (ordering only; a host thread waiting in Event::Synchronize sleeps).
//   Arena   -> ONE cudaMalloc of the whole budget at CreateArena, zero-filled,
//              carved by DeviceArena (256-byte aligned slots); freed with the arena.
//              Peak use = used_bytes(), since nothing is freed.
//   Pinned  -> an aligned anonymous mapping (gpu/pinned_memory.h) page-locked with
//              cudaHostRegister (portable, DMA-able), 4 KiB-aligned for every size,
//              counted against the pinned budget; a failed pin returns
//              kResourceExhausted saying how much could not be pinned and why. There is no fallback
//              to pageable memory: a pageable source would silently serialize every copy.
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
// Waiting: host threads that wait for the GPU block instead of spinning, so the cores stay free
// for the CPU optimizer and I/O threads that run beside the GPU (a spinning wait takes a whole
// core for as long as the GPU runs). CreateCudaDevice asks for cudaDeviceScheduleBlockingSync
// on the GPU's primary context, as it is created (cudaInitDevice) or, where the process created
// it earlier, by changing its flags (cudaSetDeviceFlags); Stream::Synchronize
// (cudaStreamSynchronize) then blocks too. A runtime that refuses to change an active context
// (cudaErrorSetOnActiveProcess) keeps its flags: a warning is logged, the description says
// "host waits spin on stream syncs", and events still block (cudaEventBlockingSync is a per-event
// flag). The flag is process-wide for that GPU: it applies to other users of the primary context
// (cuBLAS, a host framework) as well. Cost: a blocking wake-up takes some microseconds longer
// than a spin; the waits of this backend are per bucket or per step, not per kernel. The timing
// events of tracing (below) keep timing and spin, for the precision of the clock anchor.
//
// Threading: Device methods are thread-safe. Each call that launches work makes
// the device's ordinal current on the calling thread (cudaSetDevice), so streams
// may be driven from any host thread; one thread per stream keeps order obvious.
// Destroying a stream synchronizes it first; destroy streams and events before
// the device, and pinned buffers only after the copies using them completed.
//
// Tracing: with options.trace set, each stream records on a track named after the stream
//   - every CopyH2D ("H2D copy", category h2d), CopyD2H ("D2H copy", d2h) and Convert
//     ("convert", compute), timed on the GPU: a pair of CUDA timing events is recorded on the
//     stream right before and right after the operation, so the span is the time the GPU spent
//     on it once the stream reached it (not time queued behind earlier work or event waits);
//   - every ScopedComputeSpan (below), timed the same way around the kernels launched inside it;
//   - every LaunchHost function ("kernel", compute), timed on the host callback thread.
// Cost per timed operation: two cudaEventRecord calls (a few microseconds of host time), a
// queue push and a mutex-guarded wake-up check; no allocation and no cudaEventCreate in steady
// state: each stream takes 64 event pairs when it is created, and grows by 32 only when more
// spans than it holds are in flight or not yet recorded. Without options.trace none of this
// exists (no events, no thread, no queue).
// Clock: a span's events are turned into TraceRecorder::NowNs() time through a clock anchor, an
// event recorded on an idle stream of the device and waited for: its host time is the midpoint
// of the host window around that (best of 3 tries), so it is off by at most half that window
// (typically a few microseconds; Cristian's algorithm, see gpu/cuda/timed_spans.h), plus
// cudaEventElapsedTime's resolution (about 0.5 us). The anchor is renewed every second, so the
// float milliseconds that cudaEventElapsedTime returns stay precise and the drift between the
// GPU's timer and the host clock (ppm) stays at microseconds; a renewal with a much wider window
// than the current anchor's (the clock stream was held up) is discarded for up to 5 s.
// Spans of one track never overlap: each starts no earlier than the previous one ended (the
// in-order stream gives that; a clamp absorbs the anchors' few-microsecond differences). This
// holds when one thread at a time enqueues on a stream; concurrent enqueues from several
// threads may interleave the event pairs and misattribute time.
// Harvesting: one thread per traced device polls the streams' spans every millisecond while any
// are in flight (a GPU event cannot wake a host thread) and records the completed ones in stream
// order, so a span appears in the recorder within about a millisecond of finishing on the GPU.
// Stream::Synchronize records every span enqueued before it before returning, and a stream
// records all of its spans before it is destroyed: nothing traced is lost. A span whose events
// cannot be recorded or read (a failed stream) is dropped; tracing never fails an operation.
// Thread-safety: as for streams; the harvester shares only mutex-guarded queues with them, and
// makes no CUDA call while holding a lock.
#pragma once

#include <cstddef>
#include <cstdint>
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

// Times the GPU work that the caller launches directly on NativeStream(stream) (kernels, cuBLAS
// calls) between construction and destruction, as one span `name` of category compute on the
// stream's track: a timing event is recorded on the stream at construction and at destruction
// (see "Tracing" above). For code that bypasses the Stream's own operations, such as the GPT's
// CUDA blocks. Does nothing when the stream's device has no trace recorder.
//   - `stream` must be a CUDA backend stream (STRATA_CHECKed, as NativeStream).
//   - `name` must outlive the TraceRecorder (a string literal).
//   - Spans do not nest: while one is open on a stream, that stream's other traced work (copies,
//     conversions, host functions, inner spans) is part of it and not recorded separately.
//   - Construct and destroy on the thread that enqueues the stream's work; a span must not
//     outlive its stream.
// Plain C++ (no CUDA headers), so code compiled without nvcc can use it.
class ScopedComputeSpan {
 public:
  ScopedComputeSpan(Stream& stream, const char* name);
  ~ScopedComputeSpan();
  ScopedComputeSpan(const ScopedComputeSpan&) = delete;
  ScopedComputeSpan& operator=(const ScopedComputeSpan&) = delete;

 private:
  Stream* stream_;
  bool open_ = false;  // a span is timed (tracing on, not nested, events recorded)
  uint64_t id_ = 0;    // its id in the stream's span queue
};

// Number of CUDA GPUs the runtime sees. 0 (and OK) when there is no NVIDIA driver,
// the driver is too old for this runtime, or no GPU is visible
// (cudaErrorNoDevice / cudaErrorInsufficientDriver); other failures are errors.
// For `--device auto`.
StatusOr<int> CudaDeviceCount();

}  // namespace strata::gpu
