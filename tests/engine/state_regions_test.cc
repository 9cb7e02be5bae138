// StateRegions (engine/state_regions.h): the host and NVMe homes of a unit's state region, the
// read and write-back stages over pipeline buffers, Load, the synchronous copies, units kept
// elsewhere, and an injected I/O error coming back from the stage.
#include "engine/state_regions.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "io/fault_injection.h"

namespace strata::engine {
namespace {

std::string TempDir(const std::string& tag) {
  const char* base = std::getenv("TMPDIR");
  std::string dir = fmt::format("{}/strata-regions-test-{}-XXXXXX", base ? base : "/tmp", tag);
  EXPECT_NE(::mkdtemp(dir.data()), nullptr);
  return dir;
}

void Fill(std::span<std::byte> s, int seed) {
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<std::byte>((i * 31 + seed) & 0xFF);
}

bool Holds(const std::byte* p, size_t n, int seed) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != static_cast<std::byte>((i * 31 + seed) & 0xFF)) return false;
  }
  return true;
}

TEST(StateRegions, HostHomesAreZeroedRegionsUpdatedInPlace) {
  auto r = StateRegions::Create({});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  StateRegions& regions = **r;
  EXPECT_EQ(regions.swap(), nullptr);
  EXPECT_EQ(regions.io_backend_name(), "");
  ASSERT_EQ(*regions.AddUnit(5000), 0);
  ASSERT_EQ(*regions.AddUnit(300, /*here=*/false), 1);  // kept elsewhere
  ASSERT_EQ(*regions.AddUnit(12), 2);
  EXPECT_EQ(regions.num_units(), 3);
  EXPECT_EQ(regions.region_bytes(1), 300u);
  EXPECT_GE(regions.host_bytes(0), 5000u);
  EXPECT_EQ(regions.host_bytes(1), 0u);
  std::byte* home = regions.Region(0, 0);
  ASSERT_NE(home, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(home) % kDirectIoAlignment, 0u);
  for (size_t i = 0; i < 5000; ++i) ASSERT_EQ(home[i], std::byte{0}) << i;
  EXPECT_EQ(regions.Region(0, 3), home);  // every buffer index is the home
  EXPECT_NE(regions.Region(2, 0), home);
  Fill({home, 5000}, 7);
  EXPECT_TRUE(regions.Write(0, 0).ok());  // nothing to write back
  StatusOr<std::byte*> loaded = regions.Load(0);
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(*loaded, home);
  EXPECT_TRUE(Holds(*loaded, 5000, 7));
  regions.DropLastUnit();
  EXPECT_EQ(regions.num_units(), 2);
  EXPECT_EQ(regions.nvme_bytes_read() + regions.nvme_bytes_written(), 0u);
}

