// CUDA kernels against their CPU twins on random shapes: T = 1, rank 1, sizes that are not
// multiples of a warp (or of 16, which sends the base GEMM to its SIMT path), f32/f16/bf16,
// the 2D and 3D MoE wrappers, base tokens mixed in. Every test skips without a CUDA device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kernels/bgmv.h"
#include "kernels/device.h"
#include "kernels/moe_lora.h"
#include "kernels/paged_attention.h"
#include "kernels/quant_gemm.h"
#include "tests/testing/bf16.h"
#include "tests/testing/moe_problem.h"
#include "tests/testing/require_device.h"
#include "tests/testing/status_matchers.h"

namespace moelora {
namespace {

using ::moelora::testing::DTensor;
using ::moelora::testing::IsOk;
using ::moelora::testing::MoeDims;
using ::moelora::testing::MoeProblem;

#define SKIP_WITHOUT_DEVICE() \
  MOELORA_SKIP_UNLESS_DEVICE(CudaDeviceAvailable(), "no CUDA device: " << CudaDeviceSummary())

// Device copies of host buffers, kept alive with the test.
class DeviceArena {
 public:
  template <typename T>
  T* Put(const T* host, size_t count) {
    auto b = DeviceBuffer::Allocate(std::max<size_t>(count * sizeof(T), 1));
    EXPECT_THAT(b.status(), IsOk());
    if (count) {
      EXPECT_THAT(CopyToDevice(b->get(), host, count * sizeof(T)), IsOk());
    }
    bufs_.push_back(std::move(*b));
    return bufs_.back().as<T>();
  }
  template <typename T>
  T* Put(const std::vector<T>& v) {
    return Put(v.data(), v.size());
  }
  void* Put(const DTensor& t) { return Put(t.bytes.data(), t.bytes.size()); }
  void* Scratch(size_t bytes) {
    auto b = DeviceBuffer::Allocate(std::max<size_t>(bytes, 1));
    EXPECT_THAT(b.status(), IsOk());
    bufs_.push_back(std::move(*b));
    return bufs_.back().get();
  }

