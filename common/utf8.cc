#include "common/utf8.h"

namespace moelora {
namespace {

// Length of the sequence led by `c` (0 if `c` cannot lead one) and the allowed range of its
// second byte (Unicode Table 3-7).
int SequenceLength(unsigned char c, unsigned char* lo, unsigned char* hi) {
  *lo = 0x80;
  *hi = 0xBF;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return 2;
  if (c == 0xE0) {
    *lo = 0xA0;
    return 3;
  }
  if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) return 3;
  if (c == 0xED) {
    *hi = 0x9F;
    return 3;
  }
  if (c == 0xF0) {
    *lo = 0x90;
    return 4;
  }
  if (c >= 0xF1 && c <= 0xF3) return 4;
  if (c == 0xF4) {
    *hi = 0x8F;
    return 4;
  }
  return 0;
}

// Bytes of the sequence at s[i] that are well-formed so far (1..len); *complete when all are.
// *truncated when the input ended before an ill-formed byte was seen.
size_t Scan(std::string_view s, size_t i, bool* complete, bool* truncated) {
  unsigned char lo, hi;
  const int len = SequenceLength(static_cast<unsigned char>(s[i]), &lo, &hi);
  *complete = len > 0;
  *truncated = false;
  if (len <= 1) return 1;
  size_t j = i + 1;
  for (int k = 1; k < len; ++k, ++j) {
    if (j >= s.size()) {
      *complete = false;
      *truncated = true;
      return j - i;
    }
    const unsigned char d = static_cast<unsigned char>(s[j]);
    if (d < (k == 1 ? lo : 0x80) || d > (k == 1 ? hi : 0xBF)) {
      *complete = false;
      return j - i;
    }
  }
  return j - i;
}

}  // namespace

bool IsValidUtf8(std::string_view s, size_t* bad_offset) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    bool complete, truncated;
    const size_t n = Scan(s, i, &complete, &truncated);
    if (!complete) {
      if (bad_offset != nullptr) *bad_offset = i;
      return false;
    }
    i += n;
  }
  return true;
}

size_t AppendUtf8Lossy(std::string_view bytes, bool final, std::string* out) {
  size_t i = 0;
  while (i < bytes.size()) {
    if (static_cast<unsigned char>(bytes[i]) < 0x80) {
      out->push_back(bytes[i++]);
      continue;
    }
    bool complete, truncated;
    const size_t n = Scan(bytes, i, &complete, &truncated);
    if (complete) {
      out->append(bytes.substr(i, n));
    } else {
      if (truncated && !final) return i;  // may still complete: wait for more bytes
      out->append(kReplacementChar);
    }
    i += n;
  }
  return bytes.size();
}

char32_t DecodeCodePoint(std::string_view s, size_t i, size_t* len) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  if (c < 0x80 || i + 1 >= s.size()) {
    *len = 1;
    return c;
  }
  auto cont = [&](size_t k) {
    return static_cast<char32_t>(static_cast<unsigned char>(s[i + k]) & 0x3F);
  };
  if (c < 0xE0) {
    *len = 2;
    return (static_cast<char32_t>(c & 0x1F) << 6) | cont(1);
  }
  if (c < 0xF0) {
    *len = 3;
    return (static_cast<char32_t>(c & 0x0F) << 12) | (cont(1) << 6) | cont(2);
  }
  *len = 4;
  return (static_cast<char32_t>(c & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
}

void AppendCodePoint(char32_t cp, std::string* out) {
  if ((cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
    out->append(kReplacementChar);
  } else if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace moelora
