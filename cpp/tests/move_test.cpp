// sw::move_async (strideweave/move.hpp, docs/guide.md, "Movement").
//
//  * Ordered checks: each one raises before work — values, versions, claims
//    and release state of every input unchanged, the prepare step of a
//    registered route not reached unless the check comes after it.
//  * Success: Tensor(destination, 0, layout), destination version + 1, source
//    released, for every pair of native storage kinds and dense, strided,
//    nested, offset, broadcast and scalar layouts.
//  * Failure through io::inject (EIO, ENOSPC on pwrite/pread) for FileBacked
//    and BlockDevice: the error comes from value(); the source stays live,
//    unchanged and unowned; the next move succeeds after clear_faults().
//  * A test route (TestRoute over TestCarrier, test_support.hpp) whose
//    transfers stay pending until the test completes or fails them: pending
//    state, completion, failure, out-of-order completion, dropped handles.
// No sleeps: everything waits on completions, and wait_for is only a guard.
#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <thread>

#include "strideweave/grad_mode.hpp"
#include "strideweave/io.hpp"
#include "carrier_kinds.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using std::chrono::milliseconds;

const DType& F32() { return DType::Float32(); }
const DType& I32() { return DType::Int32(); }
constexpr milliseconds kGuard{60000};  // generous upper bound; never reached when things work

struct CarrierState {
  bool released;
  int claims;
  uint64_t version;
  int64_t size;
  std::vector<Value> values;
  bool operator==(const CarrierState&) const = default;
};

CarrierState state_of(const Carrier& c) {
  return {c.is_released(), c.claim_count(), c.version(), c.size(), c.is_released() ? std::vector<Value>{} : bulk_snapshot(c)};
}

void PrintTo(const CarrierState& s, std::ostream* os) {
  *os << "{released=" << s.released << ", claims=" << s.claims << ", version=" << s.version << ", size=" << s.size
      << "}";
}

// Expected value at every logical ordinal of `t`, read before a move consumes it.
std::vector<Value> logical_values(const TensorImpl& t) {
  std::vector<Value> out;
  for (int64_t i = 0; i < t.layout.size(); ++i) out.push_back(t.carrier->get(t.offset + t.layout.index(i)));
  return out;
}

void expect_holds(const TensorPtr& result, const std::vector<Value>& expected) {
  ASSERT_EQ(result->layout.size(), static_cast<int64_t>(expected.size()));
  for (int64_t i = 0; i < result->layout.size(); ++i)
    ASSERT_EQ(result->carrier->get(result->offset + result->layout.index(i)), expected[static_cast<size_t>(i)])
        << "logical ordinal " << i;
}

// A final valid move: the inputs of a refused call are usable afterwards.
void expect_movable(const TensorPtr& t) {
  const std::vector<Value> expected = logical_values(*t);
  auto fresh = std::make_shared<CPUCarrier>(0, t->dtype(), true, false);
  TensorPtr r = move_to(t, fresh);
  EXPECT_EQ(r->carrier, fresh);
  expect_holds(r, expected);
  EXPECT_TRUE(t->carrier->is_released());
}

// ---------------------------------------------------------------- ordered checks, before work

class MoveChecks : public ::testing::Test {
 protected:
  void SetUp() override {
    test_route().reset(TestRoute::Mode::Pending);
    src = std::make_shared<CPUCarrier>(40, F32(), true, false);
    fill_slots(*src, 1);
    t = make_tensor(src, 2, layout);
    dst = std::make_shared<CPUCarrier>(40, F32(), true, false);
    fill_slots(*dst, 100);
  }
  void TearDown() override { EXPECT_EQ(test_route().queued(), 0u) << "a transfer was left pending"; }

  // `call` must raise E (message containing `fragment`) and change none of `watched`.
  template <class E>
  void expect_refused(const std::function<void()>& call, const std::string& fragment,
                      std::vector<CarrierPtr> watched, int prepare_delta = 0) {
    std::vector<CarrierState> before;
    for (const auto& c : watched) before.push_back(state_of(*c));
    const int prepares = test_route().prepares.load(), submits = test_route().submits.load();
    EXPECT_SW_THROW(E, fragment, call());
    for (size_t k = 0; k < watched.size(); ++k)
      EXPECT_EQ(state_of(*watched[k]), before[k]) << "carrier " << k << " (" << watched[k]->kind_name() << ") changed";
    EXPECT_EQ(test_route().prepares.load() - prepares, prepare_delta) << "route resolution reached";
    EXPECT_EQ(test_route().submits.load(), submits) << "work started";
  }

  const Layout layout{Shape::of({3, 4}), Stride::of({1, 5})};  // cosize 18
  CarrierPtr src, dst;
  TensorPtr t;
};

TEST_F(MoveChecks, LayoutUnderTest) { EXPECT_EQ(layout.cosize(), 18); }

TEST_F(MoveChecks, TensorIsCheckedFirst) {
  expect_refused<TypeError>([&] { (void)move_async(nullptr, dst); }, "tensor must be a Tensor", {src, dst});
  expect_refused<TypeError>([&] { (void)move_async(nullptr, nullptr); }, "tensor must be a Tensor", {src, dst});
  expect_movable(t);
}

