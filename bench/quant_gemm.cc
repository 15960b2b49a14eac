// bench/quant_gemm: one MoE layer's expert products (gate/up [2I, H] and down [H, I] per expert)
// through the engine's grouped route, with the experts stored as MXFP4, as block FP8 (128 x 128)
// and as bf16, at each --rows count per expert: medians of rounds that alternate the formats in
// one process, each against bf16's time and against the time to read its own bytes at the plain
// read rate measured in the same run. Defaults: gpt-oss-20b's expert shapes (H = I = 2880).
//
//   quant_gemm [--experts 8] [--hidden 2880] [--inter 2880] [--threads 2] [--rows 1,4,16,64]
//              [--rounds 9]
#include "kernels/quant_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_split.h"
#include "bench/plain_read.h"
#include "worker/layers/gemm.h"
#include "worker/layers/quantized.h"

namespace {

using moelora::QuantFormat;
using moelora::QuantizedWeight;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Codes and scales of plausible values: random bytes (MXFP4: any nibble; FP8: finite codes),
// E8M0 scales around 2^-6, FP8 block scales around 1e-3.
QuantizedWeight Random(QuantFormat f, int64_t E, int64_t n, int64_t k) {
  QuantizedWeight w;
  w.format = f;
  const at::Tensor bytes = at::randint(0, 256, {E, n, f == QuantFormat::kMxfp4 ? k / 2 : k},
                                       at::TensorOptions().dtype(at::kByte));
  w.codes = f == QuantFormat::kMxfp4 ? bytes : bytes.bitwise_and(0x77);  // no NaN codes
  if (f == QuantFormat::kMxfp4) {
    w.scales = at::randint(118, 124, {E, n, k / 32}, at::TensorOptions().dtype(at::kByte));
  } else {
    w.scales = at::rand({E, (n + 127) / 128, (k + 127) / 128}) * 1e-3;
  }
  return w;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t E = 8, H = 2880, I = 2880;
  int threads = 2, rounds = 9;
  std::string rows_s = "1,4,16,64";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--experts") {
      E = std::atol(next().c_str());
    } else if (a == "--hidden") {
      H = std::atol(next().c_str());
    } else if (a == "--inter") {
      I = std::atol(next().c_str());
    } else if (a == "--threads") {
      threads = std::atoi(next().c_str());
    } else if (a == "--rows") {
      rows_s = next();
    } else if (a == "--rounds") {
      rounds = std::atoi(next().c_str());
    } else if (a == "--help" || a == "-h") {
      std::printf(
          "usage: quant_gemm [--experts 8] [--hidden 2880] [--inter 2880] [--threads 2]\n"
          "                  [--rows 1,4,16,64] [--rounds 9]\n"
          "One MoE layer's expert GEMMs with MXFP4, block-FP8 and bf16 experts (medians of\n"
          "alternating rounds), each against bf16 and against reading its own bytes.\n");
      return 0;
    } else {
      std::fprintf(stderr, "unknown argument %s (--help)\n", a.c_str());
      return 2;
    }
  }
  if (E < 1 || H < 32 || I < 32 || H % 32 != 0 || I % 32 != 0 || threads < 1 || rounds < 1) {
    std::fprintf(stderr, "sizes must be positive multiples of 32, threads and rounds >= 1\n");
    return 2;
  }
  at::set_num_threads(threads);
  at::manual_seed(1);
  struct Format {
    const char* name;
    QuantizedWeight w13, w2;
    at::Tensor d13, d2;  // bf16
    int64_t bytes = 0;
    std::vector<std::vector<double>> times;
  };
  std::vector<Format> fs(3);
  fs[0].name = "bf16";
  fs[0].d13 = (at::randn({E, 2 * I, H}) * 0.02).to(at::kBFloat16);
  fs[0].d2 = (at::randn({E, H, I}) * 0.02).to(at::kBFloat16);
  fs[0].bytes = fs[0].d13.nbytes() + fs[0].d2.nbytes();
  fs[1].name = "fp8";
  fs[2].name = "mxfp4";
  for (int f = 1; f < 3; ++f) {
    const QuantFormat q = f == 1 ? QuantFormat::kFp8Block : QuantFormat::kMxfp4;
    fs[f].w13 = Random(q, E, 2 * I, H);
    fs[f].w2 = Random(q, E, H, I);
    fs[f].bytes = fs[f].w13.nbytes() + fs[f].w2.nbytes();
  }
  // The plain read rate over a buffer the size of the bf16 experts.
  const at::Tensor probe = at::ones({fs[0].bytes / 8}, at::kLong);
  const double gbs = moelora::PlainReadGBs(
      reinterpret_cast<const uint64_t*>(probe.data_ptr<int64_t>()), probe.numel(), threads, 5);
  std::vector<int64_t> rows;
  for (absl::string_view r : absl::StrSplit(rows_s, ','))
    rows.push_back(std::atol(std::string(r).c_str()));
  std::printf(
      "experts %ld, H %ld, I %ld, %d threads, plain read %.1f GB/s; MXFP4 %s dequantization\n",
      static_cast<long>(E), static_cast<long>(H), static_cast<long>(I), threads, gbs,
      moelora::QuantVectorized() ? "AVX2" : "portable");
  std::printf(
      "| rows/expert | format | ms | vs bf16 | vs reading its bytes |\n|---|---|---|---|---|\n");
  for (int64_t m : rows) {
    const at::Tensor x = (at::randn({E * m, H}) * 0.5).to(at::kBFloat16);
    std::vector<std::pair<int64_t, int64_t>> runs;
    std::vector<int64_t> expert;
    for (int64_t e = 0; e < E; ++e) {
      runs.push_back({e * m, (e + 1) * m});
      expert.push_back(e);
    }
    at::Tensor h13 = at::empty({E * m, 2 * I}, x.options());
    at::Tensor act = at::empty({E * m, I}, x.options());
    at::Tensor y = at::empty({E * m, H}, x.options());
    act.normal_(0, 0.5);
    for (auto& f : fs) f.times.assign(1, {});
    for (int r = 0; r < rounds + 1; ++r) {  // the first round warms up
      for (auto& f : fs) {
        const double t0 = Now();
        if (f.d13.defined()) {
          moelora::GroupedMatmulWt(x, f.d13, runs, expert, h13);
          moelora::GroupedMatmulWt(act, f.d2, runs, expert, y);
        } else {
          moelora::GroupedQuantizedMatmulWt(x, f.w13, runs, expert, h13);
          moelora::GroupedQuantizedMatmulWt(act, f.w2, runs, expert, y);
        }
        if (r > 0) f.times[0].push_back(Now() - t0);
      }
    }
    const double base = Median(fs[0].times[0]);
    for (const auto& f : fs) {
      const double t = Median(f.times[0]);
      const double read = static_cast<double>(f.bytes) / (gbs * 1e9);
      std::printf("| %ld | %s | %.2f | %.2fx | %.2fx |\n", static_cast<long>(m), f.name, t * 1e3,
                  t / base, t / read);
    }
  }
  return 0;
}
