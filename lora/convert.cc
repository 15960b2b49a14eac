#include "lora/convert.h"

#include <emmintrin.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace moelora {
namespace {

size_t ElemBytes(DType d) { return static_cast<size_t>(DTypeBits(d) / 8); }

// Fixed-size element so that copies compile to a few moves instead of a memcpy call each.
template <size_t N>
struct Elem {
  uint8_t b[N];
};

// Fast path of InPlaceTranspose when n divides m (the MoE case: rows = 2I or H, n = E):
//   1. transpose each of the q = m/n stacked n x n squares in place (8 x 8 tiles of swaps);
//   2. the memory is now [q, n, n] (s, e, k) and must become [n, q, n] (e, s, k): an in-place
//      transpose of a q x n matrix of n-element rows, done by following permutation cycles with
//      one row of scratch and a visited bitset (q*n bits).
// Both passes move each byte about once, with sequential rows of n elements: far fewer cache
// misses than the column passes of the general method.
template <typename T>
void TransposeDivisible(T* data, int64_t m, int64_t n, std::vector<uint8_t>* scratch) {
  const int64_t q = m / n;
  constexpr int64_t kTile = 8;
  for (int64_t s = 0; s < q; ++s) {
    T* sq = data + s * n * n;
    for (int64_t ib = 0; ib < n; ib += kTile) {
      for (int64_t jb = ib; jb < n; jb += kTile) {
        for (int64_t i = ib; i < std::min(ib + kTile, n); ++i) {
          for (int64_t j = std::max(jb, i + 1); j < std::min(jb + kTile, n); ++j) {
            std::swap(sq[i * n + j], sq[j * n + i]);
          }
        }
      }
    }
  }
  if (q == 1) return;
  const size_t row_bytes = static_cast<size_t>(n) * sizeof(T);
  const int64_t count = q * n;
  const size_t bitset_bytes = static_cast<size_t>((count + 7) / 8);
  if (scratch->size() < row_bytes + bitset_bytes) scratch->resize(row_bytes + bitset_bytes);
  uint8_t* tmp = scratch->data();
  uint8_t* seen = scratch->data() + row_bytes;
  std::memset(seen, 0, bitset_bytes);
  auto row = [&](int64_t p) { return reinterpret_cast<uint8_t*>(data + p * n); };
  for (int64_t start = 1; start < count - 1; ++start) {
    if (seen[start >> 3] & (1u << (start & 7))) continue;
    // Position cur = e*q + s (destination) receives the row from s*n + e (source).
    std::memcpy(tmp, row(start), row_bytes);
    int64_t cur = start;
    while (true) {
      seen[cur >> 3] |= static_cast<uint8_t>(1u << (cur & 7));
      const int64_t src = (cur % q) * n + cur / q;
      if (src == start) {
        std::memcpy(row(cur), tmp, row_bytes);
        break;
      }
      std::memcpy(row(cur), row(src), row_bytes);
      cur = src;
    }
  }
}

// The three passes of InPlaceTranspose on typed elements; `tmp` holds max(m, n) of them.
template <typename T>
void TransposeTyped(T* data, int64_t m, int64_t n, T* tmp) {
  const int64_t c = std::gcd(m, n);
  const int64_t b = n / c;
  // 1. Rotate column j down by floor(j / b).
  if (c > 1) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = (j / b) % m;
      if (k == 0) continue;
      for (int64_t i = 0; i < m; ++i) tmp[i] = data[i * n + j];
      for (int64_t i = 0; i < m; ++i) {
        int64_t d = i + k;
        if (d >= m) d -= m;
        data[d * n + j] = tmp[i];
      }
    }
  }
  // 2. Row shuffle: the element of original row i from column j goes to column (j*m + i) mod n.
  for (int64_t i2 = 0; i2 < m; ++i2) {
    T* row = data + i2 * n;
    std::copy(row, row + n, tmp);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = ((i2 - j / b) % m + m) % m;
      row[(j * m + i) % n] = tmp[j];
    }
  }
  // 3. Column gather: row i' of column j' comes from row (i + floor(j/b)) mod m, (j, i) =
  // divmod(i'*n + j', m).
  for (int64_t jd = 0; jd < n; ++jd) {
    for (int64_t i = 0; i < m; ++i) tmp[i] = data[i * n + jd];
    int64_t j = jd / m, i = jd % m;  // divmod(i'*n + j', m), advanced incrementally below
    const int64_t step_j = n / m, step_i = n % m;
    for (int64_t id = 0; id < m; ++id) {
      int64_t src = i + j / b;
      src %= m;
      data[id * n + jd] = tmp[src];
      i += step_i;
      j += step_j;
      if (i >= m) {
        i -= m;
        ++j;
      }
    }
  }
}

