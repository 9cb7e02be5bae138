// The measurements behind `strata doctor --machine-profile FILE` (engine/plan/machine_profile.h):
// what this machine does for the cost model, each measured for a few seconds at most.
//
// Thread-safety: one call at a time (each uses every core, or the GPU, while it runs).
#pragma once

#include <map>
#include <optional>
#include <string>

#include "base/status.h"
#include "engine/plan/machine_profile.h"

namespace strata::tools {

// The kinds a device optimizer can run (issue 28): the CPU optimizer's rate is measured for each.
inline constexpr const char* kProfiledOptimizers[] = {"adamw", "adam", "lion", "sgd", "adagrad"};

// Parameters per second of one update pass of each kind (--optimizer's defaults, as `strata
// train` builds them: tools/optimizer_flags.h) over `num_params` fp32 master weights with their
// state, a bf16 gradient and a bf16 copy-out (what the engine's CPU optimizer does per block),
// in the calling thread's TBB arena, so at the engine's thread count (every core the process
// may use). Each kind: one untimed pass, then passes until `seconds` have passed (at least
// one); the rate is params x passes / their time. Memory: num_params x 16 bytes, freed on
// return. Errors: kInvalidArgument for num_params < 1; the optimizer's errors.
StatusOr<std::map<std::string, double>> MeasureCpuOptimizers(double seconds, int64_t num_params);

// The device and PCIe sections, measured on GPU 0: name and memory (CUDA runtime), the bf16
// GEMM rate (cuBLAS, 8192^3, bf16 in and out, fp32 accumulation) turned into the profile's
// model-FLOP rate (x 3/4: a step computes the forward once more, which model FLOPs do not
// count), the device memory bandwidth (a bf16 -> fp32 conversion of 512 MiB: 6 bytes moved per
// element), and pinned H2D / D2H (tools/pinned_bandwidth.h, 256 MiB). Each for about `seconds`
// (median of the repetitions).
struct GpuMeasurement {
  std::optional<engine::MachineProfile::Device> device;
  std::optional<engine::MachineProfile::Pcie> pcie;
  std::string why_not;  // when absent: no CUDA in this build, no GPU, or the error
};
GpuMeasurement MeasureGpu(double seconds);

}  // namespace strata::tools
