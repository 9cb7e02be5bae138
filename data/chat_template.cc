#include "data/chat_template.h"

#include <chrono>
#include <new>

#include "data/jinja_error.h"
#include "data/jinja_interpreter.h"
#include "data/jinja_parser.h"

namespace strata::data {

namespace {

Status ToStatus(const jinja::JinjaError& e, const std::string& where) {
  std::string message = where;
  if (e.line > 0) message += " line " + std::to_string(e.line);
  message += ": " + e.message;
  return Status(e.code, std::move(message));
}

}  // namespace

JinjaTemplate::~JinjaTemplate() = default;

StatusOr<std::unique_ptr<JinjaTemplate>> JinjaTemplate::Parse(std::string_view source,
                                                              std::string where) {
  std::unique_ptr<JinjaTemplate> t(new JinjaTemplate());
  t->where_ = std::move(where);
  try {
    t->body_ = jinja::ParseTemplate(source, &t->has_generation_);
  } catch (const jinja::JinjaError& e) {
    return ToStatus(e, t->where_);
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(t->where_ + ": out of memory parsing the template");
  }
  return t;
}

StatusOr<RenderedChat> JinjaTemplate::Render(const nlohmann::ordered_json& context,
                                             const ChatRenderOptions& options) const {
  if (!context.is_object()) {
    return InvalidArgumentError(where_ + ": the render context must be a JSON object");
  }
  jinja::RenderLimits limits;
  limits.max_output_bytes = options.max_output_bytes;
  limits.max_call_depth = options.max_call_depth;
  limits.max_loop_iterations = options.max_loop_iterations;
  limits.now = options.now != 0
                   ? options.now
                   : std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  RenderedChat out;
  try {
    jinja::Interpreter interpreter(context, limits, &out.text, &out.generation_spans);
    interpreter.Run(body_);
  } catch (const jinja::JinjaError& e) {
    return ToStatus(e, where_);
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(where_ + ": out of memory rendering the template");
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(where_ + ": " + e.what());
  }
  return out;
}

}  // namespace strata::data
