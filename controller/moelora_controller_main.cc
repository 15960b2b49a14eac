// moelora-controller: the public gRPC service (moelora.v1.Controller, grpc.health.v1, server
// reflection) in front of a tensor-parallel group of moelora-worker processes. See --help.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "chat_output/output_parser.h"
#include "common/engine_flags.h"
#include "common/flags.h"
#include "common/logging.h"
#include "common/port_file.h"
#include "controller/auth.h"
#include "controller/controller.h"
#include "controller/http_server.h"
#include "controller/metrics.h"
#include "controller/openai_api.h"
#include "controller/registry.h"
#include "controller/service.h"
#include "controller/worker_group.h"
#include "grpc/health/v1/health.pb.h"
#include "kernels/sgmv.h"
#include "nlohmann/json.hpp"
#include "prometheus/exposer.h"
#include "proto/server_flags.h"
#include "proto/tls.h"

ABSL_FLAG(std::string, model, "", "HF model directory (config.json + *.safetensors)");
ABSL_FLAG(std::string, tokenizer, "",
          "Directory with tokenizer.json (and tokenizer_config.json, generation_config.json); "
          "default --model. Without one, text prompts and stop strings are refused");
ABSL_FLAG(std::string, host, "0.0.0.0", "Address the public gRPC server binds to");
ABSL_FLAG(int, port, 50051, "Public gRPC port (0: any free port; see --port-file)");
ABSL_FLAG(int, metrics_port, 9400, "Prometheus /metrics port (0: any free port; -1: off)");
ABSL_FLAG(std::string, port_file, "",
          "Write {\"port\": P, \"metrics_port\": M} here once listening");
ABSL_FLAG(int, tensor_parallel_size, 1, "Worker processes (tensor-parallel ranks) to spawn");
ABSL_FLAG(std::string, workers, "",
          "Comma-separated host:port of running workers, rank order (Kubernetes); default: spawn "
          "--tensor-parallel-size local workers");
ABSL_FLAG(std::string, worker_bin, "",
          "moelora-worker executable (default: next to this binary, or ../worker/)");
ABSL_FLAG(std::string, adapter_root, "", "The only directory adapters may be loaded from");
ABSL_FLAG(std::string, state_dir, "moelora-state",
          "Registry (SQLite) and worker run files; the registry survives restarts");
ABSL_FLAG(int, batch_window_ms, 2,
          "When nothing is running, the first prefill step starts once no request has arrived "
          "for this long (ms, 0-1000), so that a burst runs as one step (0: start at once)");
ABSL_FLAG(int, batch_window_max_ms, 10,
          "The longest (ms, --batch-window-ms..1000) the first queued request of an idle engine "
          "waits while others keep arriving");
ABSL_FLAG(std::string, adapter_resolver, "",
          "filesystem: a request may name an unregistered adapter by its directory directly "
          "under --adapter-root, loaded and registered on first use (empty: off)");
ABSL_FLAG(int, max_registered_adapters, 100000,
          "Adapters the registry holds at most; those in neither a LoRA slot nor the workers' "
          "host cache (--max-cpu-loras) are read from disk when a request needs them");
ABSL_FLAG(int, max_bypass_ms, 2000,
          "How long a request whose adapter waits for a LoRA slot may be passed over by later "
          "requests whose adapters are resident; then nothing behind it starts until it runs");
ABSL_FLAG(int, max_queued_requests, 1024,
          "Requests waiting to be admitted at most; beyond it a request gets RESOURCE_EXHAUSTED "
          "at once");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "Bearer tokens every call of moelora.v1.Controller must carry: one \"TOKEN ROLE\" a "
          "line, roles admin (every method) and inference (Generate, GenerateStream, "
          "ListAdapters, GetAdapter); re-read on SIGHUP; health and reflection stay open "
          "(empty: no tokens asked)");
ABSL_FLAG(std::string, worker_tls_ca_file, "",
          "PEM CA certificates the workers' certificates must chain to (TLS to the workers; "
          "empty with no --worker-tls-cert-file: plaintext)");
ABSL_FLAG(std::string, worker_tls_cert_file, "",
          "PEM certificate the controller presents to workers that ask for one (their "
          "--tls-ca-file: mutual TLS)");
ABSL_FLAG(std::string, worker_tls_key_file, "", "PEM private key of --worker-tls-cert-file");
ABSL_FLAG(int, decode_steps, 4,
          "Decode steps the workers run per call while no request waits to join (1-16): fewer "
          "round trips (about 0.6 ms each on a 2-core machine), at the price of tokens streamed "
          "in bursts of this many and of a request arriving meanwhile waiting up to this many "
          "steps to join");
ABSL_FLAG(bool, call_ahead, true,
          "While no request waits to join or leave, send the next decode call to the workers "
          "shortly before the one in flight ends, so that they run it without waiting for the "
          "round trip (about 0.7 ms a call on a 2-core machine); a request arriving in that last "
          "moment waits one call more to join, and a stop string or cancellation can run up to "
          "twice --decode-steps steps before its sequence leaves");
ABSL_FLAG(int, drain_timeout_s, 30, "On SIGTERM: seconds in-flight requests may still take");
ABSL_FLAG(int, step_timeout_s, 60,
          "A step that takes longer fails its requests (UNAVAILABLE); a call of several decode "
          "steps (--decode-steps) has this much per step");
ABSL_FLAG(std::string, worker_args, "",
          "Extra flags for spawned workers, space-separated (e.g. \"--cpu-threads 1\")");
