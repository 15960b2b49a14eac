#include "controller/service.h"

#include <atomic>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "common/logging.h"
#include "controller/request_validation.h"
#include "controller/token_feed.h"
#include "proto/grpc_status.h"

namespace moelora {
namespace {

// fn() with any exception turned into INTERNAL (and logged): none leaves a gRPC handler.
template <typename Fn>
grpc::Status Guarded(const char* method, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    LOG(ERROR) << method << ": exception: " << e.what();
  } catch (...) {
    LOG(ERROR) << method << ": unknown exception";
  }
  return grpc::Status(grpc::StatusCode::INTERNAL, "internal error");
}

}  // namespace

grpc::Status ControllerService::Authorize(const grpc::ServerContextBase* ctx, bool admin) const {
  if (auth_ == nullptr) return grpc::Status::OK;
  absl::string_view authorization;
  const auto& md = ctx->client_metadata();
  if (auto it = md.find("authorization"); it != md.end()) {
    authorization = absl::string_view(it->second.data(), it->second.size());
  }
  const absl::Status s = auth_->Check(authorization, admin);
  if (s.ok()) return grpc::Status::OK;
  metrics_->auth_failures.Add({{"code", absl::AsciiStrToLower(absl::StatusCodeToString(s.code()))}})
      .Increment();
  return ToGrpc(s);
}

grpc::Status ControllerService::LoadAdapter(grpc::ServerContext* ctx,
                                            const v1::LoadAdapterRequest* req, v1::Adapter* resp) {
  return Guarded("LoadAdapter", [&]() -> grpc::Status {
    if (grpc::Status s = Authorize(ctx, /*admin=*/true); !s.ok()) return s;
    auto a = controller_->LoadAdapter(*req);
    if (!a.ok()) return ToGrpc(a.status());
    *resp = *a;
    return grpc::Status::OK;
  });
}

grpc::Status ControllerService::UnloadAdapter(grpc::ServerContext* ctx,
                                              const v1::UnloadAdapterRequest* req,
                                              v1::UnloadAdapterResponse* resp) {
  return Guarded("UnloadAdapter", [&]() -> grpc::Status {
    if (grpc::Status s = Authorize(ctx, /*admin=*/true); !s.ok()) return s;
    auto a = controller_->UnloadAdapter(req->name());
    if (!a.ok()) return ToGrpc(a.status());
    *resp->mutable_adapter() = *a;
    return grpc::Status::OK;
  });
}

grpc::Status ControllerService::ListAdapters(grpc::ServerContext* ctx,
                                             const v1::ListAdaptersRequest*,
                                             v1::ListAdaptersResponse* resp) {
  return Guarded("ListAdapters", [&]() -> grpc::Status {
    if (grpc::Status s = Authorize(ctx, /*admin=*/false); !s.ok()) return s;
    for (auto& a : controller_->ListAdapters()) *resp->add_adapters() = a;
    return grpc::Status::OK;
  });
}

grpc::Status ControllerService::GetAdapter(grpc::ServerContext* ctx,
                                           const v1::GetAdapterRequest* req, v1::Adapter* resp) {
  return Guarded("GetAdapter", [&]() -> grpc::Status {
    if (grpc::Status s = Authorize(ctx, /*admin=*/false); !s.ok()) return s;
    auto a = controller_->GetAdapter(req->name());
    if (!a.ok()) return ToGrpc(a.status());
    *resp = *a;
    return grpc::Status::OK;
  });
}

// One Generate or GenerateStream call. Shared by its reactor (gRPC's threads), its request's
// listener (the scheduler's thread, which only posts Pump) and the pump threads. The reactor
// stays valid until Finish is called on it, which happens once, after which nothing here
// touches it; gRPC calls are made without mu_ held (a reaction may run inline).
class ControllerService::Call : public std::enable_shared_from_this<Call> {
 public:
  Call(ControllerService* svc, grpc::ServerWriteReactor<grpc::ByteBuffer>* stream,
       grpc::ServerUnaryReactor* unary, grpc::ByteBuffer* unary_response)
      : svc_(svc), stream_(stream), unary_(unary), unary_response_(unary_response) {}

