// jinja2's filters and tests, the Python str / dict / list methods the sandbox lets a template
// call, and the globals transformers adds (raise_exception, strftime_now) beside jinja2's
// (range, namespace, dict). Each behaves as its Python counterpart; what is not listed here is
// refused with an error naming it, never approximated.
//
// Thread-safety: stateless; they run within one Interpreter's render.
#pragma once

#include <string_view>

#include "data/jinja_interpreter.h"

namespace strata::data::jinja {

// Whether `obj.name` is a method this engine can call (str, dict and list methods that do not
// mutate); its name as a static string for Callable::name.
bool IsMethod(const Value& obj, std::string_view name);
std::string_view MethodName(std::string_view name);
// Whether `obj.name` is a mutating method the immutable sandbox refuses (list.append, ...).
bool IsUnsafeMethod(const Value& obj, std::string_view name);

Value CallMethod(Interpreter& in, const Value& self, std::string_view name, CallArgs& args,
                 int line);
Value CallFilter(Interpreter& in, std::string_view name, const Value& input, CallArgs& args,
                 int line);
bool CallTest(Interpreter& in, std::string_view name, const Value& input, CallArgs& args, int line);
Value CallGlobal(Interpreter& in, std::string_view name, CallArgs& args, int line);

}  // namespace strata::data::jinja
