// `--device auto|host|cuda`: which gpu::Device backend a command runs on.
//
//   host  the host emulation backend (gpu/host/), always available.
//   cuda  the CUDA backend (gpu/cuda/); an error when this binary was built without it
//         or when no GPU is visible, with a one-line message saying why and what to do.
//   auto  cuda when built with it and the CUDA runtime sees at least one GPU, else host.
#pragma once

#include <memory>
#include <string_view>

#include "base/status.h"
#include "gpu/device.h"

namespace strata::tools {

// True when this binary contains the CUDA backend (STRATA_HAVE_CUDA at build time).
bool BuiltWithCuda();

// The decision alone, from its inputs, so that every combination can be tested on any
// machine: `cuda_device_count` is what gpu::CudaDeviceCount() answered (ignored when
// !built_with_cuda). Errors: kInvalidArgument for an unknown flag; for `cuda`,
// kFailedPrecondition in a build without CUDA and kUnavailable without a visible GPU.
StatusOr<gpu::DeviceKind> ResolveDeviceFlag(std::string_view flag, bool built_with_cuda,
                                            const StatusOr<int>& cuda_device_count);

struct DeviceSelectOptions {
  // Used as is for the host backend; for CUDA its pinned_budget_bytes and trace are used.
  gpu::HostDeviceOptions host;
  int cuda_device_ordinal = 0;
};

// Resolves `flag` for this binary and this machine, then creates the device.
StatusOr<std::unique_ptr<gpu::Device>> CreateDeviceFromFlag(std::string_view flag,
                                                            const DeviceSelectOptions& options);

}  // namespace strata::tools
