#include "data/token_dataset.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "base/file.h"
#include "base/unique_fd.h"

namespace strata::data {

// The format is little-endian; tokens are read and written in the host's order.
static_assert(std::endian::native == std::endian::little,
              "token files assume a little-endian host");

struct TokenDataset::Shard {
  Shard() = default;
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;
  ~Shard() {
    if (map != nullptr) ::munmap(map, map_bytes);
  }
  int32_t Token(int64_t i) const {
    return width == 2 ? static_cast<int32_t>(reinterpret_cast<const uint16_t*>(tokens)[i])
                      : static_cast<int32_t>(reinterpret_cast<const uint32_t*>(tokens)[i]);
  }

  std::string path;
  void* map = nullptr;  // the whole file, PROT_READ, MAP_PRIVATE
  size_t map_bytes = 0;
  const uint8_t* tokens = nullptr;  // map + kTokenFileHeaderBytes (page-aligned + 1024)
  const uint8_t* flags = nullptr;   // tokens + count * width, or null without flags
  int64_t count = 0;
  int width = 2;  // bytes per token
};

namespace {

bool HasGlobChars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

// Expands one --data pattern to its files, in sorted order.
StatusOr<std::vector<std::string>> Expand(const std::string& pattern) {
  std::error_code ec;
  if (!HasGlobChars(pattern) || std::filesystem::exists(pattern, ec)) {
    return std::vector<std::string>{pattern};
  }
  glob_t g{};
  const int r = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> out;
  if (r == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
  if (r == GLOB_NOMATCH) {
    return InvalidArgumentError(
        fmt::format("token files '{}': the pattern matches no file", pattern));
  }
  if (r == GLOB_NOSPACE) {
    return ResourceExhaustedError(fmt::format("token files '{}': out of memory in glob", pattern));
  }
  if (r != 0) {
    return InvalidArgumentError(
        fmt::format("token files '{}': a directory of the pattern cannot be read", pattern));
  }
  std::sort(out.begin(), out.end());  // glob sorts by the locale's collation; keep byte order
  return out;
}

// The first offset in tokens[0, count) whose value is >= limit, or -1. Scans in chunks whose
// maximum the compiler vectorizes; only a failing chunk is searched element by element.
template <typename T>
int64_t FirstTokenAtOrAbove(const T* tokens, int64_t count, uint64_t limit) {
  constexpr int64_t kChunk = 1 << 16;
  for (int64_t begin = 0; begin < count; begin += kChunk) {
    const int64_t end = std::min(count, begin + kChunk);
    T max = 0;
    for (int64_t i = begin; i < end; ++i) max = std::max(max, tokens[i]);
    if (max < limit) continue;
    for (int64_t i = begin; i < end; ++i) {
      if (tokens[i] >= limit) return i;
    }
  }
  return -1;
}

// The header's magic, version, flags word and count against the file size; *width gets the
// bytes per token.
Status CheckHeader(const std::string& path, const int32_t header[4], int64_t size, int* width) {
  if (header[0] == kLlama3TokenFileMagic) {
    // llm.c's Llama 3 file: version 7, uint32 tokens.
    if (header[1] != kLlama3TokenFileVersion) {
      return InvalidArgumentError(fmt::format(
          "token file '{}': version {} at byte offset 4 is not supported with magic {} (llm.c's "
          "Llama 3 files are version {})",
          path, header[1], kLlama3TokenFileMagic, kLlama3TokenFileVersion));
    }
  } else if (header[0] != kTokenFileMagic) {
    return InvalidArgumentError(
        fmt::format("token file '{}': bad magic {} at byte offset 0 (an llm.c token file starts "
                    "with {}, or {} for its Llama 3 files)",
                    path, header[0], kTokenFileMagic, kLlama3TokenFileMagic));
  } else if (header[1] != 1 && header[1] != 2) {
    return InvalidArgumentError(
        fmt::format("token file '{}': version {} at byte offset 4 is not supported (1: uint16 "
                    "tokens, 2: uint32 tokens)",
                    path, header[1]));
  }
  if (header[3] != 0 && header[3] != 1) {
    return InvalidArgumentError(
        fmt::format("token file '{}': flags word {} at byte offset 12 is not supported (0: no "
                    "flags, 1: one uint8 flag per token after the tokens)",
                    path, header[3]));
  }
  *width = header[0] == kTokenFileMagic && header[1] == 1 ? 2 : 4;
  const int64_t per_token = *width + (header[3] == 1 ? 1 : 0);
  const int64_t expected = kTokenFileHeaderBytes + int64_t{header[2]} * per_token;
  if (header[2] < 0 || expected != size) {
    return InvalidArgumentError(fmt::format(
        "token file '{}': the header says {} tokens ({} bytes with the header, uint{} tokens{}) "
        "but the file has {} bytes",
        path, header[2], expected, *width * 8, header[3] == 1 ? " and uint8 flags" : "", size));
  }
  return Status::Ok();
}

}  // namespace

bool TokenFileLooksWhole(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  struct stat st;
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  int32_t header[4];
  if (::pread(fd.get(), header, sizeof header, 0) != static_cast<ssize_t>(sizeof header)) {
    return false;
  }
  int width = 0;
  return CheckHeader(path, header, st.st_size, &width).ok();
}

// Every token of `shard` below vocab_size.
Status TokenDataset::CheckTokens(const Shard& shard, int vocab_size) {
  const int64_t bad = shard.width == 2
                          ? FirstTokenAtOrAbove(reinterpret_cast<const uint16_t*>(shard.tokens),
                                                shard.count, static_cast<uint64_t>(vocab_size))
                          : FirstTokenAtOrAbove(reinterpret_cast<const uint32_t*>(shard.tokens),
                                                shard.count, static_cast<uint64_t>(vocab_size));
  if (bad < 0) return Status::Ok();
  return InvalidArgumentError(
      fmt::format("token file '{}': token {} at token offset {} (byte offset {}) is not below the "
                  "vocabulary size {}",
                  shard.path, static_cast<uint32_t>(shard.Token(bad)), bad,
                  kTokenFileHeaderBytes + bad * shard.width, vocab_size));
}

StatusOr<std::shared_ptr<TokenDataset::Shard>> TokenDataset::OpenShard(const std::string& path,
                                                                       int vocab_size) {
  struct stat st;
  STRATA_ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(path, "token file", 0, &st));
  const int64_t size = st.st_size;
  if (size < kTokenFileHeaderBytes) {
    return InvalidArgumentError(
        fmt::format("token file '{}' has {} bytes, fewer than the {}-byte header of an llm.c "
                    "token file",
                    path, size, kTokenFileHeaderBytes));
  }
  auto shard = std::make_shared<TokenDataset::Shard>();
  shard->path = path;
  shard->map_bytes = static_cast<size_t>(size);
  void* map = ::mmap(nullptr, shard->map_bytes, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (map == MAP_FAILED) {
    return ErrnoToStatus(errno, fmt::format("cannot map token file '{}'", path));
  }
  shard->map = map;
  int32_t header[4];
  std::memcpy(header, map, sizeof header);
  STRATA_RETURN_IF_ERROR(CheckHeader(path, header, size, &shard->width));
  shard->count = header[2];
  shard->tokens = static_cast<const uint8_t*>(map) + kTokenFileHeaderBytes;
  if (header[3] == 1) shard->flags = shard->tokens + shard->count * shard->width;
  STRATA_RETURN_IF_ERROR(CheckTokens(*shard, vocab_size));
  if (shard->flags != nullptr) {
    for (int64_t i = 0; i < shard->count; ++i) {
      if ((shard->flags[i] & ~kTokenFlagsKnown) != 0) {
        return InvalidArgumentError(fmt::format(
            "token file '{}': flags 0x{:02x} of token offset {} (byte offset {}) have a bit "
            "other than 0 (in loss), 1 (example start) and 2 (pair start)",
            path, shard->flags[i], i, kTokenFileHeaderBytes + shard->count * shard->width + i));
      }
    }
  }
  return shard;
}

StatusOr<TokenDataset> TokenDataset::Open(const std::vector<std::string>& patterns,
                                          int vocab_size) {
  if (patterns.empty()) return InvalidArgumentError("no token files given");
  if (vocab_size <= 0) {
    return InvalidArgumentError(fmt::format("vocabulary size {} is not positive", vocab_size));
  }
  TokenDataset d;
  d.starts_.push_back(0);
  for (const std::string& pattern : patterns) {
    STRATA_ASSIGN_OR_RETURN(auto paths, Expand(pattern));
    for (const std::string& path : paths) {
      STRATA_ASSIGN_OR_RETURN(auto shard, OpenShard(path, vocab_size));
      const bool has_flags = shard->flags != nullptr;
      if (d.shards_.empty()) {
        d.has_flags_ = has_flags;
      } else if (has_flags != d.has_flags_) {
        return InvalidArgumentError(fmt::format(
            "token file '{}' {} per-token flags but '{}' {}: all shards must agree", path,
            has_flags ? "has" : "has no", d.shards_[0]->path, d.has_flags_ ? "has" : "has none"));
      }
      d.starts_.push_back(d.starts_.back() + shard->count);
      d.shards_.push_back(std::move(shard));
    }
  }
  d.end_ = d.starts_.back();
  return d;
}

std::vector<std::string> TokenDataset::paths() const {
  std::vector<std::string> out;
  for (const auto& s : shards_) out.push_back(s->path);
  return out;
}

int TokenDataset::max_token_bytes() const {
  int w = 0;
  for (const auto& s : shards_) w = std::max(w, s->width);
  return w;
}

TokenDataset TokenDataset::Slice(int64_t begin, int64_t end) const {
  STRATA_CHECK_MSG(0 <= begin && begin <= end && end <= num_tokens(),
                   fmt::format("slice [{}, {}) of {} tokens", begin, end, num_tokens()));
  TokenDataset d = *this;
  d.begin_ = begin_ + begin;
  d.end_ = begin_ + end;
  return d;
}

TokenDataset::Location TokenDataset::Locate(int64_t offset) const {
  STRATA_CHECK_MSG(0 <= offset && offset < num_tokens(),
                   fmt::format("token {} of {}", offset, num_tokens()));
  const int64_t g = begin_ + offset;
  const auto s = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), g) -
                                     starts_.begin() - 1);
  return {shards_[s]->path, g - starts_[s]};
}

