// jinja2's builtin filters and tests (jinja2/filters.py, jinja2/tests.py), and transformers'
// tojson filter (json.dumps with ensure_ascii=False, keys in insertion order).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/untrusted_text.h"
#include "data/jinja_builtins.h"
#include "data/jinja_error.h"
#include "data/jinja_strings.h"

namespace strata::data::jinja {
namespace {

bool IsIntLike(const Value& v) { return v.kind == Kind::kInt || v.kind == Kind::kBool; }
double AsDouble(const Value& v) {
  return v.kind == Kind::kFloat ? v.f : v.kind == Kind::kInt ? static_cast<double>(v.i) : v.b;
}

bool BoolArg(const CallArgs& args, size_t index, std::string_view name, bool fallback) {
  const Value* v = args.Get(index, name);
  return v ? Truthy(*v) : fallback;
}

size_t Length(const Value& v, int line) {
  switch (v.kind) {
    case Kind::kUndefined:
      return 0;
    case Kind::kString:
      return CodePointCount(v.str);
    case Kind::kList:
    case Kind::kJson:
      return v.is_list() ? SeqSize(v) : DictSize(v);
    case Kind::kDict:
      return DictSize(v);
    default:
      Fail(line, "object of type '" + std::string(TypeName(v)) + "' has no len()");
  }
}

// environment.getattr over a dotted path ("a.b", "0.name"), as make_attrgetter does.
Value AttrPath(Interpreter& in, const Value& item, std::string_view path, int line) {
  Value v = item;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string_view part =
        path.substr(start, dot == std::string_view::npos ? dot : dot - start);
    int64_t index = 0;
    const bool numeric = !part.empty() && std::all_of(part.begin(), part.end(),
                                                      [](char c) { return c >= '0' && c <= '9'; });
    if (numeric) {
      index = std::strtoll(std::string(part).c_str(), nullptr, 10);
      v = in.GetItem(v, Value::Int(index), line);
    } else {
      v = in.GetItem(v, Value::StringView(part), line);
    }
    if (dot == std::string_view::npos) return v;
    start = dot + 1;
  }
}

std::string_view AttributeArg(const CallArgs& args, size_t index, int line) {
  const Value* a = args.Get(index, "attribute");
  if (a == nullptr || a->kind == Kind::kNone) return {};
  if (a->kind != Kind::kString) Fail(line, "attribute must be a string");
  return a->str;
}

// The sort key jinja2 uses: strings lowercased unless case_sensitive.
Value SortKey(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.kind == Kind::kString) return Value::String(PyLower(v.str));
  return v;
}

Value ListOf(std::vector<Value> items) { return Value::List(std::move(items)); }

std::string HtmlEscape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string Indent(std::string_view s, const std::string& indention, bool first, bool blank) {
  std::string text(s);
  text += '\n';
  const std::vector<std::string_view> lines = PySplitLines(text);
  std::string rv;
  if (blank) {
    for (size_t k = 0; k < lines.size(); ++k) {
      if (k) rv += "\n" + indention;
      rv.append(lines[k]);
    }
  } else {
    if (!lines.empty()) rv.append(lines[0]);
    for (size_t k = 1; k < lines.size(); ++k) {
      rv += '\n';
      if (!lines[k].empty()) rv += indention;
      rv.append(lines[k]);
    }
  }
  if (first) rv = indention + rv;
  return rv;
}

// Python round() of a double to `digits` decimals, half to even.
double PyRound(double x, int64_t digits) {
  if (digits == 0) return std::nearbyint(x);
  if (digits > 0 && digits <= 17 && std::isfinite(x)) {
    // Python rounds the exact binary value to the nearest decimal (round half even), as
    // printf's %.Nf does.
    char buf[400];
    std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(digits), x);
    return std::strtod(buf, nullptr);
  }
  const double scale = std::pow(10.0, static_cast<double>(digits));
  const double y = std::nearbyint(x * scale) / scale;
  return std::isfinite(y) ? y : x;
}

