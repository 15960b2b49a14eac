// The --port-file both servers write once listening, so a supervisor (the controller, tests,
// scripts) can use port 0 and learn the ports: {"port": P, "metrics_port": M} (and
// "http_port" when the controller serves HTTP), written to a
// temporary file and renamed, so a reader never sees half of it.
#ifndef MOELORA_COMMON_PORT_FILE_H_
#define MOELORA_COMMON_PORT_FILE_H_

#include <string>

#include "absl/status/status.h"

namespace moelora {

[[nodiscard]] absl::Status WritePortFile(const std::string& path, int port, int metrics_port,
                                         int http_port = -1);

}  // namespace moelora

#endif  // MOELORA_COMMON_PORT_FILE_H_
