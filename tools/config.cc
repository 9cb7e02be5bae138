#include "tools/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "base/file.h"
#include "base/units.h"
#include "base/untrusted_text.h"
#include "tools/deepspeed_keys.h"

namespace strata::tools {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------

std::string TypeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float:
      return "a fractional number";
    default:
      return "an integer";
  }
}

// Validates values against the key they came from, words problems with its JSON path, and
// collects them, so that one run reports every problem of a file.
class Reader {
 public:
  void Add(std::string problem) { problems_.push_back(std::move(problem)); }
  void Add(const Status& s) { problems_.emplace_back(s.message()); }
  const std::vector<std::string>& problems() const { return problems_; }

  // Stores a value that validated; records the problem of one that did not.
  template <typename T, typename U>
  bool Set(T* out, StatusOr<U> v) {
    if (!v.ok()) {
      Add(v.status());
      return false;
    }
    *out = static_cast<T>(*v);
    return true;
  }

  static Status Problem(const std::string& message) { return InvalidArgumentError(message); }

  static Status WrongValue(const std::string& path, const json& v, std::string_view expected) {
    std::string hint;
    if (v.is_string() && v.get<std::string>() == "auto") {
      hint = "; \"auto\" is filled in by the Hugging Face Trainer, give the value itself";
    }
    return Problem(fmt::format("'{}' must be {}, got {} ({}){}", path, expected, JsonExcerpt(v),
                               TypeName(v), hint));
  }

  static StatusOr<int64_t> Int(const json& v, const std::string& path, int64_t lo, int64_t hi) {
    const std::string expected = hi == std::numeric_limits<int64_t>::max()
                                     ? fmt::format("an integer >= {}", lo)
                                     : fmt::format("an integer in {}..{}", lo, hi);
    int64_t x = 0;
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) {
        return Problem(fmt::format("'{}' must be {}, got {}", path, expected, JsonExcerpt(v)));
      }
      x = v.get<int64_t>();
    } else if (v.is_number_float()) {
      // 1e6 is an integer to people; 1.5 is not.
      const double d = v.get<double>();
      if (!(std::nearbyint(d) == d) || std::fabs(d) > 9.0e18) return WrongValue(path, v, expected);
      x = static_cast<int64_t>(d);
    } else {
      return WrongValue(path, v, expected);
    }
    if (x < lo || x > hi) {
      return Problem(fmt::format("'{}' must be {}, got {}", path, expected, JsonExcerpt(v)));
    }
    return x;
  }

  // A number in [lo, hi] (lo excluded when lo_open). Without a bound of its own a value must
  // fit fp32, where every rate, epsilon and decay of the file is used: 1e308 is finite in the
  // file and inf in the optimizer.
  static StatusOr<double> Number(const json& v, const std::string& path, double lo, bool lo_open,
                                 double hi = std::numeric_limits<float>::max(),
                                 bool hi_open = false) {
    std::string range =
        fmt::format("in {}{}, {}{}", lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]");
    if (hi == std::numeric_limits<float>::max()) {
      range = fmt::format("{}{} that fits fp32 (at most {}; the value is used in fp32)",
                          lo_open ? "> " : ">= ", lo, hi);
    }
    const std::string expected = "a number " + range;
    if (!v.is_number()) return WrongValue(path, v, expected);
    const double x = v.get<double>();
    const bool ok =
        std::isfinite(x) && (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi);
    if (!ok) return Problem(fmt::format("'{}' must be {}, got {}", path, expected, JsonExcerpt(v)));
    return x;
  }

  static StatusOr<bool> Bool(const json& v, const std::string& path) {
    if (!v.is_boolean()) return WrongValue(path, v, "true or false");
    return v.get<bool>();
  }

  static StatusOr<std::string> String(const json& v, const std::string& path) {
    if (!v.is_string()) return WrongValue(path, v, "a string");
    return v.get<std::string>();
  }

  static StatusOr<std::string> Choice(const json& v, const std::string& path,
                                      std::initializer_list<std::string_view> choices) {
    const std::string expected = fmt::format("one of \"{}\"", fmt::join(choices, "\", \""));
    if (!v.is_string()) return WrongValue(path, v, expected);
    const std::string s = v.get<std::string>();
    for (std::string_view c : choices) {
      if (s == c) return s;
    }
    return Problem(fmt::format("'{}' must be {}, got {}", path, expected, JsonExcerpt(v)));
  }

  // A byte size: a JSON integer or a string with units ("1MiB"), as ParseSize.
  static StatusOr<uint64_t> Size(const json& v, const std::string& path) {
    if (v.is_string()) {
      auto parsed = ParseSize(v.get<std::string>());
      if (!parsed.ok()) return Problem(fmt::format("'{}': {}", path, parsed.status().message()));
      return *parsed;
    }
    STRATA_ASSIGN_OR_RETURN(int64_t n, Int(v, path, 0, std::numeric_limits<int64_t>::max()));
    return static_cast<uint64_t>(n);
  }

  // A string or an array of non-empty strings.
  static StatusOr<std::vector<std::string>> Paths(const json& v, const std::string& path) {
    constexpr std::string_view kExpected = "a directory or an array of directories";
    std::vector<std::string> out;
    if (v.is_string()) {
      out.push_back(v.get<std::string>());
    } else if (v.is_array() && !v.empty()) {
      for (const auto& e : v) {
        if (!e.is_string()) return WrongValue(path, v, kExpected);
        out.push_back(e.get<std::string>());
      }
    } else {
      return WrongValue(path, v, kExpected);
    }
    for (const auto& p : out) {
      if (p.empty()) return Problem(fmt::format("'{}' contains an empty path", path));
    }
    return out;
  }

 private:
  std::vector<std::string> problems_;
};

// Looks a key up; nullptr when absent or when `obj` is not an object.
const json* Find(const json& obj, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(std::string(key));
  return it == obj.end() ? nullptr : &*it;
}

// Walks the file against DeepSpeed's keys (tools/deepspeed_keys.h): unknown keys inside sections
// and non-object sections become problems, unknown top-level keys are gathered to be noted (as
// DeepSpeed ignores them), no-ops are gathered by reason.
class KeyWalker {
 public:
  KeyWalker(Reader* r, std::map<NoopReason, std::vector<std::string>>* noops)
      : r_(r), noops_(noops) {}

  void Walk(const json& obj, const std::string& section, bool in_noop) {
    for (const auto& [key, value] : obj.items()) {
      const std::string path = section.empty() ? key : section + "." + key;
      const DeepSpeedKey* k = FindDeepSpeedKey(path);
      if (k == nullptr && section.empty()) {
        // DeepSpeed reads its top level key by key and ignores the others (LLaMA-Factory's
        // monitor_config, say); named on one note, with the key a typo most likely meant.
        const std::string_view best = NearestKey(key, DeepSpeedKeysUnder(""));
        ignored_top_.push_back(best.empty()
                                   ? Excerpt(key)
                                   : fmt::format("{} (did you mean '{}'?)", Excerpt(key), best));
        continue;
      }
      if (k == nullptr) {
        r_->Add(UnknownKey(section, key));
        continue;
      }
      // A no-op key, or a section all of whose keys are no-ops, is named once.
      const bool noop = k->treatment == KeyTreatment::kNoop ||
                        k->treatment == KeyTreatment::kNoopAny ||
                        (k->treatment == KeyTreatment::kSection && k->reason != NoopReason::kNone);
      if (noop && !in_noop) (*noops_)[k->reason].push_back(path);
      if (k->treatment == KeyTreatment::kSection) {
        // DeepSpeed's deprecated "zero_optimization": true / false (read_zero_config_deprecated):
        // stage 1 / 0, read by ApplyZero.
        if (path == "zero_optimization" && value.is_boolean()) continue;
        if (!value.is_object()) {
          r_->Add(Reader::WrongValue(path, value, "an object"));
          continue;
        }
        Walk(value, path, in_noop || k->reason != NoopReason::kNone);
      }
    }
  }

