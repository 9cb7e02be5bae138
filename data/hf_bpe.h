// The BPE model of a Hugging Face tokenizer.json: byte-pair encoding as in Sennrich, Haddow and
// Birch, "Neural Machine Translation of Rare Words with Subword Units", ACL 2016, applied as HF
// tokenizers' models/bpe does: the adjacent pair of lowest merge rank is merged first (leftmost
// among equals), unknown characters fall back to <0xXX> byte tokens or to the unknown token. For
// GPT-2's byte-level BPE (Radford et al., "Language Models are Unsupervised Multitask Learners",
// 2019) a pre-token is its raw bytes, each byte standing for its bytes_to_unicode character.
// Internal to data/ (hf_tokenizer.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/status.h"
#include "data/hf_text.h"

namespace strata::data::hf {

// Heterogeneous lookup of std::string keys by string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using Vocab = std::unordered_map<std::string, int, StringHash, std::equal_to<>>;

struct BpeOptions {
  bool byte_level = false;     // pre-tokens are raw bytes, vocabulary entries bytes_to_unicode text
  bool byte_fallback = false;  // an unknown character becomes its <0xXX> tokens when all exist
  bool fuse_unk = false;       // consecutive unknown characters become one unknown token
  bool ignore_merges = false;  // a pre-token that is a vocabulary entry is taken whole
  std::string unk_token;       // "" when the model has none (an unknown character is dropped)
};

// Immutable after Create; Encode may run concurrently.
class BpeModel {
 public:
  // `merges` in rank order (rank 0 first). Errors: kInvalidArgument naming the merge whose part
  // or result is not in `vocab`, or an unk_token that is not in it.
  static StatusOr<std::unique_ptr<BpeModel>> Create(
      Vocab vocab, const std::vector<std::pair<std::string, std::string>>& merges,
      BpeOptions options);

  // Appends the ids of one pre-token: raw bytes for a byte-level model, else normalized text.
  void Encode(std::string_view piece, std::vector<int32_t>* ids) const;
  // As Encode, and appends per id the bytes of `piece` it was made from: the union of its
  // units' bytes, where a unit is a byte (byte-level), a character, each <0xXX> token of a
  // character's byte fallback (the whole character) or an unknown token (the characters it
  // stands for). A character dropped for want of an unknown token is in no span.
  void EncodeWithSpans(std::string_view piece, std::vector<int32_t>* ids,
                       std::vector<Span>* spans) const;

  const Vocab& vocab() const { return vocab_; }
  const BpeOptions& options() const { return options_; }
  // Whether `id` is a part of any merge (a linear scan: for Load's checks).
  bool InAnyMerge(int32_t id) const;

 private:
  struct Merge {
    uint32_t rank;
    int32_t new_id;
  };
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  BpeModel() = default;
  // The starting symbols of `piece` (HF's merge_word before merge_all); with kSpans, each
  // symbol's bytes of `piece` in `units` (the same length as `symbols`).
  template <bool kSpans>
  void InitialSymbols(std::string_view piece, std::vector<Symbol>* symbols,
                      std::vector<Span>* units) const;
  // An unknown character `unit` at `where` in the piece: its byte fallback tokens, else the
  // unknown token (held in *pending_unk, over *pending_span, until the next known character).
  template <bool kSpans>
  void AddUnknown(std::string_view unit, Span where, int32_t* pending_unk, Span* pending_span,
                  std::vector<Symbol>* symbols, std::vector<Span>* units) const;
  void MergeAll(std::vector<Symbol>* symbols) const;
  const Merge* FindMerge(int32_t left, int32_t right) const {
    auto it = merges_.find((static_cast<uint64_t>(left) << 32) | static_cast<uint32_t>(right));
    return it == merges_.end() ? nullptr : &it->second;
  }

  BpeOptions options_;
  Vocab vocab_;
  Vocab bytes_vocab_;  // byte-level: an entry's raw bytes -> id (ignore_merges)
  std::unordered_map<uint64_t, Merge> merges_;  // (left id << 32 | right id) -> merge
  int32_t unit_ids_[256];                       // a byte's (byte-level) or ASCII char's id, or -1
  int32_t byte_fallback_ids_[256];              // <0xXX>'s id, or -1
  int32_t unk_id_ = -1;
};

}  // namespace strata::data::hf
