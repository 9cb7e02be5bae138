#include "tools/train_loop.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "base/units.h"
#include "data/text_dataset.h"
#include "data/tokenizer.h"
#include "engine/plan/model_flops.h"
#include "tools/checkpoint_commands.h"
#include "tools/lr_schedule.h"
#include "tools/preference_training.h"
#include "tools/progress.h"

namespace strata::tools {
namespace {

using Clock = std::chrono::steady_clock;

static_assert(data::kIgnoreTarget == engine::kIgnoreTarget);

// Targets the loss counts in `batch`.
int64_t TargetsInLoss(const data::Batch& batch) {
  int64_t n = 0;
  for (int32_t t : batch.targets) n += t != data::kIgnoreTarget;
  return n;
}

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The mean loss over the counted targets of the validation batches (each batch's mean weighed by
// its counted targets: every batch alike for text and plain token files).
StatusOr<float> Evaluate(engine::Engine& e, const data::Dataset& data,
                         const TrainLoopOptions& loop) {
  data::Batch batch;
  double sum = 0;
  int64_t counted = 0;
  for (int i = 0; i < loop.eval_batches; ++i) {
    data.ValBatch(i, loop.eval_batches, loop.micro_batch_size, loop.seq_len, &batch);
    STRATA_ASSIGN_OR_RETURN(float loss,
                            e.EvaluateLoss({batch.tokens, batch.targets, batch.positions},
                                           {loop.micro_batch_size, loop.seq_len}));
    const int64_t n = TargetsInLoss(batch);
    sum += static_cast<double>(loss) * n;
    counted += n;
  }
  return counted > 0 ? static_cast<float>(sum / counted) : 0.0f;
}

// The first context of a sample: a newline, as a byte or through the tokenizer (its BOS when it
// has one).
StatusOr<std::vector<int32_t>> SampleContext(const data::Tokenizer* tokenizer) {
  if (!tokenizer) return data::TextDataset::Encode("\n");
  if (tokenizer->bos_id() >= 0) return std::vector<int32_t>{tokenizer->bos_id()};
  return tokenizer->Encode("\n");
}

// One token drawn from softmax(logits / temperature).
int32_t DrawToken(const std::vector<float>& logits, double temperature, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  double maxv = -INFINITY;
  for (float l : logits) maxv = std::max<double>(maxv, l);
  std::vector<double> p(logits.size());
  double z = 0;
  for (size_t i = 0; i < p.size(); ++i) z += p[i] = std::exp((logits[i] - maxv) / temperature);
  double r = uniform(rng) * z;
  size_t tok = 0;
  while (tok + 1 < p.size() && r >= p[tok]) r -= p[tok++];
  return static_cast<int32_t>(tok);
}

// A text sample of about loop.sample_bytes bytes: byte-level tokens, or decoded by the tokenizer.
StatusOr<std::string> Sample(engine::Engine& e, const TrainLoopOptions& loop, std::mt19937_64& rng,
                             const data::Tokenizer* tokenizer) {
  STRATA_ASSIGN_OR_RETURN(std::vector<int32_t> context, SampleContext(tokenizer));
  std::vector<int32_t> sampled;
  std::string out;
  const double temperature = 0.8;
  while (static_cast<int64_t>(out.size()) < loop.sample_bytes) {
    // A long sample (a forward per token) ends at a stop signal, as a step does.
    if (StopSignal() != 0) return CancelledError("while sampling text");
    const size_t keep = std::min<size_t>(context.size(), loop.seq_len);
    STRATA_ASSIGN_OR_RETURN(auto logits, e.NextTokenLogits(std::span(context).last(keep)));
    const int32_t tok = DrawToken(logits, temperature, rng);
    context.push_back(tok);
    if (tokenizer) {
      if (tok == tokenizer->eos_id()) break;
      sampled.push_back(tok);
      STRATA_ASSIGN_OR_RETURN(out, tokenizer->Decode(sampled));
    } else {
      out.push_back(static_cast<char>(tok));
    }
  }
  return out;
}

std::string Printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) out += (c == '\n' || c == '\t' || (c >= 32 && c < 127)) ? char(c) : '?';
  return out;
}

StepReport CountersReport(const engine::EngineCounters& c) {
  StepReport r;
  r.bytes_h2d = c.bytes_h2d;
  r.bytes_d2h = c.bytes_d2h;
  r.nvme_bytes_read = c.nvme_bytes_read;
  r.nvme_bytes_written = c.nvme_bytes_written;
  return r;
}

ProgressOptions ProgressOptionsFor(const TrainLoopInputs& in, int64_t tokens_per_step,
                                   const engine::EngineCounters& start) {
  const TrainLoopOptions& loop = in.options->loop;
  ProgressOptions p;
  p.model_flops_per_token = in.model_flops_per_token;
  p.peak_flops_per_s = in.peak_bf16_TFLOPs * 1e12 * in.options->ranks.ranks;
  p.mode = ProgressModeFor(::isatty(STDOUT_FILENO), ::isatty(STDERR_FILENO));
  p.total_steps = loop.steps;
  p.log_every = loop.log_every;
  p.tokens_per_step = tokens_per_step;
  p.start = CountersReport(start);
  return p;
}

// The steps from start_step on, and what follows the last one. One per run.
class TrainLoop {
 public:
  // preference: --objective dpo, ipo or simpo; null for sft.
  TrainLoop(const TrainLoopInputs& in, int64_t start_step, int64_t start_tokens_seen,
            std::mt19937_64 data_rng, std::unique_ptr<PreferenceTraining> preference);
  StatusOr<TrainOutcome> Run();

