#include "io/fault_injection.h"

#include <thread>
#include <utility>

namespace strata::io {

namespace {

// The fields every kind of fault has; the factories below add their own.
Fault MakeFault(Fault::Kind kind, std::optional<IoOp> op, uint64_t nth, uint64_t times) {
  Fault f;
  f.kind = kind;
  f.op = op;
  f.nth = nth;
  f.times = times;
  return f;
}

}  // namespace

Fault Fault::Errno(std::optional<IoOp> op, int errno_value, uint64_t nth, uint64_t times) {
  Fault f = MakeFault(Kind::kErrno, op, nth, times);
  f.errno_value = errno_value;
  return f;
}

Fault Fault::ShortTransfer(std::optional<IoOp> op, uint64_t transfer_bytes, uint64_t nth,
                           uint64_t times) {
  Fault f = MakeFault(Kind::kShortTransfer, op, nth, times);
  f.transfer_bytes = transfer_bytes;
  return f;
}

Fault Fault::Latency(std::optional<IoOp> op, std::chrono::microseconds latency, uint64_t nth,
                     uint64_t times) {
  Fault f = MakeFault(Kind::kLatency, op, nth, times);
  f.latency = latency;
  return f;
}

StatusOr<std::unique_ptr<FaultInjectingBackend>> FaultInjectingBackend::Create(
    IoBackendOptions inner_options) {
  std::unique_ptr<FaultInjectingBackend> backend(new FaultInjectingBackend);
  inner_options.completion_hook = backend.get();
  STRATA_ASSIGN_OR_RETURN(backend->inner_, CreateIoBackend(inner_options));
  return backend;
}

FaultInjectingBackend::~FaultInjectingBackend() {
  inner_.reset();  // its threads may call the hook until they are joined
}

void FaultInjectingBackend::AddFault(const Fault& fault) {
  std::lock_guard<std::mutex> lock(mu_);
  faults_.push_back({fault, 0});
}

void FaultInjectingBackend::ClearFaults() {
  std::lock_guard<std::mutex> lock(mu_);
  faults_.clear();
}

uint64_t FaultInjectingBackend::faults_injected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return injected_;
}

uint64_t FaultInjectingBackend::completions(IoOp op) const {
  std::lock_guard<std::mutex> lock(mu_);
  return op == IoOp::kRead ? reads_ : writes_;
}

Status FaultInjectingBackend::Read(int fd, uint64_t offset_bytes, std::span<std::byte> buf,
                                   std::string_view what) {
  return inner_->Read(fd, offset_bytes, buf, what);
}

Status FaultInjectingBackend::Write(int fd, uint64_t offset_bytes, std::span<const std::byte> buf,
                                    std::string_view what) {
  return inner_->Write(fd, offset_bytes, buf, what);
}

Status FaultInjectingBackend::ReadBatch(std::span<const ReadSegment> segments) {
  return inner_->ReadBatch(segments);
}

Status FaultInjectingBackend::WriteBatch(std::span<const WriteSegment> segments) {
  return inner_->WriteBatch(segments);
}

void FaultInjectingBackend::OnCompletion(IoOp op, int fd, uint64_t offset_bytes,
                                         size_t length_bytes, int64_t* result) {
  std::chrono::microseconds delay{0};
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++(op == IoOp::kRead ? reads_ : writes_);
    bool changed = false;
    for (ActiveFault& active : faults_) {
      const Fault& f = active.fault;
      if ((f.op.has_value() && *f.op != op) || (f.fd >= 0 && f.fd != fd)) continue;
      const uint64_t n = ++active.seen;
      if (n < f.nth || (f.times != Fault::kForever && n - f.nth >= f.times)) continue;
      switch (f.kind) {
        case Fault::Kind::kErrno:
          if (!changed) {
            *result = -static_cast<int64_t>(f.errno_value);
            changed = true;
            ++injected_;
          }
          break;
        case Fault::Kind::kShortTransfer:
          if (!changed && *result >= 0 && static_cast<uint64_t>(*result) > f.transfer_bytes) {
            *result = static_cast<int64_t>(f.transfer_bytes);
            changed = true;
            ++injected_;
          }
          break;
        case Fault::Kind::kLatency:
          delay += f.latency;
          ++injected_;
          break;
      }
    }
  }
  if (delay.count() > 0) std::this_thread::sleep_for(delay);  // outside the lock
}

}  // namespace strata::io
