#include "lora/adapter.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "lora/convert.h"
#include "schema/architectures.h"

namespace moelora {
namespace {

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

bool PathExists(const std::string& p, bool* is_dir = nullptr) {
  struct stat st;
  if (::stat(p.c_str(), &st) != 0) return false;
  if (is_dir) *is_dir = S_ISDIR(st.st_mode);
  return true;
}

std::string Shape(const TensorView& v) { return v.ShapeString(); }

struct Pending {
  const TensorView* a = nullptr;
  const TensorView* b = nullptr;
  ModuleClass cls;
  int rank = 0;  // per expert for 3D
  double alpha = 0;
};

std::string LastComponent(const std::string& module) {
  auto pos = module.rfind('.');
  return pos == std::string::npos ? module : module.substr(pos + 1);
}

// Everything about a file that validation learns, before any byte is copied.
class Validator {
 public:
  Validator(const AdapterConfig& config, const AdapterReadOptions& options, std::string file)
      : config_(config), options_(options), file_(std::move(file)) {}

  [[nodiscard]] absl::Status Run(const SafetensorsFile& st);

  std::map<std::string, Pending> modules;  // by module path
  AdapterFormat format = AdapterFormat::kDense;
  int num_experts = 0;
  bool inferred = false;
  int max_rank = 0;
  std::vector<std::string> notes;

  // INVALID_ARGUMENT naming the file.
  template <typename... Parts>
  [[nodiscard]] absl::Status Bad(const Parts&... parts) const {
    return absl::InvalidArgumentError(absl::StrCat(file_, ": ", parts...));
  }

 private:
  [[nodiscard]] absl::Status CheckRank(const std::string& what, const Pending& p, int actual,
                                       int expected) const;
  [[nodiscard]] absl::Status CheckDense(const std::string& module, Pending& p);
  [[nodiscard]] absl::Status Check2D(const std::string& prefix,
                                     std::vector<std::pair<std::string, Pending*>>& members);
  [[nodiscard]] absl::Status Check3D(const std::string& prefix, Pending* gu, Pending* dn);