Value ToInt(const Value& v, const CallArgs& args, int line) {
  const Value* fallback = args.Get(0, "default");
  const Value def = fallback ? *fallback : Value::Int(0);
  switch (v.kind) {
    case Kind::kInt:
      return v;
    case Kind::kBool:
      return Value::Int(v.b);
    case Kind::kFloat:
      if (!std::isfinite(v.f) || std::fabs(v.f) >= 9.2e18) return def;
      return Value::Int(static_cast<int64_t>(v.f));
    case Kind::kString: {
      const Value* base_arg = args.Get(1, "base");
      const int base =
          base_arg && base_arg->kind == Kind::kInt ? static_cast<int>(base_arg->i) : 10;
      std::string t(PyStrip(v.str, nullptr, true, true));
      t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
      if (!t.empty()) {
        char* end = nullptr;
        errno = 0;
        const long long r = std::strtoll(t.c_str(), &end, base);
        if (end && *end == '\0' && errno == 0) return Value::Int(r);
        const double d = std::strtod(t.c_str(), &end);
        if (end && *end == '\0' && std::isfinite(d) && std::fabs(d) < 9.2e18) {
          return Value::Int(static_cast<int64_t>(d));
        }
      }
      return def;
    }
    case Kind::kUndefined:
      Interpreter::FailUndefined(v, line);
    default:
      return def;
  }
}

Value ToFloat(const Value& v, const CallArgs& args, int line) {
  const Value* fallback = args.Get(0, "default");
  const Value def = fallback ? *fallback : Value::Float(0.0);
  switch (v.kind) {
    case Kind::kFloat:
      return v;
    case Kind::kInt:
      return Value::Float(static_cast<double>(v.i));
    case Kind::kBool:
      return Value::Float(v.b);
    case Kind::kString: {
      std::string t(PyStrip(v.str, nullptr, true, true));
      t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
      char* end = nullptr;
      const double d = t.empty() ? 0 : std::strtod(t.c_str(), &end);
      if (!t.empty() && end && *end == '\0' &&
          (t[0] != '0' || t.size() < 2 || (t[1] != 'x' && t[1] != 'X'))) {
        return Value::Float(d);
      }
      return def;
    }
    case Kind::kUndefined:
      Interpreter::FailUndefined(v, line);
    default:
      return def;
  }
}

Value ToJson(const Value& v, const CallArgs& args, int line) {
  JsonDumpOptions o;
  o.ensure_ascii = BoolArg(args, 0, "ensure_ascii", false);
  std::string indent;
  const Value* ind = args.Get(1, "indent");
  if (ind && ind->kind != Kind::kNone) {
    if (IsIntLike(*ind)) {
      const int64_t n = ind->kind == Kind::kInt ? ind->i : ind->b;
      indent.assign(static_cast<size_t>(std::clamp<int64_t>(n, 0, 1024)), ' ');
    } else if (ind->kind == Kind::kString) {
      indent = std::string(ind->str);
    } else {
      Fail(line, "tojson indent must be an int or a string");
    }
    o.indent = &indent;
    o.item_separator = ",";
  }
  const Value* seps = args.Get(2, "separators");
  if (seps && seps->kind != Kind::kNone) {
    if (!seps->is_list() || SeqSize(*seps) != 2 || SeqAt(*seps, 0).kind != Kind::kString ||
        SeqAt(*seps, 1).kind != Kind::kString) {
      Fail(line, "tojson separators must be a pair of strings");
    }
    o.item_separator = std::string(SeqAt(*seps, 0).str);
    o.key_separator = std::string(SeqAt(*seps, 1).str);
  }
  o.sort_keys = BoolArg(args, 3, "sort_keys", false);
  std::string out;
  AppendJson(out, v, o, line);
  return Value::String(std::move(out));
}

// select / reject / selectattr / rejectattr.
Value SelectFilter(Interpreter& in, const Value& input, CallArgs& args, bool by_attr, bool keep,
                   int line) {
  size_t next = 0;
  std::string_view attr;
  if (by_attr) {
    const Value* a = args.Get(0, "attribute");
    if (a == nullptr || a->kind != Kind::kString) Fail(line, "selectattr needs an attribute name");
    attr = a->str;
    next = 1;
  }
  std::string_view test;
  CallArgs test_args;
  if (next < args.pos.size()) {
    if (args.pos[next].kind != Kind::kString) Fail(line, "the test name must be a string");
    test = args.pos[next].str;
    test_args.pos.assign(args.pos.begin() + static_cast<std::ptrdiff_t>(next + 1), args.pos.end());
    test_args.kw = args.kw;
  }
  std::vector<Value> out;
  if (!Truthy(input)) return ListOf(std::move(out));  // jinja2: `if value: for item in value`
  for (const Value& item : in.Iterate(input, line)) {
    const Value subject = by_attr ? AttrPath(in, item, attr, line) : item;
    CallArgs a = test_args;
    const bool pass = test.empty() ? Truthy(subject) : in.ApplyTestByName(test, subject, a, line);
    if (pass == keep) out.push_back(item);
  }
  return ListOf(std::move(out));
}

