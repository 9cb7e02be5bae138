#include "engine/engine_checkpoint.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <map>

#include "base/aligned_buffer.h"
#include "base/file.h"
#include "base/untrusted_text.h"
#include "cpu_optim/grad_stats.h"

namespace strata::engine {

using formats::FdXxh3;
using formats::FileXxh3;
using formats::OpenSafetensors;
using formats::OpenSafetensorsFile;
using formats::ReadTensorBytes;
using formats::SafetensorsDTypeName;
using formats::SafetensorsPartWriter;
using formats::SafetensorsTensor;
using formats::SafetensorsWriter;
using formats::TensorDType;

namespace {

// The checkpoint files of the optimizer's state: one per section name, in order of first use,
// holding that section of every block that has it (optimizer_state.h).
struct StateFile {
  std::string name;  // "exp_avg", ...; the file is name + ".safetensors"
  std::vector<SafetensorsWriter::TensorSpec> tensors;
  std::vector<std::pair<int, size_t>> blocks;  // (block, section index), in tensor order
};

std::vector<StateFile> StateFiles(const Model& model, const std::vector<BlockState>& states) {
  std::vector<StateFile> files;
  for (int b = 0; b < static_cast<int>(states.size()); ++b) {
    for (size_t k = 0; k < states[b].sections.size(); ++k) {
      const cpu_optim::StateSpec& spec = states[b].sections[k];
      auto it = std::find_if(files.begin(), files.end(),
                             [&](const StateFile& f) { return f.name == spec.name; });
      if (it == files.end()) it = files.insert(files.end(), StateFile{spec.name, {}, {}});
      it->tensors.push_back(
          {model.block_name(b),
           spec.dtype == cpu_optim::StateDType::kU8 ? TensorDType::U8() : TensorDType(DType::kF32),
           {spec.num_elems}});
      it->blocks.emplace_back(b, k);
    }
  }
  return files;
}

// One tensor file of a checkpoint: its name, its `content` metadata and its tensors.
struct CheckpointFile {
  std::string name;
  std::string content;
  std::vector<SafetensorsWriter::TensorSpec> tensors;
};

// The tensor files of a checkpoint, in the manifest's order: the fp32 master weights, the
// optimizer's state files (`state`), the working weights in `working`. `optimizer` names the
// state in its files' metadata.
std::vector<CheckpointFile> CheckpointFiles(const Model& model, const std::vector<StateFile>& state,
                                            std::string_view optimizer, DType working) {
  std::vector<SafetensorsWriter::TensorSpec> f32, work;
  for (int b = 0; b < model.num_blocks(); ++b) {
    f32.push_back({model.block_name(b), DType::kF32, {model.block_num_params(b)}});
    work.push_back({model.block_name(b), working, {model.block_num_params(b)}});
  }
  std::vector<CheckpointFile> files = {{kMasterFile, "fp32 master weights", std::move(f32)}};
  for (const StateFile& f : state) {
    files.push_back(
        {f.name + ".safetensors", fmt::format("{} state {}", optimizer, f.name), f.tensors});
  }
  files.push_back({kWorkingFile, "working weights", std::move(work)});
  return files;
}

// Collective: an error on any rank becomes an error on every rank (its own where it has one).
Status AgreeAll(comm::Communicator* comm, Status mine) {
  double failed = mine.ok() ? 0.0 : 1.0;
  STRATA_RETURN_IF_ERROR(comm->AllReduce(std::span(&failed, 1), comm::ReduceOp::kSum));
  if (!mine.ok()) return mine;
  if (failed > 0) {
    return AbortedError(fmt::format("{} other rank{} failed (see {} error)", failed,
                                    failed == 1 ? "" : "s", failed == 1 ? "its" : "their"));
  }
  return Status::Ok();
}

// Collective: rank 0's status and text on every rank.
StatusOr<std::string> FromRank0(comm::Communicator* comm, StatusOr<std::string> mine) {
  // [code (8 bytes)][length (8 bytes)] then the text or the error message.
  uint64_t head[2] = {0, 0};
  std::string text;
  if (comm->rank() == 0) {
    head[0] = static_cast<uint64_t>(mine.status().code());
    text = mine.ok() ? *mine : mine.status().message();
    head[1] = text.size();
  }
  STRATA_RETURN_IF_ERROR(comm->Broadcast(std::as_writable_bytes(std::span(head)), 0));
  text.resize(head[1]);
  STRATA_RETURN_IF_ERROR(comm->Broadcast(std::as_writable_bytes(std::span(text)), 0));
  if (head[0] != 0) {
    return Status(static_cast<StatusCode>(head[0]),
                  comm->rank() == 0 ? text : fmt::format("rank 0: {}", text));
  }
  return text;
}

}  // namespace

EngineCheckpoint::EngineCheckpoint(const Model& model, const Plan& plan, DType precision,
                                   bool inference_only, const cpu_optim::AnyOptimizer& optimizer,
                                   StateStore* store, comm::Communicator* comm)
    : model_(model),
      plan_(plan),
      precision_(precision),
      inference_only_(inference_only),
      optimizer_(optimizer),
      store_(store),
      comm_(comm) {}

Status EngineCheckpoint::Save(const std::string& save_dir, Manifest manifest, int keep_last,
                              std::string* checkpoint_dir) {
  const int64_t step = manifest.trainer.step;
  if (world() > 1) {
    return WriteRanks(save_dir, std::move(manifest), keep_last, checkpoint_dir)
        .WithContext(fmt::format("saving checkpoint step-{} in '{}'", step, save_dir));
  }
  STRATA_ASSIGN_OR_RETURN(std::string temp_dir, CreateCheckpointTempDir(save_dir, step));
  Status s = Write(save_dir, temp_dir, std::move(manifest), keep_last, checkpoint_dir);
  if (!s.ok()) {
    RemoveTree(temp_dir);
    return s.WithContext(fmt::format("saving checkpoint step-{} in '{}'", step, save_dir));
  }
  return Status::Ok();
}

Manifest EngineCheckpoint::ModelManifest() const {
  Manifest manifest;
  manifest.precision = std::string(DTypeName(precision_));
  manifest.model_description = model_.description();
  for (int b = 0; b < model_.num_blocks(); ++b) {
    manifest.block_names.push_back(model_.block_name(b));
    manifest.block_num_params.push_back(model_.block_num_params(b));
  }
  manifest.vocab_size = model_.vocab_size();
  manifest.max_seq_len = model_.max_seq_len();
  manifest.optimizer = optimizer_;
  manifest.ranks = world();
  return manifest;
}

Status EngineCheckpoint::Write(const std::string& save_dir, const std::string& temp_dir,
                               Manifest manifest, int keep_last, std::string* checkpoint_dir) {
  const std::vector<StateFile> state_files = StateFiles(model_, store_->full_layouts());
  const std::vector<CheckpointFile> files =
      CheckpointFiles(model_, state_files, OptimizerFlagName(optimizer_), precision_);
  std::vector<SafetensorsWriter> writers;
  for (const CheckpointFile& f : files) {
    STRATA_ASSIGN_OR_RETURN(
        auto w, SafetensorsWriter::Create(temp_dir + "/" + f.name, f.tensors,
                                          {{"format", "strata"}, {"content", f.content}}));
    writers.push_back(std::move(w));
  }
  // Block by block: one block's state in memory at a time. Each writer takes its tensors in
  // block order, so every file is appended to in order.
  for (int b = 0; b < model_.num_blocks(); ++b) {
    STRATA_RETURN_IF_ERROR(store_->Load(b).status());
    STRATA_RETURN_IF_ERROR(writers[0].Append(
        std::as_bytes(std::span(store_->Master(b, 0), static_cast<size_t>(np(b))))));
    for (size_t f = 0; f < state_files.size(); ++f) {
      for (const auto& [block, k] : state_files[f].blocks) {
        if (block == b) STRATA_RETURN_IF_ERROR(writers[1 + f].Append(store_->Section(b, 0, k)));
      }
    }
    STRATA_ASSIGN_OR_RETURN(const std::byte* w, store_->WorkingParamsBytes(b));
    STRATA_RETURN_IF_ERROR(writers.back().Append(std::span(w, np(b) * SizeOf(precision_))));
  }
  for (size_t i = 0; i < writers.size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(auto r, writers[i].Finish());
    manifest.files.push_back({files[i].name, r.size_bytes, r.xxh3});
  }
  return CommitCheckpoint(save_dir, temp_dir, manifest, keep_last, checkpoint_dir);
}

Status EngineCheckpoint::WriteRanks(const std::string& save_dir, Manifest manifest, int keep_last,
                                    std::string* checkpoint_dir) {
  const bool root = comm_->rank() == 0;
  const size_t w = SizeOf(precision_);
  // Rank 0 makes the temporary directory (a shared file system across machines).
  STRATA_ASSIGN_OR_RETURN(
      const std::string temp_dir,
      FromRank0(comm_,
                root ? CreateCheckpointTempDir(save_dir, manifest.trainer.step) : std::string()));
  const std::vector<StateFile> state_files = StateFiles(model_, store_->full_layouts());
  const std::vector<CheckpointFile> files =
      CheckpointFiles(model_, state_files, OptimizerFlagName(optimizer_), precision_);
  auto metadata = [](const CheckpointFile& f) {
    return std::map<std::string, std::string>{{"format", "strata"}, {"content", f.content}};
  };
  // Rank 0 lays every file out at its full size; then each rank writes its partitions.
  Status created;
  if (root) {
    for (const CheckpointFile& f : files) {
      created =
          SafetensorsPartWriter::Create(temp_dir + "/" + f.name, f.tensors, metadata(f)).status();
      if (!created.ok()) break;
    }
  }
  Status s = AgreeAll(comm_, created);
  std::vector<SafetensorsPartWriter> writers;
  for (size_t i = 0; s.ok() && i < files.size(); ++i) {
    auto w = SafetensorsPartWriter::Open(temp_dir + "/" + files[i].name, files[i].tensors,
                                         metadata(files[i]));
    if (!w.ok()) {
      s = w.status();
    } else {
      writers.push_back(std::move(*w));
    }
  }
  // Block by block: this rank's part of block b is tensor b of the master and working files,
  // and tensor j of a state file, at the partition's offset.
  for (int b = 0; b < model_.num_blocks() && s.ok(); ++b) {
    const uint64_t off = plan_.blocks[b].partition.offset_elems, n = own(b);
    if (n == 0) continue;
    s = store_->Load(b).status();
    if (s.ok())
      s = writers[0].WriteAt(b, off * 4, std::as_bytes(std::span(store_->Master(b, 0), n)));
    for (size_t f = 0; f < state_files.size() && s.ok(); ++f) {
      for (size_t j = 0; j < state_files[f].blocks.size() && s.ok(); ++j) {
        const auto [block, k] = state_files[f].blocks[j];
        if (block == b)
          s = writers[1 + f].WriteAt(j, off * 4, store_->Section(b, 0, k).subspan(0, n * 4));
      }
    }
    if (!s.ok()) break;
    StatusOr<const std::byte*> working = store_->WorkingParamsBytes(b);
    s = working.status();
    if (s.ok()) s = writers.back().WriteAt(b, off * w, std::span(*working, n * w));
  }
  for (size_t i = 0; i < writers.size() && s.ok(); ++i) s = writers[i].Sync();
  writers.clear();
  // Every rank's bytes are durable before rank 0 hashes the files and commits.
  s = AgreeAll(comm_, std::move(s));
  Status committed;
  if (root) {
    if (s.ok()) {
      for (const CheckpointFile& f : files) {
        uint64_t size = 0;
        StatusOr<uint64_t> hash = FileXxh3(temp_dir + "/" + f.name, &size);
        if (!hash.ok()) {
          committed = hash.status();
          break;
        }
        manifest.files.push_back({f.name, size, *hash});
      }
      if (committed.ok()) {
        committed = CommitCheckpoint(save_dir, temp_dir, manifest, keep_last, checkpoint_dir);
      }
    }
    if (!s.ok() || !committed.ok()) RemoveTree(temp_dir);
  }
  if (!s.ok()) return s;
  // Rank 0's commit decides for everyone.
  STRATA_ASSIGN_OR_RETURN(
      std::string dir,
      FromRank0(comm_, committed.ok() ? StatusOr<std::string>(checkpoint_dir ? *checkpoint_dir : "")
                                      : StatusOr<std::string>(committed)));
  if (checkpoint_dir) *checkpoint_dir = dir;
  return Status::Ok();
}

Status EngineCheckpoint::CheckManifestMatchesModel(const Manifest& m) const {
  if (m.precision != DTypeName(precision_) && !inference_only_) {
    return InvalidArgumentError(
        fmt::format("the checkpoint was trained with `precision {}`, this run uses {}", m.precision,
                    DTypeName(precision_)));
  }
  if (static_cast<int>(m.block_names.size()) != model_.num_blocks() ||
      m.vocab_size != model_.vocab_size() || m.max_seq_len != model_.max_seq_len()) {
    return InvalidArgumentError(fmt::format(
        "the checkpoint's model ({}: {} blocks, vocabulary {}, context {}) is not this run's "
        "({}: {} blocks, vocabulary {}, context {})",
        Excerpt(m.model_description, 200), m.block_names.size(), m.vocab_size, m.max_seq_len,
        model_.description(), model_.num_blocks(), model_.vocab_size(), model_.max_seq_len()));
  }
  for (int b = 0; b < model_.num_blocks(); ++b) {
    if (m.block_names[b] != model_.block_name(b) || m.block_num_params[b] != np(b)) {
      return InvalidArgumentError(fmt::format(
          "checkpoint block {} is '{}' with {} parameters, this model's is '{}' with {}", b,
          Excerpt(m.block_names[b], 80), m.block_num_params[b], model_.block_name(b), np(b)));
    }
  }
  return Status::Ok();
}

StatusOr<EngineCheckpoint::Validated> EngineCheckpoint::Validate(
    const std::string& path, const std::function<bool()>& cancel_requested) const {
  STRATA_ASSIGN_OR_RETURN(std::string dir, ResolveCheckpointDir(path));
  STRATA_ASSIGN_OR_RETURN(Manifest m, ReadManifest(dir));
  STRATA_RETURN_IF_ERROR(CheckManifestMatchesModel(m).WithContext(dir));
  // The optimizer's state is read only by the same kind (inference reads the master weights).
  const std::vector<StateFile> state_files =
      inference_only_ ? std::vector<StateFile>() : StateFiles(model_, store_->full_layouts());
  if (!inference_only_ && m.optimizer.kind != optimizer_.kind) {
    return InvalidArgumentError(
        fmt::format("{}: the checkpoint holds {} optimizer state, this run uses {}; resume with "
                    "`optimizer {}` (or start a new run)",
                    dir, OptimizerFlagName(m.optimizer), OptimizerFlagName(optimizer_),
                    OptimizerFlagName(m.optimizer)));
  }
  // Files: master, the state sections, working (Write's order).
  DType working_dtype = precision_;
  if (inference_only_) {
    STRATA_ASSIGN_OR_RETURN(working_dtype, ParseDType(m.precision));
  }
  const std::vector<CheckpointFile> expected =
      CheckpointFiles(model_, state_files, OptimizerFlagName(optimizer_), working_dtype);
  for (const CheckpointFile& e : expected) {
    const bool listed = std::any_of(m.files.begin(), m.files.end(),
                                    [&](const ManifestFile& f) { return f.name == e.name; });
    if (!listed) {
      return (e.name == kMasterFile || e.name == kWorkingFile)
                 ? DataLossError(fmt::format("{}: the manifest lists no '{}'", dir, e.name))
                 : InvalidArgumentError(fmt::format(
                       "{}: the checkpoint's {} state has no '{}', which this run's {} state "
                       "needs (amsgrad, momentum or beta1 differ from the saved run's?)",
                       dir, OptimizerFlagName(m.optimizer), e.name, OptimizerFlagName(optimizer_)));
    }
  }
  if (!inference_only_) {
    for (const ManifestFile& f : m.files) {
      const bool known = std::any_of(expected.begin(), expected.end(),
                                     [&](const CheckpointFile& e) { return e.name == f.name; });
      if (!known) {
        return InvalidArgumentError(fmt::format(
            "{}: the checkpoint's {} state has '{}', which this run's {} state does not use "
            "(amsgrad, momentum or beta1 differ from the saved run's?)",
            dir, OptimizerFlagName(m.optimizer), f.name, OptimizerFlagName(optimizer_)));
      }
    }
  }
  // Every listed file, whole, against its manifest size and xxh3, each read once: the tensor
  // files through the descriptors phase 2 reads from (what is loaded is what was verified), any
  // other (an inference load's optimizer state) by its path.
  const auto cancel_point = [&](const std::string& file) -> Status {
    if (!cancel_requested || !cancel_requested()) return Status::Ok();
    return CancelledError(
        fmt::format("cancelled while verifying checkpoint '{}' (before '{}'); the run's state "
                    "is unchanged",
                    dir, file));
  };
  for (const ManifestFile& listed : m.files) {
    const bool opened = std::any_of(expected.begin(), expected.end(),
                                    [&](const CheckpointFile& e) { return e.name == listed.name; });
    if (opened) continue;
    STRATA_RETURN_IF_ERROR(cancel_point(listed.name));
    const std::string file = dir + "/" + listed.name;
    uint64_t size = 0;
    STRATA_ASSIGN_OR_RETURN(uint64_t hash, FileXxh3(file, &size));
    STRATA_RETURN_IF_ERROR(CheckFileAgainstManifest(file, listed, size, hash));
  }
  std::vector<OpenSafetensors> files;
  std::vector<std::vector<const SafetensorsTensor*>> tensors(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    STRATA_RETURN_IF_ERROR(cancel_point(expected[i].name));
    const std::string file = dir + "/" + expected[i].name;
    const ManifestFile& listed =
        *std::find_if(m.files.begin(), m.files.end(),
                      [&](const ManifestFile& mf) { return mf.name == expected[i].name; });
    StatusOr<OpenSafetensors> opened = OpenSafetensorsFile(file);
    if (!opened.ok()) {
      // A damaged header is named as the manifest sees it (another size or checksum) when the
      // file is there to hash.
      uint64_t size = 0;
      if (StatusOr<uint64_t> hash = FileXxh3(file, &size); hash.ok()) {
        STRATA_RETURN_IF_ERROR(CheckFileAgainstManifest(file, listed, size, *hash));
      }
      return opened.status();
    }
    OpenSafetensors f = std::move(*opened);
    uint64_t size = 0;
    STRATA_ASSIGN_OR_RETURN(uint64_t hash, FdXxh3(f.fd.get(), file, &size));
    STRATA_RETURN_IF_ERROR(CheckFileAgainstManifest(file, listed, size, hash));
    if (f.header.tensors.size() != expected[i].tensors.size()) {
      return DataLossError(fmt::format("'{}' holds {} tensors, expected {}", file,
                                       f.header.tensors.size(), expected[i].tensors.size()));
    }
    for (const auto& want : expected[i].tensors) {
      const SafetensorsTensor* t = f.header.Find(want.name);
      if (!t || t->dtype != want.dtype || t->shape != want.shape) {
        return DataLossError(fmt::format("'{}': tensor '{}' is missing or not {} [{}]", file,
                                         want.name, SafetensorsDTypeName(want.dtype),
                                         want.shape[0]));
      }
      tensors[i].push_back(t);
    }
    files.push_back(std::move(f));
  }
  return Validated{std::move(m), std::move(files), std::move(tensors)};
}

Status EngineCheckpoint::Read(const Validated& checkpoint,
                              const std::function<void(int block)>& loaded,
                              const std::function<bool()>& cancel_requested) {
  const std::vector<OpenSafetensors>& files = checkpoint.files;
  const auto& tensors = checkpoint.tensors;
  const size_t working_file = files.size() - 1;
  const int n_blocks = model_.num_blocks();
  const size_t w = SizeOf(precision_);
  const auto cancel_point = [&](int b) -> Status {
    if (!cancel_requested || !cancel_requested()) return Status::Ok();
    return CancelledError(
        fmt::format("cancelled while reading the checkpoint, block {} of {}", b + 1, n_blocks));
  };
  if (inference_only_) {
    // The master weights, converted to this engine's precision.
    STRATA_ASSIGN_OR_RETURN(auto f32, AlignedBuffer::Allocate(plan_.max_block_params * 4, 64));
    for (int b = 0; b < n_blocks; ++b) {
      STRATA_RETURN_IF_ERROR(cancel_point(b));
      const std::span<float> p32(f32.as<float>(), np(b));
      STRATA_RETURN_IF_ERROR(
          ReadTensorBytes(files[0], *tensors[0][b], 0, std::as_writable_bytes(p32)));
      STRATA_RETURN_IF_ERROR(
          cpu_optim::ConvertFromF32(p32.data(), store_->WorkingHome(b, 0).data, precision_, np(b)));
      loaded(b);
    }
    return Status::Ok();
  }
  const std::vector<StateFile> state_files = StateFiles(model_, store_->full_layouts());
  // Each rank reads its partition of every tensor, whatever the number of ranks that saved them
  // (element-wise state when ranks > 1); one rank reads whole tensors.
  for (int b = 0; b < n_blocks; ++b) {
    STRATA_RETURN_IF_ERROR(cancel_point(b));
    const size_t n = static_cast<size_t>(own(b));
    const uint64_t off = plan_.blocks[b].partition.offset_elems;
    STRATA_RETURN_IF_ERROR(store_->Load(b, /*read=*/false).status());
    STRATA_RETURN_IF_ERROR(
        ReadTensorBytes(files[0], *tensors[0][b], off * 4,
                        std::as_writable_bytes(std::span(store_->Master(b, 0), n))));
    for (size_t f = 0; f < state_files.size(); ++f) {
      for (size_t j = 0; j < state_files[f].blocks.size(); ++j) {
        const auto [block, k] = state_files[f].blocks[j];
        if (block != b) continue;
        const std::span<std::byte> section =
            world() > 1 ? store_->Section(b, 0, k).subspan(0, n * 4) : store_->Section(b, 0, k);
        STRATA_RETURN_IF_ERROR(ReadTensorBytes(files[1 + f], *tensors[1 + f][j], off * 4, section));
      }
    }
    STRATA_RETURN_IF_ERROR(ReadTensorBytes(files[working_file], *tensors[working_file][b], off * w,
                                           store_->WorkingHome(b, 0).bytes().subspan(0, n * w)));
    STRATA_RETURN_IF_ERROR(store_->WriteBack(b, 0));
    loaded(b);  // every device copy is stale
  }
  return Status::Ok();
}

StatusOr<std::vector<float>> EngineCheckpoint::GatherBlock(int b, const float* mine) const {
  if (comm_ == nullptr) return std::vector<float>(mine, mine + np(b));
  // Every rank sends its partition padded to part_elems; partitions land in rank order.
  const int64_t pe = home_elems(b);
  std::vector<float> send(pe, 0.0f), all(pe * world());
  std::copy(mine, mine + own(b), send.begin());
  STRATA_RETURN_IF_ERROR(comm_->AllGatherBytes(std::as_bytes(std::span(send)),
                                               std::as_writable_bytes(std::span(all))));
  all.resize(np(b));
  return all;
}

StatusOr<std::vector<float>> EngineCheckpoint::MasterWeights(int b) const {
  STRATA_RETURN_IF_ERROR(store_->Load(b).status());
  return GatherBlock(b, store_->Master(b, 0));
}

StatusOr<uint64_t> EngineCheckpoint::MasterWeightsXxh3() const {
  XXH3_state_t* state = XXH3_createState();
  if (!state) return ResourceExhaustedError("could not allocate an xxh3 state");
  XXH3_64bits_reset(state);
  Status status;
  for (int b = 0; b < model_.num_blocks() && status.ok(); ++b) {
    StatusOr<std::vector<float>> p32 = MasterWeights(b);
    status = p32.status();
    if (status.ok()) XXH3_64bits_update(state, p32->data(), np(b) * 4);
  }
  const uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  if (!status.ok()) return status;
  return h;
}

}  // namespace strata::engine
