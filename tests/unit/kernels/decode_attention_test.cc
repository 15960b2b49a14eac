#include "kernels/decode_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "tests/testing/bf16.h"

namespace moelora {
namespace {

using testing::FromBf16;
using testing::ToBf16;

struct Case {
  int64_t n, d, heads;
  bool bf16, sinks;
};

// The kernel against the definition in double precision, row by row: keys interleaved with
// other heads' rows (kv_stride > d), as in the cache.
void Check(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "n " << c.n << " d " << c.d << " heads " << c.heads
                                    << " bf16 " << c.bf16 << " sinks " << c.sinks);
  std::mt19937 rng(static_cast<uint32_t>(c.n * 131 + c.d * 7 + c.heads));
  std::normal_distribution<float> dist(0, 1);
  const int64_t stride = 3 * c.d;
  std::vector<float> q(c.heads * c.d), k(c.n * stride), v(c.n * stride), sinks(c.heads);
  for (auto& x : q) x = 2 * dist(rng);
  for (auto& x : k) x = dist(rng);
  for (auto& x : v) x = dist(rng);
  for (auto& x : sinks) x = dist(rng);
  std::vector<uint16_t> kb(k.size()), vb(v.size());
  if (c.bf16) {
    for (size_t i = 0; i < k.size(); ++i) {
      kb[i] = ToBf16(k[i]);
      vb[i] = ToBf16(v[i]);
      k[i] = FromBf16(kb[i]);
      v[i] = FromBf16(vb[i]);
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  DecodeAttentionArgs a;
  a.q = q.data();
  a.q_stride = c.d;
  a.k = c.bf16 ? static_cast<const void*>(kb.data()) : k.data();
  a.v = c.bf16 ? static_cast<const void*>(vb.data()) : v.data();
  a.kv_bf16 = c.bf16;
  a.kv_stride = stride;
  a.n = c.n;
  a.d = c.d;
  a.heads = c.heads;
  a.scale = scale;
  a.sinks = c.sinks ? sinks.data() : nullptr;
  std::vector<float> out(c.heads * (c.d + 5), -7.0f), scratch(c.heads * (c.n + 16));
  a.out = out.data();
  a.out_stride = c.d + 5;
  DecodeAttention(a, scratch.data());
  for (int64_t h = 0; h < c.heads; ++h) {
    std::vector<double> s(c.n);
    double mx = c.sinks ? sinks[h] : -INFINITY;
    for (int64_t j = 0; j < c.n; ++j) {
      double dot = 0;
      for (int64_t e = 0; e < c.d; ++e)
        dot += static_cast<double>(q[h * c.d + e]) * k[j * stride + e];
      s[j] = dot * scale;
      mx = std::max(mx, s[j]);
    }
    double denom = c.sinks ? std::exp(sinks[h] - mx) : 0.0;
    for (auto& x : s) {
      x = std::exp(x - mx);
      denom += x;
    }
    for (int64_t e = 0; e < c.d; ++e) {
      double o = 0;
      for (int64_t j = 0; j < c.n; ++j) o += s[j] * v[j * stride + e];
      o /= denom;
      EXPECT_NEAR(out[h * (c.d + 5) + e], o, 2e-5 + 2e-5 * std::fabs(o))
          << "head " << h << " e " << e;
    }
    // Past d in the row: untouched.
    for (int64_t e = c.d; e < c.d + 5; ++e) EXPECT_EQ(out[h * (c.d + 5) + e], -7.0f);
  }
}

TEST(DecodeAttentionTest, MatchesTheDefinition) {
  if (!DecodeAttentionAvailable(64)) GTEST_SKIP() << "no AVX-512 on this CPU";
  // Key counts below, at and past one and several 16-key blocks; head dims of one to 16 chunks.
  for (int64_t n : {1, 5, 16, 17, 40, 300}) {
    for (int64_t d : {16, 64, 128, 256}) {
      for (bool bf16 : {false, true}) {
        Check({n, d, 4, bf16, false});
        Check({n, d, 1, bf16, true});
        Check({n, d, 7, bf16, true});  // heads in blocks of 4 or 2, and one at a time
      }
    }
  }
}

// Normal q (q_elems values) and cache rows k and v (kv_elems each), with kb and vb the same rows
// rounded to bf16.
struct RandomRows {
  RandomRows(std::mt19937& rng, int64_t q_elems, int64_t kv_elems)
      : q(q_elems), k(kv_elems), v(kv_elems), kb(kv_elems), vb(kv_elems) {
    std::normal_distribution<float> dist(0, 1);
    for (auto& x : q) x = dist(rng);
    for (int64_t i = 0; i < kv_elems; ++i) {
      k[i] = dist(rng);
      v[i] = dist(rng);
      kb[i] = ToBf16(k[i]);
      vb[i] = ToBf16(v[i]);
    }
  }
  // A call on heads query rows of d (d apart) against n cache rows of stride elements, from
  // element `offset` of each (f32 rows, or their bf16 copies), scale 1/8.
  DecodeAttentionArgs Args(bool bf16, int64_t offset, int64_t stride, int64_t n, int64_t d,
                           int64_t heads) const {
    DecodeAttentionArgs a;
    a.q = q.data();
    a.q_stride = d;
    a.k = bf16 ? static_cast<const void*>(kb.data() + offset) : k.data() + offset;
    a.v = bf16 ? static_cast<const void*>(vb.data() + offset) : v.data() + offset;
    a.kv_bf16 = bf16;
    a.kv_stride = stride;
    a.n = n;
    a.d = d;
    a.heads = heads;
    a.scale = 0.125f;
    return a;
  }
  std::vector<float> q, k, v;
  std::vector<uint16_t> kb, vb;
};

// The heads of a call go in blocks (4 at d = 32 and 64, 2 at d = 128): each head's output is the
// same bits as a call for that head alone.
TEST(DecodeAttentionTest, HeadsInBlocksGiveTheBitsOfOneHeadAtATime) {
  if (!DecodeAttentionAvailable(64)) GTEST_SKIP() << "no AVX-512 on this CPU";
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0, 1);
  for (int64_t d : {32, 64, 128}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "d " << d << " bf16 " << bf16);
      const int64_t n = 37, heads = 7, stride = 2 * d;
      const RandomRows r(rng, heads * d, n * stride);
      std::vector<float> sinks(heads);
      for (auto& x : sinks) x = dist(rng);
      DecodeAttentionArgs a = r.Args(bf16, 0, stride, n, d, heads);
      a.sinks = sinks.data();
      std::vector<float> all(heads * d), one(heads * d), scratch(heads * (n + 16));
      a.out = all.data();
      a.out_stride = d;
      DecodeAttention(a, scratch.data());
      for (int64_t h = 0; h < heads; ++h) {
        DecodeAttentionArgs b = a;
        b.heads = 1;
        b.q = r.q.data() + h * d;
        b.sinks = sinks.data() + h;
        b.out = one.data() + h * d;
        DecodeAttention(b, scratch.data());
      }
      for (int64_t i = 0; i < heads * d; ++i) {
        ASSERT_EQ(all[i], one[i]) << "head " << i / d << " e " << i % d;
      }
    }
  }
}

