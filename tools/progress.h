// Progress output of `strata train`: the plain per-interval lines, and a live line redrawn in
// place on a terminal.
//
// What goes where (chosen by ProgressModeFor from isatty of stdout and stderr):
//   stderr not a terminal (CI, pipes, `2>file`): kPlain. Every --log-every steps (and after the
//     first and the last step) one plain line on stdout, the format tests and scripts parse:
//       step     4/300 | loss 3.1416 | norm  0.812 | lr 3.00e-03 |   12345 tok/s[ | MFU 41.2%] |
//       h2d 1.2 MiB d2h 1.1 MiB | nvme r 4.0 MiB w 4.0 MiB[ | skipped (overflow)]
//     (one line; tok/s, MFU and bytes are over the steps since the previous plain line; MFU only
//     when the device's peak is known, ProgressOptions::peak_flops_per_s). Nothing on stderr, no
//     `\r`, no escape sequences.
//   stderr a terminal, stdout not (`strata train > log`): kLiveAndPlain. The live line on stderr,
//     and the same plain lines on stdout, so the log file keeps the history.
//   both terminals: kLiveCommitted. Only the live line; at the plain lines' cadence it is
//     "committed": drawn once more and ended with a newline, so the scrollback keeps a history
//     and a new live line starts below it. (A plain line on the same terminal would repeat it.)
//   --log-every 0 (log_every 0) turns off the plain lines and the commits, not the live line.
//
// The live line: `\r` + text + `\x1b[K` (erase to end of line), no newline, redrawn after each
// step, at most once per 0.1 s (kMinRedrawSeconds) except that the first step, the last step and
// commits are always drawn. Its text:
//   step 12/300 | loss 3.1416 | ETA 1m23s | 12345 tok/s[ | MFU 41.2%] | lr 3.00e-03 | norm 0.812 |
//   h2d 1.2 MiB d2h 1.1 MiB nvme r 4.0 MiB w 4.0 MiB /step
// with `skipped` after the loss on a step whose update an overflow skipped. tok/s and the ETA
// come from the mean wall time per step over the last kRateWindowSteps (16) steps, measured
// step end to step end with the time spent inside a Suspend() (validation, checkpoints)
// left out: the ETA counts the remaining training steps only. Bytes are those of the last step.
// The text is cut to the terminal's width less one column (TIOCGWINSZ on the live stream, read
// at every draw; 80 when unknown) at the last ` | ` that fits, so it never wraps.
//
// Any other output while the line is live goes inside a Suspend(): the line is cleared
// (`\r\x1b[K`) first and redrawn when the guard ends. Finish() (also run by the destructor, so
// an error return ends the line too) ends a live line with a newline.
//
// Thread-safety: none; one thread (the training loop) uses a ProgressLine.
#pragma once

#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <string>

