#include "worker/layers/gemm.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>

#include "kernels/amx_gemm.h"
#include "kernels/elementwise.h"
#include "kernels/skinny_gemm.h"
#include "kernels/wide_gemm.h"
#include "worker/layers/block_ranges.h"

namespace moelora {

namespace {

// Output columns per parallel task: 32 weight rows (128 KB of f32 rows of 1024) per task keeps
// the tasks many enough to balance and big enough to stream; with the tiles' prefetch of the
// next 4 rows, fewer task boundaries (where nothing was prefetched then) measured better than 16
// rows: decode step of bench/peer's model in f32, batch 32, 50 -> 46.6 ms (both changes).
constexpr int64_t kBlock = 32;
// Blocks per kernel call (RunJobs): 4 blocks of f32 rows of 1024 are 512 KB, about 30 us of a
// thread's stream, the most by which the threads' ends can differ.
constexpr int64_t kChunkBlocks = 4;
// Where every job runs on a wide kernel (a decode batch's dense products from 13 rows, a
// prefill's), one block a call: those products are compute-bound (a bf16 block at 32 rows is 28
// weight rows, about 4 us of a thread), so a thread that is done waited for the other's chunk of 4
// at the end of each call. perf of a bf16 step at batch 32 (decode_step --only peer) had the
// worker thread spinning in libgomp for 11 % of its samples, a fifth of them while the other ran
// the wide kernel. Steps alternating between 4 and 1 in one run, 4 over 1: bf16 1.002, 1.003,
// 1.002; f32 1.001, 1.011; prefill unchanged (122-125 ms both).
constexpr int64_t kWideChunkBlocks = 1;

bool Skinny(const at::Tensor& x, const at::Tensor& w) {
  return x.device().is_cpu() && x.dim() == 2 && w.is_contiguous() &&
         (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
         SkinnyGemmAvailable();
}

// bf16 x against a bf16 weight on AMX: the native bf16 route, a CPU with AMX, a weight shape the
// tiles fit (w [n, k] or experts [E, n, k]).
bool Amx(const at::Tensor& x, const at::Tensor& w) {
  return x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
         w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
         CpuBf16Gemm() == Bf16Gemm::kNative && AmxGemmAvailable() &&
         AmxGemmFits(w.size(-2), w.size(-1));
}

// f32 x against an f32 weight with kWideMinRows..kWideMaxRows rows on the wide kernel.
bool Wide(const at::Tensor& x, const at::Tensor& w) {
  return x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat &&
         w.scalar_type() == at::kFloat && w.is_contiguous() && x.stride(1) == 1 &&
         WideGemmAvailable();
}

bool WideRows(int64_t m) { return m >= kWideMinRows && m <= kWideMaxRows; }

// bf16 x against a bf16 weight on the wide kernel's vdpbf16ps variant: the native bf16 route on
// a CPU with AVX512-BF16 and no AMX, k a multiple of 32. Where the CPU has AMX, oneDNN runs on
// it and keeps the products our AMX kernel does not take (as for SkinnyMaxRows), whatever
// MOELORA_AMX says of our kernel.
bool WideBf16(const at::Tensor& x, const at::Tensor& w) {
  return x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
         w.scalar_type() == at::kBFloat16 && w.is_contiguous() && x.stride(1) == 1 &&
         CpuBf16Gemm() == Bf16Gemm::kNative && WideBf16GemmAvailable() && !AmxGemmSupported() &&
         WideBf16GemmFits(w.size(-1));
}

bool WideBf16Rows(int64_t m) { return m >= kWideBf16MinRows && m <= kWideBf16MaxRows; }

// One product of a grouped call: the skinny kernel's (f32 x rows), AMX's (packed bf16 x) or the
// wide kernel's (packed f32 x; packed bf16 x for kWideBf16).
enum class Kernel { kSkinny, kAmx, kWide, kWideBf16 };
struct Job {
  SkinnyGemmArgs args;
  // A skinny job with bf16 output rows (args.y unused): see SkinnyRowsBf16.
  uint16_t* y_bf16 = nullptr;
  int64_t ldy_bf16 = 0;
  AmxGemmArgs amx;
  WideGemmArgs wide;
  WideBf16GemmArgs wide_bf16;
  Kernel kernel = Kernel::kSkinny;
  int64_t first_block = 0;
};

// Output columns per AMX task: two 16-row weight tiles per step (64 KB of bf16 rows of 1024).
constexpr int64_t kAmxBlock = 32;

// The wide kernels' blocks: whole register tiles of weight rows, as near kBlock as they go.
int64_t BlockOf(const Job& j) {
  switch (j.kernel) {
    case Kernel::kAmx:
      return kAmxBlock;
    case Kernel::kWide:
      return kBlock / WideTileRows(j.wide.m) * WideTileRows(j.wide.m);
    case Kernel::kWideBf16:
      return kBlock / WideBf16TileRows(j.wide_bf16.m) * WideBf16TileRows(j.wide_bf16.m);
    case Kernel::kSkinny:
      break;
  }
  return kBlock;
}
int64_t BlocksOf(const Job& j) {
  const int64_t n = j.kernel == Kernel::kAmx        ? j.amx.n
                    : j.kernel == Kernel::kWide     ? j.wide.n
                    : j.kernel == Kernel::kWideBf16 ? j.wide_bf16.n
                                                    : j.args.n;
  return (n + BlockOf(j) - 1) / BlockOf(j);
}

// Elements of x's packed rows that a product of m rows on `kernel` reads (none for the skinny
// kernel, which reads x in place): f32 for kWide, bf16 pairs for kAmx and kWideBf16.
int64_t PackedElements(Kernel kernel, int64_t m, int64_t k) {
  switch (kernel) {
    case Kernel::kWide:
      return WidePackedXElements(m, k);
    case Kernel::kAmx:
    case Kernel::kWideBf16:
      return WidePackedXBf16Elements(m, k);
    case Kernel::kSkinny:
      break;
  }
  return 0;
}

// x rows packed for AMX or the wide kernel's bf16 variant (bf16 pairs, one layout) or the wide
// kernel (f32) before the products that read them.
struct Pack {
  const void* x;
  int64_t ldx, m, k;
  void* dst;
  bool wide = false;
};

// Columns [n0, n1) of a skinny job whose output rows are bf16 (job.y_bf16): the kernel writes its
// f32 sums into a scratch of this thread's (at most 24 rows x 128 columns, 12 KB: in L1), and
// they are rounded into y_bf16 right away (RoundToBf16: the bits of ATen's conversion). Before,
// the kernel wrote a [rows, n] f32 scratch for the whole call and a copy_ converted it after the
// parallel region: two more passes over memory the expert stream had evicted, 0.2 ms of a bf16
// decode step at batch 32 (timers, decode_step --only peer). The weight is offset to row n0 and
// the kernel asked for its rows [0, n1 - n0) of n - n0: its tiles, sums and prefetch are those
// of rows [n0, n1) of the whole weight.
void SkinnyRowsBf16(const Job& job, int64_t n0, int64_t n1) {
  thread_local std::vector<float> scratch;
  const SkinnyGemmArgs& a = job.args;
  const int64_t cols = n1 - n0;
  if (static_cast<int64_t>(scratch.size()) < a.m * cols) scratch.resize(a.m * cols);
  SkinnyGemmArgs s = a;
  const int64_t elem = a.w_type == SkinnyWeight::kF32 ? 4 : 2;
  s.w = static_cast<const char*>(a.w) + n0 * a.k * elem;
  s.n = a.n - n0;
  s.y = scratch.data();
  s.ldy = cols;
  SkinnyGemmRows(s, 0, cols);
  for (int64_t i = 0; i < a.m; ++i) {
    RoundToBf16(scratch.data() + i * cols, job.y_bf16 + i * job.ldy_bf16 + n0, cols);
  }
}

void RunJobs(const std::vector<Job>& jobs, int64_t blocks, const std::vector<Pack>& packs = {}) {
  // The blocks by range stealing (worker/layers/block_ranges.h): each thread streams its own
  // contiguous half of the weights (the jobs are in weight order, so the hardware prefetcher and
  // the kernels' prefetch past a chunk's last rows run on from one chunk into the next), a few
  // blocks per kernel call, and a thread that is done takes over the back half of what the other
  // has left. Before: static (3-5 % faster per decode step than dynamic, one block at a time),
  // then guided (2-4 % faster than static). But guided's first chunk is half the blocks: timers
  // per thread (decode_step --only peer, f32 batch 32, 4 runs of 20 steps) showed one thread
  // idle at the end of the expert products for 2.7-4.2 % of their time, most of it in a few calls
  // out of 160 where a thread fell 0.3-3 ms behind inside such a chunk (a vCPU descheduled, or a
  // share with more rows per expert). With range stealing, 0.07-0.14 %.
  // AMX's x packing runs first in the same parallel region.
  if (blocks == 0) return;  // no output columns (nothing reads the packed x)
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), blocks));
  // Both packed layouts are blocks of 16 rows, each 16·k elements long and depending on its own
  // rows only, so the threads split the packing by block: one dense product's x at a decode batch
  // of 32 is two blocks, which one thread packed while the other waited. decode_step --only peer,
  // two paired runs, case (a): bf16 batch 32 18.4, 17.9 -> 17.1, 17.3 ms; f32 within noise.
  std::vector<int64_t> pack_first(packs.size() + 1, 0);
  for (size_t p = 0; p < packs.size(); ++p) {
    pack_first[p + 1] = pack_first[p] + (packs[p].m + 15) / 16;
  }
  const int64_t pack_blocks = pack_first.back();
  // A chunk per kernel call: AMX configures its tiles once per call (an extra tile release and
  // configuration per block cost 25 ns, 2 % of bench/skinny_gemm's bf16 experts at 4 rows).
  const bool all_wide = std::all_of(jobs.begin(), jobs.end(), [](const Job& j) {
    return j.kernel == Kernel::kWide || j.kernel == Kernel::kWideBf16;
  });
  BlockRanges ranges(blocks, threads, all_wide ? kWideChunkBlocks : kChunkBlocks);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t u = 0; u < pack_blocks; ++u) {
      const size_t p = static_cast<size_t>(
          std::upper_bound(pack_first.begin(), pack_first.end(), u) - pack_first.begin() - 1);
      const Pack& q = packs[p];
      const int64_t r0 = (u - pack_first[p]) * 16, rows = std::min<int64_t>(16, q.m - r0);
      if (q.wide) {
        WidePackX(static_cast<const float*>(q.x) + r0 * q.ldx, q.ldx, rows, q.k,
                  static_cast<float*>(q.dst) + r0 * q.k);
      } else {
        WidePackXBf16(static_cast<const uint16_t*>(q.x) + r0 * q.ldx, q.ldx, rows, q.k,
                      static_cast<uint16_t*>(q.dst) + r0 * q.k);
      }
    }
    // A thread the runtime did not start leaves its share to be taken over by the others.
    const int me = std::min(omp_get_thread_num(), threads - 1);
    for (;;) {
      const auto [b0, b1] = ranges.Next(me);
      if (b0 >= b1) break;
      // The job holding block b0: the last one that starts at or before it; then the next ones.
      auto it = std::upper_bound(jobs.begin(), jobs.end(), b0,
                                 [](int64_t v, const Job& j) { return v < j.first_block; }) -
                1;
      for (int64_t b = b0; b < b1; ++it) {
        const Job& job = *it;
        const int64_t end = std::min(b1, job.first_block + BlocksOf(job));
        const int64_t n0 = (b - job.first_block) * BlockOf(job),
                      n1 = (end - job.first_block) * BlockOf(job);
        if (job.kernel == Kernel::kAmx) {
          AmxGemmRows(job.amx, n0, std::min(job.amx.n, n1));
        } else if (job.kernel == Kernel::kWide) {
          WideGemmRows(job.wide, n0, std::min(job.wide.n, n1));
        } else if (job.kernel == Kernel::kWideBf16) {
          WideBf16GemmRows(job.wide_bf16, n0, std::min(job.wide_bf16.n, n1));
        } else if (job.y_bf16 != nullptr) {
          SkinnyRowsBf16(job, n0, std::min(job.args.n, n1));
        } else {
          SkinnyGemmRows(job.args, n0, std::min(job.args.n, n1));
        }
        b = end;
      }
    }
  }
}

