// UTF-8 validation and lossy decoding, shared by the tokenizer, the incremental detokenizer, the
// Jinja engine and the controller. Written by hand (a few lines) because the replacement rule
// must match Hugging Face tokenizers' decode exactly: it is Rust's String::from_utf8_lossy, which
// replaces each "maximal subpart" of an ill-formed sequence with one U+FFFD (Unicode §3.9,
// W3C/WHATWG). ICU's converters follow the same rule but need UTF-16 round trips and cannot stop at
// an incomplete tail, which the streaming decoder needs. Thread-safe: pure functions.
#ifndef MOELORA_COMMON_UTF8_H_
#define MOELORA_COMMON_UTF8_H_

#include <cstddef>
#include <string>
#include <string_view>

namespace moelora {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// True when `s` is well-formed UTF-8; otherwise *bad_offset (if given) is the byte offset of
// the first ill-formed sequence.
bool IsValidUtf8(std::string_view s, size_t* bad_offset = nullptr);

// Appends the text of `bytes` to *out, each maximal ill-formed subpart replaced by U+FFFD. With
// `final` false it stops before a trailing sequence that is incomplete but may still become
// valid, and returns how many bytes it consumed (the caller keeps the rest for later); with
// `final` true it consumes everything. Feeding bytes in pieces gives the same text as one call.
size_t AppendUtf8Lossy(std::string_view bytes, bool final, std::string* out);

// The code point at s[i] (valid UTF-8 assumed); *len receives its byte length.
char32_t DecodeCodePoint(std::string_view s, size_t i, size_t* len);

// Appends the UTF-8 bytes of code point `cp` (U+FFFD for a surrogate or one beyond U+10FFFF).
void AppendCodePoint(char32_t cp, std::string* out);

}  // namespace moelora

#endif  // MOELORA_COMMON_UTF8_H_
