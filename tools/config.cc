#include "tools/config.h"

#include <fmt/format.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <vector>

#include "base/units.h"

namespace strata::tools {
namespace {

using json = nlohmann::json;

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

// Validates values against the key they came from and words errors with its JSON path.
class Reader {
 public:
  explicit Reader(std::string_view source) : source_(source) {}

  Status Error(const std::string& message) const {
    return InvalidArgumentError(fmt::format("{}: {}", source_, message));
  }

  Status WrongValue(const std::string& path, const json& v, std::string_view expected) const {
    std::string hint;
    if (v.is_string() && v.get<std::string>() == "auto") {
      hint = "; \"auto\" is filled in by the Hugging Face Trainer, give the value itself";
    }
    return Error(
        fmt::format("'{}' must be {}, got {} ({}){}", path, expected, v.dump(), TypeName(v), hint));
  }

  // Rejects keys of `obj` not in `accepted`; `obj` must be an object.
  Status CheckObject(const json& obj, const std::string& path,
                     std::initializer_list<std::string_view> accepted) const {
    if (!obj.is_object()) {
      return path.empty()
                 ? Error(fmt::format("the top level must be a JSON object, got {}", TypeName(obj)))
                 : WrongValue(path, obj, "an object");
    }
    for (const auto& [key, value] : obj.items()) {
      bool known = false;
      for (std::string_view a : accepted) known = known || key == a;
      if (!known) {
        return Error(fmt::format("unknown key '{}{}'; accepted: {}", path.empty() ? "" : path + ".",
                                 key, fmt::join(accepted, ", ")));
      }
    }
    return Status::Ok();
  }

  StatusOr<int64_t> Int(const json& v, const std::string& path, int64_t lo, int64_t hi) const {
    const std::string expected = hi == std::numeric_limits<int64_t>::max()
                                     ? fmt::format("an integer >= {}", lo)
                                     : fmt::format("an integer in {}..{}", lo, hi);
    int64_t x = 0;
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) {
        return Error(fmt::format("'{}' must be {}, got {}", path, expected, v.dump()));
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
      return Error(fmt::format("'{}' must be {}, got {}", path, expected, v.dump()));
    }
    return x;
  }

  // A number in [lo, hi] (lo excluded when lo_open).
  StatusOr<double> Number(const json& v, const std::string& path, double lo, bool lo_open,
                          double hi = std::numeric_limits<double>::infinity(),
                          bool hi_open = false) const {
    std::string range = fmt::format("{}{}", lo_open ? "> " : ">= ", lo);
    if (std::isfinite(hi)) {
      range = fmt::format("in {}{}, {}{}", lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]");
    }
    const std::string expected = "a number " + range;
    if (!v.is_number()) return WrongValue(path, v, expected);
    const double x = v.get<double>();
    const bool ok =
        std::isfinite(x) && (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi);
    if (!ok) return Error(fmt::format("'{}' must be {}, got {}", path, expected, v.dump()));
    return x;
  }

  StatusOr<bool> Bool(const json& v, const std::string& path) const {
    if (!v.is_boolean()) return WrongValue(path, v, "true or false");
    return v.get<bool>();
  }

  StatusOr<std::string> String(const json& v, const std::string& path) const {
    if (!v.is_string()) return WrongValue(path, v, "a string");
    return v.get<std::string>();
  }

  StatusOr<std::string> Choice(const json& v, const std::string& path,
                               std::initializer_list<std::string_view> choices) const {
    const std::string expected = fmt::format("one of \"{}\"", fmt::join(choices, "\", \""));
    if (!v.is_string()) return WrongValue(path, v, expected);
    const std::string s = v.get<std::string>();
    for (std::string_view c : choices) {
      if (s == c) return s;
    }
    return Error(fmt::format("'{}' must be {}, got {}", path, expected, v.dump()));
  }

