#include "engine/plan/machine_profile.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/file.h"
#include "base/untrusted_text.h"

namespace strata::engine {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kRegenerate =
    "fix it or write the file again with `strata doctor --machine-profile FILE`";

Status BadKey(const std::string& source, const std::string& key, std::string_view what) {
  return InvalidArgumentError(
      fmt::format("machine profile {}: \"{}\" {}; {}", source, Excerpt(key), what, kRegenerate));
}

// The plausible ranges of machine_profile.h: a value outside them is a broken file, and would
// give a step time of 0, inf or nan (5e-324 GB/s), or overflow a size (1e20 GiB).
struct Range {
  double lo, hi;
  const char* unit;
};
constexpr Range kRate{1e-3, 1e6, "GB/s"};
constexpr Range kTflops{1e-3, 1e6, "TFLOP/s"};
constexpr Range kGiB{1e-3, 1048576, "GiB"};
constexpr Range kCores{1, 65536, "cores"};
constexpr Range kParamsPerS{1, 1e15, "parameters/s"};

// The number at section[key], in `range`, and integral when `integral`.
StatusOr<double> PositiveNumber(const Json& section, const std::string& source,
                                const std::string& section_name, const char* key, Range range,
                                bool integral = false) {
  const std::string full = section_name + "." + key;
  if (!section.contains(key)) return BadKey(source, full, "is missing");
  const Json& v = section.at(key);
  if (!v.is_number()) {
    return BadKey(source, full, fmt::format("is {}, not a number", JsonExcerpt(v)));
  }
  const double d = v.get<double>();
  if (!(d >= range.lo && d <= range.hi)) {
    return BadKey(source, full,
                  fmt::format("is {}, outside the plausible range [{}, {}] {}", JsonExcerpt(v),
                              range.lo, range.hi, range.unit));
  }
  if (integral && d != static_cast<double>(static_cast<int64_t>(d))) {
    return BadKey(source, full, fmt::format("is {}, not a whole number", JsonExcerpt(v)));
  }
  return d;
}

// The object at root[name], or nullptr when absent.
StatusOr<const Json*> Section(const Json& root, const std::string& source, const char* name) {
  if (!root.contains(name)) return static_cast<const Json*>(nullptr);
  const Json& s = root.at(name);
  if (!s.is_object()) {
    return BadKey(source, name, fmt::format("is {}, not an object", JsonExcerpt(s)));
  }
  return &s;
}

}  // namespace

double DatasheetPeakBf16Tflops(std::string_view device_name) {
  std::vector<std::string> words;
  std::string word;
  for (const char c : device_name) {
    if (c == ' ' || c == '-' || c == '_') {
      if (!word.empty()) words.push_back(std::move(word));
      word.clear();
    } else {
      word += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    }
  }
  if (!word.empty()) words.push_back(std::move(word));
  auto has = [&](std::string_view w) {
    return std::find(words.begin(), words.end(), w) != words.end();
  };
  // The first row whose words the name all has; more specific rows first.
  struct Row {
    std::string_view a, b;  // b empty: a alone
    double tflops;
  };
  static constexpr Row kTable[] = {
      {"H100", "PCIE", 756}, {"H100", "NVL", 835}, {"H100", "", 989}, {"H200", "NVL", 835},
      {"H200", "", 989},     {"GH200", "", 989},   {"A100", "", 312}, {"L40S", "", 362},
      {"L4", "", 121},       {"4090", "RTX", 165},
  };
  for (const Row& r : kTable) {
    if (has(r.a) && (r.b.empty() || has(r.b))) return r.tflops;
  }
  return 0;
}

std::string MachineProfileJson(const MachineProfile& p) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (p.device) {
    j["device"] = {{"name", p.device->name},
                   {"memory_GiB", p.device->memory_GiB},
                   {"bf16_TFLOPs", p.device->bf16_TFLOPs},
                   {"memory_GBps", p.device->memory_GBps}};
    if (p.device->peak_bf16_TFLOPs > 0) {
      j["device"]["peak_bf16_TFLOPs"] = p.device->peak_bf16_TFLOPs;
    }
  }
  if (p.pcie) j["pcie"] = {{"h2d_GBps", p.pcie->h2d_GBps}, {"d2h_GBps", p.pcie->d2h_GBps}};
  if (p.host) {
    nlohmann::ordered_json rates = nlohmann::ordered_json::object();
    for (const auto& [kind, rate] : p.host->optimizer_params_per_s) rates[kind] = rate;
    j["host"] = {{"cores", p.host->cores},
                 {"memory_GiB", p.host->memory_GiB},
                 {"optimizer_params_per_s", rates}};
  }
  if (p.nvme) j["nvme"] = {{"read_GBps", p.nvme->read_GBps}, {"write_GBps", p.nvme->write_GBps}};
  return j.dump(2) + "\n";
}

