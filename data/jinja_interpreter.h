// Walks a parsed template (jinja_ast.h) over a render context with jinja2's semantics as
// transformers configures it (ImmutableSandboxedEnvironment, default Undefined, loopcontrols,
// the `generation` tag, the raise_exception and strftime_now globals, its tojson filter).
// The filters, tests, Python methods and globals live in jinja_builtins.cc.
//
// Scoping follows jinja2: a for loop's body and a macro call each get a new scope (a `set` in
// them is not seen after them; each loop iteration starts afresh), `if` does not; a macro sees its
// arguments, its own sets and the template's top level, not its caller's variables; a
// namespace() is shared by reference.
//
// Limits (RenderLimits) turn runaway templates into kResourceExhausted errors: output bytes
// (also any single computed string), macro call depth, loop iterations over the whole render.
//
// Thread-safety: one Interpreter per render; the AST and context are only read.
#pragma once

#include <cstdint>
#include <ctime>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/jinja_ast.h"
#include "data/jinja_value.h"

namespace strata::data::jinja {

struct RenderLimits {
  size_t max_output_bytes = size_t{64} << 20;
  int max_call_depth = 100;
  int64_t max_loop_iterations = 10'000'000;
  std::time_t now = 0;  // strftime_now's time (seconds since the epoch, formatted as local time)
};

struct Callable {
  enum class Type : uint8_t { kMacro, kMethod, kGlobal, kLoopCycle, kLoopChanged };
  Type type = Type::kMacro;
  const Stmt* macro = nullptr;  // kMacro
  Value self;                   // kMethod: the object; kLoopCycle: the loop
  std::string_view name;        // kMethod / kGlobal: its name (a static string)
  // kMacro defined inside a for, a macro or a block: the variables it saw there (not the
  // template's top level, which every macro sees), as they were when it was defined. jinja2's
  // closures see a later `set` of them too; chat templates define a macro and call it in the
  // same iteration.
  std::vector<std::pair<std::string_view, Value>> closure;
};

struct LoopData {
  std::vector<Value> items;
  size_t index0 = 0;
  int depth = 1;
  Value last_changed;  // loop.changed()
  bool has_changed = false;
};

// Positional and keyword arguments of a call.
struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string_view, Value>> kw;
  // Argument `index` or keyword `name`, or `fallback`; marks it used.
  const Value* Get(size_t index, std::string_view name) const;
};

class Interpreter {
 public:
  Interpreter(const Json& context, const RenderLimits& limits, std::string* out,
              std::vector<std::pair<size_t, size_t>>* generation_spans);

  void Run(const StmtList& body);

  // Used by the builtins.
  Value GetAttr(const Value& obj, std::string_view name, int line);
  Value GetItem(const Value& obj, const Value& key, int line);
  Value CallValue(const Value& fn, CallArgs& args, int line);
  Value ApplyFilterByName(std::string_view name, const Value& input, CallArgs& args, int line);
  bool ApplyTestByName(std::string_view name, const Value& input, CallArgs& args, int line);
  // Iterates v as Python's iter(v) does (str: code points, dict: keys, Undefined: nothing).
  std::vector<Value> Iterate(const Value& v, int line);
  void CheckStringSize(size_t size_bytes, int line) const;
  // Raises the error an Undefined raises when used ("'x' is undefined").
  [[noreturn]] static void FailUndefined(const Value& undefined, int line);
  const RenderLimits& limits() const { return limits_; }
  Value MakeNamespace(CallArgs& args, int line);

 private:
  enum class Flow : uint8_t { kNormal, kBreak, kContinue };

  Flow Exec(const StmtList& body);
  Flow ExecStmt(const Stmt& s);
  void ExecFor(const Stmt& s);
  void ExecSet(const Stmt& s);
  void Emit(const Value& v, int line);
  void Append(std::string_view text, int line);
  // Renders body into a new string (macro bodies, block sets, filter blocks).
  std::string Capture(const StmtList& body, Flow* flow = nullptr);

  Value Eval(const Expr& e);
  Value EvalBinary(const Expr& e);
  Value EvalCompare(const Expr& e);
  Value EvalCall(const Expr& e);
  Value EvalSlice(const Expr& e);
  Value ApplyFilter(const Expr& f, const Value& input);
  void EvalArgs(const Expr& e, size_t first, CallArgs* args);
  Value CallMacro(const Callable& c, CallArgs& args, int line);

  // Scopes: one flat list of (name, value); frames_ holds each scope's start.
  Value Lookup(std::string_view name, int line);
  void Assign(std::string_view name, Value v);
  void PushFrame() { frames_.push_back(vars_.size()); }
  void PopFrame() {
    vars_.resize(frames_.back());
    frames_.pop_back();
  }

  const Json& context_;
  RenderLimits limits_;
  std::string* out_;
  std::vector<std::pair<size_t, size_t>>* spans_;
  int capture_depth_ = 0;
  int call_depth_ = 0;
  size_t macro_base_ = 0;  // the first frame of the macro being run (0: top level)
  int64_t iterations_ = 0;
  std::vector<std::pair<std::string_view, Value>> vars_;
  std::vector<size_t> frames_;
  std::vector<std::shared_ptr<NamespaceData>> namespaces_;  // cleared at the end (cycles)
};

}  // namespace strata::data::jinja