// [r, E] -> [E, r] for one row of a 3D lora_B, through `tmp` (r*E elements).
template <typename T>
void RowTransposeTyped(T* row, int64_t r, int64_t e_count, T* tmp) {
  std::copy(row, row + r * e_count, tmp);
  for (int64_t e = 0; e < e_count; ++e) {
    for (int64_t j = 0; j < r; ++j) row[e * r + j] = tmp[j * e_count + e];
  }
}

template <size_t N>
bool TryTranspose(uint8_t* data, int64_t m, int64_t n, size_t es, std::vector<uint8_t>* scratch) {
  if (es != N) return false;
  if (m % n == 0) {
    TransposeDivisible(reinterpret_cast<Elem<N>*>(data), m, n, scratch);
  } else {
    TransposeTyped(reinterpret_cast<Elem<N>*>(data), m, n,
                   reinterpret_cast<Elem<N>*>(scratch->data()));
  }
  return true;
}

// [rows, r, E] -> [E, rows, r] inside `data` (one lora_B of a 3D layer). Scratch: one expert's
// [rows, r] slice (or one [r, E] row, whichever is larger).
void PermuteBToExpertMajor(uint8_t* data, int64_t rows, int64_t r, int64_t experts, size_t es,
                           std::vector<uint8_t>* scratch) {
  // 1. Within each row: [r, E] -> [E, r] (a small out-of-place transpose through the scratch).
  const size_t row_bytes = static_cast<size_t>(r * experts) * es;
  if (scratch->size() < row_bytes) scratch->resize(row_bytes);
  for (int64_t o = 0; o < rows; ++o) {
    uint8_t* row = data + o * row_bytes;
    if (es == 2) {
      RowTransposeTyped(reinterpret_cast<Elem<2>*>(row), r, experts,
                        reinterpret_cast<Elem<2>*>(scratch->data()));
    } else if (es == 4) {
      RowTransposeTyped(reinterpret_cast<Elem<4>*>(row), r, experts,
                        reinterpret_cast<Elem<4>*>(scratch->data()));
    } else {
      std::memcpy(scratch->data(), row, row_bytes);
      for (int64_t j = 0; j < r; ++j) {
        for (int64_t e = 0; e < experts; ++e) {
          std::memcpy(row + (e * r + j) * es, scratch->data() + (j * experts + e) * es, es);
        }
      }
    }
  }
  // 2. [rows, E] of r-element blocks -> [E, rows].
  InPlaceTranspose(data, rows, experts, static_cast<size_t>(r) * es, scratch);
}

// CopyBExpertMajor on typed elements: kRows source rows at a time, so each expert's destination
// gets kRows·r contiguous elements per block (whole cache lines for r·es = 32 bytes) while the
// block's source rows (kRows·r·E elements) stay in L1.
template <typename T>
void CopyBExpertMajorTyped(T* dst, const T* src, int64_t rows, int64_t r, int64_t experts,
                           int64_t o_begin, int64_t o_end) {
  constexpr int64_t kRows = 4;
  for (int64_t o0 = o_begin; o0 < o_end; o0 += kRows) {
    const int64_t o1 = std::min(o_end, o0 + kRows);
    for (int64_t e = 0; e < experts; ++e) {
      T* d = dst + (e * rows + o0) * r;
      for (int64_t o = o0; o < o1; ++o) {
        const T* s = src + o * r * experts + e;
        for (int64_t j = 0; j < r; ++j) *d++ = s[j * experts];
      }
    }
  }
}

