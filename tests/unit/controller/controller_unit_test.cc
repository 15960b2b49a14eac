// The controller's adapter manager and scheduler against a fake worker group, in milliseconds:
// slot accounting that never drifts from the workers, strict FIFO admission, LRU swaps that
// never evict a pinned adapter, unloads while queued and running, step failures, a group
// restart, deadlines and cancellation. Plus SlotPool on its own.
// Time is a SimulatedClock the tests move by hand (and the fake's steps move as they take
// simulated time): batch windows, call-ahead leads, reconcile intervals and deadlines come out
// the same however loaded the machine is. Waits on real time are only backstops for outcomes.
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "controller/controller.h"
#include "controller/slot_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"
#include "schema/model_info.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/unit/controller/fake_worker_group.h"

namespace moelora {
namespace {

using ::moelora::testing::FakeWorkerGroup;
using ::moelora::testing::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

TEST(SlotPoolTest, ASlotIsFreeOnlyWhenNoWorkerMayHoldIt) {
  SlotPool p(2);
  EXPECT_TRUE(p.TryReserve());
  EXPECT_TRUE(p.TryReserve());
  EXPECT_FALSE(p.TryReserve());
  p.BeginRelease();  // unload sent, no answer yet: still taken
  EXPECT_EQ(p.free(), 0);
  p.EndRelease(/*freed=*/false);  // a rank failed: leaked
  EXPECT_EQ(p.leaked(), 1);
  EXPECT_FALSE(p.TryReserve());
  p.Reconcile(0);  // the workers hold nothing the controller does not know
  EXPECT_EQ(p.free(), 1);
  EXPECT_TRUE(p.TryReserve());
  p.Leak();  // a rollback that failed
  EXPECT_EQ(p.held(), 1);
  EXPECT_EQ(p.leaked(), 1);
  p.Reconcile(5);  // never more than the capacity
  EXPECT_EQ(p.leaked(), 2);
  p.Reset();
  EXPECT_EQ(p.free(), 2);
  p.TryReserve();
  p.Unreserve();
  EXPECT_EQ(p.free(), 2);
}

TEST(SlotPoolTest, VictimIsTheLeastRecentlyUsedUnpinnedIdleResident) {
  const Clock::TimePoint t0{};
  auto at = [&](int s) { return t0 + std::chrono::seconds(s); };
  using C = SlotPool::Candidate;
  EXPECT_EQ(SlotPool::PickVictim({C{true, false, false, at(5)}, C{true, false, false, at(1)}}), 1u);
  EXPECT_EQ(SlotPool::PickVictim({C{true, false, false, at(5)}, C{true, true, false, at(1)}}), 0u);
  EXPECT_EQ(SlotPool::PickVictim({C{true, false, true, at(1)}, C{true, false, false, at(9)}}), 1u);
  EXPECT_EQ(SlotPool::PickVictim({C{false, false, false, at(1)}, C{true, false, false, at(9)}}),
            1u);
  EXPECT_EQ(SlotPool::PickVictim({C{true, true, false, at(1)}, C{true, false, true, at(2)}}),
            std::nullopt);
  EXPECT_EQ(SlotPool::PickVictim({}), std::nullopt);
}

struct Harness {
  TempDir dir;
  std::unique_ptr<Registry> registry;
  ControllerMetrics metrics;
  SimulatedClock clock;
  FakeWorkerGroup group;
  std::unique_ptr<Controller> c;

  explicit Harness(int max_loras, int max_num_seqs = 64, const std::string& state_dir = "",
                   int batch_window_ms = 0, int batch_window_max_ms = 0, int decode_steps = 1,
                   bool call_ahead = false, int max_queued = 0, int request_timeout_s = 0,
                   int max_bypass_ms = 2000)
      : group(max_loras, &clock) {
    auto r = Registry::Open(state_dir.empty() ? dir.path() : state_dir);
    EXPECT_TRUE(r.ok()) << r.status();
    registry = std::move(*r);
    ControllerOptions o;
    o.adapter_root = MOELORA_TEST_DATA_DIR;
    o.max_loras = max_loras;
    o.max_cpu_loras = 8;
    o.max_lora_rank = 16;
    o.mixed = true;
    o.max_num_seqs = max_num_seqs;
    o.batch_window_ms = batch_window_ms;
    o.batch_window_max_ms = batch_window_max_ms;
    o.decode_steps = decode_steps;
    o.call_ahead = call_ahead;
    o.clock = &clock;
    o.max_queued_requests = max_queued;
    o.request_timeout_s = request_timeout_s;
    o.max_bypass_ms = max_bypass_ms;
    auto info = ReadModelInfo(std::string(MOELORA_TEST_DATA_DIR) + "/qwen3_moe/model");
    EXPECT_TRUE(info.ok()) << info.status();
    o.model = *info;
    c = std::make_unique<Controller>(o, registry.get(), &group, &metrics);
    EXPECT_TRUE(c->OnGroupReady().ok());
    c->Start();
    // The start's sweep (the workers drop what an earlier controller left) goes out first: tests
    // count their own steps after it.
    EXPECT_TRUE(group.WaitFor([&] { return group.sweeps() == 1; }));
    start_steps = group.step_calls();
  }
  int start_steps = 0;
  ~Harness() {
    group.Resume();  // a held step would keep the scheduler from stopping
    c->Stop();
  }

