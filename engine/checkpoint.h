// Checkpoints: the on-disk format and the crash-safe directory protocol.
//
// A checkpoint is a directory (mode 0700) of files (mode 0600):
//   master.safetensors      fp32 master weights, one F32 tensor [num_params] per engine block,
//                           named after the block ("embedding", "layer0", ..., "head")
//   SECTION.safetensors     one file per section of the optimizer's state
//                           (engine/plan/optimizer_state.h), named after it: for AdamW
//                           exp_avg.safetensors (m) and exp_avg_sq.safetensors (v), F32
//                           [num_params] per block; for AdamW8bit the same two files with U8
//                           codes (F32 for the embedding block) and exp_avg.absmax /
//                           exp_avg_sq.absmax F32 [blocks]; for Adafactor exp_avg_sq_row,
//                           exp_avg_sq_col, exp_avg_sq (, exp_avg); ... A block without a
//                           section has no tensor in that file.
//   working.safetensors     the 16-bit (or fp32) working weights, dtype of the run's precision
//   manifest.json           format version, model structure, engine and trainer state (step,
//                           tokens seen, data position = serialized std::mt19937_64, loss scaler
//                           state, the optimizer's kind and hyper-parameters, LR schedule), and
//                           per file its size in bytes and XXH3_64bits over the whole file
// A checkpoint loads only into a run of the same optimizer kind: the state's layout follows from
// the kind and the model (Engine::LoadCheckpoint says which kind the checkpoint holds).
//
// Save protocol (a crash at any moment leaves the previous checkpoint and `latest` intact):
//   1. mkdtemp SAVE_DIR/.tmp-step-N-XXXXXX (0700); write every file (O_EXCL | O_NOFOLLOW, 0600),
//      fsync each; write manifest.json last, fsync it; fsync the directory.
//   2. rename to SAVE_DIR/step-N; fsync SAVE_DIR.
//   3. write SAVE_DIR/latest.tmp = "step-N\n", fsync, rename over SAVE_DIR/latest, fsync SAVE_DIR.
//   4. keep_last > 0: remove complete checkpoints beyond the newest keep_last (never the one
//      `latest` names), and leftovers of interrupted saves (.tmp-step-*).
// Loading verifies the manifest, every file's size and xxh3, and every tensor's name, dtype and
// shape before any engine state changes (engine.h, Engine::LoadCheckpoint).
//
// Parsers take bytes (ParseManifest; safetensors.h ParseSafetensorsHeader) so fuzzers can call
// them. File names in a manifest are validated as plain names: no '/', no leading '.', no "..".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "cpu_optim/any_optimizer.h"

