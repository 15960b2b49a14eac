#include "tokenizer/text_stream.h"

#include <algorithm>

#include "common/utf8.h"

namespace moelora::tok {

TextStream::TextStream(const Tokenizer* tokenizer, std::vector<std::string> stop_strings,
                       bool skip_special)
    : tok_(tokenizer), skip_special_(skip_special) {
  for (std::string& s : stop_strings) {
    if (s.empty()) continue;
    max_stop_ = std::max(max_stop_, s.size());
    stops_.push_back(std::move(s));
  }
}

void TextStream::CheckStop(size_t from) {
  // The earliest stop string that starts at or after `from` - (longest - 1): only text added
  // since the last check can complete one.
  const size_t begin = from >= max_stop_ ? from - max_stop_ + 1 : 0;
  size_t best = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t p = text_.find(s, begin);
    if (p < best) {
      best = p;
      matched_ = s;
    }
  }
  if (best == std::string::npos) return;
  text_.resize(best);
  released_ = std::min(released_, text_.size());
  stopped_ = true;
  pending_.clear();
}

bool TextStream::Add(int32_t id) {
  if (stopped_ || finished_) return stopped_;
  if (skip_special_ && tok_->IsSpecial(id)) return false;
  pending_.append(tok_->TokenBytes(id));
  const size_t before = text_.size();
  const size_t used = AppendUtf8Lossy(pending_, /*final=*/false, &text_);
  pending_.erase(0, used);
  if (!stops_.empty() && text_.size() > before) CheckStop(before);
  return stopped_;
}

size_t TextStream::Releasable() const {
  if (stopped_ || finished_) return text_.size();
  // Hold back the longest suffix that is a proper prefix of a stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t k = std::min(s.size() - 1, text_.size()); k > hold; --k) {
      if (text_.compare(text_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  return text_.size() - hold;
}

std::string TextStream::TakeDelta() {
  const size_t end = std::max(Releasable(), released_);
  std::string out = text_.substr(released_, end - released_);
  released_ = end;
  return out;
}

std::string TextStream::Finish() {
  if (!finished_ && !stopped_) {
    const size_t before = text_.size();
    AppendUtf8Lossy(pending_, /*final=*/true, &text_);
    pending_.clear();
    if (!stops_.empty() && text_.size() > before) CheckStop(before);
  }
  finished_ = true;
  return TakeDelta();
}

}  // namespace moelora::tok
