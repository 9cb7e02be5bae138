#include "gpu/device.h"

#include <fmt/format.h>

#include "base/units.h"

namespace strata::gpu {

std::string_view DeviceKindName(DeviceKind kind) {
  return kind == DeviceKind::kCuda ? "cuda" : "host";
}

DeviceSpan DeviceSpan::subspan(size_t offset_bytes, size_t size) const {
  STRATA_CHECK(offset_bytes + size <= size_bytes);
  return {data + offset_bytes, size};
}

PinnedSpan PinnedSpan::subspan(size_t offset_bytes, size_t size) const {
  STRATA_CHECK(offset_bytes + size <= size_bytes);
  return {data + offset_bytes, size};
}

PinnedBuffer::PinnedBuffer(std::byte* data, size_t size_bytes, Deleter deleter)
    : data_(data), size_bytes_(size_bytes), deleter_(std::move(deleter)) {}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (data_ && deleter_) deleter_(data_, size_bytes_);
    data_ = std::exchange(o.data_, nullptr);
    size_bytes_ = std::exchange(o.size_bytes_, 0);
    deleter_ = std::move(o.deleter_);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ && deleter_) deleter_(data_, size_bytes_);
}

StatusOr<DeviceSpan> DeviceArena::Carve(size_t size_bytes, std::string_view label) {
  const size_t size = AlignUp(size_bytes, kAlignment);
  if (size > capacity_bytes_ - used_bytes_) {
    return ResourceExhaustedError(fmt::format(
        "device arena: '{}' needs {} but only {} of {} is left", label, FormatBytes(size),
        FormatBytes(capacity_bytes_ - used_bytes_), FormatBytes(capacity_bytes_)));
  }
  DeviceSpan span{base_ + used_bytes_, size_bytes};
  used_bytes_ += size;
  return span;
}

Status Device::ReservePinned(size_t size_bytes, std::string_view label) {
  size_t used = pinned_used_.load();
  do {
    if (size_bytes > pinned_budget_bytes_ - std::min(used, pinned_budget_bytes_)) {
      return ResourceExhaustedError(fmt::format(
          "pinned host memory: '{}' needs {} but {} of the {} budget is in use; raise the host "
          "budget or offload more to NVMe",
          label, FormatBytes(size_bytes), FormatBytes(used), FormatBytes(pinned_budget_bytes_)));
    }
  } while (!pinned_used_.compare_exchange_weak(used, used + size_bytes));
  return Status::Ok();
}

StatusOr<PinnedBuffer> Device::AllocatePinned(size_t size_bytes, std::string_view label) {
  const size_t size = AlignUp(size_bytes, 4096);
  STRATA_RETURN_IF_ERROR(ReservePinned(size, label));
  auto data = PinnedAlloc(size);
  if (!data.ok()) {
    pinned_used_ -= size;
    return data.status().WithContext(fmt::format("pinning {} for '{}'", FormatBytes(size), label));
  }
  return PinnedBuffer(*data, size, [this](std::byte* p, size_t n) {
    PinnedFree(p, n);
    pinned_used_ -= n;
  });
}

StatusOr<PinnedBuffer> Device::RegisterPinned(std::byte* data, size_t size_bytes,
                                              std::string_view label) {
  if (reinterpret_cast<uintptr_t>(data) % 4096 != 0 || size_bytes % 4096 != 0) {
    return InvalidArgumentError(
        fmt::format("pinning '{}': {} at {} is not 4 KiB-aligned memory in whole pages", label,
                    FormatBytes(size_bytes), static_cast<const void*>(data)));
  }
  STRATA_RETURN_IF_ERROR(ReservePinned(size_bytes, label));
  const Status s = PinnedRegister(data, size_bytes);
  if (!s.ok()) {
    pinned_used_ -= size_bytes;
    return s.WithContext(fmt::format("pinning {} for '{}'", FormatBytes(size_bytes), label));
  }
  return PinnedBuffer(data, size_bytes, [this](std::byte* p, size_t n) {
    PinnedUnregister(p, n);
    pinned_used_ -= n;
  });
}

DeviceCounters Device::counters() const { return {bytes_h2d_.load(), bytes_d2h_.load()}; }

}  // namespace strata::gpu
