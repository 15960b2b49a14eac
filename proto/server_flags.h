// The flags both binaries' gRPC servers take, defined once: TLS on the port
// (--tls-cert-file, --tls-key-file, --tls-ca-file) and the plaintext --health-port.
#ifndef MOELORA_PROTO_SERVER_FLAGS_H_
#define MOELORA_PROTO_SERVER_FLAGS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"
#include "proto/health_port.h"
#include "proto/tls.h"

namespace moelora {

// --tls-cert-file, --tls-key-file and --tls-ca-file as given.
TlsFiles TlsFilesFromFlags();
// The port's credentials from --tls-*-file (insecure without them); errors name flag and file.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFlags();
// The --health-port server on `host` (null when the flag is -1).
absl::StatusOr<std::unique_ptr<HealthPort>> HealthPortFromFlags(const std::string& host);

}  // namespace moelora

#endif  // MOELORA_PROTO_SERVER_FLAGS_H_
