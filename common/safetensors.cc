#include "common/safetensors.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace moelora {
namespace {

// The SIGBUS guard: a file truncated while it is mapped makes reads past its new end fault with
// SIGBUS, which would end the process. The handler finds the mapping in this table, marks it
// damaged, maps a page of zeros over the faulting page (the read then goes on) and returns;
// CheckIntact reports the mark. Lock-free: the handler may run on any thread at any time. A
// fault outside every mapping restores the previous disposition, and the retried access gets it.
constexpr int kGuardSlots = 4096;
struct GuardSlot {
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<bool> damaged{false};
};
GuardSlot g_guard[kGuardSlots];
struct sigaction g_previous_sigbus;

void OnSigbus(int sig, siginfo_t* info, void* ucontext) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (GuardSlot& slot : g_guard) {
    const uintptr_t b = slot.begin.load(std::memory_order_acquire);
    if (b != 0 && addr >= b && addr < slot.end.load(std::memory_order_acquire)) {
      slot.damaged.store(true, std::memory_order_release);
      const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
      void* at = reinterpret_cast<void*>(addr / page * page);
      if (::mmap(at, page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) !=
          MAP_FAILED) {
        return;
      }
      break;
    }
  }
  // Not ours (or the page could not be replaced): as if no handler had been installed.
  ::sigaction(SIGBUS, &g_previous_sigbus, nullptr);
  (void)sig;
  (void)ucontext;
}

int GuardMapping(const void* base, size_t size) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction sa {};
    sa.sa_sigaction = &OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_previous_sigbus);
  });
  for (int i = 0; i < kGuardSlots; ++i) {
    uintptr_t expected = 0;
    const auto b = reinterpret_cast<uintptr_t>(base);
    // Claimed by its end first (0 = free), then published by its begin.
    if (g_guard[i].end.compare_exchange_strong(expected, b + size)) {
      g_guard[i].damaged.store(false);
      g_guard[i].begin.store(b, std::memory_order_release);
      return i;
    }
  }
  return -1;  // more mappings than slots: unguarded (CheckIntact still compares the file)
}

void UnguardMapping(int slot) {
  if (slot < 0) return;
  g_guard[slot].begin.store(0, std::memory_order_release);
  g_guard[slot].end.store(0, std::memory_order_release);
}

struct DTypeInfo {
  DType dtype;
  absl::string_view name;
  int bits;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kBool, "BOOL", 8},      {DType::kF4, "F4", 4},          {DType::kF6E2M3, "F6_E2M3", 6},
    {DType::kF6E3M2, "F6_E3M2", 6}, {DType::kU8, "U8", 8},          {DType::kI8, "I8", 8},
    {DType::kF8E5M2, "F8_E5M2", 8}, {DType::kF8E4M3, "F8_E4M3", 8}, {DType::kF8E8M0, "F8_E8M0", 8},
    {DType::kI16, "I16", 16},       {DType::kU16, "U16", 16},       {DType::kF16, "F16", 16},
    {DType::kBF16, "BF16", 16},     {DType::kI32, "I32", 32},       {DType::kU32, "U32", 32},
    {DType::kF32, "F32", 32},       {DType::kC64, "C64", 64},       {DType::kF64, "F64", 64},
    {DType::kI64, "I64", 64},       {DType::kU64, "U64", 64},
};

const DTypeInfo& InfoOf(DType dtype) {
  for (const auto& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  return kDTypes[0];  // unreachable: every enumerator is in the table
}

// Reads one non-negative integer from a JSON value.
bool AsU64(const nlohmann::json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

// bytes = product(shape) * bits / 8, overflow-checked; false if it overflows or is not whole bytes.
bool SpanBytes(const std::vector<uint64_t>& shape, int bits, uint64_t* bytes) {
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return false;
  }
  uint64_t total_bits = 0;
  if (__builtin_mul_overflow(n, static_cast<uint64_t>(bits), &total_bits)) return false;
  if (total_bits % 8 != 0) return false;
  *bytes = total_bits / 8;
  return true;
}

}  // namespace

int DTypeBits(DType dtype) { return InfoOf(dtype).bits; }
absl::string_view DTypeName(DType dtype) { return InfoOf(dtype).name; }

