// Command-line parsing for moelora binaries on top of absl flags.
//
// Flags are spelled as in vLLM (`--max-loras`); absl names them with underscores, so the
// hyphens of a flag's name (before any '=') are turned into underscores first. absl has no such
// option; this is the whole shim. `--help` lists the flags of the binary's own main file.
#ifndef MOELORA_COMMON_FLAGS_H_
#define MOELORA_COMMON_FLAGS_H_

#include <string>
#include <vector>

namespace moelora {

// Sets the usage text, normalises hyphens, parses (exits on --help or a bad flag) and returns
// the positional arguments (argv[0] first). `main_file` is a substring of the main source file's
// path (e.g. "moelora_worker_main"): its flags are the ones --help shows.
std::vector<std::string> ParseFlags(int argc, char** argv, const std::string& usage,
                                    const std::string& main_file);

}  // namespace moelora

#endif  // MOELORA_COMMON_FLAGS_H_