// Each product's last block prefetches the next product's first rows, where the next job runs on
// the same kernel (the jobs are in weight order; a thread's guided run of blocks continues into
// the next job). For the skinny kernel, where it also needs the same k and weight type; its last
// tile of a block prefetches the next block's rows as well (kernels/internal/skinny_tiles.inc):
// decode_step --only peer, f32, two paired runs against the commit before, case (a): batch 8
// 22.9, 22.5 -> 22.1, 21.7 ms; batch 32 37.3, 38.5 -> 36.3, 35.1 ms.
void ChainNext(std::vector<Job>& jobs) {
  for (size_t q = 0; q + 1 < jobs.size(); ++q) {
    if (jobs[q].kernel != jobs[q + 1].kernel) continue;
    if (jobs[q].kernel == Kernel::kAmx) {
      jobs[q].amx.next_w = jobs[q + 1].amx.w;
      jobs[q].amx.next_rows = jobs[q + 1].amx.n;
    } else if (jobs[q].kernel == Kernel::kWide) {
      jobs[q].wide.next_w = jobs[q + 1].wide.w;
    } else if (jobs[q].kernel == Kernel::kWideBf16) {
      if (jobs[q].wide_bf16.k == jobs[q + 1].wide_bf16.k) {
        jobs[q].wide_bf16.next_w = jobs[q + 1].wide_bf16.w;
      }
    } else if (jobs[q].args.k == jobs[q + 1].args.k &&
               jobs[q].args.w_type == jobs[q + 1].args.w_type) {
      jobs[q].args.next_w = jobs[q + 1].args.w;
      jobs[q].args.next_rows = jobs[q + 1].args.n;
    }
  }
}

