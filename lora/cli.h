// The `moelora-adapter` command line tool: inspect, convert and validate adapters before they
// are deployed. The logic lives here (a library function) so tests run it in-process.
#ifndef MOELORA_LORA_CLI_H_
#define MOELORA_LORA_CLI_H_

#include <ostream>
#include <string>
#include <vector>

namespace moelora {

// Exit statuses: 0 success, 2 invalid adapter (INVALID_ARGUMENT / RESOURCE_EXHAUSTED /
// FAILED_PRECONDITION, message on `err` naming file, tensor and shape), 1 anything else
// (usage errors, missing paths, I/O).
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitInvalidAdapter = 2;

int RunAdapterCli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace moelora

#endif  // MOELORA_LORA_CLI_H_
