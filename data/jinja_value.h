// The values a Jinja template computes with, modelled on the Python objects jinja2 hands a
// template: Undefined, None, bool, int, float, str, list, tuple, dict, callables (macros,
// globals, bound methods), namespace() objects and the `loop` object.
//
// Ownership: a Value is cheap to copy. Strings are a view plus an optional shared owner: views
// point into the template's AST or into the render context (both outlive the render); computed
// strings own their bytes. Lists, dicts and namespaces are shared (Python's reference semantics);
// arrays and objects of the render context are not copied but referenced (kJson). Lists and
// dicts are never mutated after construction (the sandbox is immutable); namespaces are.
//
// Thread-safety: values are confined to one render (one thread).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::data::jinja {

using Json = nlohmann::ordered_json;

enum class Kind : uint8_t {
  kUndefined,
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kList,  // also a tuple (Value::tuple) and a range() result
  kDict,
  kJson,  // an array or object of the render context
  kCallable,
  kNamespace,
  kLoop,
};

struct Value;
struct ListData;
struct DictData;
struct Callable;
struct NamespaceData;
struct LoopData;

// The deepest nesting of lists and dicts a template may build (printing and comparing recurse).
inline constexpr int kMaxValueDepth = 256;

struct Value {
  Kind kind = Kind::kUndefined;
  bool tuple = false;  // kList printed and typed as a tuple
  union {
    bool b;
    int64_t i;
    double f;
    const Json* json;
  };
  // kString: the text. kUndefined: the hint for the error raised when it is used ("'x' is
  // undefined"), a view into the AST or an owned string.
  std::string_view str;
  std::shared_ptr<const void> owner;  // keeps str's bytes, or the list/dict/callable, alive

  Value() : i(0) {}
  static Value Undefined(std::string_view hint = {}) {
    Value v;
    v.str = hint;
    return v;
  }
  static Value UndefinedOwned(std::string hint);
  static Value None() { return Make(Kind::kNone); }
  static Value Bool(bool b) {
    Value v = Make(Kind::kBool);
    v.b = b;
    return v;
  }
  static Value Int(int64_t i) {
    Value v = Make(Kind::kInt);
    v.i = i;
    return v;
  }
  static Value Float(double f) {
    Value v = Make(Kind::kFloat);
    v.f = f;
    return v;
  }
  // A view whose bytes outlive the render (AST, context).
  static Value StringView(std::string_view s) {
    Value v = Make(Kind::kString);
    v.str = s;
    return v;
  }
  static Value String(std::string s);
  static Value List(std::vector<Value> items, bool tuple = false);
  static Value Dict(std::vector<std::pair<Value, Value>> items);
  // A context value: scalars become values (strings as views), arrays and objects kJson.
  static Value FromJson(const Json& j);

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_number() const {
    return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool;
  }
  bool is_list() const { return kind == Kind::kList || (kind == Kind::kJson && json->is_array()); }
  bool is_dict() const { return kind == Kind::kDict || (kind == Kind::kJson && json->is_object()); }

  const ListData& list() const { return *static_cast<const ListData*>(owner.get()); }
  const DictData& dict() const { return *static_cast<const DictData*>(owner.get()); }
  const Callable& callable() const { return *static_cast<const Callable*>(owner.get()); }
  NamespaceData& ns() const { return *static_cast<NamespaceData*>(const_cast<void*>(owner.get())); }
  LoopData& loop() const { return *static_cast<LoopData*>(const_cast<void*>(owner.get())); }

 private:
  static Value Make(Kind k) {
    Value v;
    v.kind = k;
    return v;
  }
};

struct ListData {
  std::vector<Value> items;
  int depth = 1;
};
struct DictData {
  std::vector<std::pair<Value, Value>> items;  // insertion order, keys unique
  int depth = 1;
};
struct NamespaceData {
  std::vector<std::pair<std::string, Value>> attrs;
  Value* Find(std::string_view name) {
    for (auto& [k, v] : attrs) {
      if (k == name) return &v;
    }
    return nullptr;
  }
};

// Sequence and mapping access over both owned values and context JSON.
size_t SeqSize(const Value& v);             // is_list()
Value SeqAt(const Value& v, size_t index);  // is_list(), index < SeqSize
size_t DictSize(const Value& v);            // is_dict()
Value DictKeyAt(const Value& v, size_t index);
Value DictValueAt(const Value& v, size_t index);
// The value under `key` (Python ==), or false.
bool DictFind(const Value& v, const Value& key, Value* out);

// Python semantics.
bool Truthy(const Value& v);
bool Equal(const Value& a, const Value& b);
// <0, 0, >0; throws JinjaError (line) when Python raises TypeError.
int Compare(const Value& a, const Value& b, int line);
// "str" | "int" | ... as Python's type(x).__name__ names it, for messages.
std::string_view TypeName(const Value& v);
// str(v) appended to out; repr(v) appended to out.
void AppendStr(std::string& out, const Value& v);
void AppendRepr(std::string& out, const Value& v);
std::string ToStr(const Value& v);
// json.dumps(v, ensure_ascii, indent, separators, sort_keys); throws JinjaError for values
// json cannot serialise. indent: nullptr for none.
struct JsonDumpOptions {
  bool ensure_ascii = false;
  const std::string* indent = nullptr;
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
void AppendJson(std::string& out, const Value& v, const JsonDumpOptions& options, int line);
// Python's repr of a float ("1.0", "1e+16", "0.30000000000000004", "inf", "nan").
void AppendFloatRepr(std::string& out, double f);

// UTF-8 helpers (code points, as Python's str counts them).
void AppendUtf8(std::string& out, uint32_t code_point);
size_t CodePointCount(std::string_view s);
// Byte offsets of each code point's start, plus s.size() at the end.
std::vector<size_t> CodePointOffsets(std::string_view s);

}  // namespace strata::data::jinja