  // Top-level keys DeepSpeed does not know (ignored, as DeepSpeed ignores them).
  const std::vector<std::string>& ignored_top() const { return ignored_top_; }

 private:
  // Inside a section DeepSpeed validates (its pydantic models forbid unknown fields): an error
  // with the key a typo most likely meant, or the three nearest.
  static std::string UnknownKey(const std::string& section, const std::string& key) {
    const std::string path = section + "." + Excerpt(key);
    const auto children = DeepSpeedKeysUnder(section);
    const std::string_view best = NearestKey(key, children);
    if (!best.empty()) {
      return fmt::format("unknown key '{}' (did you mean '{}'?)", path, best);
    }
    return fmt::format("unknown key '{}'; the nearest in '{}': {}", path, section,
                       fmt::join(NearestKeys(key, children, 3), ", "));
  }

  Reader* r_;
  std::map<NoopReason, std::vector<std::string>>* noops_;
  std::vector<std::string> ignored_top_;
};

// Problems, notes and what the sections said, while the file is applied.
struct Context {
  Reader r;
  std::vector<std::string> notes;
  int stage = 0;  // DeepSpeed's default: ZeRO off
};

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Checks `params` against the keys `accepted` of this optimizer or scheduler type; the
// tunables in `ignored` are accepted and noted.
void CheckParams(Context& c, const json& params, const std::string& path,
                 std::initializer_list<std::string_view> accepted,
                 std::initializer_list<std::string_view> ignored, std::string_view type) {
  std::vector<std::string> noted;
  for (auto it = params.begin(); it != params.end(); ++it) {
    const std::string& key = it.key();  // not a structured binding: clang 14 cannot capture one
    const auto in = [&](std::initializer_list<std::string_view> keys) {
      return std::find(keys.begin(), keys.end(), key) != keys.end();
    };
    if (in(accepted)) continue;
    if (in(ignored)) {
      noted.push_back(path + "." + key);
      continue;
    }
    std::vector<std::string_view> all(accepted);
    all.insert(all.end(), ignored.begin(), ignored.end());
    const std::string_view best = NearestKey(key, all);
    c.r.Add(best.empty() ? fmt::format("unknown key '{}.{}' for type \"{}\"; it takes: {}", path,
                                       Excerpt(key), type, fmt::join(all, ", "))
                         : fmt::format("unknown key '{}.{}' for type \"{}\" (did you mean '{}'?)",
                                       path, Excerpt(key), type, best));
  }
  if (!noted.empty()) {
    c.notes.push_back(fmt::format("ignored (implementation switches of torch/DeepSpeed): {}",
                                  fmt::join(noted, ", ")));
  }
}

// Optional boolean switch of a torch optimizer that Strata supports only at one value.
void RequireBool(Context& c, const json& params, const std::string& path, std::string_view key,
                 bool supported, std::string_view why) {
  const json* v = Find(params, key);
  if (v == nullptr) return;
  bool b = supported;
  if (!c.r.Set(&b, Reader::Bool(*v, path + "." + std::string(key)))) return;
  if (b != supported) {
    c.r.Add(fmt::format("'{}.{}' {} is not supported: {}", path, key, b ? "true" : "false", why));
  }
}

void ApplyBetas(Context& c, const json& params, const std::string& path, TrainFlags* f) {
  const json* v = Find(params, "betas");
  if (v == nullptr) return;
  if (!v->is_array() || v->size() != 2) {
    c.r.Add(Reader::WrongValue(path + ".betas", *v, "[beta1, beta2], each in [0, 1)"));
    return;
  }
  double b1 = 0, b2 = 0;
  const bool ok1 = c.r.Set(&b1, Reader::Number((*v)[0], path + ".betas[0]", 0, false, 1, true));
  const bool ok2 = c.r.Set(&b2, Reader::Number((*v)[1], path + ".betas[1]", 0, false, 1, true));
  if (ok1) f->adam_beta1 = b1;
  if (ok2) f->adam_beta2 = b2;
}

// optimizer.type, lowered ("adamw" when absent); nullopt after an error. *type_name: as written.
std::optional<std::string> ReadOptimizerType(Context& c, const json& opt, std::string* type_name) {
  std::string type = "adamw";
  *type_name = "AdamW";
  if (const json* t = Find(opt, "type")) {
    constexpr std::string_view kTypes =
        "\"AdamW\", \"Adam\", \"AdamW8bit\", \"Adafactor\", \"Lion\", \"SGD\" or \"Adagrad\"";
    if (!t->is_string()) {
      c.r.Add(Reader::WrongValue("optimizer.type", *t, kTypes));
      return std::nullopt;
    }
    *type_name = t->get<std::string>();
    type = Lower(*type_name);
    if (type != "adamw" && type != "adam" && type != "adamw8bit" && type != "adafactor" &&
        type != "lion" && type != "sgd" && type != "adagrad") {
      c.r.Add(fmt::format("'optimizer.type' {} is not supported: Strata's CPU optimizers are {}",
                          JsonExcerpt(*t), kTypes));
      return std::nullopt;
    }
  }
  return type;
}