// The f32 x rows the skinny kernel reads. An f32 x with unit column stride as it is; any other x
// copied to f32 with a row stride of k + 16 floats, so that x rows k·4 bytes apart (4 KB for k =
// 1024) do not all map to the same L1 set as the weight rows (measured: no clear change on this
// machine, bench/skinny_gemm within its noise; kept because that x is copied anyway). The f32 x
// used to be copied too: an ATen copy_ on the thread the others wait for, 1.1 % of an f32 decode
// step at batch 8 (perf); reading it in place, decode_step --only peer, f32, three paired runs:
// batch 32 35.2, 34.6, 35.2 -> 34.6, 34.6, 34.2 ms, its prefill 161, 160, 163 -> 156, 152, 155
// ms; batch 8 within noise.
//
// None (an undefined tensor) where the kernel multiplies in bf16 (SkinnyBf16X): it reads the bf16
// rows in place, and the f32 copy was written and never read, 0.25 ms of a bf16 decode step at
// batch 32 (timers, decode_step --only peer).
bool SkinnyBf16X(const at::Tensor& x, at::ScalarType w) {
  return x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && w == at::kBFloat16 &&
         SkinnyGemmIsa() == SkinnyIsa::kAvx512Bf16;
}

at::Tensor SkinnyXRows(const at::Tensor& x, at::ScalarType w) {
  if (x.scalar_type() == at::kFloat && x.stride(1) == 1) return x;
  if (SkinnyBf16X(x, w)) return at::Tensor();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor p = at::empty({m, k + 16}, x.options().dtype(at::kFloat));
  at::Tensor v = p.narrow(1, 0, k);
  v.copy_(x);
  return v;
}

