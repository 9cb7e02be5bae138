#include "tools/pinned_bandwidth.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

namespace strata::tools {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Seconds taken by `enqueue` (which puts copies on streams) and the synchronization of `streams`.
template <typename Enqueue>
StatusOr<double> Timed(std::initializer_list<gpu::Stream*> streams, Enqueue enqueue) {
  const auto start = std::chrono::steady_clock::now();
  STRATA_RETURN_IF_ERROR(enqueue());
  for (gpu::Stream* s : streams) STRATA_RETURN_IF_ERROR(s->Synchronize());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

StatusOr<PinnedBandwidth> MeasurePinnedBandwidth(gpu::Device& device, size_t size_bytes,
                                                 int repetitions) {
  if (size_bytes == 0) {
    return InvalidArgumentError(
        "pinned bandwidth: the copy size is zero; give a size such as 256MiB");
  }
  if (repetitions < 1) {
    return InvalidArgumentError(
        fmt::format("pinned bandwidth: {} repetitions; give at least 1", repetitions));
  }
  // Two device regions: in the concurrent pair one is written while the other is read.
  STRATA_ASSIGN_OR_RETURN(auto arena, device.CreateArena(2 * size_bytes));
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan dev, arena->Carve(size_bytes, "bandwidth probe"));
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan dev2, arena->Carve(size_bytes, "bandwidth probe 2"));
  STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer up, device.AllocatePinned(size_bytes, "bandwidth up"));
  STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer down,
                          device.AllocatePinned(size_bytes, "bandwidth down"));
  STRATA_ASSIGN_OR_RETURN(auto h2d, device.CreateStream("bandwidth h2d"));
  STRATA_ASSIGN_OR_RETURN(auto d2h, device.CreateStream("bandwidth d2h"));

  for (size_t i = 0; i < size_bytes; ++i)
    up.data()[i] = static_cast<std::byte>((i * 131 + 7) & 0xFF);
  // Warm-up round trip (first-touch costs, lazy context setup), then the data check.
  STRATA_RETURN_IF_ERROR(h2d->CopyH2D(dev, up.span()));
  STRATA_RETURN_IF_ERROR(h2d->Synchronize());
  STRATA_RETURN_IF_ERROR(d2h->CopyD2H(down.span(), dev));
  STRATA_RETURN_IF_ERROR(d2h->Synchronize());
  STRATA_RETURN_IF_ERROR(h2d->CopyH2D(dev2, up.span()));
  STRATA_RETURN_IF_ERROR(h2d->Synchronize());
  if (std::memcmp(up.data(), down.data(), size_bytes) != 0) {
    return DataLossError(fmt::format(
        "pinned bandwidth: {} bytes copied to the device and back came back different; the "
        "device's copies are broken (check the driver: nvidia-smi, dmesg)",
        size_bytes));
  }

  std::vector<double> t_h2d, t_d2h, t_both;
  for (int r = 0; r < repetitions; ++r) {
    STRATA_ASSIGN_OR_RETURN(double a,
                            Timed({h2d.get()}, [&] { return h2d->CopyH2D(dev, up.span()); }));
    STRATA_ASSIGN_OR_RETURN(double b,
                            Timed({d2h.get()}, [&] { return d2h->CopyD2H(down.span(), dev); }));
    STRATA_ASSIGN_OR_RETURN(double c, Timed({h2d.get(), d2h.get()}, [&]() -> Status {
                              STRATA_RETURN_IF_ERROR(h2d->CopyH2D(dev, up.span()));
                              return d2h->CopyD2H(down.span(), dev2);
                            }));
    t_h2d.push_back(a);
    t_d2h.push_back(b);
    t_both.push_back(c);
  }
  PinnedBandwidth out;
  out.size_bytes = size_bytes;
  out.repetitions = repetitions;
  const double n = static_cast<double>(size_bytes);
  out.h2d_bytes_per_second = n / Median(t_h2d);
  out.d2h_bytes_per_second = n / Median(t_d2h);
  out.both_bytes_per_second = 2 * n / Median(t_both);
  return out;
}

}  // namespace strata::tools
