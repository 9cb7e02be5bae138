#include "base/cpu_info.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define STRATA_CPU_INFO_X86 1
#endif

namespace strata {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n')) {
    s.remove_prefix(1);
  }
  while (!s.empty() &&
         (s.back() == ' ' || s.back() == '\t' || s.back() == '\n' || s.back() == '\0')) {
    s.remove_suffix(1);
  }
  return s;
}

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

bool ParseUint(std::string_view s, uint64_t* v) {
  s = Trim(s);
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
  return ec == std::errc() && p == s.data() + s.size();
}

// The value of the first "key\t: value" line of /proc/cpuinfo text, or "".
std::string CpuinfoField(const std::string& cpuinfo, std::string_view key) {
  std::istringstream in(cpuinfo);
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    if (Trim(std::string_view(line).substr(0, colon)) == key) {
      return std::string(Trim(std::string_view(line).substr(colon + 1)));
    }
  }
  return "";
}

#ifdef STRATA_CPU_INFO_X86
struct Regs {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

Regs Cpuid(unsigned leaf, unsigned subleaf = 0) {
  Regs r;
  __cpuid_count(leaf, subleaf, r.eax, r.ebx, r.ecx, r.edx);
  return r;
}

uint64_t Xgetbv0() {
  unsigned lo = 0, hi = 0;
  // XGETBV with ECX = 0 reads XCR0; encoded as bytes so no -mxsave is needed.
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool Bit(unsigned reg, int bit) { return (reg >> bit) & 1u; }

std::string CpuidVendor() {
  const Regs r = Cpuid(0);
  char v[13] = {};
  std::memcpy(v, &r.ebx, 4);
  std::memcpy(v + 4, &r.edx, 4);
  std::memcpy(v + 8, &r.ecx, 4);
  return v;
}

std::string CpuidBrand() {
  if (Cpuid(0x80000000).eax < 0x80000004) return "";
  char brand[49] = {};
  for (unsigned i = 0; i < 3; ++i) {
    const Regs r = Cpuid(0x80000002 + i);
    std::memcpy(brand + 16 * i, &r.eax, 4);
    std::memcpy(brand + 16 * i + 4, &r.ebx, 4);
    std::memcpy(brand + 16 * i + 8, &r.ecx, 4);
    std::memcpy(brand + 16 * i + 12, &r.edx, 4);
  }
  return std::string(Trim(brand));
}
#endif

// Distinct (physical_package_id, core_id) pairs over the CPUs listed under sysfs.
int CountPhysicalCores() {
  namespace fs = std::filesystem;
  std::set<std::pair<uint64_t, uint64_t>> cores;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/sys/devices/system/cpu", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() < 4 || name.compare(0, 3, "cpu") != 0) continue;
    if (!std::all_of(name.begin() + 3, name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      continue;
    }
    std::string package, core;
    uint64_t p = 0, c = 0;
    if (!ReadFile(entry.path().string() + "/topology/physical_package_id", &package) ||
        !ReadFile(entry.path().string() + "/topology/core_id", &core) || !ParseUint(package, &p) ||
        !ParseUint(core, &c)) {
      continue;  // offline CPUs have no topology directory
    }
    cores.insert({p, c});
  }
  return static_cast<int>(cores.size());
}

}  // namespace

std::vector<std::pair<std::string_view, bool>> CpuIsaFlags(const CpuIsa& isa) {
  return {{"sse4_2", isa.sse4_2},
          {"avx", isa.avx},
          {"avx2", isa.avx2},
          {"fma", isa.fma},
          {"f16c", isa.f16c},
          {"avx512f", isa.avx512f},
          {"avx512bw", isa.avx512bw},
          {"avx512vl", isa.avx512vl},
          {"avx512dq", isa.avx512dq},
          {"avx512_bf16", isa.avx512_bf16},
          {"avx512_fp16", isa.avx512_fp16},
          {"amx_tile", isa.amx_tile},
          {"amx_bf16", isa.amx_bf16},
          {"amx_int8", isa.amx_int8}};
}

std::string DescribeIsa(const CpuIsa& isa) {
  std::vector<std::string> parts;
  if (isa.avx2) {
    parts.push_back("AVX2");
  } else if (isa.avx) {
    parts.push_back("AVX");
  } else if (isa.sse4_2) {
    parts.push_back("SSE4.2");
  }
  if (isa.fma) parts.push_back("FMA");
  if (isa.f16c) parts.push_back("F16C");
  if (isa.avx512f) {
    std::string s = "AVX-512F";
    if (isa.avx512bw) s += "/BW";
    if (isa.avx512vl) s += "/VL";
    if (isa.avx512dq) s += "/DQ";
    parts.push_back(s);
  }
  if (isa.avx512_bf16) parts.push_back("AVX512_BF16");
  if (isa.avx512_fp16) parts.push_back("AVX512_FP16");
  if (isa.amx_tile) {
    std::string s = "AMX";
    if (isa.amx_bf16) s += "-BF16";
    if (isa.amx_int8) s += isa.amx_bf16 ? "/INT8" : "-INT8";
    parts.push_back(s);
  }
  if (parts.empty()) return "baseline";
  return fmt::format("{}", fmt::join(parts, " "));
}

CpuIsa DetectCpuIsa() {
  CpuIsa isa;
#ifdef STRATA_CPU_INFO_X86
  const unsigned max_leaf = Cpuid(0).eax;
  if (max_leaf < 1) return isa;
  const Regs l1 = Cpuid(1);
  isa.sse4_2 = Bit(l1.ecx, 20);
  const bool osxsave = Bit(l1.ecx, 27);
  const uint64_t xcr0 = osxsave ? Xgetbv0() : 0;
  const bool ymm_state = (xcr0 & 0x6) == 0x6;       // XMM (bit 1) and YMM (bit 2)
  const bool zmm_state = (xcr0 & 0xe0) == 0xe0;     // opmask, ZMM_Hi256, Hi16_ZMM (bits 5-7)
  const bool tile_state = ((xcr0 >> 17) & 3) == 3;  // XTILECFG, XTILEDATA (bits 17-18)
  isa.avx = Bit(l1.ecx, 28) && ymm_state;
  isa.fma = Bit(l1.ecx, 12) && ymm_state;
  isa.f16c = Bit(l1.ecx, 29) && ymm_state;
  if (max_leaf >= 7) {
    const Regs l7 = Cpuid(7, 0);
    isa.avx2 = Bit(l7.ebx, 5) && ymm_state;
    const bool avx512 = ymm_state && zmm_state;
    isa.avx512f = Bit(l7.ebx, 16) && avx512;
    isa.avx512dq = Bit(l7.ebx, 17) && avx512;
    isa.avx512bw = Bit(l7.ebx, 30) && avx512;
    isa.avx512vl = Bit(l7.ebx, 31) && avx512;
    isa.avx512_fp16 = Bit(l7.edx, 23) && avx512;
    isa.amx_bf16 = Bit(l7.edx, 22) && tile_state;
    isa.amx_tile = Bit(l7.edx, 24) && tile_state;
    isa.amx_int8 = Bit(l7.edx, 25) && tile_state;
    if (l7.eax >= 1) {
      const Regs l7_1 = Cpuid(7, 1);
      isa.avx512_bf16 = Bit(l7_1.eax, 5) && avx512;
    }
  }
#endif
  return isa;
}

StatusOr<MemInfo> ParseMeminfo(std::string_view text) {
  MemInfo info;
  bool have_total = false, have_available = false;
  uint64_t free_bytes = 0, buffers_bytes = 0, cached_bytes = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    const std::string_view key = line.substr(0, colon);
    std::string_view value = Trim(line.substr(colon + 1));
    uint64_t multiplier = 1;
    if (value.size() > 3 && value.substr(value.size() - 3) == " kB") {
      value.remove_suffix(3);
      multiplier = 1024;  // /proc/meminfo's "kB" is KiB
    }
    uint64_t* target = nullptr;
    if (key == "MemTotal" || key == "MemAvailable") {
      uint64_t v = 0;
      if (!ParseUint(value, &v)) {
        return InvalidArgumentError(
            fmt::format("/proc/meminfo: malformed {} line '{}'", key, std::string(line)));
      }
      if (key == "MemTotal") {
        info.total_bytes = v * multiplier;
        have_total = true;
      } else {
        info.available_bytes = v * multiplier;
        have_available = true;
      }
      continue;
    }
    if (key == "MemFree") target = &free_bytes;
    if (key == "Buffers") target = &buffers_bytes;
    if (key == "Cached") target = &cached_bytes;
    if (target != nullptr) {
      uint64_t v = 0;
      if (ParseUint(value, &v)) *target = v * multiplier;
    }
  }
  if (!have_total) {
    return InvalidArgumentError("/proc/meminfo has no MemTotal line");
  }
  if (!have_available) info.available_bytes = free_bytes + buffers_bytes + cached_bytes;
  return info;
}

