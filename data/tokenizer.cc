#include "data/tokenizer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sentencepiece_processor.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <limits>

#include "base/file.h"
#include "base/unique_fd.h"
#include "base/untrusted_text.h"
#include "data/hf_tokenizer.h"
#include "data/hf_tokenizer_json.h"
#include "data/token_dataset.h"

namespace strata::data {

namespace {

// The whole file at `path`, however large; `what` names it in errors ("tokenizer file").
StatusOr<std::string> ReadWholeFile(const std::string& path, std::string_view what) {
  auto bytes = ReadSmallFile(path, {.max_bytes = std::numeric_limits<uint64_t>::max()});
  if (!bytes.ok()) return bytes.status().WithContext(what);
  return bytes;
}

// libsentencepiece's messages may quote a piece of the model file (a duplicate piece "is
// already defined"): they are quoted through Excerpt, escaped and bounded like any text from a
// file.
constexpr size_t kLibraryMessageBytes = 512;

// A SentencePiece model behind the Tokenizer interface.
class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(std::string path, uint64_t fingerprint)
      : Tokenizer(std::move(path), fingerprint) {}
  sentencepiece::SentencePieceProcessor sp;

  // tokenizer_config.json's add_bos_token / add_eos_token beside the model, as LlamaTokenizer
  // reads them (absent: a BOS and no EOS).
  bool add_bos = true, add_eos = false;

  int vocab_size() const override { return sp.GetPieceSize(); }
  int bos_id() const override { return sp.bos_id(); }
  int eos_id() const override { return sp.eos_id(); }
  bool adds_bos() const override { return add_bos && bos_id() >= 0; }
  bool adds_eos() const override { return add_eos && eos_id() >= 0; }
  int TokenId(std::string_view piece) const override {
    const int id = sp.PieceToId(piece);
    // PieceToId answers unk_id for a piece it does not know.
    return id >= 0 && sp.IdToPiece(id) == piece ? id : -1;
  }

  StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = sp.Encode(text, &ids);
    if (!status.ok()) {
      return InternalError(fmt::format("tokenizer '{}' failed to encode {} bytes: {}", path(),
                                       text.size(),
                                       Excerpt(status.ToString(), kLibraryMessageBytes)));
    }
    return std::vector<int32_t>(ids.begin(), ids.end());
  }

  // libsentencepiece's own offsets (SentencePieceText's begin/end, bytes of the input), with
  // the byte pieces of a byte-fallback character each given the whole character.
  StatusOr<EncodedText> EncodeWithOffsets(std::string_view text) const override {
    sentencepiece::ImmutableSentencePieceText spt;
    const auto status = sp.Encode(text, spt.mutable_proto());
    if (!status.ok()) {
      return InternalError(fmt::format("tokenizer '{}' failed to encode {} bytes: {}", path(),
                                       text.size(),
                                       Excerpt(status.ToString(), kLibraryMessageBytes)));
    }
    EncodedText out;
    const auto n = static_cast<int>(spt.pieces_size());
    out.ids.reserve(static_cast<size_t>(n));
    out.spans.reserve(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      const auto piece = spt.pieces(i);
      out.ids.push_back(static_cast<int32_t>(piece.id()));
      out.spans.push_back({std::min<size_t>(piece.begin(), text.size()),
                           std::min<size_t>(piece.end(), text.size())});
    }
    SpreadByteFallback(text, &out);
    return out;
  }