  // A byte size: a JSON integer or a string with units ("1MiB"), as ParseSize.
  StatusOr<uint64_t> Size(const json& v, const std::string& path) const {
    if (v.is_string()) {
      auto parsed = ParseSize(v.get<std::string>());
      if (!parsed.ok()) return Error(fmt::format("'{}': {}", path, parsed.status().message()));
      return *parsed;
    }
    STRATA_ASSIGN_OR_RETURN(int64_t n, Int(v, path, 0, std::numeric_limits<int64_t>::max()));
    return static_cast<uint64_t>(n);
  }

  // A string or an array of non-empty strings.
  StatusOr<std::vector<std::string>> Paths(const json& v, const std::string& path) const {
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
      if (p.empty()) return Error(fmt::format("'{}' contains an empty path", path));
    }
    return out;
  }

 private:
  std::string source_;
};

// Looks a key up; nullptr when absent.
const json* Find(const json& obj, std::string_view key) {
  auto it = obj.find(std::string(key));
  return it == obj.end() ? nullptr : &*it;
}

Status ApplyOptimizer(const Reader& r, const json& opt, TrainFlags* f) {
  STRATA_RETURN_IF_ERROR(r.CheckObject(opt, "optimizer", {"type", "params"}));
  std::string type = "adamw";
  if (const json* t = Find(opt, "type")) {
    constexpr std::string_view kTypes =
        "\"AdamW\", \"Adam\", \"AdamW8bit\", \"Adafactor\", \"Lion\", \"SGD\" or \"Adagrad\"";
    if (!t->is_string()) return r.WrongValue("optimizer.type", *t, kTypes);
    type = t->get<std::string>();
    for (char& c : type) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (type != "adamw" && type != "adam" && type != "adamw8bit" && type != "adafactor" &&
        type != "lion" && type != "sgd" && type != "adagrad") {
      return r.Error(
          fmt::format("'optimizer.type' {} is not supported: Strata's CPU optimizers are {}",
                      t->dump(), kTypes));
    }
  }
  // DeepSpeed: "Adam" is AdamW unless adam_w_mode=false.
  f->optimizer = type == "adam" ? "adamw" : type;
  f->adam_decoupled_weight_decay = true;
  const json* params = Find(opt, "params");
  if (params == nullptr) return Status::Ok();
  STRATA_RETURN_IF_ERROR(r.CheckObject(
      *params, "optimizer.params",
      {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "momentum"}));
  if (const json* v = Find(*params, "lr")) {
    STRATA_ASSIGN_OR_RETURN(f->lr, r.Number(*v, "optimizer.params.lr", 0, true));
  }
  if (const json* v = Find(*params, "betas")) {
    constexpr std::string_view kExpected = "[beta1, beta2], each in [0, 1)";
    if (!v->is_array() || v->size() != 2)
      return r.WrongValue("optimizer.params.betas", *v, kExpected);
    STRATA_ASSIGN_OR_RETURN(f->adam_beta1,
                            r.Number((*v)[0], "optimizer.params.betas[0]", 0, false, 1, true));
    STRATA_ASSIGN_OR_RETURN(f->adam_beta2,
                            r.Number((*v)[1], "optimizer.params.betas[1]", 0, false, 1, true));
  }
  if (const json* v = Find(*params, "eps")) {
    STRATA_ASSIGN_OR_RETURN(f->adam_eps, r.Number(*v, "optimizer.params.eps", 0, false));
  }
  if (const json* v = Find(*params, "weight_decay")) {
    STRATA_ASSIGN_OR_RETURN(f->weight_decay,
                            r.Number(*v, "optimizer.params.weight_decay", 0, false));
  }
  if (const json* v = Find(*params, "bias_correction")) {
    STRATA_ASSIGN_OR_RETURN(f->adam_bias_correction,
                            r.Bool(*v, "optimizer.params.bias_correction"));
  }
  if (const json* v = Find(*params, "momentum")) {
    if (type != "sgd") return r.Error("'optimizer.params.momentum' is for type \"SGD\" only");
    STRATA_ASSIGN_OR_RETURN(f->momentum, r.Number(*v, "optimizer.params.momentum", 0, false));
  }
  if (const json* v = Find(*params, "adam_w_mode")) {
    STRATA_ASSIGN_OR_RETURN(bool w, r.Bool(*v, "optimizer.params.adam_w_mode"));
    if (type == "adamw" && !w) {
      return r.Error(
          "'optimizer.params.adam_w_mode' false contradicts type \"AdamW\"; use type \"Adam\" "
          "for L2 weight decay");
    }
    f->adam_decoupled_weight_decay = w;
    if (type == "adam") f->optimizer = w ? "adamw" : "adam";
  }
  return Status::Ok();
}

