// `strata iobench`: fio-style sequential and random reads and writes through Strata's own I/O
// backends, on files striped over one or more directories like the swap store, reporting GB/s
// (1e9 bytes/s) and GiB/s, IOPS, mean and p99 latency per block (submit -> completion, us) and
// CPU time per GB; `--sweep` tries a grid and prints the best settings as the config block that
// `strata train --config FILE` reads. A new or short file is laid out (written) before the
// measured passes, so writes are overwrites unless `--first-write` asks for writes into freshly
// fallocated blocks.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace strata::tools {

struct IobenchFlags {
  std::vector<std::string> paths;  // --path, repeatable: one file per directory, striped
  std::string size = "1GiB";       // total bytes over all files (ParseSize forms)
  std::string block_size = "1MiB";
  int queue_depth = 32;
  std::string rw = "read";  // read|write|randread|randwrite
  std::string backend = "uring";
  int threads = 1;
  double runtime_s = 0;  // > 0: repeat passes until this many seconds have passed
  int loops = 1;         // passes over the file when runtime_s == 0
  // Writes: measure writes into freshly fallocated blocks instead of overwrites of a laid-out file.
  bool first_write = false;
  bool json = false;
  bool sweep = false;
  std::string config_out;  // --config-out FILE: with --sweep, write only the config block there
};

void AddIobenchFlags(CLI::App& cmd, IobenchFlags& f);
// Runs the benchmark (or the sweep); errors (bad path, not writable, size too small) come back
// as a Status that main prints as one line.
Status RunIobench(const IobenchFlags& f);

}  // namespace strata::tools
