// A random fused-MoE-LoRA problem (host data) for kernel tests: base weights, routing, slots and
// LoRA slot tensors for both wrappers. Params() points a MoeLoraParams at the host buffers;
// tests that run on the GPU copy each buffer and repoint the same fields.
#ifndef MOELORA_TESTS_TESTING_MOE_PROBLEM_H_
#define MOELORA_TESTS_TESTING_MOE_PROBLEM_H_

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/moe_lora.h"
#include "tests/testing/kernel_data.h"

namespace moelora::testing {

struct MoeDims {
  int64_t t = 4, h = 32, i = 16, e = 8, k = 2, s = 3, r = 4;
};

struct MoeProblem {
  MoeDims d;
  DType dtype = DType::kF32;
  float swiglu_limit = 0;  // MoeLoraParams::swiglu_limit
  DTensor x, w13, w2, out;
  std::vector<int32_t> topk_ids, slots;
  std::vector<float> topk_weights;
  // LoRA slots. 2D: gate, up (out_dim I each); 3D: fused w13 (out_dim 2I); down (out_dim H).
  DTensor gate_a, gate_b, up_a, up_b, w13_a, w13_b, down_a, down_b;
  std::vector<int32_t> gate_rank, up_rank, w13_rank, down_rank;

  // Random problem; slots drawn from [-1, S) (so base tokens are mixed in), ranks from [1, R]
  // per (slot, expert) with some (slot, expert) pairs left empty (rank 0).
  static MoeProblem Make(const MoeDims& d, DType dtype, uint32_t seed) {
    std::mt19937 rng(seed);
    MoeProblem p;
    p.d = d;
    p.dtype = dtype;
    const float ws = 1.0f / std::sqrt(static_cast<float>(d.h));
    p.x = Random(dtype, d.t * d.h, rng);
    p.w13 = Random(dtype, d.e * 2 * d.i * d.h, rng, ws);
    p.w2 = Random(dtype, d.e * d.h * d.i, rng, 1.0f / std::sqrt(static_cast<float>(d.i)));
    p.out = Zeros(dtype, d.t * d.h);
    std::vector<int32_t> experts(d.e);
    std::iota(experts.begin(), experts.end(), 0);
    for (int64_t t = 0; t < d.t; ++t) {
      std::shuffle(experts.begin(), experts.end(), rng);
      float sum = 0;
      std::vector<float> w(d.k);
      for (int64_t k = 0; k < d.k; ++k) {
        p.topk_ids.push_back(experts[k]);
        w[k] = 0.1f + std::uniform_real_distribution<float>(0, 1)(rng);
        sum += w[k];
      }
      for (float v : w) p.topk_weights.push_back(v / sum);
      p.slots.push_back(static_cast<int32_t>(rng() % (d.s + 1)) - 1);
    }
    auto ranks = [&] {
      std::vector<int32_t> r(d.s * d.e);
      for (auto& v : r) v = rng() % 5 == 0 ? 0 : 1 + static_cast<int32_t>(rng() % d.r);
      return r;
    };
    const float ls = 0.5f;
    auto lora = [&](DTensor* a, DTensor* b, int64_t in, int64_t out, std::vector<int32_t>* rk) {
      *rk = ranks();
      *a = Random(dtype, d.s * d.e * in * d.r, rng, ls / std::sqrt(static_cast<float>(in)));
      *b = Random(dtype, d.s * d.e * d.r * out, rng, ls);
    };
    lora(&p.gate_a, &p.gate_b, d.h, d.i, &p.gate_rank);
    lora(&p.up_a, &p.up_b, d.h, d.i, &p.up_rank);
    lora(&p.w13_a, &p.w13_b, d.h, 2 * d.i, &p.w13_rank);
    lora(&p.down_a, &p.down_b, d.i, d.h, &p.down_rank);
    return p;
  }

  // wrapper: 0 = no LoRA (base fused MoE), 2 = 2D (gate, up), 3 = 3D (w13).
  MoeLoraParams Params(int wrapper) {
    MoeLoraParams q;
    q.dtype = dtype;
    q.swiglu_limit = swiglu_limit;
    q.x = x.bytes.data();
    q.topk_ids = topk_ids.data();
    q.topk_weights = topk_weights.data();
    q.slot_of_token = wrapper ? slots.data() : nullptr;
    q.w13 = w13.bytes.data();
    q.w2 = w2.bytes.data();
    q.out = out.bytes.data();
    q.num_tokens = d.t;
    q.hidden = d.h;
    q.inter = d.i;
    q.num_experts = d.e;
    q.top_k = d.k;
    q.num_slots = d.s;
    q.max_rank = d.r;
    if (wrapper == 2) {
      q.gate_up[0] = {gate_a.bytes.data(), gate_b.bytes.data(), gate_rank.data(), 0, d.i};
      q.gate_up[1] = {up_a.bytes.data(), up_b.bytes.data(), up_rank.data(), d.i, d.i};
      q.num_gate_up = 2;
    } else if (wrapper == 3) {
      q.gate_up[0] = {w13_a.bytes.data(), w13_b.bytes.data(), w13_rank.data(), 0, 2 * d.i};
      q.num_gate_up = 1;
    }
    if (wrapper) {
      q.down = {down_a.bytes.data(), down_b.bytes.data(), down_rank.data(), 0, d.h};
      q.has_down = true;
    }
    return q;
  }
};

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_TESTING_MOE_PROBLEM_H_
