#include "controller/controller.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "controller/request_validation.h"

namespace moelora {
namespace {

AdapterManagerOptions ManagerOptions(const ControllerOptions& o) {
  AdapterManagerOptions m;
  m.adapter_root = o.adapter_root;
  m.max_loras = o.max_loras;
  m.max_cpu_loras = o.max_cpu_loras;
  m.max_registered = o.max_registered_adapters;
  m.max_lora_rank = o.max_lora_rank;
  m.mixed = o.mixed;
  m.model = o.model;
  m.clock = o.clock;
  return m;
}

}  // namespace

Controller::Controller(ControllerOptions options, Registry* registry, WorkerGroupInterface* group,
                       ControllerMetrics* metrics)
    : options_(std::move(options)),
      group_(group),
      metrics_(metrics),
      adapters_(
          ManagerOptions(options_), registry, group, metrics, [this] { return serving(); },
          [this] { scheduler_.Wake(); }),
      scheduler_(
          options_.max_num_seqs, options_.max_loras, &adapters_, group, metrics,
          [this] { return serving(); }, std::chrono::milliseconds(options_.batch_window_ms),
          std::chrono::milliseconds(options_.batch_window_max_ms), options_.decode_steps,
          options_.call_ahead, options_.clock, options_.max_queued_requests,
          std::chrono::milliseconds(options_.max_bypass_ms)),
      prepare_(std::max(1, options_.prepare_threads),
               static_cast<size_t>(std::max(1, options_.max_preparing))) {}

Controller::~Controller() { Stop(); }

absl::Status Controller::Prepare(std::function<void()> fn) {
  if (prepare_.TryPost(std::move(fn))) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("the server is preparing ", options_.max_preparing,
                   " requests already (--max-preparing-requests): retry later"));
}

void Controller::Start() { scheduler_.Start(); }

void Controller::Stop() {
  scheduler_.Stop(absl::UnavailableError("the controller is shutting down"));
}

absl::Status Controller::OnGroupReady() {
  ready_ = false;
  adapters_.ReloadAll();
  scheduler_.GroupReady();
  ready_ = true;
  metrics_->serving.Set(1);
  scheduler_.Wake();
  return absl::OkStatus();
}

void Controller::OnGroupDown(const std::string& why) {
  ready_ = false;
  metrics_->serving.Set(0);
  adapters_.ResetResidency();
  scheduler_.FailAll(absl::UnavailableError(absl::StrCat("worker group went down: ", why)));
}

void Controller::RecordRequest(const std::string& adapter, bool admitted, absl::StatusCode code) {
  // A label value per registered adapter only: a name no adapter has (the client's string) would
  // make a new series per typo or probe.
  std::string label = adapter.empty() ? "base" : adapter;
  if (!admitted && !adapter.empty() && !adapters_.Get(adapter).ok()) label = "unregistered";
  metrics_->requests
      .Add({{"adapter", label}, {"code", absl::AsciiStrToLower(absl::StatusCodeToString(code))}})
      .Increment();
}

absl::StatusOr<std::shared_ptr<GenRequest>> Controller::Submit(
    const v1::GenerateRequest& request, std::chrono::steady_clock::time_point deadline) {
  if (!serving()) {
    const std::string why = group_->not_serving_reason();
    return absl::UnavailableError(
        absl::StrCat("not serving: the worker group is not ready", why.empty() ? "" : ": ", why));
  }
  const v1::WorkerInfoResponse info = group_->info();
  RequestLimits limits;
  limits.vocab_size = info.vocab_size();
  limits.max_model_len = info.max_model_len();
  limits.kv_num_blocks = info.num_blocks();
  limits.kv_block_size = info.block_size();
  limits.tokenizer = options_.tokenizer.get();
  limits.eos_token_ids = options_.eos_token_ids;
  limits.caps = options_.caps;
  if (info.vision()) {
    limits.image_token_id = info.image_token_id();
    limits.max_images = options_.limit_images_per_prompt;
    limits.image_processor = options_.image_processor.get();
    if (!limits.image_processor) {
      limits.no_images_reason = "the controller's model directory has no preprocessor_config.json";
    }
  }
  // A text prompt is encoded here, in the RPC thread: the scheduler and the workers never wait
  // on it.
  absl::StatusOr<ValidatedRequest> v = ValidateGenerateRequest(request, limits);
  if (!v.ok()) return v.status();
  if (v->tokenize_seconds > 0) metrics_->tokenize_seconds.Observe(v->tokenize_seconds);
  if (!v->images.empty()) {
    metrics_->image_seconds.Observe(v->image_seconds);
    metrics_->images.Increment(static_cast<double>(v->images.size()));
  }
  auto r = std::make_shared<GenRequest>();
  r->req = std::move(v->req);
  r->images = std::move(v->images);
  r->tokenize_seconds = v->tokenize_seconds;
  r->adapter = r->req.adapter();
  r->arrival = options_.clock->Now();
  r->deadline = deadline;
  if (options_.request_timeout_s > 0) {
    r->timeout_at = r->arrival + std::chrono::seconds(options_.request_timeout_s);
    r->request_timeout_s = options_.request_timeout_s;
  }
  r->seed = r->req.seed();
  if (r->seed == 0)
    r->seed = std::random_device{}() | (static_cast<uint64_t>(std::random_device{}()) << 32);
  if (!r->adapter.empty()) {
    absl::StatusOr<int64_t> id = adapters_.Acquire(r->adapter);
    if (!id.ok() && id.status().code() == absl::StatusCode::kNotFound &&
        options_.resolve_from_filesystem) {
      // The filesystem resolver: the name is a directory under --adapter-root, loaded now (or
      // being loaded by another request: Load waits on the adapter's name lock and finds it
      // loaded). An error (no such directory, a bad adapter) goes to this request with
      // LoadAdapter's code. An adapter registered from another path is left alone.
      absl::StatusOr<v1::Adapter> known = adapters_.Get(r->adapter);
      if (!known.ok() || known->path() == r->adapter) {
        v1::LoadAdapterRequest load;
        load.set_name(r->adapter);
        load.set_path(r->adapter);
        if (absl::StatusOr<v1::Adapter> a = adapters_.Load(load); !a.ok()) return a.status();
        id = adapters_.Acquire(r->adapter);
      }
    }
    if (!id.ok()) return id.status();
    r->adapter_id = *id;
  }
  if (absl::Status s = scheduler_.Enqueue(r); !s.ok()) {
    if (!r->adapter.empty()) adapters_.Release(r->adapter);
    return s;
  }
  return r;
}

}  // namespace moelora
