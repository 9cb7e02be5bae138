// The interpreter's expressions (jinja_interpreter.h): operators with Python's semantics,
// comparisons, slices, calls of globals, macros, filters and tests, attributes and items.
#include <cmath>
#include <string>

#include "base/untrusted_text.h"
#include "data/jinja_builtins.h"
#include "data/jinja_error.h"
#include "data/jinja_interpreter.h"

namespace strata::data::jinja {
namespace {

double AsDouble(const Value& v) {
  return v.kind == Kind::kFloat ? v.f : v.kind == Kind::kInt ? static_cast<double>(v.i) : v.b;
}
int64_t AsInt(const Value& v) { return v.kind == Kind::kInt ? v.i : v.b; }
bool IsIntLike(const Value& v) { return v.kind == Kind::kInt || v.kind == Kind::kBool; }

[[noreturn]] void FailOperands(std::string_view op, const Value& a, const Value& b, int line) {
  Fail(line, "unsupported operand type(s) for " + std::string(op) + ": '" +
                 std::string(TypeName(a)) + "' and '" + std::string(TypeName(b)) + "'");
}

[[noreturn]] void FailOverflow(int line) {
  Fail(line,
       "integer result out of the 64-bit range (Python ints are unbounded; this engine's "
       "are not)");
}

// Python's slice index adjustment for a sequence of `len` elements.
std::vector<size_t> SliceIndices(const Value* start, const Value* stop, const Value* step,
                                 size_t len, int line) {
  auto as_index = [&](const Value* v, bool* given) -> int64_t {
    *given = v != nullptr && v->kind != Kind::kNone;
    if (!*given) return 0;
    if (!IsIntLike(*v)) {
      Fail(line, "slice indices must be integers or None, not " + std::string(TypeName(*v)));
    }
    return AsInt(*v);
  };
  bool has_start, has_stop, has_step;
  int64_t b = as_index(start, &has_start), e = as_index(stop, &has_stop);
  int64_t s = as_index(step, &has_step);
  if (!has_step) s = 1;
  if (s == 0) Fail(line, "slice step cannot be zero");
  const int64_t n = static_cast<int64_t>(len);
  const int64_t lower = s > 0 ? 0 : -1, upper = s > 0 ? n : n - 1;
  auto adjust = [&](int64_t v, bool given, int64_t fallback) {
    if (!given) return fallback;
    if (v < 0) {
      v += n;
      if (v < lower) v = lower;
    } else if (v > upper) {
      v = upper;
    }
    return v;
  };
  b = adjust(b, has_start, s > 0 ? lower : upper);
  e = adjust(e, has_stop, s > 0 ? upper : lower);
  std::vector<size_t> out;
  for (int64_t k = b; s > 0 ? k < e : k > e; k += s) out.push_back(static_cast<size_t>(k));
  return out;
}

// `format % args` for the conversions templates use (%s, %r, %d, %i, %%); others are refused.
Value FormatPercent(std::string_view format, const Value& args, int line) {
  std::vector<Value> items;
  if (args.kind == Kind::kList && args.tuple) {
    items = args.list().items;
  } else {
    items.push_back(args);
  }
  std::string out;
  size_t next = 0;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      out += format[i];
      continue;
    }
    if (++i >= format.size()) Fail(line, "incomplete format");
    const char c = format[i];
    if (c == '%') {
      out += '%';
      continue;
    }
    if (c != 's' && c != 'r' && c != 'd' && c != 'i') {
      Fail(line, "'" + Excerpt(format.substr(i - 1, 2)) + "' string formatting is not supported");
    }
    if (next >= items.size()) Fail(line, "not enough arguments for format string");
    const Value& v = items[next++];
    if (c == 's') {
      AppendStr(out, v);
    } else if (c == 'r') {
      AppendRepr(out, v);
    } else if (IsIntLike(v)) {
      out += std::to_string(AsInt(v));
    } else if (v.kind == Kind::kFloat && std::isfinite(v.f)) {
      out += std::to_string(static_cast<int64_t>(v.f));
    } else {
      Fail(line, "%d format: a real number is required, not " + std::string(TypeName(v)));
    }
  }
  if (next < items.size()) Fail(line, "not all arguments converted during string formatting");
  return Value::String(std::move(out));
}

}  // namespace

