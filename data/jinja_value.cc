#include "data/jinja_value.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>

#include "data/jinja_error.h"
#include "data/jinja_strings.h"

namespace strata::data::jinja {
namespace {

// Deeper than any value a template can build (kMaxValueDepth) or a bounded context holds.
constexpr int kMaxWalkDepth = 2 * kMaxValueDepth;

void CheckDepth(int depth) {
  if (depth > kMaxWalkDepth) FailExhausted(0, "value nested too deeply to print or compare");
}

int DepthOf(const Value& v) {
  if (v.kind == Kind::kList) return v.list().depth;
  if (v.kind == Kind::kDict) return v.dict().depth;
  return 0;
}

void AppendHex(std::string& out, uint32_t v, int digits) {
  static constexpr char kHex[] = "0123456789abcdef";
  for (int k = digits - 1; k >= 0; --k) out += kHex[(v >> (4 * k)) & 0xF];
}

void AppendStringRepr(std::string& out, std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  out += quote;
  for (size_t i = 0; i < s.size();) {
    const size_t start = i;
    const uint32_t cp = DecodeUtf8(s, &i);
    if (cp == '\\' || cp == static_cast<uint32_t>(quote)) {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp < 0x20 || cp == 0x7F) {
      out += "\\x";
      AppendHex(out, cp, 2);
    } else if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else {
      const auto type = static_cast<UCharCategory>(u_charType(static_cast<UChar32>(cp)));
      const bool printable = type != U_CONTROL_CHAR && type != U_FORMAT_CHAR &&
                             type != U_SPACE_SEPARATOR && type != U_LINE_SEPARATOR &&
                             type != U_PARAGRAPH_SEPARATOR && type != U_UNASSIGNED &&
                             type != U_SURROGATE && type != U_PRIVATE_USE_CHAR;
      if (printable) {
        out.append(s.substr(start, i - start));
      } else if (cp < 0x100) {
        out += "\\x";
        AppendHex(out, cp, 2);
      } else if (cp < 0x10000) {
        out += "\\u";
        AppendHex(out, cp, 4);
      } else {
        out += "\\U";
        AppendHex(out, cp, 8);
      }
    }
  }
  out += quote;
}

void AppendInt(std::string& out, int64_t v) {
  char buf[24];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, r.ptr);
}

void ReprAt(std::string& out, const Value& v, int depth);

void AppendSeqRepr(std::string& out, const Value& v, int depth) {
  const size_t n = SeqSize(v);
  const bool tuple = v.kind == Kind::kList && v.tuple;
  out += tuple ? '(' : '[';
  for (size_t k = 0; k < n; ++k) {
    if (k) out += ", ";
    ReprAt(out, SeqAt(v, k), depth + 1);
  }
  if (tuple && n == 1) out += ',';
  out += tuple ? ')' : ']';
}

void AppendDictRepr(std::string& out, const Value& v, int depth) {
  out += '{';
  const size_t n = DictSize(v);
  for (size_t k = 0; k < n; ++k) {
    if (k) out += ", ";
    ReprAt(out, DictKeyAt(v, k), depth + 1);
    out += ": ";
    ReprAt(out, DictValueAt(v, k), depth + 1);
  }
  out += '}';
}

void StrAt(std::string& out, const Value& v, int depth) {
  CheckDepth(depth);
  switch (v.kind) {
    case Kind::kUndefined:
      return;
    case Kind::kNone:
      out += "None";
      return;
    case Kind::kBool:
      out += v.b ? "True" : "False";
      return;
    case Kind::kInt:
      AppendInt(out, v.i);
      return;
    case Kind::kFloat:
      AppendFloatRepr(out, v.f);
      return;
    case Kind::kString:
      out.append(v.str);
      return;
    case Kind::kList:
    case Kind::kJson:
      if (v.is_list()) {
        AppendSeqRepr(out, v, depth);
      } else {
        AppendDictRepr(out, v, depth);
      }
      return;
    case Kind::kDict:
      AppendDictRepr(out, v, depth);
      return;
    case Kind::kCallable:
      out += "<function>";
      return;
    case Kind::kNamespace: {
      out += "<Namespace {";
      bool first = true;
      for (const auto& [k, item] : v.ns().attrs) {
        if (!first) out += ", ";
        first = false;
        AppendStringRepr(out, k);
        out += ": ";
        ReprAt(out, item, depth + 1);
      }
      out += "}>";
      return;
    }
    case Kind::kLoop:
      out += "<LoopContext>";
      return;
  }
}

void ReprAt(std::string& out, const Value& v, int depth) {
  if (v.kind == Kind::kString) {
    AppendStringRepr(out, v.str);
  } else {
    StrAt(out, v, depth);
  }
}

bool EqualAt(const Value& a, const Value& b, int depth) {
  CheckDepth(depth);
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::kFloat || b.kind == Kind::kFloat) {
      const double x = a.kind == Kind::kFloat ? a.f : a.kind == Kind::kInt ? double(a.i) : a.b;
      const double y = b.kind == Kind::kFloat ? b.f : b.kind == Kind::kInt ? double(b.i) : b.b;
      return x == y;
    }
    const int64_t x = a.kind == Kind::kInt ? a.i : a.b;
    const int64_t y = b.kind == Kind::kInt ? b.i : b.b;
    return x == y;
  }
  if (a.kind == Kind::kString || b.kind == Kind::kString) {
    return a.kind == b.kind && a.str == b.str;
  }
  if (a.is_list() && b.is_list()) {
    const bool ta = a.kind == Kind::kList && a.tuple;
    const bool tb = b.kind == Kind::kList && b.tuple;
    if (ta != tb) return false;
    const size_t n = SeqSize(a);
    if (n != SeqSize(b)) return false;
    for (size_t k = 0; k < n; ++k) {
      if (!EqualAt(SeqAt(a, k), SeqAt(b, k), depth + 1)) return false;
    }
    return true;
  }
  if (a.is_dict() && b.is_dict()) {
    const size_t n = DictSize(a);
    if (n != DictSize(b)) return false;
    for (size_t k = 0; k < n; ++k) {
      Value other;
      if (!DictFind(b, DictKeyAt(a, k), &other)) return false;
      if (!EqualAt(DictValueAt(a, k), other, depth + 1)) return false;
    }
    return true;
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    default:
      return a.owner == b.owner;
  }
}

