// Bearer tokens for the public API (--auth-tokens-file): one "TOKEN ROLE" a line, roles `admin`
// (every method) and `inference` (Generate, GenerateStream, ListAdapters, GetAdapter). The
// service asks Check with the call's `authorization` metadata; health and reflection are other
// services and stay open. The file is read again on SIGHUP (Reload); a file that no longer
// parses keeps the tokens in force.
//
// Thread-safety: all methods may be called from any thread.
#ifndef MOELORA_CONTROLLER_AUTH_H_
#define MOELORA_CONTROLLER_AUTH_H_

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/mutex.h"

namespace moelora {

enum class Role { kInference, kAdmin };

class TokenAuth {
 public:
  // INVALID_ARGUMENT naming the file and line for a line that is not "TOKEN ROLE" (blank lines
  // and lines starting with '#' skipped), an unknown role or a repeated token; NOT_FOUND when
  // the file cannot be read.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TokenAuth>> Load(const std::string& path);
  // Reads the file again; on error the tokens in force stay and the error is returned.
  [[nodiscard]] absl::Status Reload() ABSL_LOCKS_EXCLUDED(mu_);
  // `authorization`: the call's metadata value ("Bearer TOKEN"; empty when absent). OK when its
  // token's role may call a method that needs `admin` (or not); UNAUTHENTICATED for a missing or
  // unknown token, PERMISSION_DENIED for an inference token on an admin method.
  [[nodiscard]] absl::Status Check(absl::string_view authorization, bool admin) const
      ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit TokenAuth(std::string path) : path_(std::move(path)) {}
  [[nodiscard]] static absl::StatusOr<std::map<std::string, Role>> Parse(const std::string& path);

  const std::string path_;
  mutable Mutex mu_;
  std::map<std::string, Role> tokens_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_AUTH_H_