TEST_F(MoveChecks, SourceReleasedComesBeforeTheDestination) {
  src->release();
  expect_refused<RuntimeError>([&] { (void)move_async(t, dst); }, "source CPU carrier is released", {src, dst});
  expect_refused<RuntimeError>([&] { (void)move_async(t, nullptr); }, "released", {src, dst});
  expect_refused<RuntimeError>([&] { (void)move_async(t, src); }, "released", {src, dst});
}

TEST_F(MoveChecks, SourceOwnedComesBeforeTheDestination) {
  {
    Carrier::Claim claim = src->claim("another request");
    expect_refused<RuntimeError>([&] { (void)move_async(t, dst); }, "owned by another request", {src, dst});
    expect_refused<RuntimeError>([&] { (void)move_async(t, nullptr); }, "owned by another request", {src, dst});
    expect_refused<RuntimeError>([&] { (void)move_async(t, src); }, "owned", {src, dst});
    EXPECT_EQ(src->claim_count(), 1);
  }
  expect_movable(t);
}

TEST_F(MoveChecks, DestinationMustBeACarrier) {
  expect_refused<TypeError>([&] { (void)move_async(t, nullptr); }, "Carrier instance", {src, dst});
  expect_movable(t);
}

TEST_F(MoveChecks, OwnCarrierComesBeforeDestinationState) {
  expect_refused<ValueError>([&] { (void)move_async(t, src); }, "own carrier", {src, dst});
  // The own carrier is refused as such even when it is immutable (a later check).
  auto frozen = std::make_shared<CPUCarrier>(20, F32(), false, false);
  auto ft = make_tensor(frozen, 0, layout);
  expect_refused<ValueError>([&] { (void)move_async(ft, frozen); }, "own carrier", {frozen});
  expect_movable(t);
  expect_movable(ft);  // an immutable source may be moved (and released) elsewhere
}

TEST_F(MoveChecks, DestinationReleasedComesBeforeDtype) {
  dst->release();
  expect_refused<RuntimeError>([&] { (void)move_async(t, dst); }, "destination CPU carrier is released", {src, dst});
  auto released_i32 = std::make_shared<CPUCarrier>(2, I32(), true, false);
  released_i32->release();
  expect_refused<RuntimeError>([&] { (void)move_async(t, released_i32); }, "released", {src, released_i32});
  expect_movable(t);
}

TEST_F(MoveChecks, DestinationNotPubliclyMutableComesBeforeDtypeAndSize) {
  auto frozen = std::make_shared<CPUCarrier>(40, F32(), false, false);
  expect_refused<RuntimeError>([&] { (void)move_async(t, frozen); }, "not publicly mutable", {src, frozen});
  auto frozen_small_i32 = std::make_shared<CPUCarrier>(3, I32(), false, false);
  expect_refused<RuntimeError>([&] { (void)move_async(t, frozen_small_i32); }, "not publicly mutable",
                               {src, frozen_small_i32});
  {
    Carrier::Claim claim = dst->claim("someone else");
    expect_refused<RuntimeError>([&] { (void)move_async(t, dst); }, "owned by another request", {src, dst});
  }
  expect_movable(t);
}

TEST_F(MoveChecks, DtypeMismatchComesBeforeSize) {
  auto i32 = std::make_shared<CPUCarrier>(40, I32(), true, false);
  expect_refused<TypeError>([&] { (void)move_async(t, i32); }, "dtype mismatch: the tensor is Float32", {src, i32});
  auto small_i32 = std::make_shared<CPUCarrier>(3, I32(), true, false);
  expect_refused<TypeError>([&] { (void)move_async(t, small_i32); }, "dtype mismatch", {src, small_i32});
  auto bool_dest = std::make_shared<GenericCarrier>(40, DType::Bool(), true);
  expect_refused<TypeError>([&] { (void)move_async(t, bool_dest); }, "Bool", {src, bool_dest});
  expect_movable(t);
}

TEST_F(MoveChecks, TooSmallAndNotAllocatableComesBeforeRoute) {
  auto small = std::make_shared<CPUCarrier>(17, F32(), true, false);
  expect_refused<ValueError>([&] { (void)move_async(t, small); }, "has 17 slots but the layout needs 18", {src, small});
  // Evictable has no route from CPU, but the size check comes first.
  auto small_e = std::make_shared<EvictableCarrier>(std::make_shared<CPUCarrier>(10, F32(), true, false),
                                                    std::make_shared<FileBackedCarrier>("", F32(), true));
  expect_refused<ValueError>([&] { (void)move_async(t, small_e); }, "not allocatable", {src, small_e});
  expect_movable(t);
}

TEST_F(MoveChecks, NoRouteBetweenExactKinds) {
  // (Evictable joins the built-in routes between shipped carriers; a user kind without a route or
  // element-wise fallback has none.)
  auto user = make_test_carrier(40, F32(), true, /*fallback=*/false);
  fill_slots(*user, 3);
  auto ut = make_tensor(user, 2, layout);
  auto generic = std::make_shared<GenericCarrier>(40, F32(), true);
  expect_refused<NotImplementedError>([&] { (void)move_async(ut, generic); }, "no route from TestCarrier to Generic",
                                      {user, generic});
}

