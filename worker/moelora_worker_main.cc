// moelora-worker: one tensor-parallel rank of a model replica. Serves moelora.v1.Worker (gRPC)
// and Prometheus /metrics. Normally started by moelora-controller; see --help.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/engine_flags.h"
#include "common/flags.h"
#include "common/logging.h"
#include "common/port_file.h"
#include "grpc/health/v1/health.pb.h"
#include "kernels/device.h"
#include "kernels/sgmv.h"
#include "prometheus/exposer.h"
#include "proto/group_secret.h"
#include "proto/server_flags.h"
#include "schema/config_defaults.h"
#include "worker/comm/communicator.h"
#include "worker/engine/engine.h"
#include "worker/layers/gemm.h"
#include "worker/metrics.h"
#include "worker/service.h"

ABSL_FLAG(std::string, model, "", "HF model directory (config.json + *.safetensors)");
ABSL_FLAG(std::string, host, "127.0.0.1", "Address the gRPC server binds to");
ABSL_FLAG(int, port, 0, "gRPC port (0: any free port; see --port-file)");
ABSL_FLAG(int, metrics_port, 0, "Prometheus /metrics port (0: any free port; -1: off)");
ABSL_FLAG(std::string, port_file, "",
          "Write {\"port\": P, \"metrics_port\": M} here once listening (atomic rename)");
ABSL_FLAG(int, rank, 0, "Tensor-parallel rank of this worker");
ABSL_FLAG(int, tensor_parallel_size, 1, "Tensor-parallel world size");
ABSL_FLAG(std::string, dist_init_dir, "",
          "Rendezvous directory shared by all ranks (fresh per start); needed when "
          "--tensor-parallel-size > 1");
ABSL_FLAG(std::string, dist_host, "127.0.0.1", "This rank's address for collectives (gloo TCP)");
ABSL_FLAG(std::string, load_format, "auto",
          "auto: the checkpoint's safetensors | dummy: random weights of the shapes config.json "
          "implies, no checkpoint read (vLLM's name; to try a config without its weights)");
ABSL_FLAG(bool, print_config_defaults, false,
          "Print, as JSON, the default each architecture's configuration class gives the "
          "config.json keys the worker reads when they are absent, and exit");
ABSL_FLAG(int, cpu_threads, 0,
          "CPU threads for tensor ops (0: hardware threads / --tensor-parallel-size)");
ABSL_FLAG(std::string, adapter_root, "",
          "The only directory StageAdapter reads adapters from, symlinks resolved (none: every "
          "stage is refused); moelora-controller passes its own to the workers it spawns");
ABSL_FLAG(int, debug_fail_prompt_chunk_tokens, 0,
          "Testing only: a step with a prompt chunk of at least this many tokens asks libtorch "
          "for an impossible tensor (a real allocation failure; 0: never)");
ABSL_FLAG(int, debug_step_delay_ms, 0,
          "Testing only: sleep this long before every step, each of a call's decode_steps (to "
          "interrupt generations on purpose)");

