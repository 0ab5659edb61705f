// The registry of carrier kinds that the conformance suites run (carrier_test.cpp): one row per kind, with a
// factory and the conformance properties that do not apply to it, each with its reason (docs/guide.md,
// "Carriers" and "TiledEvictable"). A new kind gets the whole suite, and every pair of copy_slots between
// kinds, by adding one row to carrier_kinds(); a property it cannot have is declared here, never left out
// silently: the suite skips exactly the declared parts and says why.
//
// Header-only; not a *_test.cpp, so CMake builds no executable from it.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "strideweave/tiled/tiled_evictable.hpp"
#include "test_support.hpp"

namespace sw {
namespace testing_support {

// Per-test resources that some kinds need (a BlockDevice arena).
class KindEnv {
 public:
  static constexpr int64_t kDeviceBytes = int64_t{32} << 20;
  const std::shared_ptr<BlockDevice>& device() {
    if (!device_) {
      file_ = make_device_file(kDeviceBytes);
      device_ = std::make_shared<BlockDevice>(file_->path());
    }
    return device_;
  }

 private:
  std::unique_ptr<TempPath> file_;
  std::shared_ptr<BlockDevice> device_;
};

// Conformance properties a kind may declare inapplicable (with the reason, in its row), or known to fail (a
// finding, in its row: the engine breaks a property that does apply).
enum class Property {
  // allocate_like / new_like make a carrier of any size, independent of the template's size.
  LikeOfAnySize,
  // A released carrier's size() is 0.
  ReleasedSizeIsZero,
};

inline const char* property_name(Property p) {
  switch (p) {
    case Property::LikeOfAnySize: return "LikeOfAnySize";
    case Property::ReleasedSizeIsZero: return "ReleasedSizeIsZero";
  }
  return "?";
}

struct PropertyNote {
  Property property;
  const char* reason;
};

struct KindSpec {
  const char* name;
  const CarrierKind* kind;
  bool stores_bool;
  bool can_be_empty;  // size 0 and allocatable
  // A live, zero-filled carrier of `slots` slots.
  std::function<CarrierPtr(KindEnv&, int64_t slots, const DType&, bool is_mutable)> make;
  std::vector<PropertyNote> exclusions;
  // Properties that apply to the kind but that the engine breaks today (a finding, with what is wrong). The
  // suite checks each one as a strict expected failure: it reports the finding on every run, and fails once the
  // engine is fixed, so the row is removed then.
  std::vector<PropertyNote> findings = {};