int CompareAt(const Value& a, const Value& b, int line, int depth) {
  CheckDepth(depth);
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::kFloat || b.kind == Kind::kFloat) {
      const double x = a.kind == Kind::kFloat ? a.f : a.kind == Kind::kInt ? double(a.i) : a.b;
      const double y = b.kind == Kind::kFloat ? b.f : b.kind == Kind::kInt ? double(b.i) : b.b;
      return x < y ? -1 : x > y ? 1 : 0;
    }
    const int64_t x = a.kind == Kind::kInt ? a.i : a.b;
    const int64_t y = b.kind == Kind::kInt ? b.i : b.b;
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.kind == Kind::kString && b.kind == Kind::kString) {
    const int c = a.str.compare(b.str);
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  const bool ta = a.kind == Kind::kList && a.tuple;
  const bool tb = b.kind == Kind::kList && b.tuple;
  if (a.is_list() && b.is_list() && ta == tb) {
    const size_t n = SeqSize(a), m = SeqSize(b);
    for (size_t k = 0; k < n && k < m; ++k) {
      const Value x = SeqAt(a, k), y = SeqAt(b, k);
      if (!EqualAt(x, y, depth + 1)) return CompareAt(x, y, line, depth + 1);
    }
    return n < m ? -1 : n > m ? 1 : 0;
  }
  Fail(line, "'<' not supported between instances of '" + std::string(TypeName(a)) + "' and '" +
                 std::string(TypeName(b)) + "'");
}

