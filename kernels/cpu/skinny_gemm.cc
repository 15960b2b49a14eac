#include "kernels/skinny_gemm.h"

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "kernels/internal/avx2.h"
#include "kernels/internal/avx512.h"

namespace moelora {

namespace {

// The f32 x rows, for the instruction sets that read x as f32.
struct F32XRows {
  static const float* X_of(const SkinnyGemmArgs& a) { return a.x; }
  static int64_t Ldx_of(const SkinnyGemmArgs& a) { return a.ldx; }
};

namespace isa_avx2 {

struct Vec : F32XRows {
  using V = __m256;
  using X = __m256;
  static constexpr int kWidth = 8;
  MOELORA_AVX2 static V Zero() { return _mm256_setzero_ps(); }
  MOELORA_AVX2 static V Load(const float* p) { return avx2::Load8(p); }
  MOELORA_AVX2 static V Load(const uint16_t* p) { return avx2::Load8(p); }
  MOELORA_AVX2 static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  MOELORA_AVX2 static V Add(V a, V b) { return _mm256_add_ps(a, b); }
  MOELORA_AVX2 static float Sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

#define MOELORA_TILE_TARGET MOELORA_AVX2
#include "kernels/internal/skinny_tiles.inc"  // NOLINT(build/include)
#undef MOELORA_TILE_TARGET

template <typename W>
MOELORA_AVX2 void Run(const SkinnyGemmArgs& a, int64_t n0, int64_t n1) {
  // 4 weight rows (4 streams from memory) stay in L1 while the x rows pass 3 at a time (12 of
  // the 16 ymm registers accumulate): faster than 2 x 6 and 1 x 12 tiles as measured. Row
  // streams at 1-2 x rows at most: more would not fit 16 registers.
  if (RowStreams<2>(a, static_cast<const W*>(a.w), n0, n1, SkinnyRowStreamRows())) return;
  RunTiles<4, 3>(a, static_cast<const W*>(a.w), n0, n1);
}

}  // namespace isa_avx2

namespace isa_avx512 {

struct Vec : F32XRows {
  using V = __m512;
  using X = __m512;
  static constexpr int kWidth = 16;
  MOELORA_AVX512 static V Zero() { return _mm512_setzero_ps(); }
  MOELORA_AVX512 static V Load(const float* p) { return _mm512_loadu_ps(p); }
  // 16 bf16 -> 16 f32, exact (a bf16 is the top half of an f32).
  MOELORA_AVX512 static V Load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  MOELORA_AVX512 static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  MOELORA_AVX512 static V Add(V a, V b) { return _mm512_add_ps(a, b); }
  MOELORA_AVX512 static float Sum(V v) { return _mm512_reduce_add_ps(v); }
};

#define MOELORA_TILE_TARGET MOELORA_AVX512
#include "kernels/internal/skinny_tiles.inc"  // NOLINT(build/include)
#undef MOELORA_TILE_TARGET

template <typename W>
MOELORA_AVX512 void Run(const SkinnyGemmArgs& a, int64_t n0, int64_t n1) {
  // f32 weights at a decode's few rows per expert: how many weight rows stream at once was
  // measured, not derived (the kernel's rate is what the memory gives its streams). Up to
  // SkinnyRowStreamRows x rows (2, or 8 on the Zen 5): one weight row at a time (RowStreams).
  // Past them, tiles: rows of 4 KB or more (k = 1024: gate/up, the dense products) 8 rows a
  // tile (8 x 3 accumulators); rows of up to 2 KB (k = 512: the down projection) 2 rows a tile.
  // One weight row at a time up to SkinnyRowStreamRows x rows for f32 weights; bf16 weights
  // widened here (x not bf16, or no vdpbf16ps) at most 2, the rows measured for them.
  const int rows =
      std::is_same_v<W, float> ? SkinnyRowStreamRows() : std::min(2, SkinnyRowStreamRows());
  if (RowStreams<8>(a, static_cast<const W*>(a.w), n0, n1, rows)) return;
  if constexpr (std::is_same_v<W, float>) {
    const int64_t row_bytes = a.k * static_cast<int64_t>(sizeof(float));
    if (row_bytes >= 4096 && a.m <= 3) return RunTiles<8, 3>(a, static_cast<const W*>(a.w), n0, n1);
    if (row_bytes <= 2048 && a.m <= 4) return RunTiles<2, 6>(a, static_cast<const W*>(a.w), n0, n1);
  }
  // 32 zmm registers: 4 weight rows x 6 x rows = 24 accumulators, 6 for x, 1 for w.
  RunTiles<4, 6>(a, static_cast<const W*>(a.w), n0, n1);
}

}  // namespace isa_avx512

// bf16 weights against bf16 x (a.x_bf16_rows) on a CPU with AVX512-BF16: vdpbf16ps multiplies
// 32 bf16 pairs and adds them into 16 f32 lanes in one instruction, where widening takes three.
// Products are exact in f32; the sums are f32 (the instruction flushes denormals).
namespace isa_avx512_bf16 {

struct Vec {
  using V = __m512;
  using X = __m512bh;
  static constexpr int kWidth = 32;
  static const uint16_t* X_of(const SkinnyGemmArgs& a) { return a.x_bf16_rows; }
  static int64_t Ldx_of(const SkinnyGemmArgs& a) { return a.ldx_bf16; }
  MOELORA_AVX512_BF16 static V Zero() { return _mm512_setzero_ps(); }
  // 32 bf16, of x or of w.
  MOELORA_AVX512_BF16 static X Load(const uint16_t* p) {
    return reinterpret_cast<X>(_mm512_loadu_si512(p));
  }
  MOELORA_AVX512_BF16 static V Fma(X w, X x, V acc) { return _mm512_dpbf16_ps(acc, w, x); }
  MOELORA_AVX512_BF16 static V Add(V a, V b) { return _mm512_add_ps(a, b); }
  MOELORA_AVX512_BF16 static float Sum(V v) { return _mm512_reduce_add_ps(v); }
};

#define MOELORA_TILE_TARGET MOELORA_AVX512_BF16
#include "kernels/internal/skinny_tiles.inc"  // NOLINT(build/include)
#undef MOELORA_TILE_TARGET

MOELORA_AVX512_BF16 void Run(const SkinnyGemmArgs& a, int64_t n0, int64_t n1) {
  const auto* w = static_cast<const uint16_t*>(a.w);
  // One weight row at a time up to SkinnyRowStreamRows x rows (8 on the Zen 5).
  if (RowStreams<8>(a, w, n0, n1, SkinnyRowStreamRows())) return;
  // Rows of up to 1 KB (k <= 512: the MoE down projection) 8 at a time, x rows 3 at a time: a
  // 4-row tile of them is 4 KB, 16 steps of k, and its sums and the next tile's prefetch were a
  // large share of each. The gate/up rows (2 KB) gained nothing from it.
  if (a.k <= 512) return RunTiles<8, 3>(a, w, n0, n1);
  RunTiles<4, 6>(a, w, n0, n1);
}

}  // namespace isa_avx512_bf16

SkinnyIsa Detect() {
  const char* e = std::getenv("MOELORA_SKINNY_ISA");
  // An unknown name counts as unset (the best set), never as a silent downgrade.
  if (e != nullptr && std::strcmp(e, "avx2") != 0 && std::strcmp(e, "avx512") != 0 &&
      std::strcmp(e, "avx512bf16") != 0) {
    e = nullptr;
  }
  for (SkinnyIsa isa : {SkinnyIsa::kAvx512Bf16, SkinnyIsa::kAvx512, SkinnyIsa::kAvx2}) {
    if (!SkinnyGemmSupports(isa)) continue;
    if (e == nullptr || (std::strcmp(e, "avx2") == 0 && isa == SkinnyIsa::kAvx2) ||
        (std::strcmp(e, "avx512") == 0 && isa == SkinnyIsa::kAvx512) ||
        (std::strcmp(e, "avx512bf16") == 0 && isa == SkinnyIsa::kAvx512Bf16)) {
      return isa;
    }
  }
  return SkinnyGemmSupports(SkinnyIsa::kAvx2) ? SkinnyIsa::kAvx2 : SkinnyIsa::kNone;
}

}  // namespace

namespace {
// AMD family 26 (Zen 5) and later: AVX-512 on full 512-bit units (Zen 4 splits each 512-bit
// operation in two 256-bit halves). The family from CPUID leaf 1 by hand: GCC 12's
// __builtin_cpu_is knows the vendor but no Zen past znver4.
bool FullWidthZen() {
  if (!__builtin_cpu_is("amd")) return false;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
  const unsigned base = (a >> 8) & 0xf;
  const unsigned family = base == 0xf ? base + ((a >> 20) & 0xff) : base;
  return family >= 0x1a;
}

// The x rows up to which a weight is read one row at a time, by CPU, as measured (the tiles
// beyond): 2 on the Zen 4 and the Xeon, 8 on the Zen 5 (f32 and bf16 weights).
int DefaultRowStreamRows() {
  static const int rows = FullWidthZen() ? 8 : 2;
  return rows;
}

std::atomic<int>& RowStreamRowsOverride() {
  static std::atomic<int> rows{0};
  return rows;
}

// A prefetch distance in bytes: the CPU's (cpu_bytes) unless overridden (a negative override:
// the CPU's again).
class PrefetchBytes {
 public:
  // `env`: a variable that, set to a whole number of bytes (0 to 1 MiB), replaces the CPU's
  // value (for benchmarks through the public API, whose worker processes cannot be told by a
  // call; other values are ignored, as MOELORA_SKINNY_ISA's unknown names are).
  explicit PrefetchBytes(int64_t cpu_bytes, const char* env = nullptr)
      : cpu_bytes_(FromEnv(env, cpu_bytes)) {}
  int64_t Get() const {
    const int64_t o = override_.load(std::memory_order_relaxed);
    return o >= 0 ? o : cpu_bytes_;
  }
  void Set(int64_t bytes) { override_.store(bytes < 0 ? -1 : bytes, std::memory_order_relaxed); }