Value Interpreter::Eval(const Expr& e) {
  switch (e.kind) {
    case ExprKind::kConst:
      return e.value;
    case ExprKind::kName:
      return Lookup(e.name, e.line);
    case ExprKind::kList:
    case ExprKind::kTuple: {
      std::vector<Value> items;
      items.reserve(e.args.size());
      for (const auto& a : e.args) items.push_back(Eval(*a));
      return Value::List(std::move(items), e.kind == ExprKind::kTuple);
    }
    case ExprKind::kDict: {
      std::vector<std::pair<Value, Value>> items;
      for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
        Value key = Eval(*e.args[k]);
        Value val = Eval(*e.args[k + 1]);
        if (key.is_list() && !(key.kind == Kind::kList && key.tuple)) {
          Fail(e.line, "unhashable type: 'list'");
        }
        if (key.is_dict()) Fail(e.line, "unhashable type: 'dict'");
        bool replaced = false;
        for (auto& [k2, v2] : items) {
          if (Equal(k2, key)) {
            v2 = val;
            replaced = true;
            break;
          }
        }
        if (!replaced) items.emplace_back(std::move(key), std::move(val));
      }
      return Value::Dict(std::move(items));
    }
    case ExprKind::kAttr:
      return GetAttr(Eval(*e.args[0]), e.name, e.line);
    case ExprKind::kItem:
      return GetItem(Eval(*e.args[0]), Eval(*e.args[1]), e.line);
    case ExprKind::kSlice:
      return EvalSlice(e);
    case ExprKind::kCall:
      return EvalCall(e);
    case ExprKind::kFilter:
      return ApplyFilter(e, Eval(*e.args[0]));
    case ExprKind::kTest: {
      const Value input = Eval(*e.args[0]);
      CallArgs args;
      EvalArgs(e, 1, &args);
      return Value::Bool(ApplyTestByName(e.name, input, args, e.line) != e.negated);
    }
    case ExprKind::kNeg:
    case ExprKind::kPos: {
      const Value v = Eval(*e.args[0]);
      if (v.kind == Kind::kUndefined) FailUndefined(v, e.line);
      const bool neg = e.kind == ExprKind::kNeg;
      if (v.kind == Kind::kFloat) return Value::Float(neg ? -v.f : v.f);
      if (IsIntLike(v)) {
        if (neg && AsInt(v) == INT64_MIN) FailOverflow(e.line);
        return Value::Int(neg ? -AsInt(v) : AsInt(v));
      }
      Fail(e.line, std::string("bad operand type for unary ") + (neg ? "-" : "+") + ": '" +
                       std::string(TypeName(v)) + "'");
    }
    case ExprKind::kNot:
      return Value::Bool(!Truthy(Eval(*e.args[0])));
    case ExprKind::kBinary:
      return EvalBinary(e);
    case ExprKind::kConcat: {
      const Value a = Eval(*e.args[0]);
      const Value b = Eval(*e.args[1]);
      std::string s;
      AppendStr(s, a);
      AppendStr(s, b);
      CheckStringSize(s.size(), e.line);
      return Value::String(std::move(s));
    }
    case ExprKind::kCompare:
      return EvalCompare(e);
    case ExprKind::kAnd: {
      Value a = Eval(*e.args[0]);
      return Truthy(a) ? Eval(*e.args[1]) : a;
    }
    case ExprKind::kOr: {
      Value a = Eval(*e.args[0]);
      return Truthy(a) ? a : Eval(*e.args[1]);
    }
    case ExprKind::kCond:
      if (Truthy(Eval(*e.args[0]))) return Eval(*e.args[1]);
      if (e.args[2]) return Eval(*e.args[2]);
      return Value::Undefined("the inline if-expression's value");
  }
  return Value::Undefined();
}