template <typename Fn>
void TokenDataset::ForEachShardRun(int64_t offset, int64_t n, Fn&& fn) const {
  int64_t g = begin_ + offset;
  size_t s = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), g) -
                                 starts_.begin() - 1);
  for (int64_t done = 0; done < n; ++s) {
    const Shard& shard = *shards_[s];
    const int64_t local = g - starts_[s];
    const int64_t take = std::min(n - done, shard.count - local);
    fn(shard, local, take, done);
    g += take;
    done += take;
  }
}

void TokenDataset::Read(int64_t offset, int64_t n, int32_t* out) const {
  STRATA_CHECK_MSG(offset >= 0 && n >= 0 && offset + n <= num_tokens(),
                   fmt::format("read [{}, {}) of {} tokens", offset, offset + n, num_tokens()));
  ForEachShardRun(offset, n, [&](const Shard& shard, int64_t local, int64_t take, int64_t done) {
    if (shard.width == 2) {
      const auto* p = reinterpret_cast<const uint16_t*>(shard.tokens) + local;
      for (int64_t i = 0; i < take; ++i) out[done + i] = p[i];
    } else {
      const auto* p = reinterpret_cast<const uint32_t*>(shard.tokens) + local;
      for (int64_t i = 0; i < take; ++i) out[done + i] = static_cast<int32_t>(p[i]);
    }
  });
}

