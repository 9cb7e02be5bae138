// Pinned host <-> device copy bandwidth of a gpu::Device, for `strata doctor`: the PCIe (or
// NVLink-C2C) rate the engine's prefetch and gradient streaming can count on.
//
// Copies `size_bytes` from a pinned buffer into the device arena (H2D), back (D2H), and both at
// once on two streams (a full-duplex link nearly doubles the sum), each `repetitions` times after
// one untimed warm-up, and reports the median rate of each. Times are host wall-clock around
// enqueue + Stream::Synchronize, so they include the launch and synchronization latency (a few
// microseconds, under 0.1% at the default 256 MiB). The H2D data is a byte pattern that is
// checked after the round trip: a copy that "succeeds" without moving the bytes is kDataLoss.
//
// Memory: takes size_bytes of device memory (one arena) and 2 size_bytes of pinned memory from
// `device`, freed on return. Errors: kInvalidArgument for size_bytes == 0 or repetitions < 1;
// allocation and copy failures of the device as they come (kResourceExhausted, CUDA errors).
// Thread-safety: creates its own streams; other work on the device competes for the link.
#pragma once

#include <cstddef>

#include "base/status.h"
#include "gpu/device.h"

namespace strata::tools {

struct PinnedBandwidth {
  double h2d_bytes_per_second = 0;   // median
  double d2h_bytes_per_second = 0;   // median
  double both_bytes_per_second = 0;  // median of (2 size_bytes / time of the concurrent pair)
  size_t size_bytes = 0;
  int repetitions = 0;
};

StatusOr<PinnedBandwidth> MeasurePinnedBandwidth(gpu::Device& device, size_t size_bytes,
                                                 int repetitions);

}  // namespace strata::tools