  StatusOr<std::string> Decode(std::span<const int32_t> ids) const override {
    const int vocab = vocab_size();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= vocab) {
        return InvalidArgumentError(
            fmt::format("tokenizer '{}': id {} at position {} is outside its vocabulary [0, {})",
                        path(), ids[i], i, vocab));
      }
    }
    std::string text;
    const auto status = sp.Decode(std::vector<int>(ids.begin(), ids.end()), &text);
    if (!status.ok()) {
      return InternalError(fmt::format("tokenizer '{}' failed to decode: {}", path(),
                                       Excerpt(status.ToString(), kLibraryMessageBytes)));
    }
    return text;
  }

 private:
  // libsentencepiece gives the byte pieces of one unknown piece one span among them (the
  // others empty). A run of byte pieces whose spans join into exactly as many text bytes as it
  // has pieces (nothing normalized away) gets, per piece, the character its byte is part of;
  // any other run gets the run's whole span on every piece.
  void SpreadByteFallback(std::string_view text, EncodedText* out) const {
    const size_t n = out->ids.size();
    for (size_t i = 0; i < n;) {
      if (!sp.IsByte(out->ids[i])) {
        ++i;
        continue;
      }
      size_t j = i;
      TokenSpan run = out->spans[i];
      for (; j < n && sp.IsByte(out->ids[j]); ++j) {
        run.begin = std::min(run.begin, out->spans[j].begin);
        run.end = std::max(run.end, out->spans[j].end);
      }
      for (size_t k = i; k < j; ++k) out->spans[k] = run;
      if (run.end - run.begin == j - i) {
        for (size_t k = i, at = run.begin; k < j;) {  // at: a character's first byte
          const auto lead = static_cast<unsigned char>(text[at]);
          const size_t len = lead < 0xC0 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
          const TokenSpan ch{at, std::min(at + len, run.end)};
          for (size_t b = 0; b < len && k < j; ++b) out->spans[k++] = ch;
          at = ch.end;
        }
      }
      i = j;
    }
  }
};

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

StatusOr<std::unique_ptr<Tokenizer>> LoadSentencePiece(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(path, "tokenizer file"));
  auto tokenizer =
      std::make_unique<SentencePieceTokenizer>(path, XXH3_64bits(bytes.data(), bytes.size()));
  const auto status = tokenizer->sp.LoadFromSerializedProto(bytes);
  if (!status.ok()) {
    // SentencePiece's message for bytes that do not parse names its own source line; say it
    // plainly.
    const std::string why =
        std::string_view(status.message()).find("ParseFromArray") != std::string_view::npos
            ? "not a serialized SentencePiece model"
            : Excerpt(status.message(), kLibraryMessageBytes);
    return InvalidArgumentError(
        fmt::format("tokenizer file '{}' ({} bytes) does not load as a SentencePiece model: {}",
                    path, bytes.size(), why));
  }
  if (tokenizer->sp.GetPieceSize() <= 0) {
    return InvalidArgumentError(
        fmt::format("tokenizer file '{}' is a SentencePiece model without pieces", path));
  }
  STRATA_ASSIGN_OR_RETURN(const hf::SpecialTokenNames names, hf::ReadTokenizerConfigBeside(path));
  if (names.add_bos >= 0) tokenizer->add_bos = names.add_bos == 1;
  tokenizer->add_eos = names.add_eos == 1;
  return std::unique_ptr<Tokenizer>(std::move(tokenizer));
}

}  // namespace

namespace {

class ByteLevelTokenizer final : public Tokenizer {
 public:
  ByteLevelTokenizer() : Tokenizer("", 0) {}
  int vocab_size() const override { return 256; }
  int bos_id() const override { return -1; }
  int eos_id() const override { return -1; }
  int TokenId(std::string_view) const override { return -1; }
  StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  StatusOr<std::string> Decode(std::span<const int32_t> ids) const override {
    std::string text(ids.size(), '\0');
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] > 255) {
        return InvalidArgumentError(
            fmt::format("byte-level id {} at position {} is not a byte", ids[i], i));
      }
      text[i] = static_cast<char>(ids[i]);
    }
    return text;
  }
  StatusOr<EncodedText> EncodeWithOffsets(std::string_view text) const override {
    EncodedText out;
    STRATA_ASSIGN_OR_RETURN(out.ids, Encode(text));
    out.spans.resize(text.size());
    for (size_t i = 0; i < text.size(); ++i) out.spans[i] = {i, i + 1};
    return out;
  }
  size_t LastSafeCut(std::string_view text, size_t from) const override {
    return text.size() > std::max<size_t>(from, 1) ? text.size() - 1 : 0;
  }
};

}  // namespace

std::unique_ptr<Tokenizer> MakeByteLevelTokenizer() {
  return std::make_unique<ByteLevelTokenizer>();
}

StatusOr<EncodedText> Tokenizer::EncodeWithOffsets(std::string_view text) const {
  (void)text;
  return UnimplementedError(fmt::format("tokenizer '{}' gives no token offsets", path()));
}