namespace {

std::atomic<bool> g_stop{false};

// The flags, checked: what this rank serves and how.
struct WorkerFlags {
  std::string model, device, load_format;
  int rank = 0, world = 1;
  int cuda_index = -1;  // --device cuda:N's N, else -1
  bool cuda = false;
  moelora::EngineFlags engine;
};

absl::StatusOr<WorkerFlags> ReadWorkerFlags() {
  WorkerFlags w;
  auto bad = [](std::string message) { return absl::InvalidArgumentError(std::move(message)); };
  w.load_format = absl::GetFlag(FLAGS_load_format);
  if (w.load_format != "auto" && w.load_format != "dummy") {
    return bad(absl::StrCat("--load-format \"", w.load_format, "\": auto or dummy"));
  }
  w.model = absl::GetFlag(FLAGS_model);
  if (w.model.empty()) return bad("--model is required (see --help)");
  w.rank = absl::GetFlag(FLAGS_rank);
  w.world = absl::GetFlag(FLAGS_tensor_parallel_size);
  if (w.world < 1 || w.rank < 0 || w.rank >= w.world) {
    return bad(absl::StrCat("--rank ", w.rank, " outside --tensor-parallel-size ", w.world));
  }
  if (w.world > 1 && absl::GetFlag(FLAGS_dist_init_dir).empty()) {
    return bad("--dist-init-dir is required when --tensor-parallel-size > 1");
  }
  w.device = absl::GetFlag(FLAGS_device);
  if (auto s = moelora::ParseDevice(w.device, &w.cuda_index); !s.ok()) return s;
  w.cuda = absl::StartsWith(w.device, "cuda");
  if (w.cuda && !moelora::CudaDeviceAvailable()) {
    return bad(absl::StrCat("--device ", w.device, ": ", moelora::CudaDeviceSummary()));
  }
  if (auto s = moelora::ValidateDType(absl::GetFlag(FLAGS_dtype)); !s.ok()) return s;
  if (auto s = moelora::ReadEngineFlags(&w.engine); !s.ok()) return s;
  if (auto s = moelora::ValidateEngineFlags(w.engine, static_cast<int>(moelora::kSgmvMaxRank));
      !s.ok()) {
    return s;
  }
  return w;
}

// The gRPC server (the worker service, health, reflection); *port: the port bound.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpc(moelora::WorkerService* service,
                                                        int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  // Registers grpc.health.v1's descriptor (proto/grpc/health/v1/health.proto) so that server
  // reflection can describe the built-in health service to grpcurl.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();  // grpcurl without proto files
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      moelora::ServerCredentialsFromFlags();
  if (!credentials.ok()) return credentials.status();
  grpc::ServerBuilder builder;
  *port = 0;
  builder.AddListeningPort(absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port)),
                           *credentials, port);
  builder.SetMaxReceiveMessageSize(1 << 30);  // a step may carry images (resized RGB)
  builder.SetMaxSendMessageSize(256 << 20);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server)
    server->GetHealthCheckService()->SetServingStatus(false);  // until the model is loaded
  if (!server || *port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", absl::GetFlag(FLAGS_host), ":",
                                               absl::GetFlag(FLAGS_port)));
  }
  return server;
}

