#include "tools/device_select.h"

#include <fmt/format.h>

#ifdef STRATA_HAVE_CUDA
#include "gpu/cuda/cuda_device.h"
#endif

namespace strata::tools {

bool BuiltWithCuda() {
#ifdef STRATA_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

StatusOr<gpu::DeviceKind> ResolveDeviceFlag(std::string_view flag, bool built_with_cuda,
                                            const StatusOr<int>& cuda_device_count) {
  if (flag == "host") return gpu::DeviceKind::kHost;
  if (flag == "auto") {
    const bool gpu = built_with_cuda && cuda_device_count.ok() && *cuda_device_count > 0;
    return gpu ? gpu::DeviceKind::kCuda : gpu::DeviceKind::kHost;
  }
  if (flag != "cuda") {
    return InvalidArgumentError(fmt::format("--device '{}' is not one of auto, host, cuda", flag));
  }
  if (!built_with_cuda) {
    return FailedPreconditionError(
        "--device cuda: this strata was built without the CUDA backend (no nvcc at build time); "
        "rebuild with the CUDA toolkit installed (cmake -DSTRATA_CUDA=ON) or use --device host");
  }
  if (!cuda_device_count.ok()) {
    return UnavailableError(fmt::format(
        "--device cuda: the CUDA runtime failed ({}); check nvidia-smi or use --device host",
        cuda_device_count.status().message()));
  }
  if (*cuda_device_count == 0) {
    return UnavailableError(
        "--device cuda: no CUDA GPU is visible (no NVIDIA driver, a driver too old for this "
        "build's CUDA runtime, or CUDA_VISIBLE_DEVICES hides them); check nvidia-smi or use "
        "--device host");
  }
  return gpu::DeviceKind::kCuda;
}

StatusOr<std::unique_ptr<gpu::Device>> CreateDeviceFromFlag(std::string_view flag,
                                                            const DeviceSelectOptions& options) {
#ifdef STRATA_HAVE_CUDA
  // Asked only when it matters: the first CUDA call initializes the runtime (~100 ms).
  const StatusOr<int> count = flag == "host" ? StatusOr<int>(0) : gpu::CudaDeviceCount();
#else
  const StatusOr<int> count(0);
#endif
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceKind kind, ResolveDeviceFlag(flag, BuiltWithCuda(), count));
  if (kind == gpu::DeviceKind::kHost) return gpu::CreateHostDevice(options.host);
#ifdef STRATA_HAVE_CUDA
  gpu::CudaDeviceOptions o;
  o.device_ordinal = options.cuda_device_ordinal;
  o.pinned_budget_bytes = options.host.pinned_budget_bytes;
  o.trace = options.host.trace;
  auto device = gpu::CreateCudaDevice(o);
  if (!device.ok()) return device.status().WithContext("--device cuda");
  return device;
#else
  return InternalError(
      "CUDA device chosen in a build without CUDA");  // ResolveDeviceFlag rules it out
#endif
}

}  // namespace strata::tools
