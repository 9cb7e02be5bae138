#include "formats/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "base/file.h"
#include "base/untrusted_text.h"

namespace strata::formats {
namespace {

using json = nlohmann::json;

StatusOr<TensorDType> DTypeFromSafetensors(std::string_view name) {
  if (name == "F32") return TensorDType(DType::kF32);
  if (name == "F16") return TensorDType(DType::kF16);
  if (name == "BF16") return TensorDType(DType::kBF16);
  if (name == "U8") return TensorDType::U8();
  return InvalidArgumentError(
      fmt::format("safetensors dtype '{}' is not supported here (F32, F16, BF16 and U8 are)",
                  Excerpt(name, 32)));
}

// A tensor name is a key: 1..1024 printable ASCII characters.
bool ValidName(std::string_view name) {
  if (name.empty() || name.size() > 1024) return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return static_cast<unsigned char>(c) >= 0x20 && c != 0x7f; });
}

std::string Quoted(std::string_view name) {
  std::string out;
  for (char c : name.substr(0, 80)) {
    const auto u = static_cast<unsigned char>(c);
    out += (u >= 0x20 && u < 0x7f) ? std::string(1, c) : fmt::format("\\x{:02x}", u);
  }
  return "'" + out + (name.size() > 80 ? "...'" : "'");
}

uint64_t LoadLe64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

StatusOr<SafetensorsTensor> ParseTensor(const std::string& name, const json& entry,
                                        uint64_t data_bytes) {
  const std::string what = "safetensors tensor " + Quoted(name);
  if (!ValidName(name)) {
    return DataLossError(
        fmt::format("{}: a tensor name must be 1..1024 printable characters", what));
  }
  if (!entry.is_object()) return DataLossError(what + ": entry is not a JSON object");
  for (const auto& [key, value] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return DataLossError(fmt::format("{}: unknown field {}", what, Quoted(key)));
    }
  }
  const auto dt = entry.find("dtype");
  const auto sh = entry.find("shape");
  const auto off = entry.find("data_offsets");
  if (dt == entry.end() || !dt->is_string() || sh == entry.end() || !sh->is_array() ||
      off == entry.end() || !off->is_array()) {
    return DataLossError(what +
                         ": needs \"dtype\" (string), \"shape\" (array) and \"data_offsets\" "
                         "(array)");
  }
  SafetensorsTensor t;
  t.name = name;
  STRATA_ASSIGN_OR_RETURN(t.dtype, DTypeFromSafetensors(dt->get_ref<const std::string&>()));
  if (sh->size() > 16) return DataLossError(what + ": more than 16 dimensions");
  uint64_t num_elems = 1;
  for (const auto& d : *sh) {
    if (!d.is_number_unsigned()) {
      return DataLossError(what + ": a dimension is not a non-negative integer");
    }
    const uint64_t dim = d.get<uint64_t>();
    if (dim > static_cast<uint64_t>(INT64_MAX) ||
        __builtin_mul_overflow(num_elems, dim, &num_elems)) {
      return DataLossError(what + ": the shape's element count overflows");
    }
    t.shape.push_back(static_cast<int64_t>(dim));
  }
  uint64_t size_bytes = 0;
  if (__builtin_mul_overflow(num_elems, t.dtype.size(), &size_bytes) ||
      num_elems > static_cast<uint64_t>(INT64_MAX)) {
    return DataLossError(what + ": the shape's byte size overflows");
  }
  t.num_elems = static_cast<int64_t>(num_elems);
  if (off->size() != 2 || !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned()) {
    return DataLossError(what + ": data_offsets must be two non-negative integers");
  }
  t.begin_bytes = (*off)[0].get<uint64_t>();
  t.end_bytes = (*off)[1].get<uint64_t>();
  if (t.begin_bytes > t.end_bytes || t.end_bytes > data_bytes) {
    return DataLossError(
        fmt::format("{}: data_offsets [{}, {}] are not inside the data section of {} bytes", what,
                    t.begin_bytes, t.end_bytes, data_bytes));
  }
  if (t.end_bytes - t.begin_bytes != size_bytes) {
    return DataLossError(fmt::format("{}: data_offsets span {} bytes but shape and dtype need {}",
                                     what, t.end_bytes - t.begin_bytes, size_bytes));
  }
  return t;
}

}  // namespace

std::string_view SafetensorsDTypeName(TensorDType dtype) {
  if (dtype.is_u8()) return "U8";
  switch (dtype.dtype()) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "?";
}

