// A Hugging Face `tokenizer.json` tokenizer in C++: byte-level BPE, as the Qwen3, Qwen3.5/3.6,
// Step and GPT-OSS models ship it.
//
// Encoding follows the `tokenizers` library step by step: added tokens are split out first
// (leftmost-longest; `special`, `normalized`, `lstrip`, `rstrip`, `single_word`), the rest is
// normalized (NFC/NFD/NFKC/NFKD, by ICU), pre-tokenized (`Split` regexes by PCRE2, `ByteLevel`),
// and each piece goes through BPE (lowest merge rank first, leftmost on ties; `ignore_merges`);
// the post-processor's single-sequence template adds its special tokens. Decoding is the
// ByteLevel decoder, with ill-formed UTF-8 replaced as Rust's from_utf8_lossy does.
//
// Debian has no C++ package of Hugging Face tokenizers (nor of sentencepiece's BPE with these
// pre-tokenizers), so the pipeline is ours; the regexes run on PCRE2 and the normalization on
// ICU, both Debian packages. A component or option of tokenizer.json that is not implemented
// is refused by Load, naming it, rather than tokenizing differently.
//
// Thread-safety: a loaded Tokenizer is immutable; Encode/Decode may run on any thread at once.
#ifndef MOELORA_TOKENIZER_TOKENIZER_H_
#define MOELORA_TOKENIZER_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moelora::tok {

class Tokenizer {
 public:
  // `path`: a model directory (its tokenizer.json, plus tokenizer_config.json and
  // generation_config.json when present, for BOS/EOS) or a tokenizer.json file. NOT_FOUND when
  // there is no tokenizer.json; INVALID_ARGUMENT naming the file and key for a malformed one;
  // UNIMPLEMENTED naming the component for one this class does not implement.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Token ids of `text` (INVALID_ARGUMENT with the byte offset if it is not valid UTF-8).
  // `add_special_tokens`: apply the post-processor's template (e.g. a BOS), as HF does by default.
  [[nodiscard]] absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                                            bool add_special_tokens = true) const;

  // The raw bytes of `ids` (may end inside a UTF-8 sequence; ids this tokenizer does not know
  // are skipped, as HF does). `skip_special`: leave out added tokens marked special.
  std::string DecodeBytes(absl::Span<const int32_t> ids, bool skip_special = false) const;
  // The text of `ids`: DecodeBytes with ill-formed UTF-8 replaced by U+FFFD.
  std::string Decode(absl::Span<const int32_t> ids, bool skip_special = false) const;

  bool IsKnown(int32_t id) const;
  bool IsSpecial(int32_t id) const;
  // One more than the largest id (model vocabulary and added tokens).
  int32_t vocab_size() const;
  std::optional<int32_t> TokenToId(std::string_view token) const;
  // The bytes token `id` decodes to (empty for an unknown id).
  std::string_view TokenBytes(int32_t id) const;

  // EOS ids: generation_config.json's eos_token_id (int or list) and tokenizer_config.json's
  // eos_token, deduplicated; empty when neither names one.
  const std::vector<int32_t>& eos_token_ids() const { return eos_ids_; }
  std::optional<int32_t> bos_token_id() const { return bos_id_; }
  // The tokenizer.json this was loaded from.
  const std::string& source() const { return source_; }

 private:
  struct Impl;
  Tokenizer();
  std::unique_ptr<Impl> impl_;
  std::vector<int32_t> eos_ids_;
  std::optional<int32_t> bos_id_;
  std::string source_;
};

// generation_config.json's eos_token_id (an int or a list) in `model_dir`; empty when the file or
// the key is absent. INVALID_ARGUMENT naming the file for malformed JSON.
[[nodiscard]] absl::StatusOr<std::vector<int32_t>> ReadGenerationEosIds(
    const std::string& model_dir);

}  // namespace moelora::tok

#endif  // MOELORA_TOKENIZER_TOKENIZER_H_
