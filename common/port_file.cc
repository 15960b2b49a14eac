#include "common/port_file.h"

#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moelora {

[[nodiscard]] absl::Status WritePortFile(const std::string& path, int port, int metrics_port,
                                         int http_port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    nlohmann::json j{{"port", port}, {"metrics_port", metrics_port}};
    if (http_port >= 0) j["http_port"] = http_port;
    out << j.dump() << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace moelora
