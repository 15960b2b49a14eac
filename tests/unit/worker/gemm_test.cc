#include "worker/layers/gemm.h"

#include <gtest/gtest.h>

#include "kernels/amx_gemm.h"
#include "kernels/skinny_gemm.h"

namespace moelora {
namespace {

// The f32 product of the same (possibly bf16) operands, rounded to x's dtype at the end: what
// the skinny kernel computes, by ATen.
at::Tensor Reference(const at::Tensor& x, const at::Tensor& w) {
  return at::matmul(x.to(at::kDouble), w.to(at::kDouble).t()).to(x.scalar_type());
}

void ExpectClose(const at::Tensor& got, const at::Tensor& want, const char* what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  const double tol = got.scalar_type() == at::kFloat ? 1e-5 : 2e-2;
  EXPECT_TRUE(at::allclose(got.to(at::kFloat), want.to(at::kFloat), tol, tol))
      << what << ": max diff "
      << (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<float>();
}

// Every run's rows of `out` against the reference product with its expert.
void ExpectEachRun(const at::Tensor& x, const at::Tensor& weights,
                   const std::vector<std::pair<int64_t, int64_t>>& runs,
                   const std::vector<int64_t>& experts, const at::Tensor& out) {
  for (size_t r = 0; r < runs.size(); ++r) {
    auto [i, j] = runs[r];
    ExpectClose(out.narrow(0, i, j - i), Reference(x.narrow(0, i, j - i), weights[experts[r]]),
                "run");
  }
}

TEST(GemmTest, MatmulWtMatchesATenOnBothSidesOfTheCrossover) {
  if (!SkinnyGemmAvailable()) GTEST_SKIP() << "no AVX2 + FMA: MatmulWt is at::matmul";
  at::manual_seed(3);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    // Both sides of every crossover: f32, bf16 widened, bf16 native (AVX512-BF16 up to 2 rows,
    // or 24 without AMX).
    for (int64_t m :
         {int64_t{1}, kSkinnyMaxRowsBf16Dp, kSkinnyMaxRowsBf16Dp + 1, int64_t{5},
          kSkinnyMaxRowsBf16DpNoAmx, kSkinnyMaxRowsBf16DpNoAmx + 1, kSkinnyMaxRows,
          kSkinnyMaxRows + 1, kSkinnyMaxRowsAvx512, kSkinnyMaxRowsAvx512 + 1, kSkinnyMaxRowsBf16,
          kSkinnyMaxRowsBf16 + 1, kWideMinRows - 1, kWideMinRows, kWideMaxRows, kWideMaxRows + 1}) {
      at::Tensor x = at::randn({m, 72}).to(dt), w = at::randn({37, 72}).to(dt);
      ExpectClose(MatmulWt(x, w), Reference(x, w), dt == at::kFloat ? "f32" : "bf16");
    }
  }
}

// Shapes the AMX tiles fit (n % 16, k % 32): bf16 goes through AMX where the CPU has it, up to
// kAmxMaxRows rows, and through the other routes past it (and where it has none).
TEST(GemmTest, MatmulWtOnAmxShapesMatchesATenOnBothSidesOfItsCrossover) {
  at::manual_seed(5);
  for (int64_t m : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{16}, int64_t{17}, int64_t{33},
                    kAmxMaxRows, kAmxMaxRows + 1}) {
    at::Tensor x = at::randn({m, 96}).to(at::kBFloat16), w = at::randn({48, 96}).to(at::kBFloat16);
    ExpectClose(MatmulWt(x, w), Reference(x, w), "bf16");
    // A strided x (a column slice): AMX packs rows at any stride.
    at::Tensor xs = at::randn({m, 128}).to(at::kBFloat16).narrow(1, 16, 96);
    ExpectClose(MatmulWt(xs, w), Reference(xs, w), "bf16 strided x");
  }
}

TEST(GemmTest, GroupedMatmulWtOnAmxShapesWritesEachRunWithItsExpert) {
  at::manual_seed(6);
  at::Tensor weights = at::randn({4, 48, 64}).to(at::kBFloat16);
  // 1, 17 and kAmxMaxRows + 2 rows (the last past the crossover: at::mm_out), experts reused.
  const std::vector<std::pair<int64_t, int64_t>> runs = {
      {0, 1}, {1, 18}, {18, 20 + kAmxMaxRows}, {20 + kAmxMaxRows, 23 + kAmxMaxRows}};
  const std::vector<int64_t> experts = {2, 0, 3, 2};
  const int64_t rows = runs.back().second;
  at::Tensor x = at::randn({rows, 64}).to(at::kBFloat16);
  at::Tensor out = at::full({rows, 48}, 99.0, x.options());
  GroupedMatmulWt(x, weights, runs, experts, out);
  ExpectEachRun(x, weights, runs, experts, out);
}

TEST(GemmTest, GroupedMatmulWtWritesEachRunWithItsExpert) {
  at::manual_seed(4);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    at::Tensor weights = at::randn({5, 19, 40}).to(dt);
    // Runs of 1, 3, a long one (past the crossover: at::mm_out) and 2 rows, experts out of order.
    const std::vector<std::pair<int64_t, int64_t>> runs = {
        {0, 1},
        {1, 4},
        {4, 4 + kSkinnyMaxRowsBf16 + 3},
        {7 + kSkinnyMaxRowsBf16, 9 + kSkinnyMaxRowsBf16}};
    const std::vector<int64_t> experts = {3, 0, 4, 3};
    const int64_t rows = runs.back().second;  // the long run: BLAS (f32 BLAS for bf16)
    at::Tensor x = at::randn({rows, 40}).to(dt);
    at::Tensor out = at::full({rows, 19}, 99.0, x.options());
    GroupedMatmulWt(x, weights, runs, experts, out);
    ExpectEachRun(x, weights, runs, experts, out);
  }
}

