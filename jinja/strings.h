// Python's str methods as templates call them, on UTF-8 strings indexed by code point.
// Internal to jinja/.
#ifndef MOELORA_JINJA_STRINGS_H_
#define MOELORA_JINJA_STRINGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "jinja/value.h"

namespace moelora::jinja {

// The code point at s[pos] (valid UTF-8: JSON values, and Parse checks the source); its length.
size_t DecodeUtf8(const std::string& s, size_t pos, char32_t* cp);

// Code points of a UTF-8 string (strings index and measure by them in Python).
std::vector<std::string> CodePoints(const std::string& s);

// Python's str.isspace() characters, for strip() / split() without arguments.
bool IsPySpace(char32_t c);

// str.strip / lstrip / rstrip: `chars` null strips whitespace.
std::string Strip(const std::string& s, const std::string* chars, bool left, bool right);

List Split(const std::string& s, const Value* sep, int64_t maxsplit);

std::string Replace(const std::string& s, const std::string& from, const std::string& to,
                    int64_t count);

// str.upper() / str.lower(): Unicode's full case mappings (ICU's root locale, as Python).
std::string Upper(const std::string& s, bool upper);

}  // namespace moelora::jinja

#endif  // MOELORA_JINJA_STRINGS_H_