StatusOr<std::string> Tokenizer::FilePath(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return path;
  for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
    const std::string file = path + "/" + name;
    if (::stat(file.c_str(), &st) == 0) return file;
  }
  return NotFoundError(
      fmt::format("tokenizer directory '{}' has neither tokenizer.json nor tokenizer.model", path));
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& given) {
  STRATA_ASSIGN_OR_RETURN(const std::string path, FilePath(given));
  if (EndsWith(path, ".json")) {
    STRATA_ASSIGN_OR_RETURN(auto hf, HfTokenizer::Load(path));
    return std::unique_ptr<Tokenizer>(std::move(hf));
  }
  return LoadSentencePiece(path);
}

namespace {

// Appends up to `size_bytes` bytes of `fd` to `out`; returns how many were read (0 at the end).
StatusOr<size_t> ReadBlock(int fd, size_t size_bytes, const std::string& path, std::string* out) {
  const size_t old = out->size();
  out->resize(old + size_bytes);
  ssize_t n;
  do {
    n = ::read(fd, out->data() + old, size_bytes);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    const int err = errno;
    out->resize(old);
    return ErrnoToStatus(err, fmt::format("reading text file '{}'", path));
  }
  out->resize(old + static_cast<size_t>(n));
  return static_cast<size_t>(n);
}

}  // namespace

StatusOr<std::vector<int32_t>> TokenizeTextFile(const Tokenizer& tokenizer,
                                                const std::string& text_path, size_t block_bytes) {
  STRATA_ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(text_path, "text file"));
  std::vector<int32_t> ids;
  if (tokenizer.adds_bos()) ids.push_back(tokenizer.bos_id());
  std::string pending;  // text after the last cut
  bool continued = false;
  size_t searched = 0;  // pending[0, searched) has no cut point
  uint64_t offset = 0;  // of pending[0] in the file
  auto encode = [&](std::string_view text) -> Status {
    auto part = continued ? tokenizer.EncodeContinued(text) : tokenizer.Encode(text);
    if (!part.ok()) {
      // Byte offsets in Encode's message count from the part's start.
      return part.status().WithContext(
          fmt::format("text file '{}', the part from byte {}", text_path, offset));
    }
    ids.insert(ids.end(), part->begin(), part->end());
    continued = true;
    offset += text.size();
    return Status::Ok();
  };
  block_bytes = std::max<size_t>(block_bytes, 1);
  for (;;) {
    STRATA_ASSIGN_OR_RETURN(const size_t n, ReadBlock(fd.get(), block_bytes, text_path, &pending));
    if (n == 0) break;
    const size_t cut = tokenizer.LastSafeCut(pending, searched);
    if (cut == 0) {
      // A cut's test looks at a few bytes before it: search again from a little before the end.
      searched = pending.size() > 8 ? pending.size() - 8 : 0;
      continue;
    }
    STRATA_RETURN_IF_ERROR(encode(std::string_view(pending).substr(0, cut)));
    pending.erase(0, cut);
    searched = 0;
  }
  if (!pending.empty() || !continued) STRATA_RETURN_IF_ERROR(encode(pending));
  if (tokenizer.adds_eos()) ids.push_back(tokenizer.eos_id());
  return ids;
}

namespace {

// XXH3_64bits of what decides a text's tokens besides the text: the tokenizer file's bytes and a
// document's special tokens (tokenizer_config.json for a tokenizer.json), little-endian fixed
// widths.
uint64_t TokenCacheKey(const Tokenizer& tokenizer) {
  std::array<std::byte, 18> key{};
  const uint64_t fingerprint = tokenizer.fingerprint();
  const int32_t bos = tokenizer.adds_bos() ? tokenizer.bos_id() : -1;
  const int32_t eos = tokenizer.adds_eos() ? tokenizer.eos_id() : -1;
  for (int i = 0; i < 8; ++i) key[i] = static_cast<std::byte>(fingerprint >> (8 * i));
  for (int i = 0; i < 4; ++i) {
    key[8 + i] = static_cast<std::byte>(static_cast<uint32_t>(bos) >> (8 * i));
    key[12 + i] = static_cast<std::byte>(static_cast<uint32_t>(eos) >> (8 * i));
  }
  key[16] = std::byte{1};  // the key's version
  return XXH3_64bits(key.data(), key.size());
}

}  // namespace

std::string TokenCachePath(const std::string& text_path, const Tokenizer& tokenizer) {
  return fmt::format("{}.{:016x}.tokens", text_path, TokenCacheKey(tokenizer));
}

