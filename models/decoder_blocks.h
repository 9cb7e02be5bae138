// The block structure every family of models/ shares (engine::Model): block 0 is the embedding,
// blocks 1..L the transformer layers, the last block the head (final norm, LM head, loss).
#pragma once

#include <fmt/format.h>

#include <string>

#include "base/status.h"

namespace strata::models {

enum class DecoderBlock { kEmbedding, kLayer, kHead };

// What block `block` of a model of num_blocks >= 2 blocks is; STRATA_CHECKs 0 <= block <
// num_blocks. Pure.
inline DecoderBlock DecoderBlockOf(int block, int num_blocks) {
  STRATA_CHECK(block >= 0 && block < num_blocks);
  if (block == 0) return DecoderBlock::kEmbedding;
  if (block == num_blocks - 1) return DecoderBlock::kHead;
  return DecoderBlock::kLayer;
}

// "embedding", "layer{block - 1}", "head": the engine's block and checkpoint tensor names.
inline std::string DecoderBlockName(int block, int num_blocks) {
  switch (DecoderBlockOf(block, num_blocks)) {
    case DecoderBlock::kEmbedding:
      return "embedding";
    case DecoderBlock::kHead:
      return "head";
    case DecoderBlock::kLayer:
      break;
  }
  return fmt::format("layer{}", block - 1);
}

}  // namespace strata::models