Value Interpreter::EvalBinary(const Expr& e) {
  const Value a = Eval(*e.args[0]);
  const Value b = Eval(*e.args[1]);
  if (a.kind == Kind::kUndefined) FailUndefined(a, e.line);
  if (b.kind == Kind::kUndefined) FailUndefined(b, e.line);
  const int line = e.line;
  const bool numbers = a.is_number() && b.is_number();
  const bool ints = numbers && IsIntLike(a) && IsIntLike(b);
  int64_t r = 0;
  switch (e.op) {
    case BinOp::kAdd:
      if (ints) {
        if (__builtin_add_overflow(AsInt(a), AsInt(b), &r)) FailOverflow(line);
        return Value::Int(r);
      }
      if (numbers) return Value::Float(AsDouble(a) + AsDouble(b));
      if (a.kind == Kind::kString && b.kind == Kind::kString) {
        CheckStringSize(a.str.size() + b.str.size(), line);
        std::string s;
        s.reserve(a.str.size() + b.str.size());
        s.append(a.str).append(b.str);
        return Value::String(std::move(s));
      }
      if (a.is_list() && b.is_list()) {
        const bool ta = a.kind == Kind::kList && a.tuple, tb = b.kind == Kind::kList && b.tuple;
        if (ta == tb) {
          std::vector<Value> items = Iterate(a, line);
          std::vector<Value> more = Iterate(b, line);
          CheckStringSize((items.size() + more.size()) * sizeof(Value), line);
          items.insert(items.end(), more.begin(), more.end());
          return Value::List(std::move(items), ta);
        }
      }
      if (a.kind == Kind::kString) {
        Fail(line, "can only concatenate str (not \"" + std::string(TypeName(b)) + "\") to str");
      }
      FailOperands("+", a, b, line);
    case BinOp::kSub:
      if (ints) {
        if (__builtin_sub_overflow(AsInt(a), AsInt(b), &r)) FailOverflow(line);
        return Value::Int(r);
      }
      if (numbers) return Value::Float(AsDouble(a) - AsDouble(b));
      FailOperands("-", a, b, line);
    case BinOp::kMul: {
      if (ints) {
        if (__builtin_mul_overflow(AsInt(a), AsInt(b), &r)) FailOverflow(line);
        return Value::Int(r);
      }
      if (numbers) return Value::Float(AsDouble(a) * AsDouble(b));
      const Value* seq = IsIntLike(b) ? &a : IsIntLike(a) ? &b : nullptr;
      const Value* count = seq == &a ? &b : &a;
      if (seq && (seq->kind == Kind::kString || seq->is_list())) {
        const int64_t times = std::max<int64_t>(0, AsInt(*count));
        if (seq->kind == Kind::kString) {
          if (times > 0) CheckStringSize(seq->str.size() * static_cast<size_t>(times), line);
          if (times > 0 &&
              seq->str.size() > limits_.max_output_bytes / static_cast<size_t>(times)) {
            CheckStringSize(limits_.max_output_bytes + 1, line);
          }
          std::string s;
          for (int64_t k = 0; k < times; ++k) s.append(seq->str);
          return Value::String(std::move(s));
        }
        std::vector<Value> once = Iterate(*seq, line);
        if (times > 0 && !once.empty() &&
            once.size() > limits_.max_output_bytes / sizeof(Value) / static_cast<size_t>(times)) {
          CheckStringSize(limits_.max_output_bytes + 1, line);
        }
        std::vector<Value> items;
        for (int64_t k = 0; k < times; ++k) items.insert(items.end(), once.begin(), once.end());
        return Value::List(std::move(items), seq->kind == Kind::kList && seq->tuple);
      }
      FailOperands("*", a, b, line);
    }
    case BinOp::kDiv:
      if (!numbers) FailOperands("/", a, b, line);
      if (AsDouble(b) == 0) Fail(line, "division by zero");
      return Value::Float(AsDouble(a) / AsDouble(b));
    case BinOp::kFloorDiv:
      if (!numbers) FailOperands("//", a, b, line);
      if (AsDouble(b) == 0) Fail(line, "integer division or modulo by zero");
      if (ints) {
        const int64_t x = AsInt(a), y = AsInt(b);
        if (x == INT64_MIN && y == -1) FailOverflow(line);
        int64_t q = x / y;
        if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
        return Value::Int(q);
      }
      return Value::Float(std::floor(AsDouble(a) / AsDouble(b)));
    case BinOp::kMod:
      if (a.kind == Kind::kString) return FormatPercent(a.str, b, line);
      if (!numbers) FailOperands("%", a, b, line);
      if (AsDouble(b) == 0) Fail(line, "integer division or modulo by zero");
      if (ints) {
        const int64_t x = AsInt(a), y = AsInt(b);
        if (y == -1) return Value::Int(0);
        int64_t m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) m += y;
        return Value::Int(m);
      } else {
        const double y = AsDouble(b);
        double m = std::fmod(AsDouble(a), y);
        if (m != 0 && ((m < 0) != (y < 0))) m += y;
        if (m == 0) m = std::copysign(0.0, y);
        return Value::Float(m);
      }
    case BinOp::kPow:
      if (!numbers) FailOperands("** or pow()", a, b, line);
      if (ints && AsInt(b) >= 0) {
        int64_t base = AsInt(a), exp = AsInt(b), acc = 1;
        while (exp > 0) {
          if (exp & 1) {
            if (__builtin_mul_overflow(acc, base, &acc)) FailOverflow(line);
          }
          exp >>= 1;
          if (exp > 0 && __builtin_mul_overflow(base, base, &base)) FailOverflow(line);
        }
        return Value::Int(acc);
      }
      if (AsDouble(a) == 0 && AsDouble(b) < 0) {
        Fail(line, "0.0 cannot be raised to a negative power");
      }
      return Value::Float(std::pow(AsDouble(a), AsDouble(b)));
  }
  return Value::Undefined();
}

