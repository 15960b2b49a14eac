#include "worker/service.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string_view>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/path_policy.h"
#include "proto/adapter_format.h"
#include "proto/group_secret.h"
#include "proto/grpc_status.h"

namespace moelora {

void WorkerService::SetReady(std::unique_ptr<Communicator> comm, std::unique_ptr<Engine> engine) {
  comm_ = std::move(comm);
  owned_engine_ = std::move(engine);
  engine_.store(owned_engine_.get(), std::memory_order_release);
  metrics_->SetReady(true);
  UpdateAdapterGauges();
}

void WorkerService::SetLoadingDetail(const std::string& detail) {
  std::lock_guard<std::mutex> lock(detail_mu_);
  detail_ = detail;
}

grpc::Status WorkerService::NotReady() const {
  std::lock_guard<std::mutex> lock(detail_mu_);
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat("worker not ready: ", detail_));
}

void WorkerService::UpdateAdapterGauges() {
  const EngineInfo i = engine()->Info();
  metrics_->SetAdapters(i.staged_adapters, i.committed_adapters);
  metrics_->SetHostCache(i.host_cache.adapters, i.host_cache.bytes);
  metrics_->SetSlotBytes(engine()->SlotResidentBytes());
}

grpc::Status WorkerService::CheckCaller(const grpc::ServerContext* ctx) const {
  if (group_secret_.empty()) return grpc::Status::OK;
  const auto& md = ctx->client_metadata();
  auto it = md.find(kGroupSecretMetadata);
  if (it != md.end() &&
      SameSecret(std::string_view(it->second.data(), it->second.size()), group_secret_)) {
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "this worker serves only the controller that spawned it");
}

grpc::Status WorkerService::StageAdapter(grpc::ServerContext* ctx,
                                         const v1::StageAdapterRequest* req,
                                         v1::StageAdapterResponse* resp) {
  if (grpc::Status s = CheckCaller(ctx); !s.ok()) return s;
  Engine* e = engine();
  if (!e) return NotReady();
  if (req->path().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "StageAdapter: empty path");
  }
  // Whoever reaches this port reads only adapters under this worker's own root (symlinks
  // resolved), whatever the caller claims.
  absl::StatusOr<std::string> path = ResolveAdapterPath(adapter_root_, req->path());
  if ((path.status().code() == absl::StatusCode::kNotFound ||
       (path.status().code() == absl::StatusCode::kFailedPrecondition && !adapter_root_.empty())) &&
      LexicallyInside(adapter_root_, req->path())) {
    // Inside the root but gone from disk (the adapter's directory, or the root itself): the host
    // cache may still hold it (a swap-in reads no file); otherwise the engine answers NOT_FOUND.
    // A path that does not exist has no symlink to follow out of the root.
    path = req->path();
  }
  if (!path.ok()) {
    metrics_->AdapterLoadFailed(
        absl::AsciiStrToLower(absl::StatusCodeToString(path.status().code())));
    return ToGrpc(
        absl::Status(path.status().code(),
                     absl::StrCat("adapter \"", req->name(), "\": ", path.status().message(),
                                  " (the worker's --adapter-root)")));
  }
  auto r = e->StageAdapter(req->adapter_id(), *path, AdapterFormatFromProto(req->format()));
  if (!r.ok()) {
    metrics_->AdapterLoadFailed(absl::AsciiStrToLower(absl::StatusCodeToString(r.status().code())));
    return ToGrpc(absl::Status(
        r.status().code(), absl::StrCat("adapter \"", req->name(), "\": ", r.status().message())));
  }
  resp->set_detected_format(AdapterFormatToProto(r->detected_format));
  resp->set_converted_to_2d(r->converted_to_2d);
  resp->set_bytes(r->bytes);
  resp->set_rank(r->rank);
  resp->set_from_host_cache(r->from_host_cache);
  for (const auto& [k, v] : r->phase_seconds) (*resp->mutable_phase_seconds())[k] = v;
  metrics_->AdapterStaged(AdapterFormatName(r->detected_format), r->converted_to_2d,
                          r->phase_seconds, r->from_host_cache);
  UpdateAdapterGauges();
  return grpc::Status::OK;
}

grpc::Status WorkerService::CommitAdapter(grpc::ServerContext* ctx,
                                          const v1::CommitAdapterRequest* req,
                                          v1::CommitAdapterResponse* resp) {
  if (grpc::Status s = CheckCaller(ctx); !s.ok()) return s;
  Engine* e = engine();
  if (!e) return NotReady();
  auto slot = e->CommitAdapter(req->adapter_id());
  if (!slot.ok()) return ToGrpc(slot.status());
  resp->set_slot(*slot);
  UpdateAdapterGauges();
  return grpc::Status::OK;
}

