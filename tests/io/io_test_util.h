// Shared helpers and parameterized fixtures of the io/ tests. The TEST_P bodies live in
// backend_test.cc, fault_injection_test.cc and swap_store_test.cc; they are instantiated for
// "posix" and "memory" in io_test (instantiate_portable.cc) and for "uring" in io_uring_test
// (instantiate_uring.cc, CTest label `uring`).
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/unique_fd.h"
#include "io/io_backend.h"

namespace strata::io::testing {

// Small pieces and a shallow queue so that modest sizes exercise splitting and queue refills.
inline constexpr size_t kBlockBytes = 16 * 1024;
inline constexpr uint64_t kStripeBytes = 8 * 1024;

inline IoBackendOptions SmallOptions(BackendKind kind) {
  IoBackendOptions options;
  options.kind = kind;
  options.queue_depth = 4;
  options.block_size_bytes = kBlockBytes;
  options.posix_threads = 3;
  return options;
}

// A private directory under the system temp dir, removed with its contents at destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "strata-io-test-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string File(std::string_view name) const { return path_ + "/" + std::string(name); }

 private:
  std::string path_;
};

inline UniqueFd OpenFile(const std::string& path, bool direct, int access = O_RDWR) {
  return UniqueFd(
      ::open(path.c_str(), access | O_CREAT | O_CLOEXEC | (direct ? O_DIRECT : 0), 0600));
}

inline void FillRandom(std::span<std::byte> out, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(out.data() + i, &v, 8);
  }
  for (; i < out.size(); ++i) out[i] = static_cast<std::byte>(rng());
}

inline std::vector<std::byte> RandomBytes(size_t size_bytes, uint64_t seed) {
  std::vector<std::byte> v(size_bytes);
  FillRandom(v, seed);
  return v;
}

// A 4096-aligned buffer of at least size_bytes (rounded up), random contents.
inline AlignedBuffer RandomAligned(size_t size_bytes, uint64_t seed) {
  AlignedBuffer b = std::move(AlignedBuffer::Allocate(size_bytes)).value();
  FillRandom(b.span(), seed);
  return b;
}

inline AlignedBuffer ZeroAligned(size_t size_bytes) {
  return std::move(AlignedBuffer::Allocate(size_bytes)).value();
}

inline bool SameBytes(const std::byte* a, const std::byte* b, size_t size_bytes) {
  return std::memcmp(a, b, size_bytes) == 0;
}

// Parameter: the backend under test. Skips (with the reason) when "uring" is unusable here.
class BackendParamTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    if (GetParam() == BackendKind::kUring) {
      const Status probe = ProbeUring();
      if (!probe.ok()) GTEST_SKIP() << "io_uring is unusable here: " << probe.ToString();
    }
  }
  bool real_files() const { return GetParam() != BackendKind::kMemory; }
};

class BackendTest : public BackendParamTest {};
class FaultInjectionTest : public BackendParamTest {};
class SwapStoreTest : public BackendParamTest {};
// Backends whose data really lands in the swap files ("posix", "uring").
class SwapStoreOnDiskTest : public BackendParamTest {};

inline std::string BackendParamName(const ::testing::TestParamInfo<BackendKind>& info) {
  return std::string(BackendKindName(info.param));
}

}  // namespace strata::io::testing