void AppendJsonString(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    const size_t start = i;
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const uint32_t cp = DecodeUtf8(s, &i);
      if (!ensure_ascii) {
        out.append(s.substr(start, i - start));
      } else if (cp >= 0x10000) {
        const uint32_t v = cp - 0x10000;
        out += "\\u";
        AppendHex(out, 0xD800 + (v >> 10), 4);
        out += "\\u";
        AppendHex(out, 0xDC00 + (v & 0x3FF), 4);
      } else {
        out += "\\u";
        AppendHex(out, cp, 4);
      }
      continue;
    }
    ++i;
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          out += "\\u";
          AppendHex(out, c, 4);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void JsonAt(std::string& out, const Value& v, const JsonDumpOptions& o, int line, int depth) {
  CheckDepth(depth);
  auto newline = [&](int level) {
    if (o.indent == nullptr) return;
    out += '\n';
    for (int k = 0; k < level; ++k) out += *o.indent;
  };
  switch (v.kind) {
    case Kind::kNone:
      out += "null";
      return;
    case Kind::kBool:
      out += v.b ? "true" : "false";
      return;
    case Kind::kInt:
      AppendInt(out, v.i);
      return;
    case Kind::kFloat:
      if (std::isnan(v.f)) {
        out += "NaN";
      } else if (std::isinf(v.f)) {
        out += v.f < 0 ? "-Infinity" : "Infinity";
      } else {
        AppendFloatRepr(out, v.f);
      }
      return;
    case Kind::kString:
      AppendJsonString(out, v.str, o.ensure_ascii);
      return;
    default:
      break;
  }
  if (v.is_list()) {
    const size_t n = SeqSize(v);
    if (n == 0) {
      out += "[]";
      return;
    }
    out += '[';
    for (size_t k = 0; k < n; ++k) {
      if (k) out += o.item_separator;
      newline(depth + 1);
      JsonAt(out, SeqAt(v, k), o, line, depth + 1);
    }
    newline(depth);
    out += ']';
    return;
  }
  if (v.is_dict()) {
    const size_t n = DictSize(v);
    if (n == 0) {
      out += "{}";
      return;
    }
    std::vector<std::pair<std::string, size_t>> keys;
    keys.reserve(n);
    for (size_t k = 0; k < n; ++k) {
      const Value key = DictKeyAt(v, k);
      std::string text;
      switch (key.kind) {
        case Kind::kString:
          text = std::string(key.str);
          break;
        case Kind::kNone:
          text = "null";
          break;
        case Kind::kBool:
          text = key.b ? "true" : "false";
          break;
        case Kind::kInt:
        case Kind::kFloat:
          JsonAt(text, key, o, line, depth + 1);
          break;
        default:
          Fail(line,
               "keys must be str, int, float, bool or None, not " + std::string(TypeName(key)));
      }
      keys.emplace_back(std::move(text), k);
    }
    if (o.sort_keys) std::stable_sort(keys.begin(), keys.end());
    out += '{';
    bool first = true;
    for (const auto& [text, k] : keys) {
      if (!first) out += o.item_separator;
      first = false;
      newline(depth + 1);
      AppendJsonString(out, text, o.ensure_ascii);
      out += o.key_separator;
      JsonAt(out, DictValueAt(v, k), o, line, depth + 1);
    }
    newline(depth);
    out += '}';
    return;
  }
  Fail(line, "Object of type " + std::string(TypeName(v)) + " is not JSON serializable");
}

}  // namespace

Value Value::UndefinedOwned(std::string hint) {
  auto s = std::make_shared<const std::string>(std::move(hint));
  Value v;
  v.str = *s;
  v.owner = std::move(s);
  return v;
}

Value Value::String(std::string s) {
  auto p = std::make_shared<const std::string>(std::move(s));
  Value v = Make(Kind::kString);
  v.str = *p;
  v.owner = std::move(p);
  return v;
}

Value Value::List(std::vector<Value> items, bool tuple) {
  auto p = std::make_shared<ListData>();
  int depth = 0;
  for (const Value& item : items) depth = std::max(depth, DepthOf(item));
  if (depth + 1 > kMaxValueDepth) {
    FailExhausted(0, "list nested deeper than " + std::to_string(kMaxValueDepth) + " levels");
  }
  p->depth = depth + 1;
  p->items = std::move(items);
  Value v = Make(Kind::kList);
  v.tuple = tuple;
  v.owner = std::move(p);
  return v;
}

Value Value::Dict(std::vector<std::pair<Value, Value>> items) {
  auto p = std::make_shared<DictData>();
  int depth = 0;
  for (const auto& [k, item] : items) depth = std::max({depth, DepthOf(k), DepthOf(item)});
  if (depth + 1 > kMaxValueDepth) {
    FailExhausted(0, "dict nested deeper than " + std::to_string(kMaxValueDepth) + " levels");
  }
  p->depth = depth + 1;
  p->items = std::move(items);
  Value v = Make(Kind::kDict);
  v.owner = std::move(p);
  return v;
}

Value Value::FromJson(const Json& j) {
  switch (j.type()) {
    case Json::value_t::boolean:
      return Bool(j.get<bool>());
    case Json::value_t::number_integer:
      return Int(j.get<int64_t>());
    case Json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      return u > static_cast<uint64_t>(INT64_MAX) ? Float(static_cast<double>(u))
                                                  : Int(static_cast<int64_t>(u));
    }
    case Json::value_t::number_float:
      return Float(j.get<double>());
    case Json::value_t::string:
      return StringView(j.get_ref<const std::string&>());
    case Json::value_t::array:
    case Json::value_t::object: {
      Value v = Make(Kind::kJson);
      v.json = &j;
      return v;
    }
    default:
      return None();
  }
}

size_t SeqSize(const Value& v) {
  return v.kind == Kind::kJson ? v.json->size() : v.list().items.size();
}

Value SeqAt(const Value& v, size_t index) {
  return v.kind == Kind::kJson ? Value::FromJson((*v.json)[index]) : v.list().items[index];
}

size_t DictSize(const Value& v) {
  return v.kind == Kind::kJson ? v.json->size() : v.dict().items.size();
}