// Rows [i, i + m) of xf (f32; undefined where the kernel multiplies in bf16) against w [n, k]
// (the weight of `wt`'s dtype at `w`), into f32 rows y (row stride ldy; none for a job with bf16
// output rows, Job::y_bf16); x: the rows xf was made from, whose bf16 rows with unit column
// stride let the kernel multiply in bf16. Pointers, not tensor views: a decode step builds a job
// per expert and product (about 170 at batch 8 in f32), and each narrow or select of a tensor costs
// microseconds of ATen dispatch on the thread that the other threads wait for.
SkinnyGemmArgs Args(const at::Tensor& xf, const at::Tensor& x, int64_t i, int64_t m, const void* w,
                    at::ScalarType wt, int64_t n, int64_t k, float* y, int64_t ldy) {
  SkinnyGemmArgs a;
  if (xf.defined()) {
    a.x = xf.data_ptr<float>() + i * xf.stride(0);
    a.ldx = xf.stride(0);
  }
  a.w = w;
  a.w_type = wt == at::kFloat ? SkinnyWeight::kF32 : SkinnyWeight::kBF16;
  a.y = y;
  a.ldy = ldy;
  a.m = m;
  a.n = n;
  a.k = k;
  if (x.scalar_type() == at::kBFloat16 && x.stride(1) == 1) {
    a.x_bf16_rows = static_cast<const uint16_t*>(x.data_ptr()) + i * x.stride(0);
    a.ldx_bf16 = x.stride(0);
  }
  return a;
}

}  // namespace

