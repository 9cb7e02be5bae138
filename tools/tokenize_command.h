// `strata tokenize --tokenizer tokenizer.model --input text.txt --output train.bin`: a text file
// as one document (BOS first when the tokenizer has one) through a SentencePiece model, written
// as an llm.c token file (data/token_dataset.h) that `strata train --data` reads. With
// --byte-level instead of --tokenizer every byte is a token (vocabulary 256: the byte-level
// presets, and test models).
//
// An input named *.jsonl (or --format jsonl) is instruction data (data/instruction_data.h):
// every line an example rendered with --chat-template (auto: the tokenizer's
// tokenizer_config.json), written with per-token flags (the loss mask and example starts) that
// `strata train` reads as whole examples; or, when its first non-blank line has "chosen",
// preference data (data/preference_data.h): every line a pair, its chosen and its rejected side
// rendered the same way, flagged as pairs (data/token_dataset.h, kTokenFlagPairStart), which
// `strata train` reads as a PreferenceDataset. A line of the other kind is an error naming it.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "base/status.h"

namespace strata::tools {

struct TokenizeFlags {
  std::string tokenizer;
  bool byte_level = false;
  std::string input;
  std::string output;
  std::string format = "auto";         // auto (by the input's extension), text, jsonl
  std::string chat_template = "auto";  // jsonl: auto, llama3, chatml, mistral, none
  std::string chat_template_kwargs;    // --chat-template-kwargs: a JSON object, or empty
};
void AddTokenizeFlags(CLI::App& cmd, TokenizeFlags& f);

// Prints one line: tokens, bytes/token, the file's token width; for instruction (preference)
// data the template, examples (pairs), tokens and tokens in the loss. Nothing is written when the
// tokenizer or the input cannot be read or rendered (their one-line errors, naming the file and
// line), when --output names the input, or for JSONL with --byte-level (kInvalidArgument).
Status RunTokenize(const TokenizeFlags& f);

}  // namespace strata::tools
