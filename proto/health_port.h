// A second, plaintext gRPC port that serves only grpc.health.v1, mirroring a TLS port's health:
// for probes that cannot speak TLS (the kubelet's gRPC probe). It reveals nothing but
// SERVING / NOT_SERVING.
#ifndef MOELORA_PROTO_HEALTH_PORT_H_
#define MOELORA_PROTO_HEALTH_PORT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"

namespace moelora {

class HealthPort {
 public:
  // Listens on host:port (0: any free port); NOT_SERVING until Set(true).
  static absl::StatusOr<std::unique_ptr<HealthPort>> Start(const std::string& host, int port);
  ~HealthPort();
  // The overall status and `service`'s (empty: overall only).
  void Set(bool serving, const std::string& service = "");
  int port() const { return port_; }

 private:
  HealthPort() = default;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace moelora

#endif  // MOELORA_PROTO_HEALTH_PORT_H_
