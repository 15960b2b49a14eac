// Where adapters may be read from: only inside --adapter-root, after resolving symlinks.
// Thread-safe: pure functions of the file system.
#ifndef MOELORA_COMMON_PATH_POLICY_H_
#define MOELORA_COMMON_PATH_POLICY_H_

#include <string>

#include "absl/status/statusor.h"

namespace moelora {

// Resolves `requested` (relative to `root`, or absolute) to a canonical directory inside the
// canonical `root`. The lexical path is checked before anything is touched, the resolved one
// after (symlinks). Errors:
//   INVALID_ARGUMENT   empty, NUL byte, longer than 4096 bytes or a component over 255
//   PERMISSION_DENIED  outside the root (".." escape, absolute path elsewhere, symlink escape)
//   NOT_FOUND          does not exist (inside the root)
//   FAILED_PRECONDITION no --adapter-root configured
[[nodiscard]] absl::StatusOr<std::string> ResolveAdapterPath(const std::string& root,
                                                             const std::string& requested);

// Whether `requested` (absolute, or relative to `root`) lies inside `root` by its spelling alone
// ("." and ".." resolved lexically; nothing on disk is looked at, so a symlink is not followed).
bool LexicallyInside(const std::string& root, const std::string& requested);

}  // namespace moelora

#endif  // MOELORA_COMMON_PATH_POLICY_H_
