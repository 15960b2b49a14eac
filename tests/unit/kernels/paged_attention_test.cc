#include "kernels/paged_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "tests/testing/bf16.h"

namespace moelora {
namespace {

using testing::FromBf16;
using testing::ToBf16;

struct Case {
  int64_t rows, pos0, d, heads, block_size, window;
  bool bf16, sinks;
};

// The kernel (and its portable loop) against the definition in double precision: a pool of
// blocks holding 3 KV heads' rows (the tested head is the middle one), the sequence's blocks in
// shuffled order, query rows at positions pos0 .. pos0 + rows - 1 seeing keys up to their own
// position (and no further back than the window).
void Check(const Case& c) {
  SCOPED_TRACE(::testing::Message()
               << "rows " << c.rows << " pos0 " << c.pos0 << " d " << c.d << " heads " << c.heads
               << " block " << c.block_size << " window " << c.window << " bf16 " << c.bf16
               << " sinks " << c.sinks);
  std::mt19937 rng(static_cast<uint32_t>(c.rows * 131 + c.pos0 * 17 + c.d * 7 + c.heads));
  std::normal_distribution<float> dist(0, 1);
  const int64_t hkv = 3, keys = c.pos0 + c.rows;
  const int64_t nblocks = (keys + c.block_size - 1) / c.block_size + 3;  // spare blocks too
  std::vector<int32_t> table(nblocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  const int64_t row_stride = hkv * c.d, block_stride = c.block_size * row_stride;
  std::vector<float> kpool(nblocks * block_stride), vpool(kpool.size());
  for (auto& x : kpool) x = dist(rng);
  for (auto& x : vpool) x = dist(rng);
  std::vector<uint16_t> kb(kpool.size()), vb(vpool.size());
  if (c.bf16) {
    for (size_t i = 0; i < kpool.size(); ++i) {
      kb[i] = ToBf16(kpool[i]);
      vb[i] = ToBf16(vpool[i]);
      kpool[i] = FromBf16(kb[i]);
      vpool[i] = FromBf16(vb[i]);
    }
  }
  std::vector<float> q(c.rows * c.heads * c.d), sinks(c.heads);
  for (auto& x : q) x = 2 * dist(rng);
  for (auto& x : sinks) x = dist(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  auto key = [&](const std::vector<float>& pool, int64_t p, int64_t i) {
    return pool[table[p / c.block_size] * block_stride + (p % c.block_size) * row_stride + c.d + i];
  };
  std::vector<double> want(q.size());
  for (int64_t r = 0; r < c.rows; ++r) {
    const int64_t pos = c.pos0 + r,
                  lo = c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1) : 0;
    for (int64_t h = 0; h < c.heads; ++h) {
      const float* qh = q.data() + (r * c.heads + h) * c.d;
      std::vector<double> s;
      double mx = c.sinks ? sinks[h] : -INFINITY;
      for (int64_t p = lo; p <= pos; ++p) {
        double dot = 0;
        for (int64_t i = 0; i < c.d; ++i) dot += double{qh[i]} * key(kpool, p, i);
        s.push_back(dot * scale);
        mx = std::max(mx, s.back());
      }
      double den = c.sinks ? std::exp(sinks[h] - mx) : 0;
      for (double& x : s) den += (x = std::exp(x - mx));
      for (int64_t i = 0; i < c.d; ++i) {
        double acc = 0;
        for (int64_t p = lo; p <= pos; ++p) acc += s[p - lo] * key(vpool, p, i);
        want[(r * c.heads + h) * c.d + i] = acc / den;
      }
    }
  }
  PagedAttentionArgs a;
  a.q = q.data();
  a.q_row_stride = c.heads * c.d;
  a.q_head_stride = c.d;
  a.rows = c.rows;
  a.heads = c.heads;
  a.d = c.d;
  a.pos0 = c.pos0;
  a.window = c.window;
  a.blocks = table.data();
  a.block_size = c.block_size;
  a.kv_bf16 = c.bf16;
  // The middle KV head of each row.
  a.k = c.bf16 ? static_cast<const void*>(kb.data() + c.d) : kpool.data() + c.d;
  a.v = c.bf16 ? static_cast<const void*>(vb.data() + c.d) : vpool.data() + c.d;
  a.block_stride = block_stride;
  a.row_stride = row_stride;
  a.scale = scale;
  a.sinks = c.sinks ? sinks.data() : nullptr;
  a.out_row_stride = c.heads * c.d;
  a.out_head_stride = c.d;
  std::vector<float> scratch(PagedAttentionScratchFloats(a));
  for (int path = 0; path < 3; ++path) {
    SCOPED_TRACE(path == 0 ? "portable" : path == 1 ? "dispatched" : "avx2");
    std::vector<float> out(q.size(), NAN);
    a.out = out.data();
    if (path == 0) {
      PagedAttentionPortable(a, scratch.data());
    } else if (path == 1) {
      PagedAttention(a, scratch.data());
    } else if (!PagedAttentionAvx2(a, scratch.data())) {
      continue;  // no AVX2 here, or a head size it does not take
    }
    double worst = 0;
    for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::fabs(out[i] - want[i]));
    EXPECT_LT(worst, 2e-5);
  }
}

TEST(PagedAttentionTest, MatchesTheDefinition) {
  for (bool bf16 : {false, true}) {
    for (bool sinks : {false, true}) {
      // Decode rows, a prompt from 0, a chunk after earlier keys; blocks of 16, a block size
      // that is not a multiple of the 16-key chunk (24) and one smaller (5); windows inside a
      // block and across several.
      Check({1, 0, 64, 4, 16, 0, bf16, sinks});
      Check({1, 77, 64, 4, 16, 0, bf16, sinks});
      Check({37, 0, 64, 2, 16, 0, bf16, sinks});
      Check({20, 45, 128, 3, 24, 0, bf16, sinks});
      Check({9, 30, 32, 1, 5, 0, bf16, sinks});
      Check({33, 50, 64, 4, 16, 7, bf16, sinks});
      Check({3, 100, 64, 2, 16, 40, bf16, sinks});
      Check({1, 200, 256, 1, 16, 128, bf16, sinks});
    }
  }
  // A head size the vector path does not take runs the portable loop.
  Check({5, 11, 40, 2, 16, 0, false, true});
}

TEST(PagedAttentionTest, OneKeyGivesItsValue) {
  // A query at position 0 sees one key: the output is that value whatever the scores.
  const int64_t d = 16;
  std::vector<float> q(d, 3.0f), k(d, 1.0f), v(d);
  std::iota(v.begin(), v.end(), 1.0f);
  const int32_t table[] = {0};
  PagedAttentionArgs a;
  a.q = q.data();
  a.q_row_stride = a.q_head_stride = d;
  a.rows = a.heads = 1;
  a.d = d;
  a.blocks = table;
  a.block_size = 16;
  a.k = k.data();
  a.v = v.data();
  a.block_stride = 16 * d;
  a.row_stride = d;
  std::vector<float> out(d), scratch(PagedAttentionScratchFloats(a));
  a.out = out.data();
  a.out_row_stride = a.out_head_stride = d;
  PagedAttention(a, scratch.data());
  for (int64_t i = 0; i < d; ++i) EXPECT_FLOAT_EQ(out[i], v[i]);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    std::fill(out.begin(), out.end(), 0.0f);
    ASSERT_TRUE(PagedAttentionAvx2(a, scratch.data()));
    for (int64_t i = 0; i < d; ++i) EXPECT_FLOAT_EQ(out[i], v[i]);
  }
}

// The batched twin (what the CUDA kernel is checked against) equals the per-task kernel: two
// sequences with their own block tables and positions, rows of both in one call, GQA and sinks.
TEST(PagedAttentionTest, BatchTwinEqualsPerTaskCalls) {
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0, 1);
  const int64_t hq = 4, hkv = 2, d = 16, bs = 4, blocks = 12;
  std::vector<float> k(blocks * bs * hkv * d), v(k.size()), sinks(hq);
  for (auto& x : k) x = dist(rng);
  for (auto& x : v) x = dist(rng);
  for (auto& x : sinks) x = dist(rng);
  // Sequence 0: 3 rows at positions 5..7 (blocks 3, 0); sequence 1: 1 row at 13 (blocks 7..10).
  const int64_t max_blocks = 4;
  std::vector<int32_t> tables = {3, 0, 0, 0, 7, 8, 9, 10}, seq_of_row = {0, 0, 0, 1};
  std::vector<int64_t> pos_of_row = {5, 6, 7, 13};
  std::vector<float> q(4 * hq * d), out(q.size(), NAN), want(q.size(), NAN);
  for (auto& x : q) x = dist(rng);
  PagedAttentionBatch b;
  b.q = q.data();
  b.out = out.data();
  b.k = k.data();
  b.v = v.data();
  b.rows = 4;
  b.hq = hq;
  b.hkv = hkv;
  b.d = d;
  b.block_size = bs;
  b.block_tables = tables.data();
  b.max_blocks = max_blocks;
  b.seq_of_row = seq_of_row.data();
  b.pos_of_row = pos_of_row.data();
  b.window = 6;
  b.scale = 0.25f;
  b.sinks = sinks.data();
  ASSERT_TRUE(PagedAttentionBatchCpu(b).ok());
  for (int64_t t = 0; t < 4; ++t) {
    for (int64_t g = 0; g < hkv; ++g) {
      PagedAttentionArgs a;
      a.q = q.data() + (t * hq + g * 2) * d;
      a.q_row_stride = hq * d;
      a.q_head_stride = d;
      a.rows = 1;
      a.heads = 2;
      a.d = d;
      a.pos0 = pos_of_row[t];
      a.window = 6;
      a.blocks = tables.data() + seq_of_row[t] * max_blocks;
      a.block_size = bs;
      a.k = k.data() + g * d;
      a.v = v.data() + g * d;
      a.block_stride = bs * hkv * d;
      a.row_stride = hkv * d;
      a.scale = 0.25f;
      a.sinks = sinks.data() + g * 2;
      a.out = want.data() + (t * hq + g * 2) * d;
      a.out_row_stride = hq * d;
      a.out_head_stride = d;
      std::vector<float> scratch(PagedAttentionScratchFloats(a));
      PagedAttentionPortable(a, scratch.data());
    }
  }
  EXPECT_EQ(out, want);
  b.hkv = 3;  // not a divisor of hq
  EXPECT_EQ(PagedAttentionBatchCpu(b).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moelora