ABSL_FLAG(int, http_port, -1,
          "OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, /v1/models, "
          "/v1/load_lora_adapter, /v1/unload_lora_adapter, /health); -1: off, 0: any free port. "
          "HTTPS with --tls-cert-file/--tls-key-file; tokens as on gRPC");
ABSL_FLAG(int, http_threads, 2, "Threads polling the HTTP connections (streams hold none)");
ABSL_FLAG(std::string, served_model_name, "",
          "The base model's name in the HTTP API's `model` (default: --model's directory name)");
ABSL_FLAG(bool, enable_auto_tool_choice, false,
          "HTTP: parse the model's tool calls into message.tool_calls (with --tool-call-parser)");
ABSL_FLAG(std::string, tool_call_parser, "",
          "HTTP: the format of the model's tool calls: hermes (Qwen3) or qwen3_coder "
          "(Qwen3.5/3.6, Qwen3-Coder); needs --enable-auto-tool-choice");
ABSL_FLAG(std::string, reasoning_parser, "",
          "HTTP: split the model's reasoning into message.reasoning: qwen3 (<think>...</think>, "
          "also when the chat template opened <think>)");
ABSL_FLAG(std::string, chat_template, "",
          "A Jinja chat template file for /v1/chat/completions (default: the model's "
          "chat_template.jinja or tokenizer_config.json chat_template)");
ABSL_FLAG(std::string, limit_mm_per_prompt, "{\"image\": 999}",
          "vLLM's JSON: how many images one prompt may hold, e.g. '{\"image\": 1}' (0: none); "
          "other modalities are not served");
ABSL_FLAG(int, request_timeout_s, 3600,
          "A request ends with DEADLINE_EXCEEDED (HTTP 504) this long after it arrived, whatever "
          "its client's deadline (0: no bound)");
ABSL_FLAG(int, prepare_threads, 2,
          "Threads preparing requests (parsing, chat templates, tokenizing, images, adapter "
          "loads), apart from those that write answers");
ABSL_FLAG(int, max_preparing_requests, 256,
          "Requests waiting to be prepared at most; beyond it a request gets RESOURCE_EXHAUSTED "
          "(HTTP 429) at once");
ABSL_FLAG(int, max_stop_strings, 16, "Stop strings per request at most");
ABSL_FLAG(int, max_stop_bytes, 256, "Bytes per stop string at most");
ABSL_FLAG(int, max_stop_token_ids, 1024, "stop_token_ids per request at most");
ABSL_FLAG(int64_t, max_prompt_bytes, 8 << 20, "Bytes of a text prompt at most (before tokenizing)");
ABSL_FLAG(int64_t, max_image_bytes, 32 << 20, "Bytes of one encoded image at most");
ABSL_FLAG(int, max_choices, 256, "HTTP: prompts x n of one completion call at most");
ABSL_FLAG(int, max_messages, 4096, "HTTP: messages of one chat call at most");
ABSL_FLAG(int, max_tools, 512, "HTTP: tools of one chat call at most");
ABSL_FLAG(int, max_json_depth, 64, "HTTP: arrays and objects in a request body nested at most");
ABSL_FLAG(int64_t, max_json_values, 1 << 20, "HTTP: JSON values in a request body at most");
ABSL_FLAG(int64_t, http_max_body_bytes, 32 << 20,
          "HTTP: bytes of one request body at most (413 beyond, refused from Content-Length "
          "before it is read)");
ABSL_FLAG(int64_t, http_max_buffered_bytes, 512 << 20,
          "HTTP: bytes of request bodies held at once, all clients together (503 beyond)");
ABSL_FLAG(int64_t, http_max_client_buffered_bytes, 128 << 20,
          "HTTP: bytes of request bodies held at once for one client address (429 beyond)");
ABSL_FLAG(int, http_max_connections, 16384, "HTTP: open connections at most");
ABSL_FLAG(int, http_max_client_connections, 1024,
          "HTTP: open connections from one client address at most (0: no bound but the total; "
          "raise it behind a proxy, whose clients all share its address)");
ABSL_FLAG(int, http_header_timeout_s, 30,
          "HTTP: a new connection that stays quiet this long before its request's headers end "
          "is closed");
ABSL_FLAG(int, http_idle_timeout_s, 300,
          "HTTP: a connection quiet this long between requests (or while sending one) is closed");
ABSL_FLAG(std::string, http_metrics, "open",
          "GET /metrics on --http-port: open (no token, as the inference gateway's scraper "
          "reads it), token (any token, with --auth-tokens-file) or off (404; --metrics-port "
          "only)");
ABSL_FLAG(int64_t, grpc_max_message_bytes, 64 << 20,
          "gRPC: bytes of one request message at most (a Generate request may carry images)");
ABSL_FLAG(std::string, preload, "",
          "NAME=PATH[,NAME=PATH...]: adapters to load once serving (PATH under --adapter-root)");

