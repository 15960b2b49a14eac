#include "controller/service.h"

#include <limits>
#include <optional>

#include "absl/strings/ascii.h"
#include "proto/grpc_status.h"
#include "tokenizer/text_stream.h"

namespace moelora {

grpc::Status ControllerService::Authorize(const grpc::ServerContext* ctx, bool admin) const {
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
  if (grpc::Status s = Authorize(ctx, /*admin=*/true); !s.ok()) return s;
  auto a = controller_->LoadAdapter(*req);
  if (!a.ok()) return ToGrpc(a.status());
  *resp = *a;
  return grpc::Status::OK;
}

grpc::Status ControllerService::UnloadAdapter(grpc::ServerContext* ctx,
                                              const v1::UnloadAdapterRequest* req,
                                              v1::UnloadAdapterResponse* resp) {
  if (grpc::Status s = Authorize(ctx, /*admin=*/true); !s.ok()) return s;
  auto a = controller_->UnloadAdapter(req->name());
  if (!a.ok()) return ToGrpc(a.status());
  *resp->mutable_adapter() = *a;
  return grpc::Status::OK;
}

grpc::Status ControllerService::ListAdapters(grpc::ServerContext* ctx,
                                             const v1::ListAdaptersRequest*,
                                             v1::ListAdaptersResponse* resp) {
  if (grpc::Status s = Authorize(ctx, /*admin=*/false); !s.ok()) return s;
  for (auto& a : controller_->ListAdapters()) *resp->add_adapters() = a;
  return grpc::Status::OK;
}

grpc::Status ControllerService::GetAdapter(grpc::ServerContext* ctx,
                                           const v1::GetAdapterRequest* req, v1::Adapter* resp) {
  if (grpc::Status s = Authorize(ctx, /*admin=*/false); !s.ok()) return s;
  auto a = controller_->GetAdapter(req->name());
  if (!a.ok()) return ToGrpc(a.status());
  *resp = *a;
  return grpc::Status::OK;
}

grpc::Status ControllerService::Run(grpc::ServerContext* ctx, const v1::GenerateRequest& req,
                                    v1::GenerateResponse* final_chunk, const TokenSink& on_tokens) {
  if (grpc::Status s = Authorize(ctx, /*admin=*/false); !s.ok()) return s;
  auto deadline = std::chrono::steady_clock::time_point::max();
  if (ctx->deadline() != std::chrono::system_clock::time_point::max()) {
    deadline = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                   ctx->deadline() - std::chrono::system_clock::now());
  }
  auto submitted = controller_->Submit(req, deadline);
  if (!submitted.ok()) {
    controller_->RecordRequest(req.adapter(), /*admitted=*/false, submitted.status().code());
    return ToGrpc(submitted.status());
  }
  std::shared_ptr<GenRequest> r = *submitted;
  const tok::Tokenizer* tokenizer = controller_->tokenizer();
  std::optional<tok::TextStream> text;
  if (tokenizer != nullptr) {
    text.emplace(tokenizer, std::vector<std::string>(req.stop().begin(), req.stop().end()),
                 /*skip_special=*/true);
  }
  std::string all_text;                              // the unary response's text
  size_t seen = 0;                                   // tokens taken from the request
  size_t kept = std::numeric_limits<size_t>::max();  // set when a stop string ends the text
  // A unary call without stop strings needs its tokens only at the end: its thread waits for the
  // end (checking for a cancelled call), not woken by each worker call's tokens; the loop below
  // then takes them all at once.
  if (!on_tokens && (!text || req.stop().empty())) {
    while (!r->WaitDone(std::chrono::milliseconds(50))) {
      if (ctx->IsCancelled()) r->cancelled = true;
    }
  }
  while (true) {
    // Copies of the new tokens: detokenizing and writing happen without the request's lock, so
    // a slow client never stalls the scheduler.
    GenRequest::Progress p = r->WaitForProgress(seen, kept, std::chrono::milliseconds(50));
    if (!p.tokens.empty()) {
      std::vector<int32_t>& t = p.tokens;
      std::vector<float>& lp = p.logprobs;
      std::string delta;
      if (text) {
        for (size_t i = 0; i < t.size(); ++i) {
          if (text->Add(t[i])) {
            kept = seen + i + 1;
            t.resize(i + 1);
            if (lp.size() > t.size()) lp.resize(t.size());
            r->stop_string = true;
            controller_->Wake();
            break;
          }
        }
        delta = text->TakeDelta();
        all_text += delta;
      }
      seen += t.size();
      if (on_tokens && !on_tokens(t, lp, delta)) r->cancelled = true;  // the client is gone
      continue;
    }
    if (p.done) break;
    if (ctx->IsCancelled()) r->cancelled = true;
  }
  const GenRequest::Result res = r->GetResult(kept);
  controller_->RecordRequest(r->adapter, /*admitted=*/true, res.status.code());
  if (!res.status.ok()) return ToGrpc(res.status);
  if (text) {
    const std::string rest = text->Finish();
    all_text += rest;
    final_chunk->set_text(on_tokens ? rest : all_text);
  }
  if (!on_tokens) {
    final_chunk->mutable_token_ids()->Add(res.tokens.begin(), res.tokens.end());
    final_chunk->mutable_logprobs()->Add(res.logprobs.begin(), res.logprobs.end());
  }
  const bool stopped = kept != std::numeric_limits<size_t>::max();
  if (stopped) metrics_->stop_strings.Increment();
  final_chunk->set_finish_reason(stopped ? "stop" : res.finish_reason);
  final_chunk->mutable_usage()->set_prompt_tokens(r->req.prompt_token_ids_size());
  final_chunk->mutable_usage()->set_completion_tokens(static_cast<int>(res.tokens.size()));
  final_chunk->mutable_timings()->set_queue_seconds(res.queue_seconds);
  final_chunk->mutable_timings()->set_time_to_first_token_seconds(res.ttft_seconds);
  final_chunk->mutable_timings()->set_total_seconds(res.total_seconds);
  return grpc::Status::OK;
}

grpc::Status ControllerService::Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                                         v1::GenerateResponse* resp) {
  return Run(ctx, *req, resp, nullptr);
}

grpc::Status ControllerService::GenerateStream(grpc::ServerContext* ctx,
                                               const v1::GenerateRequest* req,
                                               grpc::ServerWriter<v1::GenerateResponse>* writer) {
  v1::GenerateResponse last;
  grpc::Status s = Run(ctx, *req, &last,
                       [&](const std::vector<int32_t>& tokens, const std::vector<float>& lp,
                           const std::string& text) {
                         v1::GenerateResponse chunk;
                         chunk.mutable_token_ids()->Add(tokens.begin(), tokens.end());
                         chunk.mutable_logprobs()->Add(lp.begin(), lp.end());
                         chunk.set_text(text);
                         return writer->Write(chunk);
                       });
  if (s.ok()) writer->Write(last);
  return s;
}

}  // namespace moelora