  const AdapterConfig& config_;
  const AdapterReadOptions& options_;
  std::string file_;
};

absl::Status Validator::CheckRank(const std::string& what, const Pending& p, int actual,
                                  int expected) const {
  if (actual != expected) {
    return Bad("tensor '", p.a->name, "' ", Shape(*p.a), ": ", what, " rank ", actual,
               " does not match the config's rank ", expected,
               config_.rank_pattern.empty() ? " (r)" : " (r / rank_pattern)");
  }
  if (options_.max_rank > 0 && actual > options_.max_rank) {
    return absl::ResourceExhaustedError(absl::StrCat(file_, ": tensor '", p.a->name, "' has rank ",
                                                     actual, ", above --max-lora-rank ",
                                                     options_.max_rank));
  }
  return absl::OkStatus();
}

absl::Status Validator::CheckDense(const std::string& module, Pending& p) {
  const TensorView& a = *p.a;
  const TensorView& b = *p.b;
  if (b.shape[1] != a.shape[0]) {
    return Bad("tensor '", b.name, "' ", Shape(b), " has ", b.shape[1], " columns but '", a.name,
               "' ", Shape(a), " has ", a.shape[0],
               " rows (lora_B columns must equal lora_A rows = rank)");
  }
  p.rank = static_cast<int>(a.shape[0]);
  p.alpha = config_.AlphaFor(module);
  MOELORA_RETURN_IF_ERROR(CheckRank("module", p, p.rank, config_.RankFor(module)));
  if (options_.model) {
    const ModelInfo& m = *options_.model;  // layer indices are checked for every module in Run()
    int out, in;
    if (m.DenseDims(module, &out, &in) && (a.shape[1] != in || b.shape[0] != out)) {
      return Bad("module '", module, "': lora_A ", Shape(a), " and lora_B ", Shape(b),
                 " do not fit [out=", out, ", in=", in, "] of ", m.architecture,
                 " (hint: adapter trained for a different base model?)");
    }
  }
  return absl::OkStatus();
}

absl::Status Validator::Check2D(const std::string& prefix,
                                std::vector<std::pair<std::string, Pending*>>& members) {
  // Shapes per projection must agree across experts; every targeted projection covers all experts.
  std::array<std::set<int>, 3> seen;
  std::array<const Pending*, 3> first{};
  for (auto& [module, p] : members) {
    const int e = p->cls.expert;
    const int proj = static_cast<int>(p->cls.proj);
    if (e >= num_experts) {
      return Bad("tensor '", p->a->name, "': expert index ", e, " but the model has ", num_experts,
                 " experts");
    }
    const TensorView& a = *p->a;
    const TensorView& b = *p->b;
    if (b.shape[1] != a.shape[0]) {
      return Bad("tensor '", b.name, "' ", Shape(b), " has ", b.shape[1], " columns but '", a.name,
                 "' ", Shape(a), " has ", a.shape[0],
                 " rows (lora_B columns must equal lora_A rows = rank)");
    }
    p->rank = static_cast<int>(a.shape[0]);
    p->alpha = config_.AlphaFor(module);
    MOELORA_RETURN_IF_ERROR(CheckRank("expert", *p, p->rank, config_.RankFor(module)));
    if (first[proj] == nullptr) {
      first[proj] = p;
    } else if (first[proj]->a->shape[1] != a.shape[1] || first[proj]->b->shape[0] != b.shape[0]) {
      return Bad("tensor '", a.name, "' ", Shape(a), " / '", b.name, "' ", Shape(b),
                 " differ in size from expert ", first[proj]->cls.expert, "'s ",
                 Shape(*first[proj]->a), " / ", Shape(*first[proj]->b));
    }
    seen[proj].insert(e);
  }
  for (int proj = 0; proj < 3; ++proj) {
    if (seen[proj].empty() || static_cast<int>(seen[proj].size()) == num_experts) continue;
    for (int e = 0; e < num_experts; ++e) {
      if (!seen[proj].count(e)) {
        return Bad(prefix, ": expert ", e, " has no ",
                   ExpertProjName(static_cast<ExpertProj>(proj)),
                   " LoRA while other experts do (all ", num_experts, " experts must be present)");
      }
    }
  }
  // H and I must agree between projections (gate/up: in=H, out=I; down: in=I, out=H).
  int h = -1, inter = -1;
  auto expect = [&](int* slot, int64_t value, const TensorView& t,
                    const char* what) -> absl::Status {
    if (*slot < 0) {
      *slot = static_cast<int>(value);
      return absl::OkStatus();
    }
    if (*slot != value) {
      return Bad("tensor '", t.name, "' ", Shape(t), ": ", what, " is ", value, ", expected ",
                 *slot);
    }
    return absl::OkStatus();
  };
  if (options_.model) {
    h = options_.model->hidden_size;
    inter = options_.model->moe_intermediate_size;
  }
  for (int proj = 0; proj < 3; ++proj) {
    const Pending* p = first[proj];
    if (!p) continue;
    if (proj == static_cast<int>(ExpertProj::kDown)) {
      MOELORA_RETURN_IF_ERROR(
          expect(&inter, p->a->shape[1], *p->a, "expert intermediate size (lora_A columns)"));
      MOELORA_RETURN_IF_ERROR(expect(&h, p->b->shape[0], *p->b, "hidden size (lora_B rows)"));
    } else {
      MOELORA_RETURN_IF_ERROR(expect(&h, p->a->shape[1], *p->a, "hidden size (lora_A columns)"));
      MOELORA_RETURN_IF_ERROR(
          expect(&inter, p->b->shape[0], *p->b, "expert intermediate size (lora_B rows)"));
    }
  }
  return absl::OkStatus();
}

absl::Status Validator::Check3D(const std::string& prefix, Pending* gu, Pending* dn) {
  if (gu == nullptr || dn == nullptr) {
    const Pending* have = gu ? gu : dn;
    return Bad("tensor '", have->a->name, "': 3D expert LoRA needs both the gate_up pair (", prefix,
               ".base_layer.lora_{A,B}) and the down pair (", prefix,
               ".lora_{A,B}); found only one");
  }
  const TensorView& gua = *gu->a;
  const TensorView& gub = *gu->b;
  const TensorView& da = *dn->a;
  const TensorView& db = *dn->b;
  // Old PEFT (<= 0.19.0) saved [E,out,in] parameters with in/out swapped: gate_up A [E*r, 2I],
  // B [H, r*E]; down A [E*r, H], B [I, r*E] (docs/formats.md §4).
  const bool swapped =
      gua.shape[1] != db.shape[0] && gua.shape[1] == 2 * db.shape[0] && gub.shape[0] == da.shape[1];
  const bool swapped_vs_model =
      options_.model && gua.shape[1] == 2 * options_.model->moe_intermediate_size &&
      gub.shape[0] == options_.model->hidden_size &&
      options_.model->hidden_size != 2 * options_.model->moe_intermediate_size;
  if (swapped || swapped_vs_model) {
    return Bad(
        "tensor '", gua.name, "' ", Shape(gua), " / '", gub.name, "' ", Shape(gub),
        ": in/out features are swapped (lora_A columns should be the hidden size, lora_B rows 2 x "
        "intermediate); this file was written by PEFT <= 0.19.0 — re-save it with PEFT >= 0.19.1");
  }
  for (const Pending* p : {gu, dn}) {
    if (p->a->shape[0] % num_experts != 0) {
      return Bad("tensor '", p->a->name, "' ", Shape(*p->a), ": rows ", p->a->shape[0],
                 " are not divisible by the number of experts ", num_experts,
                 inferred ? " (inferred)" : "");
    }
    const int64_t r = p->a->shape[0] / num_experts;
    if (p->b->shape[1] != r * num_experts) {
      return Bad("tensor '", p->b->name, "' ", Shape(*p->b),
                 ": columns must be rank x experts = ", r, " x ", num_experts, " = ",
                 r * num_experts, " to match '", p->a->name, "' ", Shape(*p->a));
    }
  }
  if (gub.shape[0] % 2 != 0) {
    return Bad("tensor '", gub.name, "' ", Shape(gub), ": gate_up lora_B rows ", gub.shape[0],
               " must be even (2 x intermediate)");
  }
  gu->rank = static_cast<int>(gua.shape[0] / num_experts);
  dn->rank = static_cast<int>(da.shape[0] / num_experts);
  gu->alpha = config_.AlphaFor(prefix + ".gate_up_proj");
  dn->alpha = config_.AlphaFor(prefix + ".down_proj");
  MOELORA_RETURN_IF_ERROR(
      CheckRank("per-expert gate_up", *gu, gu->rank, config_.RankFor(prefix + ".gate_up_proj")));
  MOELORA_RETURN_IF_ERROR(
      CheckRank("per-expert down", *dn, dn->rank, config_.RankFor(prefix + ".down_proj")));
  const int64_t h = options_.model ? options_.model->hidden_size : gua.shape[1];
  const int64_t inter = options_.model ? options_.model->moe_intermediate_size : da.shape[1];
  if (gua.shape[1] != h || db.shape[0] != h) {
    return Bad("tensors '", gua.name, "' ", Shape(gua), " and '", db.name, "' ", Shape(db),
               ": hidden size must be ", h, " in both (lora_A columns, lora_B rows)");
  }
  if (da.shape[1] != inter || gub.shape[0] != 2 * inter) {
    return Bad("tensors '", da.name, "' ", Shape(da), " and '", gub.name, "' ", Shape(gub),
               ": expected intermediate size ", inter, " (down lora_A columns) and ", 2 * inter,
               " (gate_up lora_B rows)");
  }
  return absl::OkStatus();
}

absl::Status Validator::Run(const SafetensorsFile& st) {
  std::string first2d, first3d;
  for (const TensorView& t : st.tensors()) {
    auto name = ParseLoraTensorName(t.name);
    if (!name.ok()) return Bad(name.status().message());
    if (!IsComputeDType(t.dtype)) {
      return Bad("tensor '", t.name, "' has dtype ", DTypeName(t.dtype),
                 "; LoRA weights must be F32, F16 or BF16");
    }
    if (t.shape.size() != 2 || t.numel() == 0) {
      return Bad("tensor '", t.name, "' has shape ", t.ShapeString(),
                 "; LoRA weights must be 2-D and non-empty");
    }
    Pending& p = modules[name->module];
    const TensorView*& slot = name->is_a ? p.a : p.b;
    if (slot != nullptr) {
      return Bad("tensors '", slot->name, "' and '", t.name,
                 "' are the same LoRA weight of module '", name->module, "'");
    }
    slot = &t;
    p.cls = ClassifyModule(name->module);
    const bool is2d = p.cls.kind == ModuleKind::kExpert2D;
    const bool is3d = p.cls.kind == ModuleKind::kGateUp3D || p.cls.kind == ModuleKind::kDown3D;
    if (is2d && first2d.empty()) first2d = t.name;
    if (is3d && first3d.empty()) first3d = t.name;
  }
  if (modules.empty()) return Bad("no LoRA tensors");
  for (const auto& [module, p] : modules) {
    if (p.a == nullptr || p.b == nullptr) {
      const TensorView* have = p.a ? p.a : p.b;
      return Bad("tensor '", have->name, "' ", Shape(*have), " has no matching ",
                 p.a ? "lora_B" : "lora_A", " for module '", module, "'");
    }
  }
  if (!first2d.empty() && !first3d.empty()) {
    return Bad("mixes 2D per-expert tensors ('", first2d, "') and 3D fused expert tensors ('",
               first3d, "'); an adapter must use one layout");
  }
  format = !first3d.empty()   ? AdapterFormat::k3D
           : !first2d.empty() ? AdapterFormat::k2D
                              : AdapterFormat::kDense;
  if (options_.expected_format && format != AdapterFormat::kDense &&
      *options_.expected_format != format) {
    return Bad("requested format ", AdapterFormatName(*options_.expected_format), " but tensor '",
               format == AdapterFormat::k3D ? first3d : first2d, "' is ", AdapterFormatName(format),
               " expert LoRA");
  }
  if (config_.r > 0 && options_.max_rank > 0 && config_.r > options_.max_rank) {
    return absl::ResourceExhaustedError(absl::StrCat(
        file_, ": LoRA rank ", config_.r, " is greater than --max-lora-rank ", options_.max_rank));
  }

  // Number of experts: the model's, or inferred (2D: max index + 1; 3D: rows / r of the down pair).
  if (format != AdapterFormat::kDense) {
    if (options_.model) {
      num_experts = options_.model->num_experts;
      if (num_experts <= 0) {
        return Bad("tensor '", format == AdapterFormat::k3D ? first3d : first2d,
                   "' is expert LoRA but model ", options_.model->architecture, " has no experts");
      }
    } else if (format == AdapterFormat::k2D) {
      for (const auto& [module, p] : modules) num_experts = std::max(num_experts, p.cls.expert + 1);
      inferred = true;
    } else {
      for (const auto& [module, p] : modules) {
        if (p.cls.kind != ModuleKind::kDown3D) continue;
        const int r = config_.RankFor(p.cls.experts_prefix + ".down_proj");
        if (p.a->shape[0] % r != 0) {
          return Bad("tensor '", p.a->name, "' ", Shape(*p.a),
                     ": rows are not a multiple of the rank ", r,
                     ", so the number of experts cannot be inferred (pass the model)");
        }
        num_experts = static_cast<int>(p.a->shape[0] / r);
        break;
      }
      if (num_experts == 0) num_experts = 1;  // only gate_up present: Check3D reports it
      inferred = true;
    }
    if (inferred)
      notes.push_back(absl::StrCat("number of experts inferred from the tensors: ", num_experts));
  }

  std::map<std::string, std::vector<std::pair<std::string, Pending*>>> groups2d;
  std::map<std::string, std::pair<Pending*, Pending*>> groups3d;
  for (auto& [module, p] : modules) {
    switch (p.cls.kind) {
      case ModuleKind::kDense:
        MOELORA_RETURN_IF_ERROR(CheckDense(module, p));
        break;
      case ModuleKind::kExpert2D:
        groups2d[p.cls.experts_prefix].emplace_back(module, &p);
        break;
      case ModuleKind::kGateUp3D:
        groups3d[p.cls.experts_prefix].first = &p;
        break;
      case ModuleKind::kDown3D:
        groups3d[p.cls.experts_prefix].second = &p;
        break;
    }
    // Step3.5's MTP layers follow the decoder's: their modules take adapters too.
    if (options_.model && p.cls.layer >= 0 && options_.model->num_layers > 0 &&
        p.cls.layer >= options_.model->num_layers + options_.model->num_nextn_predict_layers) {
      return Bad("tensor '", p.a->name, "': layer ", p.cls.layer, " but the model has ",
                 options_.model->num_layers, " layers",
                 options_.model->num_nextn_predict_layers > 0
                     ? absl::StrCat(" and ", options_.model->num_nextn_predict_layers,
                                    " MTP layers after them")
                     : "");
    }
  }
  for (auto& [prefix, members] : groups2d) MOELORA_RETURN_IF_ERROR(Check2D(prefix, members));
  for (auto& [prefix, pair] : groups3d)
    MOELORA_RETURN_IF_ERROR(Check3D(prefix, pair.first, pair.second));
  for (const auto& [module, p] : modules) max_rank = std::max(max_rank, p.rank);
  return absl::OkStatus();
}

// adapter_config.json: a regular file of at most kMaxConfigBytes (a symlink to /dev/zero, a
// FIFO or a device is refused, never read; O_NONBLOCK so that opening a FIFO cannot block).
constexpr int64_t kMaxConfigBytes = 1 << 20;
[[nodiscard]] absl::StatusOr<std::string> ReadText(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat(path, ": missing or unreadable"));
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_fd{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  if (st.st_size > kMaxConfigBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", st.st_size, " bytes, more than ",
                                                   kMaxConfigBytes, " for a config"));
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  if (got != text.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": changed while it was read (", got, " of ", text.size(), " bytes)"));
  }
  return text;
}