static at::Tensor Bf16AsF32Matmul(const at::Tensor& a, const at::Tensor& b) {
  return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type());
}

std::string BlasDescription(bool* slower_than_cpu) {
  *slower_than_cpu = false;
  using CoreName = char* (*)();
  auto corename = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (corename == nullptr) return "";
  const std::string core = corename();
  std::string d = "OpenBLAS " + core;
  if (const char* e = std::getenv("OPENBLAS_CORETYPE"); e != nullptr) {
    d += std::string(" (OPENBLAS_CORETYPE=") + e + ")";
    *slower_than_cpu = __builtin_cpu_supports("avx512f") && core != "SkylakeX" &&
                       core != "Cooperlake" && core != "SapphireRapids";
  }
  return d;
}

Bf16Gemm CpuBf16Gemm() {
  static const Bf16Gemm route = [] {
    const char* e = std::getenv("MOELORA_CPU_BF16_GEMM");
    if (e != nullptr && std::strcmp(e, "native") == 0) return Bf16Gemm::kNative;
    if (e != nullptr && std::strcmp(e, "widened") == 0) return Bf16Gemm::kWidened;
    return __builtin_cpu_supports("avx512bf16") ? Bf16Gemm::kNative : Bf16Gemm::kWidened;
  }();
  return route;
}

static bool SlowBf16(const at::Tensor& x) {
  return x.device().is_cpu() && x.scalar_type() == at::kBFloat16 &&
         CpuBf16Gemm() == Bf16Gemm::kWidened;
}

at::Tensor CpuMatmul(const at::Tensor& a, const at::Tensor& b) {
  return SlowBf16(a) ? Bf16AsF32Matmul(a, b) : at::matmul(a, b);
}

int64_t SkinnyMaxRows(at::ScalarType x_dtype) {
  if (x_dtype != at::kBFloat16) {
    const SkinnyIsa isa = SkinnyGemmIsa();
    return isa == SkinnyIsa::kAvx512 || isa == SkinnyIsa::kAvx512Bf16 ? kSkinnyMaxRowsAvx512
                                                                      : kSkinnyMaxRows;
  }
  if (CpuBf16Gemm() == Bf16Gemm::kWidened) return kSkinnyMaxRowsBf16;
  if (SkinnyGemmIsa() != SkinnyIsa::kAvx512Bf16) return 0;
  // Whether oneDNN has AMX: the CPU's, whatever MOELORA_AMX says of our own AMX kernel.
  return AmxGemmSupported() ? kSkinnyMaxRowsBf16Dp : kSkinnyMaxRowsBf16DpNoAmx;
}