namespace strata::engine {

// Version 2 records any optimizer kind; version 1 (AdamW/Adam only) is still read.
inline constexpr int kCheckpointFormatVersion = 2;
inline constexpr const char* kManifestFileName = "manifest.json";
inline constexpr const char* kLatestFileName = "latest";

// N of a checkpoint directory's name "step-N", or -1 for any other name (and for more than 18
// digits, past any int64 step count).
int64_t CheckpointStepOfName(std::string_view name);
// The tensor files: master weights first, the optimizer's sections, the working weights last.
inline constexpr const char* kMasterFile = "master.safetensors";
inline constexpr const char* kExpAvgFile = "exp_avg.safetensors";       // AdamW's m
inline constexpr const char* kExpAvgSqFile = "exp_avg_sq.safetensors";  // AdamW's v
inline constexpr const char* kWorkingFile = "working.safetensors";

// What the training loop (not the engine) needs to continue exactly where it stopped. Stored
// verbatim in the manifest under "trainer".
struct TrainerState {
  int64_t step = 0;                     // optimizer steps completed
  int64_t tokens_seen = 0;              // training tokens consumed
  std::string data_rng;                 // data position: std::mt19937_64 written with operator<<
  std::string sample_rng;               // sampling RNG state, "" if none
  std::string lr_schedule_json = "{}";  // a JSON object describing the schedule and its position
  std::string model_json = "{}";        // a JSON object: the model's configuration (e.g. GPT shape)
};

struct LossScalerState {
  float scale = 1.0f;
  int64_t clean_steps = 0;  // steps since the last overflow or growth (growth counter)
  int64_t overflows = 0;
  int hysteresis_left = 0;  // 0: not recorded (format before hysteresis): the full allowance
};

struct ManifestFile {
  std::string name;  // plain file name inside the checkpoint directory
  uint64_t size_bytes = 0;
  uint64_t xxh3 = 0;  // XXH3_64bits of the whole file
};

struct Manifest {
  int format_version = kCheckpointFormatVersion;
  std::string precision;  // "fp32", "fp16", "bf16": dtype of working.safetensors
  std::string model_description;
  std::vector<std::string> block_names;
  std::vector<int64_t> block_num_params;
  int vocab_size = 0;
  int max_seq_len = 0;
  int64_t engine_steps = 0;  // optimizer steps attempted (incl. skipped ones)
  int64_t adam_steps = 0;    // updates applied: Adam's t
  LossScalerState loss_scaler;
  cpu_optim::AnyOptimizer optimizer;  // lr = the rate of the last step
  float grad_clip_norm = 0;
  // EngineOptions::decay_norms_and_biases of the run that saved it: true when biases and norm
  // weights were decayed too. A manifest without the field (written before weight decay groups,
  // when every element was decayed) reads as true.
  bool decay_norms_and_biases = false;
  TrainerState trainer;
  // The data-parallel ranks of the run that saved it, for information: the files hold whole
  // tensors, and a run with any number of ranks loads them (each rank reads its partitions).
  int ranks = 1;
  std::vector<ManifestFile> files;
};

// JSON text of a manifest (pretty-printed; uint64 checksums as 16 hex digits).
std::string SerializeManifest(const Manifest& manifest);
// Parses and validates manifest JSON: every field present with its type, format_version 1 or
// kCheckpointFormatVersion (else kFailedPrecondition naming both), consistent block
// lists, file names that are plain names (kDataLoss otherwise). Pure function; never crashes.
StatusOr<Manifest> ParseManifest(std::string_view json);

// The settings of the update that a checkpoint records but a resume takes from the run: the
// optimizer's hyper-parameters but its learning rate (the schedule sets that), the clipping norm
// and the weight decay groups. "weight_decay 0.1 -> 0.01, grad_clip_norm 1 -> 0.5": each that
// differs between `saved` and the run's, saved first, in a fixed order; "" when none does.
// Optimizers of different kinds list the fields either has (a resume refuses them anyway). Pure.
std::string UpdateSettingsDifferences(const Manifest& saved,
                                      const cpu_optim::AnyOptimizer& optimizer,
                                      float grad_clip_norm, bool decay_norms_and_biases);

// A file name that may appear in a manifest: 1..255 of [A-Za-z0-9._-], not starting with '.'.
bool IsPlainFileName(std::string_view name);

// `path` itself if it holds manifest.json; else path/<name in path/latest> (the name must be a
// plain file name). kNotFound saying what was looked for otherwise.
StatusOr<std::string> ResolveCheckpointDir(const std::string& path);

// Reads path/manifest.json (at most 16 MiB, O_NOFOLLOW) and parses it.
StatusOr<Manifest> ReadManifest(const std::string& dir);

// Checks that every file of the manifest exists with its size and xxh3. Returns the first
// mismatch as kDataLoss naming the file and both values (kNotFound for a missing file).
Status VerifyCheckpointFiles(const std::string& dir, const Manifest& manifest);
// Checks that the manifest lists every file a resume of it reads: the master and working weights
// and the optimizer state files its optimizer keeps (one per section, cpu_optim::StateLayout;
// for Adafactor, whose factored sections depend on the tensors' shapes, which the manifest does
// not hold: exp_avg when beta1 > 0 and at least one of its second moments). kDataLoss naming
// the first file missing and who needs it. Pure.
Status CheckManifestListsItsFiles(const Manifest& manifest);
// The check VerifyCheckpointFiles makes of one file, from the size and xxh3 the caller read at
// `path` (once, through the descriptor it goes on reading): kDataLoss naming the path and both
// values when either differs from `listed`. Pure.
Status CheckFileAgainstManifest(const std::string& path, const ManifestFile& listed,
                                uint64_t size_bytes, uint64_t xxh3);

// Step 1: creates SAVE_DIR (0700) if missing and a private SAVE_DIR/.tmp-step-N-XXXXXX.
StatusOr<std::string> CreateCheckpointTempDir(const std::string& save_dir, int64_t step);
// Steps 1 (manifest, fsync) to 4. On success *final_dir (if not null) is SAVE_DIR/step-N. A
// checkpoint of the same step that already exists is replaced (after the new one is complete).
Status CommitCheckpoint(const std::string& save_dir, const std::string& temp_dir,
                        const Manifest& manifest, int keep_last, std::string* final_dir);
// The file steps of the protocol (the new file, fsync, the durable rename, the temporary
// directory, moving a directory into place, the removal of a failed save) are base/file.h's.

}  // namespace strata::engine