Value Interpreter::EvalCompare(const Expr& e) {
  Value left = Eval(*e.args[0]);
  for (size_t k = 0; k < e.cmp_ops.size(); ++k) {
    Value right = Eval(*e.args[k + 1]);
    bool ok = false;
    const CmpOp op = e.cmp_ops[k];
    switch (op) {
      case CmpOp::kEq:
        ok = Equal(left, right);
        break;
      case CmpOp::kNe:
        ok = !Equal(left, right);
        break;
      case CmpOp::kLt:
      case CmpOp::kLe:
      case CmpOp::kGt:
      case CmpOp::kGe: {
        if (left.kind == Kind::kUndefined) FailUndefined(left, e.line);
        if (right.kind == Kind::kUndefined) FailUndefined(right, e.line);
        const int c = Compare(left, right, e.line);
        ok = op == CmpOp::kLt   ? c < 0
             : op == CmpOp::kLe ? c <= 0
             : op == CmpOp::kGt ? c > 0
                                : c >= 0;
        break;
      }
      case CmpOp::kIn:
      case CmpOp::kNotIn: {
        bool found = false;
        if (right.kind == Kind::kUndefined) {
          found = false;
        } else if (right.kind == Kind::kString) {
          if (left.kind != Kind::kString) {
            Fail(e.line, "'in <string>' requires string as left operand, not " +
                             std::string(TypeName(left)));
          }
          found = right.str.find(left.str) != std::string_view::npos;
        } else if (right.is_list()) {
          const size_t n = SeqSize(right);
          for (size_t i = 0; i < n && !found; ++i) found = Equal(SeqAt(right, i), left);
        } else if (right.is_dict()) {
          if ((left.is_list() && !(left.kind == Kind::kList && left.tuple)) || left.is_dict()) {
            Fail(e.line, "unhashable type: '" + std::string(TypeName(left)) + "'");
          }
          Value ignored;
          found = DictFind(right, left, &ignored);
        } else {
          Fail(e.line, "argument of type '" + std::string(TypeName(right)) + "' is not iterable");
        }
        ok = op == CmpOp::kIn ? found : !found;
        break;
      }
    }
    if (!ok) return Value::Bool(false);
    left = std::move(right);
  }
  return Value::Bool(true);
}

Value Interpreter::EvalSlice(const Expr& e) {
  const Value obj = Eval(*e.args[0]);
  Value parts[3];
  const Value* ptrs[3] = {nullptr, nullptr, nullptr};
  for (int k = 0; k < 3; ++k) {
    if (e.args[k + 1]) {
      parts[k] = Eval(*e.args[k + 1]);
      ptrs[k] = &parts[k];
    }
  }
  if (obj.kind == Kind::kUndefined) FailUndefined(obj, e.line);
  if (obj.kind == Kind::kString) {
    const std::vector<size_t> offsets = CodePointOffsets(obj.str);
    const std::vector<size_t> idx =
        SliceIndices(ptrs[0], ptrs[1], ptrs[2], offsets.size() - 1, e.line);
    std::string s;
    s.reserve(obj.str.size());
    for (size_t i : idx) s.append(obj.str.substr(offsets[i], offsets[i + 1] - offsets[i]));
    return Value::String(std::move(s));
  }
  if (obj.is_list()) {
    const std::vector<size_t> idx = SliceIndices(ptrs[0], ptrs[1], ptrs[2], SeqSize(obj), e.line);
    std::vector<Value> items;
    items.reserve(idx.size());
    for (size_t i : idx) items.push_back(SeqAt(obj, i));
    return Value::List(std::move(items), obj.kind == Kind::kList && obj.tuple);
  }
  Fail(e.line, "'" + std::string(TypeName(obj)) + "' object is not subscriptable");
}