// Expert slice [2I, r] with rows g0,u0,g1,u1,... -> [gate(I) ; up(I)], through the scratch.
void DeinterleaveRows(uint8_t* slice, int64_t inter, int64_t r, size_t es,
                      std::vector<uint8_t>* scratch) {
  const size_t row = static_cast<size_t>(r) * es;
  const size_t bytes = 2 * static_cast<size_t>(inter) * row;
  if (scratch->size() < bytes) scratch->resize(bytes);
  std::memcpy(scratch->data(), slice, bytes);
  for (int64_t i = 0; i < inter; ++i) {
    std::memcpy(slice + i * row, scratch->data() + (2 * i) * row, row);
    std::memcpy(slice + (inter + i) * row, scratch->data() + (2 * i + 1) * row, row);
  }
}

std::string LastComponent(const std::string& module) {
  auto pos = module.rfind('.');
  return pos == std::string::npos ? module : module.substr(pos + 1);
}

// "model.layers.3.mlp.experts" -> "mlp.experts" (the parameter path inside a decoder layer).
std::string LayerRelative(const std::string& prefix) {
  const std::string marker = ".layers.";
  auto pos = prefix.find(marker);
  if (pos == std::string::npos) return prefix;
  auto dot = prefix.find('.', pos + marker.size());
  return dot == std::string::npos ? prefix : prefix.substr(dot + 1);
}

std::string RegexEscape(const std::string& s) { return absl::StrReplaceAll(s, {{".", "\\."}}); }

// 8 x 8 transposes of 16-bit elements with SSE2 (every x86-64 CPU has it), for bf16/f16 lora_B
// when r and E are multiples of 8. Written by hand: ATen's permute + contiguous would need the
// source in a tensor first (a second copy). bench/adapter_load's read (24 layers, bf16, r 16,
// E 128): 0.207 s with the element-wise loop, 0.150 s with this; 0.078 s as a plain memcpy.
void CopyBExpertMajor16(uint16_t* dst, const uint16_t* src, int64_t rows, int64_t r,
                        int64_t experts, int64_t o_begin, int64_t o_end) {
  constexpr int64_t kRows = 4;
  for (int64_t o0 = o_begin; o0 < o_end; o0 += kRows) {
    const int64_t o1 = std::min(o_end, o0 + kRows);
    for (int64_t e0 = 0; e0 < experts; e0 += 8) {
      for (int64_t o = o0; o < o1; ++o) {
        for (int64_t j0 = 0; j0 < r; j0 += 8) {
          // Rows j0..j0+7 of the source row's [r, E] matrix, columns e0..e0+7.
          const uint16_t* s = src + (o * r + j0) * experts + e0;
          __m128i v[8];
          for (int i = 0; i < 8; ++i) {
            v[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i * experts));
          }
          const __m128i a0 = _mm_unpacklo_epi16(v[0], v[1]), a1 = _mm_unpackhi_epi16(v[0], v[1]);
          const __m128i a2 = _mm_unpacklo_epi16(v[2], v[3]), a3 = _mm_unpackhi_epi16(v[2], v[3]);
          const __m128i a4 = _mm_unpacklo_epi16(v[4], v[5]), a5 = _mm_unpackhi_epi16(v[4], v[5]);
          const __m128i a6 = _mm_unpacklo_epi16(v[6], v[7]), a7 = _mm_unpackhi_epi16(v[6], v[7]);
          const __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
          const __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
          const __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
          const __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
          // Column e0 + c of the tile: 8 consecutive j of expert e0 + c.
          const __m128i col[8] = {_mm_unpacklo_epi64(b0, b4), _mm_unpackhi_epi64(b0, b4),
                                  _mm_unpacklo_epi64(b1, b5), _mm_unpackhi_epi64(b1, b5),
                                  _mm_unpacklo_epi64(b2, b6), _mm_unpackhi_epi64(b2, b6),
                                  _mm_unpacklo_epi64(b3, b7), _mm_unpackhi_epi64(b3, b7)};
          for (int c = 0; c < 8; ++c) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + ((e0 + c) * rows + o) * r + j0),
                             col[c]);
          }
        }
      }
    }
  }
}

}  // namespace