 private:
  // Runs fn (a Step, or the Flush that ends the update a Step left running) as training time.
  template <typename Fn>
  auto Timed(Fn&& fn);
  Status Flush();  // the update a Step left running, as training time
  void SampleBatches();
  Status Step(int64_t step);
  void PrintBreakdownLine(int64_t step);
  Status EvaluateAt(int64_t step);
  // The validation loss (and, with preference training, its metrics into out_.val_preference).
  StatusOr<float> Validate();
  Status SaveCheckpointAt(int64_t step);
  Status Finish();
  // Whether to stop after this step: this rank's StopSignal(), or with data parallelism any
  // rank's (a collective every rank calls after each step; AdoptStopSignal). Errors: comm's.
  StatusOr<bool> StopAgreed();
  Status FinalEvaluationAndSample();
  void PrintTimeLines();

  const TrainOptions& o_;
  const TrainLoopOptions& loop_;
  const TrainLoopInputs in_;
  engine::Engine& engine_;
  const data::Dataset& data_;
  std::mt19937_64 data_rng_;
  std::unique_ptr<PreferenceTraining> preference_;
  // Over every rank: the global batch.
  const int64_t tokens_per_step_;
  // The tokens trained on before start_step (a resumed run's, as its checkpoint recorded them).
  const int64_t start_tokens_seen_;
  std::vector<data::Batch> data_batches_;
  int64_t job_pairs_ = 0;           // preference pairs of the step's global batch (every rank's)
  int64_t job_chosen_targets_ = 0;  // and their chosen completions' targets
  std::vector<engine::MicroBatch> batches_;
  data::Batch skip_batch_;
  TrainOutcome out_;
  const Clock::time_point t_train_;
  double eval_seconds_ = 0;
  double checkpoint_seconds_ = 0;  // in SaveTraining, left out of train_seconds like eval_seconds_
  trace::Breakdown parts_at_breakdown_;  // --config wall_clock_breakdown: at the last time line
  double step_seconds_at_breakdown_ = 0;
  // Ends its live line with a newline on every way out of Run, errors included.
  ProgressLine progress_;
  TrainMetrics metrics_;
};

TrainLoop::TrainLoop(const TrainLoopInputs& in, int64_t start_step, int64_t start_tokens_seen,
                     std::mt19937_64 data_rng, std::unique_ptr<PreferenceTraining> preference)
    : o_(*in.options),
      loop_(in.options->loop),
      in_(in),
      engine_(*in.engine),
      data_(*in.data->dataset),
      data_rng_(std::move(data_rng)),
      preference_(std::move(preference)),
      tokens_per_step_(int64_t{loop_.micro_batch_size} * loop_.seq_len * loop_.grad_accum_steps *
                       o_.ranks.ranks),
      start_tokens_seen_(start_tokens_seen),
      data_batches_(loop_.grad_accum_steps),
      batches_(loop_.grad_accum_steps),
      t_train_(Clock::now()),
      progress_(ProgressOptionsFor(in, tokens_per_step_, engine_.counters()), stdout, stderr),
      metrics_(in.metrics, {engine_.counters(), {}, 0}) {
  out_.start_step = start_step;
  out_.loss_first = out_.loss_last = out_.val_loss = NAN;
}

template <typename Fn>
auto TrainLoop::Timed(Fn&& fn) {
  const trace::Breakdown before = in_.recorder->breakdown();
  const auto t0 = Clock::now();
  auto result = fn();
  out_.step_seconds += SecondsSince(t0);
  const trace::Breakdown after = in_.recorder->breakdown();
  for (int i = 0; i < trace::kNumCategories; ++i) {
    out_.parts.seconds[i] += after.seconds[i] - before.seconds[i];
  }
  return result;
}

Status TrainLoop::Flush() {
  return Timed([&] { return engine_.Flush(); });
}

// The global batch is ranks x A micro-batches drawn in one order whatever the number of ranks;
// rank r trains on micro-batches r*A .. r*A + A - 1 of it (a disjoint share), and every rank's
// data_rng advances alike. Every rank counts the targets in the loss of the whole global batch.
void TrainLoop::SampleBatches() {
  const int accum = loop_.grad_accum_steps;
  job_pairs_ = 0;
  job_chosen_targets_ = 0;
  for (int k = 0; k < o_.ranks.ranks * accum; ++k) {
    const int i = k - o_.ranks.rank * accum;
    if (i >= 0 && i < accum) {
      data::Batch& b = data_batches_[i];
      data_.SampleTrainBatch(data_rng_, loop_.micro_batch_size, loop_.seq_len, &b);
      batches_[i] = {b.tokens, b.targets, b.positions};
      out_.tokens_in_loss += TargetsInLoss(b);
      job_pairs_ += b.pairs();
      job_chosen_targets_ += engine::ChosenTargets(b.sequences);
    } else {
      data_.SampleTrainBatch(data_rng_, loop_.micro_batch_size, loop_.seq_len, &skip_batch_);
      out_.tokens_in_loss += TargetsInLoss(skip_batch_);
      job_pairs_ += skip_batch_.pairs();
      job_chosen_targets_ += engine::ChosenTargets(skip_batch_.sequences);
    }
  }
}

Status TrainLoop::Step(int64_t step) {
  SampleBatches();
  // DeepSpeed's schedulers do not advance on a skipped (overflowed) step; Strata's cosine runs
  // by step number.
  const LrSchedule& schedule = o_.schedule;
  const bool deepspeed_schedule =
      schedule.kind != LrScheduleKind::kCosine && schedule.kind != LrScheduleKind::kConstant;
  const float lr = static_cast<float>(
      LearningRateAt(schedule, deepspeed_schedule ? step - engine_.skipped_steps() : step));
  engine_.SetLearningRate(lr);
  engine::SequenceObjective* objective = nullptr;
  if (preference_) {
    STRATA_RETURN_IF_ERROR(preference_->BeginStep(data_batches_, job_pairs_, job_chosen_targets_));
    objective = preference_->objective();
  }
  STRATA_ASSIGN_OR_RETURN(auto r, Timed([&] { return engine_.Step(batches_, objective); }));
  if (step == out_.start_step) out_.loss_first = r.loss;
  out_.loss_last = r.loss;
  out_.skipped += r.skipped;
  std::vector<Scalar> extra;
  std::string detail;
  if (preference_) {
    STRATA_ASSIGN_OR_RETURN(out_.train_preference, preference_->TakeMetrics(o_.engine.comm));
    extra = preference_->Scalars("train/", *out_.train_preference);
    detail = PreferenceTraining::Summary(*out_.train_preference);
  }
  STRATA_RETURN_IF_ERROR(metrics_.RecordStep(step + 1, r, lr, tokens_per_step_,
                                             {engine_.counters(), out_.parts, out_.step_seconds},
                                             extra));
  StepReport report = CountersReport(engine_.counters());
  report.detail = std::move(detail);
  report.step = step + 1;
  report.loss = r.loss;
  report.grad_norm = r.grad_norm;
  report.lr = lr;
  report.skipped = r.skipped;
  progress_.Update(report);
  return Status::Ok();
}

// DeepSpeed's wall_clock_breakdown: busy seconds per part since the last such line.
void TrainLoop::PrintBreakdownLine(int64_t step) {
  const auto pause = progress_.Suspend();
  std::string line;
  for (int i = 0; i < trace::kNumCategories; ++i) {
    const auto cat = static_cast<trace::Category>(i);
    if (cat == trace::Category::kOther) continue;
    line += fmt::format("{}{} {:.3f}", line.empty() ? "" : ", ", trace::CategoryName(cat),
                        out_.parts.seconds[i] - parts_at_breakdown_.seconds[i]);
  }
  std::printf("time  step %5lld | %s s; step %.3f s\n", static_cast<long long>(step + 1),
              line.c_str(), out_.step_seconds - step_seconds_at_breakdown_);
  std::fflush(stdout);
  parts_at_breakdown_ = out_.parts;
  step_seconds_at_breakdown_ = out_.step_seconds;
}

Status TrainLoop::EvaluateAt(int64_t step) {
  const auto pause = progress_.Suspend();
  STRATA_RETURN_IF_ERROR(Flush());
  const auto t0 = Clock::now();
  STRATA_ASSIGN_OR_RETURN(float v, Validate());
  eval_seconds_ += SecondsSince(t0);
  std::vector<Scalar> extra;
  if (preference_) {
    extra = preference_->Scalars("val/", *out_.val_preference);
    std::printf("step %5lld | val loss %.4f | %s\n", static_cast<long long>(step + 1), v,
                PreferenceTraining::Summary(*out_.val_preference).c_str());
  } else {
    std::printf("step %5lld | val loss %.4f\n", static_cast<long long>(step + 1), v);
  }
  progress_.SkipBytes(CountersReport(engine_.counters()));
  return metrics_.RecordEvaluation(step + 1, v, engine_.counters(), extra);
}

StatusOr<float> TrainLoop::Validate() {
  if (!preference_) return Evaluate(engine_, data_, loop_);
  STRATA_ASSIGN_OR_RETURN(out_.val_preference, preference_->Evaluate(engine_));
  return static_cast<float>(out_.val_preference->loss);
}

Status TrainLoop::SaveCheckpointAt(int64_t step) {
  const auto pause = progress_.Suspend();  // SaveTraining prints the checkpoint line
  STRATA_RETURN_IF_ERROR(Flush());
  // Not a step's time nor its bytes: left out of train_seconds (and tokens/s) and of the next
  // step's byte counts, as an evaluation is.
  const auto t0 = Clock::now();
  STRATA_ASSIGN_OR_RETURN(
      out_.last_checkpoint,
      SaveTraining(engine_, loop_.checkpoint,
                   {step + 1, start_tokens_seen_ + (step + 1 - out_.start_step) * tokens_per_step_,
                    &data_rng_, LrScheduleJson(o_.schedule, step + 1), ModelSpecJson(*in_.spec)}));
  checkpoint_seconds_ += SecondsSince(t0);
  progress_.SkipBytes(CountersReport(engine_.counters()));
  metrics_.SkipBytes(engine_.counters());
  return Status::Ok();
}

StatusOr<bool> TrainLoop::StopAgreed() {
  comm::Communicator* comm = o_.engine.comm;
  if (comm == nullptr || !o_.ranks.data_parallel || comm->world_size() == 1) {
    return StopSignal() != 0;
  }
  // A signal to one rank stops every rank after the same step (its save a collective too);
  // without this the others waited in the next step's collectives until --comm-timeout.
  double sig = StopSignal();
  STRATA_RETURN_IF_ERROR(comm->AllReduce(std::span(&sig, 1), comm::ReduceOp::kMax));
  AdoptStopSignal(static_cast<int>(sig));
  return sig != 0;
}

StatusOr<TrainOutcome> TrainLoop::Run() {
  const CheckpointFlags& ckpt = loop_.checkpoint;
  if (out_.start_step >= loop_.steps) {
    // A finished run resumed (the same command run again): nothing is trained or saved.
    std::printf("nothing to train: the run is at step %lld, --steps is %lld\n",
                static_cast<long long>(out_.start_step), static_cast<long long>(loop_.steps));
  }
  for (int64_t step = out_.start_step; step < loop_.steps; ++step) {
    STRATA_RETURN_IF_ERROR(Step(step));
    const bool last = step + 1 == loop_.steps;
    if (loop_.wall_clock_breakdown && loop_.log_every > 0 &&
        ((step + 1) % loop_.log_every == 0 || last)) {
      PrintBreakdownLine(step);
    }
    if (loop_.eval_every > 0 && (step + 1) % loop_.eval_every == 0 && !last) {
      STRATA_RETURN_IF_ERROR(EvaluateAt(step));
    }
    const bool periodic = ckpt.save_every > 0 && (step + 1) % ckpt.save_every == 0;
    STRATA_ASSIGN_OR_RETURN(const bool stopping, StopAgreed());
    if (!ckpt.save_dir.empty() && (periodic || last || (stopping && ckpt.save_on_signal))) {
      STRATA_RETURN_IF_ERROR(SaveCheckpointAt(step));
    }
    if (stopping) {
      return CancelledError(fmt::format(
          "stopped by signal {} after step {}; {}", StopSignal(), step + 1,
          !out_.last_checkpoint.empty()
              ? "last checkpoint: " + out_.last_checkpoint
              : std::string("no checkpoint saved (use --save-dir with --save-on-signal)")));
    }
  }
  STRATA_RETURN_IF_ERROR(Finish());
  return out_;
}

Status TrainLoop::Finish() {
  progress_.Finish();
  STRATA_RETURN_IF_ERROR(Flush());  // the last step's update
  out_.train_seconds = SecondsSince(t_train_) - eval_seconds_ - checkpoint_seconds_;
  out_.counters = engine_.counters();
  STRATA_RETURN_IF_ERROR(FinalEvaluationAndSample());
  const int64_t steps_run = std::max<int64_t>(0, loop_.steps - out_.start_step);
  out_.tokens_per_second =
      static_cast<double>(tokens_per_step_ * steps_run) / std::max(out_.train_seconds, 1e-9);
  out_.mfu = engine::ModelFlopsUtilisation(
      in_.model_flops_per_token, out_.tokens_per_second / o_.ranks.ranks, in_.peak_bf16_TFLOPs);
  PrintTimeLines();
  if (const engine::EngineCounters& c = out_.counters;
      c.params_updated_on_cpu > 0 && (o_.engine.update_during_backward ||
                                      c.params_updated_during_backward + c.rollback_steps > 0)) {
    std::printf(
        "update during backward: %.0f%% of the CPU update ran during backward; %llu step%s "
        "rolled back\n",
        100.0 * static_cast<double>(c.params_updated_during_backward) /
            static_cast<double>(c.params_updated_on_cpu),
        static_cast<unsigned long long>(c.rollback_steps), c.rollback_steps == 1 ? "" : "s");
  }
  if (!loop_.trace_path.empty()) {
    STRATA_RETURN_IF_ERROR(in_.recorder->WriteChromeTrace(loop_.trace_path));
    std::printf("trace: %s (%zu events; open in https://ui.perfetto.dev or chrome://tracing)\n",
                loop_.trace_path.c_str(), in_.recorder->num_events());
  }
  // The steps this command ran (a resumed run's: from its checkpoint's step to --steps).
  std::printf(
      "done: %lld steps%s in %.1f s, %.0f tokens/s, %lld skipped; device peak %s of %s; "
      "master weights xxh3 %016llx\n",
      static_cast<long long>(steps_run),
      out_.start_step > 0
          ? fmt::format(" (to step {})", std::max(loop_.steps, out_.start_step)).c_str()
          : "",
      out_.train_seconds, out_.tokens_per_second, static_cast<long long>(out_.skipped),
      FormatBytes(out_.counters.device_peak_bytes).c_str(),
      FormatBytes(engine_.plan().device_budget_bytes).c_str(),
      static_cast<unsigned long long>(out_.master_hash));
  return Status::Ok();
}

Status TrainLoop::FinalEvaluationAndSample() {
  const data::TrainingData& training_data = *in_.data;
  // A signal after the last step (its checkpoint saved) skips what is left: the validation and
  // the sample, which for a long --sample-bytes ran for minutes with the signal unheard.
  const auto stopped = [&](std::string_view when) {
    return CancelledError(fmt::format(
        "stopped by signal {} after the last step ({}), {}; {}", StopSignal(), loop_.steps, when,
        !out_.last_checkpoint.empty() ? "last checkpoint: " + out_.last_checkpoint
                                      : std::string("no checkpoint saved")));
  };
  if (StopSignal() != 0) return stopped("before the final validation");
  if (loop_.eval_every > 0) {
    STRATA_ASSIGN_OR_RETURN(out_.val_loss, Validate());
    if (preference_) {
      const engine::PreferenceMetrics& m = *out_.val_preference;
      STRATA_RETURN_IF_ERROR(metrics_.RecordEvaluation(
          loop_.steps, out_.val_loss, engine_.counters(), preference_->Scalars("val/", m)));
      std::printf("validation: %s loss %.4f over %lld pairs | %s\n",
                  std::string(engine::PreferenceLossName(o_.preference->loss)).c_str(),
                  out_.val_loss, static_cast<long long>(m.pairs),
                  preference_->MetricsLine(m).c_str());
    } else {
      STRATA_RETURN_IF_ERROR(
          metrics_.RecordEvaluation(loop_.steps, out_.val_loss, engine_.counters()));
      std::printf("validation loss %.4f nats/%s (uniform is %.2f)\n", out_.val_loss,
                  training_data.byte_level ? "byte" : "token",
                  std::log(static_cast<double>(in_.model->vocab_size())));
    }
  }
  STRATA_ASSIGN_OR_RETURN(out_.master_hash, engine_.MasterWeightsXxh3());
  if (loop_.sample_bytes > 0 && (training_data.byte_level || training_data.tokenizer)) {
    std::mt19937_64 sample_rng(loop_.seed ^ 0x5a3b1eull);
    StatusOr<std::string> sampled =
        Sample(engine_, loop_, sample_rng, training_data.tokenizer.get());
    if (sampled.status().code() == StatusCode::kCancelled) return stopped("while sampling text");
    STRATA_ASSIGN_OR_RETURN(std::string text, std::move(sampled));
    std::printf("sample:\n%s\n", Printable(text).c_str());
  }
  return Status::Ok();
}

void TrainLoop::PrintTimeLines() {
  std::string parts_line;
  for (int i = 0; i < trace::kNumCategories; ++i) {
    const auto c = static_cast<trace::Category>(i);
    if (c == trace::Category::kOther) continue;
    parts_line += fmt::format("{}{} {:.2f} s", parts_line.empty() ? "" : ", ",
                              trace::CategoryName(c), out_.parts.seconds[i]);
  }
  std::printf("time in steps %.2f s: %s; overlap efficiency %.2f (largest part / step time)\n",
              out_.step_seconds, parts_line.c_str(),
              OverlapEfficiency(out_.parts, out_.step_seconds));
}

}  // namespace