// Connects the ranks and loads the model into `service` (Health says which, meanwhile).
absl::Status ConnectAndLoad(const WorkerFlags& w, moelora::WorkerService& service) {
  moelora::RendezvousOptions ro;
  ro.rank = w.rank;
  ro.world_size = w.world;
  ro.store_dir = absl::GetFlag(FLAGS_dist_init_dir);
  ro.hostname = absl::GetFlag(FLAGS_dist_host);
  ro.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_dist_timeout_s));
  service.SetLoadingDetail(absl::StrCat("connecting ", w.world, " ranks"));
  absl::StatusOr<std::unique_ptr<moelora::Communicator>> comm;
  if (w.cuda && w.world > 1) {
    const int n = moelora::CudaDeviceCount();
    comm = moelora::MakeNcclCommunicator(ro, w.cuda_index >= 0 ? w.cuda_index : w.rank % n);
  } else {
    comm = moelora::MakeGlooCommunicator(ro);
  }
  if (!comm.ok()) {
    LOG(ERROR) << comm.status();
    return comm.status();
  }
  service.SetLoadingDetail(absl::StrCat("loading ", w.model));
  moelora::EngineOptions eo;
  static_cast<moelora::EngineFlags&>(eo) = w.engine;
  eo.device = w.device;
  eo.model_dir = w.model;
  eo.dummy_weights = w.load_format == "dummy";
  eo.num_threads = absl::GetFlag(FLAGS_cpu_threads);
  eo.debug_fail_prompt_chunk_tokens = absl::GetFlag(FLAGS_debug_fail_prompt_chunk_tokens);
  auto engine = moelora::Engine::Create(eo, comm->get());
  if (!engine.ok()) {
    LOG(ERROR) << "cannot load the model: " << engine.status();
    std::fprintf(stderr, "moelora-worker: cannot load the model: %s\n",
                 engine.status().ToString().c_str());
    return engine.status();
  }
  for (const auto& s : (*engine)->Info().skipped_tensors) LOG(INFO) << "skipped " << s;
  service.SetReady(std::move(*comm), std::move(*engine));
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> rest = moelora::ParseFlags(
      argc, argv,
      "moelora-worker --model DIR [--rank R --tensor-parallel-size N --dist-init-dir DIR] "
      "[--port P] [--metrics-port M]\n\n"
      "One tensor-parallel rank of a moelora model replica: loads its shard of the model,\n"
      "holds LoRA slots, and runs continuous-batching steps for moelora-controller over gRPC\n"
      "(service moelora.v1.Worker). Exit status: 0 after SIGTERM/SIGINT or --help; 1 for a bad\n"
      "flag, or when the model or the communicator cannot be set up (the reason is printed).\n"
      "Flags may be spelled --max-loras or --max_loras.",
      "moelora_worker_main");
  moelora::InitLogging(argv[0]);
  if (bool slow = false; !moelora::BlasDescription(&slow).empty()) {
    if (slow) {
      LOG(WARNING) << moelora::BlasDescription(&slow)
                   << ": kernels below this CPU's AVX-512 (unset OPENBLAS_CORETYPE for OpenBLAS's "
                      "own choice: prompt products about 1.5x faster)";
    } else {
      LOG(INFO) << "BLAS: " << moelora::BlasDescription(&slow);
    }
  }
  auto fail = [](int code, const std::string& msg) {
    std::fprintf(stderr, "moelora-worker: %s\n", msg.c_str());
    return code;
  };
  if (rest.size() > 1) return fail(1, absl::StrCat("unexpected argument \"", rest[1], "\""));
  if (absl::GetFlag(FLAGS_print_config_defaults)) {
    std::printf("%s\n", moelora::ConfigDefaultsJson().c_str());
    return 0;
  }
  absl::StatusOr<WorkerFlags> flags = ReadWorkerFlags();
  if (!flags.ok()) return fail(1, std::string(flags.status().message()));
  const WorkerFlags& w = *flags;
  const int rank = w.rank, world = w.world;

  // Signals are handled by one thread (sigwait) so gRPC and torch threads never see them.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  moelora::WorkerMetrics metrics(rank);
  metrics.SetReady(false);
  std::unique_ptr<prometheus::Exposer> exposer;
  int metrics_port = -1;
  if (absl::GetFlag(FLAGS_metrics_port) >= 0) {
    try {
      exposer = std::make_unique<prometheus::Exposer>(
          absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_metrics_port)));
    } catch (const std::exception& e) {
      return fail(1, absl::StrCat("cannot serve /metrics on port ",
                                  absl::GetFlag(FLAGS_metrics_port), ": ", e.what()));
    }
    exposer->RegisterCollectable(metrics.registry());
    metrics_port = exposer->GetListeningPorts().at(0);
  }

  moelora::WorkerService service(&metrics, absl::GetFlag(FLAGS_device));
  service.set_adapter_root(absl::GetFlag(FLAGS_adapter_root));
  // A spawning controller's secret (proto/group_secret.h), out of the environment at once.
  if (const char* secret = std::getenv(moelora::kGroupSecretEnv); secret != nullptr) {
    service.set_group_secret(secret);
    unsetenv(moelora::kGroupSecretEnv);
  }
  service.set_step_delay(std::chrono::milliseconds(absl::GetFlag(FLAGS_debug_step_delay_ms)));
  int port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> started = StartGrpc(&service, &port);
  if (!started.ok()) return fail(1, std::string(started.status().message()));
  std::unique_ptr<grpc::Server> server = *std::move(started);
  absl::StatusOr<std::unique_ptr<moelora::HealthPort>> hp =
      moelora::HealthPortFromFlags(absl::GetFlag(FLAGS_host));
  if (!hp.ok()) return fail(1, std::string(hp.status().message()));
  std::unique_ptr<moelora::HealthPort> health_port = *std::move(hp);
  if (health_port) LOG(INFO) << "health (plaintext) on port " << health_port->port();
  LOG(INFO) << "moelora-worker rank " << rank << "/" << world << " listening on "
            << absl::GetFlag(FLAGS_host) << ":" << port << ", metrics on " << metrics_port;
  if (const std::string pf = absl::GetFlag(FLAGS_port_file); !pf.empty()) {
    if (auto s = moelora::WritePortFile(pf, port, metrics_port); !s.ok()) {
      return fail(1, std::string(s.message()));
    }
  }

  // Load in the background: Health answers "loading" meanwhile.
  int exit_code = 0;
  std::thread loader([&] {
    if (!ConnectAndLoad(w, service).ok()) {
      exit_code = 1;
      server->Shutdown();
      return;
    }
    server->GetHealthCheckService()->SetServingStatus(true);
    if (health_port) health_port->Set(true);
    LOG(INFO) << "rank " << rank << " ready";
  });
  std::thread signals([&] {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (g_stop.exchange(true)) return;
    LOG(INFO) << "signal " << sig << ": shutting down";
    // In-flight steps get half a second; a worker holds nothing that must be saved.
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  });
  server->Wait();
  loader.join();
  if (!g_stop.exchange(true)) {
    // Shut down by the loader: wake the signal thread.
    pthread_kill(signals.native_handle(), SIGTERM);
  }
  signals.join();
  google::FlushLogFiles(google::GLOG_INFO);
  // Skip static destructors and the HTTP server's slow teardown: nothing is left to save.
  std::_Exit(exit_code);
}
