// DeepSpeed's configuration keys (https://www.deepspeed.ai/docs/config-json/, with the keys of
// deepspeed/runtime/zero/config.py and the aio constants that the page leaves out) and what each
// means to `strata train --config` (tools/config.h): read by the config (mapped), a section of
// listed keys, or a no-op with the reason it has no meaning here. A path is `a.b.c`; a key not
// listed is one DeepSpeed does not know.
//
// Pure lookups over a constant table; thread-safe.
#pragma once

#include <string_view>
#include <vector>

namespace strata::tools {

enum class KeyTreatment {
  kMapped,   // read by tools/config.cc
  kSection,  // an object whose keys are listed (mapped or not)
  kNoop,     // accepted, named in a note
  kNoopAny,  // accepted with whatever it holds (a section too deep to list), named in a note
};

// Why a no-op has no meaning here; a section with a reason other than kNone holds only no-ops.
enum class NoopReason {
  kNone,
  kComm,
  kPartition,
  kParallel,
  kFeature,
  kMonitor,
  kAlways,
  kPrecision
};

struct DeepSpeedKey {
  std::string_view path;
  KeyTreatment treatment;
  NoopReason reason = NoopReason::kNone;
};

// The note's wording for a reason ("communication between GPUs; one device has none").
std::string_view NoopReasonText(NoopReason reason);
// The key at `path`, or nullptr when DeepSpeed does not know it.
const DeepSpeedKey* FindDeepSpeedKey(std::string_view path);
// The keys listed directly under `section` ("" for the top level), as last path components.
std::vector<std::string_view> DeepSpeedKeysUnder(std::string_view section);
// The candidate a typo most likely meant: the nearest by edit distance, if at most
// max(3, |key| / 3) edits away; "" otherwise.
std::string_view NearestKey(std::string_view key, const std::vector<std::string_view>& candidates);
// The up to `count` candidates nearest to `key` by edit distance, nearest first (ties in the
// candidates' order).
std::vector<std::string_view> NearestKeys(std::string_view key,
                                          const std::vector<std::string_view>& candidates,
                                          size_t count);

}  // namespace strata::tools
