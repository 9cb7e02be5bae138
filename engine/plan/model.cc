#include "engine/plan/model.h"

#include <fmt/format.h>

#include <string_view>

namespace strata::engine {

Status CheckBlockBuffers(const Model& model, int block, const BlockBuffers& b, bool backward) {
  const DType want = b.precision;
  const std::string who = fmt::format("block {} ({})", block, model.block_name(block));
  auto check = [&](std::string_view name, const auto& t, int64_t elems, bool needed) -> Status {
    if (!needed) return Status::Ok();
    if (t.empty()) return InvalidArgumentError(fmt::format("{}: buffer {} is missing", who, name));
    if (t.dtype != want) {
      return InvalidArgumentError(fmt::format("{}: buffer {} is {}, the working precision is {}",
                                              who, name, DTypeName(t.dtype), DTypeName(want)));
    }
    if (t.num_elems < elems) {
      return InvalidArgumentError(
          fmt::format("{}: buffer {} has {} elements, needs {}", who, name, t.num_elems, elems));
    }
    return Status::Ok();
  };
  const bool first = block == 0, last = block == model.num_blocks() - 1;
  if (b.shape.batch_size < 1 || b.shape.seq_len < 1 || b.shape.seq_len > model.max_seq_len()) {
    return InvalidArgumentError(
        fmt::format("{}: micro-batch of {} sequences of {} tokens; the context is {}", who,
                    b.shape.batch_size, b.shape.seq_len, model.max_seq_len()));
  }
  const int64_t act = model.activation_elems(b.shape);
  const int64_t own = model.block_num_params(block);
  const int64_t frozen = model.block_frozen_params(block);
  const int tied = model.tied_block(block);
  // A tied block with no own params lends its frozen chunk, which gets no gradient.
  const bool tied_frozen = tied >= 0 && model.block_num_params(tied) == 0;
  const int64_t tied_elems =
      tied < 0 ? 0 : (tied_frozen ? model.block_frozen_params(tied) : model.block_num_params(tied));
  if (b.frozen_reference) {
    if (backward) {
      return InvalidArgumentError(
          fmt::format("{}: frozen_reference in a Backward (the reference is forward only)", who));
    }
    if (!model.has_frozen_reference()) {
      return InvalidArgumentError(fmt::format(
          "{}: frozen_reference, but the model has no frozen reference (LoRA's base)", who));
    }
  }
  // The frozen reference reads no own params.
  STRATA_RETURN_IF_ERROR(check("params", b.params, own, own > 0 && !b.frozen_reference));
  STRATA_RETURN_IF_ERROR(check("grads", b.grads, own, own > 0 && backward));
  STRATA_RETURN_IF_ERROR(check("frozen_params", b.frozen_params, frozen, frozen > 0));
  STRATA_RETURN_IF_ERROR(check("tied_params", b.tied_params, tied_elems, tied >= 0));
  STRATA_RETURN_IF_ERROR(
      check("tied_grads", b.tied_grads, tied_elems, tied >= 0 && !tied_frozen && backward));
  STRATA_RETURN_IF_ERROR(check("x_in", b.x_in, act, !first));
  STRATA_RETURN_IF_ERROR(check("x_out", b.x_out, act, !last && !backward));
  STRATA_RETURN_IF_ERROR(check("dx_out", b.dx_out, act, !last && backward));
  STRATA_RETURN_IF_ERROR(check("dx_in", b.dx_in, act, !first && backward));
  STRATA_RETURN_IF_ERROR(check("logits", b.logits, model.logits_elems(b.shape), last && !backward));
  if (first && b.tokens == nullptr) {
    return InvalidArgumentError(fmt::format("{}: tokens are missing", who));
  }
  if (last && backward && b.targets == nullptr) {
    return InvalidArgumentError(fmt::format("{}: targets are missing", who));
  }
  if (backward && b.forward_kept) {
    const int64_t store = model.activation_store_bytes(block, b.shape, want);
    if (store <= 0) {
      return InvalidArgumentError(
          fmt::format("{}: forward_kept, but the block has no activation store", who));
    }
    if (static_cast<int64_t>(b.scratch.size_bytes) < store) {
      return InvalidArgumentError(fmt::format("{}: activation store has {} bytes, needs {}", who,
                                              b.scratch.size_bytes, store));
    }
  }
  const int64_t scratch = model.scratch_bytes(block, b.shape, want);
  if (static_cast<int64_t>(b.scratch.size_bytes) < scratch) {
    return InvalidArgumentError(
        fmt::format("{}: scratch has {} bytes, needs {}", who, b.scratch.size_bytes, scratch));
  }
  const int64_t workspace = model.workspace_bytes(block, b.shape, want);
  if (static_cast<int64_t>(b.workspace.size_bytes) < workspace) {
    return InvalidArgumentError(fmt::format("{}: workspace has {} bytes, needs {}", who,
                                            b.workspace.size_bytes, workspace));
  }
  return Status::Ok();
}

}  // namespace strata::engine