TEST_F(MoveChecks, RegisteredRouteUnsupported) {
  auto user = make_test_carrier(40, F32());
  fill_slots(*user, 3);
  auto ut = make_tensor(user, 2, layout);
  test_route().reset(TestRoute::Mode::Unsupported);
  expect_refused<NotImplementedError>([&] { (void)move_async(ut, dst); }, "the test route refuses this request",
                                      {user, dst}, /*prepare_delta=*/1);
  expect_refused<NotImplementedError>([&] { (void)move_async(ut, dst); }, "no route from TestCarrier to CPU",
                                      {user, dst}, 1);
  test_route().reset(TestRoute::Mode::Synchronous);
  expect_movable(ut);
}

TEST_F(MoveChecks, ChecksBeforeTheRouteNeverReachPrepare) {
  auto user = make_test_carrier(40, F32());
  auto ut = make_tensor(user, 2, layout);
  auto small = std::make_shared<CPUCarrier>(5, F32(), true, false);
  expect_refused<ValueError>([&] { (void)move_async(ut, small); }, "not allocatable", {user, small}, 0);
  auto i32 = std::make_shared<CPUCarrier>(40, I32(), true, false);
  expect_refused<TypeError>([&] { (void)move_async(ut, i32); }, "dtype mismatch", {user, i32}, 0);
}

TEST_F(MoveChecks, MissingReverseRouteUnderGradMode) {
  // TestCarrier -> FileBacked is registered; FileBacked -> TestCarrier is not, and this
  // TestCarrier refuses the element-wise fallback.
  auto user = make_test_carrier(40, F32());
  fill_slots(*user, 3);
  auto ut = make_tensor(user, 2, layout);
  auto fb = std::make_shared<FileBackedCarrier>("", F32(), true);
  ASSERT_TRUE(is_grad_enabled());
  // Refused before the request is accepted: the provider never prepares (Note [Moves own before they prepare]).
  expect_refused<NotImplementedError>([&] { (void)move_async(ut, fb); },
                                      "no reverse route from FileBacked to TestCarrier", {user, fb}, 0);
  // Without grad mode (or for a non-differentiable dtype) the move goes ahead.
  test_route().reset(TestRoute::Mode::Synchronous);
  const std::vector<Value> expected = logical_values(*ut);
  {
    GradModeGuard off(false);
    TensorPtr r = move_to(ut, fb);
    expect_holds(r, expected);
  }
  auto user_i32 = make_test_carrier(20, I32());
  fill_slots(*user_i32, 4);
  auto it = make_tensor(user_i32, 0, column_major(Shape::of({20})));
  TensorPtr r = move_to(it, std::make_shared<FileBackedCarrier>("", I32(), true));
  EXPECT_EQ(r->carrier->get(19), value_for(I32(), 23));
}

// ---------------------------------------------------------------- success between native storage kinds

// The native storage kinds, from the carrier registry (carrier_kinds.hpp); each is made mutable here.
struct StorageKind {
  const KindSpec* spec;
  const char* name;
  CarrierPtr make(KindEnv& env, int64_t n, const DType& d) const { return spec->make(env, n, d, true); }
};

const std::vector<StorageKind>& storage_kinds() {
  static const std::vector<StorageKind> k = [] {
    std::vector<StorageKind> out;
    for (const char* name : {"Generic", "CPU", "FileBacked", "BlockDevice"}) out.push_back({&kind_named(name), name});
    return out;
  }();
  return k;
}

struct LayoutCase {
  const char* name;
  int64_t offset;
  Layout layout;
};

std::vector<LayoutCase> layout_cases() {
  return {
      {"dense", 0, column_major(Shape::of({5, 6}))},
      {"strided_offset", 7, Layout(Shape::of({3, 4}), Stride::of({2, 9}))},
      {"nested_offset", 3, Layout(Shape::of({2, IntTuple::tuple({3, 2})}), Stride::of({1, IntTuple::tuple({4, 13})}))},
      {"row_major_offset", 11, row_major(Shape::of({4, 5}))},
      {"broadcast_offset", 5, Layout(Shape::of({4, 3}), Stride::of({1, 0}))},
      {"scalar_offset", 9, Layout()},
  };
}

enum class DestSize { Exact, Larger, Allocatable };

class MoveBetweenKinds : public ::testing::TestWithParam<std::tuple<size_t, size_t>> {
 protected:
  KindEnv env_;
};

