// The hand-written CPU forms of RmsNorm and Rotary::Apply against the ATen expressions they
// replace (written out here), on f32 and bf16, every norm kind, full and partial rotary.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "worker/layers/attention.h"
#include "worker/layers/lora_batch.h"
#include "worker/layers/moe.h"
#include "worker/layers/norm.h"
#include "worker/layers/rotary.h"

namespace moelora {
namespace {

at::Tensor NormByAten(const at::Tensor& x, const at::Tensor& w, double eps, NormKind kind) {
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  if (kind == NormKind::kZeroCentred) return (xf * (1.0 + w.to(at::kFloat))).to(x.scalar_type());
  if (kind == NormKind::kPlainF32Weight) return (w.to(at::kFloat) * xf).to(x.scalar_type());
  return w * xf.to(x.scalar_type());
}

TEST(ElementwiseTest, RmsNormMatchesItsAtenFormInEveryKind) {
  at::manual_seed(11);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (NormKind kind : {NormKind::kPlain, NormKind::kZeroCentred, NormKind::kPlainF32Weight}) {
      for (int64_t n : {int64_t{64}, int64_t{1024}, int64_t{37}}) {
        at::Tensor x = (at::randn({5, 3, n}) * 3).to(dt);
        at::Tensor w = (at::randn({n}) * 0.5 + 1).to(dt);
        at::Tensor got = RmsNorm(x, w, 1e-6, kind), want = NormByAten(x, w, 1e-6, kind);
        ASSERT_EQ(got.scalar_type(), want.scalar_type());
        ASSERT_EQ(got.sizes(), want.sizes());
        // The sum of squares runs in another order: the scale may differ in its last f32 bit,
        // which can move a bf16 result by one unit in the last place.
        const double tol = dt == at::kFloat ? 1e-5 : 1.0 / 128;
        EXPECT_TRUE(at::allclose(got.to(at::kFloat), want.to(at::kFloat), tol, 1e-6))
            << "kind " << static_cast<int>(kind) << " n " << n << " max diff "
            << (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<float>();
        if (dt == at::kBFloat16) {
          // Nearly every element is bit-identical.
          const double same = got.eq(want).to(at::kFloat).mean().item<double>();
          EXPECT_GT(same, 0.99) << "kind " << static_cast<int>(kind);
        }
      }
    }
  }
}

// AddRmsNorm: the sum bit for bit ATen's add, the norm that of RmsNorm on that sum (bit for bit:
// the same row code). ResidualStream folds each queued output into the next norm.
TEST(ElementwiseTest, AddRmsNormIsTheAtenAddThenRmsNorm) {
  at::manual_seed(12);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (NormKind kind : {NormKind::kPlain, NormKind::kZeroCentred, NormKind::kPlainF32Weight}) {
      for (int64_t n : {int64_t{64}, int64_t{1024}, int64_t{37}}) {
        at::Tensor x = (at::randn({7, n}) * 3).to(dt), d = at::randn({7, n}).to(dt);
        at::Tensor w = (at::randn({n}) * 0.5 + 1).to(dt);
        const AddNormed got = AddRmsNorm(x, d, w, 1e-6, kind);
        const at::Tensor sum = x + d;
        EXPECT_TRUE(at::equal(got.sum, sum)) << "kind " << static_cast<int>(kind) << " n " << n;
        EXPECT_TRUE(at::equal(got.normed, RmsNorm(sum, w, 1e-6, kind)))
            << "kind " << static_cast<int>(kind) << " n " << n;
        EXPECT_TRUE(at::allclose(got.normed.to(at::kFloat),
                                 NormByAten(sum, w, 1e-6, kind).to(at::kFloat),
                                 dt == at::kFloat ? 1e-5 : 1.0 / 128, 1e-6));
      }
    }
    // A strided delta takes the ATen add.
    at::Tensor x = at::randn({4, 64}).to(dt), d = at::randn({4, 96}).to(dt).narrow(1, 0, 64);
    at::Tensor w = at::randn({64}).to(dt);
    const AddNormed got = AddRmsNorm(x, d, w, 1e-6);
    EXPECT_TRUE(at::equal(got.sum, x + d));
    EXPECT_TRUE(at::equal(got.normed, RmsNorm(x + d, w, 1e-6)));
  }
}

TEST(ElementwiseTest, ResidualStreamAddsEachOutputBeforeTheNextNorm) {
  at::manual_seed(13);
  at::Tensor x0 = at::randn({3, 64}), a = at::randn({3, 64}), f = at::randn({3, 64});
  at::Tensor w1 = at::randn({64}), w2 = at::randn({64});
  ResidualStream s(x0);
  EXPECT_TRUE(at::equal(s.Norm(w1, 1e-6, NormKind::kPlain), RmsNorm(x0, w1, 1e-6)));
  s.Add(a);
  EXPECT_TRUE(at::equal(s.Norm(w2, 1e-6, NormKind::kPlain), RmsNorm(x0 + a, w2, 1e-6)));
  s.Add(f);
  EXPECT_TRUE(at::equal(s.Sum(), x0 + a + f));
  EXPECT_TRUE(at::equal(s.Sum(), x0 + a + f));  // read twice: added once
  s.Add(a);
  s.Add(f);  // two queued: both added
  EXPECT_TRUE(at::equal(s.Sum(), x0 + a + f + a + f));
}

TEST(ElementwiseTest, RmsNormOfAStridedInputTakesTheAtenForm) {
  at::Tensor x = at::randn({4, 96}).narrow(1, 0, 64);
  at::Tensor w = at::randn({64});
  EXPECT_TRUE(at::equal(RmsNorm(x, w, 1e-5), NormByAten(x, w, 1e-5, NormKind::kPlain)));
}

TEST(ElementwiseTest, RotaryApplyIsBitIdenticalToItsAtenForm) {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (int64_t rd : {int64_t{64}, int64_t{32}}) {  // full and partial rotary, head_dim 64
      RopeSpec spec;
      spec.head_dim = 64;
      spec.partial_rotary_factor = static_cast<double>(rd) / 64;
      Rotary rope(spec, at::kCPU);
      ASSERT_EQ(rope.rotary_dim(), rd);
      const std::vector<int64_t> pos = {0, 1, 7, 300, 4095};
      const Rotary::Table t = rope.Compute(pos, dt);
      at::Tensor x = at::randn({5, 3, 64}).to(dt);
      // The ATen form: x·c + rotate_half(x)·s on the first rd dims, the rest passed through.
      at::Tensor c = t.cos.unsqueeze(1), s = t.sin.unsqueeze(1);
      at::Tensor rot = x.narrow(-1, 0, rd);
      at::Tensor half = at::cat({-rot.narrow(-1, rd / 2, rd / 2), rot.narrow(-1, 0, rd / 2)}, -1);
      at::Tensor want = at::cat({rot * c + half * s, x.narrow(-1, rd, 64 - rd)}, -1);
      at::Tensor got = rope.Apply(x, t);
      EXPECT_TRUE(at::equal(got, want))
          << "rd " << rd << (dt == at::kFloat ? " f32" : " bf16") << " max diff "
          << (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<float>();
    }
  }
}

// q/k norm and rotary in one pass: the same bits as RmsNorm then Rotary::Apply on each (by hand),
// on f32 and bf16, every norm kind, full and partial rotary; q as a view whose heads are 2 d
// apart (Qwen3.5's [q ; gate] heads) against the ops on its contiguous copy. Where a norm is
// missing it does nothing and says so.
TEST(ElementwiseTest, NormRotaryQkIsRmsNormThenRotaryApply) {
  at::manual_seed(13);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (int64_t rd : {int64_t{64}, int64_t{16}}) {
      for (NormKind kind : {NormKind::kPlain, NormKind::kZeroCentred, NormKind::kPlainF32Weight}) {
        SCOPED_TRACE(::testing::Message() << (dt == at::kFloat ? "f32" : "bf16") << " rd " << rd
                                          << " kind " << static_cast<int>(kind));
        RopeSpec spec;
        spec.head_dim = 64;
        spec.partial_rotary_factor = static_cast<double>(rd) / 64;
        Rotary rope(spec, at::kCPU);
        const std::vector<int64_t> pos = {0, 3, 9, 1000, 4000, 17};
        const Rotary::Table t = rope.Compute(pos, dt);
        const int64_t T = 6, hq = 5, hkv = 2, d = 64;
        at::Tensor qg = (at::randn({T, hq, 2 * d}) * 3).to(dt);
        at::Tensor q = qg.narrow(2, 0, d);  // heads 2 d apart
        at::Tensor k = at::randn({T, hkv, d}).to(dt);
        at::Tensor qw = (at::rand({d}) + 0.5).to(dt), kw = (at::rand({d}) + 0.5).to(dt);
        const at::Tensor want_q = rope.Apply(RmsNorm(q.contiguous(), qw, 1e-6, kind), t);
        const at::Tensor want_k = rope.Apply(RmsNorm(k, kw, 1e-6, kind), t);
        at::Tensor gq = q, gk = k;
        ASSERT_TRUE(NormRotaryQk(gq, gk, qw, kw, 1e-6, kind, rope, t));
        EXPECT_TRUE(gq.is_contiguous() && gk.is_contiguous());
        EXPECT_TRUE(at::equal(gq, want_q))
            << "q max diff "
            << (gq.to(at::kFloat) - want_q.to(at::kFloat)).abs().max().item<float>();
        EXPECT_TRUE(at::equal(gk, want_k))
            << "k max diff "
            << (gk.to(at::kFloat) - want_k.to(at::kFloat)).abs().max().item<float>();
        at::Tensor uq = q, uk = k;
        EXPECT_FALSE(NormRotaryQk(uq, uk, qw, at::Tensor(), 1e-6, kind, rope, t));
        EXPECT_TRUE(uq.is_same(q) && uk.is_same(k)) << "a refused call changed q or k";
        at::Tensor flat = k.reshape({T, hkv * d});  // not [T, heads, d]: refused, no throw
        EXPECT_FALSE(NormRotaryQk(flat, uk, qw, kw, 1e-6, kind, rope, t));
      }
    }
  }
}