Value MapFilter(Interpreter& in, const Value& input, CallArgs& args, int line) {
  std::vector<Value> out;
  if (!Truthy(input)) return ListOf(std::move(out));  // jinja2: `if value: for item in value`
  if (args.pos.empty()) {
    const std::string_view attr = AttributeArg(args, 99, line);
    if (attr.empty()) Fail(line, "map requires a filter name or attribute=");
    const Value* def = args.Get(99, "default");
    for (const Value& item : in.Iterate(input, line)) {
      Value v = AttrPath(in, item, attr, line);
      if (v.is_undefined() && def) v = *def;
      out.push_back(std::move(v));
    }
    return ListOf(std::move(out));
  }
  if (args.pos[0].kind != Kind::kString) Fail(line, "map's filter name must be a string");
  const std::string_view filter = args.pos[0].str;
  CallArgs rest;
  rest.pos.assign(args.pos.begin() + 1, args.pos.end());
  rest.kw = args.kw;
  for (const Value& item : in.Iterate(input, line)) {
    CallArgs a = rest;
    out.push_back(in.ApplyFilterByName(filter, item, a, line));
  }
  return ListOf(std::move(out));
}

Value SortFilter(Interpreter& in, const Value& input, CallArgs& args, int line) {
  const bool reverse = BoolArg(args, 0, "reverse", false);
  const bool case_sensitive = BoolArg(args, 1, "case_sensitive", false);
  const std::string_view attr = AttributeArg(args, 2, line);
  std::vector<Value> items = in.Iterate(input, line);
  std::vector<std::pair<Value, size_t>> keyed;
  for (size_t k = 0; k < items.size(); ++k) {
    keyed.emplace_back(
        SortKey(attr.empty() ? items[k] : AttrPath(in, items[k], attr, line), case_sensitive), k);
  }
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
    const int c = Compare(a.first, b.first, line);
    return reverse ? c > 0 : c < 0;
  });
  std::vector<Value> out;
  for (const auto& [key, k] : keyed) out.push_back(items[k]);
  return ListOf(std::move(out));
}

Value DictSortFilter(Interpreter& in, const Value& input, CallArgs& args, int line) {
  if (!input.is_dict()) Fail(line, "dictsort expects a mapping");
  const bool case_sensitive = BoolArg(args, 0, "case_sensitive", false);
  const Value* by = args.Get(1, "by");
  const bool by_value = by && by->kind == Kind::kString && by->str == "value";
  if (by && !(by->kind == Kind::kString && (by->str == "key" || by->str == "value"))) {
    Fail(line, "You can only sort by either \"key\" or \"value\"");
  }
  const bool reverse = BoolArg(args, 2, "reverse", false);
  std::vector<Value> pairs;
  for (size_t k = 0; k < DictSize(input); ++k) {
    pairs.push_back(Value::List({DictKeyAt(input, k), DictValueAt(input, k)}, true));
  }
  std::stable_sort(pairs.begin(), pairs.end(), [&](const Value& a, const Value& b) {
    const size_t i = by_value ? 1 : 0;
    const int c = Compare(SortKey(a.list().items[i], case_sensitive),
                          SortKey(b.list().items[i], case_sensitive), line);
    return reverse ? c > 0 : c < 0;
  });
  (void)in;
  return ListOf(std::move(pairs));
}

Value MinMax(Interpreter& in, const Value& input, CallArgs& args, bool max, int line) {
  const bool case_sensitive = BoolArg(args, 0, "case_sensitive", false);
  const std::string_view attr = AttributeArg(args, 1, line);
  const std::vector<Value> items = in.Iterate(input, line);
  if (items.empty()) return Value::Undefined("no items for min/max");
  size_t best = 0;
  Value best_key =
      SortKey(attr.empty() ? items[0] : AttrPath(in, items[0], attr, line), case_sensitive);
  for (size_t k = 1; k < items.size(); ++k) {
    Value key =
        SortKey(attr.empty() ? items[k] : AttrPath(in, items[k], attr, line), case_sensitive);
    const int c = Compare(key, best_key, line);
    if (max ? c > 0 : c < 0) {
      best = k;
      best_key = std::move(key);
    }
  }
  return items[best];
}

}  // namespace