// The params keys each optimizer takes, and the torch switches that must stay off.
void CheckOptimizerParamNames(Context& c, const json& params, const std::string& p,
                              const std::string& type, const std::string& type_name) {
  // torch switches Strata's kernels have no use for (they pick their own implementation).
  const std::initializer_list<std::string_view> impl = {"foreach", "capturable", "differentiable",
                                                        "fused", "torch_adam"};
  if (type == "adamw" || type == "adam" || type == "adamw8bit") {
    CheckParams(c, params, p,
                {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "amsgrad",
                 "maximize"},
                impl, type_name);
    RequireBool(c, params, p, "amsgrad", false, "Strata's Adam keeps no max of the second moment");
    RequireBool(c, params, p, "maximize", false, "strata train minimizes the loss");
  } else if (type == "lion") {
    CheckParams(c, params, p, {"lr", "betas", "weight_decay", "maximize"}, impl, type_name);
    RequireBool(c, params, p, "maximize", false, "strata train minimizes the loss");
  } else if (type == "sgd") {
    CheckParams(c, params, p,
                {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"}, impl,
                type_name);
    RequireBool(c, params, p, "maximize", false, "strata train minimizes the loss");
  } else if (type == "adagrad") {
    CheckParams(c, params, p,
                {"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "maximize"},
                impl, type_name);
    RequireBool(c, params, p, "maximize", false, "strata train minimizes the loss");
  } else {  // adafactor: transformers' names, and torch.optim.Adafactor's
    CheckParams(c, params, p,
                {"lr", "eps", "clip_threshold", "decay_rate", "beta1", "weight_decay",
                 "scale_parameter", "relative_step", "warmup_init", "beta2_decay", "d", "maximize"},
                impl, type_name);
    RequireBool(c, params, p, "relative_step", false,
                "strata train drives the learning rate from the schedule; give lr instead");
    RequireBool(c, params, p, "warmup_init", false, "it needs relative_step");
    RequireBool(c, params, p, "maximize", false, "strata train minimizes the loss");
  }
}

// lr, betas, weight_decay, eps, bias_correction and adam_w_mode.
void ApplyCommonOptimizerParams(Context& c, const json& params, const std::string& p,
                                const std::string& type, const std::string& type_name,
                                TrainFlags* f) {
  if (const json* v = Find(params, "lr")) c.r.Set(&f->lr, Reader::Number(*v, p + ".lr", 0, true));
  if (type != "sgd" && type != "adagrad" && type != "adafactor") ApplyBetas(c, params, p, f);
  if (const json* v = Find(params, "weight_decay")) {
    c.r.Set(&f->weight_decay, Reader::Number(*v, p + ".weight_decay", 0, false));
  }
  if (const json* v = Find(params, "eps"); v != nullptr && type != "adafactor") {
    double eps = 0;
    if (c.r.Set(&eps, Reader::Number(*v, p + ".eps", 0, false))) f->adam_eps = eps;
  }
  if (const json* v = Find(params, "bias_correction")) {
    c.r.Set(&f->adam_bias_correction, Reader::Bool(*v, p + ".bias_correction"));
  }
  if (const json* v = Find(params, "adam_w_mode")) {
    bool w = true;
    if (c.r.Set(&w, Reader::Bool(*v, p + ".adam_w_mode"))) {
      if (type == "adamw" && !w) {
        // DeepSpeed runs AdamW for this type whatever adam_w_mode says (effective_adam_w_mode).
        c.notes.push_back(fmt::format(
            "{}.adam_w_mode false is ignored for type \"{}\", as DeepSpeed does (type \"Adam\" "
            "with adam_w_mode false is Adam with L2 weight decay)",
            p, type_name));
        w = true;
      } else if (type != "adam" && !w) {
        c.r.Add(
            fmt::format("'{}.adam_w_mode' false contradicts type \"{}\"; use type \"Adam\" "
                        "for L2 weight decay",
                        p, type_name));
      }
      f->adam_decoupled_weight_decay = w;
      if (type == "adam") f->optimizer = w ? "adamw" : "adam";
    }
  }
}

// SGD's momentum, dampening, nesterov; Adagrad's lr_decay, initial_accumulator_value.
void ApplySgdAndAdagradParams(Context& c, const json& params, const std::string& p,
                              const std::string& type, TrainFlags* f) {
  if (type == "sgd") {
    if (const json* v = Find(params, "momentum")) {
      c.r.Set(&f->momentum, Reader::Number(*v, p + ".momentum", 0, false));
    } else {
      f->momentum = 0;  // torch.optim.SGD's default
    }
    if (const json* v = Find(params, "dampening")) {
      c.r.Set(&f->sgd_dampening, Reader::Number(*v, p + ".dampening", 0, false));
    }
    if (const json* v = Find(params, "nesterov")) {
      c.r.Set(&f->sgd_nesterov, Reader::Bool(*v, p + ".nesterov"));
    }
  }
  if (type == "adagrad") {
    if (const json* v = Find(params, "lr_decay")) {
      c.r.Set(&f->adagrad_lr_decay, Reader::Number(*v, p + ".lr_decay", 0, false));
    }
    if (const json* v = Find(params, "initial_accumulator_value")) {
      c.r.Set(&f->adagrad_initial_accumulator,
              Reader::Number(*v, p + ".initial_accumulator_value", 0, false));
    }
  }
}

// Adafactor's eps pair, decay rate, clip threshold, beta1 and scale_parameter.
void ApplyAdafactorParams(Context& c, const json& params, const std::string& p, TrainFlags* f) {
  if (const json* v = Find(params, "eps")) {
    // transformers: [eps1, eps2]; torch: [eps1 or null, eps2].
    if (!v->is_array() || v->size() != 2) {
      c.r.Add(Reader::WrongValue(p + ".eps", *v, "[eps1, eps2]"));
    } else {
      double e1 = 1e-30, e2 = 1e-3;
      if ((*v)[0].is_null() || c.r.Set(&e1, Reader::Number((*v)[0], p + ".eps[0]", 0, false))) {
        f->adam_eps = e1;
      }
      if (c.r.Set(&e2, Reader::Number((*v)[1], p + ".eps[1]", 0, false))) f->adafactor_eps2 = e2;
    }
  }
  for (const char* key : {"decay_rate", "beta2_decay"}) {
    if (const json* v = Find(params, key)) {
      c.r.Set(
          &f->adafactor_decay_rate,
          Reader::Number(*v, p + "." + key, -std::numeric_limits<double>::max(), false, 0, true));
    }
  }
  for (const char* key : {"clip_threshold", "d"}) {
    if (const json* v = Find(params, key)) {
      c.r.Set(&f->adafactor_clip_threshold, Reader::Number(*v, p + "." + key, 0, true));
    }
  }
  if (const json* v = Find(params, "beta1"); v != nullptr && !v->is_null()) {
    double b1 = 0;
    if (c.r.Set(&b1, Reader::Number(*v, p + ".beta1", 0, false, 1, true))) f->adam_beta1 = b1;
  }
  if (const json* v = Find(params, "scale_parameter")) {
    c.r.Set(&f->adafactor_scale_parameter, Reader::Bool(*v, p + ".scale_parameter"));
  }
}

void ApplyOptimizer(Context& c, const json& opt, TrainFlags* f) {
  std::string type_name;
  const std::optional<std::string> read_type = ReadOptimizerType(c, opt, &type_name);
  if (!read_type) return;
  const std::string& type = *read_type;
  // DeepSpeed: "Adam" is AdamW unless adam_w_mode is false.
  f->optimizer = type == "adam" ? "adamw" : type;
  f->adam_decoupled_weight_decay = true;
  // What params leaves out is the default of the optimizer DeepSpeed builds for the type, not
  // Strata's flag defaults: FusedAdam / DeepSpeedCPUAdam, bitsandbytes' AdamW8bit, FusedLion /
  // DeepSpeedCPULion (betas 0.9, 0.999) and torch.optim.SGD take lr 1e-3, DeepSpeedCPUAdagrad
  // and torch.optim.Adagrad 1e-2. (Adafactor keeps Strata's: its algorithm is transformers',
  // not the torch.optim.Adafactor whose default lr DeepSpeed would use; the note below.)
  if (type != "adafactor") f->lr = type == "adagrad" ? 1e-2 : 1e-3;
  if (type == "lion") {
    f->adam_beta1 = 0.9;
    f->adam_beta2 = 0.999;
  }
  const json* params = Find(opt, "params");
  if (type == "adafactor") {
    // DeepSpeed builds any optimizer type it does not implement from torch.optim, so its
    // "Adafactor" is torch.optim.Adafactor (torch 2.5+), whose step is min(lr, 1/sqrt(t)) times
    // max(eps2, RMS(p)) and whose eps1 is a floor under sqrt(v); Strata's is transformers'. Said,
    // so that the same config's different step sizes are not a surprise.
    c.notes.push_back(fmt::format(
        "optimizer Adafactor: Strata runs transformers.Adafactor (step lr{}, eps1 added to g^2), "
        "not the torch.optim.Adafactor DeepSpeed builds for this type (step min(lr, 1/sqrt(t)) x "
        "max(eps2, RMS(p)), eps1 a floor under sqrt(v), weight decay lr x weight_decay)",
        [&] {
          const json* v =
              params != nullptr && params->is_object() ? Find(*params, "scale_parameter") : nullptr;
          return v != nullptr && v->is_boolean() && v->get<bool>() ? " x max(eps2, RMS(p))" : "";
        }()));
  }
  if (params == nullptr) return;
  const std::string p = "optimizer.params";
  if (!params->is_object()) {
    c.r.Add(Reader::WrongValue(p, *params, "an object"));
    return;
  }
  CheckOptimizerParamNames(c, *params, p, type, type_name);
  ApplyCommonOptimizerParams(c, *params, p, type, type_name, f);
  ApplySgdAndAdagradParams(c, *params, p, type, f);
  if (type == "adafactor") ApplyAdafactorParams(c, *params, p, f);
}

// scheduler.type: one of DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR; nullopt after an
// error.
std::optional<std::string> ReadSchedulerType(Context& c, const json& sched) {
  const json* t = Find(sched, "type");
  if (t == nullptr) {
    c.r.Add("'scheduler' needs a \"type\": WarmupLR, WarmupDecayLR or WarmupCosineLR");
    return std::nullopt;
  }
  std::string type;
  if (!c.r.Set(&type, Reader::String(*t, "scheduler.type"))) return std::nullopt;
  if (type == "OneCycle" || type == "LRRangeTest") {
    c.r.Add(
        fmt::format("'scheduler.type' \"{}\" is not supported: Strata runs WarmupLR, "
                    "WarmupDecayLR and WarmupCosineLR",
                    type));
    return std::nullopt;
  }
  if (type != "WarmupLR" && type != "WarmupDecayLR" && type != "WarmupCosineLR") {
    c.r.Add(
        fmt::format("'scheduler.type' \"{}\" is not a DeepSpeed scheduler; use WarmupLR, "
                    "WarmupDecayLR or WarmupCosineLR",
                    type));
    return std::nullopt;
  }
  return type;
}

// The params keys each scheduler takes.
void CheckSchedulerParamNames(Context& c, const json& params, const std::string& p,
                              const std::string& type) {
  if (type == "WarmupCosineLR") {
    CheckParams(c, params, p,
                {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                 "warmup_type", "last_batch_iteration"},
                {}, type);
  } else {
    CheckParams(
        c, params, p,
        type == "WarmupLR"
            ? std::initializer_list<std::string_view>{"warmup_min_lr", "warmup_max_lr",
                                                      "warmup_num_steps", "warmup_type",
                                                      "last_batch_iteration"}
            : std::initializer_list<std::string_view>{"total_num_steps", "warmup_min_lr",
                                                      "warmup_max_lr", "warmup_num_steps",
                                                      "warmup_type", "last_batch_iteration"},
        {}, type);
  }
}

// The warmup, total steps, ratios and rates of scheduler.params.
void ApplySchedulerParams(Context& c, const json& params, const std::string& p,
                          const std::string& type, bool has_optimizer_lr, TrainFlags* f) {
  if (const json* v = Find(params, "warmup_num_steps")) {
    // 0 is what a Hugging Face Trainer fills in without warmup; DeepSpeed's schedulers warm up
    // over max(2, warmup_num_steps) steps, as LearningRateAt does.
    c.r.Set(&f->warmup_steps, Reader::Int(*v, p + ".warmup_num_steps", 0, kMax));
  }
  if (const json* v = Find(params, "warmup_type")) {
    c.r.Set(&f->warmup_type, Reader::Choice(*v, p + ".warmup_type", {"log", "linear"}));
  }
  if (const json* v = Find(params, "last_batch_iteration")) {
    int64_t last = -1;
    if (c.r.Set(&last, Reader::Int(*v, p + ".last_batch_iteration", -1, kMax)) && last != -1) {
      c.r.Add(
          fmt::format("'{}.last_batch_iteration' {}: a run resumes its schedule from its "
                      "checkpoint (--resume); leave -1",
                      p, last));
    }
  }
  if (type != "WarmupLR") {
    if (const json* v = Find(params, "total_num_steps")) {
      c.r.Set(&f->lr_total_steps, Reader::Int(*v, p + ".total_num_steps", 1, kMax));
    } else {
      c.r.Add(fmt::format("'{}.total_num_steps' is required by {}", p, type));
    }
  }
  if (type == "WarmupCosineLR") {
    if (const json* v = Find(params, "warmup_min_ratio")) {
      c.r.Set(&f->warmup_min_ratio, Reader::Number(*v, p + ".warmup_min_ratio", 0, false, 1));
    }
    if (const json* v = Find(params, "cos_min_ratio")) {
      c.r.Set(&f->cos_min_ratio, Reader::Number(*v, p + ".cos_min_ratio", 0, false, 1));
    }
    return;  // the peak is the optimizer's lr
  }
  if (const json* v = Find(params, "warmup_min_lr")) {
    c.r.Set(&f->warmup_min_lr, Reader::Number(*v, p + ".warmup_min_lr", 0, false));
  }
  if (const json* v = Find(params, "warmup_max_lr")) {
    c.r.Set(&f->lr, Reader::Number(*v, p + ".warmup_max_lr", 0, true));
  } else if (type == "WarmupDecayLR") {
    // DeepSpeed's WarmupDecayLR defaults warmup_max_lr to 0.001 and sets every group's rate from
    // it: the optimizer's lr is not its peak. (WarmupLR without it peaks at the optimizer's lr,
    // as deepspeed.runtime.lr_schedules.WarmupLR takes param_groups[0]['lr'] for None.)
    if (has_optimizer_lr && f->lr != 1e-3) {
      c.notes.push_back(fmt::format(
          "'{}.warmup_max_lr' is absent: the peak learning rate is DeepSpeed's default 0.001, not "
          "optimizer.params.lr {} (as DeepSpeed's {} has it); give warmup_max_lr to choose it",
          p, f->lr, type));
    }
    f->lr = 1e-3;
  }
}

void ApplyScheduler(Context& c, const json& sched, bool has_optimizer_lr, TrainFlags* f) {
  const std::optional<std::string> type = ReadSchedulerType(c, sched);
  if (!type) return;
  f->lr_schedule = *type;
  // DeepSpeed's constructor defaults.
  f->warmup_steps = 1000;
  f->warmup_type = "log";
  f->warmup_min_lr = 0;
  f->warmup_min_ratio = 0;
  f->cos_min_ratio = 1e-4;
  const json empty = json::object();
  const json* params = Find(sched, "params");
  if (params == nullptr) params = &empty;
  const std::string p = "scheduler.params";
  if (!params->is_object()) {
    c.r.Add(Reader::WrongValue(p, *params, "an object"));
    return;
  }
  CheckSchedulerParamNames(c, *params, p, *type);
  ApplySchedulerParams(c, *params, p, *type, has_optimizer_lr, f);
}

void ApplyPrecision(Context& c, const json& root, TrainFlags* f) {
  const json* fp16 = Find(root, "fp16");
  // "bfloat16" is the section's old name, which DeepSpeed still reads (get_bfloat16_enabled).
  const json* bf16 = Find(root, "bf16");
  const char* bf16_name = "bf16";
  if (const json* old = Find(root, "bfloat16"); old != nullptr) {
    if (bf16 != nullptr) {
      c.r.Add("'bf16' and its old name 'bfloat16' are both given; keep one");
    } else {
      bf16 = old;
      bf16_name = "bfloat16";
    }
  }
  bool fp16_on = false, bf16_on = false;
  if (bf16 != nullptr) {
    if (const json* v = Find(*bf16, "enabled")) {
      c.r.Set(&bf16_on, Reader::Bool(*v, fmt::format("{}.enabled", bf16_name)));
    }
  }
  if (fp16 != nullptr) {
    if (const json* v = Find(*fp16, "enabled")) c.r.Set(&fp16_on, Reader::Bool(*v, "fp16.enabled"));
  }
  if (fp16_on && bf16_on) {
    c.r.Add(fmt::format("'fp16.enabled' and '{}.enabled' are both true; enable at most one",
                        bf16_name));
  }
  // As DeepSpeed: fp32 unless a section is enabled.
  f->precision = fp16_on ? "fp16" : bf16_on ? "bf16" : "fp32";
  // DeepSpeed's fp16 defaults, then the file's values.
  f->fp16_dynamic_loss_scale = true;
  f->fp16_initial_scale = 65536.0;
  f->fp16_scale_window = 1000;
  f->fp16_hysteresis = 2;
  f->fp16_consecutive_hysteresis = false;
  f->fp16_min_scale = 1.0;
  if (fp16 == nullptr) return;
  const json& s = *fp16;
  if (const json* v = Find(s, "loss_scale")) {
    double scale = 0;
    if (c.r.Set(&scale, Reader::Number(*v, "fp16.loss_scale", 0, false))) {
      f->fp16_dynamic_loss_scale = scale == 0;
      if (scale > 0) f->fp16_initial_scale = scale;
    }
  }
  if (const json* v = Find(s, "initial_scale_power")) {
    int64_t power = 16;
    if (c.r.Set(&power, Reader::Int(*v, "fp16.initial_scale_power", 0, 24))) {
      if (f->fp16_dynamic_loss_scale) {
        f->fp16_initial_scale = std::ldexp(1.0, static_cast<int>(power));
      } else {
        c.notes.push_back(
            "fp16.initial_scale_power is for dynamic scaling; fp16.loss_scale sets a static "
            "scale, which is used");
      }
    }
  }
  if (const json* v = Find(s, "loss_scale_window")) {
    c.r.Set(&f->fp16_scale_window, Reader::Int(*v, "fp16.loss_scale_window", 1, kMax));
  }
  if (const json* v = Find(s, "hysteresis")) {
    c.r.Set(&f->fp16_hysteresis, Reader::Int(*v, "fp16.hysteresis", 1, kMaxInt));
  }
  if (const json* v = Find(s, "consecutive_hysteresis")) {
    c.r.Set(&f->fp16_consecutive_hysteresis, Reader::Bool(*v, "fp16.consecutive_hysteresis"));
  }
  if (const json* v = Find(s, "min_loss_scale")) {
    c.r.Set(&f->fp16_min_scale, Reader::Number(*v, "fp16.min_loss_scale", 0, true));
  }
}

// The offload sections' placement, and their pinned-memory and buffer keys.
struct Offload {
  std::string device = "none";
  std::optional<std::vector<std::string>> nvme_paths;
};

Offload ReadOffload(Context& c, const json* section, const std::string& path, bool is_param,
                    TrainFlags* f) {
  Offload o;
  if (section == nullptr || !section->is_object()) return o;
  if (const json* v = Find(*section, "device")) {
    c.r.Set(&o.device, Reader::Choice(*v, path + ".device", {"none", "cpu", "nvme"}));
  }
  if (const json* v = Find(*section, "nvme_path")) {
    std::vector<std::string> paths;
    if (c.r.Set(&paths, Reader::Paths(*v, path + ".nvme_path"))) o.nvme_paths = paths;
  }
  if (const json* v = Find(*section, "pin_memory")) {
    bool pin = false;
    if (c.r.Set(&pin, Reader::Bool(*v, path + ".pin_memory")) && !pin && o.device != "none") {
      c.notes.push_back(fmt::format(
          "{}.pin_memory false: Strata always stages transfers in pinned host memory (a pageable "
          "copy would serialize)",
          path));
    }
  }
  if (const json* v = Find(*section, "buffer_count")) {
    int64_t n = 0;
    if (c.r.Set(&n, Reader::Int(*v, path + ".buffer_count", is_param ? 2 : 1, 64)) &&
        o.device == "nvme") {
      // Params: the blocks in flight between NVMe and compute (streaming slots); optimizer: the
      // pinned buffers of the read / update / write pipeline.
      if (is_param) {
        f->prefetch_depth = static_cast<int>(n) - 1;
      } else {
        f->optimizer_buffers = static_cast<int>(n);
      }
    }
  }
  if (const json* v = Find(*section, "ratio")) {
    double ratio = 1;
    if (c.r.Set(&ratio, Reader::Number(*v, path + ".ratio", 0, false, 1)) && ratio < 1) {
      c.r.Add(
          fmt::format("'{}.ratio' {} (partial offload) is not supported: Strata updates every "
                      "parameter on the CPU; use 1",
                      path, ratio));
    }
  }
  return o;
}

void ApplyZero(Context& c, const json* zero, TrainFlags* f) {
  const json empty = json::object();
  if (zero != nullptr && zero->is_boolean()) {
    // The deprecated boolean form: true is stage 1, false stage 0 (DeepSpeed's
    // read_zero_config_deprecated).
    c.stage = zero->get<bool>() ? 1 : 0;
    c.notes.push_back(
        fmt::format("zero_optimization {} is DeepSpeed's deprecated form of {{\"stage\": {}}}",
                    zero->get<bool>(), c.stage));
  }
  if (zero == nullptr || !zero->is_object()) zero = &empty;
  const std::string z = "zero_optimization";
  if (const json* v = Find(*zero, "stage")) {
    int64_t stage = 0;
    if (c.r.Set(&stage, Reader::Int(*v, z + ".stage", 0, 3))) c.stage = static_cast<int>(stage);
  }
  const json* param_section = Find(*zero, "offload_param");
  const json* optim_section = Find(*zero, "offload_optimizer");
  Offload param = ReadOffload(c, param_section, z + ".offload_param", true, f);
  Offload optim = ReadOffload(c, optim_section, z + ".offload_optimizer", false, f);
  // The deprecated switches.
  if (const json* v = Find(*zero, "cpu_offload")) {
    bool on = false;
    if (c.r.Set(&on, Reader::Bool(*v, z + ".cpu_offload")) && on && optim_section == nullptr) {
      optim.device = "cpu";
    }
  }
  if (const json* v = Find(*zero, "cpu_offload_param")) {
    bool on = false;
    if (c.r.Set(&on, Reader::Bool(*v, z + ".cpu_offload_param")) && on &&
        param_section == nullptr) {
      param.device = "cpu";
    }
  }
  if (const json* v = Find(*zero, "cpu_offload_use_pin_memory")) {
    bool pin = true;
    c.r.Set(&pin, Reader::Bool(*v, z + ".cpu_offload_use_pin_memory"));
  }
  // DeepSpeed's stage rules.
  if (param.device != "none" && c.stage != 3) {
    c.notes.push_back(fmt::format(
        "{}.offload_param is read at stage 3 only; at stage {} DeepSpeed keeps parameters on the "
        "GPU, and so does Strata",
        z, c.stage));
    param.device = "none";
  }
  if (optim.device == "nvme" && c.stage != 3) {
    c.r.Add(
        fmt::format("'{}.offload_optimizer.device' \"nvme\" needs stage 3 (DeepSpeed swaps "
                    "optimizer state to NVMe only at stage 3), got stage {}; use stage 3 or "
                    "device \"cpu\"",
                    z, c.stage));
  }
  if (optim.device != "none" && c.stage == 0) {
    c.notes.push_back(fmt::format(
        "{}.offload_optimizer is read at stages 1-3; at stage 0 DeepSpeed keeps optimizer state "
        "on the GPU, and so does Strata",
        z));
  }
  f->offload_params = param.device == "cpu" ? "host" : param.device == "nvme" ? "nvme" : "device";
  if (optim.device == "nvme" && c.stage == 3) {
    f->offload_optimizer = "nvme";
  } else if (optim.device == "none" || c.stage == 0) {
    f->offload_optimizer = "device";
    c.notes.push_back(
        "no offload_optimizer: DeepSpeed keeps optimizer state on the GPU, and so does Strata "
        "(--offload-optimizer device: fused update kernels there)");
  } else {
    f->offload_optimizer = "host";
  }
  if (param.nvme_paths && optim.nvme_paths && *param.nvme_paths != *optim.nvme_paths &&
      param.device == "nvme" && optim.device == "nvme") {
    c.r.Add(fmt::format(
        "'{}.offload_param.nvme_path' differs from '{}.offload_optimizer.nvme_path'; Strata "
        "stripes parameters and optimizer state over one set of directories",
        z, z));
  }
  const auto& used = param.device == "nvme" && param.nvme_paths ? param.nvme_paths
                     : optim.nvme_paths                         ? optim.nvme_paths
                                                                : param.nvme_paths;
  if (used) f->nvme_paths = *used;
}

void ApplyAio(Context& c, const json& aio, TrainFlags* f) {
  // A present section fills what it leaves out with DeepSpeed's defaults.
  uint64_t block = 1 << 20;
  int64_t depth = 8, threads = 1;
  if (const json* v = Find(aio, "block_size")) {
    if (c.r.Set(&block, Reader::Size(*v, "aio.block_size")) &&
        (block == 0 || block % 4096 != 0 || block > kGiB)) {
      c.r.Add(fmt::format(
          "'aio.block_size' must be a multiple of 4096 bytes between 4096 and 1 GiB, got {}",
          JsonExcerpt(*v)));
    }
  }
  if (const json* v = Find(aio, "queue_depth")) {
    c.r.Set(&depth, Reader::Int(*v, "aio.queue_depth", 1, 4096));
  }
  const json* old_name = Find(aio, "thread_count");
  const json* new_name = Find(aio, "intra_op_parallelism");
  if (old_name && new_name && *old_name != *new_name) {
    c.r.Add(
        fmt::format("'aio.thread_count' {} and 'aio.intra_op_parallelism' {} disagree; they "
                    "are the old and the new name of one setting, give one",
                    JsonExcerpt(*old_name), JsonExcerpt(*new_name)));
  }
  if (const json* v = new_name ? new_name : old_name) {
    c.r.Set(&threads,
            Reader::Int(*v, new_name ? "aio.intra_op_parallelism" : "aio.thread_count", 1, 256));
  }
  if (const json* v = Find(aio, "use_gds")) {
    bool gds = false;
    if (c.r.Set(&gds, Reader::Bool(*v, "aio.use_gds")) && gds) {
      c.notes.push_back(
          "aio.use_gds true: Strata reads and writes NVMe through pinned host memory (no "
          "GPUDirect Storage)");
    }
  }
  f->io_block_size = std::to_string(block);
  // DeepSpeed keeps queue_depth requests in flight on each of its threads.
  f->io_queue_depth = static_cast<int>(std::min<int64_t>(4096, depth * threads));
  f->io_threads = static_cast<int>(threads);
  if (threads > 1) {
    c.notes.push_back(fmt::format(
        "aio: queue depth {} x {} threads = {} pieces in flight on io_uring; {} posix workers",
        depth, threads, f->io_queue_depth, threads));
  }
}

void ApplyMonitor(Context& c, const json& root, std::string_view name, std::string* dir) {
  const json* s = Find(root, name);
  if (s == nullptr || !s->is_object()) return;
  const std::string p(name);
  bool enabled = false;
  if (const json* v = Find(*s, "enabled")) c.r.Set(&enabled, Reader::Bool(*v, p + ".enabled"));
  std::string output = ".", job = "DeepSpeedJobName";
  if (const json* v = Find(*s, "output_path"); v != nullptr && !v->is_null()) {
    c.r.Set(&output, Reader::String(*v, p + ".output_path"));
  }
  if (const json* v = Find(*s, "job_name")) c.r.Set(&job, Reader::String(*v, p + ".job_name"));
  if (enabled) {
    *dir = output.empty() ? job : output.back() == '/' ? output + job : output + "/" + job;
  }
}

// strata.lora: {"rank", "alpha", "targets", "dropout", "init", "base_quant",
// "base_double_quant"}, as the --lora-* and --base-* flags.
void ApplyLora(Context& c, const json& l, LoraFlags* f) {
  Reader& r = c.r;
  if (const json* v = Find(l, "rank"))
    r.Set(&f->rank, Reader::Int(*v, "strata.lora.rank", 0, kMaxInt));
  if (const json* v = Find(l, "alpha")) {
    f->alpha_given = r.Set(&f->alpha, Reader::Number(*v, "strata.lora.alpha", 0, true));
  }
  if (const json* v = Find(l, "dropout")) {
    f->dropout_given =
        r.Set(&f->dropout, Reader::Number(*v, "strata.lora.dropout", 0, false, 1, true));
  }
  if (const json* v = Find(l, "targets")) {
    std::vector<std::string> targets;
    for (const json& t : v->is_array() ? *v : json::array({*v})) {
      if (!t.is_string()) {
        r.Add(
            "'strata.lora.targets' must be a module name or a list of them, e.g. "
            "[\"q_proj\", \"v_proj\"]");
        return;
      }
      targets.push_back(t.get<std::string>());
    }
    f->targets = targets;
  }
  if (const json* v = Find(l, "init")) r.Set(&f->init, Reader::String(*v, "strata.lora.init"));
  if (const json* v = Find(l, "base_quant")) {
    r.Set(&f->base.quant, Reader::String(*v, "strata.lora.base_quant"));
  }
  if (const json* v = Find(l, "base_double_quant")) {
    r.Set(&f->base.double_quant, Reader::String(*v, "strata.lora.base_double_quant"));
  }
}

void ApplyLoraSection(Context& c, const json& strata, LoraFlags* f) {
  const json* l = Find(strata, "lora");
  if (l == nullptr) return;
  if (l->is_object()) {
    ApplyLora(c, *l, f);
  } else {
    c.r.Add(
        "'strata.lora' must be an object: {\"rank\": R, \"alpha\": A, \"targets\": [...], "
        "\"dropout\": P, \"init\": DIR}");
  }
}

// The strata section's model and data keys.
void ApplyStrataData(Context& c, const json& s, TrainFlags* f) {
  Reader& r = c.r;
  if (const json* v = Find(s, "model")) r.Set(&f->model, Reader::String(*v, "strata.model"));
  if (const json* v = Find(s, "data")) {
    std::string data;
    if (r.Set(&data, Reader::String(*v, "strata.data"))) f->data = {data};
  }
  if (const json* v = Find(s, "pack")) r.Set(&f->pack, Reader::Bool(*v, "strata.pack"));
  if (const json* v = Find(s, "long_examples")) {
    r.Set(&f->long_examples,
          Reader::Choice(*v, "strata.long_examples", {"auto", "truncate", "skip"}));
  }
  // Preference training (--objective, --beta, --label-smoothing, --simpo-gamma, --rpo-alpha,
  // --cpo-alpha); the ranges are
  // the flags' (tools/train_setup.cc checks them once, for both).
  if (const json* v = Find(s, "objective")) {
    r.Set(&f->objective, Reader::Choice(*v, "strata.objective", {"sft", "dpo", "ipo", "simpo"}));
  }
  if (const json* v = Find(s, "beta")) r.Set(&f->beta, Reader::Number(*v, "strata.beta", 0, true));
  if (const json* v = Find(s, "label_smoothing")) {
    r.Set(&f->label_smoothing, Reader::Number(*v, "strata.label_smoothing", 0, false, 0.5, true));
  }
  if (const json* v = Find(s, "simpo_gamma")) {
    r.Set(&f->simpo_gamma,
          Reader::Number(*v, "strata.simpo_gamma", -std::numeric_limits<float>::max(), false));
  }
  if (const json* v = Find(s, "rpo_alpha")) {
    r.Set(&f->rpo_alpha, Reader::Number(*v, "strata.rpo_alpha", 0, false));
  }
  if (const json* v = Find(s, "cpo_alpha")) {
    r.Set(&f->cpo_alpha, Reader::Number(*v, "strata.cpo_alpha", 0, false));
  }
}

// The strata section's keys for how a step runs: the update during backward, the schedule and
// which layers recompute their forward (activation_checkpointing: auto, all or none, as
// --activation-checkpointing; DeepSpeed's own activation_checkpointing section does not choose
// that, see ApplyConfig).
void ApplyStrataStep(Context& c, const json& s, TrainFlags* f) {
  Reader& r = c.r;
  if (const json* v = Find(s, "update_during_backward")) {
    if (v->is_boolean()) {
      f->update_during_backward = v->get<bool>() ? "on" : "off";
    } else {
      r.Set(&f->update_during_backward,
            Reader::Choice(*v, "strata.update_during_backward", {"on", "off", "auto"}));
    }
  }
  if (const json* v = Find(s, "schedule")) {
    r.Set(&f->schedule,
          Reader::Choice(*v, "strata.schedule", {"auto", "layer-major", "micro-batch-major"}));
  }
  if (const json* v = Find(s, "activation_checkpointing")) {
    r.Set(&f->activation_checkpointing,
          Reader::Choice(*v, "strata.activation_checkpointing", {"auto", "all", "none"}));
  }
}

void ApplyStrata(Context& c, const json& s, TrainFlags* f) {
  Reader& r = c.r;
  if (const json* v = Find(s, "io_backend")) {
    r.Set(&f->io_backend, Reader::Choice(*v, "strata.io_backend", {"auto", "uring", "posix"}));
  }
  if (const json* v = Find(s, "device")) {
    r.Set(&f->device, Reader::Choice(*v, "strata.device", {"auto", "host", "cuda"}));
  }
  if (const json* v = Find(s, "device_budget")) {
    if (v->is_string() && v->get<std::string>() == "auto") {
      f->device_budget = "auto";
    } else {
      uint64_t bytes = 0;
      if (r.Set(&bytes, Reader::Size(*v, "strata.device_budget"))) {
        if (bytes == 0) {
          r.Add("'strata.device_budget' is zero; give a size such as \"64MiB\" or \"auto\"");
        } else {
          f->device_budget = std::to_string(bytes);
        }
      }
    }
  }
  ApplyStrataStep(c, s, f);
  ApplyStrataData(c, s, f);
  if (const json* v = Find(s, "summary_json")) {
    r.Set(&f->summary_json, Reader::String(*v, "strata.summary_json"));
  }
  if (const json* v = Find(s, "steps")) r.Set(&f->steps, Reader::Int(*v, "strata.steps", 1, kMax));
  if (const json* v = Find(s, "seq_len")) {
    r.Set(&f->seq_len, Reader::Int(*v, "strata.seq_len", 1, kMaxInt));
  }
  if (const json* v = Find(s, "seed")) r.Set(&f->seed, Reader::Int(*v, "strata.seed", 0, kMax));
  if (const json* v = Find(s, "warmup_steps")) {
    r.Set(&f->warmup_steps, Reader::Int(*v, "strata.warmup_steps", 0, kMax));
  }
  if (const json* v = Find(s, "eval_every")) {
    r.Set(&f->eval_every, Reader::Int(*v, "strata.eval_every", 0, kMax));
  }
  if (const json* v = Find(s, "eval_batches")) {
    r.Set(&f->eval_batches, Reader::Int(*v, "strata.eval_batches", 1, kMaxInt));
  }
  if (const json* v = Find(s, "sample_bytes")) {
    r.Set(&f->sample_bytes, Reader::Int(*v, "strata.sample_bytes", 0, kMax));
  }
  // Strata's own I/O settings, as `strata iobench --sweep` measured them (no DeepSpeed scaling).
  if (const json* v = Find(s, "io_queue_depth")) {
    r.Set(&f->io_queue_depth, Reader::Int(*v, "strata.io_queue_depth", 1, 4096));
  }
  if (const json* v = Find(s, "io_block_size")) {
    uint64_t block = 0;
    if (r.Set(&block, Reader::Size(*v, "strata.io_block_size"))) {
      if (block == 0 || block % 4096 != 0 || block > kGiB) {
        r.Add(
            fmt::format("'strata.io_block_size' must be a multiple of 4096 bytes between 4096 "
                        "and 1 GiB, got {}",
                        JsonExcerpt(*v)));
      } else {
        f->io_block_size = std::to_string(block);
      }
    }
  }
  if (const json* v = Find(s, "io_threads")) {
    r.Set(&f->io_threads, Reader::Int(*v, "strata.io_threads", 1, 256));
  }
  if (const json* v = Find(s, "copy_bandwidth")) {
    r.Set(&f->copy_bandwidth, Reader::Number(*v, "strata.copy_bandwidth", 0, false));
  }
}

void ApplyBatch(Context& c, const json& root, TrainFlags* f) {
  std::optional<int64_t> micro, accum, total;
  const auto read = [&](const char* key, std::optional<int64_t>* out) {
    if (const json* v = Find(root, key)) {
      int64_t n = 0;
      if (c.r.Set(&n, Reader::Int(*v, key, 1, kMaxInt))) *out = n;
    }
  };
  read("train_micro_batch_size_per_gpu", &micro);
  read("gradient_accumulation_steps", &accum);
  read("train_batch_size", &total);
  if (total.has_value()) {
    // As DeepSpeed: train_batch_size = micro-batch * accumulation * world size, the world being
    // the processes mpirun started (OMPI_COMM_WORLD_SIZE / PMI_SIZE), 1 without a launcher.
    int64_t world = 1;
    for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
      if (const char* v = std::getenv(var); v != nullptr && std::atoll(v) > 0) {
        world = std::atoll(v);
        break;
      }
    }
    const std::string procs = fmt::format("{} process{}", world, world == 1 ? "" : "es");
    if (micro && accum && *micro * *accum * world != *total) {
      c.r.Add(
          fmt::format("'train_batch_size' {} != train_micro_batch_size_per_gpu {} * "
                      "gradient_accumulation_steps {} * {}; fix one of them or leave one out",
                      *total, *micro, *accum, procs));
      return;
    }
    const auto derive = [&](int64_t known, const char* known_key) -> std::optional<int64_t> {
      if (*total % (known * world) != 0) {
        c.r.Add(fmt::format("'train_batch_size' {} is not a multiple of '{}' {} * {}", *total,
                            known_key, known, procs));
        return std::nullopt;
      }
      return *total / (known * world);
    };
    if (micro && !accum) {
      accum = derive(*micro, "train_micro_batch_size_per_gpu");
    } else if (accum && !micro) {
      micro = derive(*accum, "gradient_accumulation_steps");
    } else if (!micro && !accum) {
      if (*total % world != 0) {
        c.r.Add(fmt::format("'train_batch_size' {} is not a multiple of {}", *total, procs));
        return;
      }
      micro = *total / world;
      accum = 1;
    }
  } else if (micro && !accum) {
    accum = 1;  // DeepSpeed's default
  }
  if (micro) f->micro_batch_size = static_cast<int>(*micro);
  if (accum) f->grad_accum_steps = static_cast<int>(*accum);
  if (total) {
    // Kept as the global batch: the accumulation is derived again once the flags that override
    // the file and the real ranks are known (tools/train_setup.cc ApplyRanks).
    f->global_batch_size = static_cast<int>(*total);
    f->global_batch_from_config = true;
  }
}

}  // namespace

