// Where a model's initial master weights come from when they are not a random initialisation:
// an imported checkpoint (models/hf_checkpoint.h reads a Hugging Face directory).
#pragma once

#include <span>

#include "base/status.h"

namespace strata::models {

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // Writes block `block`'s whole chunk as fp32, in the model's chunk layout (out.size() ==
  // the block's num_params). Reads only that block's tensors (never a whole-model copy in
  // memory). Errors: I/O errors naming the file, kDataLoss for a file that changed or is short.
  // Thread-compatible: one call at a time.
  virtual Status ReadBlock(int block, std::span<float> out) const = 0;
};

}  // namespace strata::models