void TokenDataset::ReadFlags(int64_t offset, int64_t n, uint8_t* out) const {
  STRATA_CHECK_MSG(has_flags_ && offset >= 0 && n >= 0 && offset + n <= num_tokens(),
                   fmt::format("flags [{}, {}) of {} tokens (flags: {})", offset, offset + n,
                               num_tokens(), has_flags_));
  ForEachShardRun(offset, n, [&](const Shard& shard, int64_t local, int64_t take, int64_t done) {
    std::memcpy(out + done, shard.flags + local, static_cast<size_t>(take));
  });
}

void TokenDataset::Window(int64_t offset, int seq_len, int32_t* tokens, int32_t* targets) const {
  // One read of seq_len + 1 tokens: inputs are its first seq_len, targets its last seq_len.
  Read(offset, 1, tokens);
  Read(offset + 1, seq_len, targets);
  std::copy(targets, targets + seq_len - 1, tokens + 1);
}

void TokenDataset::SampleTrainBatch(std::mt19937_64& rng, int batch_size, int seq_len,
                                    Batch* batch) const {
  STRATA_CHECK_MSG(num_tokens() > seq_len && seq_len > 0,
                   fmt::format("{} tokens for windows of {} + 1", num_tokens(), seq_len));
  std::vector<int32_t>* tokens = &batch->tokens;
  std::vector<int32_t>* targets = &batch->targets;
  batch->positions.clear();
  tokens->resize(static_cast<size_t>(batch_size) * seq_len);
  targets->resize(tokens->size());
  const uint64_t positions = static_cast<uint64_t>(num_tokens() - seq_len);
  for (int b = 0; b < batch_size; ++b) {
    const int64_t o = static_cast<int64_t>(rng() % positions);
    Window(o, seq_len, tokens->data() + static_cast<size_t>(b) * seq_len,
           targets->data() + static_cast<size_t>(b) * seq_len);
  }
}

