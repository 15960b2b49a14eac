// absl::Status <-> grpc::Status. The two share the canonical code numbering (google.rpc.Code),
// so the mapping is a cast; messages are kept verbatim.
#ifndef MOELORA_PROTO_GRPC_STATUS_H_
#define MOELORA_PROTO_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"

namespace moelora {

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

[[nodiscard]] inline absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace moelora

#endif  // MOELORA_PROTO_GRPC_STATUS_H_
