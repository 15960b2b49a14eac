// bench/skinny_gemm: the expert GEMMs of one MoE layer in a decode step, grouped through the
// skinny kernel (worker/layers/gemm.h) vs one at::mm_out per expert (the BLAS under libtorch),
// next to the time to read the same weights at the bandwidth measured in the same run. Rows per
// expert sweep the crossover (kSkinnyMaxRows). The weights sit on huge pages, as the worker's do
// (EmptyWeight). The table also gives the gate/up and the down products alone, each against its
// own bytes at the measured read rate; --dense M1,M2 times the dense products of a decode step
// at M rows (q / o [H, H], k / v [H / 4, H], the LM head [4 H, H]). --hot times the skinny
// kernel alone on one thread against weights that stay in L2 (128 KB, rows of k = H and k = I, at
// each --rows count): what its instructions cost with the memory out of the way.
// --ab-prefetch BYTES: instead of the table, the grouped products at each --rows count, 15
// rounds alternating between the CPU's row-stream prefetch distance
// (SkinnyRowStreamPrefetchBytes) and BYTES; medians and the median ratio of neighbouring rounds.
// --ab-far-prefetch BYTES: the same for the second, far prefetch of f32 weights at 5-8 x rows
// (SkinnyRowStreamFarPrefetchBytes).
//
//   skinny_gemm [--experts 32] [--hidden 1024] [--inter 512] [--dtype float32|bfloat16]
//               [--threads 2] [--rows 1,2,4,8,16,24,32,64] [--dense 8,32] [--hot]
//               [--ab-prefetch BYTES | --ab-far-prefetch BYTES]
#include "kernels/skinny_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "bench/plain_read.h"
#include "worker/layers/gemm.h"
#include "worker/loaders/weight_loader.h"