namespace strata::tools {

enum class ProgressMode {
  kPlain,          // plain lines on stdout only
  kLiveAndPlain,   // live line on stderr, plain lines on stdout
  kLiveCommitted,  // live line on stderr, committed with a newline at the plain cadence
};

// The mode for a run whose stdout / stderr are (or are not) terminals; see the file comment.
ProgressMode ProgressModeFor(bool stdout_is_terminal, bool stderr_is_terminal);

// "42s", "1m23s", "2h05m", "3d04h"; rounded to whole seconds. "--" for a negative or
// non-finite value (not known yet).
std::string FormatEta(double seconds);

// `text` if it is shorter than `width` columns (one column stays free so the cursor never
// reaches the last one, where some terminals wrap); else cut at the last " | " separator
// whose prefix fits, or hard at width - 1 characters when not even the first field fits.
// "" for width <= 1. Assumes one column per byte (the line is ASCII).
std::string FitToWidth(const std::string& text, int width);

// What one finished optimizer step reports.
struct StepReport {
  int64_t step = 0;  // steps done so far, 1-based (the step just finished)
  float loss = 0;
  double grad_norm = 0;  // global L2 norm of the unscaled gradient
  double lr = 0;
  bool skipped = false;  // the loss scaler skipped this step's update (overflow)
  // More of the step for the line, shown after the loss when not empty (preference training:
  // "acc 0.75 margin 0.123").
  std::string detail = "";
  // Cumulative engine counters after the step, in bytes.
  uint64_t bytes_h2d = 0;
  uint64_t bytes_d2h = 0;
  uint64_t nvme_bytes_read = 0;
  uint64_t nvme_bytes_written = 0;
};

struct ProgressOptions {
  ProgressMode mode = ProgressMode::kPlain;
  int64_t total_steps = 0;
  int64_t log_every = 0;        // plain lines / commits every N steps; 0 = none
  int64_t tokens_per_step = 0;  // for tok/s
  // MFU = model_flops_per_token x tok/s / peak_flops_per_s (engine/plan/model_flops.h), shown
  // when both are positive: the model FLOPs per token (recomputation not counted) and the dense
  // bf16 peak of every device the tokens are spread over together (FLOP/s; the machine profile's
  // peak_bf16_TFLOPs x 1e12 x ranks). 0: unknown, no MFU field.
  int64_t model_flops_per_token = 0;
  double peak_flops_per_s = 0;
  // Cumulative counters before the first step (a resumed run starts from a later step).
  StepReport start;
  // Monotonic seconds; default std::chrono::steady_clock.
  std::function<double()> clock;
  // Columns of the terminal the live line is drawn on; default TIOCGWINSZ on `live_out`'s fd
  // (80 when that fails).
  std::function<int()> terminal_width;
};

class ProgressLine {
 public:
  static constexpr double kMinRedrawSeconds = 0.1;
  static constexpr int kRateWindowSteps = 16;

  // `plain_out` (stdout) gets the plain lines and `live_out` (stderr) the live line; neither
  // is owned, both must outlive this object. The step clock starts here.
  ProgressLine(ProgressOptions options, std::FILE* plain_out, std::FILE* live_out);
  ~ProgressLine();  // Finish()
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // After every optimizer step, steps in increasing order: prints the plain line or commit
  // due at this step and redraws the live line (rate-limited).
  void Update(const StepReport& report);
  // After work between steps that is not a step's (an evaluation, a checkpoint, and the Flush
  // before them): its bytes, those of `counters` (cumulative, as StepReport's) beyond the last
  // step's, are not charged to the next step's line nor to the plain line's interval.
  void SkipBytes(const StepReport& counters);

  // Clears the live line until the guard ends, then redraws it; the time in between is left
  // out of the step rate and the plain lines' tok/s. Not nested.
  class Suspension {
   public:
    explicit Suspension(ProgressLine* line) : line_(line) {}
    ~Suspension() { line_->Resume(); }
    Suspension(const Suspension&) = delete;
    Suspension& operator=(const Suspension&) = delete;

   private:
    ProgressLine* line_;
  };
  [[nodiscard]] Suspension Suspend();

  // Draws the last step's state if it was not drawn yet and ends the live line with a
  // newline; later Update calls print plain lines only. Idempotent.
  void Finish();

  // The live line's text for the last Update, not cut to any width ("" before the first).
  const std::string& live_text() const { return live_text_; }

 private:
  bool live() const { return options_.mode != ProgressMode::kPlain && !finished_; }
  void Draw(bool newline);
  void ClearLine();
  void Resume();
  void Write(std::FILE* out, const std::string& s);
  // " | MFU 41.2%" at `tokens_per_second`, or "" without a peak.
  std::string MfuField(double tokens_per_second) const;

  ProgressOptions options_;
  std::FILE* plain_out_;
  std::FILE* live_out_;

  // Step timing: the end of the previous step (or of the last suspension).
  double mark_ = 0;
  std::deque<double> recent_step_seconds_;  // the last kRateWindowSteps, oldest first
  StepReport previous_;                     // counters after the previous step

  // Plain-line interval: steps, seconds and counters since the previous plain line.
  int64_t interval_steps_ = 0;
  double interval_seconds_ = 0;
  StepReport interval_start_;

  std::string live_text_;
  bool drawn_ = false;           // a live line is on the screen without its newline
  bool last_step_drawn_ = true;  // the latest Update's state is what is on the screen
  bool redraw_after_suspension_ = false;
  double last_draw_ = 0;
  bool any_draw_ = false;
  bool finished_ = false;
};

}  // namespace strata::tools