// A host tensor for `v`, its bytes still to be copied (CopyAll).
HostTensor HostFor(const TensorView& v) {
  HostTensor t;
  t.dtype = v.dtype;
  t.shape = v.shape;
  t.storage = std::make_shared<HostBuffer>(v.nbytes);
  return t;
}

// One tensor to copy out of the mapping. expert_major_r > 0: a 3D lora_B [rows, r*E] that the
// 2D conversion will need as [E, rows, r], permuted while it is copied (CopyBExpertMajor).
struct Copy {
  const TensorView* src = nullptr;
  HostTensor* dst = nullptr;
  int64_t expert_major_r = 0;
  int64_t experts = 0;
};

// Whether none of the `n` bytes of U-sized values at `p` is NaN or infinite: an exponent of all
// ones. kBytes at a time in GCC's vector extension: 16 (SSE2, the build's baseline) or 32 (the
// AVX2 copy below, chosen at run time). bench/adapter_load's read (16 layers, bf16, 3D): 0.058 s
// without the check; 0.080 s with a plain element loop (GCC did not vectorise it), 0.070 s with
// SSE2, 0.060 s with AVX2. The check runs on data the copy just brought into L1.
template <typename U, int kBytes>
struct Vec;
template <>
struct Vec<uint16_t, 16> {
  typedef uint16_t type __attribute__((vector_size(16)));
};
template <>
struct Vec<uint32_t, 16> {
  typedef uint32_t type __attribute__((vector_size(16)));
};
template <>
struct Vec<uint16_t, 32> {
  typedef uint16_t type __attribute__((vector_size(32)));
};
template <>
struct Vec<uint32_t, 32> {
  typedef uint32_t type __attribute__((vector_size(32)));
};

