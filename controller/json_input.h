// JSON from clients, read within a budget, and JSON written for them whatever their bytes.
//
// nlohmann's DOM parser builds `ordered_json` (the order of keys matters to chat templates and
// tool schemas) by looking each key up linearly, so an object of N keys costs O(N²), and it has
// no bound on nesting or on the number of values; later recursive copies of a deep document
// overflow the stack. ParseClientJson builds the same document from nlohmann's SAX events
// instead, in one pass, refusing the input at the first value past the budget: time linear in
// the input (duplicate keys found through a hash map; the last one wins, as in nlohmann's DOM
// parser), depth and values bounded, so the tree's memory is bounded too.
//
// Thread-safety: free functions, no state.
#ifndef MOELORA_CONTROLLER_JSON_INPUT_H_
#define MOELORA_CONTROLLER_JSON_INPUT_H_

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace moelora {

struct JsonBudget {
  int max_depth = 64;            // arrays and objects nested at most this deep
  size_t max_values = 1u << 20;  // values of any kind (members and elements) in all
};

// INVALID_ARGUMENT saying where the text stops being JSON, or which bound it broke.
[[nodiscard]] absl::StatusOr<nlohmann::ordered_json> ParseClientJson(std::string_view text,
                                                                     const JsonBudget& budget);

// j.dump() with invalid UTF-8 replaced by U+FFFD (nlohmann's dump() throws on it): for every
// document that may hold a client's or a file's bytes.
std::string JsonText(const nlohmann::json& j);
std::string JsonText(const nlohmann::ordered_json& j);

// A client's string for a message or a log line: at most `max_bytes` (then "..."), every byte
// that is not printable ASCII written as \xNN.
std::string Printable(std::string_view s, size_t max_bytes = 200);

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_JSON_INPUT_H_