  // gRPC's thread: authorization here; the submission (which may tokenize a long prompt) on a
  // preparation thread.
  void Start(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw) {
    grpc::Status refused = svc_->Authorize(ctx, /*admin=*/false);
    if (refused.ok()) refused = ParseRequest(raw);
    if (!refused.ok()) {
      {
        MutexLock lock(&mu_);
        finished_ = true;
      }
      FinishReactor(refused);
      return;
    }
    const v1::GenerateRequest* req = &req_;
    auto deadline = std::chrono::steady_clock::time_point::max();
    if (ctx->deadline() != std::chrono::system_clock::time_point::max()) {
      deadline = std::chrono::steady_clock::now() +
                 std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                     ctx->deadline() - std::chrono::system_clock::now());
    }
    // Tokenizing, images and adapter resolution on the preparation threads, not on the pump
    // threads that write every stream's tokens.
    absl::Status s = svc_->controller_->Prepare([self = shared_from_this(), req, deadline] {
      try {
        self->Submit(*req, deadline);
      } catch (const std::exception& e) {  // no exception leaves a call: it ends INTERNAL
        LOG(ERROR) << "Generate: exception: " << e.what();
        self->Fail(grpc::Status(grpc::StatusCode::INTERNAL, "internal error"));
      }
    });
    if (!s.ok()) {
      svc_->controller_->RecordRequest(req->adapter(), /*admitted=*/false, s.code());
      {
        MutexLock lock(&mu_);
        finished_ = true;
      }
      FinishReactor(ToGrpc(s));
    }
  }

  // The request from its bytes: counts scanned on the wire first (CheckWireCaps), then parsed.
  grpc::Status ParseRequest(const grpc::ByteBuffer* raw) {
    std::vector<grpc::Slice> slices;
    if (!raw->Dump(&slices).ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "unreadable request");
    }
    std::string wire;
    wire.reserve(raw->Length());
    for (const grpc::Slice& sl : slices) {
      wire.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    }
    Controller* c = svc_->controller_;
    if (absl::Status s = CheckWireCaps(wire, c->caps(), c->limit_images_per_prompt()); !s.ok()) {
      return ToGrpc(s);
    }
    if (!req_.ParseFromString(wire)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "the request is not a moelora.v1.GenerateRequest");
    }
    return grpc::Status::OK;
  }

  // gRPC's thread (OnCancel): the scheduler ends the request, whose listener finishes the call.
  void Cancel() {
    cancelled_ = true;
    if (std::shared_ptr<GenRequest> r = request()) {
      r->cancelled = true;
      svc_->controller_->Wake();
    }
  }

  // gRPC's thread (OnWriteDone).
  void WriteDone(bool ok) {
    if (!ok) Cancel();  // the client is gone: nothing more is written
    Action next;
    {
      MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) broken_ = true;
      next = Next();
    }
    if (next) next();
  }

 private:
  std::shared_ptr<GenRequest> request() {
    MutexLock lock(&mu_);
    return r_;
  }

  // Ends the call with `s` before any request ran.
  void Fail(const grpc::Status& s) {
    Action next;
    {
      MutexLock lock(&mu_);
      if (final_ready_) return;
      final_status_ = s;
      final_ready_ = true;
      next = Next();
    }
    if (next) next();
  }

  void Submit(const v1::GenerateRequest& req, std::chrono::steady_clock::time_point deadline) {
    Controller* c = svc_->controller_;
    absl::StatusOr<std::shared_ptr<GenRequest>> submitted = c->Submit(req, deadline);
    if (!submitted.ok()) {
      c->RecordRequest(req.adapter(), /*admitted=*/false, submitted.status().code());
      return Fail(ToGrpc(submitted.status()));
    }
    std::shared_ptr<GenRequest> r = *submitted;
    const tok::Tokenizer* tokenizer = c->tokenizer();
    {
      MutexLock lock(&mu_);
      r_ = r;
      feed_.emplace(c, svc_->metrics_, r);
    }
    if (cancelled_) {
      r->cancelled = true;
      c->Wake();
    }
    // A unary call without stop strings needs its tokens only at the end.
    const bool on_tokens = stream_ != nullptr || (tokenizer != nullptr && !req.stop().empty());
    r->SetListener(
        [weak = weak_from_this()] {
          if (std::shared_ptr<Call> self = weak.lock()) self->Schedule();
        },
        on_tokens);
  }

  // The scheduler's thread: at most one Pump queued at a time.
  void Schedule() {
    if (!queued_.exchange(true)) svc_->pump_.Post([self = shared_from_this()] { self->Pump(); });
  }

  // A pump thread: new tokens to text (ending the request at a stop string), then writes.
  void Pump() {
    queued_ = false;
    Action next;
    {
      MutexLock lock(&mu_);
      next = PumpLocked();
    }
    if (next) next();
  }

  using Action = std::function<void()>;  // a gRPC call, made without mu_ held

  Action PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (final_ready_) return nullptr;
    TokenFeed::Chunk c = feed_->Take();
    if (!c.tokens.empty() && stream_ != nullptr && !broken_) {
      pending_.mutable_token_ids()->Add(c.tokens.begin(), c.tokens.end());
      pending_.mutable_logprobs()->Add(c.logprobs.begin(), c.logprobs.end());
      pending_.mutable_text()->append(c.text);
      has_pending_ = true;
    }
    if (c.done) Conclude();
    return Next();
  }

  // The request has ended and every token it kept was taken: the last response or the status.
  void Conclude() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    final_ready_ = true;
    TokenFeed::Outcome o = feed_->Finish();
    if (!o.status.ok()) {
      final_status_ = ToGrpc(o.status);
      return;
    }
    v1::GenerateResponse& last = final_chunk_;
    if (feed_->has_text()) last.set_text(stream_ != nullptr ? o.rest : o.text);
    if (stream_ == nullptr) {
      last.mutable_token_ids()->Add(o.result.tokens.begin(), o.result.tokens.end());
      last.mutable_logprobs()->Add(o.result.logprobs.begin(), o.result.logprobs.end());
    }
    last.set_finish_reason(o.finish_reason);
    last.mutable_usage()->set_prompt_tokens(r_->req.prompt_token_ids_size());
    last.mutable_usage()->set_completion_tokens(static_cast<int>(o.result.tokens.size()));
    last.mutable_timings()->set_queue_seconds(o.result.queue_seconds);
    last.mutable_timings()->set_time_to_first_token_seconds(o.result.ttft_seconds);
    last.mutable_timings()->set_total_seconds(o.result.total_seconds);
  }

  // The next write, or the end of the call once everything was written (one write at a time);
  // null when there is nothing to do now.
  Action Next() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_) return nullptr;
    if (stream_ != nullptr && has_pending_ && !broken_) {
      in_flight_.Swap(&pending_);
      pending_.Clear();
      has_pending_ = false;
      writing_ = true;
      Serialize(in_flight_, &in_flight_bytes_);
      return [this] { stream_->StartWrite(&in_flight_bytes_); };
    }
    if (!final_ready_) return nullptr;
    finished_ = true;
    if (stream_ != nullptr && final_status_.ok() && !broken_) {
      Serialize(final_chunk_, &in_flight_bytes_);
      return [this] {
        stream_->StartWriteAndFinish(&in_flight_bytes_, grpc::WriteOptions(), grpc::Status::OK);
      };
    }
    if (unary_ != nullptr && final_status_.ok()) Serialize(final_chunk_, unary_response_);
    // A stream whose client went away ends CANCELLED whatever the request's own outcome.
    grpc::Status s = broken_ && final_status_.ok()
                         ? grpc::Status(grpc::StatusCode::CANCELLED, "client gone")
                         : final_status_;
    return [this, s = std::move(s)] { FinishReactor(s); };
  }

  static void Serialize(const v1::GenerateResponse& m, grpc::ByteBuffer* out) {
    const std::string bytes = m.SerializeAsString();
    grpc::Slice slice(bytes);
    *out = grpc::ByteBuffer(&slice, 1);
  }

  void FinishReactor(const grpc::Status& s) {
    if (stream_ != nullptr) {
      stream_->Finish(s);
    } else {
      unary_->Finish(s);
    }
  }

  ControllerService* const svc_;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* const stream_;
  grpc::ServerUnaryReactor* const unary_;
  grpc::ByteBuffer* const unary_response_;
  v1::GenerateRequest req_;  // parsed by Start, then only read
  std::atomic<bool> queued_{false};
  std::atomic<bool> cancelled_{false};

  Mutex mu_;
  std::shared_ptr<GenRequest> r_ ABSL_GUARDED_BY(mu_);
  std::optional<TokenFeed> feed_ ABSL_GUARDED_BY(mu_);
  v1::GenerateResponse pending_ ABSL_GUARDED_BY(mu_);  // taken, not yet written
  bool has_pending_ ABSL_GUARDED_BY(mu_) = false;
  v1::GenerateResponse in_flight_;    // the response being written (set only while no write is)
  grpc::ByteBuffer in_flight_bytes_;  // its bytes, which gRPC holds during the write
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;  // a write failed: the client is gone
  bool final_ready_ ABSL_GUARDED_BY(mu_) = false;
  v1::GenerateResponse final_chunk_ ABSL_GUARDED_BY(mu_);
  grpc::Status final_status_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

class ControllerService::StreamReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  StreamReactor(ControllerService* svc, grpc::CallbackServerContext* ctx,
                const grpc::ByteBuffer* req)
      : call_(std::make_shared<Call>(svc, this, nullptr, nullptr)) {
    call_->Start(ctx, req);
  }
  void OnWriteDone(bool ok) override { call_->WriteDone(ok); }
  void OnCancel() override { call_->Cancel(); }
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<Call> call_;
};

class ControllerService::UnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  UnaryReactor(ControllerService* svc, grpc::CallbackServerContext* ctx,
               const grpc::ByteBuffer* req, grpc::ByteBuffer* resp)
      : call_(std::make_shared<Call>(svc, nullptr, this, resp)) {
    call_->Start(ctx, req);
  }
  void OnCancel() override { call_->Cancel(); }
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<Call> call_;
};

grpc::ServerUnaryReactor* ControllerService::Generate(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* req,
                                                      grpc::ByteBuffer* resp) {
  return new UnaryReactor(this, ctx, req, resp);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* ControllerService::GenerateStream(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req) {
  return new StreamReactor(this, ctx, req);
}

}  // namespace moelora
