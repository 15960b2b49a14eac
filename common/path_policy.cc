#include "common/path_policy.h"

#include <filesystem>

#include "absl/strings/str_cat.h"

namespace moelora {
namespace fs = std::filesystem;

namespace {
bool Inside(const fs::path& root, const fs::path& p) {
  auto r = root.begin(), q = p.begin();
  for (; r != root.end(); ++r, ++q) {
    if (r->empty()) continue;  // trailing separator
    if (q == p.end() || *q != *r) return false;
  }
  return true;
}
}  // namespace

[[nodiscard]] absl::StatusOr<std::string> ResolveAdapterPath(const std::string& root,
                                                             const std::string& requested) {
  if (root.empty()) {
    return absl::FailedPreconditionError("no --adapter-root configured: adapters cannot be loaded");
  }
  if (requested.empty()) return absl::InvalidArgumentError("empty adapter path");
  if (requested.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("adapter path contains a NUL byte");
  }
  if (requested.size() > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("adapter path of ", requested.size(), " bytes is longer than 4096"));
  }
  for (const auto& part : fs::path(requested)) {
    if (part.native().size() > 255) {
      return absl::InvalidArgumentError("adapter path has a component longer than 255 bytes");
    }
  }
  std::error_code ec;
  const fs::path canon_root = fs::canonical(root, ec);
  if (ec)
    return absl::FailedPreconditionError(absl::StrCat("--adapter-root ", root, ": ", ec.message()));
  const fs::path p =
      fs::path(requested).is_absolute() ? fs::path(requested) : canon_root / requested;
  const fs::path lexical = p.lexically_normal();
  if (!Inside(canon_root, lexical)) {
    return absl::PermissionDeniedError(
        absl::StrCat("adapter path \"", requested, "\" is outside --adapter-root"));
  }
  if (!fs::exists(lexical, ec)) {
    return absl::NotFoundError(
        absl::StrCat("adapter path \"", requested, "\" does not exist under --adapter-root"));
  }
  const fs::path resolved = fs::canonical(lexical, ec);
  if (ec)
    return absl::NotFoundError(absl::StrCat("adapter path \"", requested, "\": ", ec.message()));
  if (!Inside(canon_root, resolved)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "adapter path \"", requested, "\" resolves (through a symlink) outside --adapter-root"));
  }
  if (!fs::is_directory(resolved, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("adapter path \"", requested,
                     "\" is not a directory (a PEFT adapter directory is expected)"));
  }
  return resolved.string();
}

bool LexicallyInside(const std::string& root, const std::string& requested) {
  if (root.empty() || requested.empty()) return false;
  const fs::path r = fs::path(root).lexically_normal();
  const fs::path p = fs::path(requested).is_absolute() ? fs::path(requested) : r / requested;
  return Inside(r, p.lexically_normal());
}

}  // namespace moelora
