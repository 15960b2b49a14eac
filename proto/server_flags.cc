#include "proto/server_flags.h"

#include "absl/flags/flag.h"
#include "proto/tls.h"

ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain of the gRPC port (the controller's public port, a worker's "
          "port); with --tls-key-file: TLS; empty: plaintext");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls-cert-file");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA certificates: with it, only callers presenting a certificate it signs may call "
          "(mutual TLS; for workers, the controller's --worker-tls-cert-file)");
ABSL_FLAG(int, health_port, -1,
          "Plaintext port serving only grpc.health.v1, mirroring the gRPC port's health, for "
          "probes that cannot speak TLS (the kubelet's); -1: off, 0: any free port");

namespace moelora {

TlsFiles TlsFilesFromFlags() {
  return {"--", absl::GetFlag(FLAGS_tls_cert_file), absl::GetFlag(FLAGS_tls_key_file),
          absl::GetFlag(FLAGS_tls_ca_file)};
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFlags() {
  return ServerCredentialsFrom(TlsFilesFromFlags());
}

absl::StatusOr<std::unique_ptr<HealthPort>> HealthPortFromFlags(const std::string& host) {
  const int port = absl::GetFlag(FLAGS_health_port);
  if (port < 0) return std::unique_ptr<HealthPort>();
  return HealthPort::Start(host, port);
}

}  // namespace moelora