void CopyBExpertMajor(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t r, int64_t experts,
                      size_t es, int64_t o_begin, int64_t o_end) {
  if (o_end < 0) o_end = rows;
  if (es == 2 && r % 8 == 0 && experts % 8 == 0) {
    CopyBExpertMajor16(reinterpret_cast<uint16_t*>(dst), reinterpret_cast<const uint16_t*>(src),
                       rows, r, experts, o_begin, o_end);
  } else if (es == 2) {
    CopyBExpertMajorTyped(reinterpret_cast<Elem<2>*>(dst), reinterpret_cast<const Elem<2>*>(src),
                          rows, r, experts, o_begin, o_end);
  } else if (es == 4) {
    CopyBExpertMajorTyped(reinterpret_cast<Elem<4>*>(dst), reinterpret_cast<const Elem<4>*>(src),
                          rows, r, experts, o_begin, o_end);
  } else {
    for (int64_t o = o_begin; o < o_end; ++o) {
      for (int64_t e = 0; e < experts; ++e) {
        for (int64_t j = 0; j < r; ++j) {
          std::memcpy(dst + ((e * rows + o) * r + j) * es, src + ((o * r + j) * experts + e) * es,
                      es);
        }
      }
    }
  }
}

void InPlaceTranspose(uint8_t* data, int64_t m, int64_t n, size_t es,
                      std::vector<uint8_t>* scratch) {
  if (m <= 1 || n <= 1) return;  // [1, n] and [m, 1] are their own transposes in memory
  const size_t need = static_cast<size_t>(std::max(m, n)) * es;
  if (scratch->size() < need) scratch->resize(need);
  uint8_t* tmp = scratch->data();
  // Common element sizes (rank x dtype bytes) get a fixed-size copy; others a byte-wise one.
  if (TryTranspose<2>(data, m, n, es, scratch) || TryTranspose<4>(data, m, n, es, scratch) ||
      TryTranspose<8>(data, m, n, es, scratch) || TryTranspose<16>(data, m, n, es, scratch) ||
      TryTranspose<32>(data, m, n, es, scratch) || TryTranspose<64>(data, m, n, es, scratch) ||
      TryTranspose<128>(data, m, n, es, scratch) || TryTranspose<256>(data, m, n, es, scratch)) {
    return;
  }
  // Generic element size: the same three passes with memcpy per element.
  const int64_t c = std::gcd(m, n);
  const int64_t b = n / c;
  auto at = [&](int64_t i, int64_t j) { return data + (i * n + j) * static_cast<int64_t>(es); };
  if (c > 1) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = (j / b) % m;
      if (k == 0) continue;
      for (int64_t i = 0; i < m; ++i) std::memcpy(tmp + i * es, at(i, j), es);
      for (int64_t i = 0; i < m; ++i) std::memcpy(at((i + k) % m, j), tmp + i * es, es);
    }
  }
  for (int64_t i2 = 0; i2 < m; ++i2) {
    std::memcpy(tmp, at(i2, 0), static_cast<size_t>(n) * es);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = ((i2 - j / b) % m + m) % m;
      std::memcpy(at(i2, (j * m + i) % n), tmp + j * es, es);
    }
  }
  for (int64_t jd = 0; jd < n; ++jd) {
    for (int64_t i = 0; i < m; ++i) std::memcpy(tmp + i * es, at(i, jd), es);
    for (int64_t id = 0; id < m; ++id) {
      const int64_t l = id * n + jd;
      std::memcpy(at(id, jd), tmp + ((l % m + (l / m) / b) % m) * es, es);
    }
  }
}