  int64_t Load(const std::string& name, const std::string& path, bool pinned = false) {
    v1::LoadAdapterRequest req;
    req.set_name(name);
    req.set_path("qwen3_moe/" + path);
    req.set_pinned(pinned);
    auto a = c->LoadAdapter(req);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->id() : 0;
  }
  std::shared_ptr<GenRequest> Submit(const std::string& adapter, int max_tokens,
                                     Clock::TimePoint deadline = Clock::TimePoint::max()) {
    v1::GenerateRequest req;
    req.set_adapter(adapter);
    req.add_prompt_token_ids(1);
    req.add_prompt_token_ids(2);
    req.set_max_tokens(max_tokens);
    auto r = c->Submit(req, deadline);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : nullptr;
  }
  // Moves the clock by `d` and waits until the scheduler has seen it (waits on the clock again).
  void Tick(Clock::Duration d) {
    const int64_t before = clock.waits();
    clock.Advance(d);
    EXPECT_TRUE(group.WaitFor([&] { return clock.waits() > before; }));
  }
  // What the worker group's monitor does after a failed step took the group out of service:
  // finds every rank ready again.
  void Recover() {
    EXPECT_TRUE(group.WaitFor([&] { return !group.serving(); }));
    group.set_serving(true);
    EXPECT_TRUE(c->OnGroupReady().ok());
  }
  // The request's final status (DEADLINE_EXCEEDED here if it does not end within 10 s).
  [[nodiscard]] static absl::Status Wait(const std::shared_ptr<GenRequest>& r) {
    if (!r->WaitDone(std::chrono::seconds(10)))
      return absl::DeadlineExceededError("the test waited 10 s");
    return r->GetResult().status;
  }
};

// Bug: a failed unload on the workers used to free the slot in the controller's count, so the
// next load was staged into a slot a worker still held and got RESOURCE_EXHAUSTED.
TEST(ControllerUnitTest, FailedUnloadKeepsTheSlotTakenUntilTheWorkersFreeIt) {
  Harness h(/*max_loras=*/1);
  const int64_t a = h.Load("a", "adapter_2d");
  EXPECT_THAT(h.group.committed(), ElementsAre(a));
  h.group.FailNextUnloads(2);  // the unload, and the first reconcile's retry
  ASSERT_TRUE(h.c->UnloadAdapter("a").ok());
  EXPECT_THAT(h.group.committed(), ElementsAre(a)) << "the fake's unload should have failed";
  const int64_t b = h.Load("b", "adapter_3d");  // registered; no slot is free yet
  auto r = h.Submit("b", 3);
  ASSERT_NE(r, nullptr);
  // The first reconcile's retry fails; the next comes a second later and frees a's slot.
  ASSERT_TRUE(h.group.WaitFor([&] { return h.group.unload_calls() >= 2; }));
  const Clock::TimePoint t0 = h.clock.Now();
  for (int i = 0; i < 20 && !r->WaitDone(std::chrono::milliseconds(0)); ++i) {
    h.Tick(std::chrono::milliseconds(100));
  }
  EXPECT_OK(Harness::Wait(r));  // swapped in once a reconcile freed a's slot
  EXPECT_GE(h.clock.Now() - t0, std::chrono::seconds(1)) << "the reconcile interval";
  EXPECT_EQ(h.group.unload_calls(), 3);
  EXPECT_EQ(r->num_tokens(), 3u);
  EXPECT_THAT(h.group.committed(), ElementsAre(b));
}

// A rollback (commit failed on a rank, then its unload failed too) leaks the slot until the
// controller has seen the workers free it.
TEST(ControllerUnitTest, FailedRollbackIsReconciledBeforeTheSlotIsReused) {
  Harness h(1);
  h.group.FailNextCommits(1);
  h.group.FailNextUnloads(1);
  v1::LoadAdapterRequest req;
  req.set_name("a");
  req.set_path("qwen3_moe/adapter_2d");
  EXPECT_EQ(h.c->LoadAdapter(req).status().code(), absl::StatusCode::kUnavailable);
  // The fake left the orphan committed on one rank; the scheduler's reconciliation may already
  // have freed it (it runs as soon as the scheduler wakes).
  EXPECT_LE(h.group.committed().size(), 1u);
  EXPECT_TRUE(h.c->ListAdapters().empty());
  const int64_t b = h.Load("b", "adapter_3d");
  auto r = h.Submit("b", 2);
  // A reconcile at most a second after the last one frees the orphan's slot.
  for (int i = 0; i < 20 && !r->WaitDone(std::chrono::milliseconds(0)); ++i) {
    h.Tick(std::chrono::milliseconds(100));
  }
  EXPECT_OK(Harness::Wait(r));
  EXPECT_THAT(h.group.committed(), ElementsAre(b));
}

TEST(ControllerUnitTest, RequestsWithResidentAdaptersGoFirstWhileASwapWaits) {
  Harness h(1, 64, "", /*batch_window_ms=*/150, 1000);  // the three arrive before any pass
  const int64_t a = h.Load("a", "adapter_2d");
  const int64_t b = h.Load("b", "adapter_3d");  // not resident: the one slot holds a
  auto rb = h.Submit("b", 2);
  auto r0 = h.Submit("", 2);
  auto ra = h.Submit("a", 2);
  h.clock.Advance(std::chrono::milliseconds(150));
  for (auto& r : {rb, r0, ra}) EXPECT_OK(Harness::Wait(r));
  // The base request and a's (resident) start at once; b swaps in once a's request is done.
  EXPECT_THAT(h.group.admitted_adapters(), ElementsAre(0, a, b));
}

// A request waiting for its adapter's slot is passed over for --max-bypass-ms at most: then the
// requests behind it wait, the running ones end, and its adapter swaps in before theirs.
TEST(ControllerUnitTest, APassedOverRequestRunsOnceItHasWaitedTheBypassLimit) {
  Harness h(1, 64, "", 0, 0, 1, false, 0, 0, /*max_bypass_ms=*/100);
  const int64_t a = h.Load("a", "adapter_2d");
  const int64_t b = h.Load("b", "adapter_3d");
  h.group.set_step_delay(std::chrono::milliseconds(10));
  h.group.Hold();
  auto ra1 = h.Submit("a", 40);
  ASSERT_TRUE(h.group.WaitHolds(1));
  auto rb = h.Submit("b", 2);
  auto ra2 = h.Submit("a", 2);  // passed b 10 ms into its wait
  h.group.Release(1);
  ASSERT_TRUE(h.group.WaitHolds(2));
  EXPECT_THAT(h.group.admitted_adapters(), ElementsAre(a, a));
  h.clock.Advance(std::chrono::milliseconds(200));  // b has waited past the limit
  auto ra3 = h.Submit("a", 2);
  h.group.Resume();
  for (auto& r : {ra1, rb, ra2, ra3}) EXPECT_OK(Harness::Wait(r));
  EXPECT_THAT(h.group.admitted_adapters(), ElementsAre(a, a, b, a));
}

// A swap-in finishes beside the steps: while the workers still read c for its request, a
// request for a resident adapter runs from start to end; then c's request runs.
TEST(ControllerUnitTest, StepsGoOnWhileAnAdapterIsSwappedIn) {
  Harness h(2);
  const int64_t a = h.Load("a", "adapter_2d");
  h.Load("b", "adapter_3d");
  const int64_t c = h.Load("c", "adapter_2d_shared_a");  // registered: both slots are taken
  h.clock.Advance(std::chrono::milliseconds(10));
  EXPECT_OK(Harness::Wait(h.Submit("a", 2)));  // b is now the least recently used
  h.group.HoldStages();
  auto rc = h.Submit("c", 2);
  ASSERT_TRUE(h.group.WaitFor([&] { return h.group.stages_waiting() == 1; }));
  auto ra = h.Submit("a", 3);
  EXPECT_OK(Harness::Wait(ra));
  EXPECT_EQ(h.group.stages_waiting(), 1) << "c's stage still waits";
  h.group.ReleaseStages();
  EXPECT_OK(Harness::Wait(rc));
  EXPECT_THAT(h.group.committed(), UnorderedElementsAre(a, c));
}

TEST(ControllerUnitTest, LruSwapNeverEvictsAPinnedAdapter) {
  Harness h(2);
  const int64_t p = h.Load("p", "adapter_2d", /*pinned=*/true);  // the least recently used
  const int64_t a = h.Load("a", "adapter_3d");
  const int64_t b = h.Load("b", "adapter_2d_shared_a");
  EXPECT_THAT(h.group.committed(), UnorderedElementsAre(p, a));
  EXPECT_OK(Harness::Wait(h.Submit("b", 2)));
  EXPECT_THAT(h.group.committed(), UnorderedElementsAre(p, b));
  EXPECT_OK(Harness::Wait(h.Submit("a", 2)));
  EXPECT_THAT(h.group.committed(), UnorderedElementsAre(p, a));
  EXPECT_OK(Harness::Wait(h.Submit("p", 2)));  // resident: no swap
  EXPECT_THAT(h.group.committed(), UnorderedElementsAre(p, a));
}

TEST(ControllerUnitTest, UnloadWhileRunningOrQueuedLetsThoseFinishAndRefusesNewOnes) {
  Harness h(1, /*max_num_seqs=*/1);
  h.Load("a", "adapter_2d");
  h.group.Hold();
  auto running = h.Submit("a", 40);
  ASSERT_TRUE(h.group.WaitHolds(1));  // its first step made, the scheduler held in it
  auto queued = h.Submit("a", 3);     // the batch holds one sequence: this one waits
  auto u = h.c->UnloadAdapter("a");
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->state(), v1::ADAPTER_STATE_UNLOADING);
  v1::GenerateRequest req;
  req.set_adapter("a");
  req.add_prompt_token_ids(1);
  req.set_max_tokens(2);
  EXPECT_EQ(h.c->Submit(req, Clock::TimePoint::max()).status().code(), absl::StatusCode::kNotFound);
  h.group.Resume();
  EXPECT_OK(Harness::Wait(running));
  EXPECT_OK(Harness::Wait(queued));
  EXPECT_EQ(running->num_tokens(), 40u);
  EXPECT_EQ(queued->num_tokens(), 3u);
  EXPECT_TRUE(h.group.WaitFor([&] { return h.group.committed().empty(); }))
      << "the deferred unload did not reach the workers";
  EXPECT_TRUE(h.c->ListAdapters().empty());
  // The slot is free again: a new adapter is resident at once.
  const int64_t b = h.Load("b", "adapter_3d");
  EXPECT_THAT(h.group.committed(), ElementsAre(b));
}

// A burst arriving at an idle engine starts as one step with --batch-window-ms; without it the
// first request starts alone. The window is a quiet gap: requests 100 ms apart keep a 150 ms
// window open past the first's 150 ms, up to --batch-window-max-ms after the first arrival.
TEST(ControllerUnitTest, BatchWindowGathersABurstIntoOneFirstStep) {
  const auto ms = [](int n) { return std::chrono::milliseconds(n); };
  auto first_step = [](Harness& h) {
    return h.group.WaitFor([&] { return h.group.step_calls() > h.start_steps; });
  };
  {
    SCOPED_TRACE("no window");
    Harness h(4);
    std::vector<std::shared_ptr<GenRequest>> rs = {h.Submit("", 2)};
    ASSERT_TRUE(first_step(h));
    for (int i = 0; i < 2; ++i) {
      h.clock.Advance(ms(100));
      rs.push_back(h.Submit("", 2));
    }
    for (auto& r : rs) EXPECT_OK(Harness::Wait(r));
    EXPECT_EQ(h.group.adds_per_step().front(), 1);
  }
  {
    SCOPED_TRACE("150 ms gap, 1000 ms cap: requests at 0, 100, 200 start together at 350");
    Harness h(4, 64, "", 150, 1000);
    std::vector<std::shared_ptr<GenRequest>> rs = {h.Submit("", 2)};
    for (int i = 0; i < 2; ++i) {
      h.clock.Advance(ms(100));
      rs.push_back(h.Submit("", 2));
    }
    h.clock.Advance(ms(149));  // 349: the window is still open
    EXPECT_EQ(h.group.step_calls(), h.start_steps);
    h.clock.Advance(ms(1));
    for (auto& r : rs) EXPECT_OK(Harness::Wait(r));
    EXPECT_EQ(h.group.adds_per_step().front(), 3);
  }
  {
    SCOPED_TRACE("150 ms gap, 250 ms cap: the fourth, at 300, comes after the first step");
    Harness h(4, 64, "", 150, 250);
    std::vector<std::shared_ptr<GenRequest>> rs = {h.Submit("", 2)};
    for (int i = 0; i < 2; ++i) {
      h.clock.Advance(ms(100));
      rs.push_back(h.Submit("", 2));
    }
    h.clock.Advance(ms(50));  // 250: the cap
    ASSERT_TRUE(first_step(h));
    h.clock.Advance(ms(50));
    rs.push_back(h.Submit("", 2));
    h.clock.Advance(ms(150));  // its own window, should it arrive at an idle engine
    for (auto& r : rs) EXPECT_OK(Harness::Wait(r));
    EXPECT_EQ(h.group.adds_per_step().front(), 3);
  }
}

// A call of several decode steps brings each sequence's tokens step after step, and sequences end
// within it: every request gets its own tokens in order, up to its last, and its finish reason.
TEST(ControllerUnitTest, SeveralDecodeStepsACallGiveEachRequestItsTokensInOrder) {
  Harness h(4, 64, "", 150, 1000, /*decode_steps=*/4);
  std::vector<std::shared_ptr<GenRequest>> rs;
  const std::vector<int> max_tokens = {1, 2, 5, 7, 9};
  for (int m : max_tokens) rs.push_back(h.Submit("", m));
  h.clock.Advance(std::chrono::milliseconds(150));  // the window closes on the burst
  for (size_t i = 0; i < rs.size(); ++i) {
    ASSERT_OK(Harness::Wait(rs[i]));
    const GenRequest::Result res = rs[i]->GetResult();
    std::vector<int32_t> want;  // the fake's tokens for this sequence
    for (int g = 0; g < max_tokens[i]; ++g) {
      want.push_back(static_cast<int32_t>((rs[i]->seq_id * 7 + g) % 384));
    }
    EXPECT_EQ(res.tokens, want) << "request " << i;
    EXPECT_EQ(res.finish_reason, "length");
  }
  // The burst joined in one step, the rest ran 4 steps a call: 1 + 2 calls for 9 tokens.
  EXPECT_EQ(h.group.adds_per_step(), std::vector<int>{5});
  EXPECT_EQ(h.group.step_calls() - h.start_steps, 3);
}

// --call-ahead: decode calls go out before the call in flight ends and run after it; every
// request still gets its own tokens in order, and one that joins meanwhile joins.
TEST(ControllerUnitTest, CallsSentAheadGiveEachRequestItsTokensInOrder) {
  Harness h(4, 64, "", 50, 1000, /*decode_steps=*/4, /*call_ahead=*/true);
  h.group.set_step_delay(std::chrono::milliseconds(3));
  auto want = [](const std::shared_ptr<GenRequest>& r, int n) {
    std::vector<int32_t> w;
    for (int g = 0; g < n; ++g) w.push_back(static_cast<int32_t>((r->seq_id * 7 + g) % 384));
    return w;
  };
  const std::vector<int> max_tokens = {3, 9, 17, 30};
  std::vector<std::shared_ptr<GenRequest>> rs;
  for (int m : max_tokens) rs.push_back(h.Submit("", m));
  h.group.Hold();
  h.clock.Advance(std::chrono::milliseconds(50));  // the window closes on the burst
  // Held in the third call (the joiners' step, then decode calls of 4 steps, each but the first
  // sent 1 ms before the one in flight is due), a request joins.
  ASSERT_TRUE(h.group.WaitHolds(1));
  h.group.Release(2);
  ASSERT_TRUE(h.group.WaitHolds(2));
  auto joiner = h.Submit("", 6);
  h.group.Resume();
  for (size_t i = 0; i < rs.size(); ++i) {
    ASSERT_OK(Harness::Wait(rs[i]));
    EXPECT_EQ(rs[i]->GetResult().tokens, want(rs[i], max_tokens[i])) << "request " << i;
  }
  ASSERT_OK(Harness::Wait(joiner));
  EXPECT_EQ(joiner->GetResult().tokens, want(joiner, 6));
  EXPECT_GT(h.group.ahead_calls(), 0) << "no call was sent ahead";
  EXPECT_EQ(h.metrics.calls_ahead.Value(), h.group.ahead_calls());
}

// A failed call with a call sent ahead of it: the running requests fail with UNAVAILABLE, the
// call sent ahead is given up, and the next request runs.
TEST(ControllerUnitTest, AFailedCallWithACallSentAheadFailsTheRunningRequestsAndServesOn) {
  Harness h(1, 64, "", 0, 0, /*decode_steps=*/4, /*call_ahead=*/true);
  h.group.set_step_delay(std::chrono::milliseconds(3));
  h.group.Hold();
  h.group.Release(3);  // held in the fourth call, which was sent ahead, with a fifth sent after it
  auto r = h.Submit("", 60);
  ASSERT_TRUE(h.group.WaitHolds(1));
  EXPECT_GE(h.group.ahead_calls(), 2);
  h.group.FailNextSteps(1);  // the fifth
  h.group.Resume();
  EXPECT_EQ(Harness::Wait(r).code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(r->num_tokens(), 60u);
  h.Recover();
  auto next = h.Submit("", 12);
  ASSERT_OK(Harness::Wait(next));
  EXPECT_EQ(next->num_tokens(), 12u);
}

TEST(ControllerUnitTest, StepFailureFailsTheRunningRequestsWithUnavailable) {
  Harness h(1);
  h.group.FailNextSteps(1);
  auto r = h.Submit("", 4);
  EXPECT_EQ(Harness::Wait(r).code(), absl::StatusCode::kUnavailable);
  h.Recover();
  // A sequence running when a step fails is removed from the workers too (when the group is
  // found ready again): none is left behind to fill the batch.
  h.group.Hold();
  auto running = h.Submit("", 40);
  ASSERT_TRUE(h.group.WaitHolds(1));
  h.group.FailNextSteps(1);
  h.group.Resume();
  EXPECT_EQ(Harness::Wait(running).code(), absl::StatusCode::kUnavailable);
  h.Recover();
  EXPECT_TRUE(h.group.WaitFor([&] { return h.group.running() == 0; }))
      << h.group.running() << " sequences left on the workers";
  auto next = h.Submit("", 4);
  EXPECT_OK(Harness::Wait(next));
  EXPECT_EQ(next->num_tokens(), 4u);
}

TEST(ControllerUnitTest, GroupRestartReloadsTheAdaptersIntoTheNewWorkers) {
  Harness h(2);
  const int64_t a = h.Load("a", "adapter_2d");
  const int64_t b = h.Load("b", "adapter_3d");
  h.group.Hold();
  auto r = h.Submit("a", 50);
  ASSERT_TRUE(h.group.WaitHolds(1));
  h.c->OnGroupDown("test: a rank died");
  EXPECT_EQ(Harness::Wait(r).code(), absl::StatusCode::kUnavailable);
  h.group.Resume();
  h.group.Restart();
  EXPECT_TRUE(h.group.committed().empty());
  ASSERT_TRUE(h.c->OnGroupReady().ok());
  EXPECT_THAT(h.group.committed(), UnorderedElementsAre(a, b));
  EXPECT_OK(Harness::Wait(h.Submit("b", 2)));
}

// --max-queued-requests: a request beyond the queue's bound is refused at once, holding nothing
// (its adapter's reference is given back: the adapter can still be unloaded), and the queue
// takes requests again once it has room.
TEST(ControllerUnitTest, ARequestBeyondTheQueueBoundIsRefusedAtOnce) {
  Harness h(1, /*max_num_seqs=*/1, "", 0, 0, 1, false, /*max_queued=*/2);
  h.Load("a", "adapter_2d");
  h.group.Hold();
  auto running = h.Submit("", 5);
  ASSERT_TRUE(h.group.WaitHolds(1));
  auto q1 = h.Submit("", 2);
  auto q2 = h.Submit("a", 2);
  v1::GenerateRequest req;
  req.set_adapter("a");
  req.add_prompt_token_ids(1);
  req.set_max_tokens(2);
  const absl::Status refused = h.c->Submit(req, Clock::TimePoint::max()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("--max-queued-requests"));
  h.group.Resume();
  for (auto& r : {running, q1, q2}) EXPECT_OK(Harness::Wait(r));
  EXPECT_OK(Harness::Wait(h.Submit("a", 2)));
  // Only the requests that ran held the adapter: the unload goes through at once.
  ASSERT_TRUE(h.c->UnloadAdapter("a").ok());
  EXPECT_TRUE(h.group.WaitFor([&] { return h.c->ListAdapters().empty(); }));
}

// Workers that still hold sequences of an earlier controller (--workers mode, a controller
// restart): each time the group is found ready a step drops them, with no request needed, so
// they neither fill the batch nor collide with the new controller's sequence ids.
TEST(ControllerUnitTest, WorkersDropSequencesOfAnEarlierControllerWhenTheGroupIsReady) {
  Harness h(1);  // the start's step dropped what there was
  h.c->OnGroupDown("test: connection lost");
  h.group.AddStray(1, 1000);
  h.group.AddStray(7, 1000);
  ASSERT_TRUE(h.c->OnGroupReady().ok());
  EXPECT_TRUE(h.group.WaitFor([&] { return h.group.running() == 0; }))
      << h.group.running() << " sequences left on the workers";
  EXPECT_EQ(h.group.sweeps(), 2);
  auto r = h.Submit("", 3);
  ASSERT_EQ(r->seq_id, 1);
  EXPECT_OK(Harness::Wait(r));
  EXPECT_EQ(r->num_tokens(), 3u);
  EXPECT_EQ(h.group.sweeps(), 2);  // once per ready, not per step
}

// Every step names the sequences the controller expects: one the workers hold beside them (a
// removal that never reached a rank) leaves at the next step, while the others run on.
TEST(ControllerUnitTest, EveryStepDropsSequencesTheControllerDoesNotExpect) {
  Harness h(1);
  h.group.Hold();
  auto running = h.Submit("", 30);
  ASSERT_TRUE(h.group.WaitHolds(1));
  h.group.AddStray(999, 1000);
  h.group.Resume();
  EXPECT_TRUE(h.group.WaitFor([&] { return h.group.running() <= 1; }));
  EXPECT_OK(Harness::Wait(running));
  EXPECT_EQ(running->num_tokens(), 30u);
  EXPECT_TRUE(h.group.WaitFor([&] { return h.group.running() == 0; }));
}

// A failed step takes the group out of service until it is found ready again (which drops
// every worker sequence): the running requests fail, the queued ones wait and then run.
TEST(ControllerUnitTest, AFailedStepChecksTheGroupAgainAndQueuedRequestsWait) {
  Harness h(1, /*max_num_seqs=*/1);
  h.group.Hold();
  auto running = h.Submit("", 40);
  ASSERT_TRUE(h.group.WaitHolds(1));
  auto queued = h.Submit("", 4);
  h.group.FailNextSteps(1);
  h.group.Resume();
  EXPECT_EQ(Harness::Wait(running).code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(h.group.WaitFor([&] { return !h.group.revalidated().empty(); }));
  EXPECT_THAT(h.group.revalidated()[0], HasSubstr("a rank died"));
  EXPECT_FALSE(queued->WaitDone(std::chrono::milliseconds(0)));
  h.group.set_serving(true);
  ASSERT_TRUE(h.c->OnGroupReady().ok());
  EXPECT_OK(Harness::Wait(queued));
  EXPECT_EQ(queued->num_tokens(), 4u);
  EXPECT_TRUE(h.group.WaitFor([&] { return h.group.running() == 0; }));
}

// Pinning never takes the last slot: a request for an unpinned adapter could never run.
TEST(ControllerUnitTest, PinningNeverTakesTheLastSlot) {
  Harness h(2);
  h.Load("p", "adapter_2d", /*pinned=*/true);
  v1::LoadAdapterRequest req;
  req.set_name("q");
  req.set_path("qwen3_moe/adapter_3d");
  req.set_pinned(true);
  const absl::Status s = h.c->LoadAdapter(req).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("1 of --max-loras 2 slots are pinned"));
  EXPECT_EQ(h.c->ListAdapters().size(), 1u);
  req.set_pinned(false);
  ASSERT_TRUE(h.c->LoadAdapter(req).ok());
  EXPECT_OK(Harness::Wait(h.Submit("q", 2)));
  EXPECT_OK(Harness::Wait(h.Submit("p", 2)));
}

// --request-timeout-s bounds a request whose client set no deadline: queued or running.
TEST(ControllerUnitTest, TheRequestTimeoutEndsRequestsWithoutADeadline) {
  Harness h(1, /*max_num_seqs=*/1, "", 0, 0, 1, false, 0, /*request_timeout_s=*/30);
  h.group.Hold();
  auto running = h.Submit("", 40);
  ASSERT_TRUE(h.group.WaitHolds(1));
  auto queued = h.Submit("", 2);
  h.clock.Advance(std::chrono::seconds(29));
  EXPECT_FALSE(running->WaitDone(std::chrono::milliseconds(0)));
  h.clock.Advance(std::chrono::seconds(2));
  h.group.Resume();
  for (auto& r : {running, queued}) {
    const absl::Status s = Harness::Wait(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(std::string(s.message()), HasSubstr("--request-timeout-s 30"));
  }
  EXPECT_LT(running->num_tokens(), 40u);
  EXPECT_TRUE(h.group.WaitFor([&] { return h.group.running() == 0; }));
}

// An adapter that FAILED to load again after a restart (a transient refusal) is loaded again by
// a LoadAdapter with its name and path, instead of that returning the FAILED record.
TEST(ControllerUnitTest, LoadAdapterRetriesAnAdapterThatFailed) {
  Harness h(2);
  const int64_t a = h.Load("a", "adapter_2d");
  h.c->OnGroupDown("test: a rank died");
  h.group.Restart();
  h.group.FailNextStages(1);
  ASSERT_TRUE(h.c->OnGroupReady().ok());
  ASSERT_EQ(h.c->ListAdapters().size(), 1u);
  EXPECT_EQ(h.c->ListAdapters()[0].state(), v1::ADAPTER_STATE_FAILED);
  EXPECT_THAT(h.c->ListAdapters()[0].failure(), HasSubstr("fake: stage failed"));
  EXPECT_TRUE(h.group.committed().empty());
  // Its requests are refused with the reason (and how to retry).
  v1::GenerateRequest req;
  req.set_adapter("a");
  req.add_prompt_token_ids(1);
  req.set_max_tokens(2);
  const absl::Status refused = h.c->Submit(req, Clock::TimePoint::max()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("failed to load: fake: stage failed"));
  EXPECT_EQ(h.Load("a", "adapter_2d"), a);  // the same id: the same registry record
  EXPECT_EQ(h.c->ListAdapters()[0].state(), v1::ADAPTER_STATE_READY);
  EXPECT_EQ(h.c->ListAdapters()[0].failure(), "");
  EXPECT_THAT(h.group.committed(), ElementsAre(a));
  EXPECT_OK(Harness::Wait(h.Submit("a", 2)));
}

TEST(ControllerUnitTest, DeadlinesAndCancellationEndRequestsAndFreeTheirSequences) {
  Harness h(1);
  auto late = h.Submit("", 4, h.clock.Now() - std::chrono::milliseconds(1));
  EXPECT_EQ(Harness::Wait(late).code(), absl::StatusCode::kDeadlineExceeded);
  // A deadline that passes while the request runs (each step takes 2 ms).
  h.group.set_step_delay(std::chrono::milliseconds(2));
  h.group.Hold();
  auto timed = h.Submit("", 60, h.clock.Now() + std::chrono::milliseconds(10));
  ASSERT_TRUE(h.group.WaitHolds(1));
  h.clock.Advance(std::chrono::milliseconds(10));
  h.group.Resume();
  EXPECT_EQ(Harness::Wait(timed).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(timed->num_tokens(), 60u);
  h.group.Hold();
  auto r = h.Submit("", 60);
  ASSERT_TRUE(h.group.WaitHolds(2));
  r->cancelled = true;
  h.group.Resume();
  EXPECT_EQ(Harness::Wait(r).code(), absl::StatusCode::kCancelled);
  EXPECT_LT(r->num_tokens(), 60u);
  EXPECT_TRUE(h.group.WaitFor([&] { return h.group.running() == 0; }))
      << "the cancelled sequence was not removed from the workers";
}

// A small tmpfs (root only; the test skips elsewhere), unmounted at the end.
struct SmallTmpfs {
  TempDir dir;
  bool mounted = false;
  SmallTmpfs() {
    mounted =
        std::system(
            ("mount -t tmpfs -o size=512k moelora-test " + dir.path() + " 2>/dev/null").c_str()) ==
        0;
  }
  ~SmallTmpfs() {
    if (mounted) std::system(("umount " + dir.path()).c_str());
  }
  // Fills the file system (a file of zeros until ENOSPC).
  void Fill() {
    std::FILE* f = std::fopen((dir.path() + "/fill").c_str(), "wb");
    std::vector<char> zeros(4096, 0);
    while (f != nullptr && std::fwrite(zeros.data(), 1, zeros.size(), f) == zeros.size() &&
           std::fflush(f) == 0) {
    }
    if (f != nullptr) std::fclose(f);
  }
};

// A full disk under --state-dir: LoadAdapter fails with RESOURCE_EXHAUSTED saying so, and
// nothing is half-registered (not in the list, not on the workers, not in the registry).
TEST(ControllerUnitTest, FullDiskUnderTheStateDirFailsTheLoadAndRegistersNothing) {
  SmallTmpfs fs;
  if (!fs.mounted) GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  {
    Harness h(2, 64, fs.dir.path() + "/state");
    h.Load("a", "adapter_2d");
    fs.Fill();
    v1::LoadAdapterRequest req;
    req.set_name("b");
    req.set_path("qwen3_moe/adapter_3d");
    const absl::Status s = h.c->LoadAdapter(req).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("disk under --state-dir is full"));
    ASSERT_EQ(h.c->ListAdapters().size(), 1u);
    EXPECT_EQ(h.c->ListAdapters()[0].name(), "a");
    EXPECT_EQ(h.group.committed().size(), 1u);
  }
  std::remove((fs.dir.path() + "/fill").c_str());
  auto reg = Registry::Open(fs.dir.path() + "/state");
  ASSERT_TRUE(reg.ok()) << reg.status();
  ASSERT_EQ((*reg)->List().size(), 1u);
  EXPECT_EQ((*reg)->List()[0].name, "a");
}

std::string Scrape(ControllerMetrics& m) {
  return prometheus::TextSerializer().Serialize(m.registry()->Collect());
}

// The residency gauge and the lora_requests_info series that the Gateway API inference
// extension reads (--lora-info-metric) for LoRA-affinity routing.
TEST(ControllerUnitTest, ResidencyAndLoraRequestsInfoFollowTheBatch) {
  Harness h(1);
  h.Load("a", "adapter_2d");
  h.Load("b", "adapter_3d");
  std::string text = Scrape(h.metrics);
  EXPECT_THAT(text, HasSubstr(R"(moelora_adapter_resident{adapter="a",tier="slot"} 1)"));
  // b is registered only (the one slot holds a): no series until it is in a tier.
  EXPECT_EQ(text.find(R"(adapter="b")"), std::string::npos);
  EXPECT_THAT(
      text,
      HasSubstr(
          R"(moelora_lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""})"));
  h.group.Hold();
  auto ra = h.Submit("a", 60);
  ASSERT_TRUE(h.group.WaitHolds(1));
  auto rb = h.Submit("b", 2);  // waits: a's sequence holds the only slot
  EXPECT_THAT(Scrape(h.metrics),
              HasSubstr(R"(running_lora_adapters="a",waiting_lora_adapters="b")"));
  text = Scrape(h.metrics);
  EXPECT_EQ(text.find(R"(running_lora_adapters="",waiting_lora_adapters="")"), std::string::npos)
      << "the old series must be removed, not left beside the new one";
  ra->cancelled = true;
  h.group.Resume();
  EXPECT_EQ(Harness::Wait(ra).code(), absl::StatusCode::kCancelled);
  EXPECT_OK(Harness::Wait(rb));
  // The swap waited for the cancelled sequence to leave the workers before unloading a.
  EXPECT_EQ(h.group.unload_refusals(), 0);
  text = Scrape(h.metrics);
  EXPECT_THAT(text, HasSubstr(R"(moelora_adapter_resident{adapter="b",tier="slot"} 1)"));
  // a was swapped out into the workers' host cache (what rank 0 answered the unload with).
  EXPECT_THAT(text, HasSubstr(R"(moelora_adapter_resident{adapter="a",tier="host"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(moelora_adapter_resident{adapter="b",tier="host"} 0)"));
  // The swap back: a leaves the host tier, b enters it.
  EXPECT_OK(Harness::Wait(h.Submit("a", 1)));
  text = Scrape(h.metrics);
  EXPECT_THAT(text, HasSubstr(R"(moelora_adapter_resident{adapter="a",tier="host"} 0)"));
  EXPECT_THAT(text, HasSubstr(R"(moelora_adapter_resident{adapter="b",tier="host"} 1)"));
  ASSERT_TRUE(h.c->UnloadAdapter("b").ok());
  EXPECT_EQ(Scrape(h.metrics).find(R"(adapter="b")"), std::string::npos);
  EXPECT_EQ(h.group.host_cache(), std::vector<int64_t>{}) << "an unload by the user drops it";
}

}  // namespace
}  // namespace moelora