void TokenDataset::ValBatch(int index, int count, int batch_size, int seq_len, Batch* batch) const {
  STRATA_CHECK_MSG(num_tokens() > seq_len && seq_len > 0 && 0 <= index && index < count,
                   fmt::format("validation batch {} of {} over {} tokens, windows of {} + 1", index,
                               count, num_tokens(), seq_len));
  std::vector<int32_t>* tokens = &batch->tokens;
  std::vector<int32_t>* targets = &batch->targets;
  batch->positions.clear();
  tokens->resize(static_cast<size_t>(batch_size) * seq_len);
  targets->resize(tokens->size());
  const uint64_t positions = static_cast<uint64_t>(num_tokens() - seq_len);
  const uint64_t windows = static_cast<uint64_t>(count) * batch_size;
  for (int b = 0; b < batch_size; ++b) {
    const uint64_t k = static_cast<uint64_t>(index) * batch_size + b;
    const int64_t o = static_cast<int64_t>(k * positions / windows);
    Window(o, seq_len, tokens->data() + static_cast<size_t>(b) * seq_len,
           targets->data() + static_cast<size_t>(b) * seq_len);
  }
}

int64_t TokenDataset::num_windows(int seq_len, int64_t max_tokens) const {
  STRATA_CHECK_MSG(seq_len > 0, fmt::format("windows of {} tokens", seq_len));
  const int64_t n = max_tokens > 0 ? std::min(max_tokens, num_tokens()) : num_tokens();
  return n > seq_len ? (n - 1) / seq_len : 0;
}

void TokenDataset::EvalWindow(int64_t index, int seq_len, int32_t* tokens, int32_t* targets) const {
  STRATA_CHECK_MSG(index >= 0 && index < num_windows(seq_len),
                   fmt::format("evaluation window {} of {}", index, num_windows(seq_len)));
  Window(index * seq_len, seq_len, tokens, targets);
}

Status WriteTokenFile(const std::string& path, std::span<const int32_t> tokens,
                      std::span<const uint8_t> flags) {
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return InvalidArgumentError(fmt::format(
        "token file '{}': {} tokens exceed the format's int32 count; write several shards", path,
        tokens.size()));
  }
  if (!flags.empty() && flags.size() != tokens.size()) {
    return InvalidArgumentError(
        fmt::format("token file '{}': {} flags for {} tokens", path, flags.size(), tokens.size()));
  }
  for (size_t i = 0; i < flags.size(); ++i) {
    if ((flags[i] & ~kTokenFlagsKnown) != 0) {
      return InvalidArgumentError(
          fmt::format("token file '{}': flags 0x{:02x} at token offset {} have an unknown bit",
                      path, flags[i], i));
    }
  }
  int32_t max = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0) {
      return InvalidArgumentError(fmt::format(
          "token file '{}': token {} at token offset {} is negative", path, tokens[i], i));
    }
    max = std::max(max, tokens[i]);
  }
  const int width = max < 65536 ? 2 : 4;
  // A regular file (or none) is replaced whole; /dev/stdout or a FIFO is written directly.
  STRATA_ASSIGN_OR_RETURN(OutputFileWriter file, OutputFileWriter::Create(path, "token file"));
  {
    std::vector<int32_t> header(kTokenFileHeaderInts, 0);
    header[0] = kTokenFileMagic;
    header[1] = width == 2 ? 1 : 2;
    header[2] = static_cast<int32_t>(tokens.size());
    header[3] = flags.empty() ? 0 : 1;
    STRATA_RETURN_IF_ERROR(file.Append(std::as_bytes(std::span(header))));
    constexpr size_t kChunk = 1 << 20;
    std::vector<uint8_t> buf(kChunk * width);
    for (size_t begin = 0; begin < tokens.size(); begin += kChunk) {
      const size_t n = std::min(kChunk, tokens.size() - begin);
      if (width == 2) {
        auto* p = reinterpret_cast<uint16_t*>(buf.data());
        for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint16_t>(tokens[begin + i]);
      } else {
        auto* p = reinterpret_cast<uint32_t*>(buf.data());
        for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint32_t>(tokens[begin + i]);
      }
      STRATA_RETURN_IF_ERROR(file.Append(std::as_bytes(std::span(buf.data(), n * width))));
    }
    if (!flags.empty()) STRATA_RETURN_IF_ERROR(file.Append(std::as_bytes(flags)));
  }
  return file.Commit();
}

TokenTrainingData::TokenTrainingData(TokenDataset train, TokenDataset val, std::string description)
    : train_(std::move(train)), val_(std::move(val)), description_(std::move(description)) {}

std::string TokenTrainingData::Describe() const {
  return fmt::format("{}, {} tokens (train {}, val {})", description_,
                     train_tokens() + val_tokens(), train_tokens(), val_tokens());
}

}  // namespace strata::data
