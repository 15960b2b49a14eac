// Incremental detokenization with stop strings, for streamed generation.
//
// Tokens arrive one at a time; the text released so far is always valid UTF-8 (bytes of a
// character split across tokens are held until it completes) and never contains a prefix of a
// stop string that may still complete (held until it does or cannot). When a stop string
// completes, the text ends just before it. The concatenation of every delta equals
// Tokenizer::Decode of the same ids (cut at the stop string), so a stream and a unary call give
// the same text.
//
// Thread-safety: none; one stream per request, used by one thread at a time.
#ifndef MOELORA_TOKENIZER_TEXT_STREAM_H_
#define MOELORA_TOKENIZER_TEXT_STREAM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace moelora::tok {

class TextStream {
 public:
  // `tokenizer` must outlive the stream. `skip_special`: special tokens add no text.
  TextStream(const Tokenizer* tokenizer, std::vector<std::string> stop_strings, bool skip_special);

  // Adds one generated token. Returns true when a stop string completed with it (or earlier):
  // the text then ends before the stop string and further tokens are ignored.
  bool Add(int32_t id);
  // The text released since the last call (possibly empty).
  std::string TakeDelta();
  // Ends the stream: returns what was held back (an incomplete character becomes U+FFFD).
  std::string Finish();

  bool stopped() const { return stopped_; }
  // The stop string that ended the text, when stopped().
  const std::string& matched_stop() const { return matched_; }
  // All text so far, released or held (cut at the stop string).
  const std::string& text() const { return text_; }

 private:
  void CheckStop(size_t from);
  size_t Releasable() const;

  const Tokenizer* tok_;
  std::vector<std::string> stops_;
  size_t max_stop_ = 0;
  bool skip_special_;
  std::string pending_;  // undecoded bytes: an incomplete UTF-8 sequence
  std::string text_;     // decoded text
  size_t released_ = 0;  // bytes of text_ handed out
  bool stopped_ = false;
  bool finished_ = false;
  std::string matched_;
};

}  // namespace moelora::tok

#endif  // MOELORA_TOKENIZER_TEXT_STREAM_H_
