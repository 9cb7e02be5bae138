#include "data/hf_bpe.h"

#include <fmt/format.h>

#include <queue>

#include "base/untrusted_text.h"
#include "data/hf_text.h"

namespace strata::data::hf {

StatusOr<std::unique_ptr<BpeModel>> BpeModel::Create(
    Vocab vocab, const std::vector<std::pair<std::string, std::string>>& merges,
    BpeOptions options) {
  std::unique_ptr<BpeModel> m(new BpeModel());
  m->options_ = std::move(options);
  m->vocab_ = std::move(vocab);
  const BpeOptions& o = m->options_;
  if (!o.unk_token.empty()) {
    auto it = m->vocab_.find(o.unk_token);
    if (it == m->vocab_.end()) {
      return InvalidArgumentError(
          fmt::format("/model/unk_token: '{}' is not in /model/vocab", Excerpt(o.unk_token)));
    }
    m->unk_id_ = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    const std::string unit = o.byte_level ? ByteToChar()[b] : std::string(1, static_cast<char>(b));
    auto it = m->vocab_.find(unit);
    m->unit_ids_[b] = it != m->vocab_.end() && (o.byte_level || b < 0x80) ? it->second : -1;
    auto fb = m->vocab_.find(fmt::format("<0x{:02X}>", b));
    m->byte_fallback_ids_[b] = fb != m->vocab_.end() ? fb->second : -1;
  }
  if (o.byte_level && o.ignore_merges) {
    for (const auto& [token, id] : m->vocab_) {
      std::string bytes;
      bool ok = true;
      for (size_t i = 0, len = 0; i < token.size() && ok; i += len) {
        const int b = CharToByte(DecodeUtf8(token, i, &len));
        ok = b >= 0;
        bytes.push_back(static_cast<char>(b));
      }
      if (ok) m->bytes_vocab_.emplace(std::move(bytes), id);
    }
  }
  m->merges_.reserve(merges.size() * 2);
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const std::string merged = a + b;
    auto ia = m->vocab_.find(a), ib = m->vocab_.find(b), ic = m->vocab_.find(merged);
    if (ia == m->vocab_.end() || ib == m->vocab_.end() || ic == m->vocab_.end()) {
      const std::string& missing = ia == m->vocab_.end() ? a : ib == m->vocab_.end() ? b : merged;
      return InvalidArgumentError(
          fmt::format("/model/merges/{} ('{}' '{}'): '{}' is not in /model/vocab", rank, Excerpt(a),
                      Excerpt(b), Excerpt(missing)));
    }
    const uint64_t key =
        (static_cast<uint64_t>(ia->second) << 32) | static_cast<uint32_t>(ib->second);
    // The first (lowest) rank of a pair wins, as in HF's MergeMap built in rank order.
    m->merges_.emplace(key, Merge{static_cast<uint32_t>(rank), ic->second});
  }
  return m;
}

bool BpeModel::InAnyMerge(int32_t id) const {
  for (const auto& [key, merge] : merges_) {
    if (static_cast<int32_t>(key >> 32) == id || static_cast<int32_t>(key & 0xFFFFFFFFu) == id) {
      return true;
    }
  }
  return false;
}

template <bool kSpans>
void BpeModel::AddUnknown(std::string_view unit, Span where, int32_t* pending_unk,
                          Span* pending_span, std::vector<Symbol>* symbols,
                          std::vector<Span>* units) const {
  if (options_.byte_fallback) {
    bool all = true;
    for (unsigned char c : unit) all = all && byte_fallback_ids_[c] >= 0;
    if (all) {
      for (unsigned char c : unit) {
        symbols->push_back({byte_fallback_ids_[c], 0, 0, true});
        if constexpr (kSpans) units->push_back(where);
      }
      return;
    }
  }
  if (unk_id_ < 0) return;  // no unknown token: the character is dropped, as HF does
  if (*pending_unk >= 0 && !options_.fuse_unk) {
    symbols->push_back({*pending_unk, 0, 0, true});
    if constexpr (kSpans) units->push_back(*pending_span);
  }
  if constexpr (kSpans) {
    if (*pending_unk < 0 || !options_.fuse_unk) pending_span->begin = where.begin;
    pending_span->end = where.end;
  }
  *pending_unk = unk_id_;
}