std::string UserTokenCacheDir() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg != nullptr && xdg[0] == '/') return std::string(xdg) + "/strata/tokens";
  const char* home = std::getenv("HOME");
  if (home != nullptr && home[0] == '/') return std::string(home) + "/.cache/strata/tokens";
  return "";
}

std::string UserTokenCachePath(const std::string& text_path, const Tokenizer& tokenizer) {
  const std::string dir = UserTokenCacheDir();
  if (dir.empty()) return "";
  std::error_code ec;
  std::filesystem::path absolute = std::filesystem::weakly_canonical(text_path, ec);
  if (ec) absolute = std::filesystem::absolute(text_path, ec);
  if (ec) absolute = text_path;
  const std::string name = absolute.native();
  return fmt::format("{}/{}.{:016x}.{:016x}.tokens", dir, absolute.filename().native(),
                     XXH3_64bits(name.data(), name.size()), TokenCacheKey(tokenizer));
}

namespace {

bool NewerThan(const struct timespec& a, const struct timespec& b) {
  if (a.tv_sec != b.tv_sec) return a.tv_sec > b.tv_sec;
  return a.tv_nsec > b.tv_nsec;
}

// Whether a cache written at `cache`'s mtime saw `input` as it is: modified and changed (the
// inode's ctime, which a copy that keeps an older mtime, tar or rsync -a cannot set back) before.
bool Saw(const struct stat& cache, const struct stat& input) {
  return NewerThan(cache.st_mtim, input.st_mtim) && NewerThan(cache.st_mtim, input.st_ctim);
}

// Whether `cache` holds `text_path`'s tokens as they are now (TokenizeTextFileCached's rule).
bool IsFresh(const std::string& cache, const struct stat& text_st,
             const struct stat& tokenizer_st) {
  struct stat cache_st;
  return ::stat(cache.c_str(), &cache_st) == 0 && Saw(cache_st, text_st) &&
         Saw(cache_st, tokenizer_st) && TokenFileLooksWhole(cache);
}

}  // namespace

StatusOr<std::string> TokenizeTextFileCached(const Tokenizer& tokenizer,
                                             const std::string& text_path, bool* reused,
                                             std::string* user_cache_note) {
  if (user_cache_note != nullptr) user_cache_note->clear();
  const std::string cache = TokenCachePath(text_path, tokenizer);
  const std::string user_cache = UserTokenCachePath(text_path, tokenizer);
  struct stat text_st, tokenizer_st;
  if (::stat(text_path.c_str(), &text_st) != 0) {
    return ErrnoToStatus(errno, fmt::format("cannot stat text file '{}'", text_path));
  }
  if (::stat(tokenizer.path().c_str(), &tokenizer_st) != 0) {
    return ErrnoToStatus(errno, fmt::format("cannot stat tokenizer file '{}'", tokenizer.path()));
  }
  for (const std::string* candidate : {&cache, &user_cache}) {
    if (!candidate->empty() && IsFresh(*candidate, text_st, tokenizer_st)) {
      if (reused != nullptr) *reused = true;
      if (user_cache_note != nullptr && candidate == &user_cache) {
        *user_cache_note = "in the user cache, made when the text's directory could not hold it";
      }
      return *candidate;
    }
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<int32_t> ids, TokenizeTextFile(tokenizer, text_path));
  if (reused != nullptr) *reused = false;
  const Status beside = WriteTokenFile(cache, ids);
  if (beside.ok()) return cache;
  // The text's directory may be read-only (a shared dataset mount): the user's cache directory
  // holds it instead, named by the text's absolute path.
  if (user_cache.empty()) {
    return beside.WithContext(
        "token cache (no user cache directory: neither XDG_CACHE_HOME nor "
        "HOME is an absolute path)");
  }
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(user_cache).parent_path(), ec);
  if (ec) {
    return beside.WithContext(
        fmt::format("token cache (nor could the user cache directory '{}' "
                    "be made: {})",
                    std::filesystem::path(user_cache).parent_path().native(), ec.message()));
  }
  if (Status s = WriteTokenFile(user_cache, ids); !s.ok()) {
    // Both places, in the order they were tried.
    return Status(beside.code(),
                  fmt::format("token cache of '{}': beside the text: {}; in the user cache: {}",
                              text_path, beside.message(), s.message()));
  }
  if (user_cache_note != nullptr) {
    *user_cache_note = fmt::format("in the user cache: {}", beside.message());
  }
  return user_cache;
}

}  // namespace strata::data