namespace {

std::string DefaultWorkerBin(const char* argv0) {
  std::error_code ec;
  std::filesystem::path self = std::filesystem::canonical("/proc/self/exe", ec);
  if (ec) self = std::filesystem::absolute(argv0);
  for (auto p : {self.parent_path() / "moelora-worker",
                 self.parent_path().parent_path() / "worker" / "moelora-worker"}) {
    if (std::filesystem::exists(p, ec)) return p.string();
  }
  return "moelora-worker";
}

// Errors of the setup below: the message is what moelora-controller prints before it exits 1.
absl::Status Fail(std::string message) { return absl::InvalidArgumentError(std::move(message)); }

// The controller's own flags, in range (the engine flags are checked by ValidateEngineFlags).
absl::Status CheckControllerFlags() {
  const std::string device = absl::GetFlag(FLAGS_device);
  if (device != "cpu" && device != "cuda" && device != "cpu-twins") {
    return Fail(absl::StrCat("--device ", device, ": expected cpu, cuda or cpu-twins"));
  }
  if (absl::GetFlag(FLAGS_tensor_parallel_size) < 1) {
    return Fail("--tensor-parallel-size must be >= 1");
  }
  if (absl::GetFlag(FLAGS_batch_window_ms) < 0 || absl::GetFlag(FLAGS_batch_window_ms) > 1000) {
    return Fail("--batch-window-ms must be in 0..1000");
  }
  if (absl::GetFlag(FLAGS_batch_window_max_ms) < absl::GetFlag(FLAGS_batch_window_ms) ||
      absl::GetFlag(FLAGS_batch_window_max_ms) > 1000) {
    return Fail("--batch-window-max-ms must be in --batch-window-ms..1000");
  }
  if (absl::GetFlag(FLAGS_max_bypass_ms) < 0) return Fail("--max-bypass-ms must be >= 0");
  if (const std::string r = absl::GetFlag(FLAGS_adapter_resolver); !r.empty() && r != "filesystem")
    return Fail(absl::StrCat("--adapter-resolver ", r, ": expected filesystem (or empty: off)"));
  if (absl::GetFlag(FLAGS_adapter_resolver) == "filesystem" &&
      absl::GetFlag(FLAGS_adapter_root).empty())
    return Fail("--adapter-resolver filesystem needs --adapter-root");
  if (absl::GetFlag(FLAGS_max_registered_adapters) < 1)
    return Fail("--max-registered-adapters must be >= 1");
  if (absl::GetFlag(FLAGS_max_queued_requests) < 1)
    return Fail("--max-queued-requests must be >= 1");
  if (absl::GetFlag(FLAGS_decode_steps) < 1 || absl::GetFlag(FLAGS_decode_steps) > 16) {
    return Fail("--decode-steps must be in 1..16");
  }
  const std::string tool_parser = absl::GetFlag(FLAGS_tool_call_parser);
  if (!tool_parser.empty() && !absl::GetFlag(FLAGS_enable_auto_tool_choice)) {
    return Fail("--tool-call-parser needs --enable-auto-tool-choice");
  }
  if (absl::GetFlag(FLAGS_enable_auto_tool_choice) && tool_parser.empty()) {
    return Fail(absl::StrCat("--enable-auto-tool-choice needs --tool-call-parser (",
                             absl::StrJoin(moelora::ToolCallParserNames(), ", "), ")"));
  }
  {
    moelora::OutputParserOptions po;
    po.reasoning_parser = absl::GetFlag(FLAGS_reasoning_parser);
    po.tool_call_parser = tool_parser;
    auto p = moelora::OutputParser::Create(po);
    if (!p.ok())
      return Fail(absl::StrCat("--reasoning-parser / --tool-call-parser: ", p.status().message()));
  }
  if (absl::GetFlag(FLAGS_step_timeout_s) < 1) return Fail("--step-timeout-s must be >= 1");
  if (absl::GetFlag(FLAGS_request_timeout_s) < 0) return Fail("--request-timeout-s must be >= 0");
  for (const auto& [name, v] : std::vector<std::pair<const char*, int64_t>>{
           {"--prepare-threads", absl::GetFlag(FLAGS_prepare_threads)},
           {"--max-preparing-requests", absl::GetFlag(FLAGS_max_preparing_requests)},
           {"--max-stop-strings", absl::GetFlag(FLAGS_max_stop_strings)},
           {"--max-stop-bytes", absl::GetFlag(FLAGS_max_stop_bytes)},
           {"--max-stop-token-ids", absl::GetFlag(FLAGS_max_stop_token_ids)},
           {"--max-prompt-bytes", absl::GetFlag(FLAGS_max_prompt_bytes)},
           {"--max-image-bytes", absl::GetFlag(FLAGS_max_image_bytes)},
           {"--max-choices", absl::GetFlag(FLAGS_max_choices)},
           {"--max-messages", absl::GetFlag(FLAGS_max_messages)},
           {"--max-tools", absl::GetFlag(FLAGS_max_tools)},
           {"--max-json-depth", absl::GetFlag(FLAGS_max_json_depth)},
           {"--max-json-values", absl::GetFlag(FLAGS_max_json_values)},
           {"--http-max-body-bytes", absl::GetFlag(FLAGS_http_max_body_bytes)},
           {"--http-max-buffered-bytes", absl::GetFlag(FLAGS_http_max_buffered_bytes)},
           {"--http-max-client-buffered-bytes",
            absl::GetFlag(FLAGS_http_max_client_buffered_bytes)},
           {"--http-max-connections", absl::GetFlag(FLAGS_http_max_connections)},
           {"--http-header-timeout-s", absl::GetFlag(FLAGS_http_header_timeout_s)},
           {"--http-idle-timeout-s", absl::GetFlag(FLAGS_http_idle_timeout_s)},
           {"--grpc-max-message-bytes", absl::GetFlag(FLAGS_grpc_max_message_bytes)}}) {
    if (v < 1 || v > INT32_MAX) return Fail(absl::StrCat(name, " must be in 1..", INT32_MAX));
  }
  if (absl::GetFlag(FLAGS_http_max_client_connections) < 0) {
    return Fail("--http-max-client-connections must be >= 0");
  }
  const std::string http_metrics = absl::GetFlag(FLAGS_http_metrics);
  if (http_metrics != "open" && http_metrics != "token" && http_metrics != "off") {
    return Fail(absl::StrCat("--http-metrics ", http_metrics, ": expected open, token or off"));
  }
  if (absl::GetFlag(FLAGS_drain_timeout_s) < 0) return Fail("--drain-timeout-s must be >= 0");
  return absl::OkStatus();
}

// The flags the workers take as well, checked here by the same rules as there: a worker that
// refuses one exits, and the controller would restart the group with it forever. So would a
// model without MTP heads the workers can build, or with fewer chained heads than drafts.
absl::StatusOr<moelora::EngineFlags> ReadWorkerFlags(const moelora::ModelInfo& info,
                                                     const std::string& model) {
  moelora::EngineFlags f;
  if (auto s = moelora::ReadEngineFlags(&f); !s.ok()) return Fail(std::string(s.message()));
  if (auto s = moelora::ValidateEngineFlags(f, static_cast<int>(moelora::kSgmvMaxRank)); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  const int k = f.num_speculative_tokens;
  const bool qwen_head =
      absl::StartsWith(info.architecture, "Qwen3_5Moe") && info.mtp_num_hidden_layers == 1;
  const int step_heads =
      info.architecture == "Step3p5ForCausalLM" ? info.num_nextn_predict_layers : 0;
  if (k > 0 && !qwen_head && (step_heads <= 0 || step_heads > moelora::kMaxMtpHeads)) {
    return Fail(absl::StrCat(
        "--speculative-config method mtp: ", info.architecture, " from ", model,
        " declares no MTP head this server can build (Qwen3.5/3.6-MoE checkpoints with "
        "mtp_num_hidden_layers 1 and mtp.* weights; Step3.5 with num_nextn_predict_layers 1 .. ",
        moelora::kMaxMtpHeads, ")"));
  }
  if (k > step_heads && step_heads > 0) {
    return Fail(absl::StrCat("--speculative-config num_speculative_tokens ", k, ": ",
                             info.architecture, " from ", model,
                             " declares num_nextn_predict_layers ", step_heads,
                             " (one MTP layer per draft token): at most ", step_heads, " a step"));
  }
  return f;
}

// /metrics on --metrics-port (none when negative); *port: the port it listens on, or -1.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> ServeMetrics(
    moelora::ControllerMetrics* metrics, int* port) {
  *port = -1;
  if (absl::GetFlag(FLAGS_metrics_port) < 0) return nullptr;
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>(
        absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_metrics_port)));
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("cannot serve /metrics on port ", absl::GetFlag(FLAGS_metrics_port),
                             ": ", e.what()));
  }
  exposer->RegisterCollectable(metrics->registry());
  *port = exposer->GetListeningPorts().at(0);
  return exposer;
}