static int64_t MaxRows(const at::Tensor& x) { return SkinnyMaxRows(x.scalar_type()); }

// The product of bf16 x rows [i, i + m) (packed into `packed` from element `at`, by `pack`, in
// column pairs) with the bf16 weight w [n, k] into bf16 rows y (row stride ldy): AmxGemmArgs for
// the AMX kernel, WideBf16GemmArgs for the wide kernel's bf16 variant (the same fields, and the
// same packed layout).
template <typename A>
static A PairsJob(const at::Tensor& x, int64_t i, int64_t m, const uint16_t* w, int64_t n,
                  int64_t k, at::Tensor& packed, int64_t at, at::BFloat16* y, int64_t ldy,
                  Pack* pack) {
  auto* p = static_cast<uint16_t*>(packed.data_ptr()) + at;
  *pack = Pack{
      static_cast<const uint16_t*>(x.data_ptr()) + i * x.stride(0), x.stride(0), m, k, p, false};
  A a;
  a.x_packed = p;
  a.w = w;
  a.y_bf16 = reinterpret_cast<uint16_t*>(y);
  a.ldy = ldy;
  a.m = m;
  a.n = n;
  a.k = k;
  return a;
}

// The wide kernel's product of f32 x rows [i, i + m) (packed into `packed` from element `at`, by
// `pack`) with the f32 weight w [n, k] into f32 rows y (row stride ldy).
static WideGemmArgs WideJob(const at::Tensor& x, int64_t i, int64_t m, const float* w, int64_t n,
                            int64_t k, at::Tensor& packed, int64_t at, float* y, int64_t ldy,
                            Pack* pack) {
  float* p = packed.data_ptr<float>() + at;
  *pack = Pack{x.data_ptr<float>() + i * x.stride(0), x.stride(0), m, k, p, true};
  WideGemmArgs a;
  a.x_packed = p;
  a.w = w;
  a.y = y;
  a.ldy = ldy;
  a.m = m;
  a.n = n;
  a.k = k;
  return a;
}