void Interpreter::EvalArgs(const Expr& e, size_t first, CallArgs* args) {
  args->pos.reserve(e.args.size() - first);
  for (size_t k = first; k < e.args.size(); ++k) args->pos.push_back(Eval(*e.args[k]));
  for (const auto& [name, expr] : e.kwargs) args->kw.emplace_back(name, Eval(*expr));
}

Value Interpreter::EvalCall(const Expr& e) {
  const Expr& callee = *e.args[0];
  CallArgs args;
  if (callee.kind == ExprKind::kAttr) {
    // obj.method(...) without building a bound method.
    Value obj = Eval(*callee.args[0]);
    if (IsMethod(obj, callee.name)) {
      EvalArgs(e, 1, &args);
      return CallMethod(*this, obj, callee.name, args, e.line);
    }
    Value fn = GetAttr(obj, callee.name, e.line);
    EvalArgs(e, 1, &args);
    return CallValue(fn, args, e.line);
  }
  Value fn = Eval(callee);
  EvalArgs(e, 1, &args);
  return CallValue(fn, args, e.line);
}

Value Interpreter::CallValue(const Value& fn, CallArgs& args, int line) {
  if (fn.kind == Kind::kUndefined) FailUndefined(fn, line);
  if (fn.kind != Kind::kCallable) {
    Fail(line, "'" + std::string(TypeName(fn)) + "' object is not callable");
  }
  const Callable& c = fn.callable();
  switch (c.type) {
    case Callable::Type::kMacro:
      return CallMacro(c, args, line);
    case Callable::Type::kMethod:
      return CallMethod(*this, c.self, c.name, args, line);
    case Callable::Type::kGlobal:
      return CallGlobal(*this, c.name, args, line);
    case Callable::Type::kLoopCycle: {
      if (args.pos.empty()) Fail(line, "no items for cycling given");
      return args.pos[c.self.loop().index0 % args.pos.size()];
    }
    case Callable::Type::kLoopChanged: {
      LoopData& loop = c.self.loop();
      Value now = Value::List(args.pos, true);
      const bool changed = !loop.has_changed || !Equal(now, loop.last_changed);
      loop.has_changed = true;
      loop.last_changed = std::move(now);
      return Value::Bool(changed);
    }
  }
  return Value::Undefined();
}

Value Interpreter::CallMacro(const Callable& c, CallArgs& args, int line) {
  const Stmt& m = *c.macro;
  if (call_depth_ >= limits_.max_call_depth) {
    FailExhausted(line, "macro calls nested deeper than " + std::to_string(limits_.max_call_depth) +
                            " (recursion?)");
  }
  if (args.pos.size() > m.params.size()) {
    Fail(line, "macro '" + m.text + "' takes not more than " + std::to_string(m.params.size()) +
                   " argument(s)");
  }
  for (const auto& [k, v] : args.kw) {
    bool known = false;
    for (const auto& p : m.params) known |= p == k;
    if (!known) Fail(line, "macro '" + m.text + "' takes no keyword argument '" + Excerpt(k) + "'");
  }
  ++call_depth_;
  const size_t saved_base = macro_base_;
  PushFrame();
  macro_base_ = frames_.size() - 1;
  struct Restore {
    Interpreter* self;
    size_t base;
    ~Restore() {
      self->PopFrame();
      self->macro_base_ = base;
      --self->call_depth_;
    }
  } restore{this, saved_base};
  for (const auto& [name, value] : c.closure) Assign(name, value);
  for (size_t k = 0; k < m.params.size(); ++k) {
    const Value* given = args.Get(k, m.params[k]);
    if (given) {
      Assign(m.params[k], *given);
    } else if (m.defaults[k]) {
      Assign(m.params[k], Eval(*m.defaults[k]));
    } else {
      Assign(m.params[k], Value::Undefined(m.params[k]));
    }
  }
  return Value::String(Capture(m.body));
}

Value Interpreter::ApplyFilter(const Expr& f, const Value& input) {
  CallArgs args;
  EvalArgs(f, 1, &args);
  return ApplyFilterByName(f.name, input, args, f.line);
}

Value Interpreter::ApplyFilterByName(std::string_view name, const Value& input, CallArgs& args,
                                     int line) {
  return CallFilter(*this, name, input, args, line);
}

bool Interpreter::ApplyTestByName(std::string_view name, const Value& input, CallArgs& args,
                                  int line) {
  return CallTest(*this, name, input, args, line);
}