StatusOr<int> CountListEntries(std::string_view list) {
  list = Trim(list);
  int count = 0;
  size_t pos = 0;
  auto bad = [&] {
    return InvalidArgumentError(
        fmt::format("malformed CPU/node list '{}': expected e.g. '0-3,8'", std::string(list)));
  };
  if (list.empty()) return 0;
  while (pos <= list.size()) {
    size_t end = list.find(',', pos);
    if (end == std::string_view::npos) end = list.size();
    const std::string_view item = list.substr(pos, end - pos);
    pos = end + 1;
    const size_t dash = item.find('-');
    uint64_t lo = 0, hi = 0;
    if (dash == std::string_view::npos) {
      if (!ParseUint(item, &lo)) return bad();
      hi = lo;
    } else if (!ParseUint(item.substr(0, dash), &lo) || !ParseUint(item.substr(dash + 1), &hi) ||
               hi < lo) {
      return bad();
    }
    count += static_cast<int>(hi - lo + 1);
    if (end == list.size()) break;
  }
  return count;
}

StatusOr<CpuInfo> DetectCpuInfo() {
  CpuInfo info;
  std::string cpuinfo;
  ReadFile("/proc/cpuinfo", &cpuinfo);  // optional: the ISA and counts do not need it
#ifdef STRATA_CPU_INFO_X86
  info.vendor = CpuidVendor();
  info.model = CpuidBrand();
#endif
  if (info.vendor.empty()) info.vendor = CpuinfoField(cpuinfo, "vendor_id");
  if (info.model.empty()) info.model = CpuinfoField(cpuinfo, "model name");
  info.isa = DetectCpuIsa();

  info.logical_cores = static_cast<int>(std::max<long>(1, ::sysconf(_SC_NPROCESSORS_ONLN)));
  cpu_set_t set;
  CPU_ZERO(&set);
  info.affinity_cores =
      ::sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : info.logical_cores;
  info.physical_cores = CountPhysicalCores();

  std::string nodes;
  info.numa_nodes = 1;
  if (ReadFile("/sys/devices/system/node/online", &nodes)) {
    auto n = CountListEntries(nodes);
    if (n.ok() && *n > 0) info.numa_nodes = *n;
  }

  std::string meminfo;
  if (!ReadFile("/proc/meminfo", &meminfo)) {
    return UnavailableError("cannot read /proc/meminfo: is /proc mounted (Linux only)?");
  }
  auto mem = ParseMeminfo(meminfo);
  if (!mem.ok()) return UnavailableError(mem.status().message());
  info.mem_total_bytes = mem->total_bytes;
  info.mem_available_bytes = mem->available_bytes;
  return info;
}

}  // namespace strata
