// A CPU carrier over memory it does not own (Note [Borrowed memory] in native.cpp; the DLPack import of
// docs/guide.md, "Carriers"): no copy, the owner held by the carrier and by every export of it until the last
// one lets go, never shared copy-on-write, and a misaligned address refused before anything is held.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"

namespace sw {
namespace {

// Memory of `n` floats 0, 1, 2, ... and a weak view of its owner, to see when the last holder lets go.
struct Owned {
  explicit Owned(size_t n) : values(std::make_shared<std::vector<float>>(n)) {
    for (size_t i = 0; i < n; ++i) (*values)[i] = static_cast<float>(i);
    watch = values;
  }
  std::byte* data() const { return reinterpret_cast<std::byte*>(values->data()); }
  std::shared_ptr<std::vector<float>> values;
  std::weak_ptr<std::vector<float>> watch;
};

TEST(BorrowedMemory, ReadsAndWritesTheOwnersBytesInPlace) {
  Owned m(8);
  CPUCarrier c(m.data(), 8, DType::Float32(), true, m.values);
  EXPECT_EQ(c.native_data(), m.data());  // no copy
  EXPECT_EQ(c.size(), 8);
  float out[8];
  c.read_slots(0, 8, out);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(out[i], static_cast<float>(i));
  const float seven = 7.5f;
  c.write_slots(3, 1, &seven);
  EXPECT_EQ((*m.values)[3], 7.5f);  // written where the owner sees it
  (*m.values)[5] = -1.0f;
  EXPECT_EQ(c.read_value(5), Value::from_float(-1.0));  // and the owner's writes are seen
  EXPECT_EQ(c.mutable_native_data(), m.data());  // alone, a writer never takes a private copy
}

TEST(BorrowedMemory, TheOwnerLivesUntilTheCarrierAndEveryExportAreGone) {
  Owned m(4);
  auto c = std::make_shared<CPUCarrier>(m.data(), 4, DType::Float32(), true, m.values);
  m.values.reset();
  EXPECT_FALSE(m.watch.expired());  // the carrier holds it
  std::shared_ptr<const void> exported = c->native_owner();
  c->release();
  EXPECT_EQ(c->size(), 0);
  EXPECT_FALSE(m.watch.expired());  // the export holds it (Note [Exports outlive release])
  EXPECT_EQ(static_cast<const AlignedBuffer*>(exported.get())->data(), reinterpret_cast<std::byte*>(m.watch.lock()->data()));
  exported.reset();
  EXPECT_TRUE(m.watch.expired());  // the last holder let go: dropped, never freed here

  Owned n(4);
  auto d = std::make_shared<CPUCarrier>(n.data(), 4, DType::Float32(), true, n.values);
  n.values.reset();
  d.reset();
  EXPECT_TRUE(n.watch.expired());  // destroying the carrier drops it too
}

TEST(BorrowedMemory, IsNeverSharedCopyOnWrite) {
  Owned m(4);
  CPUCarrier c(m.data(), 4, DType::Float32(), true, m.values);
  EXPECT_EQ(c.share_snapshot(), nullptr);  // the owner may write it behind the carriers' backs
  EXPECT_FALSE(c.shares_memory());
}

TEST(BorrowedMemory, ImmutableBorrowedMemoryRefusesPublicWrites) {
  Owned m(2);
  CPUCarrier c(m.data(), 2, DType::Float32(), false, m.values);
  EXPECT_FALSE(c.is_mutable());
  EXPECT_THROW(c.check_writable("write"), RuntimeError);
  EXPECT_EQ((*m.values)[1], 1.0f);
}

TEST(BorrowedMemory, AMisalignedAddressIsRefusedAndNothingIsHeld) {
  Owned m(4);
  try {
    CPUCarrier c(m.data() + 1, 2, DType::Float32(), true, m.values);
    FAIL() << "a misaligned address was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("is not aligned to the 4-byte elements of Float32"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(m.values.use_count(), 1);  // the refused carrier holds nothing
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ((*m.values)[i], static_cast<float>(i));
  // One-byte elements have no alignment to keep.
  auto bytes = std::make_shared<std::vector<bool>>();
  std::byte raw[3] = {std::byte{1}, std::byte{0}, std::byte{1}};
  CPUCarrier b(raw + 1, 2, DType::Bool(), true, bytes);
  EXPECT_EQ(b.read_value(1), Value::from_bool(true));
}

}  // namespace
}  // namespace sw
