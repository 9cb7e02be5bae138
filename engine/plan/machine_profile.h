// A machine profile: the rates the cost model (engine/plan/cost_model.h) predicts a step from, as a
// JSON file that `strata doctor --machine-profile FILE` writes and `strata estimate --machine
// FILE` / `strata train --machine FILE` read:
//
//   {"device": {"name": "NVIDIA H200", "memory_GiB": 139.8, "bf16_TFLOPs": 386,
//               "memory_GBps": 4000, "peak_bf16_TFLOPs": 989},
//    "pcie": {"h2d_GBps": 40, "d2h_GBps": 43},
//    "host": {"cores": 16, "memory_GiB": 125, "optimizer_params_per_s": {"adamw": 1.95e9}},
//    "nvme": {"read_GBps": 0.9, "write_GBps": 1.0}}
//
// Units: GB/s = 1e9 B/s, GiB = 2^30 B, TFLOP/s = 1e12 FLOP/s. bf16_TFLOPs counts model FLOPs,
// 6 P + 12 L T C per token (Chowdhery et al. 2022, "PaLM", appendix B), over the time of the
// forward, the recomputed forward and the backward: the recomputation is not counted, so this is
// the rate a training step achieves, not a peak. peak_bf16_TFLOPs (optional): the device's dense
// bf16 tensor peak from its datasheet (no sparsity), what model FLOP utilisation (MFU,
// engine/plan/model_flops.h) is measured against; without it there is no MFU (`strata train`
// prints none and its summary says null). optimizer_params_per_s: parameters per second
// that one update pass of that kind (--optimizer names: adamw, adam, lion, sgd, adagrad, ...)
// achieves on the host at the engine's thread count, state in host memory.
//
// Every section may be missing: a host-only machine has no "device" and no "pcie"; a machine
// measured without a drive has no "nvme". A present section must have all its keys (positive
// numbers; "name" a string; "optimizer_params_per_s" an object with at least one kind). Unknown
// keys are ignored, so later versions may add some; peak_bf16_TFLOPs is the one optional key (files
// written before it existed stay valid). A value must be plausible, so that no
// prediction is 0, inf or nan and no size overflows: rates (GB/s), bf16_TFLOPs and
// peak_bf16_TFLOPs in [0.001, 1e6], memory_GiB in [0.001, 1048576], host.cores a whole number
// in 1..65536, optimizer_params_per_s in [1, 1e15]. The file is parsed with base/untrusted_text.h's
// nesting limit, and a message quotes at most a bounded excerpt of a value.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "base/status.h"

namespace strata::engine {

struct MachineProfile {
  struct Device {
    std::string name;
    double memory_GiB = 0;
    double bf16_TFLOPs = 0;       // model FLOPs per second / 1e12 (see above)
    double memory_GBps = 0;       // device memory bandwidth (read + write bytes per second / 1e9)
    double peak_bf16_TFLOPs = 0;  // datasheet dense bf16 peak / 1e12; 0: unknown (key absent)
  };
  struct Pcie {
    double h2d_GBps = 0;  // pinned host -> device
    double d2h_GBps = 0;  // device -> pinned host
  };
  struct Host {
    int cores = 0;
    double memory_GiB = 0;
    // Optimizer kind ("adamw", "lion", ... as --optimizer) -> parameters updated per second.
    std::map<std::string, double> optimizer_params_per_s;
  };
  struct Nvme {
    double read_GBps = 0;
    double write_GBps = 0;
  };
  std::optional<Device> device;
  std::optional<Pcie> pcie;
  std::optional<Host> host;
  std::optional<Nvme> nvme;
};

// The datasheet dense bf16 tensor-core peak, TFLOP/s, of a GPU by its CUDA device name (as
// cudaGetDeviceProperties gives it: "NVIDIA H200", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB",
// "NVIDIA GeForce RTX 4090"), matched by whole words, case-insensitively; 0 for a device the table
// does not know. From NVIDIA's datasheets, without sparsity: H100 SXM 989, H100 PCIe 756, H100 NVL
// 835, H200 (SXM) 989, H200 NVL 835, GH200 989, A100 (SXM and PCIe) 312, L40S 362, L4 121; RTX
// 4090 165 (the Ada Lovelace architecture whitepaper, bf16 with fp32 accumulation).
double DatasheetPeakBf16Tflops(std::string_view device_name);

// The JSON text of a profile (the format above; absent sections are left out), indented by 2.
std::string MachineProfileJson(const MachineProfile& profile);

// Parses a profile. `source` names the file in errors. Errors: kInvalidArgument, one line naming
// the source, the key (as "device.bf16_TFLOPs") and what is wrong with it, and what to do (fix
// the value or regenerate the file with `strata doctor --machine-profile FILE`).
StatusOr<MachineProfile> ParseMachineProfile(const std::string& json_text,
                                             const std::string& source);

// Reads and parses `path` (at most 1 MiB). Errors: ParseMachineProfile's, and kNotFound /
// kPermissionDenied-style errors of opening the file (naming it).
StatusOr<MachineProfile> ReadMachineProfile(const std::string& path);

// Writes MachineProfileJson to `path` whole (WriteOutputFile: a regular file is replaced
// atomically, a crash or a full disk leaves the old one; /dev/stdout or a pipe is written
// directly). Errors: the open or write error, naming the path.
Status WriteMachineProfile(const MachineProfile& profile, const std::string& path);

}  // namespace strata::engine