absl::StatusOr<moelora::WorkerGroupOptions> GroupOptions(const char* argv0,
                                                         const std::string& model,
                                                         const moelora::EngineFlags& engine_flags) {
  moelora::WorkerGroupOptions go;
  go.worker_bin = absl::GetFlag(FLAGS_worker_bin).empty() ? DefaultWorkerBin(argv0)
                                                          : absl::GetFlag(FLAGS_worker_bin);
  go.model = model;
  go.tp = absl::GetFlag(FLAGS_tensor_parallel_size);
  if (!absl::GetFlag(FLAGS_workers).empty()) {
    go.addresses = absl::StrSplit(absl::GetFlag(FLAGS_workers), ',', absl::SkipEmpty());
  }
  go.run_dir = std::filesystem::absolute(absl::GetFlag(FLAGS_state_dir) + "/run").string();
  go.step_timeout = std::chrono::seconds(absl::GetFlag(FLAGS_step_timeout_s));
  auto c = moelora::ChannelCredentialsFrom({"--worker-", absl::GetFlag(FLAGS_worker_tls_cert_file),
                                            absl::GetFlag(FLAGS_worker_tls_key_file),
                                            absl::GetFlag(FLAGS_worker_tls_ca_file)});
  if (!c.ok()) return Fail(std::string(c.status().message()));
  go.credentials = *c;
  go.dist_timeout_s = absl::GetFlag(FLAGS_dist_timeout_s);
  go.worker_flags = moelora::EngineFlagArgs(engine_flags);
  go.worker_flags.insert(go.worker_flags.end(),
                         {"--device", absl::GetFlag(FLAGS_device), "--metrics-port", "0",
                          "--adapter-root", absl::GetFlag(FLAGS_adapter_root)});
  go.expected = moelora::WorkerSettingsFromFlags(engine_flags, model);
  for (const auto& a : absl::StrSplit(absl::GetFlag(FLAGS_worker_args), ' ', absl::SkipEmpty())) {
    go.worker_flags.push_back(std::string(a));
  }
  return go;
}