const SafetensorsTensor* SafetensorsHeader::Find(std::string_view name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::span<const std::byte> file_prefix,
                                                   uint64_t file_size) {
  if (file_size < 8 || file_prefix.size() < 8) {
    return DataLossError(fmt::format(
        "safetensors file of {} bytes is shorter than its 8-byte header length", file_size));
  }
  SafetensorsHeader h;
  h.header_bytes = LoadLe64(file_prefix.data());
  if (h.header_bytes > file_size - 8 || h.header_bytes > kMaxSafetensorsHeaderBytes) {
    return DataLossError(
        fmt::format("safetensors header length {} does not fit a file of {} bytes (limit {} bytes)",
                    h.header_bytes, file_size, kMaxSafetensorsHeaderBytes));
  }
  if (file_prefix.size() < 8 + h.header_bytes) {
    return DataLossError(fmt::format("safetensors header truncated: {} of {} bytes available",
                                     file_prefix.size() - 8, h.header_bytes));
  }
  h.data_offset_bytes = 8 + h.header_bytes;
  const uint64_t data_bytes = file_size - h.data_offset_bytes;
  const auto* text = reinterpret_cast<const char*>(file_prefix.data() + 8);
  // Bounded: a header nested millions deep is refused before it is built (it held gigabytes).
  StatusOr<json> parsed = ParseJsonBounded(std::string_view(text, h.header_bytes));
  if (!parsed.ok()) {
    return DataLossError(
        fmt::format("safetensors header is not a JSON object: {}", parsed.status().message()));
  }
  const json& j = *parsed;
  if (!j.is_object()) return DataLossError("safetensors header is not a JSON object");
  for (const auto& [key, value] : j.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) return DataLossError("safetensors __metadata__ is not an object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          return DataLossError(
              fmt::format("safetensors __metadata__ value of {} is not a string", Quoted(mk)));
        }
        h.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(auto t, ParseTensor(key, value, data_bytes));
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const auto& a, const auto& b) { return a.begin_bytes < b.begin_bytes; });
  // The tensors tile the data section: no overlap, no hole, nothing after the last one.
  uint64_t cursor = 0;
  for (const auto& t : h.tensors) {
    if (t.begin_bytes != cursor) {
      return DataLossError(fmt::format(
          "safetensors tensor {} starts at byte {} of the data section, expected {} ({})",
          Quoted(t.name), t.begin_bytes, cursor, t.begin_bytes < cursor ? "overlap" : "hole"));
    }
    cursor = t.end_bytes;
  }
  if (cursor != data_bytes) {
    return DataLossError(fmt::format(
        "safetensors data section is {} bytes but its tensors cover {}", data_bytes, cursor));
  }
  return h;
}

