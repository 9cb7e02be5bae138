// The safetensors file format (Hugging Face, https://github.com/huggingface/safetensors):
//
//   [8 bytes: N, little-endian uint64] [N bytes: UTF-8 JSON header] [data section]
//
// The header is a JSON object {name: {"dtype": "F32"|"F16"|"BF16"|"U8", "shape": [d0, ...],
// "data_offsets": [begin, end]}, ..., "__metadata__": {string: string}}. Offsets are bytes
// relative to the start of the data section; the tensors cover the data section exactly, without
// holes or overlaps. Our writer pads the header with spaces so the data section starts at a
// multiple of 8 bytes (as the reference implementation does).
//
// Reading is two steps so that a fuzzer can call the parser on a byte string:
// ParseSafetensorsHeader validates a header against the file size before anything uses it
// (header length vs file size, JSON syntax, dtypes, shapes without overflow, offsets inside the
// data section, no overlap or hole, size = num_elems * dtype size, tensor names are plain keys
// of printable ASCII). Hostile input is a kDataLoss or kInvalidArgument error, never a crash or
// an out-of-bounds read.
//
// Tensor names are keys, never paths: nothing here opens a file named after a tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "base/unique_fd.h"

namespace strata::formats {

// Largest JSON header we accept (the reference implementation's limit is 100 MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// A tensor's element type: one of the engine's DTypes, or U8 (the codes of 8-bit optimizer state,
// engine/plan/optimizer_state.h). Converts implicitly from DType, so `tensor.dtype == DType::kF32`
// reads as it should; dtype() is the DType of a non-U8 type.
class TensorDType {
 public:
  constexpr TensorDType(DType dtype)  // NOLINT(google-explicit-constructor)
      : code_(static_cast<uint8_t>(dtype)) {}
  static constexpr TensorDType U8() { return TensorDType(kU8Code); }
  constexpr bool is_u8() const { return code_ == kU8Code; }
  // The DType; kF32 for U8 (check is_u8() first where U8 can occur).
  constexpr DType dtype() const { return is_u8() ? DType::kF32 : static_cast<DType>(code_); }
  constexpr size_t size() const { return is_u8() ? 1 : SizeOf(dtype()); }
  friend constexpr bool operator==(TensorDType a, TensorDType b) { return a.code_ == b.code_; }

 private:
  static constexpr uint8_t kU8Code = 0xff;
  explicit constexpr TensorDType(uint8_t code) : code_(code) {}
  uint8_t code_;
};

// "F32", "F16", "BF16", "U8" (the safetensors spelling).
std::string_view SafetensorsDTypeName(TensorDType dtype);

struct SafetensorsTensor {
  std::string name;
  TensorDType dtype = DType::kF32;
  std::vector<int64_t> shape;  // empty = scalar
  int64_t num_elems = 0;
  uint64_t begin_bytes = 0;  // offsets within the data section
  uint64_t end_bytes = 0;
  uint64_t size_bytes() const { return end_bytes - begin_bytes; }
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;               // N, the JSON length
  uint64_t data_offset_bytes = 0;          // 8 + N: where the data section starts in the file
  std::vector<SafetensorsTensor> tensors;  // sorted by begin_bytes
  std::map<std::string, std::string> metadata;
  // nullptr when there is no such tensor.
  const SafetensorsTensor* Find(std::string_view name) const;
};

// Parses and validates the header of a safetensors file of file_size bytes whose first bytes are
// file_prefix (at least 8 bytes; at least 8 + N to parse, else kDataLoss "header truncated").
// Errors: kDataLoss for a file that cannot be a valid safetensors file (lengths, offsets, JSON),
// kInvalidArgument for a well-formed file with a dtype this build does not handle. Pure function.
StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::span<const std::byte> file_prefix,
                                                   uint64_t file_size);

// Opens `path` (O_RDONLY | O_NOFOLLOW | O_CLOEXEC, base's OpenRegularFile: a FIFO or a directory
// is refused, not waited on), reads and validates its header. The returned fd is positioned
// nowhere in particular; use pread. Errors: as ParseSafetensorsHeader and OpenRegularFile
// (kInvalidArgument "safetensors file 'PATH' is a FIFO, not a regular file"), and errno-derived
// ones naming the path.
struct OpenSafetensors {
  std::string path;  // as opened; names the file in ReadTensorBytes' errors
  UniqueFd fd;
  uint64_t file_size = 0;
  SafetensorsHeader header;
};
StatusOr<OpenSafetensors> OpenSafetensorsFile(const std::string& path);