TEST_P(MoveBetweenKinds, PublishesTheResultAndConsumesTheSource) {
  const StorageKind& sk = storage_kinds()[std::get<0>(GetParam())];
  const StorageKind& dk = storage_kinds()[std::get<1>(GetParam())];
  int cases = 0;
  for (const LayoutCase& lc : layout_cases()) {
    for (const DType* dt : {&F32(), &I32()}) {
      if (dt == &I32() && std::string(lc.name) != "strided_offset") continue;
      for (DestSize ds : {DestSize::Exact, DestSize::Larger, DestSize::Allocatable}) {
        SCOPED_TRACE(std::string(lc.name) + " " + dt->name() + " dest " +
                     (ds == DestSize::Exact ? "exact" : ds == DestSize::Larger ? "larger" : "allocatable"));
        const int64_t need = lc.layout.cosize();
        CarrierPtr src = sk.make(env_, 64, *dt);
        fill_slots(*src, 1);
        const uint64_t src_version = src->version();
        TensorPtr t = make_tensor(src, lc.offset, lc.layout);
        const std::vector<Value> expected = logical_values(*t);
        const int64_t dsize = ds == DestSize::Exact ? need : ds == DestSize::Larger ? need + 9 : 0;
        CarrierPtr dst = dk.make(env_, dsize, *dt);
        fill_slots(*dst, 500);
        const uint64_t v = dst->version();

        auto handle = move_async(t, dst);
        ASSERT_NE(handle, nullptr);
        TensorPtr r = handle->value();
        ++cases;
        EXPECT_TRUE(handle->done());
        EXPECT_EQ(handle->error(), nullptr);
        ASSERT_NE(r, nullptr);
        EXPECT_EQ(r->carrier, dst);
        EXPECT_EQ(r->offset, 0);
        EXPECT_EQ(r->layout, lc.layout);
        EXPECT_EQ(&handle->value(), &handle->value()) << "every value() returns the same result";
        EXPECT_EQ(dst->version(), v + 1) << "a move bumps the destination once";
        EXPECT_EQ(dst->size(), std::max(dsize, need));
        EXPECT_FALSE(dst->is_owned());
        EXPECT_TRUE(dst->is_mutable());
        EXPECT_TRUE(src->is_released()) << "a move consumes its source";
        EXPECT_FALSE(src->is_owned());
        EXPECT_EQ(src->version(), src_version);
        expect_holds(r, expected);
        // Slots outside the layout's image keep their values (or are zero when grown).
        std::set<int64_t> image;
        for (int64_t i = 0; i < lc.layout.size(); ++i) image.insert(lc.layout.index(i));
        const std::vector<Value> after = bulk_snapshot(*dst);
        for (int64_t s = 0; s < dst->size(); ++s) {
          if (image.count(s)) continue;
          const Value want = ds == DestSize::Allocatable ? zero_of(*dt) : value_for(*dt, s + 500);
          ASSERT_EQ(after[static_cast<size_t>(s)], want) << "slot " << s << " outside the layout changed";
        }
      }
    }
  }
  EXPECT_EQ(cases, 21);
}

std::string kind_pair_name(const ::testing::TestParamInfo<std::tuple<size_t, size_t>>& info) {
  return std::string(storage_kinds()[std::get<0>(info.param)].name) + "_to_" +
         storage_kinds()[std::get<1>(info.param)].name;
}

INSTANTIATE_TEST_SUITE_P(NativePairs, MoveBetweenKinds,
                         ::testing::Combine(::testing::Range<size_t>(0, 4), ::testing::Range<size_t>(0, 4)),
                         kind_pair_name);

TEST(Move, BlockingMoveIsMoveAsyncWait) {
  auto src = std::make_shared<CPUCarrier>(6, F32(), true, false);
  fill_slots(*src, 2);
  auto t = make_tensor(src, 0, column_major(Shape::of({2, 3})));
  const auto expected = logical_values(*t);
  auto dst = std::make_shared<GenericCarrier>(0, F32(), true);
  TensorPtr r = move_to(t, dst);
  expect_holds(r, expected);
  EXPECT_TRUE(src->is_released());
  // The result is an ordinary tensor: it can be moved on.
  auto fb = std::make_shared<FileBackedCarrier>("", F32(), true);
  TensorPtr r2 = move_to(r, fb);
  expect_holds(r2, expected);
  EXPECT_TRUE(dst->is_released());
  EXPECT_EQ(fb->version(), 1u);
}

TEST(Move, ConcurrentRoundTripsKeepValues) {
  constexpr int kThreads = 4, kRounds = 8;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int th = 0; th < kThreads; ++th)
    threads.emplace_back([&ok, th] {
      auto c = std::make_shared<CPUCarrier>(257, F32(), true, false);
      fill_slots(*c, th * 1000);
      TensorPtr t = make_tensor(c, 1, column_major(Shape::of({16, 16})));
      const auto expected = logical_values(*t);
      for (int r = 0; r < kRounds; ++r) {
        CarrierPtr next = (r % 2 == 0) ? CarrierPtr(std::make_shared<FileBackedCarrier>("", F32(), true))
                                       : CarrierPtr(std::make_shared<CPUCarrier>(0, F32(), true, false));
        t = move_to(t, next);
      }
      bool same = true;
      for (int64_t i = 0; i < 256; ++i) same = same && t->carrier->get(t->offset + t->layout.index(i)) == expected[i];
      if (same) ok.fetch_add(1);
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), kThreads);
}

// ---------------------------------------------------------------- failures through io::inject

struct FaultCase {
  const char* name;
  size_t src_kind, dst_kind;  // indices into storage_kinds()
  io::Op op;
  int error;
  const char* fragment;
  bool allocatable_destination;
};

class MoveFaults : public ::testing::TestWithParam<FaultCase> {
 protected:
  void TearDown() override { io::clear_faults(); }
  KindEnv env_;
};

