// Writes a model as a Hugging Face model directory that transformers' from_pretrained loads:
//
//   OUT/config.json                        HfConfigJson(config, dtype)
//   OUT/model.safetensors                  all tensors, when they fit max_shard_bytes; else
//   OUT/model-00001-of-0000N.safetensors   shards of at most max_shard_bytes of tensor data
//   OUT/model.safetensors.index.json       (a tensor larger than that gets a shard of its own)
//                                          and {"metadata": {"total_size": B}, "weight_map"}
//   OUT/<companion files>                  copies of the files named (HfCheckpoint::
//                                          companion_files: the tokenizer's, chat_template.jinja,
//                                          generation_config.json)
//
// Tensors carry the family's Hugging Face names, shapes and layouts (HfBlockTensors: the GPT-2
// untied lm_head transposed back to (V, C); a tied model has no lm_head.weight), in block order,
// safetensors metadata {"format": "pt"}. Values are rounded from fp32 to `dtype` to nearest even
// (fp32: the bits as they are, so an fp32 import then export is byte-identical).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "formats/safetensors.h"
#include "models/hf_config.h"

namespace strata::models {

// A file copied into an exported directory as it is, under `name`, or its own file name when
// that is empty (a run's tokenizer trained from my_tok.json is written as the tokenizer.json
// transformers looks for).
struct CompanionFile {
  CompanionFile(std::string path_in, std::string name_in = "")  // NOLINT: a path is a file
      : path(std::move(path_in)), name(std::move(name_in)) {}
  std::string path;
  std::string name;
  std::string out_name() const;  // name, else path's file name; pure
};

// read_block(b, out) writes block b's fp32 chunk (HfBlockNumParams(config, b) elements, the
// layout of HfBlockTensors) into out; it is called once per block, in order, with one reused
// buffer of the largest block: the whole model is never in memory.
//
// Crash safety: out_dir must not exist or be an empty directory (else kAlreadyExists naming it);
// everything is written and fsynced into a temporary sibling directory ".NAME.tmp-export-XXXXXX"
// that is renamed to out_dir at the end, so out_dir appears complete or not at all. On any error
// the temporary directory is removed and out_dir is left as it was.
//
// Errors: kInvalidArgument (config out of range, max_shard_bytes == 0, two companion files with
// one name or one named as a weights or config file), kAlreadyExists, the first error of
// read_block, errno-derived I/O errors naming the file (a missing companion file: kNotFound).
//
// companion_files (tokenizer files, generation_config.json, ...) are copied in as they are, each
// under its CompanionFile::out_name().
Status WriteHfDirectory(const std::string& out_dir, const HfModelConfig& config,
                        const std::function<Status(int block, std::span<float> out)>& read_block,
                        DType dtype, uint64_t max_shard_bytes,
                        const std::vector<CompanionFile>& companion_files);

// The crash-safe directory write WriteHfDirectory uses, for any directory of files: out_dir must
// not exist or be empty (else kAlreadyExists, `what` naming the kind of write: "export"); `write`
// fills a temporary sibling directory, which is renamed to out_dir when it succeeds and removed
// when it fails. Errors: kInvalidArgument for a path that names no directory, write's, I/O.
Status WriteDirectoryAtomically(const std::string& out_dir, std::string_view what,
                                const std::function<Status(const std::string& tmp)>& write);

// The file name of safetensors shard `shard` (0-based) of `num_shards`, as transformers'
// save_pretrained names them: "model.safetensors" alone, else "model-00001-of-00003.safetensors".
std::string HfShardFileName(int shard, int num_shards);
// Finishes a shard's writer (formats/safetensors.h) and gives its file, `path`, mode 0644 (the
// writer creates files 0600). Errors: the writer's, errno-derived naming the file.
Status FinishHfShard(formats::SafetensorsWriter& writer, const std::string& path);

// Copies the regular file `from` to the new file `to` (O_CREAT | O_EXCL | O_NOFOLLOW, mode 0644)
// and fsyncs it; `what` names `from` in errors ("tokenizer file"). Errors: errno-derived, naming
// the file (a missing `from`: kNotFound; an existing `to`: kAlreadyExists).
Status CopyNewFile(const std::string& from, const std::string& to, std::string_view what);

}  // namespace strata::models