// One layer's 3D pairs -> per-expert 2D pairs, in place.
static absl::Status ConvertLayerTo2D(const std::string& prefix, MoeLayerLora& layer,
                                     bool interleaved, std::vector<uint8_t>& scratch) {
  if (layer.format != AdapterFormat::k3D) return absl::OkStatus();
  if (!layer.gate_up || !layer.down) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, ": 3D layer without both gate_up and down pairs"));
  }
  LoraPair& gu = *layer.gate_up;
  LoraPair& dn = *layer.down;
  const int64_t e_count = layer.num_experts;
  const int64_t r_gu = gu.rank, r_d = dn.rank;
  const int64_t two_i = gu.b.dim(0), inter = two_i / 2, h = dn.b.dim(0);
  const int64_t h_in = gu.a.dim(1), i_in = dn.a.dim(1);
  const size_t es_gu_b = ElemBytes(gu.b.dtype), es_d_b = ElemBytes(dn.b.dtype);
  const size_t es_gu_a = ElemBytes(gu.a.dtype), es_d_a = ElemBytes(dn.a.dtype);
  if (!layer.b_expert_major) {
    PermuteBToExpertMajor(gu.b.data(), two_i, r_gu, e_count, es_gu_b, &scratch);
  }
  if (interleaved) {
    for (int64_t e = 0; e < e_count; ++e) {
      DeinterleaveRows(gu.b.data() + e * two_i * r_gu * es_gu_b, inter, r_gu, es_gu_b, &scratch);
    }
  }
  if (!layer.b_expert_major) PermuteBToExpertMajor(dn.b.data(), h, r_d, e_count, es_d_b, &scratch);
  layer.b_expert_major = false;
  layer.experts.assign(e_count, {});
  // A per-expert pair: views into the fused pair's buffers, its rank, alpha, scaling and names.
  auto view_of = [](const LoraPair& fused, HostTensor a, HostTensor b) {
    LoraPair p = fused;
    p.a = std::move(a);
    p.b = std::move(b);
    return p;
  };
  for (int64_t e = 0; e < e_count; ++e) {
    LoraPair gate = view_of(gu, gu.a.View(e * r_gu * h_in * es_gu_a, {r_gu, h_in}),
                            gu.b.View(e * two_i * r_gu * es_gu_b, {inter, r_gu}));
    LoraPair up = gate;
    up.b = gu.b.View(e * two_i * r_gu * es_gu_b + inter * r_gu * es_gu_b, {inter, r_gu});
    LoraPair down = view_of(dn, dn.a.View(e * r_d * i_in * es_d_a, {r_d, i_in}),
                            dn.b.View(e * h * r_d * es_d_b, {h, r_d}));
    layer.experts[e][static_cast<int>(ExpertProj::kGate)] = std::move(gate);
    layer.experts[e][static_cast<int>(ExpertProj::kUp)] = std::move(up);
    layer.experts[e][static_cast<int>(ExpertProj::kDown)] = std::move(down);
  }
  layer.gate_up.reset();
  layer.down.reset();
  layer.format = AdapterFormat::k2D;
  return absl::OkStatus();
}

[[nodiscard]] absl::Status ConvertTo2DInPlace(LoraAdapter* adapter) {
  if (adapter->format != AdapterFormat::k3D) return absl::OkStatus();
  // Layers are independent: converted on the machine's cores (OpenMP), each thread with its own
  // scratch; the first layer's error (in layer order) is returned.
  std::vector<std::pair<const std::string*, MoeLayerLora*>> layers;
  for (auto& [prefix, layer] : adapter->moe) layers.push_back({&prefix, &layer});
  std::vector<absl::Status> status(layers.size());
  const int64_t n = static_cast<int64_t>(layers.size());
  const bool interleaved = adapter->interleaved_gate_up;
#pragma omp parallel
  {
    std::vector<uint8_t> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      status[i] = ConvertLayerTo2D(*layers[i].first, *layers[i].second, interleaved, scratch);
    }
  }
  for (const absl::Status& st : status) MOELORA_RETURN_IF_ERROR(st);
  adapter->converted_to_2d = true;
  return absl::OkStatus();
}