template <typename U, int kBytes>
inline __attribute__((always_inline)) bool FiniteBitsT(const uint8_t* p, size_t n, U exponent) {
  using V = typename Vec<U, kBytes>::type;
  constexpr size_t kLanes = kBytes / sizeof(U);
  V mask;
  for (size_t l = 0; l < kLanes; ++l) mask[l] = exponent;
  V acc = {};
  const size_t whole = n / kBytes * kBytes;
  for (size_t i = 0; i < whole; i += kBytes) {
    V x;
    std::memcpy(&x, p + i, kBytes);
    acc |= reinterpret_cast<V>((x & mask) == mask);
  }
  U any = 0;
  for (size_t l = 0; l < kLanes; ++l) any |= acc[l];
  for (size_t i = whole; i + sizeof(U) <= n; i += sizeof(U)) {
    U w;
    std::memcpy(&w, p + i, sizeof(U));
    any |= (w & exponent) == exponent;
  }
  return any == 0;
}

__attribute__((target("avx2"))) bool FiniteBits16Avx2(const uint8_t* p, size_t n, uint16_t e) {
  return FiniteBitsT<uint16_t, 32>(p, n, e);
}
__attribute__((target("avx2"))) bool FiniteBits32Avx2(const uint8_t* p, size_t n, uint32_t e) {
  return FiniteBitsT<uint32_t, 32>(p, n, e);
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2");

bool FiniteBits(const uint8_t* p, size_t n, uint16_t e) {
  return kHasAvx2 ? FiniteBits16Avx2(p, n, e) : FiniteBitsT<uint16_t, 16>(p, n, e);
}
bool FiniteBits(const uint8_t* p, size_t n, uint32_t e) {
  return kHasAvx2 ? FiniteBits32Avx2(p, n, e) : FiniteBitsT<uint32_t, 16>(p, n, e);
}

bool AllFinite(const uint8_t* p, size_t n, DType t) {
  switch (t) {
    case DType::kF32:
      return FiniteBits(p, n, uint32_t{0x7F800000u});
    case DType::kBF16:
      return FiniteBits(p, n, uint16_t{0x7F80u});
    case DType::kF16:
      return FiniteBits(p, n, uint16_t{0x7C00u});
    default:
      return true;
  }
}

// The mapped bytes of every tensor into its host buffer, on the machine's cores (OpenMP), the
// pages of a tensor of 1 MiB or more released from the mapping once copied (RSS then stays near
// the adapter's size; the page cache is the kernel's either way). Smaller ones wait for the
// unmap: a madvise costs about 16 us (TLB shootdowns), half the read of a 2D adapter's 800
// tensors of 32-64 KB. One thread copied 9.4 GB/s here, below
// what two reach (bench/adapter_load; docs/performance.md). Each piece is checked for NaN and
// infinities while it is still in the cache: the index of the first tensor that holds one, or
// -1.
int64_t CopyAll(const std::vector<Copy>& copies, const SafetensorsFile& st, bool parallel) {
  const int64_t n = static_cast<int64_t>(copies.size());
  std::atomic<int64_t> first_bad{n};
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t i = 0; i < n; ++i) {
    const Copy& c = copies[i];
    const TensorView& v = *c.src;
    uint8_t* dst = c.dst->storage->bytes.get();
    bool finite = true;
    constexpr size_t kPiece = size_t{16} << 10;  // stays in L1 between the check and the copy
    const uint8_t* src = static_cast<const uint8_t*>(v.data);
    if (c.expert_major_r > 0) {
      // Source rows a block at a time: checked, then permuted while still in the cache.
      const size_t row = static_cast<size_t>(v.nbytes / std::max<int64_t>(1, v.shape[0]));
      const int64_t block = std::max<int64_t>(4, static_cast<int64_t>(kPiece / row) / 4 * 4);
      for (int64_t o = 0; o < v.shape[0]; o += block) {
        const int64_t end = std::min(v.shape[0], o + block);
        finite = AllFinite(src + o * row, (end - o) * row, v.dtype) && finite;
        CopyBExpertMajor(dst, src, v.shape[0], c.expert_major_r, c.experts, DTypeBits(v.dtype) / 8,
                         o, end);
      }
    } else {
      for (size_t at = 0; at < v.nbytes; at += kPiece) {
        const size_t len = std::min(kPiece, v.nbytes - at);
        std::memcpy(dst + at, src + at, len);
        finite = AllFinite(dst + at, len, v.dtype) && finite;
      }
    }
    if (v.nbytes >= (size_t{1} << 20)) st.ReleasePages(v);
    if (!finite) {
      int64_t cur = first_bad.load();
      while (i < cur && !first_bad.compare_exchange_weak(cur, i)) {
      }
    }
  }
  return first_bad.load() < n ? first_bad.load() : -1;
}

}  // namespace

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t HostTensor::nbytes() const { return static_cast<size_t>(numel()) * DTypeBits(dtype) / 8; }