Status ApplyPrecision(const Reader& r, const json& root, TrainFlags* f) {
  const json* fp16 = Find(root, "fp16");
  const json* bf16 = Find(root, "bf16");
  std::optional<bool> fp16_on, bf16_on;
  if (bf16 != nullptr) {
    STRATA_RETURN_IF_ERROR(r.CheckObject(*bf16, "bf16", {"enabled"}));
    if (const json* v = Find(*bf16, "enabled")) {
      STRATA_ASSIGN_OR_RETURN(bf16_on, r.Bool(*v, "bf16.enabled"));
    }
  }
  if (fp16 != nullptr) {
    STRATA_RETURN_IF_ERROR(r.CheckObject(
        *fp16, "fp16",
        {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale"}));
    if (const json* v = Find(*fp16, "enabled")) {
      STRATA_ASSIGN_OR_RETURN(fp16_on, r.Bool(*v, "fp16.enabled"));
    }
    if (const json* v = Find(*fp16, "loss_scale")) {
      STRATA_ASSIGN_OR_RETURN(double s, r.Number(*v, "fp16.loss_scale", 0, false));
      f->fp16_dynamic_loss_scale = s == 0;
      if (s > 0) f->fp16_initial_scale = s;
    }
    if (const json* v = Find(*fp16, "initial_scale_power")) {
      if (!f->fp16_dynamic_loss_scale) {
        return r.Error(
            "'fp16.initial_scale_power' is for dynamic loss scaling but 'fp16.loss_scale' sets a "
            "static scale; give one of them");
      }
      STRATA_ASSIGN_OR_RETURN(int64_t p, r.Int(*v, "fp16.initial_scale_power", 0, 24));
      f->fp16_initial_scale = std::ldexp(1.0, static_cast<int>(p));
    }
    if (const json* v = Find(*fp16, "loss_scale_window")) {
      STRATA_ASSIGN_OR_RETURN(f->fp16_scale_window, r.Int(*v, "fp16.loss_scale_window", 1,
                                                          std::numeric_limits<int64_t>::max()));
    }
    if (const json* v = Find(*fp16, "min_loss_scale")) {
      STRATA_ASSIGN_OR_RETURN(f->fp16_min_scale, r.Number(*v, "fp16.min_loss_scale", 0, true));
    }
  }
  if (fp16_on.value_or(false) && bf16_on.value_or(false)) {
    return r.Error("'fp16.enabled' and 'bf16.enabled' are both true; enable at most one");
  }
  if (fp16_on.value_or(false)) {
    f->precision = "fp16";
  } else if (bf16_on.value_or(false)) {
    f->precision = "bf16";
  } else if (fp16_on.has_value() && bf16_on.has_value()) {
    f->precision = "fp32";  // both sections say disabled: full precision, as in DeepSpeed
  }
  return Status::Ok();
}

// offload_optimizer / offload_param: device, nvme_path, pin_memory.
Status ApplyOffload(const Reader& r, const json& section, const std::string& path, bool is_param,
                    TrainFlags* f, std::optional<std::vector<std::string>>* nvme_paths) {
  STRATA_RETURN_IF_ERROR(r.CheckObject(section, path, {"device", "nvme_path", "pin_memory"}));
  if (const json* v = Find(section, "device")) {
    std::string device;
    if (is_param) {
      STRATA_ASSIGN_OR_RETURN(device, r.Choice(*v, path + ".device", {"cpu", "nvme", "none"}));
      f->offload_params = device == "cpu" ? "host" : device == "none" ? "device" : "nvme";
    } else {
      STRATA_ASSIGN_OR_RETURN(device, r.Choice(*v, path + ".device", {"cpu", "nvme"}));
      f->offload_optimizer = device == "cpu" ? "host" : "nvme";
    }
  }
  if (const json* v = Find(section, "nvme_path")) {
    STRATA_ASSIGN_OR_RETURN(auto paths, r.Paths(*v, path + ".nvme_path"));
    if (nvme_paths->has_value() && **nvme_paths != paths) {
      return r.Error(fmt::format(
          "'{}.nvme_path' differs from the other offload section's nvme_path; Strata stripes "
          "parameters and optimizer state over one set of directories",
          path));
    }
    *nvme_paths = std::move(paths);
  }
  if (const json* v = Find(section, "pin_memory")) {
    STRATA_RETURN_IF_ERROR(r.Bool(*v, path + ".pin_memory").status());
  }
  return Status::Ok();
}

Status ApplyZero(const Reader& r, const json& zero, TrainFlags* f) {
  STRATA_RETURN_IF_ERROR(
      r.CheckObject(zero, "zero_optimization", {"stage", "offload_optimizer", "offload_param"}));
  if (const json* v = Find(zero, "stage")) {
    STRATA_ASSIGN_OR_RETURN(int64_t stage, r.Int(*v, "zero_optimization.stage", 0, 3));
    if (stage != 3) {
      return r.Error(fmt::format(
          "'zero_optimization.stage' {} is not supported: Strata streams parameters, gradients "
          "and optimizer state per block like ZeRO stage 3; use 3 (or leave the key out)",
          stage));
    }
  }
  std::optional<std::vector<std::string>> nvme_paths;
  if (const json* v = Find(zero, "offload_optimizer")) {
    STRATA_RETURN_IF_ERROR(
        ApplyOffload(r, *v, "zero_optimization.offload_optimizer", false, f, &nvme_paths));
  }
  if (const json* v = Find(zero, "offload_param")) {
    STRATA_RETURN_IF_ERROR(
        ApplyOffload(r, *v, "zero_optimization.offload_param", true, f, &nvme_paths));
  }
  if (nvme_paths.has_value()) f->nvme_paths = *nvme_paths;
  return Status::Ok();
}

Status ApplyAio(const Reader& r, const json& aio, TrainFlags* f) {
  STRATA_RETURN_IF_ERROR(r.CheckObject(aio, "aio", {"block_size", "queue_depth", "thread_count"}));
  if (const json* v = Find(aio, "block_size")) {
    STRATA_ASSIGN_OR_RETURN(uint64_t bytes, r.Size(*v, "aio.block_size"));
    if (bytes == 0 || bytes % 4096 != 0 || bytes > kGiB) {
      return r.Error(fmt::format(
          "'aio.block_size' must be a multiple of 4096 bytes between 4096 and 1 GiB, got {}",
          v->dump()));
    }
    f->io_block_size = std::to_string(bytes);
  }
  if (const json* v = Find(aio, "queue_depth")) {
    STRATA_ASSIGN_OR_RETURN(int64_t q, r.Int(*v, "aio.queue_depth", 1, 4096));
    f->io_queue_depth = static_cast<int>(q);
  }
  if (const json* v = Find(aio, "thread_count")) {
    STRATA_ASSIGN_OR_RETURN(int64_t t, r.Int(*v, "aio.thread_count", 1, 256));
    f->io_threads = static_cast<int>(t);
  }
  return Status::Ok();
}

Status ApplyStrata(const Reader& r, const json& s, TrainFlags* f) {
  STRATA_RETURN_IF_ERROR(
      r.CheckObject(s, "strata",
                    {"io_backend", "device", "device_budget", "model", "data", "steps", "seq_len",
                     "seed", "warmup_steps", "eval_every", "eval_batches", "sample_bytes",
                     "summary_json", "copy_bandwidth"}));
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  if (const json* v = Find(s, "io_backend")) {
    STRATA_ASSIGN_OR_RETURN(f->io_backend,
                            r.Choice(*v, "strata.io_backend", {"auto", "uring", "posix"}));
  }
  if (const json* v = Find(s, "device")) {
    STRATA_ASSIGN_OR_RETURN(f->device, r.Choice(*v, "strata.device", {"auto", "host", "cuda"}));
  }
  if (const json* v = Find(s, "device_budget")) {
    if (v->is_string() && v->get<std::string>() == "auto") {
      f->device_budget = "auto";
    } else {
      STRATA_ASSIGN_OR_RETURN(uint64_t bytes, r.Size(*v, "strata.device_budget"));
      if (bytes == 0) {
        return r.Error("'strata.device_budget' is zero; give a size such as \"64MiB\" or \"auto\"");
      }
      f->device_budget = std::to_string(bytes);
    }
  }
  if (const json* v = Find(s, "model")) {
    STRATA_ASSIGN_OR_RETURN(f->model, r.String(*v, "strata.model"));
  }
  if (const json* v = Find(s, "data")) {
    STRATA_ASSIGN_OR_RETURN(std::string data, r.String(*v, "strata.data"));
    f->data = {data};
  }
  if (const json* v = Find(s, "summary_json")) {
    STRATA_ASSIGN_OR_RETURN(f->summary_json, r.String(*v, "strata.summary_json"));
  }
  if (const json* v = Find(s, "steps")) {
    STRATA_ASSIGN_OR_RETURN(f->steps, r.Int(*v, "strata.steps", 1, kMax));
  }
  if (const json* v = Find(s, "seq_len")) {
    STRATA_ASSIGN_OR_RETURN(int64_t n, r.Int(*v, "strata.seq_len", 1, kMaxInt));
    f->seq_len = static_cast<int>(n);
  }
  if (const json* v = Find(s, "seed")) {
    STRATA_ASSIGN_OR_RETURN(int64_t n, r.Int(*v, "strata.seed", 0, kMax));
    f->seed = static_cast<uint64_t>(n);
  }
  if (const json* v = Find(s, "warmup_steps")) {
    STRATA_ASSIGN_OR_RETURN(f->warmup_steps, r.Int(*v, "strata.warmup_steps", 0, kMax));
  }
  if (const json* v = Find(s, "eval_every")) {
    STRATA_ASSIGN_OR_RETURN(f->eval_every, r.Int(*v, "strata.eval_every", 0, kMax));
  }
  if (const json* v = Find(s, "eval_batches")) {
    STRATA_ASSIGN_OR_RETURN(int64_t n, r.Int(*v, "strata.eval_batches", 1, kMaxInt));
    f->eval_batches = static_cast<int>(n);
  }
  if (const json* v = Find(s, "sample_bytes")) {
    STRATA_ASSIGN_OR_RETURN(f->sample_bytes, r.Int(*v, "strata.sample_bytes", 0, kMax));
  }
  if (const json* v = Find(s, "copy_bandwidth")) {
    STRATA_ASSIGN_OR_RETURN(f->copy_bandwidth, r.Number(*v, "strata.copy_bandwidth", 0, false));
  }
  return Status::Ok();
}

}  // namespace

Status ApplyTrainConfigText(std::string_view text, std::string_view source, TrainFlags* f) {
  const Reader r(source);
  json root;
  try {
    root = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    // e.what() is "[json.exception.parse_error.101] parse error at line 3, column 5: ...".
    std::string what = e.what();
    const auto pos = what.find("parse error");
    if (pos != std::string::npos) what = what.substr(pos);
    return r.Error(fmt::format("malformed JSON: {}", what));
  } catch (const json::exception& e) {
    // out_of_range: a number too large for a double (e.g. 1e999).
    return r.Error(fmt::format("malformed JSON: {}", e.what()));
  }
  STRATA_RETURN_IF_ERROR(
      r.CheckObject(root, "",
                    {"train_batch_size", "train_micro_batch_size_per_gpu",
                     "gradient_accumulation_steps", "gradient_clipping", "steps_per_print", "fp16",
                     "bf16", "optimizer", "zero_optimization", "aio", "strata"}));
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  std::optional<int64_t> micro, accum, total;
  if (const json* v = Find(root, "train_micro_batch_size_per_gpu")) {
    STRATA_ASSIGN_OR_RETURN(micro, r.Int(*v, "train_micro_batch_size_per_gpu", 1, kMaxInt));
  }
  if (const json* v = Find(root, "gradient_accumulation_steps")) {
    STRATA_ASSIGN_OR_RETURN(accum, r.Int(*v, "gradient_accumulation_steps", 1, kMaxInt));
  }
  if (const json* v = Find(root, "train_batch_size")) {
    STRATA_ASSIGN_OR_RETURN(total, r.Int(*v, "train_batch_size", 1, kMaxInt));
  }
  if (total.has_value()) {
    // One process (world size 1): train_batch_size = micro-batch * accumulation, as DeepSpeed.
    if (micro && accum && *micro * *accum != *total) {
      return r.Error(fmt::format(
          "'train_batch_size' {} != train_micro_batch_size_per_gpu {} * "
          "gradient_accumulation_steps {} (one process); fix one of them or leave one out",
          *total, *micro, *accum));
    }
    const auto derive = [&](int64_t known, const char* known_key) -> StatusOr<int64_t> {
      if (*total % known != 0) {
        return r.Error(fmt::format("'train_batch_size' {} is not a multiple of '{}' {}", *total,
                                   known_key, known));
      }
      return *total / known;
    };
    if (micro && !accum) {
      STRATA_ASSIGN_OR_RETURN(accum, derive(*micro, "train_micro_batch_size_per_gpu"));
    } else if (accum && !micro) {
      STRATA_ASSIGN_OR_RETURN(micro, derive(*accum, "gradient_accumulation_steps"));
    } else if (!micro && !accum) {
      micro = *total;
      accum = 1;
    }
  }
  if (micro) f->micro_batch_size = static_cast<int>(*micro);
  if (accum) f->grad_accum_steps = static_cast<int>(*accum);
  if (const json* v = Find(root, "gradient_clipping")) {
    STRATA_ASSIGN_OR_RETURN(f->grad_clip, r.Number(*v, "gradient_clipping", 0, false));
  }
  if (const json* v = Find(root, "steps_per_print")) {
    STRATA_ASSIGN_OR_RETURN(f->log_every,
                            r.Int(*v, "steps_per_print", 0, std::numeric_limits<int64_t>::max()));
  }
  STRATA_RETURN_IF_ERROR(ApplyPrecision(r, root, f));
  if (const json* v = Find(root, "optimizer")) STRATA_RETURN_IF_ERROR(ApplyOptimizer(r, *v, f));
  if (const json* v = Find(root, "zero_optimization")) STRATA_RETURN_IF_ERROR(ApplyZero(r, *v, f));
  if (const json* v = Find(root, "aio")) STRATA_RETURN_IF_ERROR(ApplyAio(r, *v, f));
  if (const json* v = Find(root, "strata")) STRATA_RETURN_IF_ERROR(ApplyStrata(r, *v, f));
  return Status::Ok();
}

Status ApplyTrainConfigFile(const std::string& path, TrainFlags* f) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoToStatus(errno, fmt::format("--config '{}'", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return ErrnoToStatus(errno, fmt::format("reading --config '{}'", path));
  return ApplyTrainConfigText(ss.str(), path, f);
}

}  // namespace strata::tools