// The tokenizer: optional (token-id requests need none), but a tokenizer.json that is present and
// cannot be loaded is an error, not a silent fallback.
absl::Status LoadTokenizer(const std::string& model, const std::string& tok_dir,
                           moelora::ControllerOptions* co) {
  if (std::filesystem::exists(std::filesystem::path(tok_dir) / "tokenizer.json") ||
      !absl::GetFlag(FLAGS_tokenizer).empty()) {
    const auto t0 = std::chrono::steady_clock::now();
    auto tok = moelora::tok::Tokenizer::Load(tok_dir);
    if (!tok.ok())
      return Fail(absl::StrCat("--tokenizer ", tok_dir, ": ", tok.status().ToString()));
    co->tokenizer = std::move(*tok);
    co->eos_token_ids = co->tokenizer->eos_token_ids();
    LOG(INFO) << "tokenizer " << co->tokenizer->source() << ": " << co->tokenizer->vocab_size()
              << " ids, EOS " << absl::StrJoin(co->eos_token_ids, ",") << ", loaded in "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
              << " s";
    return absl::OkStatus();
  }
  auto eos = moelora::tok::ReadGenerationEosIds(model);
  if (!eos.ok()) return Fail(eos.status().ToString());
  co->eos_token_ids = *eos;
  LOG(INFO) << "no tokenizer.json in " << tok_dir << ": token-id requests only";
  return absl::OkStatus();
}

// Images: --limit-mm-per-prompt, and the model's image processor when it has one.
absl::Status ReadImageOptions(const std::string& model, moelora::ControllerOptions* co) {
  const nlohmann::json j = nlohmann::json::parse(absl::GetFlag(FLAGS_limit_mm_per_prompt), nullptr,
                                                 /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Fail("--limit-mm-per-prompt: a JSON object such as '{\"image\": 1}' expected");
  }
  for (const auto& [modality, n] : j.items()) {
    if (!n.is_number_integer() || n.get<int64_t>() < 0 || n.get<int64_t>() > 100000) {
      return Fail(absl::StrCat("--limit-mm-per-prompt: ", modality,
                               ": a count in [0, 100000] expected, not ", n.dump()));
    }
    if (modality == "image") {
      co->limit_images_per_prompt = n.get<int>();
    } else if (n.get<int64_t>() != 0) {
      return Fail(absl::StrCat("--limit-mm-per-prompt: ", modality,
                               " inputs are not served (images only)"));
    }
  }
  if (std::filesystem::exists(std::filesystem::path(model) / "preprocessor_config.json")) {
    auto ip = moelora::vision::ImageProcessorConfig::Load(model);
    if (!ip.ok()) return Fail(ip.status().ToString());
    co->image_processor =
        std::make_shared<const moelora::vision::ImageProcessorConfig>(*std::move(ip));
  }
  return absl::OkStatus();
}

absl::StatusOr<moelora::ControllerOptions> ControllerOptionsFromFlags(
    const moelora::ModelInfo& info, const std::string& model, const std::string& tok_dir,
    const moelora::EngineFlags& engine_flags) {
  moelora::ControllerOptions co;
  co.adapter_root = absl::GetFlag(FLAGS_adapter_root);
  co.max_loras = engine_flags.max_loras;
  co.max_cpu_loras = engine_flags.max_cpu_loras;
  co.max_lora_rank = engine_flags.max_lora_rank;
  co.mixed = engine_flags.enable_mixed_moe_lora_format;
  co.max_num_seqs = engine_flags.max_num_seqs;
  co.batch_window_ms = absl::GetFlag(FLAGS_batch_window_ms);
  co.max_queued_requests = absl::GetFlag(FLAGS_max_queued_requests);
  co.max_bypass_ms = absl::GetFlag(FLAGS_max_bypass_ms);
  co.max_registered_adapters = absl::GetFlag(FLAGS_max_registered_adapters);
  co.resolve_from_filesystem = absl::GetFlag(FLAGS_adapter_resolver) == "filesystem";
  co.batch_window_max_ms = absl::GetFlag(FLAGS_batch_window_max_ms);
  co.decode_steps = absl::GetFlag(FLAGS_decode_steps);
  co.call_ahead = absl::GetFlag(FLAGS_call_ahead);
  co.request_timeout_s = absl::GetFlag(FLAGS_request_timeout_s);
  co.prepare_threads = absl::GetFlag(FLAGS_prepare_threads);
  co.max_preparing = absl::GetFlag(FLAGS_max_preparing_requests);
  co.caps.max_stop_strings = absl::GetFlag(FLAGS_max_stop_strings);
  co.caps.max_stop_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_stop_bytes));
  co.caps.max_stop_token_ids = absl::GetFlag(FLAGS_max_stop_token_ids);
  co.caps.max_prompt_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_prompt_bytes));
  co.caps.max_image_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_image_bytes));
  co.caps.max_choices = absl::GetFlag(FLAGS_max_choices);
  co.caps.max_messages = absl::GetFlag(FLAGS_max_messages);
  co.caps.max_tools = absl::GetFlag(FLAGS_max_tools);
  co.model = info;
  if (absl::Status s = LoadTokenizer(model, tok_dir, &co); !s.ok()) return s;
  if (absl::Status s = ReadImageOptions(model, &co); !s.ok()) return s;
  return co;
}

