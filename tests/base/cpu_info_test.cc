// CpuInfo against independent sources: /proc/cpuinfo (the kernel's view of CPUID after it
// cleared what XCR0 does not enable), sysinfo(2) and sysconf.
#include "base/cpu_info.h"

#include <gtest/gtest.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

namespace strata {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Trimmed(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.pop_back();
  size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
  return s.substr(i);
}

// Values of every "key : value" line of /proc/cpuinfo with this key, in order.
std::vector<std::string> CpuinfoValues(const std::string& key) {
  std::istringstream in(ReadAll("/proc/cpuinfo"));
  std::vector<std::string> values;
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    if (Trimmed(line.substr(0, colon)) == key) values.push_back(Trimmed(line.substr(colon + 1)));
  }
  return values;
}

TEST(CpuInfo, IsaMatchesTheKernelsCpuinfoFlagsOneByOne) {
  const auto flag_lines = CpuinfoValues("flags");
  if (flag_lines.empty()) GTEST_SKIP() << "/proc/cpuinfo has no 'flags' line (not x86 Linux)";
  std::set<std::string> flags;
  std::istringstream words(flag_lines.front());
  for (std::string w; words >> w;) flags.insert(w);
  const CpuIsa isa = DetectCpuIsa();
  int present = 0;
  for (const auto& [name, have] : CpuIsaFlags(isa)) {
    EXPECT_EQ(have, flags.count(std::string(name)) == 1)
        << name << ": CPUID+XCR0 says " << have << ", /proc/cpuinfo disagrees";
    present += have;
  }
  // Every x86-64 CPU this project targets has SSE4.2; a detector returning all-false fails here.
  EXPECT_TRUE(isa.sse4_2);
  EXPECT_GT(present, 0);
}

TEST(CpuInfo, IsaImplicationsHold) {
  const CpuIsa isa = DetectCpuIsa();
  if (isa.avx2) {
    EXPECT_TRUE(isa.avx);
  }
  if (isa.avx512f) {
    EXPECT_TRUE(isa.avx2);
  }
  for (bool sub : {isa.avx512bw, isa.avx512vl, isa.avx512dq, isa.avx512_bf16, isa.avx512_fp16}) {
    if (sub) {
      EXPECT_TRUE(isa.avx512f);
    }
  }
  if (isa.amx_bf16 || isa.amx_int8) {
    EXPECT_TRUE(isa.amx_tile);
  }
}

TEST(CpuInfo, VendorModelAndCountsMatchCpuinfoAndSysconf) {
  auto info = DetectCpuInfo();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  const auto vendors = CpuinfoValues("vendor_id");
  const auto models = CpuinfoValues("model name");
  if (!vendors.empty()) {
    EXPECT_EQ(info->vendor, vendors.front());
  }
  // The model is CPUID's brand string; the kernel's "model name" is the same string on bare metal
  // but not under every hypervisor (seen: CPUID "Oxide Virtual Turin-like Processor", /proc/cpuinfo
  // "AMD EPYC"), so a difference is reported, not failed. Both must name something.
  EXPECT_FALSE(info->model.empty());
  if (!models.empty() && info->model != models.front()) {
    ::testing::Test::RecordProperty("cpuinfo_model_name", models.front());
    std::printf("note: CPUID brand '%s', /proc/cpuinfo model name '%s'\n", info->model.c_str(),
                models.front().c_str());
  }
  EXPECT_FALSE(info->vendor.empty());

  EXPECT_EQ(info->logical_cores, static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)));
  EXPECT_EQ(static_cast<size_t>(info->logical_cores), CpuinfoValues("processor").size());
  EXPECT_GE(info->affinity_cores, 1);
  EXPECT_LE(info->affinity_cores, info->logical_cores);

  // Physical cores: distinct (physical id, core id) pairs of /proc/cpuinfo.
  const auto packages = CpuinfoValues("physical id");
  const auto core_ids = CpuinfoValues("core id");
  if (!packages.empty() && packages.size() == core_ids.size()) {
    std::set<std::pair<std::string, std::string>> cores;
    for (size_t i = 0; i < packages.size(); ++i) cores.insert({packages[i], core_ids[i]});
    EXPECT_EQ(info->physical_cores, static_cast<int>(cores.size()));
  }
  if (info->physical_cores > 0) {
    EXPECT_LE(info->physical_cores, info->logical_cores);
  }

  // NUMA nodes: the node<N> directories.
  int node_dirs = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/sys/devices/system/node", ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 4 && n.compare(0, 4, "node") == 0 &&
        n.find_first_not_of("0123456789", 4) == std::string::npos) {
      ++node_dirs;
    }
  }
  EXPECT_EQ(info->numa_nodes, node_dirs == 0 ? 1 : node_dirs);
}

