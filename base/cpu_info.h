// What this host's CPUs and memory offer: vendor and model, the ISA extensions that the CPU has
// AND the operating system has enabled, core and NUMA counts, total and available memory.
//
// ISA flags come from CPUID and XGETBV (Intel SDM Vol. 1 ch. 13 "Managing State Using the XSAVE
// Feature Set"; Vol. 2A "CPUID"): a vector extension is reported only when CPUID lists it and
// XCR0 says the OS saves its register state on context switch (XMM|YMM for AVX/AVX2/FMA/F16C,
// plus opmask|ZMM_Hi256|Hi16_ZMM for AVX-512, plus XTILECFG|XTILEDATA for AMX). On Linux a
// process must still request AMX tile state with arch_prctl(ARCH_REQ_XCOMP_PERM) before using
// it; `amx_*` here says only that the CPU and kernel support it. On non-x86 builds every flag is
// false and the vendor/model come from /proc/cpuinfo alone.
//
// Counts and memory come from Linux: logical cores = online CPUs (sysconf), cores usable by
// this process = its affinity mask (sched_getaffinity; smaller in a cgroup/taskset), physical
// cores = distinct (package, core) pairs of /sys/devices/system/cpu/cpu*/topology, NUMA nodes =
// /sys/devices/system/node/online, memory = MemTotal / MemAvailable of /proc/meminfo (bytes).
//
// Thread-safety: DetectCpuInfo reads files and executes CPUID; safe to call from any thread,
// not cached. The parse helpers are pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace strata {

// Usable ISA extensions (CPU support AND OS-enabled register state, see the file comment).
// Names follow the flags of /proc/cpuinfo.
struct CpuIsa {
  bool sse4_2 = false;
  bool avx = false;
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512_bf16 = false;
  bool avx512_fp16 = false;
  bool amx_tile = false;
  bool amx_bf16 = false;
  bool amx_int8 = false;
};

// One (name, present) pair per CpuIsa field, in the order above, names as in /proc/cpuinfo
// ("sse4_2", "avx512_bf16", "amx_tile", ...).
std::vector<std::pair<std::string_view, bool>> CpuIsaFlags(const CpuIsa& isa);

// "AVX2 FMA F16C AVX-512F/BW/VL/DQ AVX512_BF16 AMX-BF16": the usable extensions for people,
// from AVX up (SSE4.2 is omitted when AVX is present); "none beyond SSE4.2" / "baseline".
std::string DescribeIsa(const CpuIsa& isa);

struct CpuInfo {
  std::string vendor;  // CPUID vendor id: "GenuineIntel", "AuthenticAMD"; else /proc/cpuinfo
  std::string model;   // brand string, trimmed: "Intel(R) Xeon(R) Gold 6430"; "" if unknown
  CpuIsa isa;
  int logical_cores = 0;   // online CPUs (hardware threads)
  int affinity_cores = 0;  // CPUs this process may run on (<= logical_cores)
  int physical_cores = 0;  // distinct (package, core) pairs; 0 if the topology is not exposed
  int numa_nodes = 0;      // online NUMA nodes; 1 when the kernel exposes no node directory
  uint64_t mem_total_bytes = 0;
  uint64_t mem_available_bytes = 0;  // MemAvailable: what can be allocated without swapping
};

// Reads everything above. Errors: kUnavailable when /proc/meminfo cannot be read or lacks
// MemTotal (not Linux, or /proc not mounted); the message names the file. Missing topology or
// NUMA files are not errors (physical_cores 0, numa_nodes 1).
StatusOr<CpuInfo> DetectCpuInfo();

// Only the ISA (CPUID + XGETBV, no file access). All false on non-x86 builds.
CpuIsa DetectCpuIsa();

// Parses /proc/meminfo text ("MemTotal:  16318412 kB" lines) into bytes. kInvalidArgument when
// MemTotal is missing or a number is malformed; MemAvailable missing (kernels before 3.14) is
// estimated as MemFree + Buffers + Cached.
struct MemInfo {
  uint64_t total_bytes = 0;
  uint64_t available_bytes = 0;
};
StatusOr<MemInfo> ParseMeminfo(std::string_view text);

// Counts the CPUs of a Linux cpu/node list such as "0-3,8,10-11\n" (-> 7). kInvalidArgument
// naming the text when malformed (a range whose end is below its start, a non-number).
StatusOr<int> CountListEntries(std::string_view list);

}  // namespace strata