[[nodiscard]] absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const auto& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "'"));
}

bool IsComputeDType(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  // O_NONBLOCK: opening a FIFO in an adapter's directory must not block the loader (fstat then
  // refuses anything but a regular file).
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot open: ", std::strerror(err)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": file is ", size, " bytes, shorter than the 8-byte header length"));
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": mmap failed: ", std::strerror(errno)));
  }
  file->map_ = map;
  file->map_size_ = size;
  file->opened_ = st;
  file->guard_slot_ = GuardMapping(map, size);
  MOELORA_RETURN_IF_ERROR(file->Parse(absl::MakeConstSpan(static_cast<const uint8_t*>(map), size)));
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBuffer(
    absl::Span<const uint8_t> bytes, std::string label) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = std::move(label);
  MOELORA_RETURN_IF_ERROR(file->Parse(bytes));
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  UnguardMapping(guard_slot_);
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

absl::Status SafetensorsFile::CheckIntact() const {
  if (map_ == nullptr) return absl::OkStatus();
  if (guard_slot_ >= 0 && g_guard[guard_slot_].damaged.load(std::memory_order_acquire)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ": the file was truncated while it was read (rewritten under the load?)"));
  }
  struct stat now;
  if (::stat(path_.c_str(), &now) != 0 || now.st_size != opened_.st_size ||
      now.st_ino != opened_.st_ino || now.st_dev != opened_.st_dev ||
      now.st_mtim.tv_sec != opened_.st_mtim.tv_sec ||
      now.st_mtim.tv_nsec != opened_.st_mtim.tv_nsec) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": the file changed while it was read (rewritten under the load?)"));
  }
  return absl::OkStatus();
}

