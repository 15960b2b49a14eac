#include "controller/service.h"

#include "absl/strings/ascii.h"
#include "proto/grpc_status.h"

namespace moelora {

grpc::Status ControllerService::LoadAdapter(grpc::ServerContext*, const v1::LoadAdapterRequest* req,
                                            v1::Adapter* resp) {
  auto a = controller_->LoadAdapter(*req);
  if (!a.ok()) return ToGrpc(a.status());
  *resp = *a;
  return grpc::Status::OK;
}

grpc::Status ControllerService::UnloadAdapter(grpc::ServerContext*,
                                              const v1::UnloadAdapterRequest* req,
                                              v1::UnloadAdapterResponse* resp) {
  auto a = controller_->UnloadAdapter(req->name());
  if (!a.ok()) return ToGrpc(a.status());
  *resp->mutable_adapter() = *a;
  return grpc::Status::OK;
}

grpc::Status ControllerService::ListAdapters(grpc::ServerContext*, const v1::ListAdaptersRequest*,
                                             v1::ListAdaptersResponse* resp) {
  for (auto& a : controller_->ListAdapters()) *resp->add_adapters() = a;
  return grpc::Status::OK;
}

grpc::Status ControllerService::GetAdapter(grpc::ServerContext*, const v1::GetAdapterRequest* req,
                                           v1::Adapter* resp) {
  auto a = controller_->GetAdapter(req->name());
  if (!a.ok()) return ToGrpc(a.status());
  *resp = *a;
  return grpc::Status::OK;
}

grpc::Status ControllerService::Run(grpc::ServerContext* ctx, const v1::GenerateRequest& req,
                                    v1::GenerateResponse* final_chunk, const TokenSink& on_tokens) {
  auto deadline = std::chrono::steady_clock::time_point::max();
  if (ctx->deadline() != std::chrono::system_clock::time_point::max()) {
    deadline = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                   ctx->deadline() - std::chrono::system_clock::now());
  }
  auto submitted = controller_->Submit(req, deadline);
  if (!submitted.ok()) {
    metrics_->requests
        .Add({{"adapter", req.adapter().empty() ? "base" : req.adapter()},
              {"code", absl::AsciiStrToLower(absl::StatusCodeToString(submitted.status().code()))}})
        .Increment();
    return ToGrpc(submitted.status());
  }
  std::shared_ptr<GenRequest> r = *submitted;
  size_t sent = 0;
  std::unique_lock<std::mutex> lock(r->mu);
  while (true) {
    if (on_tokens && r->tokens.size() > sent) {
      // Copy, then write without the lock: a slow client must not stall the scheduler.
      std::vector<int32_t> t(r->tokens.begin() + sent, r->tokens.end());
      std::vector<float> lp;
      if (r->logprobs.size() >= r->tokens.size())
        lp.assign(r->logprobs.begin() + sent, r->logprobs.end());
      sent = r->tokens.size();
      lock.unlock();
      const bool ok = on_tokens(t, lp);
      lock.lock();
      if (!ok) r->cancelled = true;  // the client is gone
      continue;
    }
    if (r->done) break;
    r->cv.wait_for(lock, std::chrono::milliseconds(50));
    if (ctx->IsCancelled()) r->cancelled = true;
  }
  lock.unlock();
  controller_->RecordRequest(*r, r->status.code());
  if (!r->status.ok()) return ToGrpc(r->status);
  if (!on_tokens) {
    final_chunk->mutable_token_ids()->Add(r->tokens.begin(), r->tokens.end());
    final_chunk->mutable_logprobs()->Add(r->logprobs.begin(), r->logprobs.end());
  }
  final_chunk->set_finish_reason(r->finish_reason);
  final_chunk->mutable_usage()->set_prompt_tokens(r->req.prompt_token_ids_size());
  final_chunk->mutable_usage()->set_completion_tokens(static_cast<int>(r->tokens.size()));
  final_chunk->mutable_timings()->set_queue_seconds(r->queue_seconds);
  final_chunk->mutable_timings()->set_time_to_first_token_seconds(r->ttft_seconds);
  final_chunk->mutable_timings()->set_total_seconds(r->total_seconds);
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
  grpc::Status s =
      Run(ctx, *req, &last, [&](const std::vector<int32_t>& tokens, const std::vector<float>& lp) {
        v1::GenerateResponse chunk;
        chunk.mutable_token_ids()->Add(tokens.begin(), tokens.end());
        chunk.mutable_logprobs()->Add(lp.begin(), lp.end());
        return writer->Write(chunk);
      });
  if (s.ok()) writer->Write(last);
  return s;
}

}  // namespace moelora