Status ApplyTrainConfigText(std::string_view text, std::string_view source, TrainFlags* f) {
  const auto error = [&](const std::string& message) {
    return InvalidArgumentError(fmt::format("{}: {}", source, message));
  };
  // "malformed JSON: parse error at line 3, column 5: ...", a number beyond double range
  // (1e999), or nesting past the limit: base/untrusted_text.h.
  auto parsed = ParseJsonBounded(text);
  if (!parsed.ok()) return error(parsed.status().message());
  const json root = std::move(*parsed);
  if (!root.is_object()) {
    return error(fmt::format("the top level must be a JSON object, got {}", TypeName(root)));
  }
  Context c;
  std::map<NoopReason, std::vector<std::string>> noops;
  KeyWalker walker(&c.r, &noops);
  walker.Walk(root, "", false);
  if (!walker.ignored_top().empty()) {
    c.notes.push_back(
        fmt::format("ignored (top-level keys DeepSpeed does not know; it ignores them too): {}",
                    fmt::join(walker.ignored_top(), ", ")));
  }

  ApplyBatch(c, root, f);
  if (const json* v = Find(root, "gradient_clipping")) {
    c.r.Set(&f->grad_clip, Reader::Number(*v, "gradient_clipping", 0, false));
  } else {
    // DeepSpeed's default is 0, no clipping (GRADIENT_CLIPPING_DEFAULT); Strata's flag default
    // clips at 1, so the difference is said.
    f->grad_clip = 0;
    c.notes.push_back(
        "no gradient_clipping: gradients are not clipped, as DeepSpeed (give gradient_clipping "
        "or --grad-clip to clip)");
  }
  if (const json* v = Find(root, "steps_per_print")) {
    c.r.Set(&f->log_every, Reader::Int(*v, "steps_per_print", 0, kMax));
  }
  if (const json* v = Find(root, "wall_clock_breakdown")) {
    c.r.Set(&f->wall_clock_breakdown, Reader::Bool(*v, "wall_clock_breakdown"));
  }
  ApplyPrecision(c, root, f);
  const json* opt = Find(root, "optimizer");
  if (opt != nullptr && opt->is_object()) ApplyOptimizer(c, *opt, f);
  const json* sched = Find(root, "scheduler");
  if (sched != nullptr && sched->is_object()) {
    const json* params = opt ? Find(*opt, "params") : nullptr;
    ApplyScheduler(c, *sched, params != nullptr && Find(*params, "lr") != nullptr, f);
  } else if (opt != nullptr) {
    f->lr_schedule = "constant";  // DeepSpeed: an optimizer and no scheduler keeps its lr
  }
  ApplyZero(c, Find(root, "zero_optimization"), f);
  if (const json* v = Find(root, "aio"); v != nullptr && v->is_object()) ApplyAio(c, *v, f);
  // DeepSpeed's activation_checkpointing section configures the checkpoints a model's own code
  // takes (deepspeed.checkpointing.checkpoint around its layers): where they live, not which
  // layers recompute. Here the plan chooses that per layer (strata.activation_checkpointing,
  // auto by default: the same results bit for bit, less recomputation where memory allows), so
  // only cpu_checkpointing maps (the boundary activations in pinned host memory); the other keys
  // (partition_activations, contiguous_memory_optimization, number_checkpoints, ...) are no-ops
  // (tools/deepspeed_keys.cc).
  if (const json* ac = Find(root, "activation_checkpointing"); ac != nullptr && ac->is_object()) {
    if (const json* v = Find(*ac, "cpu_checkpointing")) {
      c.r.Set(&f->offload_activations,
              Reader::Bool(*v, "activation_checkpointing.cpu_checkpointing"));
    }
  }
  ApplyMonitor(c, root, "tensorboard", &f->tensorboard_dir);
  ApplyMonitor(c, root, "csv_monitor", &f->metrics_csv_dir);
  if (const json* v = Find(root, "strata"); v != nullptr && v->is_object()) {
    ApplyStrata(c, *v, f);
    ApplyLoraSection(c, *v, &f->lora);
  }

  const auto& problems = c.r.problems();
  if (problems.size() == 1) return error(problems[0]);
  if (!problems.empty()) {
    return error(fmt::format("{} problems:\n  {}", problems.size(), fmt::join(problems, "\n  ")));
  }
  for (const auto& [why, paths] : noops) {
    c.notes.push_back(fmt::format("ignored ({}): {}", NoopReasonText(why), fmt::join(paths, ", ")));
  }
  f->config_notes.insert(f->config_notes.end(), c.notes.begin(), c.notes.end());
  return Status::Ok();
}

Status ApplyTrainConfigFile(const std::string& path, TrainFlags* f) {
  // Opened non-blocking and checked to be a regular file first: a FIFO is refused, not waited
  // on. A DeepSpeed config is a few KiB; 16 MiB is far beyond any.
  auto text = ReadSmallFile(path, {.max_bytes = uint64_t{16} << 20});
  if (!text.ok()) return text.status();  // names the path; the caller names --config
  return ApplyTrainConfigText(*text, path, f);
}

}  // namespace strata::tools