std::vector<at::Tensor> MatmulWtEach(const at::Tensor& x, const std::vector<at::Tensor>& ws) {
  if (ws.empty()) return {};
  const int64_t m = x.dim() == 2 ? x.size(0) : 0;
  auto all = [&](auto&& pred) { return std::all_of(ws.begin(), ws.end(), pred); };
  std::optional<Kernel> kernel;
  if (m > 0 && m <= kAmxMaxRows && all([&](const at::Tensor& w) { return Amx(x, w); })) {
    kernel = Kernel::kAmx;
  } else if (WideRows(m) && all([&](const at::Tensor& w) { return Wide(x, w); })) {
    kernel = Kernel::kWide;
  } else if (WideBf16Rows(m) && all([&](const at::Tensor& w) { return WideBf16(x, w); })) {
    kernel = Kernel::kWideBf16;
  } else if (m > 0 && m <= MaxRows(x) && all([&](const at::Tensor& w) { return Skinny(x, w); })) {
    kernel = Kernel::kSkinny;
  }
  std::vector<at::Tensor> ys;
  if (!kernel) {
    for (const at::Tensor& w : ws) ys.push_back(CpuMatmul(x, w.t()));
    return ys;
  }
  // One x for every product: packed once (AMX, wide) or copied to padded f32 rows once (skinny,
  // unless it multiplies in bf16).
  const int64_t k = x.size(1);
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor packed, xf;
  if (*kernel == Kernel::kSkinny) {
    const bool one_type =
        all([&](const at::Tensor& w) { return w.scalar_type() == ws[0].scalar_type(); });
    xf = SkinnyXRows(x, one_type ? ws[0].scalar_type() : at::kFloat);
  } else {
    packed = at::empty({PackedElements(*kernel, m, k)}, x.options());
  }
  std::vector<Pack> packs;  // AMX, wide: x packed once, for every product
  std::vector<Job> jobs;
  int64_t blocks = 0;
  for (const at::Tensor& w : ws) {
    const int64_t n = w.size(0);
    Job job;
    job.kernel = *kernel;
    job.first_block = blocks;
    Pack pack;  // the same for every product
    if (*kernel == Kernel::kAmx) {
      ys.push_back(at::empty({m, n}, x.options()));
      job.amx =
          PairsJob<AmxGemmArgs>(xc, 0, m, static_cast<const uint16_t*>(w.data_ptr()), n, k, packed,
                                0, ys.back().data_ptr<at::BFloat16>(), ys.back().stride(0), &pack);
    } else if (*kernel == Kernel::kWide) {
      ys.push_back(at::empty({m, n}, x.options()));
      job.wide = WideJob(xc, 0, m, w.data_ptr<float>(), n, k, packed, 0,
                         ys.back().data_ptr<float>(), ys.back().stride(0), &pack);
    } else if (*kernel == Kernel::kWideBf16) {
      ys.push_back(at::empty({m, n}, x.options()));
      job.wide_bf16 = PairsJob<WideBf16GemmArgs>(
          xc, 0, m, static_cast<const uint16_t*>(w.data_ptr()), n, k, packed, 0,
          ys.back().data_ptr<at::BFloat16>(), ys.back().stride(0), &pack);
    } else if (x.scalar_type() == at::kFloat) {
      ys.push_back(at::empty({m, n}, x.options()));
      job.args = Args(xf, x, 0, m, w.data_ptr(), w.scalar_type(), n, k, ys.back().data_ptr<float>(),
                      ys.back().stride(0));
    } else {
      ys.push_back(at::empty({m, n}, x.options()));
      job.args = Args(xf, x, 0, m, w.data_ptr(), w.scalar_type(), n, k, nullptr, 0);
      job.y_bf16 = reinterpret_cast<uint16_t*>(ys.back().data_ptr<at::BFloat16>());
      job.ldy_bf16 = ys.back().stride(0);
    }
    if (packs.empty() && *kernel != Kernel::kSkinny) packs.push_back(pack);
    blocks += BlocksOf(job);
    jobs.push_back(job);
  }
  ChainNext(jobs);
  RunJobs(jobs, blocks, packs);
  return ys;
}

at::Tensor MatmulWt(const at::Tensor& x, const at::Tensor& w) { return MatmulWtEach(x, {w})[0]; }