 private:
  static int64_t FromEnv(const char* env, int64_t fallback) {
    const char* v = env != nullptr ? std::getenv(env) : nullptr;
    if (v == nullptr || *v == '\0' || std::strspn(v, "0123456789") != std::strlen(v) ||
        std::strlen(v) > 7) {
      return fallback;
    }
    const int64_t bytes = std::atoll(v);
    return bytes <= (int64_t{1} << 20) ? bytes : fallback;
  }
  const int64_t cpu_bytes_;
  std::atomic<int64_t> override_{-1};
};

// On the Zen 5, f32 rows 4 KB ahead and bf16 rows 8 KB ahead: rows of 1-2 KB prefetched one row
// ahead were less than the memory's latency covers at a core's bandwidth. Elsewhere none (the
// hardware prefetcher alone).
PrefetchBytes& RowStreamPrefetch(SkinnyWeight w) {
  static PrefetchBytes f32(FullWidthZen() ? 4096 : 0, "MOELORA_SKINNY_PREFETCH_BYTES");
  static PrefetchBytes bf16(FullWidthZen() ? 8192 : 0, "MOELORA_SKINNY_PREFETCH_BYTES");
  return w == SkinnyWeight::kF32 ? f32 : bf16;
}

// On the Zen 5, f32 weights at 5-8 x rows: a second prefetch 8 KB ahead into L2 (bf16 weights
// gained nothing from it).
PrefetchBytes& RowStreamFarPrefetch() {
  static PrefetchBytes bytes(FullWidthZen() ? 8192 : 0);
  return bytes;
}

// On the Zen 5, the row streams prefetch with the non-temporal hint (prefetchnta): a row stream
// reads each weight row once a call, and a decode step streams far more than the L3 holds (a
// layer's experts are 100 MB in bf16 at bench/peer's model, the L3 32 MB); the L3 there takes
// the lines L2 evicts, so with the L1 / L2 hints the stream displaced what the step reads again
// (the KV cache, the activations, the wide kernel's dense weights) and paid for the victim
// writes.
bool RowStreamNonTemporalDefault() {
  static const bool on = [] {
    const char* e = std::getenv("MOELORA_SKINNY_PREFETCH_NTA");
    if (e != nullptr && std::strcmp(e, "0") == 0) return false;
    if (e != nullptr && std::strcmp(e, "1") == 0) return true;
    return FullWidthZen();
  }();
  return on;
}

std::atomic<int>& RowStreamNonTemporalOverride() {
  static std::atomic<int> on{-1};
  return on;
}

std::atomic<bool>& RowStreamsFlag() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("MOELORA_SKINNY_ROW_STREAMS");
    return e == nullptr || std::strcmp(e, "0") != 0;
  }()};
  return on;
}
}  // namespace