// CPU-path LoRA slots of `dt` for a MoeExperts under test.
SlotShape CpuSlots(int slots, int rank, at::ScalarType dt) {
  SlotShape shape;
  shape.num_slots = slots;
  shape.max_rank = rank;
  shape.slot_options = at::TensorOptions().dtype(dt);
  shape.rank_options = at::TensorOptions().dtype(at::kInt);
  return shape;
}

// Random routing [T, 2] over E experts, two distinct experts per token.
at::Tensor TwoDistinctExperts(int64_t T, int64_t E) {
  at::Tensor ids = at::randint(0, E, {T, 2}, at::kLong);
  ids.select(1, 1).copy_((ids.select(1, 0) + 1 + at::randint(0, E - 1, {T}, at::kLong)) % E);
  return ids;
}

// Σ_k w · down(silu(gate) · up) per token and choice in double, as ATen ops; with `slots`, a
// token of slot ≥ 0 adds B·(A·x) to gate, up and down (A[e][p] [r, in], B[e][p] [out, r], p =
// gate, up, down, scaling folded into B).
at::Tensor ExpertsByAten(const at::Tensor& h, const at::Tensor& ids, const at::Tensor& wts,
                         const at::Tensor& w13, const at::Tensor& w2,
                         const std::vector<int32_t>* slots = nullptr,
                         const std::vector<std::array<at::Tensor, 3>>* A = nullptr,
                         const std::vector<std::array<at::Tensor, 3>>* B = nullptr) {
  const int64_t T = h.size(0), H = h.size(1), I = w2.size(2);
  auto lora = [&](int64_t t, int64_t e, int p, const at::Tensor& v) {
    if (slots == nullptr || (*slots)[t] < 0) return at::zeros({(*B)[e][p].size(0)}, at::kDouble);
    return at::matmul((*B)[e][p], at::matmul((*A)[e][p], v));
  };
  at::Tensor want = at::zeros({T, H}, at::kDouble);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < ids.size(1); ++k) {
      const int64_t e = ids[t][k].item<int64_t>();
      const at::Tensor x = h[t].to(at::kDouble);
      at::Tensor g = at::matmul(w13[e].narrow(0, 0, I).to(at::kDouble), x);
      at::Tensor u = at::matmul(w13[e].narrow(0, I, I).to(at::kDouble), x);
      if (slots != nullptr) g = g + lora(t, e, 0, x), u = u + lora(t, e, 1, x);
      const at::Tensor a = at::silu(g) * u;
      at::Tensor y = at::matmul(w2[e].to(at::kDouble), a);
      if (slots != nullptr) y = y + lora(t, e, 2, a);
      want[t] += wts[t][k].to(at::kDouble) * y;
    }
  }
  return want;
}

