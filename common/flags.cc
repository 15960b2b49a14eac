#include "common/flags.h"

#include <cstdlib>
#include <iostream>

#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"

namespace moelora {

std::vector<std::string> ParseFlags(int argc, char** argv, const std::string& usage,
                                    const std::string& main_file) {
  absl::flags_internal::SetProgramInvocationName(argv[0]);
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig cfg;
  // The binary's own flags and the flags both binaries share (engine, server).
  cfg.contains_help_flags = [main_file](absl::string_view f) {
    return absl::StrContains(f, main_file) || absl::StrContains(f, "common/engine_flags.cc") ||
           absl::StrContains(f, "proto/server_flags.cc");
  };
  cfg.contains_helpshort_flags = cfg.contains_help_flags;
  cfg.normalize_filename = [](absl::string_view f) { return std::string(f); };
  absl::SetFlagsUsageConfig(cfg);
  std::vector<std::string> args(argv, argv + argc);
  bool after_dashdash = false;
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (after_dashdash || a.size() < 3 || a[0] != '-') continue;
    if (a == "--") {
      after_dashdash = true;
      continue;
    }
    const size_t start = a[1] == '-' ? 2 : 1;
    const size_t end = a.find('=') == std::string::npos ? a.size() : a.find('=');
    for (size_t k = start; k < end; ++k) {
      if (a[k] == '-') a[k] = '_';
    }
  }
  // absl exits with status 1 after --help; a help request is not an error, so it is answered
  // here (through absl's own formatter) with status 0.
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--") break;
    if (args[i] == "--help" || args[i] == "-help" || args[i] == "-h") {
      absl::flags_internal::FlagsHelp(std::cout, main_file,
                                      absl::flags_internal::HelpFormat::kHumanReadable, usage);
      // The shared engine and server flags, where this binary has them.
      if (absl::FindCommandLineFlag("max_loras") != nullptr) {
        absl::flags_internal::FlagsHelp(std::cout, "common/engine_flags.cc",
                                        absl::flags_internal::HelpFormat::kHumanReadable, "");
      }
      if (absl::FindCommandLineFlag("tls_cert_file") != nullptr) {
        absl::flags_internal::FlagsHelp(std::cout, "proto/server_flags.cc",
                                        absl::flags_internal::HelpFormat::kHumanReadable, "");
      }
      std::exit(0);
    }
  }
  std::vector<char*> ptrs;
  for (std::string& a : args) ptrs.push_back(a.data());
  std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(ptrs.size()), ptrs.data());
  return std::vector<std::string>(rest.begin(), rest.end());
}

}  // namespace moelora
