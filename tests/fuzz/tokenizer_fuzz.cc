// Arbitrary bytes through the tokenizer (the committed tiny tokenizer.json): Encode must refuse
// ill-formed UTF-8 and otherwise give ids whose decode is NFC-stable; the ids, streamed one by
// one through TextStream with a stop string, give valid UTF-8 deltas that add up to Decode.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/utf8.h"
#include "tokenizer/text_stream.h"
#include "tokenizer/tokenizer.h"

namespace {
const moelora::tok::Tokenizer& Tok() {
  static const moelora::tok::Tokenizer* t = [] {
    auto r = moelora::tok::Tokenizer::Load(MOELORA_TEST_DATA_DIR "/tokenizer/tiny_tokenizer.json");
    if (!r.ok()) std::abort();
    return r->release();
  }();
  return *t;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  const auto& t = Tok();
  auto ids = t.Encode(in);
  if (ids.ok() != moelora::IsValidUtf8(in)) std::abort();
  // The raw bytes as ids too (every byte is an id of the tiny vocabulary's range).
  std::vector<int32_t> raw;
  for (unsigned char c : in) raw.push_back(c % t.vocab_size());
  for (const std::vector<int32_t>* v : {ids.ok() ? &*ids : nullptr, &raw}) {
    if (v == nullptr) continue;
    const std::string whole = t.Decode(*v);
    if (!moelora::IsValidUtf8(whole)) std::abort();
    moelora::tok::TextStream s(&t, {}, false);
    std::string streamed;
    for (int32_t id : *v) {
      s.Add(id);
      const std::string d = s.TakeDelta();
      if (!moelora::IsValidUtf8(d)) std::abort();
      streamed += d;
    }
    streamed += s.Finish();
    if (streamed != whole) std::abort();
    // With a stop string: the text is a prefix of the whole that does not contain it.
    if (whole.size() > 4) {
      const std::string stop = whole.substr(whole.size() / 2, 2);
      if (moelora::IsValidUtf8(stop)) {
        moelora::tok::TextStream st(&t, {stop}, false);
        std::string cut;
        for (int32_t id : *v) {
          const bool hit = st.Add(id);
          cut += st.TakeDelta();
          if (hit) break;
        }
        cut += st.Finish();
        if (whole.compare(0, cut.size(), cut) != 0 || cut.find(stop) != std::string::npos)
          std::abort();
      }
    }
  }
  // decode(encode(s)) is NFC(s): doing it again changes nothing.
  if (ids.ok()) {
    const std::string once = t.Decode(*ids);
    if (t.Decode(t.Encode(once).value()) != once) std::abort();
  }
  return 0;
}
