// Typed reading of the JSON objects Strata writes and reads back: a checkpoint's manifest.json
// (engine/checkpoint.h), an offload optimizer's saved state (offload/offload_optimizer.h).
//
// Why: a file read back may be damaged or made by hand. nlohmann's get<int64_t>() of 1e300 is
// undefined behaviour, get<float>() of 6.7e98 is inf (written back as null), and a string
// quoted from the file may hold control characters. Each accessor here returns the field with
// the type and range asked for, or kDataLoss as one line naming the file and the field's place:
//   "manifest: engine.steps is missing or not a number"
//   "manifest: files[0].size_bytes = -3 is outside [0, 9223372036854775807]"
// Text from the file in a message goes through Excerpt (base/untrusted_text.h).
//
// Thread-safety: a JsonFields refers to `object` (not owned; it must outlive the JsonFields);
// its methods are const and touch nothing else.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace strata {

class JsonFields {
 public:
  // `file`: how messages name the file ("manifest", "offload optimizer: Load 'd': manifest.json");
  // `where`: the object's place in it ("engine", "buckets[2]"; "" for the top level).
  JsonFields(const nlohmann::json& object, std::string file, std::string where);

  // The field `key` when it has `type`. number_float accepts any number; number_integer any
  // integer; number_unsigned a non-negative integer. kDataLoss when this is not an object or the
  // field is missing or of another type.
  StatusOr<const nlohmann::json*> Get(std::string_view key, nlohmann::json::value_t type) const;
  // An integer in [lo, hi]; a float (even 3.0) is refused.
  StatusOr<int64_t> Int(std::string_view key, int64_t lo, int64_t hi) const;
  // An array of at most `max_count` integers, each in [lo, hi].
  StatusOr<std::vector<int64_t>> Ints(std::string_view key, int64_t lo, int64_t hi,
                                      size_t max_count) const;
  // A number that fits fp32 (one beyond it would become inf).
  StatusOr<float> Float(std::string_view key) const;
  StatusOr<std::string> String(std::string_view key) const;
  StatusOr<bool> Bool(std::string_view key) const;
  // An object, as its compact JSON text.
  StatusOr<std::string> ObjectText(std::string_view key) const;
  // A string of exactly 16 hex digits (how Strata writes an xxh3), as its value.
  StatusOr<uint64_t> Hex64(std::string_view key) const;

  // "file: where.key" (or "file: key" at the top level): how messages name a field.
  std::string Name(std::string_view key) const;

 private:
  const nlohmann::json& object_;
  std::string file_;
  std::string where_;
};

// `value` as integers in [lo, hi], at most `max_count` of them: kDataLoss naming `name` (a
// JsonFields::Name) when it is not an array of such integers.
StatusOr<std::vector<int64_t>> JsonInts(const nlohmann::json& value, std::string_view name,
                                        int64_t lo, int64_t hi, size_t max_count);

}  // namespace strata