[[nodiscard]] absl::Status ConvertTo3D(LoraAdapter* adapter) {
  if (adapter->format == AdapterFormat::kDense) return absl::OkStatus();
  bool any2d = false;
  for (const auto& [prefix, layer] : adapter->moe) any2d |= layer.format == AdapterFormat::k2D;
  if (!any2d) return absl::OkStatus();
  // Build everything first, then swap in: a failure leaves the adapter unchanged.
  std::map<std::string, std::pair<LoraPair, LoraPair>> built;
  for (const auto& [prefix, layer] : adapter->moe) {
    const std::string& where = prefix;  // structured bindings cannot be captured in C++17
    auto bad = [&where](auto&&... parts) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": cannot fuse to 3D: ", parts...));
    };
    const int64_t e_count = layer.num_experts;
    if (e_count <= 0 || static_cast<int64_t>(layer.experts.size()) != e_count)
      return bad("no experts");
    for (int64_t e = 0; e < e_count; ++e) {
      for (int p = 0; p < 3; ++p) {
        if (!layer.experts[e][p]) {
          return bad("expert ", e, " has no ", ExpertProjName(static_cast<ExpertProj>(p)),
                     " LoRA (3D needs gate, up and down for every expert)");
        }
      }
    }
    const LoraPair& g0 = *layer.experts[0][0];
    const LoraPair& u0 = *layer.experts[0][1];
    const LoraPair& d0 = *layer.experts[0][2];
    if (std::abs(g0.scaling - u0.scaling) > 1e-12 * std::abs(g0.scaling)) {
      return bad("gate_proj scaling ", g0.scaling, " differs from up_proj scaling ", u0.scaling);
    }
    const DType dt = g0.a.dtype;
    const size_t es = ElemBytes(dt);
    bool shared = g0.rank == u0.rank;
    for (int64_t e = 0; e < e_count; ++e) {
      for (int p = 0; p < 3; ++p) {
        const LoraPair& x = *layer.experts[e][p];
        const LoraPair& ref = *layer.experts[0][p];
        if (x.rank != ref.rank || x.a.dtype != dt || x.b.dtype != dt || x.a.shape != ref.a.shape ||
            x.b.shape != ref.b.shape) {
          return bad("expert ", e, " ", ExpertProjName(static_cast<ExpertProj>(p)),
                     " has shape/rank/dtype A ", x.a.ShapeString(), " B ", x.b.ShapeString(),
                     " unlike expert 0's A ", ref.a.ShapeString(), " B ", ref.b.ShapeString());
        }
      }
      const LoraPair& g = *layer.experts[e][0];
      const LoraPair& u = *layer.experts[e][1];
      if (shared && std::memcmp(g.a.data(), u.a.data(), g.a.nbytes()) != 0) shared = false;
    }
    const int64_t r = g0.rank, h = g0.a.dim(1), inter = g0.b.dim(0);
    const int64_t r_gu = shared ? r : 2 * r;
    const int64_t r_d = d0.rank, i_in = d0.a.dim(1), h_out = d0.b.dim(0);
    LoraPair gu, dn;
    gu.a.dtype = gu.b.dtype = dn.a.dtype = dn.b.dtype = dt;
    gu.a.shape = {e_count * r_gu, h};
    gu.b.shape = {2 * inter, r_gu * e_count};
    dn.a.shape = {e_count * r_d, i_in};
    dn.b.shape = {h_out, r_d * e_count};
    for (HostTensor* t : {&gu.a, &gu.b, &dn.a, &dn.b})
      t->storage = std::make_shared<HostBuffer>(t->nbytes());
    std::memset(gu.b.data(), 0, gu.b.nbytes());  // block-diagonal zeros in the rank-concat case
    const bool interleave = adapter->interleaved_gate_up;
    for (int64_t e = 0; e < e_count; ++e) {
      const LoraPair& g = *layer.experts[e][0];
      const LoraPair& u = *layer.experts[e][1];
      const LoraPair& d = *layer.experts[e][2];
      uint8_t* a_dst = gu.a.data() + e * r_gu * h * es;
      std::memcpy(a_dst, g.a.data(), g.a.nbytes());
      if (!shared) std::memcpy(a_dst + r * h * es, u.a.data(), u.a.nbytes());
      for (int64_t i = 0; i < inter; ++i) {
        const int64_t gate_row = interleave ? 2 * i : i;
        const int64_t up_row = interleave ? 2 * i + 1 : inter + i;
        for (int64_t j = 0; j < r; ++j) {
          // column (rank index) * E + expert
          std::memcpy(gu.b.data() + (gate_row * r_gu * e_count + j * e_count + e) * es,
                      g.b.data() + (i * r + j) * es, es);
          const int64_t ju = shared ? j : r + j;
          std::memcpy(gu.b.data() + (up_row * r_gu * e_count + ju * e_count + e) * es,
                      u.b.data() + (i * r + j) * es, es);
        }
      }
      std::memcpy(dn.a.data() + e * r_d * i_in * es, d.a.data(), d.a.nbytes());
      for (int64_t o = 0; o < h_out; ++o) {
        for (int64_t j = 0; j < r_d; ++j) {
          std::memcpy(dn.b.data() + (o * r_d * e_count + j * e_count + e) * es,
                      d.b.data() + (o * r_d + j) * es, es);
        }
      }
    }
    gu.rank = static_cast<int>(r_gu);
    gu.scaling = g0.scaling;
    gu.alpha = adapter->config.use_rslora ? g0.scaling * std::sqrt(static_cast<double>(r_gu))
                                          : g0.scaling * static_cast<double>(r_gu);
    if (shared) gu.alpha = g0.alpha;
    gu.a_name = g0.a_name;
    gu.b_name = g0.b_name;
    dn.rank = static_cast<int>(r_d);
    dn.alpha = d0.alpha;
    dn.scaling = d0.scaling;
    dn.a_name = d0.a_name;
    dn.b_name = d0.b_name;
    built.emplace(prefix, std::make_pair(std::move(gu), std::move(dn)));
  }
  for (auto& [prefix, pairs] : built) {
    MoeLayerLora& layer = adapter->moe[prefix];
    layer.gate_up = std::move(pairs.first);
    layer.down = std::move(pairs.second);
    layer.experts.clear();
    layer.format = AdapterFormat::k3D;
  }
  adapter->max_rank = 0;
  for (const auto& [m, p] : adapter->dense) adapter->max_rank = std::max(adapter->max_rank, p.rank);
  for (const auto& [prefix, layer] : adapter->moe) {
    adapter->max_rank = std::max({adapter->max_rank, layer.gate_up->rank, layer.down->rank});
  }
  return absl::OkStatus();
}

