#include "proto/health_port.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace moelora {

absl::StatusOr<std::unique_ptr<HealthPort>> HealthPort::Start(const std::string& host, int port) {
  grpc::EnableDefaultHealthCheckService(true);
  std::unique_ptr<HealthPort> h(new HealthPort());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(host, ":", port), grpc::InsecureServerCredentials(),
                           &h->port_);
  h->server_ = builder.BuildAndStart();
  if (!h->server_ || h->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("--health-port: cannot listen on ", host, ":", port));
  }
  h->Set(false);
  return h;
}

HealthPort::~HealthPort() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now());
}

void HealthPort::Set(bool serving, const std::string& service) {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (service.empty()) {
    health->SetServingStatus(serving);
  } else {
    health->SetServingStatus(service, serving);
  }
}

}  // namespace moelora
