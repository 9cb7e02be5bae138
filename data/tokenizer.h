// Text <-> token ids. SentencePiece models (Kudo and Richardson, "SentencePiece: A simple and
// language independent subword tokenizer and detokenizer for Neural Text Processing", EMNLP
// 2018) are read by Debian's libsentencepiece: the tokenizer.model files that Llama-family
// checkpoints ship. Hugging Face tokenizer.json files (BPE, byte-level or SentencePiece-style)
// are read by HfTokenizer (data/hf_tokenizer.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"

namespace strata::data {

// A token's source: the bytes [begin, end) of the encoded text it was made from.
struct TokenSpan {
  size_t begin = 0, end = 0;
  bool operator==(const TokenSpan&) const = default;
};
// What a tokenizer keeps across EncodeWithOffsets calls (Tokenizer::NewEncodeCache): opaque.
class EncodeCache {
 public:
  virtual ~EncodeCache() = default;
};

// Encode's ids and, per id, its source; ids.size() == spans.size().
struct EncodedText {
  std::vector<int32_t> ids;
  std::vector<TokenSpan> spans;
};

// Text <-> token ids. Implementations: SentencePiece models (tokenizer.cc) and Hugging Face
// tokenizer.json files (HfTokenizer, hf_tokenizer.h).
//
// Thread-safety: immutable after Load; every const method may run concurrently.
class Tokenizer {
 public:
  // Loads the tokenizer at `path`: a directory means its tokenizer.json when it has one, else
  // its tokenizer.model; a file whose name ends in ".json" is a Hugging Face tokenizer.json
  // (HfTokenizer::Load); any other file a SentencePiece model. The caller owns the result.
  // Errors (one line naming the file): the errno-mapped code when it cannot be read (kNotFound,
  // kPermissionDenied, ...; kNotFound for a directory with neither file); kInvalidArgument when
  // it is not a tokenizer Strata reads.
  static StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  // The file Load reads for `path`: a directory's tokenizer.json, else its tokenizer.model;
  // any other path as it is. Reads the file system only. Errors: kNotFound (one line naming the
  // directory) for a directory with neither file.
  static StatusOr<std::string> FilePath(const std::string& path);
  virtual ~Tokenizer() = default;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // The file the tokenizer was loaded from.
  const std::string& path() const { return path_; }
  // XXH3_64bits of the tokenizer file's bytes: names the token cache of a text file.
  uint64_t fingerprint() const { return fingerprint_; }

  // Ids are in [0, vocab_size()).
  virtual int vocab_size() const = 0;
  // The beginning/end-of-sequence ids, or -1 when the tokenizer has none.
  virtual int bos_id() const = 0;
  virtual int eos_id() const = 0;
  // Whether a document's tokens start with the BOS id and end with the EOS id, as Hugging Face's
  // tokenizer(text) (add_special_tokens=True) gives them: what TokenizeTextFile writes. Default:
  // a BOS when there is one, no EOS. A SentencePiece model follows add_bos_token / add_eos_token of
  // a tokenizer_config.json beside it, as LlamaTokenizer does (absent: that default).
  virtual bool adds_bos() const { return bos_id() >= 0; }
  virtual bool adds_eos() const { return false; }
  // The id of the vocabulary entry spelt exactly `piece` (a special token such as "<s>" or
  // "<|eot_id|>" included), or -1 when there is none.
  virtual int TokenId(std::string_view piece) const = 0;

  // The ids of `text` (no BOS or EOS added). Errors: kInternal if the implementation fails.
  virtual StatusOr<std::vector<int32_t>> Encode(std::string_view text) const = 0;
  // Encode(text)'s ids, bit for bit, and per id the bytes of `text` it came from: Hugging Face's
  // offset_mapping (return_offsets_mapping=True), in bytes instead of characters. Spans are in
  // token order with non-decreasing begins, begin <= end <= text.size(). A token's span is:
  //  * made of text bytes: exactly those bytes (byte-level BPE: the bytes its string maps back
  //    to, so without NFC changes the spans tile the text and text[span] is the token's bytes;
  //    unlike HF's ByteLevel trim_offsets, a leading space stays in " wor"'s span);
  //  * an added token: its content, with the whitespace its lstrip/rstrip swallowed;
  //  * holding a normalizer-inserted prefix (the "▁" of a Prepend normalizer or a Metaspace
  //    prepend_scheme): only the text bytes it holds; a token that is only the prefix is empty,
  //    at the position of the text it precedes;
  //  * holding a "▁" a Replace normalizer made of a space: that one space byte;
  //  * a byte-fallback token (<0xE2>): the whole UTF-8 character its byte is part of, so the
  //    three tokens of "€" have the same span;
  //  * made from text NFC changed: the whole run ICU reports changed (between normalization
  //    boundaries, e.g. "e" + U+0301), on every token made from it: conservative, and such
  //    spans overlap.
  // Every byte of the text is in some span, except bytes a tokenizer drops: a character with
  // neither a vocabulary entry, a byte fallback nor an unknown token (none in real files), and,
  // for SentencePiece models (libsentencepiece's own offsets), the whitespace its normalizer
  // strips or folds away (leading, trailing and repeated spaces with remove_extra_whitespaces).
  // A caller that masks by characters takes a token when any byte of its span is in the range.
  // Thread-safety: as Encode. Errors: Encode's; kUnimplemented from a Tokenizer that does not
  // override it.
  virtual StatusOr<EncodedText> EncodeWithOffsets(std::string_view text) const;
  // The same, reusing `cache` (from NewEncodeCache; null: none) across calls: a tokenizer's
  // encoding of a pre-token is the same every time, so many short texts (instruction data, one
  // conversation each) encode as fast as one long text. The cache is the caller's, used by one
  // thread at a time and only with the tokenizer that made it. Default: EncodeWithOffsets(text).
  virtual StatusOr<EncodedText> EncodeWithOffsets(std::string_view text, EncodeCache* cache) const {
    (void)cache;
    return EncodeWithOffsets(text);
  }
  // A cache for the call above, or null when the tokenizer keeps none (the default).
  virtual std::unique_ptr<EncodeCache> NewEncodeCache() const { return nullptr; }
  // The text of `ids`. Errors: kInvalidArgument for an id outside [0, vocab_size()).
  virtual StatusOr<std::string> Decode(std::span<const int32_t> ids) const = 0;