TEST_P(MoveFaults, FailureLeavesTheSourceLiveAndTheNextMoveSucceeds) {
  const FaultCase& fc = GetParam();
  const StorageKind& sk = storage_kinds()[fc.src_kind];
  const StorageKind& dk = storage_kinds()[fc.dst_kind];
  const Layout layout(Shape::of({4, 5}), Stride::of({1, 7}));  // strided: several runs
  CarrierPtr src = sk.make(env_, 48, F32());
  fill_slots(*src, 3);
  TensorPtr t = make_tensor(src, 4, layout);
  const std::vector<Value> expected = logical_values(*t);
  CarrierPtr dst = dk.make(env_, fc.allocatable_destination ? 0 : 40, F32());
  const CarrierState src_before = state_of(*src);
  const uint64_t dst_version = dst->version();
  const int64_t free_before = fc.dst_kind == 3 ? env_.device()->free_bytes() : 0;

  io::inject(fc.op, fc.error, -1);
  auto handle = move_async(t, dst);  // checks pass; the failure is the work's
  ASSERT_TRUE(handle->wait_for(kGuard));
  EXPECT_TRUE(handle->done());
  std::exception_ptr e1 = handle->error();
  ASSERT_NE(e1, nullptr);
  const void* first = nullptr;
  for (int k = 0; k < 2; ++k) {
    try {
      (void)handle->value();
      ADD_FAILURE() << "value() did not raise";
    } catch (const RuntimeError& e) {
      EXPECT_NE(std::string(e.what()).find(fc.fragment), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(io::Op::Pread == fc.op ? "pread of " : "pwrite of "), std::string::npos)
          << e.what();
      if (!first) first = &e;
      EXPECT_EQ(static_cast<const void*>(&e), first) << "value() raises the same exception object";
    }
  }
  EXPECT_EQ(handle->error(), e1);
  io::clear_faults();

  EXPECT_EQ(state_of(*src), src_before) << "the source is live, unowned and unchanged";
  EXPECT_FALSE(dst->is_owned());
  EXPECT_FALSE(dst->is_released());
  EXPECT_EQ(dst->version(), dst_version) << "a failed move is not a write";
  if (fc.dst_kind == 3 && fc.allocatable_destination)
    EXPECT_EQ(env_.device()->free_bytes(), free_before) << "a failed grow returns its extent";

  TensorPtr r = move_to(t, dst);
  EXPECT_EQ(r->carrier, dst);
  expect_holds(r, expected);
  EXPECT_EQ(dst->version(), dst_version + 1);
  EXPECT_TRUE(src->is_released());
}

std::string fault_name(const ::testing::TestParamInfo<FaultCase>& info) { return info.param.name; }

// storage_kinds(): 0 Generic, 1 CPU, 2 FileBacked, 3 BlockDevice
INSTANTIATE_TEST_SUITE_P(
    InjectedIo, MoveFaults,
    ::testing::Values(FaultCase{"CPU_to_FileBacked_pwrite_EIO", 1, 2, io::Op::Pwrite, EIO, "(EIO)", false},
                      FaultCase{"CPU_to_FileBacked_pwrite_ENOSPC", 1, 2, io::Op::Pwrite, ENOSPC, "(ENOSPC)", false},
                      FaultCase{"CPU_to_allocatable_FileBacked_ENOSPC", 1, 2, io::Op::Pwrite, ENOSPC, "No space left", true},
                      FaultCase{"FileBacked_to_CPU_pread_EIO", 2, 1, io::Op::Pread, EIO, "(EIO)", false},
                      FaultCase{"FileBacked_to_Generic_pread_EIO", 2, 0, io::Op::Pread, EIO, "Input/output error", false},
                      FaultCase{"Generic_to_BlockDevice_pwrite_EIO", 0, 3, io::Op::Pwrite, EIO, "(EIO)", false},
                      FaultCase{"CPU_to_BlockDevice_pwrite_ENOSPC", 1, 3, io::Op::Pwrite, ENOSPC, "(ENOSPC)", false},
                      FaultCase{"CPU_to_allocatable_BlockDevice_EIO", 1, 3, io::Op::Pwrite, EIO, "(EIO)", true},
                      FaultCase{"BlockDevice_to_CPU_pread_EIO", 3, 1, io::Op::Pread, EIO, "(EIO)", false},
                      FaultCase{"BlockDevice_to_FileBacked_pread_EIO", 3, 2, io::Op::Pread, EIO, "(EIO)", false},
                      FaultCase{"FileBacked_to_BlockDevice_pwrite_ENOSPC", 2, 3, io::Op::Pwrite, ENOSPC, "(ENOSPC)", false}),
    fault_name);

TEST(MoveFaultsOnce, AOneShotFaultFailsOneMoveOnly) {
  io::clear_faults();
  auto src = std::make_shared<CPUCarrier>(10, F32(), true, false);
  fill_slots(*src, 1);
  auto t = make_tensor(src, 0, column_major(Shape::of({10})));
  auto dst = std::make_shared<FileBackedCarrier>("", F32(), true);
  dst->grow(10, true);
  io::inject(io::Op::Pwrite, EIO, 1);
  auto h = move_async(t, dst);
  EXPECT_SW_THROW(RuntimeError, "(EIO)", h->value());
  TensorPtr r = move_to(t, dst);  // the fault was used up
  EXPECT_EQ(r->carrier->get(9), value_for(F32(), 10));
  io::clear_faults();
}

// ---------------------------------------------------------------- a test route that the test drives