TEST(CpuInfo, MemoryMatchesSysinfo) {
  auto info = DetectCpuInfo();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  struct sysinfo si {};
  ASSERT_EQ(::sysinfo(&si), 0);
  const uint64_t total = static_cast<uint64_t>(si.totalram) * si.mem_unit;
  // Both report the kernel's totalram_pages; /proc/meminfo rounds to KiB.
  EXPECT_NEAR(static_cast<double>(info->mem_total_bytes), static_cast<double>(total), 1024.0);
  EXPECT_GT(info->mem_available_bytes, 0u);
  EXPECT_LE(info->mem_available_bytes, info->mem_total_bytes);
}

TEST(CpuInfo, ParseMeminfoReadsKibAsBytesAndEstimatesAvailableOnOldKernels) {
  auto m = ParseMeminfo(
      "MemTotal:       16318412 kB\nMemFree:  100 kB\nMemAvailable:   "
      "8000000 kB\nBuffers: 5 kB\n");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->total_bytes, 16318412ull * 1024);
  EXPECT_EQ(m->available_bytes, 8000000ull * 1024);

  auto old = ParseMeminfo("MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 20 kB\nCached: 300 kB\n");
  ASSERT_TRUE(old.ok());
  EXPECT_EQ(old->available_bytes, (100u + 20 + 300) * 1024);
}

TEST(CpuInfo, ParseMeminfoRejectsMissingOrMalformedTotal) {
  auto missing = ParseMeminfo("MemFree: 100 kB\n");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("MemTotal"), std::string::npos);
  auto malformed = ParseMeminfo("MemTotal: 12x4 kB\n");
  ASSERT_FALSE(malformed.ok());
  EXPECT_NE(malformed.status().message().find("12x4"), std::string::npos);
}

TEST(CpuInfo, CountListEntriesCountsRangesAndSingles) {
  EXPECT_EQ(*CountListEntries("0\n"), 1);
  EXPECT_EQ(*CountListEntries("0-3"), 4);
  EXPECT_EQ(*CountListEntries("0-3,8,10-11\n"), 7);
  EXPECT_EQ(*CountListEntries(""), 0);
  for (const char* bad : {"3-1", "a", "0-", "1,,2", "-4"}) {
    auto r = CountListEntries(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_NE(r.status().message().find(bad), std::string::npos) << bad;
    }
  }
}

TEST(CpuInfo, DescribeIsaNamesTheFamilies) {
  CpuIsa isa;
  EXPECT_EQ(DescribeIsa(isa), "baseline");
  isa.sse4_2 = isa.avx = isa.avx2 = isa.fma = isa.f16c = true;
  EXPECT_EQ(DescribeIsa(isa), "AVX2 FMA F16C");
  isa.avx512f = isa.avx512bw = isa.avx512vl = isa.avx512dq = isa.avx512_bf16 = true;
  isa.amx_tile = isa.amx_bf16 = isa.amx_int8 = true;
  EXPECT_EQ(DescribeIsa(isa), "AVX2 FMA F16C AVX-512F/BW/VL/DQ AVX512_BF16 AMX-BF16/INT8");
}

}  // namespace
}  // namespace strata
