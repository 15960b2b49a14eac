// Command-line pieces the benchmarks share (adapter_spread, slora; Capture: peer,
// vision_encoder).
#ifndef MOELORA_BENCH_BENCH_ARGS_H_
#define MOELORA_BENCH_BENCH_ARGS_H_

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace moelora::bench {

// The standard output of `cmd` (its exit status must be 0), or "" with a message.
inline std::string Capture(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return "";
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  if (pclose(p) != 0) {
    std::fprintf(stderr, "failed: %s\n", cmd.c_str());
    return "";
  }
  return out;
}

// The value after argv[*i], advancing *i; exits 2 naming the flag when there is none.
inline std::string NextValue(int argc, char** argv, int* i) {
  if (*i + 1 >= argc) {
    std::fprintf(stderr, "%s needs a value\n", argv[*i]);
    std::exit(2);
  }
  return argv[++*i];
}

// The positive numbers of a comma-separated list ("1,8,100"); others are left out.
template <typename T>
std::vector<T> PositiveList(const std::string& s) {
  std::vector<T> v;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    double x = 0;
    if (absl::SimpleAtod(p, &x) && x > 0) v.push_back(static_cast<T>(x));
  }
  return v;
}

// Space-separated words ("--max-loras 4 --worker-args ..."), as extra flags for a process.
inline std::vector<std::string> Words(const std::string& s) {
  std::vector<std::string> w;
  for (absl::string_view p : absl::StrSplit(s, ' ', absl::SkipEmpty())) w.emplace_back(p);
  return w;
}

}  // namespace moelora::bench

#endif  // MOELORA_BENCH_BENCH_ARGS_H_
