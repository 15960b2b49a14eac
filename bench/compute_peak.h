// The arithmetic probe the benchmarks judge compute-bound products against: `threads` threads,
// each running 24 independent chains of the multiply-add a dense product of that dtype uses on
// this CPU, on registers only, best of `reps` passes, in GFLOP/s. f32: vfmadd231ps (zmm with
// AVX-512, ymm with AVX2 + FMA); bf16 on a CPU with AVX512-BF16: vdpbf16ps (two products a lane),
// otherwise the f32 rate (the bf16 kernels widen to f32 there). 0 when the CPU has neither.
// Hand-written: no library reports a CPU's sustained FMA rate, and a decode step's dense products
// run on this instruction (kernels/cpu/wide_gemm.cc); with AMX the bf16 products run faster than
// this probe says (bench/peer prints which instruction it timed).
#ifndef MOELORA_BENCH_COMPUTE_PEAK_H_
#define MOELORA_BENCH_COMPUTE_PEAK_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "kernels/internal/avx2.h"
#include "kernels/internal/avx512.h"

namespace moelora {
namespace peak {

constexpr int kChains = 24;  // enough to cover the latency (4-6 cycles) of 2 pipes

// Each returns the flops of `iters` passes over kChains multiply-adds, and folds the chains into
// *sink so that the compiler keeps them. One body for both AVX-512 instructions: compiled for
// AVX512-BF16, but the f32 instantiation holds no bf16 instruction, so it runs on any AVX-512 CPU.
template <bool kBf16>
MOELORA_AVX512_BF16 inline double Avx512Chains(int64_t iters, float* sink) {
  __m512 acc[kChains];
#pragma GCC unroll 24
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.0001f);
  const __m512bh ah = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3c00));
  const __m512bh bh = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3a00));
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < kChains; ++i) {
      if constexpr (kBf16) {
        acc[i] = _mm512_dpbf16_ps(acc[i], ah, bh);
      } else {
        acc[i] = _mm512_fmadd_ps(acc[i], a, b);
      }
    }
  }
  __m512 s = acc[0];
#pragma GCC unroll 24
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  *sink += _mm512_reduce_add_ps(s);
  // vfmadd231ps: 16 lanes, 2 flops; vdpbf16ps: 16 lanes, two products and their sum each.
  return static_cast<double>(iters) * kChains * 16 * (kBf16 ? 4 : 2);
}

MOELORA_AVX2 inline double Avx2Fma(int64_t iters, float* sink) {
  constexpr int kYmmChains = 12;  // 16 ymm registers
  __m256 acc[kYmmChains];
#pragma GCC unroll 12
  for (int i = 0; i < kYmmChains; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(0.0001f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kYmmChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  __m256 s = acc[0];
#pragma GCC unroll 12
  for (int i = 1; i < kYmmChains; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float v[8];
  _mm256_store_ps(v, s);
  for (float x : v) *sink += x;
  return static_cast<double>(iters) * kYmmChains * 8 * 2;
}

// What the probe timed, for the printout.
inline const char* Instruction(bool bf16) {
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  if (bf16 && avx512 && __builtin_cpu_supports("avx512bf16")) return "vdpbf16ps zmm";
  if (avx512) return "vfmadd231ps zmm";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "vfmadd231ps ymm";
  return nullptr;
}

}  // namespace peak

inline double ComputePeakGflops(int threads, bool bf16, int reps = 5) {
  const char* ins = peak::Instruction(bf16);
  if (ins == nullptr) return 0;
  const std::string which = ins;
  auto pass = [&](int64_t iters, float* sink) {
    if (which == "vdpbf16ps zmm") return peak::Avx512Chains<true>(iters, sink);
    if (which == "vfmadd231ps zmm") return peak::Avx512Chains<false>(iters, sink);
    return peak::Avx2Fma(iters, sink);
  };
  constexpr int64_t kIters = 1 << 20;  // about 10 ms a thread at 3 GHz
  double best = 0;
  std::atomic<int> sink_bits{0};
  for (int rep = 0; rep < reps; ++rep) {
    std::vector<double> flops(threads);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        float sink = 0;
        flops[t] = pass(kIters, &sink);
        sink_bits += sink > 1e30f ? 1 : 0;
      });
    }
    for (auto& t : ts) t.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double total = 0;
    for (double f : flops) total += f;
    best = std::max(best, total / s / 1e9);
  }
  return sink_bits.load() < 0 ? 0 : best;
}

}  // namespace moelora

#endif  // MOELORA_BENCH_COMPUTE_PEAK_H_