std::vector<float> DeltaWeight(const LoraPair& pair) {
  const int64_t r = pair.a.dim(0), in = pair.a.dim(1), out = pair.b.dim(0);
  std::vector<float> a(static_cast<size_t>(r * in)), b(static_cast<size_t>(out * r));
  for (int64_t i = 0; i < r * in; ++i) a[i] = LoadAsF32(pair.a.dtype, pair.a.data(), i);
  for (int64_t i = 0; i < out * r; ++i) b[i] = LoadAsF32(pair.b.dtype, pair.b.data(), i);
  std::vector<float> d(static_cast<size_t>(out * in), 0.0f);
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t j = 0; j < r; ++j) {
      const double bj = b[o * r + j];
      for (int64_t i = 0; i < in; ++i) d[o * in + i] += static_cast<float>(bj * a[j * in + i]);
    }
  }
  for (float& x : d) x = static_cast<float>(x * pair.scaling);
  return d;
}

[[nodiscard]] absl::Status WriteAdapter(const LoraAdapter& adapter, const std::string& out_dir) {
  ::mkdir(out_dir.c_str(), 0755);
  struct stat st;
  if (::stat(out_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(out_dir, ": cannot create the output directory"));
  }
  std::vector<TensorToWrite> tensors;
  auto add = [&tensors](const std::string& module, const LoraPair& p) {
    const std::string base = "base_model.model." + module;
    tensors.push_back({base + ".lora_A.weight", p.a.dtype, p.a.shape, p.a.data(), p.a.nbytes()});
    tensors.push_back({base + ".lora_B.weight", p.b.dtype, p.b.shape, p.b.data(), p.b.nbytes()});
  };
  nlohmann::json cfg = adapter.config.raw;
  const AdapterConfig& c = adapter.config;
  std::set<std::string> modules;
  for (const auto& [module, p] : adapter.dense) {
    add(module, p);
    modules.insert(LastComponent(module));
  }
  // rank/alpha patterns for expert LoRA whose rank or alpha differs from the top-level r/alpha.
  std::map<std::string, int> rank_extra;
  std::map<std::string, double> alpha_extra;
  std::set<std::string> target_params;
  bool any3d = false;
  auto note = [&](const std::string& key, const LoraPair& p) {
    if (p.rank != c.r) rank_extra[key] = p.rank;
    if (std::abs(p.alpha - c.lora_alpha) > 1e-12 * std::max(1.0, std::abs(c.lora_alpha)))
      alpha_extra[key] = p.alpha;
  };
  for (const auto& [prefix, layer] : adapter.moe) {
    const std::string rel = LayerRelative(prefix);
    if (layer.format == AdapterFormat::k3D) {
      any3d = true;
      add(prefix + ".base_layer", *layer.gate_up);
      add(prefix, *layer.down);
      target_params.insert(rel + ".gate_up_proj");
      target_params.insert(rel + ".down_proj");
      note(RegexEscape(rel) + "\\.gate_up_proj", *layer.gate_up);
      note(RegexEscape(rel) + "\\.down_proj", *layer.down);
      continue;
    }
    for (size_t e = 0; e < layer.experts.size(); ++e) {
      for (int p = 0; p < 3; ++p) {
        if (!layer.experts[e][p]) continue;
        const std::string proj = ExpertProjName(static_cast<ExpertProj>(p));
        add(absl::StrCat(prefix, ".", e, ".", proj), *layer.experts[e][p]);
        modules.insert(proj);
        note(absl::StrCat(RegexEscape(rel), "\\.\\d+\\.", proj), *layer.experts[e][p]);
      }
    }
  }
  // Patterns that named the other layout's expert parameters no longer apply.
  for (const char* key : {"rank_pattern", "alpha_pattern"}) {
    nlohmann::json kept = nlohmann::json::object();
    if (cfg.contains(key) && cfg[key].is_object()) {
      for (auto it = cfg[key].begin(); it != cfg[key].end(); ++it) {
        if (!absl::StrContains(it.key(), "experts") &&
            !absl::StrContains(it.key(), "gate_up_proj")) {
          kept[it.key()] = it.value();
        }
      }
    }
    cfg[key] = kept;
  }
  for (const auto& [k, v] : rank_extra) cfg["rank_pattern"][k] = v;
  for (const auto& [k, v] : alpha_extra) cfg["alpha_pattern"][k] = v;
  cfg["target_modules"] = std::vector<std::string>(modules.begin(), modules.end());
  if (any3d) {
    cfg["target_parameters"] = std::vector<std::string>(target_params.begin(), target_params.end());
  } else {
    cfg["target_parameters"] = nullptr;
  }
  std::sort(tensors.begin(), tensors.end(),
            [](const auto& x, const auto& y) { return x.name < y.name; });
  MOELORA_RETURN_IF_ERROR(
      WriteSafetensors(out_dir + "/adapter_model.safetensors", tensors, {{"format", "pt"}}));
  const std::string config_path = out_dir + "/adapter_config.json";
  std::ofstream out(config_path, std::ios::trunc);
  out << cfg.dump(2) << "\n";
  if (!out) return absl::InternalError(absl::StrCat(config_path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace moelora