const TensorView* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::ReleasePages(const TensorView& view) const {
  if (map_ == nullptr || view.nbytes == 0) return;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  uintptr_t begin = reinterpret_cast<uintptr_t>(view.data);
  uintptr_t end = begin + view.nbytes;
  begin = (begin + page - 1) / page * page;  // only whole pages of this tensor
  end = end / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

absl::Status SafetensorsFile::Parse(absl::Span<const uint8_t> bytes) {
  auto bad = [this](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", parts...));
  };
  if (bytes.size() < 8) {
    return bad("file is ", bytes.size(), " bytes, shorter than the 8-byte header length");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > kMaxSafetensorsHeaderBytes) {
    return bad("header length ", n, " exceeds the ", kMaxSafetensorsHeaderBytes, "-byte limit");
  }
  if (n > bytes.size() - 8) {
    return bad("header length ", n, " runs past the end of the file (", bytes.size(), " bytes)");
  }
  const char* header = reinterpret_cast<const char*>(bytes.data() + 8);
  if (n == 0 || header[0] != '{') return bad("header is not a JSON object (must start with '{')");

  // Track keys per JSON object to reject duplicates (nlohmann, like serde's map, would keep one).
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  auto callback = [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) {
      keys.emplace_back();
    } else if (event == E::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (event == E::key && !keys.empty()) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!keys.back().insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(header, header + n, callback);
  } catch (const nlohmann::json::exception& e) {
    return bad("header is not valid JSON: ", e.what());
  }
  if (!duplicate.empty()) return bad("duplicate key '", duplicate, "' in header");
  if (!root.is_object()) return bad("header is not a JSON object");

  const uint8_t* data = bytes.data() + 8 + n;
  const uint64_t data_size = bytes.size() - 8 - n;
  struct Entry {
    uint64_t begin, end;
    TensorView view;
  };
  std::vector<Entry> entries;
  entries.reserve(root.size());
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return bad("__metadata__ is not an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          return bad("__metadata__ value of '", m.key(), "' is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) return bad("tensor '", name, "': entry is not an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string())
      return bad("tensor '", name, "': missing or non-string dtype");
    if (sh == v.end() || !sh->is_array())
      return bad("tensor '", name, "': missing or non-array shape");
    if (off == v.end() || !off->is_array() || off->size() != 2) {
      return bad("tensor '", name, "': data_offsets must be [begin, end]");
    }
    auto dtype = ParseDType(dt->get<std::string>());
    if (!dtype.ok()) return bad("tensor '", name, "': ", dtype.status().message());
    std::vector<uint64_t> shape;
    for (const auto& d : *sh) {
      uint64_t x;
      if (!AsU64(d, &x))
        return bad("tensor '", name, "': shape entries must be non-negative integers");
      if (x > static_cast<uint64_t>(INT64_MAX))
        return bad("tensor '", name, "': shape entry too large");
      shape.push_back(x);
    }
    uint64_t begin, end;
    if (!AsU64((*off)[0], &begin) || !AsU64((*off)[1], &end)) {
      return bad("tensor '", name, "': data_offsets must be non-negative integers");
    }
    if (end < begin) return bad("tensor '", name, "': data_offsets end ", end, " < begin ", begin);
    uint64_t span_bytes = 0;
    if (!SpanBytes(shape, DTypeBits(*dtype), &span_bytes)) {
      return bad("tensor '", name,
                 "': shape × dtype size overflows or is not a whole number of bytes");
    }
    Entry e{begin, end, {}};
    e.view.name = name;
    e.view.dtype = *dtype;
    e.view.shape.assign(shape.begin(), shape.end());
    if (span_bytes != end - begin) {
      return bad("tensor '", name, "': shape ", e.view.ShapeString(), " × ", DTypeName(*dtype),
                 " is ", span_bytes, " bytes but data_offsets span ", end - begin, " bytes");
    }
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  for (const Entry& e : entries) {
    if (e.begin != expected) {
      return bad("tensor '", e.view.name, "': data_offsets begin ", e.begin,
                 " but the previous tensor ends at ", expected,
                 e.begin < expected ? " (overlap)" : " (gap)");
    }
    expected = e.end;
  }
  if (expected != data_size) {
    return bad("tensors cover ", expected, " bytes but the data section is ", data_size,
               expected > data_size ? " bytes (offsets out of range or file truncated)"
                                    : " bytes (trailing bytes)");
  }
  tensors_.reserve(entries.size());
  for (Entry& e : entries) {
    e.view.data = data + e.begin;
    e.view.nbytes = e.end - e.begin;
    e.view.offset = e.begin;
    index_.emplace(e.view.name, tensors_.size());
    tensors_.push_back(std::move(e.view));
  }
  data_bytes_ = data_size;
  return absl::OkStatus();
}

namespace {

// The 8-byte length prefix plus the JSON header padded with spaces to a multiple of 8.
[[nodiscard]] absl::StatusOr<std::string> BuildHeader(
    const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const auto& t : tensors) {
    if (t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate or reserved tensor name '", t.name, "'"));
    }
    std::vector<uint64_t> shape(t.shape.begin(), t.shape.end());
    for (int64_t d : t.shape) {
      if (d < 0)
        return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': negative dim"));
    }
    uint64_t bytes = 0;
    if (!SpanBytes(shape, DTypeBits(t.dtype), &bytes) || bytes != t.nbytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "': ", t.nbytes, " bytes given, shape needs ", bytes));
    }
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                      {"shape", shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string json = header.dump();
  while ((8 + json.size()) % 8 != 0) json.push_back(' ');
  std::string out;
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += json;
  return out;
}

}  // namespace

[[nodiscard]] absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata) {
  MOELORA_ASSIGN_OR_RETURN(std::string out, BuildHeader(tensors, metadata));
  for (const auto& t : tensors) out.append(static_cast<const char*>(t.data), t.nbytes);
  return out;
}

[[nodiscard]] absl::Status WriteSafetensors(const std::string& path,
                                            const std::vector<TensorToWrite>& tensors,
                                            const std::map<std::string, std::string>& metadata) {
  // Streams tensor by tensor: no second copy of the data in memory.
  MOELORA_ASSIGN_OR_RETURN(std::string header, BuildHeader(tensors, metadata));
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::InvalidArgumentError(absl::StrCat(tmp, ": cannot create"));
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const auto& t : tensors) {
      out.write(static_cast<const char*>(t.data), static_cast<std::streamsize>(t.nbytes));
    }
    out.flush();
    if (!out) return absl::InternalError(absl::StrCat(tmp, ": write failed"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat(path, ": rename failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace moelora
