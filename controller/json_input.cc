#include "controller/json_input.h"

#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace moelora {
namespace {

using nlohmann::ordered_json;

// Builds the document from SAX events (written here because nlohmann's own DOM builder is the
// quadratic, unbounded part). A container's frame points at its value inside its parent, which
// grows only once the container is closed, so the pointers stay valid.
class Builder final : public ordered_json::json_sax_t {
 public:
  explicit Builder(const JsonBudget& budget) : budget_(budget) {}

  bool null() override { return Add(ordered_json(nullptr)) != nullptr; }
  bool boolean(bool v) override { return Add(ordered_json(v)) != nullptr; }
  bool number_integer(number_integer_t v) override { return Add(ordered_json(v)) != nullptr; }
  bool number_unsigned(number_unsigned_t v) override { return Add(ordered_json(v)) != nullptr; }
  bool number_float(number_float_t v, const string_t&) override {
    return Add(ordered_json(v)) != nullptr;
  }
  bool string(string_t& v) override { return Add(ordered_json(std::move(v))) != nullptr; }
  bool binary(binary_t&) override { return Fail("binary values are not JSON"); }
  bool start_object(std::size_t) override { return Open(ordered_json::object()); }
  bool start_array(std::size_t) override { return Open(ordered_json::array()); }
  bool end_object() override { return Close(); }
  bool end_array() override { return Close(); }
  bool key(string_t& k) override {
    stack_.back().key = std::move(k);
    return true;
  }
  bool parse_error(std::size_t, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    return Fail(Printable(ex.what()));
  }

  absl::StatusOr<ordered_json> Take() {
    if (!error_.empty()) return absl::InvalidArgumentError(error_);
    return std::move(root_);
  }
  bool failed() const { return !error_.empty(); }

 private:
  struct Frame {
    ordered_json* value;
    absl::flat_hash_map<std::string, size_t> keys;  // objects: member index by key
    std::string key;                                // objects: the key of the next value
  };

  bool Fail(std::string why) {
    if (error_.empty()) error_ = std::move(why);
    return false;
  }

  // Places `v` in the open container (or as the root); null past the budget.
  ordered_json* Add(ordered_json v) {
    if (++values_ > budget_.max_values) {
      Fail(absl::StrCat("more than ", budget_.max_values, " JSON values (--max-json-values)"));
      return nullptr;
    }
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& f = stack_.back();
    if (f.value->is_array()) {
      auto& a = f.value->get_ref<ordered_json::array_t&>();
      a.push_back(std::move(v));
      return &a.back();
    }
    auto& members = static_cast<ordered_json::object_t::Container&>(
        f.value->get_ref<ordered_json::object_t&>());
    auto [it, inserted] = f.keys.try_emplace(f.key, members.size());
    if (!inserted) {
      members[it->second].second = std::move(v);  // a repeated key: the last one wins
      return &members[it->second].second;
    }
    members.emplace_back(std::move(f.key), std::move(v));
    return &members.back().second;
  }

  bool Open(ordered_json empty) {
    if (static_cast<int>(stack_.size()) >= budget_.max_depth) {
      return Fail(absl::StrCat("JSON nested deeper than ", budget_.max_depth,
                               " levels (--max-json-depth)"));
    }
    ordered_json* v = Add(std::move(empty));
    if (v == nullptr) return false;
    stack_.push_back(Frame{v, {}, {}});
    return true;
  }

  bool Close() {
    stack_.pop_back();
    return true;
  }

  const JsonBudget budget_;
  size_t values_ = 0;
  ordered_json root_;
  std::vector<Frame> stack_;
  std::string error_;
};

}  // namespace

absl::StatusOr<ordered_json> ParseClientJson(std::string_view text, const JsonBudget& budget) {
  Builder b(budget);
  // Never throws: errors come to parse_error, which stops the parse.
  const bool ok = ordered_json::sax_parse(text.begin(), text.end(), &b);
  if (!ok && !b.failed()) return absl::InvalidArgumentError("not JSON");
  return b.Take();
}

std::string JsonText(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string JsonText(const nlohmann::ordered_json& j) {
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

std::string Printable(std::string_view s, size_t max_bytes) {
  std::string out;
  const size_t n = std::min(s.size(), max_bytes);
  out.reserve(n + 8);
  static constexpr char kHex[] = "0123456789abcdef";
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (s.size() > n) out += "...";
  return out;
}

}  // namespace moelora
