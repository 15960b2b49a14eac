// One request's generated tokens as a front end hands them on (the gRPC service, the OpenAI
// HTTP API): the new tokens since the last look, their text with the request's stop strings
// applied (reaching one ends the request: the scheduler is woken to stop it), and at the end the
// outcome, counted in moelora_requests_total.
//
// Thread-safety: none; its owner calls it under its own lock.
#ifndef MOELORA_CONTROLLER_TOKEN_FEED_H_
#define MOELORA_CONTROLLER_TOKEN_FEED_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "controller/controller.h"
#include "controller/gen_request.h"
#include "controller/metrics.h"
#include "tokenizer/text_stream.h"

namespace moelora {

class TokenFeed {
 public:
  // Text is produced when the controller has a tokenizer.
  TokenFeed(Controller* controller, ControllerMetrics* metrics, std::shared_ptr<GenRequest> r);

  struct Chunk {
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;  // when the request asked for them
    std::string text;             // the text these tokens released (may be empty)
    bool done = false;            // the request ended: these are its last tokens
  };
  Chunk Take();

  struct Outcome {
    absl::Status status;
    std::string finish_reason;  // "stop" when a stop string ended the text
    std::string rest;           // text held back until the end (a stream's last delta)
    std::string text;           // all of it
    GenRequest::Result result;  // tokens up to the one that completed a stop string
  };
  // Once, after Take returned done.
  Outcome Finish();

  bool has_text() const { return text_.has_value(); }
  const std::shared_ptr<GenRequest>& request() const { return r_; }

 private:
  Controller* const controller_;
  ControllerMetrics* const metrics_;
  const std::shared_ptr<GenRequest> r_;
  std::optional<tok::TextStream> text_;
  std::string all_text_;
  size_t seen_ = 0;                                   // tokens taken from the request
  size_t kept_ = std::numeric_limits<size_t>::max();  // set when a stop string ends the text
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_TOKEN_FEED_H_