// ---- attribute and item access ----

Value Interpreter::GetAttr(const Value& obj, std::string_view name, int line) {
  switch (obj.kind) {
    case Kind::kUndefined:
      FailUndefined(obj, line);
    case Kind::kNamespace: {
      if (Value* v = obj.ns().Find(name)) return *v;
      return Value::Undefined(name);
    }
    case Kind::kLoop: {
      const LoopData& l = obj.loop();
      const size_t n = l.items.size(), i = l.index0;
      if (name == "index") return Value::Int(static_cast<int64_t>(i + 1));
      if (name == "index0") return Value::Int(static_cast<int64_t>(i));
      if (name == "revindex") return Value::Int(static_cast<int64_t>(n - i));
      if (name == "revindex0") return Value::Int(static_cast<int64_t>(n - i - 1));
      if (name == "first") return Value::Bool(i == 0);
      if (name == "last") return Value::Bool(i + 1 == n);
      if (name == "length") return Value::Int(static_cast<int64_t>(n));
      if (name == "depth") return Value::Int(l.depth);
      if (name == "depth0") return Value::Int(l.depth - 1);
      if (name == "previtem")
        return i > 0 ? l.items[i - 1] : Value::Undefined("there is no previous item");
      if (name == "nextitem")
        return i + 1 < n ? l.items[i + 1] : Value::Undefined("there is no next item");
      if (name == "cycle" || name == "changed") {
        auto c = std::make_shared<Callable>();
        c->type = name == "cycle" ? Callable::Type::kLoopCycle : Callable::Type::kLoopChanged;
        c->self = obj;
        Value v;
        v.kind = Kind::kCallable;
        v.owner = std::move(c);
        return v;
      }
      return Value::Undefined(name);
    }
    default:
      break;
  }
  if (IsMethod(obj, name)) {
    auto c = std::make_shared<Callable>();
    c->type = Callable::Type::kMethod;
    c->self = obj;
    c->name = MethodName(name);
    Value v;
    v.kind = Kind::kCallable;
    v.owner = std::move(c);
    return v;
  }
  if (IsUnsafeMethod(obj, name)) {
    Value u = Value::UndefinedOwned("access to attribute '" + Excerpt(name) + "' of '" +
                                    std::string(TypeName(obj)) + "' object is unsafe.");
    u.tuple = true;
    return u;
  }
  if (obj.is_dict()) {
    Value out;
    if (DictFind(obj, Value::StringView(name), &out)) return out;
  }
  Value u = Value::UndefinedOwned("'" + std::string(TypeName(obj)) + " object' has no attribute '" +
                                  Excerpt(name) + "'");
  u.tuple = true;
  return u;
}

Value Interpreter::GetItem(const Value& obj, const Value& key, int line) {
  if (obj.kind == Kind::kUndefined) FailUndefined(obj, line);
  if (obj.is_dict()) {
    Value out;
    if (DictFind(obj, key, &out)) return out;
  } else if ((obj.is_list() || obj.kind == Kind::kString) && IsIntLike(key)) {
    if (obj.kind == Kind::kString) {
      const std::vector<size_t> offsets = CodePointOffsets(obj.str);
      int64_t i = AsInt(key);
      const int64_t n = static_cast<int64_t>(offsets.size()) - 1;
      if (i < 0) i += n;
      if (i >= 0 && i < n) {
        const auto k = static_cast<size_t>(i);
        return Value::String(std::string(obj.str.substr(offsets[k], offsets[k + 1] - offsets[k])));
      }
    } else {
      int64_t i = AsInt(key);
      const int64_t n = static_cast<int64_t>(SeqSize(obj));
      if (i < 0) i += n;
      if (i >= 0 && i < n) return SeqAt(obj, static_cast<size_t>(i));
    }
    Value u = Value::UndefinedOwned(std::string(TypeName(obj)) + " index out of range");
    u.tuple = true;
    return u;
  }
  if (key.kind == Kind::kString && !obj.is_dict()) return GetAttr(obj, key.str, line);
  if (key.kind == Kind::kString && IsMethod(obj, key.str)) return GetAttr(obj, key.str, line);
  std::string hint = "'" + std::string(TypeName(obj)) + " object' has no attribute ";
  AppendRepr(hint, key);
  Value u = Value::UndefinedOwned(Excerpt(hint, 200));
  u.tuple = true;
  return u;
}

}  // namespace strata::data::jinja
