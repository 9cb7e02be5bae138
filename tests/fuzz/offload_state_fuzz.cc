// Fuzzes the offload optimizer's saved-state reader (offload/offload_optimizer.h, Load): the
// input is the manifest.json of a state saved by an optimizer of two groups (AdamW over a bf16
// bucket of three segments, Adafactor over an fp32 bucket of a matrix and a vector: saved shapes
// change its layout). Any bytes give a load, or a one-line error naming the directory that
// leaves the optimizer as it was, never a crash or a sanitizer report. This is the file the C
// API and strata.torch read back (strata_offload_load).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cpu_optim/adafactor.h"
#include "offload/offload_optimizer.h"
#include "tests/fuzz/one_line_message.h"
#include "tests/fuzz/scratch_file.h"

namespace {

using strata::cpu_optim::AnyOptimizer;
using strata::cpu_optim::OptimizerKind;

struct Fixture {
  std::vector<uint16_t> bf16 = std::vector<uint16_t>(3 + 5 + 7, 0x3f80);  // bf16 1.0
  std::vector<float> fp32 = std::vector<float>(4 * 6 + 6, 0.5f);
  std::unique_ptr<strata::engine::OffloadOptimizer> optimizer;
  std::string dir;
};

Fixture& TheFixture() {
  static Fixture* f = [] {
    auto* x = new Fixture;
    x->dir = strata::fuzz::ScratchFile("offload_state_fuzz", "state");
    auto opt = strata::engine::OffloadOptimizer::Create({});
    if (!opt.ok()) std::abort();
    x->optimizer = std::move(*opt);
    strata::cpu_optim::AdafactorConfig adafactor{.beta1 = 0.9f};
    if (!x->optimizer->AddGroup(AnyOptimizer{OptimizerKind::kAdamW, {}}).ok() ||
        !x->optimizer->AddGroup(AnyOptimizer{OptimizerKind::kAdafactor, adafactor}).ok()) {
      std::abort();
    }
    uint16_t* b = x->bf16.data();
    float* p = x->fp32.data();
    const std::vector<strata::engine::OffloadSegment> bf16 = {
        {b, 3, {}}, {b + 3, 5, {}}, {b + 8, 7, {}}};
    const std::vector<strata::engine::OffloadSegment> fp32 = {{p, 24, {4, 6}}, {p + 24, 6, {6}}};
    if (!x->optimizer->AddBucket(0, strata::DType::kBF16, bf16).ok() ||
        !x->optimizer->AddBucket(1, strata::DType::kF32, fp32).ok() ||
        !x->optimizer->Save(x->dir).ok()) {
      std::abort();
    }
    // The seed corpus's saved.json is this file: STRATA_FUZZ_SEED_OUT=path writes it again.
    if (const char* out = std::getenv("STRATA_FUZZ_SEED_OUT")) {
      std::ifstream in(x->dir + "/manifest.json", std::ios::binary);
      std::ofstream(out, std::ios::binary) << in.rdbuf();
    }
    return x;
  }();
  return *f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& f = TheFixture();
  std::ofstream(f.dir + "/manifest.json", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  const int64_t steps[2] = {f.optimizer->group_step(0), f.optimizer->group_step(1)};
  const strata::Status loaded = f.optimizer->Load(f.dir);
  if (!loaded.ok()) {
    if (!strata::fuzz::IsOneCleanLine(loaded.message(), f.dir)) std::abort();
    // Refused: nothing changed.
    if (f.optimizer->group_step(0) != steps[0] || f.optimizer->group_step(1) != steps[1]) {
      std::abort();
    }
  }
  return 0;
}