// The gRPC server: the controller's service, health and reflection; *port: the port bound.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpc(moelora::ControllerService* service,
                                                        int* port) {
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      moelora::ServerCredentialsFromFlags();
  if (!credentials.ok()) return Fail(std::string(credentials.status().message()));
  grpc::EnableDefaultHealthCheckService(true);
  // Registers grpc.health.v1's descriptor (proto/grpc/health/v1/health.proto) so that server
  // reflection can describe the built-in health service to grpcurl.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  *port = 0;
  builder.AddListeningPort(absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port)),
                           *credentials, port);
  builder.RegisterService(service);
  // A Generate request may carry image files (gRPC's default is 4 MiB).
  builder.SetMaxReceiveMessageSize(static_cast<int>(absl::GetFlag(FLAGS_grpc_max_message_bytes)));
  // Generate and GenerateStream hold no thread while they wait (callback API, service.h). The
  // synchronous adapter RPCs get at most 64 threads: beyond, gRPC answers RESOURCE_EXHAUSTED.
  grpc::ResourceQuota quota("moelora-controller");
  quota.SetMaxThreads(64);
  builder.SetResourceQuota(quota);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || *port == 0) {
    return Fail(absl::StrCat("cannot listen on ", absl::GetFlag(FLAGS_host), ":",
                             absl::GetFlag(FLAGS_port)));
  }
  return server;
}

// The HTTP API's options: the served name, the chat template, the special tokens, sampling
// defaults and limits.
absl::StatusOr<moelora::OpenAiOptions> OpenAiOptionsFromFlags(const std::string& model,
                                                              const std::string& tok_dir) {
  moelora::OpenAiOptions oo;
  oo.model_path = model;
  oo.served_model_name = absl::GetFlag(FLAGS_served_model_name);
  if (oo.served_model_name.empty()) {
    oo.served_model_name = std::filesystem::path(model).lexically_normal().filename().string();
    if (oo.served_model_name.empty()) {
      oo.served_model_name =
          std::filesystem::path(model).lexically_normal().parent_path().filename().string();
    }
  }
  absl::StatusOr<std::string> source = moelora::tok::ReadChatTemplate(tok_dir);
  if (const std::string file = absl::GetFlag(FLAGS_chat_template); !file.empty()) {
    std::ifstream f(file);
    std::stringstream ss;
    if (!f || !(ss << f.rdbuf()))
      return Fail(absl::StrCat("--chat-template ", file, ": cannot be read"));
    source = ss.str();
  }
  if (source.ok()) {
    auto t = moelora::tok::ChatTemplate::Parse(*source);
    if (!t.ok())
      return Fail(absl::StrCat("chat template of ", tok_dir, ": ", t.status().message()));
    oo.chat_template = *t;
  } else if (source.status().code() != absl::StatusCode::kNotFound) {
    return Fail(source.status().ToString());
  } else {
    LOG(INFO) << "no chat template (" << source.status().message()
              << "): /v1/chat/completions answers 400";
  }
  auto special = moelora::tok::ReadSpecialTokenVariables(tok_dir);
  if (!special.ok()) return Fail(special.status().ToString());
  oo.special_tokens = *special;
  moelora::ReadSamplingDefaults(model, &oo);
  oo.reasoning_parser = absl::GetFlag(FLAGS_reasoning_parser);
  oo.tool_call_parser = absl::GetFlag(FLAGS_tool_call_parser);
  oo.json.max_depth = absl::GetFlag(FLAGS_max_json_depth);
  oo.json.max_values = static_cast<size_t>(absl::GetFlag(FLAGS_max_json_values));
  const std::string http_metrics = absl::GetFlag(FLAGS_http_metrics);
  oo.metrics = http_metrics == "open"    ? moelora::OpenAiOptions::Metrics::kOpen
               : http_metrics == "token" ? moelora::OpenAiOptions::Metrics::kToken
                                         : moelora::OpenAiOptions::Metrics::kOff;
  return oo;
}

// The OpenAI-compatible HTTP API on --http-port, answered by `api`.
absl::StatusOr<std::unique_ptr<moelora::HttpServer>> StartHttp(moelora::OpenAiApi* api) {
  moelora::HttpServer::Options ho;
  ho.host = absl::GetFlag(FLAGS_host);
  ho.port = absl::GetFlag(FLAGS_http_port);
  ho.threads = std::max(1, absl::GetFlag(FLAGS_http_threads));
  ho.max_body_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_http_max_body_bytes));
  ho.max_buffered_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_http_max_buffered_bytes));
  ho.max_client_buffered_bytes =
      static_cast<size_t>(absl::GetFlag(FLAGS_http_max_client_buffered_bytes));
  ho.max_connections = static_cast<unsigned>(absl::GetFlag(FLAGS_http_max_connections));
  ho.max_client_connections =
      static_cast<unsigned>(absl::GetFlag(FLAGS_http_max_client_connections));
  ho.header_timeout_s = absl::GetFlag(FLAGS_http_header_timeout_s);
  ho.idle_timeout_s = absl::GetFlag(FLAGS_http_idle_timeout_s);
  ho.admit = [api](const moelora::HttpExchange& ex) { return api->Admit(ex); };
  const moelora::TlsFiles tls = moelora::TlsFilesFromFlags();
  if (!tls.ca.empty()) {
    return Fail(
        "--http-port with --tls-ca-file: client certificates are not supported on the "
        "HTTP port (use bearer tokens, --auth-tokens-file)");
  }
  if (absl::Status s = moelora::ServerPemFrom(tls, &ho.tls_cert, &ho.tls_key); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  auto h = moelora::HttpServer::Start(
      ho, [api](std::shared_ptr<moelora::HttpExchange> ex) { api->Handle(std::move(ex)); });
  if (!h.ok()) return Fail(std::string(h.status().message()));
  LOG(INFO) << "HTTP (OpenAI API) on port " << (*h)->port()
            << (ho.tls_cert.empty() ? "" : " (TLS)");
  return h;
}