// The routed experts' CPU path (the grouped GEMMs, the SwiGLU pass and the combine by hand)
// against the same block written as ATen ops per token and choice: Σ_k w · down(silu(g) · u).
// Shapes the AMX tiles fit, so bf16 takes AMX where the CPU has it.
TEST(ElementwiseTest, MoeExpertsMatchAPerTokenAtenForm) {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    at::manual_seed(21);
    const int64_t E = 4, H = 64, I = 32, T = 9, K = 2;
    at::Tensor w13 = (at::randn({E, 2 * I, H}) * 0.1).to(dt);
    at::Tensor w2 = (at::randn({E, H, I}) * 0.1).to(dt);
    MoeExperts experts("model.layers.0.mlp.experts", w13, w2, I, AdapterFormat::k2D, "test",
                       CpuSlots(1, 4, dt));
    at::Tensor h = at::randn({T, H}).to(dt);
    at::Tensor ids = TwoDistinctExperts(T, E);
    at::Tensor wts = at::rand({T, K}).to(dt);
    const std::vector<int32_t> slots(T, -1);
    LoraBatch lb;
    lb.slots = &slots;
    auto got = experts.Forward(h, ids, wts, lb);
    ASSERT_TRUE(got.ok()) << got.status();
    const at::Tensor want = ExpertsByAten(h, ids, wts, w13, w2);
    const double tol = dt == at::kFloat ? 1e-5 : 3e-2;
    EXPECT_TRUE(at::allclose(got->to(at::kDouble), want, tol, tol))
        << (dt == at::kFloat ? "f32" : "bf16") << " max diff "
        << (got->to(at::kDouble) - want).abs().max().item<double>();
  }
}

