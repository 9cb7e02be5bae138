// Hugging Face tokenizer.json tokenizers (the file format of HF tokenizers, github.com/huggingface/
// tokenizers, that Llama 2/3, Mistral, Qwen 2/2.5/3 and GPT-2 checkpoints ship): the BPE model
// (Sennrich et al., "Neural Machine Translation of Rare Words with Subword Units", ACL 2016) in
// two variants —
//  * byte-level (GPT-2's, Radford et al., "Language Models are Unsupervised Multitask Learners",
//    2019; Llama 3, Qwen 2): pre_tokenizer ByteLevel (GPT-2's pattern or none), Split with the
//    file's regex (PCRE2, UTF and Unicode properties), Sequence; decoder ByteLevel;
//  * SentencePiece-style (Llama 2, Mistral v0.1): normalizers Prepend, Replace (a String), NFC
//    (ICU), Sequence; pre_tokenizer Metaspace or none; <0xXX> byte fallback; decoders Replace,
//    ByteFallback, Fuse, Strip, Metaspace, Sequence.
// added_tokens (special or not) are found in the raw text first, leftmost and longest first, with
// single_word, lstrip and rstrip as HF applies them. post_processor TemplateProcessing, ByteLevel,
// Sequence or null. Any other component, a BPE dropout, a continuing_subword_prefix or
// end_of_word_suffix, truncation or padding, or an added token with normalized: true under a
// normalizer, is refused by name (kInvalidArgument), never approximated.
#pragma once

#include <memory>
#include <string>

#include "data/tokenizer.h"

namespace strata::data {

// Thread-safety: immutable after Load; every const method may run concurrently (each Encode has
// its own pre-token cache and regex match data).
class HfTokenizer final : public Tokenizer {
 public:
  // Loads the tokenizer.json file at `path` (a file, not a directory: Tokenizer::Load resolves
  // those). bos_id()/eos_id() come from bos_token/eos_token of a tokenizer_config.json in the same
  // directory when it names them, else from the post-processor's single template (the special
  // token before/after the sequence), else -1. fingerprint() is XXH3_64bits of the file's bytes.
  // Errors (one line naming the file): the errno-mapped code when it cannot be read;
  // kInvalidArgument for malformed JSON, a missing or mistyped field, a merge or token not in
  // the vocabulary, or an unsupported component ("tokenizer.json 'P': pre_tokenizer type Digits
  // is not supported (supported: ByteLevel, Split, Metaspace, Sequence)").
  static StatusOr<std::unique_ptr<HfTokenizer>> Load(const std::string& path);
  ~HfTokenizer() override;

  // max(id) + 1 over the model's vocabulary and the added tokens.
  int vocab_size() const override;
  int bos_id() const override;
  int eos_id() const override;
  // tokenizer_config.json's add_bos_token / add_eos_token where it gives them (with a BOS / EOS
  // to add: Llama 2's and Gemma's true, some fine-tunes' add_eos_token true); absent, a BOS when
  // its tokenizer_class defaults add_bos_token to true (Llama, CodeLlama, Gemma, Cohere) or
  // tokenizer.json's post-processor template starts with one (Llama 3's), as transformers'
  // tokenizer(text) adds it, and no EOS.
  bool adds_bos() const override;
  bool adds_eos() const override;
  // An added token's content, else a model vocabulary entry (byte-level entries are spelt in
  // bytes_to_unicode characters: " the" is "Ġthe").
  int TokenId(std::string_view piece) const override;

  // HF's Tokenizer::encode(text, add_special_tokens=false): no BOS/EOS. Errors:
  // kInvalidArgument when `text` is not valid UTF-8 (naming the byte offset).
  StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override;
  // HF's encode(text, add_special_tokens=false) with return_offsets_mapping, in bytes (the
  // contract in tokenizer.h). Byte-level tokenizers without a normalizer or prefix space take
  // Encode's ids and check that their bytes tile the text (Encode's time, bench_tokenizer);
  // otherwise (or where they do not tile: an lstrip/rstrip token) the alignment through the
  // normalizers and the pre-tokenizer costs a span per byte: about twice Encode's time.
  StatusOr<EncodedText> EncodeWithOffsets(std::string_view text) const override;
  // The cache holds pre-tokens' ids (at most 65536 pre-tokens of up to 64 bytes, as within one
  // Encode call).
  StatusOr<EncodedText> EncodeWithOffsets(std::string_view text, EncodeCache* cache) const override;
  std::unique_ptr<EncodeCache> NewEncodeCache() const override;
  // HF's decode(ids, skip_special_tokens=false): the tokens' strings through the decoder (joined
  // by spaces without one). Errors: kInvalidArgument for an id with no token.
  StatusOr<std::string> Decode(std::span<const int32_t> ids) const override;

  // Cut points: byte-level tokenizers whose pre-tokenizer splits first with GPT-2's, Llama 3's or
  // Qwen 2's pattern cut before a letter that follows a newline after a non-space character (no
  // pattern match spans it); SentencePiece-style ones (no regex) cut after a newline when no
  // vocabulary entry but "\n" itself contains one and "\n" is never an unknown token (BPE cannot
  // merge across it). Neither cuts where an added token could start or span the cut, nor before
  // a character NFC could combine with what precedes it. Other configurations (an unknown Split
  // regex, a Replace of a newline, a Split before a ByteLevel with add_prefix_space) have no cut:
  // the text is held whole.
  size_t LastSafeCut(std::string_view text, size_t from) const override;
  // As Encode, for text that continues a cut: no Prepend normalizer, Metaspace prefix or
  // ByteLevel prefix space at its start.
  StatusOr<std::vector<int32_t>> EncodeContinued(std::string_view text) const override;

  struct Impl;

 private:
  HfTokenizer(std::string path, uint64_t fingerprint, std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::data