  // The declared exclusion of `p`, or nullptr when the property applies to this kind.
  const PropertyNote* excluded(Property p) const {
    auto it = std::find_if(exclusions.begin(), exclusions.end(), [p](const PropertyNote& e) { return e.property == p; });
    return it == exclusions.end() ? nullptr : &*it;
  }
  bool applies(Property p) const { return excluded(p) == nullptr; }
  // The known finding on `p`, or nullptr.
  const PropertyNote* finding(Property p) const {
    auto it = std::find_if(findings.begin(), findings.end(), [p](const PropertyNote& e) { return e.property == p; });
    return it == findings.end() ? nullptr : &*it;
  }
  // "Name: property (reason)" for a skip message.
  std::string why_not(Property p) const {
    const PropertyNote* e = excluded(p);
    return e ? std::string(name) + ": " + property_name(p) + " does not apply (" + e->reason + ")" : std::string();
  }
};

inline CarrierPtr make_evictable(int64_t n, const DType& d, bool m) {
  auto primary = std::make_shared<CPUCarrier>(n, d, true, false);
  auto secondary = std::make_shared<FileBackedCarrier>("", d, true);
  return std::make_shared<EvictableCarrier>(primary, secondary, m);
}

// A two-axis tile geometry of exactly `n` slots: n's prime factors, smallest first, dealt in turn to
// tile[0], grid[0], tile[1], grid[1]. Tiles of more than one axis make footprints of several runs, so the
// suite crosses tile boundaries inside and between runs (1025 = 5 * 5 * 41: tile (5, 41), grid (5, 1)).
inline void tile_geometry_of(int64_t n, std::vector<int64_t>& grid, std::vector<int64_t>& tile) {
  grid = {1, 1};
  tile = {1, 1};
  int64_t* deal[4] = {&tile[0], &grid[0], &tile[1], &grid[1]};
  int turn = 0;
  for (int64_t p = 2; n > 1; ++p) {
    if (p * p > n) p = n;
    while (n % p == 0) {
      *deal[turn++ % 4] *= p;
      n /= p;
    }
  }
}

// A TiledEvictable of `n` slots over a CPU primary and an anonymous FileBacked secondary holding zeros: every
// tile starts valid in the secondary tier, so the suite's reads and writes promote tiles as they go.
inline CarrierPtr make_tiled_evictable(int64_t n, const DType& d, bool m) {
  std::vector<int64_t> grid, tile;
  tile_geometry_of(n, grid, tile);
  auto primary = std::make_shared<CPUCarrier>(0, d, true, false);
  auto secondary = std::make_shared<FileBackedCarrier>("", d, true);
  secondary->grow(n, true);
  return std::make_shared<TiledEvictable>(primary, secondary, grid, tile, nullptr, m);
}

inline const std::vector<KindSpec>& carrier_kinds() {
  static const std::vector<KindSpec> k{
      {"Generic", &generic_kind(), true, true,
       [](KindEnv&, int64_t n, const DType& d, bool m) -> CarrierPtr {
         return std::make_shared<GenericCarrier>(n, d, m);
       },
       {}},
      {"CPU", &cpu_kind(), true, true,
       [](KindEnv&, int64_t n, const DType& d, bool m) -> CarrierPtr {
         return std::make_shared<CPUCarrier>(n, d, m, false);
       },
       {}},
      {"FileBacked", &file_backed_kind(), false, true,
       [](KindEnv&, int64_t n, const DType& d, bool m) -> CarrierPtr {
         auto c = std::make_shared<FileBackedCarrier>("", d, m);
         c->grow(n, true);
         return c;
       },
       {}},
      {"BlockDevice", &block_device_carrier_kind(), false, true,
       [](KindEnv& env, int64_t n, const DType& d, bool m) -> CarrierPtr {
         return env.device()->allocate(n, d, m, false);
       },
       {}},
      {"Evictable", &evictable_kind(), false, false,
       [](KindEnv&, int64_t n, const DType& d, bool m) -> CarrierPtr { return make_evictable(n, d, m); }, {}},
      {"UserDefined", &test_kind(), false, true,
       [](KindEnv&, int64_t n, const DType& d, bool m) -> CarrierPtr { return make_test_carrier(n, d, m); }, {}},
      {"TiledEvictable", &tiled_evictable_kind(), false, false,
       [](KindEnv&, int64_t n, const DType& d, bool m) -> CarrierPtr { return make_tiled_evictable(n, d, m); },
       {{Property::LikeOfAnySize,
         "its extent is its tile geometry: allocate_like and new_like take 0 or the full extent and refuse "
         "other sizes with ValueError (docs/guide.md, \"TiledEvictable\")"}}},
  };
  return k;
}

// The row named `name` (every suite names the kinds it needs by their registry names).
inline const KindSpec& kind_named(std::string_view name) {
  for (const KindSpec& k : carrier_kinds())
    if (name == k.name) return k;
  throw std::invalid_argument("no carrier kind named " + std::string(name) + " in carrier_kinds()");
}

// Readable parameter names for suites parametrised over carrier_kinds() indices.
inline std::string kind_param_name(const ::testing::TestParamInfo<size_t>& info) {
  return carrier_kinds()[info.param].name;
}

}  // namespace testing_support
}  // namespace sw
