#include "data/jinja_interpreter.h"

#include <cmath>
#include <string>

#include "base/untrusted_text.h"
#include "data/jinja_builtins.h"
#include "data/jinja_error.h"

namespace strata::data::jinja {
namespace {

// Names of the interpreter's globals, as static strings a Callable can view.
constexpr std::string_view kGlobals[] = {"range", "namespace", "dict", "raise_exception",
                                         "strftime_now"};

}  // namespace

const Value* CallArgs::Get(size_t index, std::string_view name) const {
  if (index < pos.size()) return &pos[index];
  for (const auto& [k, v] : kw) {
    if (k == name) return &v;
  }
  return nullptr;
}

Interpreter::Interpreter(const Json& context, const RenderLimits& limits, std::string* out,
                         std::vector<std::pair<size_t, size_t>>* generation_spans)
    : context_(context), limits_(limits), out_(out), spans_(generation_spans) {}

void Interpreter::Run(const StmtList& body) {
  frames_.push_back(0);
  struct Cleanup {
    Interpreter* self;
    ~Cleanup() {
      // Namespaces may reference themselves; break the cycles before they are dropped.
      for (auto& ns : self->namespaces_) ns->attrs.clear();
    }
  } cleanup{this};
  Exec(body);
}

void Interpreter::FailUndefined(const Value& u, int line) {
  if (u.tuple) Fail(line, std::string(u.str));  // a full message (attribute / security errors)
  if (u.str.empty()) Fail(line, "undefined value used");
  Fail(line, "'" + Excerpt(u.str) + "' is undefined");
}

void Interpreter::CheckStringSize(size_t size_bytes, int line) const {
  if (size_bytes > limits_.max_output_bytes) {
    FailExhausted(line, "string of " + std::to_string(size_bytes) + " bytes exceeds the limit of " +
                            std::to_string(limits_.max_output_bytes) + " bytes");
  }
}

void Interpreter::Append(std::string_view text, int line) {
  out_->append(text);
  if (out_->size() > limits_.max_output_bytes) {
    FailExhausted(line, "rendered output exceeds the limit of " +
                            std::to_string(limits_.max_output_bytes) + " bytes");
  }
}

void Interpreter::Emit(const Value& v, int line) {
  if (v.kind == Kind::kString) {
    Append(v.str, line);
  } else if (v.kind != Kind::kUndefined) {
    AppendStr(*out_, v);
    Append({}, line);
  }
}

Interpreter::Flow Interpreter::Exec(const StmtList& body) {
  for (const auto& s : body) {
    const Flow f = ExecStmt(*s);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

std::string Interpreter::Capture(const StmtList& body, Flow* flow) {
  std::string buffer;
  std::string* saved = out_;
  out_ = &buffer;
  ++capture_depth_;
  struct Restore {
    Interpreter* self;
    std::string* saved;
    ~Restore() {
      self->out_ = saved;
      --self->capture_depth_;
    }
  } restore{this, saved};
  const Flow f = Exec(body);
  if (flow) *flow = f;
  return buffer;
}

Interpreter::Flow Interpreter::ExecStmt(const Stmt& s) {
  switch (s.kind) {
    case StmtKind::kText:
      Append(s.text, s.line);
      return Flow::kNormal;
    case StmtKind::kOutput:
      Emit(Eval(*s.expr), s.line);
      return Flow::kNormal;
    case StmtKind::kIf:
      return Exec(Truthy(Eval(*s.expr)) ? s.body : s.else_body);
    case StmtKind::kFor:
      ExecFor(s);
      return Flow::kNormal;
    case StmtKind::kSet:
      ExecSet(s);
      return Flow::kNormal;
    case StmtKind::kSetBlock: {
      Value v = Value::String(Capture(s.body));
      for (const auto& f : s.filters) v = ApplyFilter(*f, v);
      Assign(s.targets[0], std::move(v));
      return Flow::kNormal;
    }
    case StmtKind::kFilterBlock: {
      // Its body is a scope of its own: a `set` inside does not leak out (as jinja2).
      PushFrame();
      Value v = Value::String(Capture(s.body));
      PopFrame();
      for (const auto& f : s.filters) v = ApplyFilter(*f, v);
      Emit(v, s.line);
      return Flow::kNormal;
    }
    case StmtKind::kMacro: {
      auto c = std::make_shared<Callable>();
      c->type = Callable::Type::kMacro;
      c->macro = &s;
      c->name = s.text;
      if (frames_.size() > 1) {
        // Inside a for, a macro or a block: what it sees there beyond the top level.
        const size_t from = frames_[std::max<size_t>(macro_base_, 1)];
        c->closure.assign(vars_.begin() + static_cast<std::ptrdiff_t>(from), vars_.end());
      }
      Value v;
      v.kind = Kind::kCallable;
      v.owner = std::move(c);
      Assign(s.text, std::move(v));
      return Flow::kNormal;
    }
    case StmtKind::kBreak:
      return Flow::kBreak;
    case StmtKind::kContinue:
      return Flow::kContinue;
    case StmtKind::kGeneration: {
      const size_t start = out_->size();
      PushFrame();
      const Flow f = Exec(s.body);
      PopFrame();
      if (capture_depth_ == 0) spans_->emplace_back(start, out_->size());
      return f;
    }
  }
  return Flow::kNormal;
}

void Interpreter::ExecFor(const Stmt& s) {
  std::vector<Value> items = Iterate(Eval(*s.expr), s.line);
  PushFrame();
  const size_t base = vars_.size();
  auto bind = [&](const Value& item) {
    vars_.resize(base);
    if (!s.tuple_target) {
      vars_.emplace_back(s.targets[0], item);
      return;
    }
    if (!item.is_list() && item.kind != Kind::kString) {
      Fail(s.line, "cannot unpack non-iterable " + std::string(TypeName(item)) + " object");
    }
    std::vector<Value> parts = Iterate(item, s.line);
    if (parts.size() != s.targets.size()) {
      Fail(s.line, std::string(parts.size() < s.targets.size() ? "not enough" : "too many") +
                       " values to unpack (expected " + std::to_string(s.targets.size()) + ")");
    }
    for (size_t k = 0; k < parts.size(); ++k) Assign(s.targets[k], parts[k]);
  };
  if (s.cond) {
    std::vector<Value> kept;
    for (Value& item : items) {
      bind(item);
      if (Truthy(Eval(*s.cond))) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  auto loop = std::make_shared<LoopData>();
  loop->items = std::move(items);
  Value loop_value;
  loop_value.kind = Kind::kLoop;
  loop_value.owner = loop;
  const size_t n = loop->items.size();
  for (size_t k = 0; k < n; ++k) {
    if (++iterations_ > limits_.max_loop_iterations) {
      FailExhausted(s.line, "more than " + std::to_string(limits_.max_loop_iterations) +
                                " loop iterations in one render");
    }
    bind(loop->items[k]);
    vars_.emplace_back("loop", loop_value);
    loop->index0 = k;
    if (Exec(s.body) == Flow::kBreak) break;
  }
  PopFrame();
  if (n == 0) Exec(s.else_body);
}

void Interpreter::ExecSet(const Stmt& s) {
  Value v = Eval(*s.expr);
  if (!s.text.empty()) {
    Value target = Lookup(s.targets[0], s.line);
    if (target.kind != Kind::kNamespace) {
      Fail(s.line, "cannot assign attribute on non-namespace object");
    }
    NamespaceData& ns = target.ns();
    if (Value* slot = ns.Find(s.text)) {
      *slot = std::move(v);
    } else {
      ns.attrs.emplace_back(s.text, std::move(v));
    }
    return;
  }
  if (!s.tuple_target) {
    Assign(s.targets[0], std::move(v));
    return;
  }
  std::vector<Value> parts = Iterate(v, s.line);
  if (parts.size() != s.targets.size()) {
    Fail(s.line, "cannot unpack " + std::to_string(parts.size()) + " values into " +
                     std::to_string(s.targets.size()) + " names");
  }
  for (size_t k = 0; k < parts.size(); ++k) Assign(s.targets[k], parts[k]);
}

Value Interpreter::Lookup(std::string_view name, int line) {
  const size_t stop = frames_[macro_base_];
  for (size_t k = vars_.size(); k > stop; --k) {
    if (vars_[k - 1].first == name) return vars_[k - 1].second;
  }
  if (macro_base_ > 0) {
    const size_t top_end = frames_.size() > 1 ? frames_[1] : vars_.size();
    for (size_t k = top_end; k > 0; --k) {
      if (vars_[k - 1].first == name) return vars_[k - 1].second;
    }
  }
  if (context_.is_object()) {
    const auto& obj = context_.get_ref<const Json::object_t&>();
    for (const auto& [k, v] : obj) {
      if (k == name) return Value::FromJson(v);
    }
  }
  for (std::string_view g : kGlobals) {
    if (g == name) {
      auto c = std::make_shared<Callable>();
      c->type = Callable::Type::kGlobal;
      c->name = g;
      Value v;
      v.kind = Kind::kCallable;
      v.owner = std::move(c);
      return v;
    }
  }
  return Value::Undefined(name);
}

void Interpreter::Assign(std::string_view name, Value v) {
  for (size_t k = vars_.size(); k > frames_.back(); --k) {
    if (vars_[k - 1].first == name) {
      vars_[k - 1].second = std::move(v);
      return;
    }
  }
  vars_.emplace_back(name, std::move(v));
}

std::vector<Value> Interpreter::Iterate(const Value& v, int line) {
  std::vector<Value> out;
  switch (v.kind) {
    case Kind::kUndefined:
      return out;
    case Kind::kList:
      return v.list().items;
    case Kind::kDict:
      out.reserve(v.dict().items.size());
      for (const auto& [k, item] : v.dict().items) out.push_back(k);
      return out;
    case Kind::kJson: {
      const size_t n = v.json->size();
      out.reserve(n);
      if (v.json->is_array()) {
        for (const auto& item : *v.json) out.push_back(Value::FromJson(item));
      } else {
        for (size_t k = 0; k < n; ++k) out.push_back(DictKeyAt(v, k));
      }
      return out;
    }
    case Kind::kString: {
      const std::vector<size_t> offsets = CodePointOffsets(v.str);
      out.reserve(offsets.size());
      for (size_t k = 0; k + 1 < offsets.size(); ++k) {
        Value c = Value::StringView(v.str.substr(offsets[k], offsets[k + 1] - offsets[k]));
        c.owner = v.owner;
        out.push_back(std::move(c));
      }
      return out;
    }
    default:
      Fail(line, "'" + std::string(TypeName(v)) + "' object is not iterable");
  }
}

Value Interpreter::MakeNamespace(CallArgs& args, int line) {
  auto ns = std::make_shared<NamespaceData>();
  for (const Value& p : args.pos) {
    if (!p.is_dict()) Fail(line, "namespace() takes keyword arguments or a dict");
    for (size_t k = 0; k < DictSize(p); ++k) {
      ns->attrs.emplace_back(ToStr(DictKeyAt(p, k)), DictValueAt(p, k));
    }
  }
  for (const auto& [k, v] : args.kw) {
    if (Value* slot = ns->Find(k)) {
      *slot = v;
    } else {
      ns->attrs.emplace_back(std::string(k), v);
    }
  }
  namespaces_.push_back(ns);
  Value v;
  v.kind = Kind::kNamespace;
  v.owner = std::move(ns);
  return v;
}

// ---- expressions ----

}  // namespace strata::data::jinja
