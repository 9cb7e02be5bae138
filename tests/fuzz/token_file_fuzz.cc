// Fuzzes the llm.c token file reader (data/token_dataset.h, TokenDataset::Open): the input is a
// whole file (header, tokens, flags). Any bytes give a dataset whose every token is below the
// vocabulary and whose windows read inside the file, or a one-line error naming the file, never
// a crash or a sanitizer report.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/token_dataset.h"
#include "tests/fuzz/one_line_message.h"
#include "tests/fuzz/scratch_file.h"

namespace {

const std::string& ScratchFile() {
  return strata::fuzz::ScratchFile("token_file_fuzz", "tokens.bin");
}

constexpr int kVocab = 300;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::ofstream(ScratchFile(), std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  auto d = strata::data::TokenDataset::Open({ScratchFile()}, kVocab);
  if (!d.ok()) {
    const std::string m = d.status().message();
    if (!strata::fuzz::IsOneCleanLine(m, ScratchFile())) {
      std::abort();
    }
    return 0;
  }
  constexpr int kSeqLen = 4;
  const int64_t windows = d->num_windows(kSeqLen);
  std::vector<int32_t> tokens(kSeqLen), targets(kSeqLen);
  for (int64_t w = 0; w < windows && w < 4; ++w) {
    d->EvalWindow(w, kSeqLen, tokens.data(), targets.data());
    for (int32_t t : tokens) {
      if (t < 0 || t >= kVocab) std::abort();
    }
  }
  if (d->has_flags() && d->num_tokens() > 0) {
    std::vector<uint8_t> flags(static_cast<size_t>(d->num_tokens() < 8 ? d->num_tokens() : 8));
    d->ReadFlags(0, static_cast<int64_t>(flags.size()), flags.data());
  }
  return 0;
}