Value DictKeyAt(const Value& v, size_t index) {
  if (v.kind == Kind::kJson) {
    const auto& obj = v.json->get_ref<const Json::object_t&>();
    return Value::StringView((obj.begin() + static_cast<std::ptrdiff_t>(index))->first);
  }
  return v.dict().items[index].first;
}

Value DictValueAt(const Value& v, size_t index) {
  if (v.kind == Kind::kJson) {
    const auto& obj = v.json->get_ref<const Json::object_t&>();
    return Value::FromJson((obj.begin() + static_cast<std::ptrdiff_t>(index))->second);
  }
  return v.dict().items[index].second;
}

bool DictFind(const Value& v, const Value& key, Value* out) {
  if (v.kind == Kind::kJson) {
    if (key.kind != Kind::kString) return false;
    const auto& obj = v.json->get_ref<const Json::object_t&>();
    for (const auto& [k, item] : obj) {
      if (k == key.str) {
        *out = Value::FromJson(item);
        return true;
      }
    }
    return false;
  }
  for (const auto& [k, item] : v.dict().items) {
    if (EqualAt(k, key, 0)) {
      *out = item;
      return true;
    }
  }
  return false;
}

bool Truthy(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return v.b;
    case Kind::kInt:
      return v.i != 0;
    case Kind::kFloat:
      return v.f != 0.0;
    case Kind::kString:
      return !v.str.empty();
    case Kind::kList:
      return !v.list().items.empty();
    case Kind::kDict:
      return !v.dict().items.empty();
    case Kind::kJson:
      return !v.json->empty();
    default:
      return true;
  }
}

bool Equal(const Value& a, const Value& b) { return EqualAt(a, b, 0); }
int Compare(const Value& a, const Value& b, int line) { return CompareAt(a, b, line, 0); }

std::string_view TypeName(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return v.tuple ? "tuple" : "list";
    case Kind::kDict:
      return "dict";
    case Kind::kJson:
      return v.json->is_array() ? "list" : "dict";
    case Kind::kCallable:
      return "function";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kLoop:
      return "LoopContext";
  }
  return "object";
}

void AppendStr(std::string& out, const Value& v) { StrAt(out, v, 0); }
void AppendRepr(std::string& out, const Value& v) { ReprAt(out, v, 0); }
std::string ToStr(const Value& v) {
  if (v.kind == Kind::kString) return std::string(v.str);
  std::string s;
  StrAt(s, v, 0);
  return s;
}

void AppendJson(std::string& out, const Value& v, const JsonDumpOptions& options, int line) {
  JsonAt(out, v, options, line, 0);
}

void AppendFloatRepr(std::string& out, double f) {
  if (std::isnan(f)) {
    out += "nan";
    return;
  }
  if (std::isinf(f)) {
    out += f < 0 ? "-inf" : "inf";
    return;
  }
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, f, std::chars_format::scientific);
  std::string_view s(buf, static_cast<size_t>(r.ptr - buf));
  if (s[0] == '-') {
    out += '-';
    s.remove_prefix(1);
  }
  const size_t e = s.find('e');
  std::string digits(1, s[0]);
  if (e > 1) digits.append(s.substr(2, e - 2));
  int exp = 0;
  std::from_chars(s.data() + e + 1 + (s[e + 1] == '+'), s.data() + s.size(), exp);
  const int n = static_cast<int>(digits.size());
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      if (n <= exp + 1) {
        out += digits;
        out.append(static_cast<size_t>(exp + 1 - n), '0');
        out += ".0";
      } else {
        out.append(digits, 0, static_cast<size_t>(exp + 1));
        out += '.';
        out.append(digits, static_cast<size_t>(exp + 1));
      }
    } else {
      out += "0.";
      out.append(static_cast<size_t>(-exp - 1), '0');
      out += digits;
    }
  } else {
    out += digits[0];
    if (n > 1) {
      out += '.';
      out.append(digits, 1);
    }
    out += 'e';
    out += exp < 0 ? '-' : '+';
    const int a = exp < 0 ? -exp : exp;
    if (a < 10) out += '0';
    out += std::to_string(a);
  }
}

void AppendUtf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t CodePointCount(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    n += (static_cast<unsigned char>(s[i]) & 0xC0) != 0x80 || i == 0;
  }
  return n;
}

std::vector<size_t> CodePointOffsets(std::string_view s) {
  std::vector<size_t> offsets;
  offsets.reserve(s.size() + 1);
  for (size_t i = 0; i < s.size(); ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80 || i == 0) offsets.push_back(i);
  }
  offsets.push_back(s.size());
  return offsets;
}

}  // namespace strata::data::jinja
