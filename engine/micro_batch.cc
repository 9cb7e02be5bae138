#include "engine/micro_batch.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

namespace strata::engine {
namespace {

bool AllTargetsCount(std::span<const int64_t> loss_tokens, int64_t tokens_per_micro_batch) {
  return std::all_of(loss_tokens.begin(), loss_tokens.end(),
                     [&](int64_t c) { return c == tokens_per_micro_batch; });
}

Status CheckPositionIds(std::span<const int32_t> ids, MicroBatchShape shape) {
  if (ids.size() != static_cast<size_t>(shape.tokens())) {
    return InvalidArgumentError(fmt::format("micro-batch has {} position ids, expected {}x{} = {}",
                                            ids.size(), shape.batch_size, shape.seq_len,
                                            shape.tokens()));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    const bool row_start = i % shape.seq_len == 0;
    const bool ok = ids[i] == 0 || (!row_start && ids[i] == ids[i - 1] + 1);
    if (!ok) {
      return InvalidArgumentError(fmt::format(
          "position id {} at {} neither starts an example (0) nor follows the previous one", ids[i],
          i));
    }
  }
  return Status::Ok();
}

}  // namespace

StatusOr<int64_t> CheckMicroBatch(const MicroBatch& mb, MicroBatchShape shape, int vocab,
                                  bool with_targets) {
  const size_t count = shape.tokens();
  if (mb.tokens.size() != count || (with_targets && mb.targets.size() != count)) {
    return InvalidArgumentError(fmt::format("micro-batch has {} tokens, expected {}x{} = {}",
                                            mb.tokens.size(), shape.batch_size, shape.seq_len,
                                            count));
  }
  int64_t loss_tokens = 0;
  for (size_t i = 0; i < count; ++i) {
    if (mb.tokens[i] < 0 || mb.tokens[i] >= vocab) {
      return InvalidArgumentError(fmt::format("token id at {} is outside [0, {})", i, vocab));
    }
    if (!with_targets || mb.targets[i] == kIgnoreTarget) continue;
    if (mb.targets[i] < 0 || mb.targets[i] >= vocab) {
      return InvalidArgumentError(
          fmt::format("target at {} is {}: outside [0, {}) and not {} (ignored)", i, mb.targets[i],
                      vocab, kIgnoreTarget));
    }
    ++loss_tokens;
  }
  if (!mb.position_ids.empty()) STRATA_RETURN_IF_ERROR(CheckPositionIds(mb.position_ids, shape));
  return loss_tokens;
}

StatusOr<std::vector<int64_t>> CheckMicroBatches(std::span<const MicroBatch> mbs,
                                                 MicroBatchShape shape, int vocab) {
  std::vector<int64_t> loss_tokens(mbs.size());
  for (size_t i = 0; i < mbs.size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(loss_tokens[i], CheckMicroBatch(mbs[i], shape, vocab, true));
  }
  return loss_tokens;
}

uint64_t MicroBatchDropoutSeed(uint64_t seed, int64_t step, size_t i) {
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  return mix(seed ^ mix(static_cast<uint64_t>(step) * 65536 + i)) | 1;
}

StatusOr<std::vector<float>> MicroBatchLossWeights(std::span<const int64_t> loss_tokens,
                                                   int64_t tokens_per_micro_batch, float scale,
                                                   int world, int64_t job_loss_tokens) {
  const size_t n = loss_tokens.size();
  const int64_t own = std::accumulate(loss_tokens.begin(), loss_tokens.end(), int64_t{0});
  if (job_loss_tokens < own) {
    return InvalidArgumentError(fmt::format(
        "the job's counted targets {} are fewer than this rank's {}", job_loss_tokens, own));
  }
  if (job_loss_tokens == static_cast<int64_t>(n) * world * tokens_per_micro_batch) {
    return std::vector<float>(n, scale / static_cast<float>(n * world));
  }
  if (job_loss_tokens == 0) {
    return InvalidArgumentError(fmt::format(
        "no target of this step's {} micro-batches{} counts in the loss (all prompt or padding): "
        "check the data's loss mask",
        n * world, world > 1 ? fmt::format(" on {} ranks", world) : ""));
  }
  std::vector<float> weights(n);
  for (size_t i = 0; i < n; ++i) {
    weights[i] = static_cast<float>(static_cast<double>(scale) * loss_tokens[i] /
                                    static_cast<double>(job_loss_tokens));
  }
  return weights;
}

float StepLoss(std::span<const float> losses, std::span<const int64_t> loss_tokens,
               int64_t tokens_per_micro_batch) {
  if (AllTargetsCount(loss_tokens, tokens_per_micro_batch)) {
    float sum = 0;
    for (float l : losses) sum += l;
    return sum / static_cast<float>(losses.size());
  }
  double sum = 0;
  int64_t total = 0;
  for (size_t i = 0; i < losses.size(); ++i) {
    sum += static_cast<double>(losses[i]) * loss_tokens[i];
    total += loss_tokens[i];
  }
  return total > 0 ? static_cast<float>(sum / total) : 0.0f;
}

}  // namespace strata::engine
