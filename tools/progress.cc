#include "tools/progress.h"

#include <fmt/format.h>
#include <sys/ioctl.h>

#include <chrono>
#include <cmath>
#include <utility>

#include "base/units.h"

namespace strata::tools {

ProgressMode ProgressModeFor(bool stdout_is_terminal, bool stderr_is_terminal) {
  if (!stderr_is_terminal) return ProgressMode::kPlain;
  return stdout_is_terminal ? ProgressMode::kLiveCommitted : ProgressMode::kLiveAndPlain;
}

std::string FormatEta(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--";
  const long long s = std::llround(seconds);
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  if (s < 86400) return fmt::format("{}h{:02}m", s / 3600, s % 3600 / 60);
  return fmt::format("{}d{:02}h", s / 86400, s % 86400 / 3600);
}

std::string FitToWidth(const std::string& text, int width) {
  if (width <= 1) return "";
  const size_t limit = static_cast<size_t>(width) - 1;
  if (text.size() <= limit) return text;
  const size_t cut = text.rfind(" | ", limit);
  if (cut != std::string::npos && cut > 0) return text.substr(0, cut);
  return text.substr(0, limit);
}

namespace {

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int TerminalWidth(std::FILE* out) {
  winsize ws{};
  if (out != nullptr && ::ioctl(::fileno(out), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) {
    return ws.ws_col;
  }
  return 80;
}

}  // namespace

ProgressLine::ProgressLine(ProgressOptions options, std::FILE* plain_out, std::FILE* live_out)
    : options_(std::move(options)), plain_out_(plain_out), live_out_(live_out) {
  if (!options_.clock) options_.clock = SteadySeconds;
  if (!options_.terminal_width) {
    options_.terminal_width = [out = live_out_] { return TerminalWidth(out); };
  }
  mark_ = options_.clock();
  previous_ = options_.start;
  interval_start_ = options_.start;
}

ProgressLine::~ProgressLine() { Finish(); }

void ProgressLine::Write(std::FILE* out, const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), out);
  std::fflush(out);
}

std::string ProgressLine::MfuField(double tokens_per_second) const {
  if (options_.model_flops_per_token <= 0 || options_.peak_flops_per_s <= 0) return "";
  return fmt::format(" | MFU {:.1f}%", 100.0 * static_cast<double>(options_.model_flops_per_token) *
                                           tokens_per_second / options_.peak_flops_per_s);
}

void ProgressLine::Update(const StepReport& r) {
  const double now = options_.clock();
  const double dt = now - mark_;
  mark_ = now;
  recent_step_seconds_.push_back(dt);
  if (static_cast<int>(recent_step_seconds_.size()) > kRateWindowSteps) {
    recent_step_seconds_.pop_front();
  }
  ++interval_steps_;
  interval_seconds_ += dt;

  double window_seconds = 0;
  for (double s : recent_step_seconds_) window_seconds += s;
  const double seconds_per_step = window_seconds / recent_step_seconds_.size();
  const double eta = seconds_per_step * static_cast<double>(options_.total_steps - r.step);
  const double live_rate = seconds_per_step > 0 ? options_.tokens_per_step / seconds_per_step : 0.0;
  live_text_ = fmt::format(
      "step {}/{} | loss {:.4f}{}{} | ETA {} | {:.0f} tok/s{} | lr {:.2e} | norm {:.3f} | "
      "h2d {} d2h {} nvme r {} w {} /step",
      r.step, options_.total_steps, r.loss, r.detail.empty() ? "" : " | " + r.detail,
      r.skipped ? " | skipped" : "", FormatEta(seconds_per_step > 0 ? eta : NAN), live_rate,
      MfuField(live_rate), r.lr, r.grad_norm, FormatBytes(r.bytes_h2d - previous_.bytes_h2d),
      FormatBytes(r.bytes_d2h - previous_.bytes_d2h),
      FormatBytes(r.nvme_bytes_read - previous_.nvme_bytes_read),
      FormatBytes(r.nvme_bytes_written - previous_.nvme_bytes_written));
  previous_ = r;

  const int64_t every = options_.log_every;
  const bool due =
      every > 0 && (r.step % every == 0 || r.step == 1 || r.step == options_.total_steps);
  if (due && (options_.mode != ProgressMode::kLiveCommitted || finished_)) {
    const StepReport& a = interval_start_;
    const double rate = options_.tokens_per_step * interval_steps_ / interval_seconds_;
    Write(
        plain_out_,
        fmt::format("step {:5}/{} | loss {:.4f}{} | norm {:6.3f} | lr {:.2e} | {:7.0f} tok/s{} | "
                    "h2d {} d2h {} | nvme r {} w {}{}\n",
                    r.step, options_.total_steps, r.loss, r.detail.empty() ? "" : " | " + r.detail,
                    r.grad_norm, r.lr, rate, MfuField(rate), FormatBytes(r.bytes_h2d - a.bytes_h2d),
                    FormatBytes(r.bytes_d2h - a.bytes_d2h),
                    FormatBytes(r.nvme_bytes_read - a.nvme_bytes_read),
                    FormatBytes(r.nvme_bytes_written - a.nvme_bytes_written),
                    r.skipped ? " | skipped (overflow)" : ""));
  }
  if (due) {
    interval_steps_ = 0;
    interval_seconds_ = 0;
    interval_start_ = r;
  }
  if (!live()) return;
  last_step_drawn_ = false;
  if (due && options_.mode == ProgressMode::kLiveCommitted) {
    Draw(/*newline=*/true);
  } else if (!any_draw_ || r.step == options_.total_steps ||
             now - last_draw_ >= kMinRedrawSeconds) {
    Draw(/*newline=*/false);
  }
}

void ProgressLine::SkipBytes(const StepReport& counters) {
  auto skip = [&](uint64_t StepReport::*field) {
    interval_start_.*field += counters.*field - previous_.*field;
    previous_.*field = counters.*field;
  };
  for (uint64_t StepReport::*field :
       {&StepReport::bytes_h2d, &StepReport::bytes_d2h, &StepReport::nvme_bytes_read,
        &StepReport::nvme_bytes_written}) {
    skip(field);
  }
}

void ProgressLine::Draw(bool newline) {
  std::fflush(plain_out_);  // what the caller printed to stdout goes above the line
  const std::string text = FitToWidth(live_text_, options_.terminal_width());
  Write(live_out_, "\r" + text + "\x1b[K" + (newline ? "\n" : ""));
  drawn_ = !newline;
  last_step_drawn_ = true;
  any_draw_ = true;
  last_draw_ = options_.clock();
}

void ProgressLine::ClearLine() {
  if (!drawn_) return;
  Write(live_out_, "\r\x1b[K");
  drawn_ = false;
}

ProgressLine::Suspension ProgressLine::Suspend() {
  redraw_after_suspension_ = drawn_ || (live() && !last_step_drawn_);
  ClearLine();
  return Suspension(this);
}

void ProgressLine::Resume() {
  mark_ = options_.clock();
  if (redraw_after_suspension_ && live()) Draw(/*newline=*/false);
  redraw_after_suspension_ = false;
}

void ProgressLine::Finish() {
  if (finished_) return;
  if (live() && !last_step_drawn_) Draw(/*newline=*/false);
  if (drawn_) {
    std::fflush(plain_out_);
    Write(live_out_, "\n");
    drawn_ = false;
  }
  finished_ = true;
}

}  // namespace strata::tools