grpc::Status WorkerService::AbortAdapter(grpc::ServerContext* ctx,
                                         const v1::AbortAdapterRequest* req,
                                         v1::AbortAdapterResponse*) {
  if (grpc::Status s = CheckCaller(ctx); !s.ok()) return s;
  Engine* e = engine();
  if (!e) return NotReady();
  grpc::Status s = ToGrpc(e->AbortAdapter(req->adapter_id()));
  UpdateAdapterGauges();
  return s;
}

grpc::Status WorkerService::UnloadAdapter(grpc::ServerContext* ctx,
                                          const v1::WorkerUnloadAdapterRequest* req,
                                          v1::WorkerUnloadAdapterResponse* resp) {
  if (grpc::Status s = CheckCaller(ctx); !s.ok()) return s;
  Engine* e = engine();
  if (!e) return NotReady();
  absl::StatusOr<HostCacheStats> cache =
      e->UnloadAdapter(req->adapter_id(), req->keep_in_host_cache());
  UpdateAdapterGauges();
  if (!cache.ok()) return ToGrpc(cache.status());
  for (int64_t id : cache->adapter_ids) resp->add_host_cache_adapter_ids(id);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Step(grpc::ServerContext* ctx, const v1::StepRequest* req,
                                 v1::StepResponse* resp) {
  if (grpc::Status s = CheckCaller(ctx); !s.ok()) return s;
  Engine* e = engine();
  if (!e) return NotReady();
  if (req->after_step() != 0) {
    // Sent ahead: wait until the call before it is queued on the compute thread (at once, in the
    // usual case: it is running), then queue behind it, so that the compute thread goes on to
    // this call without a hand-off. Polled in slices, so that a cancelled call or one past its
    // deadline gives up without stepping.
    std::unique_lock<std::mutex> lock(order_mu_);
    while (passed_step_ != req->after_step()) {
      if (ctx->IsCancelled()) {
        return grpc::Status(
            grpc::StatusCode::CANCELLED,
            absl::StrCat("step ", req->step(), " was cancelled while it waited for step ",
                         req->after_step()));
      }
      if (std::chrono::system_clock::now() >= ctx->deadline()) {
        return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            absl::StrCat("step ", req->step(), " waited for step ",
                                         req->after_step(), ", which has not come to this worker"));
      }
      order_cv_.wait_for(lock, std::chrono::milliseconds(5));
    }
  }
  // This call has passed once its work is queued on the compute thread, or when it returns
  // without having queued any (a call sent ahead of it may go then).
  struct Pass {
    WorkerService* s;
    int64_t step;
    bool done = false;
    void operator()() {
      if (done) return;
      done = true;
      {
        std::lock_guard<std::mutex> lock(s->order_mu_);
        s->passed_step_ = step;
      }
      s->order_cv_.notify_all();
    }
    ~Pass() { (*this)(); }
  } pass{this, req->step()};
  std::vector<NewSequence> add;
  for (const v1::SequenceSpec& s : req->add()) {
    NewSequence n;
    n.id = s.sequence_id();
    n.adapter_id = s.adapter_id();
    n.prompt.assign(s.prompt_token_ids().begin(), s.prompt_token_ids().end());
    n.sampling.temperature = s.temperature();
    n.sampling.top_p = s.top_p();
    n.sampling.top_k = s.top_k();
    n.sampling.seed = s.seed();
    n.max_tokens = s.max_tokens();
    n.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
    n.return_logprobs = s.return_logprobs();
    n.return_logits = s.return_logits();
    n.return_prompt_logits = s.return_prompt_logits();
    for (const v1::SequenceImage& im : s.images()) {
      n.images.push_back({im.offset(), im.height(), im.width(), im.rgb()});
    }
    add.push_back(std::move(n));
  }
  std::vector<int64_t> remove(req->remove().begin(), req->remove().end());
  // Testing: the delay before every step, so a call of several steps lasts as long as that
  // many calls of one.
  std::function<void()> delay;
  if (step_delay_.count() > 0) delay = [d = step_delay_] { std::this_thread::sleep_for(d); };
  StepControl control;
  control.drop_all = req->drop_all();
  control.epoch = req->epoch();
  control.expected.assign(req->expected().begin(), req->expected().end());
  auto out = e->Steps(
      add, remove, req->decode_steps(), delay, [&pass] { pass(); }, control);
  // The reply is built below; then the compute thread may go on (it waits for this).
  struct Replied {
    Engine* e;
    ~Replied() { e->StepsReplied(); }
  } replied{e};
  if (!out.ok()) {
    if (out.status().code() == absl::StatusCode::kUnavailable && comm_ && comm_->world_size() > 1) {
      // A failed collective leaves this rank out of step with its peers for good: exit so the
      // supervisor (controller or Kubernetes) restarts the whole group.
      LOG(ERROR) << "collective failed, exiting: " << out.status();
      std::_Exit(3);
    }
    return ToGrpc(out.status());
  }
  const EngineInfo info = e->Info();  // after the steps: what runs now, the cache's blocks
  int batch_tokens = 0;
  double seconds = 0;
  int preempted = 0;
  int64_t prefix_queries = 0, prefix_hits = 0;
  for (size_t i = 0; i < out->size(); ++i) {
    const StepOutput& o = (*out)[i];
    preempted += o.preempted;
    prefix_queries += o.prefix_queries;
    prefix_hits += o.prefix_hits;
    if (o.idle_before_seconds >= 0) metrics_->StepIdle(o.idle_before_seconds);
    for (const auto& [id, why] : o.failed) {
      v1::SequenceFailure* f = resp->add_failed();
      f->set_sequence_id(id);
      f->set_message(why);
    }
    for (const TokenOut& t : o.tokens) {
      v1::SequenceToken* p = resp->add_tokens();
      p->set_sequence_id(t.sequence_id);
      p->set_token_id(t.token);
      p->set_logprob(t.logprob);
      p->set_finished(t.finished);
      p->set_finish_reason(t.finish_reason);
      p->set_drafted(t.drafted);
      p->set_accepted(t.accepted);
      p->set_same_step(t.same_step);
      p->mutable_logits()->Add(t.logits.begin(), t.logits.end());
      p->mutable_prompt_logits()->Add(t.prompt_logits.begin(), t.prompt_logits.end());
    }
    batch_tokens += o.batch_tokens;
    seconds += o.seconds;
    if (!o.tokens.empty()) {
      // The sequences still running after this step: the next step's tokens (or, after the
      // last, the engine's count).
      const int running = i + 1 < out->size() ? (*out)[i + 1].sequences : info.running;
      metrics_->StepDone(o.batch_tokens, o.distinct_adapters, o.seconds,
                         static_cast<int>(o.tokens.size()), running);
    }
  }
  resp->set_batch_tokens(batch_tokens);
  resp->set_distinct_adapters(out->empty() ? 0 : out->front().distinct_adapters);
  resp->set_seconds(seconds);
  resp->set_steps(static_cast<int>(out->size()));
  resp->set_preempted(preempted);
  resp->set_prefix_cache_queries(prefix_queries);
  resp->set_prefix_cache_hits(prefix_hits);
  if (!out->empty()) resp->set_kv_free_blocks(out->back().kv_free_blocks);
  metrics_->KvCache(info.num_blocks, info.free_blocks, info.block_size, preempted, prefix_queries,
                    prefix_hits);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Health(grpc::ServerContext*, const v1::WorkerHealthRequest*,
                                   v1::WorkerHealthResponse* resp) {
  if (engine()) {
    resp->set_ready(true);
  } else {
    std::lock_guard<std::mutex> lock(detail_mu_);
    resp->set_ready(false);
    resp->set_detail(detail_);
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::Info(grpc::ServerContext* ctx, const v1::WorkerInfoRequest*,
                                 v1::WorkerInfoResponse* resp) {
  if (grpc::Status s = CheckCaller(ctx); !s.ok()) return s;
  Engine* e = engine();
  if (!e) return NotReady();
  const EngineInfo i = e->Info();
  resp->set_rank(i.rank);
  resp->set_world_size(i.world_size);
  resp->set_architecture(i.architecture);
  resp->set_vocab_size(i.vocab_size);
  resp->set_max_model_len(i.max_model_len);
  resp->set_max_loras(i.max_loras);
  resp->set_max_lora_rank(i.max_lora_rank);
  resp->set_mixed_moe_lora_format(i.mixed);
  resp->set_native_moe_format(AdapterFormatToProto(i.native_format));
  resp->set_device(device_);
  for (const auto& s : i.skipped_tensors) resp->add_skipped_tensors(s);
  resp->set_communicator(comm_ ? comm_->backend() : "");
  std::vector<int64_t> ids = i.committed_adapter_ids;
  std::sort(ids.begin(), ids.end());
  resp->mutable_committed_adapter_ids()->Add(ids.begin(), ids.end());
  resp->set_dtype(i.dtype);
  resp->set_expert_parallel(i.expert_parallel);
  resp->set_fully_sharded_loras(i.fully_sharded_loras);
  resp->set_max_num_seqs(i.max_num_seqs);
  resp->set_max_cpu_loras(i.max_cpu_loras);
  resp->set_model(i.model_dir);
  resp->set_config_fingerprint(i.config_fingerprint);
  resp->set_block_size(i.block_size);
  resp->set_num_blocks(i.num_blocks);
  resp->set_free_blocks(i.free_blocks);
  resp->set_max_num_batched_tokens(i.max_num_batched_tokens);
  resp->set_prefix_caching(i.prefix_caching);
  resp->set_prefill_tokens_beside_decodes(i.prefill_tokens_beside_decodes);
  resp->set_num_speculative_tokens(i.num_speculative_tokens);
  resp->set_running_sequences(i.running);
  resp->set_vision(i.vision);
  resp->set_image_token_id(static_cast<int32_t>(i.image_token_id));
  resp->set_tower_connector_lora(i.tower_connector_lora);
  return grpc::Status::OK;
}

}  // namespace moelora
