// `strata tokenize --tokenizer tokenizer.model --input text.txt --output train.bin`: a text file
// as one document (BOS first when the tokenizer has one) through a SentencePiece model, written
// as an llm.c token file (data/token_dataset.h) that `strata train --data` reads. With
// --byte-level instead of --tokenizer every byte is a token (vocabulary 256: the byte-level
// presets, and test models).
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
};
void AddTokenizeFlags(CLI::App& cmd, TokenizeFlags& f);

// Prints one line: tokens, bytes/token, the file's token width. Nothing is written when the
// tokenizer or the input cannot be read (their one-line errors, naming the file), or when
// --output names the input (kInvalidArgument).
Status RunTokenize(const TokenizeFlags& f);

}  // namespace strata::tools