// An expert-parallel rank holds a view of some experts (weights starting past element 0), and a
// decode step's runs are all short (every row from the kernel, converted back in one piece).
TEST(GemmTest, GroupedMatmulWtOnAViewOfSomeExpertsWithShortRuns) {
  at::manual_seed(7);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    at::Tensor all = at::randn({6, 33, 64}).to(dt);
    at::Tensor weights = all.narrow(0, 2, 3);
    const std::vector<std::pair<int64_t, int64_t>> runs = {{0, 2}, {2, 3}, {3, 5}, {5, 6}};
    const std::vector<int64_t> experts = {2, 0, 1, 2};
    at::Tensor x = at::randn({6, 64}).to(dt);
    at::Tensor out = at::full({6, 33}, 99.0, x.options());
    GroupedMatmulWt(x, weights, runs, experts, out);
    ExpectEachRun(x, weights, runs, experts, out);
  }
}

// f32 runs on every route in one call: the skinny kernel (under kWideMinRows rows), the wide
// kernel (up to kWideMaxRows; a weight of 37 rows: a tail of 5 after its 8-row tiles) and
// at::mm_out past it, on a view of some experts, each run's product next to the others'.
TEST(GemmTest, GroupedMatmulWtTakesEveryF32RouteInOneCall) {
  at::manual_seed(8);
  at::Tensor all = at::randn({6, 37, 72});
  at::Tensor weights = all.narrow(0, 1, 4);
  const std::vector<int64_t> sizes = {3, kWideMinRows, 40, kWideMaxRows + 1, 1, kWideMaxRows};
  const std::vector<int64_t> experts = {2, 0, 3, 1, 2, 3};
  std::vector<std::pair<int64_t, int64_t>> runs;
  int64_t rows = 0;
  for (int64_t s : sizes) {
    runs.emplace_back(rows, rows + s);
    rows += s;
  }
  at::Tensor x = at::randn({rows, 72});
  at::Tensor out = at::full({rows, 37}, 99.0, x.options());
  GroupedMatmulWt(x, weights, runs, experts, out);
  ExpectEachRun(x, weights, runs, experts, out);
}

// bf16 runs on every route in one call, on a shape the wide kernel's bf16 variant takes (k % 32;
// AMX would not: n % 16): the skinny kernel (up to kSkinnyMaxRowsBf16DpNoAmx rows), the wide
// kernel (kWideBf16MinRows..kWideBf16MaxRows; 37 weight rows: a tail of 5), and oneDNN (past
// it) where the CPU has AVX512-BF16 and no AMX; other routes elsewhere. Rows of the kernels
// that write bf16 straight into out stand next to rows the skinny kernel converts from f32.
TEST(GemmTest, GroupedMatmulWtTakesEveryBf16RouteInOneCall) {
  at::manual_seed(9);
  at::Tensor all = at::randn({6, 37, 64}).to(at::kBFloat16);
  at::Tensor weights = all.narrow(0, 1, 4);
  const std::vector<int64_t> sizes = {3, kWideBf16MinRows - 1, kWideBf16MinRows,     40,
                                      1, kWideBf16MaxRows,     kWideBf16MaxRows + 1, 2};
  const std::vector<int64_t> experts = {2, 0, 3, 1, 2, 3, 0, 1};
  std::vector<std::pair<int64_t, int64_t>> runs;
  int64_t rows = 0;
  for (int64_t s : sizes) {
    runs.emplace_back(rows, rows + s);
    rows += s;
  }
  at::Tensor x = at::randn({rows, 64}).to(at::kBFloat16);
  at::Tensor out = at::full({rows, 37}, 99.0, x.options());
  GroupedMatmulWt(x, weights, runs, experts, out);
  ExpectEachRun(x, weights, runs, experts, out);
  // The dense products on both sides of each bound.
  for (int64_t m : sizes) {
    at::Tensor xm = x.narrow(0, 0, m);
    ExpectClose(MatmulWt(xm, weights[1]), Reference(xm, weights[1]), "bf16 dense");
  }
}

