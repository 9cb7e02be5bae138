#include "models/hf_export.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "base/file.h"
#include "base/unique_fd.h"
#include "cpu_optim/grad_stats.h"
#include "formats/safetensors.h"

namespace strata::models {
namespace {

namespace fs = std::filesystem;

// Elements converted and appended per piece.
constexpr int64_t kPieceElems = int64_t{1} << 20;

}  // namespace

std::string HfShardFileName(int shard, int num_shards) {
  return num_shards == 1 ? std::string("model.safetensors")
                         : fmt::format("model-{:05d}-of-{:05d}.safetensors", shard + 1, num_shards);
}

Status FinishHfShard(formats::SafetensorsWriter& writer, const std::string& path) {
  STRATA_RETURN_IF_ERROR(writer.Finish().status());
  if (::chmod(path.c_str(), 0644) != 0) {
    return ErrnoToStatus(errno, fmt::format("chmod '{}'", path));
  }
  return Status::Ok();
}

Status CopyNewFile(const std::string& from, const std::string& to, std::string_view what) {
  STRATA_ASSIGN_OR_RETURN(UniqueFd in, OpenRegularFile(from, what));
  UniqueFd out(::open(to.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (!out.valid()) return ErrnoToStatus(errno, fmt::format("creating '{}'", to));
  std::vector<std::byte> buf(1 << 20);
  for (;;) {
    const ssize_t r = ::read(in.get(), buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoToStatus(errno, fmt::format("reading '{}'", from));
    if (r == 0) break;
    STRATA_RETURN_IF_ERROR(WriteAll(out.get(), std::span(buf.data(), static_cast<size_t>(r)), to));
  }
  return FsyncFile(out.get(), to);
}

namespace {

// One output tensor: its block, its layout, and the shard it goes to.
struct Planned {
  int block = 0;
  HfTensor tensor;
  uint64_t size_bytes = 0;
  int shard = 0;
};

Status WriteInto(const std::string& tmp, const HfModelConfig& config,
                 const std::function<Status(int, std::span<float>)>& read_block, DType dtype,
                 uint64_t max_shard_bytes, const std::vector<CompanionFile>& companion_files) {
  // Plan: tensors in block order, packed greedily into shards of at most max_shard_bytes.
  const int num_blocks = HfNumBlocks(config);
  std::vector<Planned> plan;
  int64_t max_block = 0;
  uint64_t total_bytes = 0, shard_bytes = 0;
  int num_shards = 0;
  for (int b = 0; b < num_blocks; ++b) {
    max_block = std::max(max_block, HfBlockNumParams(config, b));
    for (HfTensor& t : HfBlockTensors(config, b)) {
      const uint64_t bytes = static_cast<uint64_t>(t.num_elems) * SizeOf(dtype);
      if (num_shards == 0 || (shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes)) {
        ++num_shards;
        shard_bytes = 0;
      }
      shard_bytes += bytes;
      total_bytes += bytes;
      plan.push_back({b, std::move(t), bytes, num_shards - 1});
    }
  }
  auto shard_name = [num_shards](int shard) { return HfShardFileName(shard, num_shards); };
  auto create_shard = [&](int shard) -> StatusOr<formats::SafetensorsWriter> {
    std::vector<formats::SafetensorsWriter::TensorSpec> specs;
    for (const Planned& p : plan) {
      if (p.shard == shard) specs.push_back({p.tensor.name, dtype, p.tensor.shape});
    }
    return formats::SafetensorsWriter::Create(tmp + "/" + shard_name(shard), std::move(specs),
                                              {{"format", "pt"}});
  };
  auto finish_shard = [&](formats::SafetensorsWriter& w, int shard) {
    return FinishHfShard(w, tmp + "/" + shard_name(shard));
  };

  // Write: one block in memory at a time, converted piece by piece.
  std::vector<float> chunk(static_cast<size_t>(max_block));
  std::vector<float> gathered;
  std::vector<std::byte> staging;
  std::optional<formats::SafetensorsWriter> writer;
  int current = -1;
  size_t next = 0;
  for (int b = 0; b < num_blocks; ++b) {
    const std::span<float> block(chunk.data(), static_cast<size_t>(HfBlockNumParams(config, b)));
    STRATA_RETURN_IF_ERROR(read_block(b, block));
    for (; next < plan.size() && plan[next].block == b; ++next) {
      const Planned& p = plan[next];
      if (p.shard != current) {
        if (writer) STRATA_RETURN_IF_ERROR(finish_shard(*writer, current));
        current = p.shard;
        STRATA_ASSIGN_OR_RETURN(auto w, create_shard(current));
        writer.emplace(std::move(w));
      }
      const float* src = block.data() + p.tensor.chunk_offset;
      const int64_t n = p.tensor.num_elems;
      // Appends fp32 values as `dtype`.
      auto append = [&](const float* values, int64_t count) -> Status {
        staging.resize(static_cast<size_t>(count) * SizeOf(dtype));
        STRATA_RETURN_IF_ERROR(cpu_optim::ConvertFromF32(values, staging.data(), dtype, count));
        return writer->Append(staging);
      };
      if (!p.tensor.transposed) {
        for (int64_t e = 0; e < n; e += kPieceElems) {
          STRATA_RETURN_IF_ERROR(append(src + e, std::min(kPieceElems, n - e)));
        }
        continue;
      }
      // Stored (R, K) from the chunk's (K, R): gather rows.
      const int64_t R = p.tensor.shape[0], K = p.tensor.shape[1];
      const int64_t piece_rows = std::max<int64_t>(1, kPieceElems / K);
      for (int64_t r0 = 0; r0 < R; r0 += piece_rows) {
        const int64_t nr = std::min(piece_rows, R - r0);
        gathered.resize(static_cast<size_t>(nr * K));
        for (int64_t r = 0; r < nr; ++r) {
          for (int64_t k = 0; k < K; ++k) gathered[r * K + k] = src[k * R + r0 + r];
        }
        STRATA_RETURN_IF_ERROR(append(gathered.data(), nr * K));
      }
    }
  }
  if (writer) STRATA_RETURN_IF_ERROR(finish_shard(*writer, current));

  if (num_shards > 1) {
    nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}},
                            {"weight_map", nlohmann::json::object()}};
    for (const Planned& p : plan) index["weight_map"][p.tensor.name] = shard_name(p.shard);
    STRATA_RETURN_IF_ERROR(
        WriteNewFile(tmp + "/model.safetensors.index.json", index.dump(2) + "\n", 0644));
  }
  STRATA_RETURN_IF_ERROR(WriteNewFile(tmp + "/config.json", HfConfigJson(config, dtype), 0644));
  for (const CompanionFile& from : companion_files) {
    STRATA_RETURN_IF_ERROR(CopyNewFile(from.path, tmp + "/" + from.out_name(), "model file"));
  }
  return FsyncDirectory(tmp);
}

}  // namespace

std::string CompanionFile::out_name() const {
  return name.empty() ? fs::path(path).filename().string() : name;
}

Status WriteHfDirectory(const std::string& out_dir, const HfModelConfig& config,
                        const std::function<Status(int block, std::span<float> out)>& read_block,
                        DType dtype, uint64_t max_shard_bytes,
                        const std::vector<CompanionFile>& companion_files) {
  STRATA_RETURN_IF_ERROR(config.family == HfModelConfig::Family::kLlama
                             ? ValidateLlamaConfig(config.llama)
                             : ValidateShape(config.gpt2));
  if (max_shard_bytes == 0) return InvalidArgumentError("max_shard_bytes must be positive");
  std::set<std::string> names;
  for (const CompanionFile& f : companion_files) {
    const std::string name = f.out_name();
    if (name.empty() || name.find('/') != std::string::npos || name == "config.json" ||
        name.ends_with(".safetensors") || name.ends_with(".index.json") ||
        !names.insert(name).second) {
      return InvalidArgumentError(fmt::format(
          "companion file '{}' as '{}': its name is empty, repeated or that of a weights/config "
          "file",
          f.path, name));
    }
  }

  return WriteDirectoryAtomically(out_dir, "export", [&](const std::string& tmp) {
    return WriteInto(tmp, config, read_block, dtype, max_shard_bytes, companion_files);
  });
}

Status WriteDirectoryAtomically(const std::string& out_dir, std::string_view what,
                                const std::function<Status(const std::string& tmp)>& write) {
  // out_dir: absent, or an empty directory that the rename replaces.
  fs::path target(out_dir);
  while (target.has_relative_path() && !target.has_filename()) target = target.parent_path();
  if (!target.has_filename() || target.filename() == "." || target.filename() == "..") {
    return InvalidArgumentError(fmt::format("'{}' does not name a directory to create", out_dir));
  }
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(target, ec);
  if (fs::exists(st)) {
    if (!fs::is_directory(st) || !fs::is_empty(target, ec) || ec) {
      return AlreadyExistsError(fmt::format(
          "'{}' exists and is not an empty directory (an {} never overwrites)", out_dir, what));
    }
  }
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  auto made = MakeTempDirectory(
      (parent / fmt::format(".{}.tmp-XXXXXX", target.filename().string())).string());
  if (!made.ok()) return made.status().WithContext(fmt::format("writing '{}'", out_dir));
  const std::string tmp = *made;
  Status s = write(tmp);
  if (s.ok() && ::chmod(tmp.c_str(), 0755) != 0) {
    s = ErrnoToStatus(errno, fmt::format("chmod '{}'", tmp));
  }
  if (s.ok()) s = RenameDurably(tmp, target.string());
  if (!s.ok()) RemoveTree(tmp);
  return s;
}

}  // namespace strata::models
