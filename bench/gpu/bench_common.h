// Shared by the GPU benchmarks: one CUDA device for the whole program, and the context
// lines (backend, GPU) printed at the top of every run.
#pragma once

#include <benchmark/benchmark.h>

#include <memory>
#include <string>

#include "gpu/cuda/cuda_device.h"
#include "gpu/device.h"

namespace strata::gpu::bench {

struct GpuContext {
  std::unique_ptr<Device> device;  // null without a usable GPU
  std::string why_not;             // then: the reason, for SkipWithError
};

// Opens GPU 0 once (pinned budget: 8 GiB) and adds "backend" and "gpu" to the context.
inline GpuContext& Gpu() {
  static GpuContext* ctx = [] {
    auto* c = new GpuContext;
    auto n = CudaDeviceCount();
    if (!n.ok()) {
      c->why_not = "no usable CUDA runtime: " + n.status().message();
    } else if (*n == 0) {
      c->why_not = "no CUDA GPU (no NVIDIA driver or no GPU visible)";
    } else {
      CudaDeviceOptions o;
      o.pinned_budget_bytes = size_t{8} << 30;
      auto dev = CreateCudaDevice(o);
      if (dev.ok()) {
        c->device = std::move(*dev);
      } else {
        c->why_not = dev.status().ToString();
      }
    }
    benchmark::AddCustomContext("backend", "cuda");
    benchmark::AddCustomContext("gpu", c->device ? c->device->description() : c->why_not);
    return c;
  }();
  return *ctx;
}

}  // namespace strata::gpu::bench
