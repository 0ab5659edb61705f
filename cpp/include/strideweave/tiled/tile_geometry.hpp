// strideweave/tiled/tile_geometry.hpp — where the tiles of a TiledEvictable lie: a value, and pure functions of it.
//
// A geometry is a grid of tiles, each of one tile shape; the logical shape is grid times tile, per axis. Slot s of
// the flat extent is the logical coordinate c = colex(s, logical_shape) (first axis fastest); its tile is c / tile
// and its within-tile coordinate c % tile, both numbered first axis fastest. Every tile's footprint (the slots it
// covers) is one run pattern shifted to the tile's first slot, so a tile's runs cost nothing to name. Nothing here
// allocates per tile or knows about carriers: the functions are those of the value (as a layout's are), and the
// constructor enforces the tile table limits (Note [Tile table limits]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <utility>
#include <vector>

#include "strideweave/layout.hpp"

namespace sw {

using TileCoord = std::vector<int64_t>;

class TileGeometry;

// The footprint runs of one tile (ordinal = within-tile ordinal, offset = slot): a view of the geometry's run
// pattern shifted to the tile's first slot. Valid while the geometry lives.
class FootprintRuns {
 public:
  class iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = Run;
    using difference_type = std::ptrdiff_t;
    using pointer = void;
    using reference = Run;
    iterator() = default;
    iterator(const Run* at, int64_t base) : at_(at), base_(base) {}
    Run operator*() const noexcept { return {at_->ordinal, at_->offset + base_, at_->length}; }
    iterator& operator++() noexcept {
      ++at_;
      return *this;
    }
    iterator operator++(int) noexcept {
      iterator old = *this;
      ++at_;
      return old;
    }
    bool operator==(const iterator& o) const noexcept { return at_ == o.at_; }

   private:
    const Run* at_ = nullptr;
    int64_t base_ = 0;
  };
  FootprintRuns(std::span<const Run> pattern, int64_t base) : pattern_(pattern), base_(base) {}
  iterator begin() const noexcept { return {pattern_.data(), base_}; }
  iterator end() const noexcept { return {pattern_.data() + pattern_.size(), base_}; }
  size_t size() const noexcept { return pattern_.size(); }
  Run operator[](size_t k) const noexcept { return *iterator(pattern_.data() + k, base_); }
  Run front() const noexcept { return (*this)[0]; }

 private:
  std::span<const Run> pattern_;
  int64_t base_;
};

class TileGeometry {
 public:
  static constexpr int64_t kMaxTiles = int64_t{1} << 24;
  static constexpr int64_t kMaxRuns = int64_t{1} << 26;

  TileGeometry() = default;  // rank 0, no tiles: only to be assigned
  // ValueError unless grid and tile have one non-zero rank and positive extents, the extent is at most 2**62, and
  // the tile table fits its limits (Note [Tile table limits]); checked before anything is allocated.
  TileGeometry(std::vector<int64_t> grid, std::vector<int64_t> tile);

  const std::vector<int64_t>& grid_shape() const noexcept { return grid_; }
  const std::vector<int64_t>& tile_shape() const noexcept { return tile_; }
  const std::vector<int64_t>& logical_shape() const noexcept { return logical_; }
  // Dense (column-major) strides of the logical shape: slot = sum of coordinate times stride.
  const std::vector<int64_t>& slot_strides() const noexcept { return slot_stride_; }
  size_t rank() const noexcept { return grid_.size(); }
  int64_t tile_count() const noexcept { return tile_count_; }
  int64_t tile_size() const noexcept { return tile_size_; }
  int64_t size() const noexcept { return total_; }
  bool operator==(const TileGeometry& o) const noexcept { return grid_ == o.grid_ && tile_ == o.tile_; }

  // -------- tiles and slots
  // ValueError for a coordinate of another rank or outside the grid.
  int64_t tile_index(const TileCoord& t) const;
  TileCoord tile_coord(int64_t index) const;
  // Slot s -> (tile index, within-tile ordinal).
  std::pair<int64_t, int64_t> locate(int64_t slot) const noexcept;
  // The inverse of locate: the slot of within-tile ordinal `within` of tile `index`.
  int64_t slot(int64_t index, int64_t within) const noexcept;
  // The footprint of tile `index` in slot space as contiguous runs.
  FootprintRuns footprint_runs(int64_t index) const noexcept { return {runs_, tile_base(index)}; }
  // The first slot of tile `index` (where its footprint pattern starts).
  int64_t tile_base(int64_t index) const noexcept;

  // -------- one tile's region of a dense tensor with column-major `strides` (the logical shape's, or a compact
  // selection's)
  // Offset of the region of the tile at (grid or compact) coordinate `c`.
  int64_t region_base(const TileCoord& c, std::span<const int64_t> strides) const noexcept;
  // Offset of within-tile ordinal `within` inside a region.
  int64_t region_offset(int64_t within, std::span<const int64_t> strides) const noexcept;
  // A region's runs (ordinal = within-tile ordinal, offset relative to region_base).
  std::vector<Run> region_runs(std::span<const int64_t> strides) const;

  // -------- selections: per axis, grid coordinates in the caller's order
  // The selected tiles in coordinates order (first axis fastest): the k-th is compact tile compact_coord(k, counts).
  // ValueError for a selection of another rank or a coordinate outside the grid.
  std::vector<int64_t> select(const std::vector<std::vector<int64_t>>& per_axis) const;
  // Per axis, the count of selected coordinates times the tile extent.
  std::vector<int64_t> compact_shape(const std::vector<std::vector<int64_t>>& per_axis) const;
  // Colex decoding: ordinal k over `extents` (first axis fastest).
  static TileCoord compact_coord(int64_t k, std::span<const int64_t> extents);
  // Dense column-major strides of `shape`, and its product.
  static std::vector<int64_t> dense_strides(std::span<const int64_t> shape);
  static int64_t product(std::span<const int64_t> shape) noexcept;

  // -------- footprints of a tensor over the full logical shape
  // ValueError unless a tensor read with `layout` at `offset` reaches every tile's slots exactly through that tile's
  // logical region: no slot outside the extent, none twice, each in its own tile ("tile footprints").
  // Decided from the layout's structure when it can be (Note [Footprints by structure]), else slot by slot.
  void check_footprints(const Layout& layout, int64_t offset) const;
  // The same verdict, always slot by slot over the whole extent (tests compare the two).
  void check_footprints_slot_by_slot(const Layout& layout, int64_t offset) const;

 private:
  void check_table_size() const;  // Note [Tile table limits]
  bool footprints_match_by_structure(const Layout& layout) const;  // Note [Footprints by structure]

  std::vector<int64_t> grid_, tile_, logical_, slot_stride_;
  int64_t tile_count_ = 0, tile_size_ = 0, total_ = 0;
  std::vector<Run> runs_;  // the footprint runs of tile 0 (every tile's, shifted by its base)
};

}  // namespace sw