StatusOr<OpenSafetensors> OpenSafetensorsFile(const std::string& path) {
  OpenSafetensors f;
  f.path = path;
  struct stat st;
  STRATA_ASSIGN_OR_RETURN(f.fd, OpenRegularFile(path, "safetensors file", O_NOFOLLOW, &st));
  f.file_size = static_cast<uint64_t>(st.st_size);
  std::byte len[8];
  const ssize_t n = f.file_size >= 8 ? ::pread(f.fd.get(), len, 8, 0) : 0;
  if (n < 0) return ErrnoToStatus(errno, fmt::format("reading '{}'", path));
  if (n != 8) {
    return DataLossError(
        fmt::format("'{}': {} bytes is too short for a safetensors file", path, f.file_size));
  }
  const uint64_t header_bytes = LoadLe64(len);
  if (header_bytes > f.file_size - 8 || header_bytes > kMaxSafetensorsHeaderBytes) {
    auto s = ParseSafetensorsHeader(std::span<const std::byte>(len, 8), f.file_size);
    return s.status().WithContext(path);
  }
  std::vector<std::byte> prefix(8 + header_bytes);
  std::memcpy(prefix.data(), len, 8);
  uint64_t done = 0;
  while (done < header_bytes) {
    const ssize_t r = ::pread(f.fd.get(), prefix.data() + 8 + done, header_bytes - done, 8 + done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoToStatus(errno, fmt::format("reading '{}'", path));
    if (r == 0) return DataLossError(fmt::format("'{}': header truncated", path));
    done += static_cast<uint64_t>(r);
  }
  auto header = ParseSafetensorsHeader(prefix, f.file_size);
  if (!header.ok()) return header.status().WithContext(path);
  f.header = std::move(*header);
  return f;
}

Status ReadTensorBytes(const OpenSafetensors& file, const SafetensorsTensor& t,
                       uint64_t offset_bytes, std::span<std::byte> out) {
  if (offset_bytes > t.size_bytes() || out.size() > t.size_bytes() - offset_bytes) {
    return OutOfRangeError(fmt::format("bytes [{}, +{}) are outside tensor '{}' of {} bytes",
                                       offset_bytes, out.size(), t.name, t.size_bytes()));
  }
  uint64_t pos = file.header.data_offset_bytes + t.begin_bytes + offset_bytes;
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t r = ::pread(file.fd.get(), out.data() + done, out.size() - done,
                              static_cast<off_t>(pos + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      return ErrnoToStatus(errno, fmt::format("'{}': reading tensor '{}'", file.path, t.name));
    }
    if (r == 0) {
      return DataLossError(fmt::format("'{}': tensor '{}': file ends at byte {} (truncated)",
                                       file.path, t.name, pos + done));
    }
    done += static_cast<size_t>(r);
  }
  return Status::Ok();
}

void SafetensorsWriter::XxhFree::operator()(void* state) const {
  XXH3_freeState(static_cast<XXH3_state_t*>(state));
}

namespace {

// The header text (padded so the data starts 8-byte aligned) and each tensor's data range.
struct HeaderLayout {
  std::string text;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  uint64_t data_bytes = 0;
};

StatusOr<HeaderLayout> LayOutHeader(const std::vector<SafetensorsWriter::TensorSpec>& tensors,
                                    const std::map<std::string, std::string>& metadata) {
  HeaderLayout l;
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (!ValidName(t.name) || t.name == "__metadata__" || !names.insert(t.name).second) {
      return InvalidArgumentError(fmt::format(
          "tensor name {} is empty, not printable, reserved or repeated", Quoted(t.name)));
    }
    uint64_t n = t.dtype.size();
    for (int64_t d : t.shape) {
      if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) {
        return InvalidArgumentError(fmt::format("tensor '{}': bad shape", t.name));
      }
    }
    header[t.name] = {{"dtype", SafetensorsDTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + n}}};
    l.ranges.emplace_back(offset, offset + n);
    offset += n;
  }
  l.data_bytes = offset;
  l.text = header.dump();
  l.text.append((8 - (8 + l.text.size()) % 8) % 8, ' ');  // data section 8-byte aligned
  return l;
}

Status PwriteAll(int fd, const std::string& path, uint64_t offset,
                 std::span<const std::byte> bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t r = ::pwrite(fd, bytes.data() + done, bytes.size() - done, offset + done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoToStatus(errno, fmt::format("writing '{}'", path));
    done += static_cast<size_t>(r);
  }
  return Status::Ok();
}

}  // namespace

StatusOr<SafetensorsPartWriter> SafetensorsPartWriter::Make(
    const std::string& path, const std::vector<SafetensorsWriter::TensorSpec>& tensors,
    const std::map<std::string, std::string>& metadata, bool create) {
  STRATA_ASSIGN_OR_RETURN(HeaderLayout l, LayOutHeader(tensors, metadata));
  SafetensorsPartWriter w;
  w.path_ = path;
  w.data_offset_bytes_ = 8 + l.text.size();
  w.ranges_ = std::move(l.ranges);
  const uint64_t file_bytes = w.data_offset_bytes_ + l.data_bytes;
  if (!create) {
    w.fd_ = UniqueFd(::open(path.c_str(), O_WRONLY | O_NOFOLLOW | O_CLOEXEC));
    if (!w.fd_.valid()) return ErrnoToStatus(errno, fmt::format("opening '{}'", path));
    struct stat st;
    if (::fstat(w.fd_.get(), &st) != 0) return ErrnoToStatus(errno, path);
    if (static_cast<uint64_t>(st.st_size) != file_bytes) {
      return DataLossError(
          fmt::format("'{}' is {} bytes, its layout needs {}", path, st.st_size, file_bytes));
    }
    return w;
  }
  w.fd_ = UniqueFd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                          S_IRUSR | S_IWUSR));
  if (!w.fd_.valid()) return ErrnoToStatus(errno, fmt::format("creating '{}'", path));
  std::byte len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<std::byte>((l.text.size() >> (8 * i)) & 0xff);
  STRATA_RETURN_IF_ERROR(PwriteAll(w.fd_.get(), path, 0, len));
  STRATA_RETURN_IF_ERROR(PwriteAll(w.fd_.get(), path, 8, std::as_bytes(std::span(l.text))));
  if (::ftruncate(w.fd_.get(), static_cast<off_t>(file_bytes)) != 0) {
    return ErrnoToStatus(errno, fmt::format("sizing '{}'", path));
  }
  return w;
}