// Reads bytes [offset_bytes, offset_bytes + out.size()) of tensor `t`'s data. kOutOfRange when
// the range is outside the tensor; kDataLoss on a short read (file truncated since it was opened);
// errno-derived errors on a failed read. Read errors name file.path and the tensor.
Status ReadTensorBytes(const OpenSafetensors& file, const SafetensorsTensor& t,
                       uint64_t offset_bytes, std::span<std::byte> out);

// Streams a safetensors file: the tensor list is declared up front (so the header can be written
// first), then the data of each tensor is appended in declaration order, in pieces of any size.
// The file is created with O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode 0600. XXH3-64 of the
// whole file is computed while writing. Finish() checks that every declared byte was appended,
// fsyncs the file and closes it. Not thread-safe. Destroying an unfinished writer leaves a partial
// file behind (the caller writes into a temporary directory it removes on failure).
class SafetensorsWriter {
 public:
  struct TensorSpec {
    std::string name;
    TensorDType dtype;
    std::vector<int64_t> shape;
  };
  // Errors: kInvalidArgument (duplicate or non-printable name, negative dimension, overflow),
  // kAlreadyExists / errno-derived ones naming the path.
  static StatusOr<SafetensorsWriter> Create(const std::string& path,
                                            std::vector<TensorSpec> tensors,
                                            const std::map<std::string, std::string>& metadata);
  SafetensorsWriter(SafetensorsWriter&&) = default;
  SafetensorsWriter& operator=(SafetensorsWriter&&) = default;

  // Appends bytes of the current tensor(s); kFailedPrecondition past the declared total.
  // Write errors (ENOSPC, EIO) come back naming the path.
  Status Append(std::span<const std::byte> bytes);
  struct Result {
    uint64_t size_bytes = 0;
    uint64_t xxh3 = 0;  // XXH3_64bits of the whole file
  };
  StatusOr<Result> Finish();

 private:
  SafetensorsWriter() = default;
  Status WriteAll(std::span<const std::byte> bytes);
  std::string path_;
  UniqueFd fd_;
  uint64_t data_total_bytes_ = 0;
  uint64_t data_written_bytes_ = 0;
  uint64_t file_bytes_ = 0;
  struct XxhFree {
    void operator()(void* state) const;
  };
  std::unique_ptr<void, XxhFree> xxh_state_;  // XXH3_state_t
};

// A safetensors file that several processes write at once (the data-parallel ranks of a
// checkpoint, each writing its partition of every tensor): the layout is SafetensorsWriter's for
// the same tensors and metadata. Create (one process) creates the file (O_EXCL, mode 0600),
// writes the header and sizes the file to its full length; Open (the others, after Create)
// opens it for writing. WriteAt writes `bytes` at `offset_bytes` into tensor `index`'s data
// (kOutOfRange outside it); Sync makes this process's writes durable (fdatasync). The file's
// xxh3 is computed afterwards by one process (FileXxh3). Not thread-safe; one object per process.
class SafetensorsPartWriter {
 public:
  static StatusOr<SafetensorsPartWriter> Create(
      const std::string& path, const std::vector<SafetensorsWriter::TensorSpec>& tensors,
      const std::map<std::string, std::string>& metadata) {
    return Make(path, tensors, metadata, /*create=*/true);
  }
  // kDataLoss when the file's size is not its layout's.
  static StatusOr<SafetensorsPartWriter> Open(
      const std::string& path, const std::vector<SafetensorsWriter::TensorSpec>& tensors,
      const std::map<std::string, std::string>& metadata) {
    return Make(path, tensors, metadata, /*create=*/false);
  }
  Status WriteAt(size_t index, uint64_t offset_bytes, std::span<const std::byte> bytes);
  Status Sync();

 private:
  SafetensorsPartWriter() = default;
  static StatusOr<SafetensorsPartWriter> Make(
      const std::string& path, const std::vector<SafetensorsWriter::TensorSpec>& tensors,
      const std::map<std::string, std::string>& metadata, bool create);
  std::string path_;
  UniqueFd fd_;
  uint64_t data_offset_bytes_ = 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranges_;  // [begin, end) of each tensor's data
};

// XXH3_64bits of a whole regular file, read in pieces; errors name the path (OpenRegularFile's:
// a FIFO, device or directory is refused without waiting on it).
StatusOr<uint64_t> FileXxh3(const std::string& path, uint64_t* size_bytes);
// The same over an open file descriptor (read with pread from offset 0); `what` names it in errors.
StatusOr<uint64_t> FdXxh3(int fd, std::string_view what, uint64_t* size_bytes);

}  // namespace strata::formats