HostTensor HostFromAten(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kFloat).contiguous();
  HostTensor h;
  h.dtype = DType::kF32;
  h.shape = c.sizes().vec();
  h.storage = std::make_shared<HostBuffer>(c.nbytes());
  std::memcpy(h.storage->bytes.get(), c.data_ptr(), c.nbytes());
  return h;
}

// Expert LoRA on the CPU path in the 2D wrapper, where gate and up share lora_A in three experts
// of four (as a 3D adapter converted to 2D does): those run one shrink for both (SharedGateUpA
// counts them), the fourth two; the block matches the per-token ATen form with LoRA, rows of no
// slot get none. The sharing follows the slot through the host cache's save, reset and restore
// (into another slot), which gives the same bits.
TEST(ElementwiseTest, ExpertLoraWithSharedGateUpAMatchesAPerTokenAtenForm) {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(dt == at::kFloat ? "f32" : "bf16");
    at::manual_seed(23);
    const int64_t E = 4, H = 64, I = 32, T = 11, K = 2, r = 4;
    const double scaling = 0.5;
    at::Tensor w13 = (at::randn({E, 2 * I, H}) * 0.1).to(dt);
    at::Tensor w2 = (at::randn({E, H, I}) * 0.1).to(dt);
    MoeExperts experts("model.layers.0.mlp.experts", w13, w2, I, AdapterFormat::k2D, "test",
                       CpuSlots(2, 8, dt));
    MoeLayerLora ml;
    ml.prefix = "model.layers.0.mlp.experts";
    ml.format = AdapterFormat::k2D;
    ml.num_experts = static_cast<int>(E);
    ml.experts.resize(E);
    // [e][proj]: A [r, in], B [out, r] (f32, rounded to the slot dtype as the slot does).
    std::vector<std::array<at::Tensor, 3>> A(E), B(E);
    for (int64_t e = 0; e < E; ++e) {
      A[e][0] = at::randn({r, H}) * 0.3;
      A[e][1] = e == 3 ? at::randn({r, H}) * 0.3 : A[e][0];
      A[e][2] = at::randn({r, I}) * 0.3;
      B[e][0] = at::randn({I, r}) * 0.3;
      B[e][1] = at::randn({I, r}) * 0.3;
      B[e][2] = at::randn({H, r}) * 0.3;
      for (int k = 0; k < 3; ++k) {
        LoraPair p;
        p.a = HostFromAten(A[e][k]);
        p.b = HostFromAten(B[e][k]);
        p.rank = static_cast<int>(r);
        p.scaling = scaling;
        ml.experts[e][k] = p;
        A[e][k] = A[e][k].to(dt).to(at::kDouble);
        B[e][k] = (B[e][k] * scaling).to(dt).to(at::kDouble);
      }
    }
    auto write_to = [](int slot) {
      SlotWrite w;
      w.slot = slot;
      w.dst = [slot](at::Tensor& full) { return full[slot]; };
      return w;
    };
    experts.WriteExperts(ml, write_to(0));
    EXPECT_EQ(experts.SharedGateUpA(0), 3);
    EXPECT_EQ(experts.SharedGateUpA(1), 0);
    at::Tensor h = at::randn({T, H}).to(dt);
    at::Tensor ids = TwoDistinctExperts(T, E);
    ids[0][0] = 3;  // the expert that does not share, with a slot (token 0 has slot 0)
    if (ids[0][1].item<int64_t>() == 3) ids[0][1] = 0;
    at::Tensor wts = at::rand({T, K}).to(dt);
    std::vector<int32_t> slots(T);
    for (int64_t t = 0; t < T; ++t) slots[t] = t % 3 == 2 ? -1 : 0;
    LoraBatch lb = LoraBatch::Make(ModelOptions{}, slots, at::kCPU);
    ASSERT_TRUE(lb.any);
    auto got = experts.Forward(h, ids, wts, lb);
    ASSERT_TRUE(got.ok()) << got.status();
    const at::Tensor want = ExpertsByAten(h, ids, wts, w13, w2, &slots, &A, &B);
    const double tol = dt == at::kFloat ? 1e-5 : 3e-2;
    EXPECT_TRUE(at::allclose(got->to(at::kDouble), want, tol, tol))
        << "max diff " << (got->to(at::kDouble) - want).abs().max().item<double>();
    // Through the host cache into slot 1.
    ModuleSlotImage image;
    ASSERT_TRUE(experts.SaveSlot(0, &image));
    experts.Reset(0);
    EXPECT_EQ(experts.SharedGateUpA(0), 0);
    experts.RestoreSlot(image, write_to(1));
    EXPECT_EQ(experts.SharedGateUpA(1), 3);
    for (auto& s : slots) s = s == 0 ? 1 : s;
    lb = LoraBatch::Make(ModelOptions{}, slots, at::kCPU);
    auto again = experts.Forward(h, ids, wts, lb);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(at::equal(*again, *got));
  }
}

