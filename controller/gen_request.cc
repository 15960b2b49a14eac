#include "controller/gen_request.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moelora {
namespace {
double Seconds(GenRequest::Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

absl::Status GenRequest::Expiry(Clock::time_point now, const char* where) const {
  if (now > deadline) {
    return absl::DeadlineExceededError(absl::StrCat("deadline exceeded while ", where));
  }
  if (now > timeout_at) {
    return absl::DeadlineExceededError(
        absl::StrCat("--request-timeout-s ", request_timeout_s, " exceeded while ", where));
  }
  if (cancelled) return absl::CancelledError("cancelled by the client");
  return absl::OkStatus();
}

void GenRequest::SetQueueSeconds(double s) {
  MutexLock lock(&mu_);
  queue_seconds_ = s;
}

std::vector<GenRequest::TokenTiming> GenRequest::AddTokens(absl::Span<const int32_t> tokens,
                                                           absl::Span<const float> logprobs,
                                                           Clock::time_point now) {
  std::vector<TokenTiming> timings(tokens.size());
  std::function<void()> notify;
  {
    MutexLock lock(&mu_);
    if (listen_to_tokens_ && !tokens.empty()) notify = listener_;
    for (size_t i = 0; i < tokens.size(); ++i) {
      TokenTiming& t = timings[i];
      t.first = tokens_.empty();
      if (t.first) {
        ttft_seconds_ = Seconds(now - arrival);
        t.seconds = ttft_seconds_;
      } else {
        t.seconds = Seconds(now - last_token_);
      }
      last_token_ = now;
      tokens_.push_back(tokens[i]);
      if (req.return_logprobs()) logprobs_.push_back(i < logprobs.size() ? logprobs[i] : 0.0f);
    }
  }
  if (notify) notify();
  return timings;
}

bool GenRequest::Finish(absl::Status status, std::string finish_reason, Clock::time_point now) {
  std::function<void()> notify;
  {
    MutexLock lock(&mu_);
    notify = listener_;
    if (done_) return false;
    done_ = true;
    status_ = std::move(status);
    finish_reason_ = std::move(finish_reason);
    total_seconds_ = Seconds(now - arrival);
  }
  cv_.SignalAll();
  if (notify) notify();
  return true;
}

void GenRequest::SetListener(std::function<void()> fn, bool on_tokens) {
  bool now;
  {
    MutexLock lock(&mu_);
    listener_ = fn;
    listen_to_tokens_ = on_tokens;
    now = done_ || (on_tokens && !tokens_.empty());
  }
  if (now) fn();
}

GenRequest::Progress GenRequest::Peek(size_t seen, size_t limit) const {
  MutexLock lock(&mu_);
  Progress p;
  const size_t n = std::min(tokens_.size(), limit);
  if (n > seen) {
    p.tokens.assign(tokens_.begin() + seen, tokens_.begin() + n);
    if (logprobs_.size() >= n) p.logprobs.assign(logprobs_.begin() + seen, logprobs_.begin() + n);
  }
  p.done = done_;
  return p;
}

bool GenRequest::WaitDone(std::chrono::milliseconds timeout) {
  MutexLock lock(&mu_);
  const auto until = Clock::now() + timeout;
  while (!done_) {
    const auto now = Clock::now();
    if (now >= until) return false;
    cv_.WaitFor(&mu_, until - now);
  }
  return true;
}

GenRequest::Result GenRequest::GetResult(size_t limit) const {
  MutexLock lock(&mu_);
  Result r;
  r.status = status_;
  r.finish_reason = finish_reason_;
  const size_t n = std::min(tokens_.size(), limit);
  r.tokens.assign(tokens_.begin(), tokens_.begin() + n);
  r.logprobs.assign(logprobs_.begin(), logprobs_.begin() + std::min(logprobs_.size(), n));
  r.queue_seconds = queue_seconds_;
  r.ttft_seconds = ttft_seconds_;
  r.total_seconds = total_seconds_;
  return r;
}

size_t GenRequest::num_tokens() const {
  MutexLock lock(&mu_);
  return tokens_.size();
}

}  // namespace moelora