template <bool kSpans>
void BpeModel::InitialSymbols(std::string_view piece, std::vector<Symbol>* symbols,
                              std::vector<Span>* units) const {
  int32_t pending_unk = -1;
  Span pending_span;
  for (size_t i = 0, len = 1; i < piece.size(); i += len) {
    const auto c = static_cast<unsigned char>(piece[i]);
    int32_t id = -1;
    std::string_view unit;
    if (options_.byte_level) {
      len = 1;
      id = unit_ids_[c];
      unit = ByteToChar()[c];
    } else {
      DecodeUtf8(piece, i, &len);
      unit = piece.substr(i, len);
      if (len == 1) {
        id = unit_ids_[c];
      } else if (auto it = vocab_.find(unit); it != vocab_.end()) {
        id = it->second;
      }
    }
    if (id < 0) {
      AddUnknown<kSpans>(unit, {i, i + len}, &pending_unk, &pending_span, symbols, units);
      continue;
    }
    if (pending_unk >= 0) {
      symbols->push_back({pending_unk, 0, 0, true});
      if constexpr (kSpans) units->push_back(pending_span);
    }
    pending_unk = -1;
    symbols->push_back({id, 0, 0, true});
    if constexpr (kSpans) units->push_back({i, i + len});
  }
  if (pending_unk >= 0) {
    symbols->push_back({pending_unk, 0, 0, true});
    if constexpr (kSpans) units->push_back(pending_span);
  }
  const auto n = static_cast<int32_t>(symbols->size());
  for (int32_t k = 0; k < n; ++k) {
    (*symbols)[k].prev = k - 1;
    (*symbols)[k].next = k + 1 < n ? k + 1 : -1;
  }
}

void BpeModel::MergeAll(std::vector<Symbol>* symbols) const {
  struct Candidate {
    uint32_t rank;
    int32_t pos, new_id;
    // A min-heap on (rank, pos): the lowest rank first, the leftmost among equals.
    bool operator<(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<Symbol>& s = *symbols;
  std::priority_queue<Candidate> queue;
  for (int32_t k = 0; k + 1 < static_cast<int32_t>(s.size()); ++k) {
    if (const Merge* m = FindMerge(s[k].id, s[k + 1].id)) queue.push({m->rank, k, m->new_id});
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = s[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = s[left.next];
    const Merge* m = FindMerge(left.id, right.id);
    if (m == nullptr || m->new_id != top.new_id || m->rank != top.rank) continue;  // stale
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) s[right.next].prev = top.pos;
    if (left.prev >= 0) {
      if (const Merge* p = FindMerge(s[left.prev].id, left.id)) {
        queue.push({p->rank, left.prev, p->new_id});
      }
    }
    if (left.next >= 0) {
      if (const Merge* n = FindMerge(left.id, s[left.next].id)) {
        queue.push({n->rank, top.pos, n->new_id});
      }
    }
  }
}

void BpeModel::Encode(std::string_view piece, std::vector<int32_t>* ids) const {
  if (options_.ignore_merges) {
    const Vocab& whole = options_.byte_level ? bytes_vocab_ : vocab_;
    if (auto it = whole.find(piece); it != whole.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  InitialSymbols<false>(piece, &symbols, nullptr);
  MergeAll(&symbols);
  for (const Symbol& sym : symbols) {
    if (sym.alive) ids->push_back(sym.id);
  }
}

void BpeModel::EncodeWithSpans(std::string_view piece, std::vector<int32_t>* ids,
                               std::vector<Span>* spans) const {
  if (options_.ignore_merges) {
    const Vocab& whole = options_.byte_level ? bytes_vocab_ : vocab_;
    if (auto it = whole.find(piece); it != whole.end()) {
      ids->push_back(it->second);
      spans->push_back({0, piece.size()});
      return;
    }
  }
  std::vector<Symbol> symbols;
  std::vector<Span> units;
  symbols.reserve(piece.size());
  units.reserve(piece.size());
  InitialSymbols<true>(piece, &symbols, &units);
  MergeAll(&symbols);
  // A merge keeps the left symbol and absorbs the right one: a live symbol k holds the starting
  // symbols [k, next).
  const auto n = static_cast<int32_t>(symbols.size());
  for (int32_t k = 0; k < n; ++k) {
    const Symbol& sym = symbols[k];
    if (!sym.alive) continue;
    const int32_t last = (sym.next < 0 ? n : sym.next) - 1;
    ids->push_back(sym.id);
    spans->push_back({units[k].begin, units[last].end});
  }
}

}  // namespace strata::data::hf