class TestRouteMoves : public ::testing::Test {
 protected:
  void SetUp() override {
    test_route().reset(TestRoute::Mode::Pending);
    src = make_test_carrier(30, F32());
    fill_slots(*src, 5);
    t = make_tensor(src, 3, layout);
    expected = logical_values(*t);
    dst = std::make_shared<CPUCarrier>(30, F32(), true, false);
  }
  void TearDown() override {
    // Never leave a worker blocked on a transfer.
    while (auto p = test_route().take()) p->fail(std::make_exception_ptr(RuntimeError("test teardown")));
  }
  const Layout layout{Shape::of({3, 4}), Stride::of({1, 6})};  // cosize 21
  std::shared_ptr<TestCarrier> src;
  TensorPtr t;
  std::vector<Value> expected;
  CarrierPtr dst;
};

TEST_F(TestRouteMoves, BothCarriersAreOwnedBeforePrepareAndTheProviderMayWriteItsDestination) {
  // Note [Moves own before they prepare].
  bool checked = false;
  test_route().on_prepare = [&](const TransferRequest& r) {
    EXPECT_TRUE(r.tensor->carrier->is_owned());
    EXPECT_TRUE(r.destination->is_owned());
    EXPECT_EQ(r.destination->owner_description(), "a move");
    EXPECT_SW_THROW(RuntimeError, "owned by a move", r.tensor->carrier->set(0, F(1.0)));
    EXPECT_SW_THROW(RuntimeError, "owned by a move", r.tensor->carrier->release());
    EXPECT_SW_THROW(RuntimeError, "owned", r.destination->release());
    r.destination->set(29, F(7.0));  // the provider's own write to its in-flight destination
    std::thread other([&] {           // ... but nobody else's
      EXPECT_SW_THROW(RuntimeError, "owned by a move", r.destination->set(28, F(1.0)));
    });
    other.join();
    checked = true;
  };
  const uint64_t v0 = dst->version();
  auto h = move_async(t, dst);
  EXPECT_TRUE(checked);
  auto p = test_route().take();
  ASSERT_NE(p, nullptr);
  p->complete();
  TensorPtr r = h->value();
  EXPECT_EQ(r->carrier, dst);
  expect_holds(r, expected);
  EXPECT_EQ(dst->get(29), F(7.0));
  EXPECT_EQ(dst->version(), v0 + 2);  // the provider's write and the move
}

TEST_F(TestRouteMoves, AnUnsupportedOrFailingPrepareEndsTheClaims) {
  test_route().on_prepare = [](const TransferRequest& r) {
    EXPECT_TRUE(r.tensor->carrier->is_owned() && r.destination->is_owned());
    raise<ValueError>("prepare failed on purpose");
  };
  EXPECT_SW_THROW(ValueError, "prepare failed on purpose", (void)move_async(t, dst));
  EXPECT_FALSE(src->is_owned());
  EXPECT_FALSE(dst->is_owned());
  test_route().reset(TestRoute::Mode::Unsupported);
  EXPECT_SW_THROW(NotImplementedError, "TestCarrier, CPU", (void)move_async(t, dst));
  EXPECT_FALSE(src->is_owned());
  EXPECT_FALSE(dst->is_owned());
  dst->set(0, F(1.0));  // both usable
  EXPECT_EQ(src->release_calls.load(), 0);
}

TEST_F(TestRouteMoves, PendingUntilCompleted) {
  const int submits = test_route().submits.load();
  auto h = move_async(t, dst);
  EXPECT_EQ(test_route().submits.load(), submits + 1) << "submit is called exactly once";
  ASSERT_EQ(test_route().queued(), 1u);
  EXPECT_FALSE(h->done());
  EXPECT_FALSE(h->wait_for(milliseconds(0)));
  // Both carriers are owned while the move is in flight.
  EXPECT_TRUE(src->is_owned());
  EXPECT_TRUE(dst->is_owned());
  EXPECT_FALSE(src->is_mutable());
  EXPECT_FALSE(dst->is_mutable());
  EXPECT_EQ(src->owner_description(), "a move");
  EXPECT_SW_THROW(RuntimeError, "owned by a move", src->set(0, F(1.0)));
  EXPECT_SW_THROW(RuntimeError, "owned by a move", dst->set(0, F(1.0)));
  EXPECT_SW_THROW(RuntimeError, "owned", src->release());
  EXPECT_SW_THROW(RuntimeError, "owned", dst->release());
  EXPECT_EQ(src->get(3), value_for(F32(), 8)) << "others may read an owned carrier";
  // Neither carrier can join another move meanwhile.
  EXPECT_SW_THROW(RuntimeError, "owned by a move", (void)move_async(t, std::make_shared<CPUCarrier>(30, F32(), true, false)));
  auto other = std::make_shared<CPUCarrier>(30, F32(), true, false);
  EXPECT_SW_THROW(RuntimeError, "owned by another request", (void)move_async(make_tensor(other, 0, layout), dst));
  EXPECT_EQ(src->release_calls.load(), 0);

  auto p = test_route().take();
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->request.tensor, t);
  EXPECT_EQ(p->request.destination, dst);
  EXPECT_EQ(p->request.source_kind, &test_kind());
  EXPECT_EQ(p->request.destination_kind, &cpu_kind());
  EXPECT_EQ(p->request.dtype, &F32());
  EXPECT_EQ(p->request.layout, layout);
  EXPECT_EQ(p->request.physical_span, 21);  // the layout's cosize
  EXPECT_FALSE(h->done()) << "still pending until the test decides";

  p->complete();
  TensorPtr r = h->value();
  EXPECT_TRUE(h->done());
  EXPECT_EQ(r->carrier, dst);
  EXPECT_EQ(r->offset, 0);
  EXPECT_EQ(r->layout, layout);
  expect_holds(r, expected);
  EXPECT_EQ(dst->version(), 1u);
  EXPECT_FALSE(dst->is_owned());
  EXPECT_TRUE(src->is_released());
  EXPECT_FALSE(src->is_owned());
  EXPECT_EQ(src->release_calls.load(), 1) << "the provider's release runs exactly once";
  src->release();
  EXPECT_EQ(src->release_calls.load(), 1);
}