std::string HostTensor::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

HostTensor HostTensor::View(size_t byte_offset, std::vector<int64_t> view_shape) const {
  HostTensor v;
  v.dtype = dtype;
  v.shape = std::move(view_shape);
  v.storage = storage;
  v.offset = offset + byte_offset;
  return v;
}

std::vector<std::string> LoraAdapter::TargetModules() const {
  std::set<std::string> names;
  for (const auto& [module, p] : dense) names.insert(LastComponent(module));
  for (const auto& [prefix, layer] : moe) {
    if (layer.format == AdapterFormat::k3D) {
      names.insert("experts");
      continue;
    }
    for (const auto& expert : layer.experts) {
      for (int proj = 0; proj < 3; ++proj) {
        if (expert[proj]) names.insert(ExpertProjName(static_cast<ExpertProj>(proj)));
      }
    }
  }
  return {names.begin(), names.end()};
}

size_t LoraAdapter::num_tensors() const {
  size_t n = 2 * dense.size();
  for (const auto& [prefix, layer] : moe) {
    if (layer.format == AdapterFormat::k3D) {
      n += 4;
      continue;
    }
    for (const auto& expert : layer.experts) {
      for (const auto& p : expert) n += p ? 2 : 0;
    }
  }
  return n;
}

[[nodiscard]] absl::StatusOr<LoraAdapter> ReadAdapter(const std::string& dir,
                                                      const AdapterReadOptions& options,
                                                      AdapterLoadTimings* timings) {
  AdapterLoadTimings local;
  AdapterLoadTimings& tm = timings ? *timings : local;
  tm = {};
  bool is_dir = false;
  if (!PathExists(dir, &is_dir))
    return absl::NotFoundError(absl::StrCat(dir, ": no such adapter directory"));
  if (!is_dir) return absl::InvalidArgumentError(absl::StrCat(dir, ": not a directory"));

  LoraAdapter adapter;
  adapter.dir = dir;
  const std::string config_path = dir + "/adapter_config.json";
  MOELORA_ASSIGN_OR_RETURN(std::string config_text, ReadText(config_path));
  MOELORA_ASSIGN_OR_RETURN(adapter.config, ParseAdapterConfig(config_text, config_path));
  MOELORA_RETURN_IF_ERROR(CheckServable(adapter.config, config_path));

  adapter.safetensors_path = dir + "/adapter_model.safetensors";
  if (!PathExists(adapter.safetensors_path)) {
    for (const char* pickle : {"adapter_model.bin", "adapter_model.pt"}) {
      if (PathExists(dir + "/" + pickle)) {
        return absl::InvalidArgumentError(absl::StrCat(
            dir, "/", pickle,
            ": pickle weights are never read (they can run code); convert the adapter to "
            "adapter_model.safetensors, e.g. with PEFT's "
            "save_pretrained(safe_serialization=True)"));
      }
    }
    return absl::InvalidArgumentError(absl::StrCat(adapter.safetensors_path, ": missing"));
  }

  auto t0 = Clock::now();
  auto opened = SafetensorsFile::Open(adapter.safetensors_path);
  if (!opened.ok()) {
    // A missing file here raced with the check above; a malformed one is the caller's bad input.
    return absl::InvalidArgumentError(opened.status().message());
  }
  std::unique_ptr<SafetensorsFile> st = std::move(opened).value();
  tm.read += SecondsSince(t0);

  t0 = Clock::now();
  Validator v(adapter.config, options, adapter.safetensors_path);
  MOELORA_RETURN_IF_ERROR(v.Run(*st));
  tm.validate = SecondsSince(t0);

  t0 = Clock::now();
  adapter.format = v.format;
  adapter.num_experts = v.num_experts;
  adapter.num_experts_inferred = v.inferred;
  adapter.max_rank = v.max_rank;
  adapter.notes = v.notes;
  const ArchFacts* arch = options.arch.empty() ? nullptr : FindArchFacts(options.arch);
  adapter.interleaved_gate_up = options.arch.empty()
                                    ? (options.model && options.model->interleaved_gate_up)
                                    : (arch != nullptr && arch->interleaved_gate_up);
  const AdapterConfig& cfg = adapter.config;
  // Buffers first (the pairs' places in the maps are stable), the copies together after.
  std::vector<Copy> copies;
  // Converting: a 3D layer's lora_B goes expert-major as it is copied (one pass over its bytes),
  // and ConvertTo2DInPlace then only splits (or de-interleaves) gate and up.
  const bool fuse_b = options.convert_to_2d && v.format == AdapterFormat::k3D;
  auto make_pair = [&](const Pending& p) {
    LoraPair pair;
    pair.a = HostFor(*p.a);
    pair.b = HostFor(*p.b);
    pair.rank = p.rank;
    pair.alpha = p.alpha;
    pair.scaling = cfg.ScalingFor(p.rank, p.alpha);
    pair.a_name = p.a->name;
    pair.b_name = p.b->name;
    adapter.bytes += p.a->nbytes + p.b->nbytes;
    return pair;
  };
  // After each insertion: its two tensors (a, b) join the copies. std::map and std::vector
  // elements placed below are not moved again (experts are sized once per layer, before any
  // pair goes in; see the resize below).
  auto queue = [&](const Pending& p, LoraPair& pair, bool fused_3d = false) {
    copies.push_back({p.a, &pair.a});
    copies.push_back({p.b, &pair.b, fused_3d && fuse_b ? p.rank : 0, v.num_experts});
  };
  for (const auto& [module, p] : v.modules) {
    if (p.cls.kind == ModuleKind::kDense) {
      queue(p, adapter.dense.emplace(module, make_pair(p)).first->second);
      continue;
    }
    MoeLayerLora& layer = adapter.moe[p.cls.experts_prefix];
    layer.prefix = p.cls.experts_prefix;
    layer.layer = p.cls.layer;
    layer.num_experts = v.num_experts;
    layer.format = v.format;
    if (p.cls.kind == ModuleKind::kExpert2D) {
      layer.experts.resize(v.num_experts);  // the same size every time: no reallocation
      auto& slot = layer.experts[p.cls.expert][static_cast<int>(p.cls.proj)];
      slot = make_pair(p);
      queue(p, *slot);
    } else if (p.cls.kind == ModuleKind::kGateUp3D) {
      layer.gate_up = make_pair(p);
      queue(p, *layer.gate_up, true);
      layer.b_expert_major = fuse_b;
    } else {
      layer.down = make_pair(p);
      queue(p, *layer.down, true);
      layer.b_expert_major = fuse_b;
    }
  }
  const int64_t bad = CopyAll(copies, *st, options.parallel);
  // What was read from a file changed under the load is dropped whatever it held.
  MOELORA_RETURN_IF_ERROR(st->CheckIntact());
  if (bad >= 0) {
    const TensorView& t = *copies[bad].src;
    return v.Bad("tensor '", t.name, "' ", Shape(t), " holds NaN or infinite values");
  }
  tm.read += SecondsSince(t0);
  st.reset();

  if (options.convert_to_2d && adapter.format == AdapterFormat::k3D) {
    t0 = Clock::now();
    MOELORA_RETURN_IF_ERROR(ConvertTo2DInPlace(&adapter));
    tm.convert = SecondsSince(t0);
  }
  return adapter;
}

}  // namespace moelora