// The CPU router against at::softmax(·, kFloat), at::topk, the division and the scaling: the same
// experts (no ties in random logits), weights within an ulp or two of f32.
TEST(ElementwiseTest, SoftmaxTopKMatchesItsAtenForm) {
  at::manual_seed(14);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (bool norm : {true, false}) {
      for (double scale : {1.0, 2.5}) {
        const int64_t T = 37, E = 48;
        const int k = 6;
        at::Tensor logits = (at::randn({T, E}) * 3).to(dt);
        at::Tensor wts, idx;
        SoftmaxTopKCpu(logits, k, norm, scale, wts, idx);
        ASSERT_EQ(wts.sizes(), (std::vector<int64_t>{T, k}));
        ASSERT_EQ(idx.scalar_type(), at::kLong);
        const at::Tensor probs = at::softmax(logits, 1, at::kFloat);
        auto [want_w, want_i] = at::topk(probs, k, -1);
        // bf16 logits tie often: then any of the tied experts is a right choice (ATen's order
        // among them is its sort's), so the choice is checked by the probabilities it picks.
        if (dt == at::kFloat) {
          EXPECT_TRUE(at::equal(idx, want_i)) << "norm " << norm;
        }
        EXPECT_TRUE(at::allclose(probs.gather(1, idx), want_w, 1e-6, 0));
        EXPECT_TRUE(at::equal(std::get<0>(at::sort(idx, 1)).diff(1, 1).gt(0).all(),
                              at::ones({}, at::kBool)))
            << "an expert chosen twice";
        if (norm) want_w = want_w / want_w.sum(-1, true);
        if (scale != 1.0) want_w = want_w * scale;
        EXPECT_TRUE(at::allclose(wts, want_w, 1e-6, 0))
            << "norm " << norm << " max diff " << (wts - want_w).abs().max().item<float>();
      }
    }
  }
  // Ties go to the lower expert id.
  at::Tensor flat = at::zeros({1, 8});
  at::Tensor wts, idx;
  SoftmaxTopKCpu(flat, 3, true, 1.0, wts, idx);
  EXPECT_EQ(idx[0][0].item<int64_t>(), 0);
  EXPECT_EQ(idx[0][2].item<int64_t>(), 2);
  EXPECT_NEAR(wts[0][0].item<float>(), 1.0f / 3, 1e-7);
  // NaN logits: still k distinct experts, the first k, as a scalar scan picks them.
  at::Tensor nan = at::full({2, 8}, std::numeric_limits<float>::quiet_NaN());
  nan[1][5] = 1.0f;  // a row where one is a number: softmax is NaN everywhere still
  SoftmaxTopKCpu(nan, 3, false, 1.0, wts, idx);
  for (int64_t t = 0; t < 2; ++t) {
    EXPECT_EQ(idx[t][0].item<int64_t>(), 0);
    EXPECT_EQ(idx[t][1].item<int64_t>(), 1);
    EXPECT_EQ(idx[t][2].item<int64_t>(), 2);
  }
}

}  // namespace
}  // namespace moelora