  // Streaming (TokenizeTextFile). The largest p in [max(from, 1), text.size()) such that for
  // every continuation s, Encode(text + s) == Encode(text[0, p)) ++ EncodeContinued(text[p, ) +
  // s), and the same with EncodeContinued in place of the first Encode when `text` itself
  // continues a cut; 0 when there is none (the caller then holds the text and asks again with
  // more). Each implementation says where it cuts. The default, which SentencePiece models use,
  // never cuts: libsentencepiece's normalizer (dummy prefix, whitespace folding, its
  // normalization rules) leaves no cut that is provably exact for every model, so a
  // SentencePiece model tokenizes a text file whole.
  virtual size_t LastSafeCut(std::string_view text, size_t from) const {
    (void)text, (void)from;
    return 0;
  }
  // The ids of `text`, which continues text cut at a point LastSafeCut gave. Default: Encode.
  virtual StatusOr<std::vector<int32_t>> EncodeContinued(std::string_view text) const {
    return Encode(text);
  }

 protected:
  Tokenizer(std::string path, uint64_t fingerprint)
      : path_(std::move(path)), fingerprint_(fingerprint) {}

 private:
  std::string path_;
  uint64_t fingerprint_ = 0;
};

// Every byte a token (vocabulary 256, no BOS or EOS, no special tokens: TokenId finds nothing):
// the byte-level models' text behind the interface, for instruction data with the `none` chat
// template. path() is "" and fingerprint() 0; every cut is safe.
std::unique_ptr<Tokenizer> MakeByteLevelTokenizer();

// The default block size of TokenizeTextFile's reads.
inline constexpr size_t kTokenizeBlockBytes = size_t{1} << 20;

// The tokens of a text file treated as one document: the BOS id first when the tokenizer adds
// one (adds_bos()), then Encode(whole file), then the EOS id when it adds one (adds_eos()). What
// `strata tokenize` writes and the token cache holds. The file is read in blocks of `block_bytes`
// and encoded up to the tokenizer's last safe cut (Tokenizer::LastSafeCut) as it goes, so the text
// held is a block plus what follows the last cut; the ids are exactly Encode(whole file)'s. Errors:
// the file's errno-mapped code naming it; Encode's, naming the file.
StatusOr<std::vector<int32_t>> TokenizeTextFile(const Tokenizer& tokenizer,
                                                const std::string& text_path,
                                                size_t block_bytes = kTokenizeBlockBytes);

// "<text_path>.<16 lowercase hex digits>.tokens": XXH3_64bits of tokenizer.fingerprint() and the
// document's special tokens (the BOS and EOS it adds, which a tokenizer.json's
// tokenizer_config.json decides), so that another tokenizer or another add_bos_token /
// add_eos_token names another cache.
std::string TokenCachePath(const std::string& text_path, const Tokenizer& tokenizer);

// The directory of token caches that cannot sit beside their text (a read-only dataset mount):
// $XDG_CACHE_HOME/strata/tokens, else $HOME/.cache/strata/tokens (the XDG base directory
// specification's default); "" when neither variable is an absolute path. Reads the
// environment: not thread-safe against setenv.
std::string UserTokenCacheDir();

// "<UserTokenCacheDir()>/<text file name>.<16 hex>.<16 hex>.tokens": XXH3_64bits of the text's
// absolute path (symlinks resolved where they exist), then TokenCachePath's key; "" when there is
// no user cache directory.
std::string UserTokenCachePath(const std::string& text_path, const Tokenizer& tokenizer);

// The path of `text_path`'s token cache: TokenCachePath, else UserTokenCachePath. Either is reused
// as is when it was modified after the text file and the tokenizer file were both modified and
// changed (their mtime and ctime: a text replaced by a copy with an older mtime is seen) and its
// header describes its size (its tokens are validated when opened; a truncated cache is made
// again). Otherwise the cache is made now, crash-safely (WriteTokenFile), beside the text; when
// that write fails (a read-only directory, no space there), in the user cache directory (made with
// its parents). `*reused` (may be null) says whether a cache was reused; `*user_cache_note` (may
// be null) is "" for a cache beside the text, else says why it is in the user cache (the error of
// the write beside the text when made now). Errors: those of TokenizeTextFile; the errno-mapped
// code of a stat; when neither place can be written, the write beside the text's, with the user
// cache's failure in its context.
StatusOr<std::string> TokenizeTextFileCached(const Tokenizer& tokenizer,
                                             const std::string& text_path, bool* reused,
                                             std::string* user_cache_note = nullptr);

}  // namespace strata::data