namespace {
double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
template <typename F>
double Best(F f, int reps = 7) {
  double best = 1e9;
  for (int i = 0; i < reps; ++i) {
    const double t0 = Now();
    f();
    best = std::min(best, Now() - t0);
  }
  return best;
}
// The skinny kernel on one thread, its weights (128 KB) in L2 after the first pass: rows per
// expert against k, in GFLOP/s and in GB/s of weights (what it could stream if memory kept up).
int HotTable(at::ScalarType dt, const std::string& rows_s, const std::vector<int64_t>& ks) {
  if (!moelora::SkinnyGemmAvailable()) {
    std::fprintf(stderr, "skinny_gemm --hot: this CPU has no AVX2 + FMA (no skinny kernel)\n");
    return 1;
  }
  const bool bf16 = dt == at::kBFloat16;
  std::printf("skinny kernel, one thread, weights in L2 (128 KB), %s\n| rows |",
              bf16 ? "bf16" : "f32");
  for (int64_t k : ks) std::printf(" k %ld: GFLOP/s, GB/s |", static_cast<long>(k));
  std::printf("\n|---|");
  for (size_t i = 0; i < ks.size(); ++i) std::printf("---|");
  std::printf("\n");
  for (absl::string_view r : absl::StrSplit(rows_s, ',')) {
    const int64_t m = std::atol(std::string(r).c_str());
    std::printf("| %ld |", static_cast<long>(m));
    for (int64_t k : ks) {
      const int64_t n = 128 * 1024 / (k * (bf16 ? 2 : 4));
      at::Tensor x = at::randn({m, k}).to(dt), w = (at::randn({n, k}) * 0.02).to(dt);
      at::Tensor xf = x.to(at::kFloat), y = at::empty({m, n});
      moelora::SkinnyGemmArgs a;
      a.x = xf.data_ptr<float>();
      a.ldx = k;
      a.w = w.data_ptr();
      a.w_type = bf16 ? moelora::SkinnyWeight::kBF16 : moelora::SkinnyWeight::kF32;
      a.y = y.data_ptr<float>();
      a.ldy = n;
      a.m = m;
      a.n = n;
      a.k = k;
      if (bf16) {
        a.x_bf16_rows = static_cast<const uint16_t*>(x.data_ptr());
        a.ldx_bf16 = k;
      }
      const int reps = 2000;
      const double t = Best([&] {
        for (int i = 0; i < reps; ++i) moelora::SkinnyGemmRows(a, 0, n);
      });
      std::printf(" %.1f, %.1f |", 2.0 * m * n * k * reps / t / 1e9,
                  static_cast<double>(w.numel() * w.element_size()) * reps / t / 1e9);
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t E = 32, H = 1024, I = 512;
  int threads = 2;
  std::string dtype = "float32", rows_s = "1,2,4,8,16,24,32,64", dense_s;
  bool hot = false;
  int64_t ab_prefetch = -1;
  bool ab_far = false;  // ab_prefetch is for the far prefetch
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--hot") {
      hot = true;
      continue;
    }
    if (f == "--help" || i + 1 >= argc) {
      std::printf(
          "usage: skinny_gemm [--experts 32] [--hidden 1024] [--inter 512] [--dtype D] "
          "[--threads 2] [--rows 1,2,4,8,16,24,32,64] [--dense 8,32] [--hot] "
          "[--ab-prefetch BYTES | --ab-far-prefetch BYTES]\n");
      return f == "--help" ? 0 : 2;
    }
    const std::string v = argv[++i];
    if (f == "--experts")
      E = std::atol(v.c_str());
    else if (f == "--hidden")
      H = std::atol(v.c_str());
    else if (f == "--inter")
      I = std::atol(v.c_str());
    else if (f == "--dtype")
      dtype = v;
    else if (f == "--threads")
      threads = std::atoi(v.c_str());
    else if (f == "--rows")
      rows_s = v;
    else if (f == "--dense")
      dense_s = v;
    else if (f == "--ab-prefetch" || f == "--ab-far-prefetch") {
      ab_prefetch = std::atol(v.c_str());
      ab_far = f == "--ab-far-prefetch";
      if (ab_prefetch < 0 || ab_prefetch > (int64_t{1} << 20)) {
        std::fprintf(stderr, "%s takes 0-1048576 bytes\n", f.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n", f.c_str());
      return 2;
    }
  }
  at::set_num_threads(threads);
  const at::ScalarType dt = dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  if (hot) return HotTable(dt, rows_s, {H, I});
  auto weight = [&](at::IntArrayRef shape) {
    at::Tensor w = moelora::EmptyWeight(shape, dt);
    w.copy_(at::randn(shape) * 0.02);
    return w;
  };
  at::Tensor w13 = weight({E, 2 * I, H});
  at::Tensor w2 = weight({E, H, I});
  const double bytes = static_cast<double>(w13.numel() + w2.numel()) * w13.element_size();
  // Read bandwidth: sum of the same weights (at::sum streams them once, threaded).
  at::Tensor flat = moelora::EmptyWeight({static_cast<int64_t>(bytes / 4)}, at::kFloat).normal_();
  const double read = Best([&] { (void)flat.sum().item<float>(); });
  std::printf(
      "%ld experts, H %ld, I %ld, %s, %d threads: weights %.0f MB, read at %.1f GB/s = %.2f ms\n",
      static_cast<long>(E), static_cast<long>(H), static_cast<long>(I), dtype.c_str(), threads,
      bytes / 1e6, flat.numel() * 4 / read / 1e9, bytes / (flat.numel() * 4 / read) * 1e3);
  const double rate = flat.numel() * 4 / read;  // bytes per second
  // The same buffer read as bench/peer's probe reads its own (bench/plain_read.h), best of 7.
  // at::sum reads it through its reduction
  // kernel; the two differ by the VM's stretch and by that kernel's own cost, so both are shown.
  const auto* words = static_cast<const uint64_t*>(flat.data_ptr());
  const int64_t nwords = flat.numel() / 2;
  const double plain = moelora::PlainReadGBs(words, nwords, threads, 7);
  std::printf("plain %d-thread sum of the same buffer (bench/peer's probe): %.1f GB/s = %.2f ms\n",
              threads, plain, bytes / (plain * 1e9) * 1e3);
  std::printf(
      "| rows/expert | grouped skinny ms | per-expert at::mm_out ms | mm/skinny | skinny/read | "
      "gate/up alone ms, /read | down alone ms, /read |\n"
      "|---|---|---|---|---|---|---|\n");
  for (absl::string_view r : absl::StrSplit(rows_s, ',')) {
    const int64_t m = std::atol(std::string(r).c_str());
    at::Tensor x = at::randn({E * m, H}).to(dt);
    std::vector<std::pair<int64_t, int64_t>> runs;
    std::vector<int64_t> experts;
    for (int64_t e = 0; e < E; ++e) {
      runs.push_back({e * m, (e + 1) * m});
      experts.push_back(e);
    }
    at::Tensor h13 = at::empty({E * m, 2 * I}, x.options()), act,
               y = at::empty({E * m, H}, x.options());
    auto grouped = [&] {
      moelora::GroupedMatmulWt(x, w13, runs, experts, h13);
      act = h13.narrow(1, 0, I).contiguous();
      moelora::GroupedMatmulWt(act, w2, runs, experts, y);
    };
    auto per_expert = [&] {
      for (int64_t e = 0; e < E; ++e) {
        at::Tensor d = h13.narrow(0, e * m, m);
        at::mm_out(d, x.narrow(0, e * m, m), w13[e].t());
      }
      act = h13.narrow(1, 0, I).contiguous();
      for (int64_t e = 0; e < E; ++e) {
        at::Tensor d = y.narrow(0, e * m, m);
        at::mm_out(d, act.narrow(0, e * m, m), w2[e].t());
      }
    };
    if (ab_prefetch >= 0) {
      // The grouped products alternating between the CPU's row-stream prefetch distance (or far
      // prefetch distance) and ab_prefetch bytes, 15 rounds: medians and the median ratio of
      // neighbouring rounds.
      auto set = ab_far ? moelora::SetSkinnyRowStreamFarPrefetchBytes
                        : moelora::SetSkinnyRowStreamPrefetchBytes;
      std::vector<double> t[2], ratio;
      for (int round = 0; round < 30; ++round) {
        set(round % 2 == 0 ? -1 : ab_prefetch);
        const double t0 = Now();
        grouped();
        t[round % 2].push_back(Now() - t0);
        if (round % 2 == 1) ratio.push_back(t[0].back() / t[1].back());
      }
      set(-1);
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      std::printf(
          "| %ld | %s: the CPU's %ld bytes %.2f ms, %ld bytes %.2f ms (medians), median "
          "ratio %.3f |\n",
          static_cast<long>(m), ab_far ? "far prefetch" : "prefetch",
          static_cast<long>(ab_far ? moelora::SkinnyRowStreamFarPrefetchBytes()
                                   : moelora::SkinnyRowStreamPrefetchBytes(
                                         dt == at::kBFloat16 ? moelora::SkinnyWeight::kBF16
                                                             : moelora::SkinnyWeight::kF32)),
          median(t[0]) * 1e3, static_cast<long>(ab_prefetch), median(t[1]) * 1e3, median(ratio));
      continue;
    }
    const double g = Best(grouped), p = Best(per_expert);
    const double gu = Best([&] { moelora::GroupedMatmulWt(x, w13, runs, experts, h13); });
    act = h13.narrow(1, 0, I).contiguous();
    const double dn = Best([&] { moelora::GroupedMatmulWt(act, w2, runs, experts, y); });
    const double half = bytes / 3;  // w2's bytes; w13 has twice as many
    std::printf("| %ld | %.2f | %.2f | %.2f | %.2f | %.2f, %.2f | %.2f, %.2f |\n",
                static_cast<long>(m), g * 1e3, p * 1e3, p / g, g / (bytes / rate), gu * 1e3,
                gu / (2 * half / rate), dn * 1e3, dn / (half / rate));
  }
  if (!dense_s.empty()) {
    // A decode step's dense products of one layer and the LM head, at M rows each, from memory:
    // enough copies of each weight (512 MB or more) that a pass over them cannot sit in the L3.
    auto copies = [&](at::IntArrayRef shape) {
      std::vector<at::Tensor> ws;
      const double each = static_cast<double>(c10::multiply_integers(shape)) * w13.element_size();
      for (int i = 0; i < std::max(1, static_cast<int>(512e6 / each)); ++i)
        ws.push_back(weight(shape));
      return ws;
    };
    const std::vector<at::Tensor> wq = copies({H, H}), wk = copies({H / 4, H}),
                                  wlm = copies({4 * H, H});
    std::printf(
        "| dense rows | q or o [%ld, %ld] ms, /read | k or v ms, /read | LM head ms, /read | q, k, "
        "v apart / grouped (MatmulWtEach) ms |\n"
        "|---|---|---|---|---|\n",
        static_cast<long>(H), static_cast<long>(H));
    for (absl::string_view r : absl::StrSplit(dense_s, ',')) {
      const int64_t m = std::atol(std::string(r).c_str());
      at::Tensor x = at::randn({m, H}).to(dt);
      auto row = [&](const std::vector<at::Tensor>& ws) {
        const double t = Best([&] {
                           for (const at::Tensor& w : ws) (void)moelora::MatmulWt(x, w);
                         }) /
                         ws.size();
        return std::make_pair(t * 1e3, t / (ws[0].numel() * ws[0].element_size() / rate));
      };
      const auto q = row(wq), k = row(wk), lm = row(wlm);
      // An attention layer's q, k and v on the same x: three calls against one grouped call.
      const size_t nq = wq.size(), nk = wk.size();
      const double apart = Best([&] {
                             for (size_t i = 0; i < nq; ++i) {
                               (void)moelora::MatmulWt(x, wq[i]);
                               (void)moelora::MatmulWt(x, wk[2 * i % nk]);
                               (void)moelora::MatmulWt(x, wk[(2 * i + 1) % nk]);
                             }
                           }) /
                           nq;
      const double grouped =
          Best([&] {
            for (size_t i = 0; i < nq; ++i)
              (void)moelora::MatmulWtEach(x, {wq[i], wk[2 * i % nk], wk[(2 * i + 1) % nk]});
          }) /
          nq;
      std::printf("| %ld | %.3f, %.2f | %.3f, %.2f | %.3f, %.2f | %.3f / %.3f |\n",
                  static_cast<long>(m), q.first, q.second, k.first, k.second, lm.first, lm.second,
                  apart * 1e3, grouped * 1e3);
    }
  }
  // A prefill GEMM, as tools/torch_ops_bench.py times it with the PyTorch wheel.
  at::Tensor px = at::randn({512, H}).to(dt), pw = (at::randn({H, H}) * 0.02).to(dt);
  const double t = Best([&] { (void)moelora::CpuMatmul(px, pw.t()); });
  std::printf("prefill GEMM 512 x %ld x %ld (CpuMatmul): %.2f ms (%.0f GFLOP/s)\n",
              static_cast<long>(H), static_cast<long>(H), t * 1e3, 2.0 * 512 * H * H / t / 1e9);
  return 0;
}
