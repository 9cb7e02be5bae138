#include "base/json_fields.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <limits>
#include <optional>
#include <system_error>
#include <utility>

#include "base/untrusted_text.h"

namespace strata {

using Json = nlohmann::json;

namespace {

// An integer JSON value in [lo, hi], or nullopt (a float, a string, out of range).
std::optional<int64_t> IntIn(const Json& v, int64_t lo, int64_t hi) {
  if (!v.is_number_integer()) return std::nullopt;
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    return std::nullopt;
  }
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) return std::nullopt;
  return x;
}

}  // namespace

JsonFields::JsonFields(const Json& object, std::string file, std::string where)
    : object_(object), file_(std::move(file)), where_(std::move(where)) {}

std::string JsonFields::Name(std::string_view key) const {
  if (where_.empty()) return fmt::format("{}: {}", file_, key);
  return fmt::format("{}: {}.{}", file_, where_, key);
}

StatusOr<const Json*> JsonFields::Get(std::string_view key, Json::value_t type) const {
  if (!object_.is_object()) {
    return DataLossError(where_.empty() ? fmt::format("{}: not a JSON object", file_)
                                        : fmt::format("{}: {} is not an object", file_, where_));
  }
  const auto it = object_.find(key);
  const bool ok = it != object_.end() &&
                  (it->type() == type || (type == Json::value_t::number_float && it->is_number()) ||
                   (type == Json::value_t::number_integer && it->is_number_integer()) ||
                   (type == Json::value_t::number_unsigned && it->is_number_unsigned()));
  if (!ok) {
    const std::string_view type_name = Json(type).type_name();
    const bool vowel = type_name[0] == 'a' || type_name[0] == 'o';  // array, object
    return DataLossError(
        fmt::format("{} is missing or not {} {}", Name(key), vowel ? "an" : "a", type_name));
  }
  return &*it;
}

StatusOr<int64_t> JsonFields::Int(std::string_view key, int64_t lo, int64_t hi) const {
  STRATA_ASSIGN_OR_RETURN(const Json* v, Get(key, Json::value_t::number_integer));
  const std::optional<int64_t> x = IntIn(*v, lo, hi);
  if (!x) {
    return DataLossError(
        fmt::format("{} = {} is outside [{}, {}]", Name(key), JsonExcerpt(*v), lo, hi));
  }
  return *x;
}

StatusOr<std::vector<int64_t>> JsonInts(const Json& value, std::string_view name, int64_t lo,
                                        int64_t hi, size_t max_count) {
  if (!value.is_array() || value.size() > max_count) {
    return DataLossError(fmt::format("{} is not an array of at most {} integers", name, max_count));
  }
  std::vector<int64_t> out;
  out.reserve(value.size());
  for (size_t i = 0; i < value.size(); ++i) {
    const std::optional<int64_t> x = IntIn(value[i], lo, hi);
    if (!x) {
      return DataLossError(fmt::format("{}[{}] = {} is not an integer in [{}, {}]", name, i,
                                       JsonExcerpt(value[i]), lo, hi));
    }
    out.push_back(*x);
  }
  return out;
}

StatusOr<std::vector<int64_t>> JsonFields::Ints(std::string_view key, int64_t lo, int64_t hi,
                                                size_t max_count) const {
  STRATA_ASSIGN_OR_RETURN(const Json* v, Get(key, Json::value_t::array));
  return JsonInts(*v, Name(key), lo, hi, max_count);
}

StatusOr<float> JsonFields::Float(std::string_view key) const {
  STRATA_ASSIGN_OR_RETURN(const Json* v, Get(key, Json::value_t::number_float));
  const double d = v->get<double>();
  if (!(std::abs(d) <= std::numeric_limits<float>::max())) {
    return DataLossError(fmt::format("{} = {} does not fit fp32", Name(key), JsonExcerpt(*v)));
  }
  return static_cast<float>(d);
}

StatusOr<std::string> JsonFields::String(std::string_view key) const {
  STRATA_ASSIGN_OR_RETURN(const Json* v, Get(key, Json::value_t::string));
  return v->get<std::string>();
}

StatusOr<bool> JsonFields::Bool(std::string_view key) const {
  STRATA_ASSIGN_OR_RETURN(const Json* v, Get(key, Json::value_t::boolean));
  return v->get<bool>();
}

StatusOr<std::string> JsonFields::ObjectText(std::string_view key) const {
  STRATA_ASSIGN_OR_RETURN(const Json* v, Get(key, Json::value_t::object));
  return v->dump();
}

StatusOr<uint64_t> JsonFields::Hex64(std::string_view key) const {
  STRATA_ASSIGN_OR_RETURN(std::string s, String(key));
  uint64_t x = 0;
  const char* end = s.data() + s.size();
  const auto [ptr, ec] = std::from_chars(s.data(), end, x, 16);
  const bool ok = s.size() == 16 && ec == std::errc() && ptr == end;
  if (!ok) {
    return DataLossError(fmt::format("{} '{}' is not 16 hex digits", Name(key), Excerpt(s, 40)));
  }
  return x;
}

}  // namespace strata
