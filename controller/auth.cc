#include "controller/auth.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace moelora {

absl::StatusOr<std::map<std::string, Role>> TokenAuth::Parse(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot be read"));
  std::map<std::string, Role> tokens;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const absl::string_view l = absl::StripAsciiWhitespace(line);
    if (l.empty() || l[0] == '#') continue;
    const std::vector<absl::string_view> f = absl::StrSplit(l, ' ', absl::SkipWhitespace());
    const std::string where = absl::StrCat(path, ":", n, ": ");
    if (f.size() != 2) return absl::InvalidArgumentError(where + "expected \"TOKEN ROLE\"");
    Role role;
    if (f[1] == "admin") {
      role = Role::kAdmin;
    } else if (f[1] == "inference") {
      role = Role::kInference;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "role \"", f[1], "\" is neither admin nor inference"));
    }
    if (!tokens.emplace(std::string(f[0]), role).second) {
      return absl::InvalidArgumentError(where + "the token is listed twice");
    }
  }
  return tokens;
}

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::Load(const std::string& path) {
  std::unique_ptr<TokenAuth> a(new TokenAuth(path));
  if (absl::Status s = a->Reload(); !s.ok()) return s;
  return a;
}

absl::Status TokenAuth::Reload() {
  absl::StatusOr<std::map<std::string, Role>> t = Parse(path_);
  if (!t.ok()) return t.status();
  MutexLock lock(&mu_);
  tokens_ = std::move(*t);
  return absl::OkStatus();
}

size_t TokenAuth::size() const {
  MutexLock lock(&mu_);
  return tokens_.size();
}

absl::Status TokenAuth::Check(absl::string_view authorization, bool admin) const {
  absl::string_view token = authorization;
  if (!absl::ConsumePrefix(&token, "Bearer ") && !absl::ConsumePrefix(&token, "bearer ")) {
    return absl::UnauthenticatedError(
        "this server needs a token: metadata \"authorization: Bearer TOKEN\"");
  }
  token = absl::StripAsciiWhitespace(token);
  // Every known token is compared, each in time that depends on lengths only (CRYPTO_memcmp-like
  // by hand: OpenSSL is not a dependency of the controller), so the answer's timing says nothing
  // of how much of a token was right.
  MutexLock lock(&mu_);
  const Role* found = nullptr;
  for (const auto& [known, role] : tokens_) {
    unsigned char diff = known.size() == token.size() ? 0 : 1;
    const size_t n = std::min(known.size(), token.size());
    for (size_t i = 0; i < n; ++i) {
      diff |= static_cast<unsigned char>(known[i] ^ token[i]);
    }
    if (diff == 0) found = &role;
  }
  if (found == nullptr) return absl::UnauthenticatedError("unknown token");
  if (admin && *found != Role::kAdmin) {
    return absl::PermissionDeniedError("this method needs an admin token");
  }
  return absl::OkStatus();
}

}  // namespace moelora