 private:
  std::vector<DeviceBuffer> bufs_;
};

double Tolerance(DType d) { return d == DType::kF32 ? 1e-5 : d == DType::kF16 ? 4e-3 : 2e-2; }

struct BgmvShape {
  int64_t t, in, out, r, s;
};

class BgmvGpu : public ::testing::TestWithParam<DType> {};

TEST_P(BgmvGpu, MatchesCpuTwin) {
  SKIP_WITHOUT_DEVICE();
  const DType d = GetParam();
  std::mt19937 rng(5);
  for (const BgmvShape& sh : {BgmvShape{1, 1, 1, 1, 1}, BgmvShape{1, 33, 17, 1, 2},
                              BgmvShape{7, 100, 45, 16, 3}, BgmvShape{64, 2048, 4096, 64, 8},
                              BgmvShape{257, 777, 301, 17, 5}, BgmvShape{31, 2048, 512, 33, 4}}) {
    SCOPED_TRACE(::testing::PrintToString(std::vector<int64_t>{sh.t, sh.in, sh.out, sh.r, sh.s}));
    DTensor x = testing::Random(d, sh.t * sh.in, rng);
    DTensor a = testing::Random(d, sh.s * sh.in * sh.r, rng, 1.0f / std::sqrt(float(sh.in)));
    DTensor b = testing::Random(d, sh.s * sh.r * sh.out, rng);
    DTensor out = testing::Random(d, sh.t * sh.out, rng);
    std::vector<int32_t> rank(sh.s), slot(sh.t);
    for (auto& v : rank) v = static_cast<int32_t>(rng() % (sh.r + 1));  // 0 = empty slot
    rank[0] = static_cast<int32_t>(sh.r);
    for (auto& v : slot) v = static_cast<int32_t>(rng() % (sh.s + 1)) - 1;
    slot[0] = 0;
    BgmvParams p;
    p.dtype = d;
    p.x_stride = sh.in;
    p.out_stride = sh.out;
    p.num_tokens = sh.t;
    p.in_dim = sh.in;
    p.out_dim = sh.out;
    p.max_rank = sh.r;
    p.num_slots = sh.s;
    DeviceArena dev;
    BgmvParams g = p;
    g.x = dev.Put(x);
    g.a_t = dev.Put(a);
    g.b_t = dev.Put(b);
    g.out = dev.Put(out);
    g.rank = dev.Put(rank);
    g.slot_of_token = dev.Put(slot);
    g.workspace = dev.Scratch(BgmvWorkspaceBytes(p));
    ASSERT_THAT(BgmvCuda(g, nullptr), IsOk());
    ASSERT_THAT(DeviceSynchronize(), IsOk());
    DTensor got = out;
    ASSERT_THAT(CopyToHost(got.bytes.data(), g.out, got.bytes.size()), IsOk());
    p.x = x.bytes.data();
    p.a_t = a.bytes.data();
    p.b_t = b.bytes.data();
    p.out = out.bytes.data();
    p.rank = rank.data();
    p.slot_of_token = slot.data();
    const DTensor before = out;
    ASSERT_THAT(BgmvCpu(p), IsOk());
    EXPECT_LT(testing::RelErr(got.floats(), out.floats()), Tolerance(d));
    // Base tokens and empty slots: bit-identical to what was there.
    const size_t row = sh.out * testing::DTypeBytes(d);
    for (int64_t t = 0; t < sh.t; ++t) {
      if (slot[t] < 0 || rank[slot[t]] == 0) {
        EXPECT_EQ(std::memcmp(got.bytes.data() + t * row, before.bytes.data() + t * row, row), 0)
            << "token " << t;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, BgmvGpu, ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

struct MoeCase {
  MoeDims d;
  int wrapper;  // 0 base, 2 = 2D, 3 = 3D
};

class MoeLoraGpu : public ::testing::TestWithParam<DType> {};

// Runs `p` on the device; returns the output bytes.
std::vector<uint8_t> RunOnDevice(MoeProblem& p, int wrapper) {
  DeviceArena dev;
  MoeLoraParams q = p.Params(wrapper);
  q.x = dev.Put(p.x);
  q.topk_ids = dev.Put(p.topk_ids);
  q.topk_weights = dev.Put(p.topk_weights);
  q.slot_of_token = wrapper ? dev.Put(p.slots) : nullptr;
  q.w13 = dev.Put(p.w13);
  q.w2 = dev.Put(p.w2);
  q.out = dev.Scratch(p.out.bytes.size());
  if (wrapper == 2) {
    q.gate_up[0] = {dev.Put(p.gate_a), dev.Put(p.gate_b), dev.Put(p.gate_rank), 0, p.d.i};
    q.gate_up[1] = {dev.Put(p.up_a), dev.Put(p.up_b), dev.Put(p.up_rank), p.d.i, p.d.i};
  } else if (wrapper == 3) {
    q.gate_up[0] = {dev.Put(p.w13_a), dev.Put(p.w13_b), dev.Put(p.w13_rank), 0, 2 * p.d.i};
  }
  if (wrapper) q.down = {dev.Put(p.down_a), dev.Put(p.down_b), dev.Put(p.down_rank), 0, p.d.h};
  q.workspace = dev.Scratch(MoeLoraWorkspaceBytes(q));
  EXPECT_THAT(MoeLoraCuda(q, nullptr), IsOk());
  EXPECT_THAT(DeviceSynchronize(), IsOk());
  std::vector<uint8_t> out(p.out.bytes.size());
  EXPECT_THAT(CopyToHost(out.data(), q.out, out.size()), IsOk());
  return out;
}

TEST_P(MoeLoraGpu, MatchesCpuTwin) {
  SKIP_WITHOUT_DEVICE();
  const DType d = GetParam();
  const std::vector<MoeCase> cases = {
      {{.t = 1, .h = 16, .i = 16, .e = 4, .k = 1, .s = 1, .r = 1}, 2},  // T=1, rank 1
      {{.t = 1, .h = 64, .i = 32, .e = 8, .k = 2, .s = 2, .r = 16}, 3},
      {{.t = 5, .h = 33, .i = 17, .e = 6, .k = 2, .s = 3, .r = 5}, 2},      // SIMT GEMM path
      {{.t = 37, .h = 128, .i = 48, .e = 16, .k = 4, .s = 4, .r = 16}, 2},  // WMMA path (f16/bf16)
      {{.t = 37, .h = 128, .i = 48, .e = 16, .k = 4, .s = 4, .r = 16}, 3},
      {{.t = 64, .h = 256, .i = 96, .e = 32, .k = 8, .s = 8, .r = 64}, 3},
      {{.t = 100, .h = 96, .i = 40, .e = 8, .k = 2, .s = 2, .r = 8}, 0},  // base fused MoE
  };
  for (const MoeCase& c : cases) {
    SCOPED_TRACE(::testing::PrintToString(
        std::vector<int64_t>{c.d.t, c.d.h, c.d.i, c.d.e, c.d.k, c.d.s, c.d.r, c.wrapper}));
    MoeProblem p = MoeProblem::Make(c.d, d, 21);
    const std::vector<uint8_t> got = RunOnDevice(p, c.wrapper);
    ASSERT_THAT(MoeLoraCpu(p.Params(c.wrapper)), IsOk());
    DTensor g = p.out;
    g.bytes = got;
    EXPECT_LT(testing::RelErr(g.floats(), p.out.floats()), Tolerance(d));
  }
}

// Step3.5's clamped SwiGLU on the device equals the CPU twin's, and the limit matters.
TEST_P(MoeLoraGpu, ClampedSwiGluMatchesCpuTwin) {
  SKIP_WITHOUT_DEVICE();
  const DType d = GetParam();
  MoeProblem p =
      MoeProblem::Make({.t = 37, .h = 128, .i = 48, .e = 16, .k = 4, .s = 4, .r = 16}, d, 23);
  const std::vector<uint8_t> plain = RunOnDevice(p, 2);
  p.swiglu_limit = 0.05f;
  const std::vector<uint8_t> got = RunOnDevice(p, 2);
  ASSERT_THAT(MoeLoraCpu(p.Params(2)), IsOk());
  DTensor g = p.out;
  g.bytes = got;
  EXPECT_LT(testing::RelErr(g.floats(), p.out.floats()), Tolerance(d));
  EXPECT_NE(got, plain);
}

TEST_P(MoeLoraGpu, BaseTokensBitIdenticalWithAdaptersLoaded) {
  SKIP_WITHOUT_DEVICE();
  const DType d = GetParam();
  MoeProblem p =
      MoeProblem::Make({.t = 48, .h = 128, .i = 64, .e = 16, .k = 4, .s = 4, .r = 16}, d, 22);
  const std::vector<uint8_t> base = RunOnDevice(p, 0);
  const std::vector<uint8_t> mixed = RunOnDevice(p, 2);
  const size_t row = p.d.h * testing::DTypeBytes(d);
  int checked = 0;
  for (int64_t t = 0; t < p.d.t; ++t) {
    if (p.slots[t] >= 0) continue;
    ++checked;
    EXPECT_EQ(std::memcmp(base.data() + t * row, mixed.data() + t * row, row), 0) << "token " << t;
  }
  EXPECT_GT(checked, 0);
  // Deterministic: the same call twice gives the same bits.
  EXPECT_EQ(mixed, RunOnDevice(p, 2));
}

// Qwen3-30B-A3B's MoE layer (E=128 top-8, H=2048, I=768) at rank 64 in bf16, both wrappers.
TEST(MoeLoraGpuShapes, RealModelShapeBf16) {
  SKIP_WITHOUT_DEVICE();
  const MoeDims d{.t = 4, .h = 2048, .i = 768, .e = 128, .k = 8, .s = 4, .r = 64};
  for (int wrapper : {2, 3}) {
    SCOPED_TRACE(wrapper);
    MoeProblem p = MoeProblem::Make(d, DType::kBF16, 31);
    const std::vector<uint8_t> got = RunOnDevice(p, wrapper);
    ASSERT_THAT(MoeLoraCpu(p.Params(wrapper)), IsOk());
    DTensor g = p.out;
    g.bytes = got;
    EXPECT_LT(testing::RelErr(g.floats(), p.out.floats()), Tolerance(DType::kBF16));
  }
}

// At the sort's limit E·(S + 1) = 10240 the kernel runs and matches; one slot more is refused.
TEST(MoeLoraGpuShapes, AtTheSortLimit) {
  SKIP_WITHOUT_DEVICE();
  const MoeDims d{.t = 64, .h = 64, .i = 32, .e = 128, .k = 8, .s = 79, .r = 16};
  ASSERT_EQ(d.e * (d.s + 1), kMoeLoraCudaMaxSortKeys);
  MoeProblem p = MoeProblem::Make(d, DType::kBF16, 32);
  const std::vector<uint8_t> got = RunOnDevice(p, 2);
  ASSERT_THAT(MoeLoraCpu(p.Params(2)), IsOk());
  DTensor g = p.out;
  g.bytes = got;
  EXPECT_LT(testing::RelErr(g.floats(), p.out.floats()), Tolerance(DType::kBF16));
  MoeLoraParams over = p.Params(2);
  over.num_slots = d.s + 1;
  over.workspace = &over;  // never dereferenced: refused before any launch
  EXPECT_THAT(MoeLoraCuda(over, nullptr),
              ::moelora::testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

INSTANTIATE_TEST_SUITE_P(DTypes, MoeLoraGpu,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// The paged attention kernel against its CPU twin: f32 and bf16 pools, GQA, a window and sinks,
// prompt rows and decode rows of two sequences, head dims 64 and 128.
TEST(PagedAttentionGpu, MatchesCpuTwin) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0, 1);
  for (bool bf16 : {false, true}) {
    for (int64_t d : {64, 128}) {
      for (int64_t window : {0, 100}) {
        SCOPED_TRACE(::testing::Message() << "bf16 " << bf16 << " d " << d << " window " << window);
        const int64_t hq = 8, hkv = 2, bs = 16, blocks = 80, max_blocks = 40;
        std::vector<float> kf(blocks * bs * hkv * d), vf(kf.size()), sinks(hq);
        for (auto& x : kf) x = dist(rng);
        for (auto& x : vf) x = dist(rng);
        for (auto& x : sinks) x = dist(rng);
        std::vector<uint16_t> kb(kf.size()), vb(vf.size());
        for (size_t i = 0; i < kf.size(); ++i) {
          kb[i] = testing::ToBf16(kf[i]);
          vb[i] = testing::ToBf16(vf[i]);
        }
        std::vector<int32_t> tables(2 * max_blocks);
        for (int64_t i = 0; i < 2 * max_blocks; ++i)
          tables[i] = static_cast<int32_t>((i * 37) % blocks);
        std::vector<int32_t> seq_of_row;
        std::vector<int64_t> pos_of_row;
        for (int64_t p = 300; p < 340; ++p) seq_of_row.push_back(0), pos_of_row.push_back(p);
        seq_of_row.push_back(1), pos_of_row.push_back(620);
        const int64_t rows = static_cast<int64_t>(seq_of_row.size());
        std::vector<float> q(rows * hq * d), want(q.size()), got(q.size());
        for (auto& x : q) x = dist(rng);
        PagedAttentionBatch b;
        b.q = q.data();
        b.out = want.data();
        b.k = bf16 ? static_cast<const void*>(kb.data()) : kf.data();
        b.v = bf16 ? static_cast<const void*>(vb.data()) : vf.data();
        b.kv_bf16 = bf16;
        b.rows = rows;
        b.hq = hq;
        b.hkv = hkv;
        b.d = d;
        b.block_size = bs;
        b.block_tables = tables.data();
        b.max_blocks = max_blocks;
        b.seq_of_row = seq_of_row.data();
        b.pos_of_row = pos_of_row.data();
        b.window = window;
        b.scale = 0.125f;
        b.sinks = sinks.data();
        ASSERT_THAT(PagedAttentionBatchCpu(b), IsOk());
        DeviceArena arena;
        PagedAttentionBatch g = b;
        g.q = arena.Put(q);
        float* dev_out = static_cast<float*>(arena.Scratch(q.size() * sizeof(float)));
        g.out = dev_out;
        g.k = bf16 ? static_cast<const void*>(arena.Put(kb)) : arena.Put(kf);
        g.v = bf16 ? static_cast<const void*>(arena.Put(vb)) : arena.Put(vf);
        g.block_tables = arena.Put(tables);
        g.seq_of_row = arena.Put(seq_of_row);
        g.pos_of_row = arena.Put(pos_of_row);
        g.sinks = arena.Put(sinks);
        ASSERT_THAT(PagedAttentionCuda(g, nullptr), IsOk());
        ASSERT_THAT(DeviceSynchronize(), IsOk());
        ASSERT_THAT(CopyToHost(got.data(), dev_out, got.size() * sizeof(float)), IsOk());
        double worst = 0;
        for (size_t i = 0; i < got.size(); ++i)
          worst = std::max(worst, double{std::fabs(got[i] - want[i])});
        EXPECT_LT(worst, 1e-4);
      }
    }
  }
}

// The quantized GEMM (MXFP4 and block FP8, one or several passes of 8 x rows, FP8 blocks that
// split rows and a row's tail) against its CPU twin.
TEST(QuantGemmGpu, MatchesCpuTwin) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937 rng(21);
  std::normal_distribution<float> dist(0, 1);
  for (bool mx : {true, false}) {
    for (int64_t m : {1, 5, 19}) {
      SCOPED_TRACE(::testing::Message() << (mx ? "mxfp4" : "fp8") << " m " << m);
      const int64_t n = 67, k = mx ? 2880 : 300, bn = 16, bk = 128;
      std::vector<uint8_t> data(n * (mx ? k / 2 : k)), e8m0(mx ? n * k / 32 : 0);
      for (auto& b : data) b = static_cast<uint8_t>(rng());
      if (!mx) {
        for (auto& b : data) b = (b & 0x7F) == 0x7F ? b ^ 1 : b;
      }
      for (auto& s : e8m0) s = static_cast<uint8_t>(118 + rng() % 8);
      std::vector<float> scales(mx ? 0 : ((n + bn - 1) / bn) * ((k + bk - 1) / bk));
      for (auto& s : scales) s = 1e-3f * (1.0f + static_cast<float>(rng() % 100) / 50.0f);
      std::vector<float> x(m * k), want(m * n), got(m * n);
      for (auto& v : x) v = dist(rng);
      QuantGemmArgs a;
      a.x = x.data();
      a.ldx = k;
      a.m = m;
      a.w.format = mx ? QuantFormat::kMxfp4 : QuantFormat::kFp8Block;
      a.w.data = data.data();
      a.w.row_bytes = mx ? k / 2 : k;
      a.w.n = n;
      a.w.k = k;
      a.w.e8m0 = mx ? e8m0.data() : nullptr;
      a.w.block_scales = mx ? nullptr : scales.data();
      a.w.scale_stride = mx ? k / 32 : (k + bk - 1) / bk;
      a.w.block_n = bn;
      a.w.block_k = bk;
      a.y = want.data();
      a.ldy = n;
      ASSERT_THAT(ValidateQuantGemm(a), IsOk());
      QuantGemmRows(a, 0, n);
      DeviceArena arena;
      QuantGemmArgs g = a;
      g.x = arena.Put(x);
      g.w.data = arena.Put(data);
      if (mx) {
        g.w.e8m0 = arena.Put(e8m0);
      } else {
        g.w.block_scales = arena.Put(scales);
      }
      float* dev_y = static_cast<float*>(arena.Scratch(got.size() * sizeof(float)));
      g.y = dev_y;
      ASSERT_THAT(QuantGemmCuda(g, nullptr), IsOk());
      ASSERT_THAT(DeviceSynchronize(), IsOk());
      ASSERT_THAT(CopyToHost(got.data(), dev_y, got.size() * sizeof(float)), IsOk());
      double worst = 0, mag = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        worst = std::max(worst, double{std::fabs(got[i] - want[i])});
        mag = std::max(mag, double{std::fabs(want[i])});
      }
      EXPECT_LT(worst, 1e-5 * mag + 1e-6);
    }
  }
}

TEST(PinnedUploaderGpu, CopiesEveryByte) {
  SKIP_WITHOUT_DEVICE();
  // A size that is not a multiple of the chunk, through a ring of 2 small buffers.
  std::vector<uint8_t> src(5 * 1000 * 1000 + 7);
  std::mt19937 rng(9);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  auto up = PinnedUploader::Create(1 << 20, 2);
  ASSERT_THAT(up.status(), IsOk());
  auto dst = DeviceBuffer::Allocate(src.size());
  ASSERT_THAT(dst.status(), IsOk());
  ASSERT_THAT((*up)->Copy(dst->get(), src.data(), src.size() / 2), IsOk());
  ASSERT_THAT((*up)->Copy(dst->as<uint8_t>() + src.size() / 2, src.data() + src.size() / 2,
                          src.size() - src.size() / 2),
              IsOk());
  ASSERT_THAT((*up)->Finish(), IsOk());
  std::vector<uint8_t> back(src.size());
  ASSERT_THAT(CopyToHost(back.data(), dst->get(), back.size()), IsOk());
  EXPECT_EQ(src, back);
}

}  // namespace
}  // namespace moelora
