// strideweave/tiled/tile_set.hpp — tile coordinates as values: the canonical tile order, the checks of a
// set of tiles and of a selection's axes, and a selection's expansion into coordinates.
//
// Note [Canonical tile order]. Tiles are ordered first axis fastest (colexicographic: the last component
// decides first, as the tile index of any grid does), so a set of tiles listed in canonical order is
// listed in tile-index order whatever the grid. This is the one definition of the order: the Python
// TileSet is sorted by canonicalize_tiles, a selection's tile set is enumerated by selection_tiles, and
// the bindings sort the tiles the engine reports with tile_order_less (docs/guide.md, "TiledEvictable", "Request values and their messages").
//
// Everything here is a pure function of its arguments and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace sw {

using TileCoord = std::vector<int64_t>;
using TileAxes = std::vector<std::vector<int64_t>>;

// Names entry `i` (a coordinate of a set, an axis of a selection) in a message, as its caller spelled it;
// empty: the values themselves, written as a Python tuple.
using TileDescriber = std::function<std::string(size_t)>;

// Note [Canonical tile order]: true when `a` comes before `b`.
bool tile_order_less(const TileCoord& a, const TileCoord& b);

// A set of tiles: checks that the coordinates share one rank, have no negative component and are distinct
// (ValueError, in that order, naming the first offender), then sorts them into canonical order.
void canonicalize_tiles(std::vector<TileCoord>& tiles, const TileDescriber& describe = {});

// A selection's axes: at least one, each non-empty, without duplicates and without negative coordinates
// (ValueError naming the first offending axis).
void check_selection_axes(const TileAxes& per_axis, const TileDescriber& describe = {});

// The product of checked axes: in compact order (first axis fastest, each axis in the given order), or in
// canonical order (the same product over the sorted axes). The count is the product of the axis lengths.
std::vector<TileCoord> selection_tiles(const TileAxes& per_axis, bool canonical);

// A tuple of ints as Python writes it: "(1, 2)", "(1,)", "()".
std::string tile_tuple_str(const std::vector<int64_t>& values);

}  // namespace sw
