#!/usr/bin/env bash
# Runs clang-format over the project's C++, CUDA and proto sources.
#   format.sh CLANG_FORMAT fix    rewrites files in place
#   format.sh CLANG_FORMAT check  exits 1 and lists files that would change
set -euo pipefail
cf="${1:-clang-format}"
mode="${2:-check}"
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh' '*.proto' 2>/dev/null || true)
[ "${#files[@]}" -eq 0 ] && exit 0
if [ "$mode" = fix ]; then
  "$cf" -i --style=file "${files[@]}"
  exit 0
fi
bad=0
for f in "${files[@]}"; do
  if ! "$cf" --style=file --dry-run -Werror "$f" >/dev/null 2>&1; then
    echo "needs clang-format: $f"
    bad=1
  fi
done
exit $bad
