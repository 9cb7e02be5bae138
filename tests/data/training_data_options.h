// TrainingDataOptions for the data tests: the given files and shape, the rest defaulted.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "data/dataset.h"

namespace strata::data::testing {

inline TrainingDataOptions Opts(std::vector<std::string> data, int seq_len, int vocab_size,
                                std::vector<std::string> val_data = {},
                                std::string tokenizer = "") {
  TrainingDataOptions o;
  o.data = std::move(data);
  o.val_data = std::move(val_data);
  o.tokenizer = std::move(tokenizer);
  o.seq_len = seq_len;
  o.vocab_size = vocab_size;
  return o;
}

}  // namespace strata::data::testing
