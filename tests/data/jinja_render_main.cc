// jinja_render: renders a chat template over a JSON context, for the reference comparison in
// tests/python/test_jinja_templates.py and for timing.
//
//   jinja_render TEMPLATE_FILE CONTEXT_FILE [--now=SECONDS] [--time=N]
//
// Prints one JSON object: {"ok": true, "text": ..., "spans": [[begin, end], ...]} (byte
// offsets) or {"ok": false, "code": ..., "error": ...}. With --time=N it renders N more times
// and adds "render_ns_median" (nanoseconds per render, median of 15 batches).
// CONTEXT_FILE may hold a JSON array of contexts: then one result line per context.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "data/chat_template.h"

namespace {

bool ReadFile(const char* path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::stringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  return true;
}

nlohmann::ordered_json RenderOne(const strata::data::JinjaTemplate& t,
                                 const nlohmann::ordered_json& context,
                                 const strata::data::ChatRenderOptions& options, long timing) {
  nlohmann::ordered_json result;
  auto r = t.Render(context, options);
  if (!r.ok()) {
    result["ok"] = false;
    result["code"] = std::string(strata::StatusCodeName(r.status().code()));
    result["error"] = r.status().message();
    return result;
  }
  result["ok"] = true;
  result["text"] = r->text;
  result["spans"] = nlohmann::ordered_json::array();
  for (const auto& [b, e] : r->generation_spans) result["spans"].push_back({b, e});
  if (timing > 0) {
    std::vector<double> per_render;
    for (int batch = 0; batch < 15; ++batch) {
      const auto start = std::chrono::steady_clock::now();
      for (long k = 0; k < timing; ++k) {
        auto again = t.Render(context, options);
        if (!again.ok()) return result;
      }
      const auto ns =
          std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start);
      per_render.push_back(ns.count() / static_cast<double>(timing));
    }
    std::sort(per_render.begin(), per_render.end());
    result["render_ns_median"] = per_render[per_render.size() / 2];
    result["render_ns_min"] = per_render.front();
    result["render_ns_max"] = per_render.back();
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: jinja_render TEMPLATE_FILE CONTEXT_FILE [--now=S] [--time=N]\n");
    return 2;
  }
  strata::data::ChatRenderOptions options;
  long timing = 0;
  for (int k = 3; k < argc; ++k) {
    const std::string a = argv[k];
    if (a.rfind("--now=", 0) == 0) options.now = std::stol(a.substr(6));
    if (a.rfind("--time=", 0) == 0) timing = std::stol(a.substr(7));
  }
  std::string source, context_text;
  if (!ReadFile(argv[1], &source) || !ReadFile(argv[2], &context_text)) {
    std::fprintf(stderr, "jinja_render: cannot read the input files\n");
    return 2;
  }
  const auto context = nlohmann::ordered_json::parse(context_text, nullptr, false);
  if (context.is_discarded()) {
    std::fprintf(stderr, "jinja_render: the context is not JSON\n");
    return 2;
  }
  const auto parse_start = std::chrono::steady_clock::now();
  auto t = strata::data::JinjaTemplate::Parse(source, "template");
  const double parse_ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - parse_start)
          .count();
  if (!t.ok()) {
    nlohmann::ordered_json result;
    result["ok"] = false;
    result["code"] = std::string(strata::StatusCodeName(t.status().code()));
    result["error"] = t.status().message();
    result["phase"] = "parse";
    std::cout << result.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    return 0;
  }
  const std::vector<nlohmann::ordered_json> contexts =
      context.is_array() ? context.get<std::vector<nlohmann::ordered_json>>()
                         : std::vector<nlohmann::ordered_json>{context};
  for (const auto& c : contexts) {
    nlohmann::ordered_json result = RenderOne(**t, c, options, timing);
    if (timing > 0) result["parse_ns"] = parse_ns;
    std::cout << result.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  }
  return 0;
}
