// Borrowed memory whose owner can move it (Note [Borrowed memory] in native.cpp): a CPU carrier given a
// BorrowedMemoryCheck runs it in check_live(), so every checked entry point (an element read or write, an
// operation, an export) fails with the check's error once the owner says the memory moved, before any byte is
// read or written; a carrier without one, or over memory that stays, is unaffected.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/tensor.hpp"

namespace sw {
namespace {

// An owner that moves its memory when told to, counting the checks.
struct MovableOwner final : BorrowedMemoryCheck {
  void check(const char* action) const override {
    ++checks;
    if (moved) raise<RuntimeError>("cannot ", action, ": the test's owner moved its memory");
  }
  mutable std::atomic<int> checks{0};
  std::atomic<bool> moved{false};
};

TEST(BorrowedMemoryCheck, EveryCheckedUseFailsOnceTheOwnerMovedTheMemory) {
  auto values = std::make_shared<std::vector<float>>(std::vector<float>{1, 2, 3, 4});
  auto owner = std::make_shared<MovableOwner>();
  auto c = std::make_shared<CPUCarrier>(reinterpret_cast<std::byte*>(values->data()), 4, DType::Float32(), true,
                                        values, owner);
  EXPECT_EQ(c->get(2), Value::from_float(3.0));
  c->set(0, Value::from_float(9.0));
  EXPECT_EQ((*values)[0], 9.0f);
  EXPECT_NO_THROW(c->check_live("compute with it"));
  EXPECT_GE(owner->checks.load(), 3);  // each use asked

  owner->moved = true;
  auto fails = [](auto use, const std::string& fragment) {
    try {
      use();
      ADD_FAILURE() << "no error for " << fragment;
    } catch (const RuntimeError& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  fails([&] { (void)c->get(1); }, "cannot read: the test's owner moved its memory");
  fails([&] { c->set(1, Value::from_float(-1.0)); }, "cannot write: the test's owner moved its memory");
  fails([&] { c->check_live("compute with it"); }, "cannot compute with it: the test's owner moved");
  auto t = make_tensor(c, 0, column_major(Shape::of({4})));
  fails([&] { (void)t->get(Coord(IntTuple(0))); }, "cannot read a tensor element: the test's owner moved");
  EXPECT_EQ((*values)[1], 2.0f);  // the refused write reached nothing

  owner->moved = false;  // memory that is back in place is usable again
  EXPECT_EQ(c->get(1), Value::from_float(2.0));
}

TEST(BorrowedMemoryCheck, AReleasedCarrierSaysReleasedWithoutAskingTheOwner) {
  auto values = std::make_shared<std::vector<float>>(2, 0.0f);
  auto owner = std::make_shared<MovableOwner>();
  auto c = std::make_shared<CPUCarrier>(reinterpret_cast<std::byte*>(values->data()), 2, DType::Float32(), true,
                                        values, owner);
  owner->moved = true;
  c->release();
  const int before = owner->checks.load();
  try {
    c->check_live("read");
    ADD_FAILURE() << "no error";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("carrier is released"), std::string::npos) << e.what();
  }
  EXPECT_EQ(owner->checks.load(), before);
}

TEST(BorrowedMemoryCheck, CarriersWithoutOneAreNotAsked) {
  auto values = std::make_shared<std::vector<float>>(2, 5.0f);
  CPUCarrier borrowed(reinterpret_cast<std::byte*>(values->data()), 2, DType::Float32(), true, values);
  EXPECT_NO_THROW(borrowed.check_live("read"));
  EXPECT_EQ(borrowed.get(1), Value::from_float(5.0));
  CPUCarrier owned(2, DType::Float32(), true, false);
  EXPECT_NO_THROW(owned.check_live("read"));
}

}  // namespace
}  // namespace sw