Status SafetensorsPartWriter::WriteAt(size_t index, uint64_t offset_bytes,
                                      std::span<const std::byte> bytes) {
  if (index >= ranges_.size() ||
      offset_bytes + bytes.size() > ranges_[index].second - ranges_[index].first) {
    return OutOfRangeError(fmt::format("'{}': write of {} bytes at {} outside tensor {}", path_,
                                       bytes.size(), offset_bytes, index));
  }
  return PwriteAll(fd_.get(), path_, data_offset_bytes_ + ranges_[index].first + offset_bytes,
                   bytes);
}

Status SafetensorsPartWriter::Sync() {
  if (::fdatasync(fd_.get()) != 0) return ErrnoToStatus(errno, fmt::format("syncing '{}'", path_));
  return Status::Ok();
}

StatusOr<SafetensorsWriter> SafetensorsWriter::Create(
    const std::string& path, std::vector<TensorSpec> tensors,
    const std::map<std::string, std::string>& metadata) {
  STRATA_ASSIGN_OR_RETURN(HeaderLayout l, LayOutHeader(tensors, metadata));
  SafetensorsWriter w;
  w.path_ = path;
  w.data_total_bytes_ = l.data_bytes;
  const std::string& text = l.text;
  w.xxh_state_.reset(XXH3_createState());
  if (!w.xxh_state_) return ResourceExhaustedError("could not allocate an xxh3 state");
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(w.xxh_state_.get()));
  w.fd_ = UniqueFd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                          S_IRUSR | S_IWUSR));
  if (!w.fd_.valid()) return ErrnoToStatus(errno, fmt::format("creating '{}'", path));
  std::byte len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<std::byte>((text.size() >> (8 * i)) & 0xff);
  STRATA_RETURN_IF_ERROR(w.WriteAll(len));
  STRATA_RETURN_IF_ERROR(w.WriteAll(std::as_bytes(std::span(text))));
  return w;
}

Status SafetensorsWriter::WriteAll(std::span<const std::byte> bytes) {
  STRATA_RETURN_IF_ERROR(strata::WriteAll(fd_.get(), bytes, path_));
  XXH3_64bits_update(static_cast<XXH3_state_t*>(xxh_state_.get()), bytes.data(), bytes.size());
  file_bytes_ += bytes.size();
  return Status::Ok();
}

Status SafetensorsWriter::Append(std::span<const std::byte> bytes) {
  if (!fd_.valid()) return FailedPreconditionError(fmt::format("'{}' is already finished", path_));
  if (bytes.size() > data_total_bytes_ - data_written_bytes_) {
    return FailedPreconditionError(
        fmt::format("'{}': appending {} bytes exceeds the declared tensors' {} bytes", path_,
                    bytes.size(), data_total_bytes_));
  }
  STRATA_RETURN_IF_ERROR(WriteAll(bytes));
  data_written_bytes_ += bytes.size();
  return Status::Ok();
}

StatusOr<SafetensorsWriter::Result> SafetensorsWriter::Finish() {
  if (!fd_.valid()) return FailedPreconditionError(fmt::format("'{}' is already finished", path_));
  if (data_written_bytes_ != data_total_bytes_) {
    return FailedPreconditionError(fmt::format("'{}': {} of {} tensor bytes were appended", path_,
                                               data_written_bytes_, data_total_bytes_));
  }
  STRATA_RETURN_IF_ERROR(FsyncFile(fd_.get(), path_));
  if (::close(fd_.release()) != 0) return ErrnoToStatus(errno, fmt::format("close '{}'", path_));
  return Result{file_bytes_, XXH3_64bits_digest(static_cast<XXH3_state_t*>(xxh_state_.get()))};
}

StatusOr<uint64_t> FileXxh3(const std::string& path, uint64_t* size_bytes) {
  STRATA_ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(path, "file", O_NOFOLLOW));
  return FdXxh3(fd.get(), path, size_bytes);
}

StatusOr<uint64_t> FdXxh3(int fd, std::string_view what, uint64_t* size_bytes) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                 &XXH3_freeState);
  if (!state) return ResourceExhaustedError("could not allocate an xxh3 state");
  XXH3_64bits_reset(state.get());
  std::vector<char> buf(1 << 20);
  uint64_t total = 0;
  for (;;) {
    const ssize_t r = ::pread(fd, buf.data(), buf.size(), static_cast<off_t>(total));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoToStatus(errno, fmt::format("reading '{}'", what));
    if (r == 0) break;
    XXH3_64bits_update(state.get(), buf.data(), static_cast<size_t>(r));
    total += static_cast<uint64_t>(r);
  }
  if (size_bytes) *size_bytes = total;
  return XXH3_64bits_digest(state.get());
}

}  // namespace strata::formats