// The skinny route's bf16 rows are the kernel's f32 sums over the whole weight, rounded to bf16
// (ATen's conversion), bit for bit: RunJobs runs each thread's blocks into a scratch of its own
// at an offset into the weight and rounds them there. 300 weight rows: several 32-row blocks
// and 128-row chunks at nonzero offsets, and a tail of rows taken one at a time.
TEST(GemmTest, SkinnyBf16RowsAreTheKernelsF32SumsRounded) {
  const int64_t max_rows = SkinnyMaxRows(at::kBFloat16);
  if (!SkinnyGemmAvailable() || max_rows < 5) GTEST_SKIP() << "bf16 rows do not take the kernel";
  at::manual_seed(12);
  const int64_t n = 300, k = 64;
  at::Tensor weights = at::randn({3, n, k}).to(at::kBFloat16);
  const std::vector<std::pair<int64_t, int64_t>> runs = {{0, 1}, {1, 3}, {3, 6}, {6, 6 + max_rows}};
  const std::vector<int64_t> experts = {2, 0, 1, 2};
  const int64_t rows = runs.back().second;
  at::Tensor x = at::randn({rows, k}).to(at::kBFloat16);
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor out = at::full({rows, n}, 99.0, x.options());
  GroupedMatmulWt(x, weights, runs, experts, out);
  // The kernel's own f32 sums of a run's rows against a whole weight, in one call.
  auto kernel_rows = [&](int64_t i, int64_t m, const at::Tensor& w) {
    at::Tensor y = at::empty({m, n});
    SkinnyGemmArgs a;
    a.x = xf.data_ptr<float>() + i * k;
    a.ldx = k;
    a.x_bf16_rows = static_cast<const uint16_t*>(x.data_ptr()) + i * k;
    a.ldx_bf16 = k;
    a.w = w.data_ptr();
    a.w_type = SkinnyWeight::kBF16;
    a.y = y.data_ptr<float>();
    a.ldy = n;
    a.m = m;
    a.n = n;
    a.k = k;
    SkinnyGemmRows(a, 0, n);
    return y.to(at::kBFloat16);
  };
  for (size_t r = 0; r < runs.size(); ++r) {
    auto [i, j] = runs[r];
    EXPECT_TRUE(at::equal(out.narrow(0, i, j - i), kernel_rows(i, j - i, weights[experts[r]])))
        << "run " << r;
  }
  // A dense product on the same route (MatmulWt: one weight, its x rows).
  EXPECT_TRUE(at::equal(MatmulWt(x.narrow(0, 0, 3), weights[1]), kernel_rows(0, 3, weights[1])));
}

// Several weights on one x (an attention layer's q, k and v): each product the same bits as
// MatmulWt on its own, on every route (skinny, wide and ATen in f32; AMX or the other bf16
// routes), with weights of different heights, one of them a row tail for the wide kernel.
TEST(GemmTest, MatmulWtEachEqualsMatmulWtOnEveryWeight) {
  at::manual_seed(9);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    const std::vector<at::Tensor> ws = {at::randn({64, 96}).to(dt), at::randn({16, 96}).to(dt),
                                        at::randn({48, 96}).to(dt)};
    for (int64_t m : {int64_t{1}, int64_t{3}, kWideMinRows, int64_t{40}, kWideMaxRows + 1}) {
      at::Tensor x = at::randn({m, 96}).to(dt);
      const std::vector<at::Tensor> ys = MatmulWtEach(x, ws);
      ASSERT_EQ(ys.size(), ws.size());
      for (size_t i = 0; i < ws.size(); ++i) {
        at::Tensor want = MatmulWt(x, ws[i]);
        ASSERT_EQ(ys[i].sizes(), want.sizes());
        EXPECT_TRUE(at::equal(ys[i], want)) << "rows " << m << ", weight " << i;
        ExpectClose(ys[i], Reference(x, ws[i]), "each");
      }
    }
  }
  // Edge shapes: no weights; a weight of no rows (an empty product on every route).
  at::Tensor x = at::randn({20, 96});
  EXPECT_TRUE(MatmulWtEach(x, {}).empty());
  for (int64_t m : {int64_t{3}, int64_t{20}}) {
    const std::vector<at::Tensor> ys = MatmulWtEach(x.narrow(0, 0, m), {at::randn({0, 96})});
    ASSERT_EQ(ys.size(), 1u);
    EXPECT_EQ(ys[0].sizes(), (std::vector<int64_t>{m, 0}));
  }
}

}  // namespace
}  // namespace moelora