// The first heads' prefetch of whole cache rows (k_rows, v_rows: every KV head's part of a row,
// as the CPU attention passes them for a row's first KV head) gives the same bits as a call
// without it: key counts below and past the rows it runs ahead, heads in blocks (d 64) and one
// at a time (d 256).
TEST(DecodeAttentionTest, WholeRowPrefetchChangesNoResult) {
  if (!DecodeAttentionAvailable(64)) GTEST_SKIP() << "no AVX-512 on this CPU";
  std::mt19937 rng(5);
  for (int64_t n : {1, 8, 9, 40, 300}) {
    for (int64_t d : {64, 256}) {
      for (bool bf16 : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "n " << n << " d " << d << " bf16 " << bf16);
        const int64_t kv_heads = 3, stride = kv_heads * d, heads = 7;
        const RandomRows r(rng, heads * d, n * stride);
        // KV head 1's part of each row (d elements in): a kernel that read its keys or values
        // through the rows to prefetch would read head 0's.
        DecodeAttentionArgs a = r.Args(bf16, d, stride, n, d, heads);
        std::vector<float> plain(heads * d), fetched(heads * d), scratch(heads * (n + 16));
        a.out = plain.data();
        a.out_stride = d;
        DecodeAttention(a, scratch.data());
        DecodeAttentionArgs b = a;
        b.k_rows = bf16 ? static_cast<const void*>(r.kb.data()) : r.k.data();
        b.v_rows = bf16 ? static_cast<const void*>(r.vb.data()) : r.v.data();
        b.row_bytes = stride * (bf16 ? 2 : 4);
        b.out = fetched.data();
        DecodeAttention(b, scratch.data());
        for (int64_t i = 0; i < heads * d; ++i) {
          ASSERT_EQ(plain[i], fetched[i]) << "head " << i / d << " e " << i % d;
        }
      }
    }
  }
}

TEST(DecodeAttentionTest, LargeLogitsDoNotOverflow) {
  if (!DecodeAttentionAvailable(64)) GTEST_SKIP() << "no AVX-512 on this CPU";
  // q · k of several hundred: exp would overflow without the max subtracted.
  const int64_t n = 20, d = 64;
  std::vector<float> q(d, 3.0f), k(n * d), v(n * d), out(d), scratch(n + 16);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t e = 0; e < d; ++e) {
      k[j * d + e] = static_cast<float>(j);  // scores 0, 24, 48, ... · scale 8
      v[j * d + e] = static_cast<float>(j);
    }
  }
  DecodeAttentionArgs a;
  a.q = q.data();
  a.q_stride = d;
  a.k = k.data();
  a.v = v.data();
  a.kv_stride = d;
  a.n = n;
  a.d = d;
  a.heads = 1;
  a.scale = 1.0f;
  a.out = out.data();
  a.out_stride = d;
  DecodeAttention(a, scratch.data());
  // The last key dominates by exp(192) over the one before.
  for (float o : out) EXPECT_FLOAT_EQ(o, 19.0f);
}

TEST(DecodeAttentionTest, Availability) {
  // Whatever the CPU: head dims the kernel cannot take are refused.
  EXPECT_FALSE(DecodeAttentionAvailable(0));
  EXPECT_FALSE(DecodeAttentionAvailable(72));
  EXPECT_FALSE(DecodeAttentionAvailable(272));
  EXPECT_EQ(DecodeAttentionAvailable(64), DecodeAttentionAvailable(128));
}

}  // namespace
}  // namespace moelora