// --preload's adapters, once.
void Preload(moelora::Controller& controller) {
  for (const auto& item : absl::StrSplit(absl::GetFlag(FLAGS_preload), ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    moelora::v1::LoadAdapterRequest req;
    req.set_name(kv.first);
    req.set_path(kv.second);
    auto a = controller.LoadAdapter(req);
    if (a.ok()) {
      LOG(INFO) << "preloaded " << kv.first << " ("
                << moelora::v1::AdapterFormat_Name(a->detected_format())
                << (a->converted_to_2d() ? ", converted to 2D" : "") << ")";
    } else {
      LOG(ERROR) << "preload " << kv.first << ": " << a.status();
    }
  }
}

// Health follows the worker group; preloads run once, the first time it serves, before health
// says SERVING (else a preloaded adapter's first requests get NOT_FOUND while it loads). Runs
// until `stopping`.
void WatchGroup(moelora::Controller& controller, moelora::WorkerGroup& group,
                moelora::ControllerMetrics& metrics, const std::function<void(bool)>& set_health,
                const std::atomic<bool>& stopping) {
  bool preloaded = false;
  bool last = false;
  int restarts = 0;
  while (!stopping) {
    const bool serving = controller.serving();
    const auto up = group.RanksUp();
    for (size_t r = 0; r < up.size(); ++r)
      metrics.worker_up.Add({{"rank", std::to_string(r)}}).Set(up[r]);
    if (group.restarts() != restarts) {
      metrics.worker_restarts.Increment(group.restarts() - restarts);
      restarts = group.restarts();
    }
    if (serving && !preloaded) {
      preloaded = true;
      Preload(controller);
    }
    if (serving != last) {
      set_health(serving);
      last = serving;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// Waits for SIGTERM or SIGINT (returned); SIGHUP reads the tokens again (a file that no longer
// parses keeps those in force).
int WaitForStop(const sigset_t& sigs, moelora::TokenAuth* auth) {
  int sig = 0;
  for (;;) {
    sigwait(&sigs, &sig);
    if (sig != SIGHUP) return sig;
    if (auth == nullptr) {
      LOG(INFO) << "SIGHUP: no --auth-tokens-file to read";
    } else if (absl::Status r = auth->Reload(); r.ok()) {
      LOG(INFO) << "SIGHUP: " << auth->size() << " tokens from "
                << absl::GetFlag(FLAGS_auth_tokens_file);
    } else {
      LOG(ERROR) << "SIGHUP: tokens kept: " << r;
    }
  }
}

// Everything the controller serves with, built from the flags; Run serves until a signal.
struct Servers {
  std::unique_ptr<moelora::Registry> registry;
  moelora::ControllerMetrics metrics;
  std::unique_ptr<prometheus::Exposer> exposer;
  int metrics_port = -1;
  std::unique_ptr<moelora::WorkerGroup> group;
  std::unique_ptr<moelora::Controller> controller;
  std::unique_ptr<moelora::ControllerService> service;
  std::unique_ptr<moelora::TokenAuth> auth;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::unique_ptr<moelora::HealthPort> health_port;
  std::unique_ptr<moelora::OpenAiApi> openai;
  std::unique_ptr<moelora::HttpServer> http;

  absl::Status Build(const char* argv0, const std::string& model, const moelora::ModelInfo& info);
  void SetHealth(bool serving);
  // Serves until SIGTERM / SIGINT, then drains within --drain-timeout-s and stops.
  void Run(const sigset_t& sigs);
};

absl::Status Servers::Build(const char* argv0, const std::string& model,
                            const moelora::ModelInfo& info) {
  absl::StatusOr<moelora::EngineFlags> engine_flags = ReadWorkerFlags(info, model);
  if (!engine_flags.ok()) return engine_flags.status();
  auto r = moelora::Registry::Open(absl::GetFlag(FLAGS_state_dir));
  if (!r.ok()) return Fail(r.status().ToString());
  registry = *std::move(r);
  absl::StatusOr<std::unique_ptr<prometheus::Exposer>> e = ServeMetrics(&metrics, &metrics_port);
  if (!e.ok()) return e.status();
  exposer = *std::move(e);
  absl::StatusOr<moelora::WorkerGroupOptions> go = GroupOptions(argv0, model, *engine_flags);
  if (!go.ok()) return go.status();
  group = std::make_unique<moelora::WorkerGroup>(*go);
  const std::string tok_dir =
      absl::GetFlag(FLAGS_tokenizer).empty() ? model : absl::GetFlag(FLAGS_tokenizer);
  absl::StatusOr<moelora::ControllerOptions> co =
      ControllerOptionsFromFlags(info, model, tok_dir, *engine_flags);
  if (!co.ok()) return co.status();
  controller = std::make_unique<moelora::Controller>(*co, registry.get(), group.get(), &metrics);
  group->SetOnReady([this] { return controller->OnGroupReady(); });
  group->SetOnDown([this](const std::string& why) { controller->OnGroupDown(why); });
  service = std::make_unique<moelora::ControllerService>(controller.get(), &metrics);
  if (!absl::GetFlag(FLAGS_auth_tokens_file).empty()) {
    auto a = moelora::TokenAuth::Load(absl::GetFlag(FLAGS_auth_tokens_file));
    if (!a.ok()) return Fail(absl::StrCat("--auth-tokens-file: ", a.status().message()));
    auth = std::move(*a);
    service->set_auth(auth.get());
    LOG(INFO) << "tokens: " << auth->size() << " from " << absl::GetFlag(FLAGS_auth_tokens_file);
  }
  absl::StatusOr<std::unique_ptr<grpc::Server>> s = StartGrpc(service.get(), &port);
  if (!s.ok()) return s.status();
  server = *std::move(s);
  server->GetHealthCheckService()->SetServingStatus(false);
  absl::StatusOr<std::unique_ptr<moelora::HealthPort>> hp =
      moelora::HealthPortFromFlags(absl::GetFlag(FLAGS_host));
  if (!hp.ok()) return Fail(std::string(hp.status().message()));
  health_port = *std::move(hp);
  if (health_port) LOG(INFO) << "health (plaintext) on port " << health_port->port();
  int http_port = -1;
  if (absl::GetFlag(FLAGS_http_port) >= 0) {
    absl::StatusOr<moelora::OpenAiOptions> oo = OpenAiOptionsFromFlags(model, tok_dir);
    if (!oo.ok()) return oo.status();
    openai = std::make_unique<moelora::OpenAiApi>(controller.get(), &metrics, auth.get(),
                                                  *std::move(oo));
    absl::StatusOr<std::unique_ptr<moelora::HttpServer>> h = StartHttp(openai.get());
    if (!h.ok()) return h.status();
    http = *std::move(h);
    http_port = http->port();
  }
  LOG(INFO) << "moelora-controller listening on " << absl::GetFlag(FLAGS_host) << ":" << port
            << ", metrics on " << metrics_port << ", workers: "
            << (go->addresses.empty() ? absl::StrCat(go->tp, " local (", go->worker_bin, ")")
                                      : absl::GetFlag(FLAGS_workers));
  if (const std::string pf = absl::GetFlag(FLAGS_port_file); !pf.empty()) {
    if (auto ps = moelora::WritePortFile(pf, port, metrics_port, http_port); !ps.ok()) {
      return Fail(std::string(ps.message()));
    }
  }
  return absl::OkStatus();
}

void Servers::SetHealth(bool serving) {
  if (openai) openai->set_healthy(serving);
  auto* health = server->GetHealthCheckService();
  health->SetServingStatus(serving);
  health->SetServingStatus("moelora.v1.Controller", serving);
  if (health_port) {
    health_port->Set(serving);
    health_port->Set(serving, "moelora.v1.Controller");
  }
}

void Servers::Run(const sigset_t& sigs) {
  controller->Start();
  group->Start();
  std::atomic<bool> stopping{false};
  std::thread watcher([&] {
    WatchGroup(
        *controller, *group, metrics, [this](bool s) { SetHealth(s); }, stopping);
  });
  const int sig = WaitForStop(sigs, auth.get());
  LOG(INFO) << "signal " << sig << ": draining (up to " << absl::GetFlag(FLAGS_drain_timeout_s)
            << " s)";
  SetHealth(false);
  const auto drain_deadline =
      std::chrono::system_clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_drain_timeout_s));
  if (http) http->StopAccepting();
  server->Shutdown(drain_deadline);
  // HTTP requests in flight finish too, within the same deadline; then the server ends the rest.
  while (http && http->open_exchanges() > 0 && std::chrono::system_clock::now() < drain_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  http.reset();
  stopping = true;
  watcher.join();
  controller->Stop();
  group->Stop();
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> rest = moelora::ParseFlags(
      argc, argv,
      "moelora-controller --model DIR --adapter-root DIR [--tensor-parallel-size N | --workers "
      "H:P,...] [--port P] [--metrics-port M] [--http-port H]\n\n"
      "Serves MoE models with many LoRA adapters (2D per-expert and 3D fused) over gRPC:\n"
      "moelora.v1.Controller (LoadAdapter, UnloadAdapter, ListAdapters, GetAdapter, Generate,\n"
      "GenerateStream), grpc.health.v1 (SERVING once every worker rank has the model) and server\n"
      "reflection (grpcurl works without proto files); with --http-port, the OpenAI-compatible\n"
      "HTTP API too. Spawns --tensor-parallel-size\n"
      "moelora-worker processes, or drives --workers. Exit status: 0 after SIGTERM/SIGINT (after\n"
      "draining) or --help; 1 for a bad flag or a setup failure (the reason is printed).\n"
      "Flags may be spelled --max-loras or --max_loras.",
      "moelora_controller_main");
  moelora::InitLogging(argv[0]);
  auto fail = [](const std::string& msg) {
    std::fprintf(stderr, "moelora-controller: %s\n", msg.c_str());
    return 1;
  };
  if (rest.size() > 1) return fail(absl::StrCat("unexpected argument \"", rest[1], "\""));
  const std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) return fail("--model is required (see --help)");
  auto info = moelora::ReadModelInfo(model);
  if (!info.ok()) return fail(info.status().ToString());
  if (absl::Status s = CheckControllerFlags(); !s.ok()) return fail(std::string(s.message()));
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  auto servers = std::make_unique<Servers>();
  if (absl::Status s = servers->Build(argv[0], model, *info); !s.ok()) {
    return fail(std::string(s.message()));
  }
  servers->Run(sigs);
  LOG(INFO) << "stopped";
  google::FlushLogFiles(google::GLOG_INFO);
  // The registry commits every change durably (SQLite, synchronous=FULL); skip the slow
  // teardown of the HTTP server and static destructors.
  std::_Exit(0);
}
