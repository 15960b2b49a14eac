// gRPC credentials from PEM files named by flags: the server side (the controller's public port,
// the workers' ports) and the client side (the controller's channels to its workers). Errors name
// the flag and the file.
#ifndef MOELORA_PROTO_TLS_H_
#define MOELORA_PROTO_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace moelora {

// `flag_prefix` + "tls-cert-file" etc. name the flags in errors ("--" or "--worker-").
struct TlsFiles {
  std::string flag_prefix = "--";
  std::string cert, key, ca;
};

// Insecure when neither cert nor key is given. With both: TLS with that identity; with `ca` as
// well, clients must present a certificate that CA signed (mutual TLS).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFrom(const TlsFiles& f);
// The PEM text of the cert and key `f` names, for a server that is not gRPC (the controller's
// HTTP port); both left empty when neither is given.
absl::Status ServerPemFrom(const TlsFiles& f, std::string* cert, std::string* key);

// Insecure when nothing is given. With `ca`: TLS, the server's certificate checked against it
// (without: the system's roots); with cert and key: this client's certificate for mutual TLS.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFrom(const TlsFiles& f);

}  // namespace moelora

#endif  // MOELORA_PROTO_TLS_H_
