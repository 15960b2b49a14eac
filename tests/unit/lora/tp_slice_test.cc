// TP slicing of LoRA pairs: which columns of A and rows of B each rank keeps.
#include "lora/tp_slice.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace moelora {
namespace {

using ::moelora::testing::StatusIs;
using ::testing::ElementsAre;

MATCHER_P2(Range, begin, size, "") { return arg.begin == begin && arg.size == size; }

TEST(TpSlice, ColumnParallelKeepsAWholeAndItsRowsOfB) {
  auto s = PlanLoraShard(TpMode::kColumn, 24, {32}, 1, 2);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(s->a_cols, ElementsAre(Range(0, 24)));
  EXPECT_THAT(s->b_rows, ElementsAre(Range(16, 16)));
  EXPECT_EQ(s->in_local, 24);
  EXPECT_EQ(s->out_local, 16);
}

TEST(TpSlice, RowParallelKeepsItsColumnsOfAAndBWhole) {
  auto s = PlanLoraShard(TpMode::kRow, 32, {24}, 3, 4);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(s->a_cols, ElementsAre(Range(24, 8)));
  EXPECT_THAT(s->b_rows, ElementsAre(Range(0, 24)));
}

TEST(TpSlice, MergedSectionsAreShardedEachOnItsOwn) {
  // gate_up [gate (10) ; up (10)] at TP=2: rank 1 keeps gate rows 5..10 and up rows 15..20.
  auto s = PlanLoraShard(TpMode::kColumn, 24, {10, 10}, 1, 2);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_THAT(s->b_rows, ElementsAre(Range(5, 5), Range(15, 5)));
  EXPECT_EQ(s->out_local, 10);
  // Qwen3.5 in_proj_qkv [q 16 | k 16 | v 32] at TP=4, rank 2.
  auto q = ShardSections({16, 16, 32}, 2, 4);
  ASSERT_TRUE(q.ok());
  EXPECT_THAT(*q, ElementsAre(Range(8, 4), Range(24, 4), Range(48, 8)));
}

TEST(TpSlice, ReplicatedKeepsEverythingAndTp1IsTheIdentity) {
  auto r = PlanLoraShard(TpMode::kReplicated, 7, {3, 4}, 1, 2);
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->a_cols, ElementsAre(Range(0, 7)));
  EXPECT_THAT(r->b_rows, ElementsAre(Range(0, 7)));
  for (TpMode m : {TpMode::kColumn, TpMode::kRow}) {
    auto s = PlanLoraShard(m, 12, {6, 6}, 0, 1);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->in_local, 12) << TpModeName(m);
    EXPECT_EQ(s->out_local, 12) << TpModeName(m);
  }
}

TEST(TpSlice, IndivisibleSectionsAndBadRanksAreRefused) {
  EXPECT_THAT(PlanLoraShard(TpMode::kColumn, 8, {10, 5}, 0, 2).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(PlanLoraShard(TpMode::kRow, 9, {4}, 0, 2).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ShardSections({4}, 2, 2).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ShardSections({4}, 0, 0).status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace moelora
