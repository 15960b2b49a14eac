// Command-line pieces the process benchmarks share (adapter_spread, slora).
#ifndef MOELORA_BENCH_BENCH_ARGS_H_
#define MOELORA_BENCH_BENCH_ARGS_H_

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace moelora::bench {

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