Value CallFilter(Interpreter& in, std::string_view name, const Value& input, CallArgs& args,
                 int line) {
  const Value& v = input;
  if (name == "tojson") return ToJson(v, args, line);
  if (name == "trim") {
    const Value* chars = args.Get(0, "chars");
    const std::string s = ToStr(v);
    std::string_view c;
    const bool has_chars = chars && chars->kind == Kind::kString;
    if (has_chars) c = chars->str;
    return Value::String(std::string(PyStrip(s, has_chars ? &c : nullptr, true, true)));
  }
  if (name == "length" || name == "count") return Value::Int(static_cast<int64_t>(Length(v, line)));
  if (name == "default" || name == "d") {
    const bool boolean = BoolArg(args, 1, "boolean", false);
    if (v.is_undefined() || (boolean && !Truthy(v))) {
      const Value* def = args.Get(0, "default_value");
      return def ? *def : Value::StringView("");
    }
    return v;
  }
  if (name == "string") return v.kind == Kind::kString ? v : Value::String(ToStr(v));
  if (name == "safe") return v.kind == Kind::kString ? v : Value::String(ToStr(v));
  if (name == "escape" || name == "e" || name == "forceescape")
    return Value::String(HtmlEscape(ToStr(v)));
  if (name == "upper") return Value::String(PyUpper(ToStr(v)));
  if (name == "lower") return Value::String(PyLower(ToStr(v)));
  if (name == "capitalize") return Value::String(PyCapitalize(ToStr(v)));
  if (name == "title") {
    // jinja2's own title: words begin after '-', whitespace or an opening bracket.
    const std::string s = ToStr(v);
    std::string out;
    bool word_start = true;
    for (size_t i = 0; i < s.size();) {
      const std::vector<size_t> one = CodePointOffsets(std::string_view(s).substr(i, 4));
      const std::string_view ch = std::string_view(s).substr(i, one.size() > 1 ? one[1] : 1);
      const bool sep = ch == "-" || ch == "(" || ch == "{" || ch == "[" || ch == "<" ||
                       (ch.size() == 1 && (ch[0] == ' ' || (ch[0] >= '\t' && ch[0] <= '\r'))) ||
                       (ch.size() > 1 && PyStrip(ch, nullptr, true, true).empty());
      if (sep) {
        out.append(ch);
        word_start = true;
      } else {
        out += word_start ? PyUpper(ch) : PyLower(ch);
        word_start = false;
      }
      i += ch.size();
    }
    return Value::String(std::move(out));
  }
  if (name == "replace") {
    const Value* old_v = args.Get(0, "old");
    const Value* new_v = args.Get(1, "new");
    if (!old_v || !new_v) Fail(line, "replace needs old and new");
    const Value* count = args.Get(2, "count");
    std::string r = PyReplace(ToStr(v), ToStr(*old_v), ToStr(*new_v),
                              count && count->kind == Kind::kInt ? count->i : -1);
    in.CheckStringSize(r.size(), line);
    return Value::String(std::move(r));
  }
  if (name == "join") {
    const Value* sep = args.Get(0, "d");
    const std::string d = sep ? ToStr(*sep) : std::string();
    const std::string_view attr = AttributeArg(args, 1, line);
    std::string out;
    bool first = true;
    for (const Value& item : in.Iterate(v, line)) {
      if (!first) out += d;
      first = false;
      AppendStr(out, attr.empty() ? item : AttrPath(in, item, attr, line));
      in.CheckStringSize(out.size(), line);
    }
    return Value::String(std::move(out));
  }
  if (name == "list") return ListOf(in.Iterate(v, line));
  if (name == "first") {
    if (v.is_list()) return SeqSize(v) ? SeqAt(v, 0) : Value::Undefined("no first item");
    std::vector<Value> items = in.Iterate(v, line);
    return items.empty() ? Value::Undefined("no first item") : items.front();
  }
  if (name == "last") {
    if (v.is_list())
      return SeqSize(v) ? SeqAt(v, SeqSize(v) - 1) : Value::Undefined("no last item");
    std::vector<Value> items = in.Iterate(v, line);
    return items.empty() ? Value::Undefined("no last item") : items.back();
  }
  if (name == "reverse") {
    std::vector<Value> items = in.Iterate(v, line);
    std::reverse(items.begin(), items.end());
    if (v.kind == Kind::kString) {
      std::string out;
      out.reserve(v.str.size());
      for (const Value& c : items) out.append(c.str);
      return Value::String(std::move(out));
    }
    return ListOf(std::move(items));
  }
  if (name == "items") {
    if (v.is_undefined()) return ListOf({});
    if (!v.is_dict()) Fail(line, "can only get item pairs from a mapping");
    std::vector<Value> pairs;
    for (size_t k = 0; k < DictSize(v); ++k) {
      pairs.push_back(Value::List({DictKeyAt(v, k), DictValueAt(v, k)}, true));
    }
    return ListOf(std::move(pairs));
  }
  if (name == "dictsort") return DictSortFilter(in, v, args, line);
  if (name == "map") return MapFilter(in, v, args, line);
  if (name == "select") return SelectFilter(in, v, args, false, true, line);
  if (name == "reject") return SelectFilter(in, v, args, false, false, line);
  if (name == "selectattr") return SelectFilter(in, v, args, true, true, line);
  if (name == "rejectattr") return SelectFilter(in, v, args, true, false, line);
  if (name == "sort") return SortFilter(in, v, args, line);
  if (name == "unique") {
    const bool case_sensitive = BoolArg(args, 0, "case_sensitive", false);
    const std::string_view attr = AttributeArg(args, 1, line);
    std::vector<Value> out, seen;
    for (const Value& item : in.Iterate(v, line)) {
      Value key = SortKey(attr.empty() ? item : AttrPath(in, item, attr, line), case_sensitive);
      bool dup = false;
      for (const Value& s : seen) dup = dup || Equal(s, key);
      if (!dup) {
        seen.push_back(std::move(key));
        out.push_back(item);
      }
    }
    return ListOf(std::move(out));
  }
  if (name == "int") return ToInt(v, args, line);
  if (name == "float") return ToFloat(v, args, line);
  if (name == "abs") {
    if (v.kind == Kind::kInt) {
      if (v.i == INT64_MIN) Fail(line, "integer overflow in abs");
      return Value::Int(v.i < 0 ? -v.i : v.i);
    }
    if (v.kind == Kind::kBool) return Value::Int(v.b);
    if (v.kind == Kind::kFloat) return Value::Float(std::fabs(v.f));
    if (v.is_undefined()) Interpreter::FailUndefined(v, line);
    Fail(line, "bad operand type for abs(): '" + std::string(TypeName(v)) + "'");
  }
  if (name == "round") {
    const Value* p = args.Get(0, "precision");
    const int64_t precision = p && IsIntLike(*p) ? (p->kind == Kind::kInt ? p->i : p->b) : 0;
    const Value* m = args.Get(1, "method");
    const std::string method = m ? ToStr(*m) : "common";
    if (method != "common" && method != "ceil" && method != "floor") {
      Fail(line, "method must be common, ceil or floor");
    }
    if (v.is_undefined()) Interpreter::FailUndefined(v, line);
    if (!v.is_number())
      Fail(line, "type " + std::string(TypeName(v)) + " doesn't define __round__ method");
    if (method == "common") {
      if (IsIntLike(v) && precision >= 0) return Value::Int(v.kind == Kind::kInt ? v.i : v.b);
      return Value::Float(PyRound(AsDouble(v), precision));
    }
    const double scale = std::pow(10.0, static_cast<double>(precision));
    const double x = AsDouble(v) * scale;
    return Value::Float((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
  }
  if (name == "indent") {
    const Value* w = args.Get(0, "width");
    std::string indention(4, ' ');
    if (w && w->kind == Kind::kString) {
      indention = std::string(w->str);
    } else if (w && IsIntLike(*w)) {
      indention.assign(
          static_cast<size_t>(std::clamp<int64_t>(w->kind == Kind::kInt ? w->i : w->b, 0, 1024)),
          ' ');
    }
    std::string r = Indent(ToStr(v), indention, BoolArg(args, 1, "first", false),
                           BoolArg(args, 2, "blank", false));
    in.CheckStringSize(r.size(), line);
    return Value::String(std::move(r));
  }
  if (name == "wordcount") {
    const std::string s = ToStr(v);
    int64_t n = 0;
    bool in_word = false;
    for (unsigned char c : s) {
      const bool word = std::isalnum(c) || c == '_' || c >= 0x80;
      if (word && !in_word) ++n;
      in_word = word;
    }
    return Value::Int(n);
  }
  if (name == "batch") {
    const Value* count = args.Get(0, "linecount");
    if (!count || count->kind != Kind::kInt || count->i <= 0)
      Fail(line, "batch needs a positive count");
    const Value* fill = args.Get(1, "fill_with");
    std::vector<Value> out, tmp;
    for (const Value& item : in.Iterate(v, line)) {
      tmp.push_back(item);
      if (static_cast<int64_t>(tmp.size()) == count->i) {
        out.push_back(ListOf(std::move(tmp)));
        tmp.clear();
      }
    }
    if (!tmp.empty()) {
      if (fill && fill->kind != Kind::kNone) {
        while (static_cast<int64_t>(tmp.size()) < count->i) tmp.push_back(*fill);
      }
      out.push_back(ListOf(std::move(tmp)));
    }
    return ListOf(std::move(out));
  }
  if (name == "min") return MinMax(in, v, args, false, line);
  if (name == "max") return MinMax(in, v, args, true, line);
  if (name == "sum") {
    const std::string_view attr = AttributeArg(args, 0, line);
    const Value* start = args.Get(1, "start");
    Value total = start ? *start : Value::Int(0);
    for (const Value& item : in.Iterate(v, line)) {
      const Value x = attr.empty() ? item : AttrPath(in, item, attr, line);
      if (!x.is_number() || !total.is_number()) Fail(line, "sum of non-numbers is not supported");
      if (IsIntLike(x) && IsIntLike(total)) {
        int64_t r;
        if (__builtin_add_overflow(total.kind == Kind::kInt ? total.i : total.b,
                                   x.kind == Kind::kInt ? x.i : x.b, &r)) {
          Fail(line, "integer overflow in sum");
        }
        total = Value::Int(r);
      } else {
        total = Value::Float(AsDouble(total) + AsDouble(x));
      }
    }
    return total;
  }
  if (name == "attr") {
    const Value* a = args.Get(0, "name");
    if (!a || a->kind != Kind::kString) Fail(line, "attr needs a name");
    return in.GetAttr(v, a->str, line);
  }
  if (name == "center") {
    const Value* w = args.Get(0, "width");
    const int64_t width = w && w->kind == Kind::kInt ? w->i : 80;
    const std::string s = ToStr(v);
    const int64_t n = static_cast<int64_t>(CodePointCount(s));
    if (width <= n) return Value::String(s);
    const int64_t pad = std::min<int64_t>(width - n, 1 << 20);
    // Python's str.center puts the extra space on the right when the string length is even.
    const int64_t left = pad / 2 + (pad & width & 1);
    return Value::String(std::string(static_cast<size_t>(left), ' ') + s +
                         std::string(static_cast<size_t>(pad - left), ' '));
  }
  Fail(line, "filter '" + Excerpt(name) + "' is not supported");
}

bool CallTest(Interpreter& in, std::string_view name, const Value& v, CallArgs& args, int line) {
  auto arg = [&](std::string_view what) -> const Value& {
    if (args.pos.empty()) Fail(line, "test '" + std::string(name) + "' needs " + std::string(what));
    return args.pos[0];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.kind == Kind::kNone;
  if (name == "boolean") return v.kind == Kind::kBool;
  if (name == "true") return v.kind == Kind::kBool && v.b;
  if (name == "false") return v.kind == Kind::kBool && !v.b;
  if (name == "integer") return v.kind == Kind::kInt;
  if (name == "float") return v.kind == Kind::kFloat;
  if (name == "number") return v.is_number();
  if (name == "string") return v.kind == Kind::kString;
  if (name == "mapping") return v.is_dict();
  if (name == "iterable" || name == "sequence") {
    return v.is_undefined() || v.kind == Kind::kString || v.is_list() || v.is_dict();
  }
  if (name == "callable") return v.kind == Kind::kCallable || v.is_undefined();
  if (name == "escaped") return false;
  if (name == "lower" || name == "upper") {
    const std::string s = ToStr(v);
    const std::string lower = PyLower(s), upper = PyUpper(s);
    return lower != upper && (name == "lower" ? s == lower : s == upper);
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    if (v.is_undefined()) Interpreter::FailUndefined(v, line);
    int64_t d = 2;
    if (name == "divisibleby") {
      const Value& n = arg("a divisor");
      if (!IsIntLike(n)) Fail(line, "divisibleby needs an integer");
      d = n.kind == Kind::kInt ? n.i : n.b;
      if (d == 0) Fail(line, "integer division or modulo by zero");
    }
    if (!v.is_number())
      Fail(line, "unsupported operand type(s) for %: '" + std::string(TypeName(v)) + "' and 'int'");
    if (v.kind == Kind::kFloat) {
      double m = std::fmod(v.f, static_cast<double>(d));
      if (m != 0 && ((m < 0) != (d < 0))) m += static_cast<double>(d);
      return name == "odd" ? m == 1 : m == 0;
    }
    const int64_t x = v.kind == Kind::kInt ? v.i : v.b;
    int64_t m = d == -1 ? 0 : x % d;
    if (m != 0 && ((m < 0) != (d < 0))) m += d;
    return name == "odd" ? m == 1 : m == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return Equal(v, arg("a value"));
  if (name == "ne" || name == "!=") return !Equal(v, arg("a value"));
  if (name == "lt" || name == "lessthan" || name == "<")
    return Compare(v, arg("a value"), line) < 0;
  if (name == "le" || name == "<=") return Compare(v, arg("a value"), line) <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">")
    return Compare(v, arg("a value"), line) > 0;
  if (name == "ge" || name == ">=") return Compare(v, arg("a value"), line) >= 0;
  if (name == "sameas") {
    const Value& o = arg("a value");
    if (v.kind != o.kind) return false;
    switch (v.kind) {
      case Kind::kNone:
      case Kind::kUndefined:
        return true;
      case Kind::kBool:
        return v.b == o.b;
      case Kind::kInt:
        return v.i == o.i && v.i >= -5 && v.i <= 256;
      default:
        return v.owner && v.owner == o.owner;
    }
  }
  if (name == "in") {
    const Value& seq = arg("a container");
    if (seq.kind == Kind::kString) {
      if (v.kind != Kind::kString) Fail(line, "'in <string>' requires string as left operand");
      return seq.str.find(v.str) != std::string_view::npos;
    }
    if (seq.is_dict()) {
      Value ignored;
      return DictFind(seq, v, &ignored);
    }
    for (const Value& item : in.Iterate(seq, line)) {
      if (Equal(item, v)) return true;
    }
    return false;
  }
  if (name == "filter" || name == "test") {
    static constexpr std::string_view kFilters[] = {
        "tojson",    "trim",     "length", "count",       "default", "d",          "string",
        "safe",      "escape",   "e",      "forceescape", "upper",   "lower",      "capitalize",
        "title",     "replace",  "join",   "list",        "first",   "last",       "reverse",
        "items",     "dictsort", "map",    "select",      "reject",  "selectattr", "rejectattr",
        "sort",      "unique",   "int",    "float",       "abs",     "round",      "indent",
        "wordcount", "batch",    "min",    "max",         "sum",     "attr",       "center"};
    static constexpr std::string_view kTests[] = {
        "defined", "undefined", "none",   "boolean",     "true",     "false",       "integer",
        "float",   "number",    "string", "mapping",     "iterable", "sequence",    "callable",
        "escaped", "lower",     "upper",  "odd",         "even",     "divisibleby", "eq",
        "equalto", "==",        "ne",     "!=",          "lt",       "lessthan",    "<",
        "le",      "<=",        "gt",     "greaterthan", ">",        "ge",          ">=",
        "sameas",  "in",        "filter", "test"};
    if (v.kind != Kind::kString) return false;
    if (name == "filter")
      return std::find(std::begin(kFilters), std::end(kFilters), v.str) != std::end(kFilters);
    return std::find(std::begin(kTests), std::end(kTests), v.str) != std::end(kTests);
  }
  Fail(line, "test '" + Excerpt(name) + "' is not supported");
}

}  // namespace strata::data::jinja
