#include "worker/layers/gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kernels/skinny_gemm.h"

namespace moelora {

namespace {

// Output columns per parallel task: 16 weight rows (64 KB of an f32 row of 1024) per task keeps
// the tasks many enough to balance and big enough to stream.
constexpr int64_t kBlock = 16;

bool Skinny(const at::Tensor& x, const at::Tensor& w) {
  return x.device().is_cpu() && x.dim() == 2 && w.is_contiguous() &&
         (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
         SkinnyGemmAvailable();
}

struct Job {
  SkinnyGemmArgs args;
  int64_t first_block = 0;
};

void RunJobs(const std::vector<Job>& jobs, int64_t blocks) {
  // Dynamic scheduling (OpenMP directly, not at::parallel_for's static halves): a block's cost
  // follows its expert's rows, which differ from expert to expert. (Against a static split the
  // difference was within this machine's run-to-run noise.)
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), blocks));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) {
    // The job holding block b: the last one that starts at or before it.
    const auto it = std::upper_bound(jobs.begin(), jobs.end(), b,
                                     [](int64_t v, const Job& j) { return v < j.first_block; });
    const Job& job = *(it - 1);
    const int64_t n0 = (b - job.first_block) * kBlock;
    SkinnyGemmRows(job.args, n0, std::min(job.args.n, n0 + kBlock));
  }
}

// x in f32 with a row stride of k + 16 floats, so that x rows k·4 bytes apart (4 KB for k = 1024)
// do not all map to the same L1 set as the weight rows. Measured: no clear change on this
// machine (bench/skinny_gemm, within its noise); kept because x is copied anyway (to f32 for
// bf16) and the copy is small next to the weights.
at::Tensor PaddedF32(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor p = at::empty({m, k + 16}, x.options().dtype(at::kFloat));
  at::Tensor v = p.narrow(1, 0, k);
  v.copy_(x);
  return v;
}

// x: the rows xf was made from; bf16 x with unit column stride lets the kernel multiply in bf16.
SkinnyGemmArgs Args(const at::Tensor& xf, const at::Tensor& x, const at::Tensor& w, float* y,
                    int64_t ldy) {
  SkinnyGemmArgs a;
  a.x = xf.data_ptr<float>();
  a.ldx = xf.stride(0);
  a.w = w.data_ptr();
  a.w_type = w.scalar_type() == at::kFloat ? SkinnyWeight::kF32 : SkinnyWeight::kBF16;
  a.y = y;
  a.ldy = ldy;
  a.m = xf.size(0);
  a.n = w.size(0);
  a.k = w.size(1);
  if (x.scalar_type() == at::kBFloat16 && x.stride(1) == 1) {
    a.x_bf16_rows = static_cast<const uint16_t*>(x.data_ptr());
    a.ldx_bf16 = x.stride(0);
  }
  return a;
}

}  // namespace

static at::Tensor Bf16AsF32Matmul(const at::Tensor& a, const at::Tensor& b) {
  return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type());
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
  if (x_dtype != at::kBFloat16) return kSkinnyMaxRows;
  if (CpuBf16Gemm() == Bf16Gemm::kWidened) return kSkinnyMaxRowsBf16;
  return SkinnyGemmIsa() == SkinnyIsa::kAvx512Bf16 ? kSkinnyMaxRowsBf16Dp : 0;
}

static int64_t MaxRows(const at::Tensor& x) { return SkinnyMaxRows(x.scalar_type()); }

at::Tensor MatmulWt(const at::Tensor& x, const at::Tensor& w) {
  if (!Skinny(x, w) || x.size(0) > MaxRows(x) || x.size(0) == 0) return CpuMatmul(x, w.t());
  at::Tensor xf = PaddedF32(x);
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
  RunJobs({Job{Args(xf, x, w, y.data_ptr<float>(), y.stride(0)), 0}},
          (w.size(0) + kBlock - 1) / kBlock);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

void GroupedMatmulWt(const at::Tensor& x, const at::Tensor& weights,
                     const std::vector<std::pair<int64_t, int64_t>>& runs,
                     const std::vector<int64_t>& expert, at::Tensor& out) {
  const bool skinny = Skinny(x, weights[0]) && MaxRows(x) > 0;
  const bool f32 = x.scalar_type() == at::kFloat;
  at::Tensor xf = skinny ? PaddedF32(x) : x;
  // bf16: the kernel writes f32 rows into a scratch of out's shape, converted once at the end.
  at::Tensor yf = skinny && !f32 ? at::empty(out.sizes(), out.options().dtype(at::kFloat)) : out;
  std::vector<Job> jobs;
  int64_t blocks = 0;
  bool any_skinny = false;
  for (size_t r = 0; r < runs.size(); ++r) {
    auto [i, j] = runs[r];
    at::Tensor w = weights[expert[r]];
    if (!skinny || j - i > MaxRows(x)) {
      at::Tensor dst = out.narrow(0, i, j - i);
      if (SlowBf16(x)) {
        dst.copy_(Bf16AsF32Matmul(x.narrow(0, i, j - i), w.t()));
      } else {
        at::mm_out(dst, x.narrow(0, i, j - i), w.t());
      }
      continue;
    }
    Job job{Args(xf.narrow(0, i, j - i), x.narrow(0, i, j - i), w,
                 yf.data_ptr<float>() + i * yf.stride(0), yf.stride(0)),
            blocks};
    blocks += (job.args.n + kBlock - 1) / kBlock;
    jobs.push_back(job);
    any_skinny = true;
  }
  if (!any_skinny) return;
  RunJobs(jobs, blocks);
  if (!f32) {
    for (const Job& job : jobs) {
      const int64_t i = (job.args.y - yf.data_ptr<float>()) / yf.stride(0);
      out.narrow(0, i, job.args.m).copy_(yf.narrow(0, i, job.args.m));
    }
  }
}

}  // namespace moelora