TEST(StateRegions, NvmeUnitsGoThroughThePipelineBuffers) {
  const std::string dir = TempDir("nvme");
  {
    StateRegionsOptions o;
    o.nvme = true;
    o.nvme_paths = {dir};
    o.io.kind = io::BackendKind::kPosix;
    o.extent_name = [](int u) { return fmt::format("unit{}.state", u); };
    auto r = StateRegions::Create(std::move(o));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    StateRegions& regions = **r;
    EXPECT_EQ(regions.io_backend_name(), "posix");
    ASSERT_EQ(*regions.AddUnit(10000), 0);  // its extent and buffers hold 12288 bytes
    ASSERT_EQ(*regions.AddUnit(4096), 1);
    EXPECT_EQ(regions.host_bytes(0), 0u);
    // The extents carry the owner's names.
    EXPECT_EQ(regions.swap()->Allocate("unit1.state", 4096).code(), StatusCode::kAlreadyExists);
    std::vector<AlignedBuffer> buffers;
    std::vector<std::span<std::byte>> views;
    for (int i = 0; i < 2; ++i) {
      buffers.push_back(*AlignedBuffer::Allocate(16384));
      views.push_back(buffers.back().span());
    }
    regions.SetPipelineBuffers(views);
    EXPECT_EQ(regions.Region(0, 1), buffers[1].data());

    Fill(buffers[0].span().subspan(0, 10000), 3);
    ASSERT_TRUE(regions.Write(0, 0).ok());
    Fill(buffers[0].span().subspan(0, 4096), 5);
    ASSERT_TRUE(regions.Write(1, 0).ok());
    std::memset(buffers[1].data(), 0, buffers[1].size_bytes());
    ASSERT_TRUE(regions.Read(0, 1).ok());
    EXPECT_TRUE(Holds(buffers[1].data(), 10000, 3));
    StatusOr<std::byte*> loaded = regions.Load(1);
    ASSERT_TRUE(loaded.ok());
    EXPECT_EQ(*loaded, buffers[0].data());
    EXPECT_TRUE(Holds(*loaded, 4096, 5));
    // Load without reading leaves the buffer as it is.
    std::memset(buffers[0].data(), 0xAB, 4096);
    ASSERT_TRUE(regions.Load(0, /*read=*/false).ok());
    EXPECT_EQ(buffers[0].data()[0], std::byte{0xAB});

    // The synchronous copies, outside the pipeline buffers.
    AlignedBuffer own = *AlignedBuffer::Allocate(10000);
    Fill(own.span().subspan(0, 10000), 9);
    ASSERT_TRUE(regions.WriteFrom(0, own.span()).ok());
    AlignedBuffer back = *AlignedBuffer::Allocate(10000);
    ASSERT_TRUE(regions.ReadTo(0, back.span()).ok());
    EXPECT_TRUE(Holds(back.data(), 10000, 9));
    // A span short of the padded extent (12288 bytes) is refused before any I/O.
    EXPECT_EQ(regions.ReadTo(0, back.span().first(10000)).code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Holds(back.data(), 10000, 9));
    EXPECT_GT(regions.nvme_bytes_read(), 0u);
    EXPECT_GT(regions.nvme_bytes_written(), 0u);
  }
  std::filesystem::remove_all(dir);
}

TEST(StateRegions, AnInjectedReadErrorComesBackFromTheReadStage) {
  const std::string dir = TempDir("eio");
  {
    io::FaultInjectingBackend* faults = nullptr;
    StateRegionsOptions o;
    o.nvme = true;
    o.nvme_paths = {dir};
    o.io.kind = io::BackendKind::kPosix;
    o.extent_name = [](int u) { return fmt::format("bucket{}.state", u); };
    o.io_backend_factory =
        [&](const io::IoBackendOptions& io) -> StatusOr<std::unique_ptr<io::IoBackend>> {
      STRATA_ASSIGN_OR_RETURN(auto f, io::FaultInjectingBackend::Create(io));
      faults = f.get();
      return std::unique_ptr<io::IoBackend>(std::move(f));
    };
    auto r = StateRegions::Create(std::move(o));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_NE(faults, nullptr);
    StateRegions& regions = **r;
    ASSERT_EQ(*regions.AddUnit(8192), 0);
    AlignedBuffer buffer = *AlignedBuffer::Allocate(8192);
    regions.SetPipelineBuffers({buffer.span()});
    ASSERT_TRUE(regions.Write(0, 0).ok());
    faults->AddFault(io::Fault::Errno(io::IoOp::kRead, EIO));
    const Status failed = regions.Read(0, 0);
    EXPECT_FALSE(failed.ok());
    EXPECT_NE(failed.ToString().find("bucket0.state"), std::string::npos) << failed.ToString();
    EXPECT_TRUE(regions.Read(0, 0).ok());  // nothing sticky here: the owner's pipeline is
  }
  std::filesystem::remove_all(dir);
}

TEST(StateRegions, NvmeHomesNeedExtentNames) {
  StateRegionsOptions o;
  o.nvme = true;
  o.nvme_paths = {"/tmp"};
  auto r = StateRegions::Create(std::move(o));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::engine