double OverlapEfficiency(const trace::Breakdown& parts, double step_seconds) {
  double largest_part = 0;
  for (int i = 0; i < trace::kNumCategories; ++i) {
    if (static_cast<trace::Category>(i) == trace::Category::kOther) continue;
    largest_part = std::max(largest_part, parts.seconds[i]);
  }
  return step_seconds > 0 ? largest_part / step_seconds : 0.0;
}

StatusOr<TrainOutcome> RunTrainLoop(const TrainLoopInputs& in) {
  std::mt19937_64 data_rng(in.options->loop.seed ^ 0x5eedda7aull);
  const CheckpointFlags& ckpt = in.options->loop.checkpoint;
  std::unique_ptr<PreferenceTraining> preference;
  if (in.options->preference) {
    // The reference of full fine-tuning is the initial weights: before a checkpoint loads.
    preference = std::make_unique<PreferenceTraining>(
        *in.options->preference, in.data->preference, in.spec->lora.enabled(),
        in.options->loop.micro_batch_size, in.options->loop.seq_len);
    // Every rank computes the same reference (whole blocks on each device); rank 0 writes it.
    STRATA_RETURN_IF_ERROR(StoppedBeforeTheFirstStep(preference->PrepareReference(
        *in.engine, ckpt.save_dir, !ckpt.resume.empty(), in.options->ranks.rank == 0,
        [] { return StopSignal() != 0; })));
  }
  int64_t start_step = 0, start_tokens_seen = 0;
  if (!ckpt.resume.empty()) {
    StatusOr<int64_t> resumed = ResumeTraining(
        *in.engine, ckpt, &data_rng, LrScheduleJson(in.options->schedule, /*next_step=*/0),
        in.options->engine, &start_tokens_seen);
    STRATA_RETURN_IF_ERROR(StoppedBeforeTheFirstStep(resumed.status()));
    start_step = *resumed;
  }
  TrainLoop loop(in, start_step, start_tokens_seen, std::move(data_rng), std::move(preference));
  return loop.Run();
}

}  // namespace strata::tools