bool SkinnyRowStreams() { return RowStreamsFlag().load(std::memory_order_relaxed); }

void SetSkinnyRowStreams(bool on) { RowStreamsFlag().store(on, std::memory_order_relaxed); }

int SkinnyRowStreamRows() {
  if (!SkinnyRowStreams()) return 0;
  const int o = RowStreamRowsOverride().load(std::memory_order_relaxed);
  return o > 0 ? o : DefaultRowStreamRows();
}

void SetSkinnyRowStreamRows(int rows) {
  RowStreamRowsOverride().store(std::max(0, std::min(rows, 8)), std::memory_order_relaxed);
}

int64_t SkinnyRowStreamPrefetchBytes(SkinnyWeight w) { return RowStreamPrefetch(w).Get(); }

void SetSkinnyRowStreamPrefetchBytes(int64_t bytes) {
  RowStreamPrefetch(SkinnyWeight::kF32).Set(bytes);
  RowStreamPrefetch(SkinnyWeight::kBF16).Set(bytes);
}

int64_t SkinnyRowStreamFarPrefetchBytes() { return RowStreamFarPrefetch().Get(); }

void SetSkinnyRowStreamFarPrefetchBytes(int64_t bytes) { RowStreamFarPrefetch().Set(bytes); }

bool SkinnyRowStreamNonTemporal() {
  const int o = RowStreamNonTemporalOverride().load(std::memory_order_relaxed);
  return o >= 0 ? o != 0 : RowStreamNonTemporalDefault();
}