void GroupedMatmulWt(const at::Tensor& x, const at::Tensor& weights,
                     const std::vector<std::pair<int64_t, int64_t>>& runs,
                     const std::vector<int64_t>& expert, at::Tensor& out) {
  // The checks read only the weight's device, dtype and contiguity, so they take the [E, n, k]
  // tensor itself: weights[0] was an ATen select (a view) per check, on the thread the other
  // threads wait for.
  const bool amx = Amx(x, weights) && x.stride(1) == 1;
  const bool wide = !amx && Wide(x, weights);
  const bool wide_bf16 = WideBf16(x, weights);
  const bool skinny = !amx && Skinny(x, weights) && MaxRows(x) > 0;
  const bool f32 = x.scalar_type() == at::kFloat;
  // Which kernel takes a run of m rows; none: at::mm_out (long runs) or the widened bf16 route.
  auto kernel_of = [&](int64_t m) -> std::optional<Kernel> {
    if (amx && m <= kAmxMaxRows) return Kernel::kAmx;
    if (wide && WideRows(m)) return Kernel::kWide;
    if (wide_bf16 && WideBf16Rows(m)) return Kernel::kWideBf16;
    if (skinny && m <= MaxRows(x)) return Kernel::kSkinny;
    return std::nullopt;
  };
  // AMX and the wide kernel: every kernel run's x rows packed into one buffer.
  at::Tensor packed;
  std::vector<Pack> packs;
  int64_t elems = 0;
  bool any_skinny = false;
  for (auto [i, j] : runs) {
    const auto kernel = kernel_of(j - i);
    if (kernel) elems += PackedElements(*kernel, j - i, x.size(1));
    any_skinny = any_skinny || kernel == Kernel::kSkinny;
  }
  if (elems > 0) packed = at::empty({elems}, x.options());
  at::Tensor xf = any_skinny ? SkinnyXRows(x, weights.scalar_type()) : x;
  int64_t packed_at = 0;
  std::vector<size_t> long_runs;
  std::vector<Job> jobs;
  int64_t blocks = 0;
  // Each expert's weight by pointer arithmetic (see Args).
  const int64_t wn = weights.size(1), wk = weights.size(2);
  const auto* wbase = static_cast<const char*>(weights.data_ptr());
  const int64_t wbytes = weights.stride(0) * weights.element_size();
  for (size_t r = 0; r < runs.size(); ++r) {
    auto [i, j] = runs[r];
    const auto kernel = kernel_of(j - i);
    if (!kernel) {
      if (SlowBf16(x)) {
        out.narrow(0, i, j - i)
            .copy_(Bf16AsF32Matmul(x.narrow(0, i, j - i), weights[expert[r]].t()));
      } else {
        long_runs.push_back(r);  // below, the experts in parallel
      }
      continue;
    }
    const char* w = wbase + expert[r] * wbytes;
    Job job;
    job.first_block = blocks;
    job.kernel = *kernel;
    if (*kernel == Kernel::kAmx) {
      packs.emplace_back();
      job.amx = PairsJob<AmxGemmArgs>(
          x, i, j - i, reinterpret_cast<const uint16_t*>(w), wn, wk, packed, packed_at,
          out.data_ptr<at::BFloat16>() + i * out.stride(0), out.stride(0), &packs.back());
    } else if (*kernel == Kernel::kWide) {
      packs.emplace_back();
      job.wide = WideJob(x, i, j - i, reinterpret_cast<const float*>(w), wn, wk, packed, packed_at,
                         out.data_ptr<float>() + i * out.stride(0), out.stride(0), &packs.back());
    } else if (*kernel == Kernel::kWideBf16) {
      packs.emplace_back();
      job.wide_bf16 = PairsJob<WideBf16GemmArgs>(
          x, i, j - i, reinterpret_cast<const uint16_t*>(w), wn, wk, packed, packed_at,
          out.data_ptr<at::BFloat16>() + i * out.stride(0), out.stride(0), &packs.back());
    } else if (f32) {
      job.args = Args(xf, x, i, j - i, w, weights.scalar_type(), wn, wk,
                      out.data_ptr<float>() + i * out.stride(0), out.stride(0));
    } else {
      // bf16 rows straight into out (SkinnyRowsBf16).
      job.args = Args(xf, x, i, j - i, w, weights.scalar_type(), wn, wk, nullptr, 0);
      job.y_bf16 = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + i * out.stride(0);
      job.ldy_bf16 = out.stride(0);
    }
    packed_at += PackedElements(*kernel, j - i, x.size(1));
    blocks += BlocksOf(job);
    jobs.push_back(job);
  }
  if (!long_runs.empty()) {
    // Long runs (prefill): one expert per thread, each GEMM single-threaded inside the region
    // (OpenBLAS and oneDNN do not nest), rather than every expert split over all threads: f32
    // expert GEMMs of the bench/peer prefill at batch 32, 353 -> 306 ms (decode_step --only peer).
    // An exception must not leave an OpenMP region: the first one is rethrown after it.
    const int64_t nl = static_cast<int64_t>(long_runs.size());
    std::exception_ptr error;
    std::mutex error_mu;
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
    for (int64_t q = 0; q < nl; ++q) {
      try {
        auto [i, j] = runs[long_runs[q]];
        at::Tensor dst = out.narrow(0, i, j - i);
        at::mm_out(dst, x.narrow(0, i, j - i), weights[expert[long_runs[q]]].t());
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
  }
  if (jobs.empty()) return;
  ChainNext(jobs);
  RunJobs(jobs, blocks, packs);
}

}  // namespace moelora
