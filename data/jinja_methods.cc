// The Python methods a sandboxed template may call on str, dict and list values, and the
// globals (range, namespace, dict, raise_exception, strftime_now).
#include <ctime>
#include <string>

#include "base/untrusted_text.h"
#include "data/jinja_builtins.h"
#include "data/jinja_error.h"
#include "data/jinja_strings.h"

namespace strata::data::jinja {
namespace {

constexpr std::string_view kStrMethods[] = {
    "strip",    "lstrip",  "rstrip",  "split",   "rsplit",     "startswith",
    "endswith", "replace", "upper",   "lower",   "title",      "capitalize",
    "find",     "rfind",   "count",   "join",    "splitlines", "isdigit",
    "isalpha",  "isalnum", "isspace", "islower", "isupper"};
constexpr std::string_view kDictMethods[] = {"items", "keys", "values", "get", "copy"};
constexpr std::string_view kListMethods[] = {"index", "count", "copy"};
constexpr std::string_view kUnsafeDict[] = {"clear", "pop", "popitem", "setdefault", "update"};
constexpr std::string_view kUnsafeList[] = {"append", "extend", "insert", "pop",
                                            "remove", "clear",  "sort",   "reverse"};

template <size_t N>
std::string_view FindName(const std::string_view (&names)[N], std::string_view name) {
  for (std::string_view n : names) {
    if (n == name) return n;
  }
  return {};
}

const std::string_view* OptionalString(const CallArgs& args, size_t index, std::string_view name,
                                       std::string_view method, int line) {
  const Value* v = args.Get(index, name);
  if (v == nullptr || v->kind == Kind::kNone) return nullptr;
  if (v->kind != Kind::kString) {
    Fail(line,
         std::string(method) + "() argument must be str or None, not " + std::string(TypeName(*v)));
  }
  return &v->str;
}

std::string_view RequireString(const CallArgs& args, size_t index, std::string_view name,
                               std::string_view method, int line) {
  const Value* v = args.Get(index, name);
  if (v == nullptr)
    Fail(line, std::string(method) + "() missing required argument '" + std::string(name) + "'");
  if (v->kind != Kind::kString) {
    Fail(line, std::string(method) + "() argument must be str, not " + std::string(TypeName(*v)));
  }
  return v->str;
}

int64_t OptionalInt(const CallArgs& args, size_t index, std::string_view name, int64_t fallback,
                    int line) {
  const Value* v = args.Get(index, name);
  if (v == nullptr) return fallback;
  if (v->kind == Kind::kInt) return v->i;
  if (v->kind == Kind::kBool) return v->b;
  Fail(line, "'" + std::string(TypeName(*v)) + "' object cannot be interpreted as an integer");
}

Value Substring(const Value& s, std::string_view part) {
  Value v = Value::StringView(part);
  v.owner = s.owner;
  return v;
}

bool AllCodePoints(std::string_view s, bool (*pred)(uint32_t)) {
  if (s.empty()) return false;
  std::string tmp;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    uint32_t cp = c;
    if (c >= 0x80) {
      // Non-ASCII: decode via the offsets helper.
      const std::vector<size_t> o = CodePointOffsets(s.substr(i));
      const std::string_view one = s.substr(i, o[1]);
      cp = 0;
      const int n = one.size() == 2 ? 0x1F : one.size() == 3 ? 0x0F : 0x07;
      cp = static_cast<unsigned char>(one[0]) & n;
      for (size_t k = 1; k < one.size(); ++k) cp = (cp << 6) | (one[k] & 0x3F);
      i += one.size();
    } else {
      ++i;
    }
    if (!pred(cp)) return false;
  }
  return true;
}

Value StrMethod(Interpreter& in, const Value& self, std::string_view name, CallArgs& args,
                int line) {
  const std::string_view s = self.str;
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const std::string_view* chars = OptionalString(args, 0, "chars", name, line);
    return Substring(self, PyStrip(s, chars, name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    const std::string_view* sep = OptionalString(args, 0, "sep", name, line);
    std::vector<std::string_view> parts;
    if (!PySplit(s, sep, OptionalInt(args, 1, "maxsplit", -1, line), name == "rsplit", &parts)) {
      Fail(line, "empty separator");
    }
    std::vector<Value> items;
    items.reserve(parts.size());
    for (std::string_view p : parts) items.push_back(Substring(self, p));
    return Value::List(std::move(items));
  }
  if (name == "splitlines") {
    std::vector<Value> items;
    for (std::string_view p : PySplitLines(s)) items.push_back(Substring(self, p));
    return Value::List(std::move(items));
  }
  if (name == "startswith" || name == "endswith") {
    const Value* prefix = args.Get(0, "prefix");
    if (prefix == nullptr) Fail(line, std::string(name) + "() takes at least 1 argument");
    auto test = [&](const Value& p) {
      if (p.kind != Kind::kString) {
        Fail(line, std::string(name) + " first arg must be str or a tuple of str, not " +
                       std::string(TypeName(p)));
      }
      return name == "startswith" ? s.starts_with(p.str) : s.ends_with(p.str);
    };
    if (prefix->kind == Kind::kList && prefix->tuple) {
      for (const Value& p : prefix->list().items) {
        if (test(p)) return Value::Bool(true);
      }
      return Value::Bool(false);
    }
    return Value::Bool(test(*prefix));
  }
  if (name == "replace") {
    const std::string_view old_text = RequireString(args, 0, "old", name, line);
    const std::string_view new_text = RequireString(args, 1, "new", name, line);
    std::string r = PyReplace(s, old_text, new_text, OptionalInt(args, 2, "count", -1, line));
    in.CheckStringSize(r.size(), line);
    return Value::String(std::move(r));
  }
  if (name == "upper") return Value::String(PyUpper(s));
  if (name == "lower") return Value::String(PyLower(s));
  if (name == "title") return Value::String(PyTitle(s));
  if (name == "capitalize") return Value::String(PyCapitalize(s));
  if (name == "find" || name == "rfind") {
    if (args.pos.size() > 1) Fail(line, std::string(name) + "() with start/end is not supported");
    return Value::Int(PyFind(s, RequireString(args, 0, "sub", name, line), name == "rfind"));
  }
  if (name == "count") {
    if (args.pos.size() > 1) Fail(line, "count() with start/end is not supported");
    return Value::Int(PyCount(s, RequireString(args, 0, "sub", name, line)));
  }
  if (name == "join") {
    const Value* items = args.Get(0, "iterable");
    if (items == nullptr) Fail(line, "join() takes exactly one argument");
    std::string out;
    bool first = true;
    for (const Value& v : in.Iterate(*items, line)) {
      if (v.kind != Kind::kString) {
        Fail(line, "sequence item: expected str instance, " + std::string(TypeName(v)) + " found");
      }
      if (!first) out.append(s);
      first = false;
      out.append(v.str);
      in.CheckStringSize(out.size(), line);
    }
    return Value::String(std::move(out));
  }
  if (name == "isdigit")
    return Value::Bool(AllCodePoints(s, [](uint32_t c) { return c >= '0' && c <= '9'; }));
  if (name == "isspace") return Value::Bool(AllCodePoints(s, IsPyWhitespace));
  if (name == "isalpha" || name == "isalnum") {
    if (s.empty()) return Value::Bool(false);
    for (char c : s) {
      const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                         (static_cast<unsigned char>(c) >= 0x80);
      const bool digit = c >= '0' && c <= '9';
      if (!(alpha || (name == "isalnum" && digit))) return Value::Bool(false);
    }
    return Value::Bool(true);
  }
  if (name == "islower" || name == "isupper") {
    const std::string lower = PyLower(s), upper = PyUpper(s);
    const bool cased = lower != upper;
    return Value::Bool(cased && (name == "islower" ? s == lower : s == upper));
  }
  Fail(line, "str method '" + std::string(name) + "' is not supported");
}

Value DictMethod(Interpreter& in, const Value& self, std::string_view name, CallArgs& args,
                 int line) {
  const size_t n = DictSize(self);
  if (name == "items" || name == "keys" || name == "values") {
    std::vector<Value> items;
    items.reserve(n);
    for (size_t k = 0; k < n; ++k) {
      if (name == "items") {
        items.push_back(Value::List({DictKeyAt(self, k), DictValueAt(self, k)}, true));
      } else {
        items.push_back(name == "keys" ? DictKeyAt(self, k) : DictValueAt(self, k));
      }
    }
    return Value::List(std::move(items));
  }
  if (name == "get") {
    const Value* key = args.Get(0, "key");
    if (key == nullptr) Fail(line, "get expected at least 1 argument, got 0");
    Value out;
    if (DictFind(self, *key, &out)) return out;
    const Value* fallback = args.Get(1, "default");
    return fallback ? *fallback : Value::None();
  }
  if (name == "copy") return self;
  (void)in;
  Fail(line, "dict method '" + std::string(name) + "' is not supported");
}

Value ListMethod(Interpreter& in, const Value& self, std::string_view name, CallArgs& args,
                 int line) {
  if (name == "copy") return self;
  const Value* x = args.Get(0, "value");
  if (x == nullptr) Fail(line, std::string(name) + "() takes exactly one argument (0 given)");
  const size_t n = SeqSize(self);
  int64_t count = 0;
  for (size_t k = 0; k < n; ++k) {
    if (Equal(SeqAt(self, k), *x)) {
      if (name == "index") return Value::Int(static_cast<int64_t>(k));
      ++count;
    }
  }
  if (name == "index") Fail(line, "list.index(x): x not in list");
  (void)in;
  return Value::Int(count);
}

std::vector<Value> RangeItems(const CallArgs& args, int line) {
  int64_t start = 0, stop = 0, step = 1;
  auto arg = [&](size_t k) {
    const Value& v = args.pos[k];
    if (v.kind == Kind::kInt) return v.i;
    if (v.kind == Kind::kBool) return static_cast<int64_t>(v.b);
    Fail(line, "'" + std::string(TypeName(v)) + "' object cannot be interpreted as an integer");
  };
  if (args.pos.size() == 1) {
    stop = arg(0);
  } else if (args.pos.size() == 2 || args.pos.size() == 3) {
    start = arg(0);
    stop = arg(1);
    if (args.pos.size() == 3) step = arg(2);
  } else {
    Fail(line, "range expected 1 to 3 arguments");
  }
  if (step == 0) Fail(line, "range() arg 3 must not be zero");
  // The sandbox's MAX_RANGE.
  constexpr int64_t kMaxRange = 100000;
  const double count = step > 0 ? (static_cast<double>(stop) - start) / step
                                : (static_cast<double>(start) - stop) / -step;
  if (count > kMaxRange) {
    Fail(line, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
  }
  std::vector<Value> items;
  for (int64_t v = start; step > 0 ? v < stop : v > stop; v += step) items.push_back(Value::Int(v));
  return items;
}

}  // namespace

bool IsMethod(const Value& obj, std::string_view name) {
  if (obj.kind == Kind::kString) return !FindName(kStrMethods, name).empty();
  if (obj.is_dict()) return !FindName(kDictMethods, name).empty();
  if (obj.is_list()) return !FindName(kListMethods, name).empty();
  return false;
}

std::string_view MethodName(std::string_view name) {
  for (auto n :
       {FindName(kStrMethods, name), FindName(kDictMethods, name), FindName(kListMethods, name)}) {
    if (!n.empty()) return n;
  }
  return {};
}

bool IsUnsafeMethod(const Value& obj, std::string_view name) {
  if (obj.is_dict()) return !FindName(kUnsafeDict, name).empty();
  if (obj.is_list()) return !FindName(kUnsafeList, name).empty();
  return false;
}

Value CallMethod(Interpreter& in, const Value& self, std::string_view name, CallArgs& args,
                 int line) {
  if (self.kind == Kind::kString) return StrMethod(in, self, name, args, line);
  if (self.is_dict()) return DictMethod(in, self, name, args, line);
  return ListMethod(in, self, name, args, line);
}

Value CallGlobal(Interpreter& in, std::string_view name, CallArgs& args, int line) {
  if (name == "range") return Value::List(RangeItems(args, line));
  if (name == "namespace") return in.MakeNamespace(args, line);
  if (name == "dict") {
    std::vector<std::pair<Value, Value>> items;
    for (const auto& [k, v] : args.kw) items.emplace_back(Value::String(std::string(k)), v);
    return Value::Dict(std::move(items));
  }
  if (name == "raise_exception") {
    const Value* msg = args.Get(0, "message");
    Fail(line, msg ? Excerpt(ToStr(*msg), 1000) : std::string("raise_exception() called"));
  }
  if (name == "strftime_now") {
    const Value* fmt = args.Get(0, "format");
    if (fmt == nullptr || fmt->kind != Kind::kString)
      Fail(line, "strftime_now() takes a format string");
    std::tm tm{};
    const std::time_t now = in.limits().now;
    localtime_r(&now, &tm);
    const std::string f(fmt->str);
    std::string out(256, '\0');
    const size_t n = f.empty() ? 0 : std::strftime(out.data(), out.size(), f.c_str(), &tm);
    if (n == 0 && !f.empty()) Fail(line, "strftime_now() format gives no text or over 256 bytes");
    out.resize(n);
    return Value::String(std::move(out));
  }
  Fail(line, "'" + std::string(name) + "' is not callable");
}

}  // namespace strata::data::jinja