void SetSkinnyRowStreamNonTemporal(int on) {
  RowStreamNonTemporalOverride().store(on < 0 ? -1 : (on != 0 ? 1 : 0), std::memory_order_relaxed);
}

SkinnyIsa SkinnyGemmIsa() {
  static const SkinnyIsa isa = Detect();
  return isa;
}

bool SkinnyGemmAvailable() { return SkinnyGemmIsa() != SkinnyIsa::kNone; }

bool SkinnyGemmSupports(SkinnyIsa isa) {
  switch (isa) {
    case SkinnyIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case SkinnyIsa::kAvx512:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
    case SkinnyIsa::kAvx512Bf16:
      return SkinnyGemmSupports(SkinnyIsa::kAvx512) && __builtin_cpu_supports("avx512bf16");
    case SkinnyIsa::kNone:
      break;
  }
  return false;
}

void SkinnyGemmRows(const SkinnyGemmArgs& a, int64_t n0, int64_t n1, SkinnyIsa isa) {
  const bool f32 = a.w_type == SkinnyWeight::kF32;
  if (isa == SkinnyIsa::kAvx512Bf16 && !f32 && a.x_bf16_rows != nullptr) {
    isa_avx512_bf16::Run(a, n0, n1);
  } else if (isa == SkinnyIsa::kAvx512 || isa == SkinnyIsa::kAvx512Bf16) {
    f32 ? isa_avx512::Run<float>(a, n0, n1) : isa_avx512::Run<uint16_t>(a, n0, n1);
  } else {
    f32 ? isa_avx2::Run<float>(a, n0, n1) : isa_avx2::Run<uint16_t>(a, n0, n1);
  }
}

void SkinnyGemmRows(const SkinnyGemmArgs& a, int64_t n0, int64_t n1) {
  SkinnyGemmRows(a, n0, n1, SkinnyGemmIsa());
}

}  // namespace moelora
