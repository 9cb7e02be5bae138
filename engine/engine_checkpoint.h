// Saving and loading an Engine's training state in the checkpoint format of engine/checkpoint.h,
// block by block out of and into the state store (state_store.h): host memory use is one block's
// state, never a whole-model copy.
//
// Save writes the one-rank layout (whole tensors). With a communicator of N > 1 ranks it is
// collective: rank 0 makes the temporary directory and lays every file out at its full size,
// every rank writes its partitions at their offsets (SafetensorsPartWriter) and fsyncs, and
// rank 0 hashes the files and commits; an error on any rank fails the save on every rank.
//
// Load is two phases. Validate checks everything (manifest, every file's size and xxh3, the
// model structure, precision and optimizer kind, every tensor's name, dtype and shape) without
// touching the engine and keeps the verified files open; Read then copies the validated tensors
// into the store, each rank its partition of every tensor, whatever the number of ranks that
// saved them.
//
// Threads: the driving thread, between steps, with the state store drained (no update in
// flight) and, for Read, no load reading a pinned home. Errors: file-system errors naming the
// path and the cause, swap-store errors, kDataLoss / kInvalidArgument / kFailedPrecondition as
// Engine::LoadCheckpoint (engine.h) lists them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "comm/communicator.h"
#include "cpu_optim/any_optimizer.h"
#include "engine/checkpoint.h"
#include "engine/plan/model.h"
#include "engine/plan/planner.h"
#include "engine/state_store.h"
#include "formats/safetensors.h"

namespace strata::engine {

class EngineCheckpoint {
 public:
  // A checkpoint that passed Validate: its manifest and its tensor files, open, in the order
  // master, the optimizer's state files, working.
  struct Validated {
    Manifest manifest;
    std::vector<formats::OpenSafetensors> files;
    std::vector<std::vector<const formats::SafetensorsTensor*>>
        tensors;  // per file, in block order
  };

  // Everything is borrowed and must outlive this object; `optimizer` is the run's (its kind and
  // name; its learning rate may change between calls). comm may be null (one rank).
  EngineCheckpoint(const Model& model, const Plan& plan, DType precision, bool inference_only,
                   const cpu_optim::AnyOptimizer& optimizer, StateStore* store,
                   comm::Communicator* comm);

  // Writes save_dir/step-{manifest.trainer.step} from the store (which must be drained) and
  // `manifest` (files not listed yet), points save_dir/latest at it and keeps the newest
  // keep_last (0: all). A failed save removes its temporary directory.
  Status Save(const std::string& save_dir, Manifest manifest, int keep_last,
              std::string* checkpoint_dir);

  // A manifest with what this run's model, plan and optimizer say (precision, model description,
  // block names and sizes, vocabulary, context, optimizer, ranks); the caller adds the step
  // counters, loss scaler, clipping and trainer state.
  Manifest ModelManifest() const;

  // Phase 1 of a load: resolves `path` (a checkpoint or a save directory), validates it against
  // this run, reading each listed file once. Changes nothing. `cancel_requested` (may be empty;
  // EngineOptions::cancel_requested) is polled before each file: kCancelled once it says so.
  StatusOr<Validated> Validate(const std::string& path,
                               const std::function<bool()>& cancel_requested = {}) const;
  // Phase 2: copies the validated tensors into the store, block by block; `loaded(b)` after
  // block b's home was written (the caller marks its device copies stale). Inference: the master
  // weights, converted to the working precision, into the working homes only.
  // `cancel_requested` is polled before each block: kCancelled, blocks before it loaded.
  Status Read(const Validated& checkpoint, const std::function<void(int block)>& loaded,
              const std::function<bool()>& cancel_requested = {});

  // Block b's whole fp32 tensor from this rank's partition `mine` (own_elems floats): a copy with
  // one rank; with a communicator, every rank's partition all-gathered in rank order (a
  // collective: every rank calls it for the same block). Errors: the all-gather's.
  StatusOr<std::vector<float>> GatherBlock(int b, const float* mine) const;
  // Block b's whole master weights (np(b) floats), from the store (which must be drained).
  StatusOr<std::vector<float>> MasterWeights(int b) const;
  // xxh3-64 of every block's whole master weights in block order: the same value whatever the
  // placement and the number of ranks (a collective with a communicator). Store drained.
  StatusOr<uint64_t> MasterWeightsXxh3() const;

 private:
  int world() const { return comm_ ? comm_->world_size() : 1; }
  int64_t np(int b) const { return model_.block_num_params(b); }
  int64_t own(int b) const { return plan_.blocks[b].partition.own_elems; }
  int64_t home_elems(int b) const { return plan_.blocks[b].partition.part_elems; }
  Status CheckManifestMatchesModel(const Manifest& m) const;
  Status Write(const std::string& save_dir, const std::string& temp_dir, Manifest manifest,
               int keep_last, std::string* checkpoint_dir);
  // Data parallel, N > 1: every rank writes its partition of every tensor into the shared files.
  Status WriteRanks(const std::string& save_dir, Manifest manifest, int keep_last,
                    std::string* checkpoint_dir);

  const Model& model_;
  const Plan& plan_;
  const DType precision_;
  const bool inference_only_;
  const cpu_optim::AnyOptimizer& optimizer_;
  StateStore* store_;
  comm::Communicator* comm_;
};

}  // namespace strata::engine