TEST_F(TestRouteMoves, FailureRaisesTheSameExceptionAndLeavesTheSourceLive) {
  const CarrierState src_before = state_of(*src);
  const CarrierState dst_before = state_of(*dst);
  auto h = move_async(t, dst);
  auto p = test_route().take();
  ASSERT_NE(p, nullptr);
  p->fail(std::make_exception_ptr(RuntimeError("the transfer was lost on purpose")));
  ASSERT_TRUE(h->wait_for(kGuard));
  const std::exception_ptr e = h->error();
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(h->error(), e);
  const void* first = nullptr;
  for (int k = 0; k < 2; ++k) {
    try {
      (void)h->value();
      ADD_FAILURE() << "value() did not raise";
    } catch (const RuntimeError& x) {
      EXPECT_STREQ(x.what(), "the transfer was lost on purpose");
      if (!first) first = &x;
      EXPECT_EQ(static_cast<const void*>(&x), first) << "the same exception object every time";
    }
  }
  EXPECT_EQ(state_of(*src), src_before) << "the source is live, unowned and unchanged";
  EXPECT_EQ(state_of(*dst), dst_before) << "the destination is unowned and unchanged";
  EXPECT_EQ(src->release_calls.load(), 0);
  EXPECT_TRUE(src->is_mutable());

  // The next move succeeds.
  auto h2 = move_async(t, dst);
  auto p2 = test_route().take();
  ASSERT_NE(p2, nullptr);
  p2->complete();
  expect_holds(h2->value(), expected);
  EXPECT_EQ(src->release_calls.load(), 1);
}

TEST_F(TestRouteMoves, DroppedHandleWhilePending) {
  // Held by the callback too, so it outlives the worker's use of it.
  auto finished = std::make_shared<Completion<bool>>();
  std::weak_ptr<Completion<TensorPtr>> weak;
  {
    auto h = move_async(t, dst);
    weak = h;
    h->then([finished] { finished->set_value(true); });
  }  // the caller's handle is gone while the transfer is pending
  EXPECT_FALSE(weak.expired()) << "the work holds its own state";
  EXPECT_TRUE(src->is_owned());
  EXPECT_TRUE(dst->is_owned());
  auto p = test_route().take();
  ASSERT_NE(p, nullptr);
  t.reset();  // the tensor may go too: the request holds what it needs
  p->complete();
  p.reset();
  finished->wait();
  EXPECT_TRUE(src->is_released());
  EXPECT_EQ(src->release_calls.load(), 1);
  EXPECT_FALSE(dst->is_owned());
  EXPECT_EQ(dst->version(), 1u);
  for (int64_t i = 0; i < layout.size(); ++i)
    ASSERT_EQ(dst->get(layout.index(i)), expected[static_cast<size_t>(i)]) << i;
}

TEST_F(TestRouteMoves, DroppedHandleThenFailure) {
  auto finished = std::make_shared<Completion<bool>>();
  {
    auto h = move_async(t, dst);
    h->then([finished] { finished->set_value(true); });
  }
  auto p = test_route().take();
  ASSERT_NE(p, nullptr);
  p->fail(std::make_exception_ptr(RuntimeError("nobody is listening")));
  finished->wait();
  EXPECT_FALSE(src->is_released());
  EXPECT_FALSE(src->is_owned());
  EXPECT_FALSE(dst->is_owned());
  EXPECT_EQ(dst->version(), 0u);
  EXPECT_EQ(src->release_calls.load(), 0);
}

TEST_F(TestRouteMoves, IndependentTransfersCompleteInAnyOrder) {
  constexpr int kMoves = 3;
  std::vector<std::shared_ptr<TestCarrier>> srcs;
  std::vector<CarrierPtr> dsts;
  std::vector<CompletionPtr<TensorPtr>> handles;
  std::vector<std::shared_ptr<PendingTransfer>> pending;
  for (int k = 0; k < kMoves; ++k) {
    srcs.push_back(make_test_carrier(8, F32()));
    fill_slots(*srcs.back(), 10 * k);
    dsts.push_back(std::make_shared<CPUCarrier>(8, F32(), true, false));
    handles.push_back(move_async(make_tensor(srcs.back(), 0, column_major(Shape::of({8}))), dsts.back()));
    pending.push_back(test_route().take());
    ASSERT_NE(pending.back(), nullptr);
  }
  pending[2]->complete();
  ASSERT_TRUE(handles[2]->wait_for(kGuard)) << "a later transfer must not wait behind pending ones";
  EXPECT_EQ(handles[2]->value()->carrier->get(7), value_for(F32(), 27));
  EXPECT_FALSE(handles[0]->done());
  EXPECT_FALSE(handles[1]->done());
  EXPECT_TRUE(srcs[0]->is_owned());
  pending[1]->fail(std::make_exception_ptr(ValueError("second fails")));
  ASSERT_TRUE(handles[1]->wait_for(kGuard));
  EXPECT_SW_THROW(ValueError, "second fails", handles[1]->value());
  EXPECT_FALSE(handles[0]->done());
  pending[0]->complete();
  EXPECT_EQ(handles[0]->value()->carrier->get(0), value_for(F32(), 0));
  EXPECT_TRUE(srcs[0]->is_released());
  EXPECT_FALSE(srcs[1]->is_released());
  EXPECT_TRUE(srcs[2]->is_released());
}

