// One Generate call in flight, shared by its RPC thread and the scheduler, with all of its
// locking here.
//
// Thread-safety: the fields above `cancelled` are set once by Controller::Submit, before the
// request is shared, and only read afterwards. `cancelled` and `stop_string` are atomics the RPC
// thread sets. Everything else (tokens, timings, the outcome) is under the request's own mutex:
// the scheduler writes it through SetQueueSeconds / AddTokens / Finish, the RPC side is told by
// its listener and reads it through Peek / GetResult.
#ifndef MOELORA_CONTROLLER_GEN_REQUEST_H_
#define MOELORA_CONTROLLER_GEN_REQUEST_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/mutex.h"
#include "moelora/v1/controller.pb.h"
#include "moelora/v1/worker.pb.h"

namespace moelora {

class GenRequest {
 public:
  using Clock = std::chrono::steady_clock;

  // Set by Submit before the request is shared.
  int64_t seq_id = 0;
  int64_t adapter_id = 0;
  std::string adapter;  // "" = base
  v1::GenerateRequest req;
  // Its images, prepared (sent to the workers with the sequence, then released).
  std::vector<v1::SequenceImage> images;
  uint64_t seed = 0;
  Clock::time_point arrival;
  Clock::time_point deadline = Clock::time_point::max();  // the client's
  // --request-timeout-s after arrival (the server's bound whatever the client asks for).
  Clock::time_point timeout_at = Clock::time_point::max();
  int request_timeout_s = 0;  // for the message
  double tokenize_seconds = 0;

  std::atomic<bool> cancelled{false};
  // Set by the RPC thread when the text reached a stop string: the scheduler then ends the
  // sequence (finish_reason "stop"); tokens generated after it are dropped.
  std::atomic<bool> stop_string{false};

  // Scheduler side.
  // Why the request must leave at `now`: its deadline passed or its client cancelled (deadline
  // first: gRPC also marks a call cancelled when its deadline passes). OK when it may stay;
  // `where` ("queued", "generating") goes into the message.
  absl::Status Expiry(Clock::time_point now, const char* where) const;
  void SetQueueSeconds(double s) ABSL_LOCKS_EXCLUDED(mu_);
  // Appends the tokens a worker call sampled for this request, in order, and calls the listener
  // once for all of them (one call of --decode-steps steps brings up to that many) when it asked
  // for tokens. `logprobs` is as long as `tokens`. Returns each token's time to the first token
  // (the request's first) or since the token before it, and whether it was the first.
  struct TokenTiming {
    bool first = false;
    double seconds = 0;
  };
  std::vector<TokenTiming> AddTokens(absl::Span<const int32_t> tokens,
                                     absl::Span<const float> logprobs, Clock::time_point now)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the request once and calls the listener; false when it had ended already.
  bool Finish(absl::Status status, std::string finish_reason, Clock::time_point now)
      ABSL_LOCKS_EXCLUDED(mu_);

  // RPC side. `fn` is called (on the scheduler's thread, without the request's lock: it must
  // only hand work on) when the request ends and, with `on_tokens`, when tokens arrive; at once
  // when either happened before. Set once.
  void SetListener(std::function<void()> fn, bool on_tokens) ABSL_LOCKS_EXCLUDED(mu_);
  // The tokens in [seen, min(size, limit)) and whether the request has ended. Tokens are
  // appended before Finish, so an empty slice with `done` means every token was taken.
  struct Progress {
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;  // when requested
    bool done = false;
  };
  Progress Peek(size_t seen, size_t limit) const ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until the request has ended (false after `timeout`).
  bool WaitDone(std::chrono::milliseconds timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // The outcome, its first `limit` tokens.
  struct Result {
    absl::Status status;
    std::string finish_reason;
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
    double queue_seconds = 0, ttft_seconds = 0, total_seconds = 0;
  };
  Result GetResult(size_t limit = SIZE_MAX) const ABSL_LOCKS_EXCLUDED(mu_);
  size_t num_tokens() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable Mutex mu_;
  CondVar cv_;
  std::vector<int32_t> tokens_ ABSL_GUARDED_BY(mu_);
  std::vector<float> logprobs_ ABSL_GUARDED_BY(mu_);
  Clock::time_point last_token_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::string finish_reason_ ABSL_GUARDED_BY(mu_);
  double queue_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double ttft_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double total_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  // A unary Generate without stop strings needs only the end: waking it for each worker call's
  // tokens at batch 32 took CPU time from the worker and the scheduler's thread.
  std::function<void()> listener_ ABSL_GUARDED_BY(mu_);
  bool listen_to_tokens_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_GEN_REQUEST_H_
