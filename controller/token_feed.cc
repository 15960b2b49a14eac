#include "controller/token_feed.h"

#include <utility>

namespace moelora {

TokenFeed::TokenFeed(Controller* controller, ControllerMetrics* metrics,
                     std::shared_ptr<GenRequest> r)
    : controller_(controller), metrics_(metrics), r_(std::move(r)) {
  if (const tok::Tokenizer* tokenizer = controller_->tokenizer(); tokenizer != nullptr) {
    text_.emplace(tokenizer, std::vector<std::string>(r_->req.stop().begin(), r_->req.stop().end()),
                  /*skip_special=*/true);
  }
}

TokenFeed::Chunk TokenFeed::Take() {
  Chunk c;
  GenRequest::Progress p = r_->Peek(seen_, kept_);
  c.done = p.done;
  if (p.tokens.empty()) return c;
  c.tokens = std::move(p.tokens);
  c.logprobs = std::move(p.logprobs);
  if (text_) {
    for (size_t i = 0; i < c.tokens.size(); ++i) {
      if (text_->Add(c.tokens[i])) {
        kept_ = seen_ + i + 1;
        c.tokens.resize(i + 1);
        if (c.logprobs.size() > c.tokens.size()) c.logprobs.resize(c.tokens.size());
        r_->stop_string = true;
        controller_->Wake();
        break;
      }
    }
    c.text = text_->TakeDelta();
    all_text_ += c.text;
  }
  seen_ += c.tokens.size();
  return c;
}

TokenFeed::Outcome TokenFeed::Finish() {
  Outcome o;
  o.result = r_->GetResult(kept_);
  controller_->RecordRequest(r_->adapter, /*admitted=*/true, o.result.status.code());
  o.status = o.result.status;
  if (!o.status.ok()) return o;
  if (text_) {
    o.rest = text_->Finish();
    all_text_ += o.rest;
    o.text = all_text_;
  }
  const bool stopped = kept_ != std::numeric_limits<size_t>::max();
  if (stopped) metrics_->stop_strings.Increment();
  o.finish_reason = stopped ? "stop" : o.result.finish_reason;
  return o;
}

}  // namespace moelora