TEST_F(TestRouteMoves, AllocatableDestinationGrowsBeforeSubmit) {
  auto empty = std::make_shared<CPUCarrier>(0, F32(), true, false);
  auto h = move_async(t, empty);
  EXPECT_EQ(empty->size(), 21) << "grown to the layout's cosize before the transfer is submitted";
  EXPECT_TRUE(empty->is_owned());
  auto p = test_route().take();
  ASSERT_NE(p, nullptr);
  p->complete();
  expect_holds(h->value(), expected);
  EXPECT_EQ(empty->version(), 1u);
}

TEST_F(TestRouteMoves, SynchronousSubmitCompletes) {
  test_route().reset(TestRoute::Mode::Synchronous);
  auto h = move_async(t, dst);
  EXPECT_EQ(test_route().queued(), 0u);
  expect_holds(h->value(), expected);
  EXPECT_TRUE(src->is_released());
  EXPECT_EQ(dst->version(), 1u);
}

TEST_F(TestRouteMoves, SubmitThatThrowsFailsTheRequest) {
  test_route().reset(TestRoute::Mode::SubmitThrows);
  const CarrierState src_before = state_of(*src);
  auto h = move_async(t, dst);
  EXPECT_TRUE(h->done()) << "a failed submit fails the request at once";
  EXPECT_SW_THROW(RuntimeError, "submit failed on purpose", h->value());
  EXPECT_EQ(state_of(*src), src_before);
  EXPECT_FALSE(dst->is_owned());
  EXPECT_EQ(dst->version(), 0u);
  test_route().reset(TestRoute::Mode::Synchronous);
  expect_holds(move_to(t, dst), expected);
}

TEST_F(TestRouteMoves, MovesIntoTheUserKind) {
  auto cpu = std::make_shared<CPUCarrier>(25, F32(), true, false);
  fill_slots(*cpu, 40);
  auto ct = make_tensor(cpu, 4, layout);
  const auto want = logical_values(*ct);
  auto user = make_test_carrier(0, F32());  // allocatable through its provider
  EXPECT_TRUE(user->is_allocatable());
  auto h = move_async(ct, user);
  EXPECT_EQ(user->size(), 21);
  auto p = test_route().take();
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->request.source_kind, &cpu_kind());
  EXPECT_EQ(p->request.destination_kind, &test_kind());
  p->complete();
  TensorPtr r = h->value();
  EXPECT_EQ(r->carrier, user);
  expect_holds(r, want);
  EXPECT_TRUE(cpu->is_released());
}

TEST(FallbackRoute, ElementwiseBetweenFallbackCarriers) {
  auto user = make_test_carrier(30, F32(), true, /*fallback=*/true);
  fill_slots(*user, 2);
  const Layout l(Shape::of({2, 3}), Stride::of({5, 1}));
  auto t = make_tensor(user, 4, l);
  const auto want = logical_values(*t);
  const int prepares = test_route().prepares.load();
  auto g = std::make_shared<GenericCarrier>(0, F32(), true);
  TensorPtr r = move_to(t, g);
  expect_holds(r, want);
  EXPECT_EQ(test_route().prepares.load(), prepares) << "no registered route is involved";
  EXPECT_EQ(user->release_calls.load(), 1);
  auto back = make_test_carrier(0, F32(), true, true);
  TensorPtr r2 = move_to(r, back);
  expect_holds(r2, want);
  EXPECT_TRUE(g->is_released());
}

// Note [Letting go before completing]: once a move reports completion, its job holds neither the source nor the
// destination, so whoever waited can count on the references it sees (the result holds the destination).
TEST(MoveCompletion, AWaitedMoveHoldsNoReferenceToItsCarriers) {
  GradModeGuard off(false);
  int extra_source = 0, extra_destination = 0;
  for (int round = 0; round < 2000; ++round) {
    auto src = std::make_shared<CPUCarrier>(64, DType::Float32(), true, false);
    auto dst = std::make_shared<CPUCarrier>(0, DType::Float32(), true, false);
    TensorPtr t = make_tensor(src, 0, column_major(Shape::flat({64})));
    TensorPtr moved = move_async(t, dst)->value();
    extra_destination += dst.use_count() != 2;  // ours and the result's
    t.reset();
    extra_source += src.use_count() != 1;
  }
  EXPECT_EQ(extra_source, 0);
  EXPECT_EQ(extra_destination, 0);
}

}  // namespace
}  // namespace sw