StatusOr<MachineProfile> ParseMachineProfile(const std::string& json_text,
                                             const std::string& source) {
  auto parsed = ParseJsonBounded(json_text);
  if (!parsed.ok()) {
    return InvalidArgumentError(fmt::format("machine profile {}: not valid JSON ({}); {}", source,
                                            parsed.status().message(), kRegenerate));
  }
  const Json root = std::move(*parsed);
  if (!root.is_object()) {
    return InvalidArgumentError(
        fmt::format("machine profile {}: the top level is not an object with \"device\", "
                    "\"pcie\", \"host\" or \"nvme\"; {}",
                    source, kRegenerate));
  }
  MachineProfile p;
  STRATA_ASSIGN_OR_RETURN(const Json* device, Section(root, source, "device"));
  if (device) {
    MachineProfile::Device d;
    if (!device->contains("name") || !device->at("name").is_string()) {
      return BadKey(source, "device.name", "is missing or not a string");
    }
    d.name = device->at("name").get<std::string>();
    if (d.name.size() > 256 || Excerpt(d.name, 256) != d.name) {
      return BadKey(
          source, "device.name",
          fmt::format("is '{}', not a name of at most 256 printable bytes", Excerpt(d.name)));
    }
    STRATA_ASSIGN_OR_RETURN(d.memory_GiB,
                            PositiveNumber(*device, source, "device", "memory_GiB", kGiB));
    STRATA_ASSIGN_OR_RETURN(d.bf16_TFLOPs,
                            PositiveNumber(*device, source, "device", "bf16_TFLOPs", kTflops));
    STRATA_ASSIGN_OR_RETURN(d.memory_GBps,
                            PositiveNumber(*device, source, "device", "memory_GBps", kRate));
    if (device->contains("peak_bf16_TFLOPs")) {  // optional: no MFU without it
      STRATA_ASSIGN_OR_RETURN(d.peak_bf16_TFLOPs, PositiveNumber(*device, source, "device",
                                                                 "peak_bf16_TFLOPs", kTflops));
    }
    p.device = d;
  }
  STRATA_ASSIGN_OR_RETURN(const Json* pcie, Section(root, source, "pcie"));
  if (pcie) {
    MachineProfile::Pcie c;
    STRATA_ASSIGN_OR_RETURN(c.h2d_GBps, PositiveNumber(*pcie, source, "pcie", "h2d_GBps", kRate));
    STRATA_ASSIGN_OR_RETURN(c.d2h_GBps, PositiveNumber(*pcie, source, "pcie", "d2h_GBps", kRate));
    p.pcie = c;
  }
  STRATA_ASSIGN_OR_RETURN(const Json* host, Section(root, source, "host"));
  if (host) {
    MachineProfile::Host h;
    STRATA_ASSIGN_OR_RETURN(const double cores, PositiveNumber(*host, source, "host", "cores",
                                                               kCores, /*integral=*/true));
    h.cores = static_cast<int>(cores);
    STRATA_ASSIGN_OR_RETURN(h.memory_GiB,
                            PositiveNumber(*host, source, "host", "memory_GiB", kGiB));
    STRATA_ASSIGN_OR_RETURN(const Json* rates, Section(*host, source, "optimizer_params_per_s"));
    if (!rates) return BadKey(source, "host.optimizer_params_per_s", "is missing");
    if (rates->empty()) {
      return BadKey(source, "host.optimizer_params_per_s",
                    "names no optimizer (give at least \"adamw\": parameters per second)");
    }
    for (const auto& [kind, value] : rates->items()) {
      STRATA_ASSIGN_OR_RETURN(
          h.optimizer_params_per_s[kind],
          PositiveNumber(*rates, source, "host.optimizer_params_per_s", kind.c_str(), kParamsPerS));
    }
    p.host = h;
  }
  STRATA_ASSIGN_OR_RETURN(const Json* nvme, Section(root, source, "nvme"));
  if (nvme) {
    MachineProfile::Nvme n;
    STRATA_ASSIGN_OR_RETURN(n.read_GBps, PositiveNumber(*nvme, source, "nvme", "read_GBps", kRate));
    STRATA_ASSIGN_OR_RETURN(n.write_GBps,
                            PositiveNumber(*nvme, source, "nvme", "write_GBps", kRate));
    p.nvme = n;
  }
  return p;
}

StatusOr<MachineProfile> ReadMachineProfile(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(std::string text,
                          ReadSmallFile(path, ReadSmallFileOptions{.max_bytes = 1 << 20}));
  return ParseMachineProfile(text, "'" + path + "'");
}

Status WriteMachineProfile(const MachineProfile& profile, const std::string& path) {
  return WriteOutputFile(path, MachineProfileJson(profile), "machine profile");
}

}  // namespace strata::engine
