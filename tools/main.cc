// strata: one binary, git-style subcommands. The only place that reads flags.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>

#include "base/exceptions.h"
#include "base/logging.h"
#include "base/untrusted_text.h"
#include "tools/doctor_command.h"
#include "tools/estimate_command.h"
#include "tools/eval_command.h"
#include "tools/iobench_command.h"
#include "tools/option_flags.h"
#include "tools/quantize_command.h"
#include "tools/tokenize_command.h"
#include "tools/train_command.h"

namespace {

// The message as printed: every control character but the newlines that separate a config
// file's problems written as \xNN, so that a NUL does not cut it and nothing from a file
// reaches the terminal as a control sequence.
std::string Printable(std::string_view message) {
  std::string out;
  out.reserve(message.size());
  for (const char c : message) {
    const auto b = static_cast<unsigned char>(c);
    if ((b < 0x20 && c != '\n') || b == 0x7F) {
      out += fmt::format("\\x{:02X}", b);
    } else {
      out.push_back(c);
    }
  }
  return out;
}

int Fail(std::string_view message) {
  const std::string line = "strata: error: " + Printable(message) + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  strata::SetLogLevel(strata::LogLevel::kWarning);
  CLI::App app{"Strata: train models larger than GPU memory on one workstation"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "strata " STRATA_VERSION_STRING);
  strata::tools::TrainFlags train;
  CLI::App* train_cmd = app.add_subcommand(
      "train",
      "Train or fine-tune a model (GPT preset, Llama, GPT-2) with parameters and optimizer state "
      "offloaded");
  strata::tools::AddTrainFlags(*train_cmd, train);
  strata::tools::EstimateFlags estimate;
  CLI::App* estimate_cmd = app.add_subcommand(
      "estimate", "Print the placement plan for a model and budgets without training");
  strata::tools::AddEstimateFlags(*estimate_cmd, estimate);
  strata::tools::DoctorFlags doctor;
  CLI::App* doctor_cmd = app.add_subcommand(
      "doctor", "Check what this host offers for offload: io_uring, O_DIRECT, memory, CPU, GPU");
  strata::tools::AddDoctorFlags(*doctor_cmd, doctor);
  strata::tools::IobenchFlags iobench;
  strata::tools::AddIobenchFlags(
      *app.add_subcommand("iobench", "Measure sequential/random read/write throughput of paths"),
      iobench);
  strata::tools::InspectFlags inspect;
  CLI::App* inspect_cmd = app.add_subcommand(
      "inspect", "List a checkpoint's tensors and verify every file's size and xxh3");
  strata::tools::AddInspectFlags(*inspect_cmd, inspect);
  strata::tools::ExportFlags export_flags;
  CLI::App* export_cmd = app.add_subcommand(
      "export", "Write a checkpoint as a Hugging Face model directory (config.json, safetensors)");
  strata::tools::AddExportFlags(*export_cmd, export_flags);
  strata::tools::QuantizeFlags quantize;
  CLI::App* quantize_cmd = app.add_subcommand(
      "quantize",
      "Write a Hugging Face directory's layer weights in 4 bits as bitsandbytes stores them "
      "(nf4/fp4: a QLoRA base)");
  strata::tools::AddQuantizeFlags(*quantize_cmd, quantize);
  strata::tools::TokenizeFlags tokenize;
  CLI::App* tokenize_cmd = app.add_subcommand(
      "tokenize", "Tokenize a text file with a SentencePiece model into an llm.c token file");
  strata::tools::AddTokenizeFlags(*tokenize_cmd, tokenize);
  strata::tools::EvalFlags eval;
  CLI::App* eval_cmd =
      app.add_subcommand("eval", "Mean cross-entropy and perplexity of a model on a token file");
  strata::tools::AddEvalFlags(*eval_cmd, eval);
  strata::tools::GenerateFlags generate;
  CLI::App* generate_cmd =
      app.add_subcommand("generate", "Sample text from a model, continuing a prompt");
  strata::tools::AddGenerateFlags(*generate_cmd, generate);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    if (what.empty()) what = "bad command line";
    // A config file's problems are complete as they are (the file and its keys, not a flag to
    // look up); a flag error gets the pointer.
    if (what.find('\n') != std::string::npos || what.starts_with("--config: ")) return Fail(what);
    // The help of the subcommand being read (`strata iobench --help`), else the list of them.
    std::string help = "strata --help";
    for (const CLI::App* sub : app.get_subcommands()) {
      help = "strata " + sub->get_name() + " --help";
    }
    return Fail(fmt::format("{} (see '{}')", what, help));
  } catch (const std::exception& e) {
    return Fail(fmt::format("internal error while reading the command line: {}",
                            strata::Excerpt(e.what(), 300)));
  }
  // CLI11 reads "nan" and "inf" as numbers, and a range check passes a NaN; no option of Strata
  // takes either (--lr nan trained at the default rate).
  for (const CLI::App* sub : app.get_subcommands()) {
    for (const CLI::Option* opt : sub->get_options()) {
      if (opt->get_type_name().find("FLOAT") == std::string::npos) continue;
      for (const std::string& v : opt->results()) {
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        if (end != v.c_str() && !std::isfinite(x)) {
          return Fail(fmt::format("{}: {} is not a finite number (see 'strata {} --help')",
                                  opt->get_name(), v, sub->get_name()));
        }
      }
    }
  }
  strata::Status status;
  // Errors travel as Status; an exception that escapes a command anyway (an allocation that
  // failed, a library's throw) still ends in one line and exit 1, not in std::terminate.
  try {
    if (train_cmd->parsed()) status = strata::tools::RunTrain(train);
    if (estimate_cmd->parsed()) status = strata::tools::RunEstimate(estimate);
    if (doctor_cmd->parsed()) status = strata::tools::RunDoctor(doctor);
    if (app.got_subcommand("iobench")) status = strata::tools::RunIobench(iobench);
    if (inspect_cmd->parsed()) status = strata::tools::RunInspect(inspect);
    if (export_cmd->parsed()) status = strata::tools::RunExport(export_flags);
    if (quantize_cmd->parsed()) status = strata::tools::RunQuantize(quantize);
    if (tokenize_cmd->parsed()) status = strata::tools::RunTokenize(tokenize);
    if (eval_cmd->parsed()) status = strata::tools::RunEval(eval);
    if (generate_cmd->parsed()) status = strata::tools::RunGenerate(generate);
  } catch (...) {
    // Where it was thrown is not known here; what it was is, and a process limit that may be why.
    const strata::Status s = strata::StatusOfException(std::current_exception(), "");
    const std::string message = strata::Excerpt(s.message(), 400);
    return Fail(s.code() == strata::StatusCode::kInternal ? "internal error: " + message : message);
  }
  if (status.code() == strata::StatusCode::kCancelled && strata::tools::StopSignal() != 0) {
    std::fprintf(stderr, "strata: %s\n", status.message().c_str());
    return 128 + strata::tools::StopSignal();  // 130 for SIGINT, 143 for SIGTERM
  }
  // The engine names its options; the user gave flags (tools/option_flags.h).
  if (!status.ok()) return Fail(strata::tools::InFlagTerms(status.message()));
  return 0;
}
