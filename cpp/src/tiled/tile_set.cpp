#include "strideweave/tiled/tile_set.hpp"

#include <algorithm>
#include <numeric>
#include <set>

#include "strideweave/errors.hpp"

namespace sw {

// The order of Note [Canonical tile order] (tile_set.hpp).
bool tile_order_less(const TileCoord& a, const TileCoord& b) {
  return std::lexicographical_compare(a.rbegin(), a.rend(), b.rbegin(), b.rend());
}

std::string tile_tuple_str(const std::vector<int64_t>& values) {
  std::string out = "(";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(values[i]);
  }
  return out + (values.size() == 1 ? ",)" : ")");
}

namespace {
std::string described(const TileDescriber& describe, size_t i, const std::vector<int64_t>& values) {
  return describe ? describe(i) : tile_tuple_str(values);
}
bool has_negative(const std::vector<int64_t>& values) {
  return std::any_of(values.begin(), values.end(), [](int64_t v) { return v < 0; });
}
}  // namespace

void canonicalize_tiles(std::vector<TileCoord>& tiles, const TileDescriber& describe) {
  std::set<size_t> ranks;
  for (const TileCoord& t : tiles) ranks.insert(t.size());
  if (ranks.size() > 1) {
    std::string list;
    for (size_t r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
    raise<ValueError>("TileSet coordinates must all have the same rank, got ranks [", list, "]");
  }
  for (size_t i = 0; i < tiles.size(); ++i)
    if (has_negative(tiles[i]))
      raise<ValueError>("TileSet coordinate ", described(describe, i, tiles[i]),
                        " has a negative component: components must be non-negative");
  std::sort(tiles.begin(), tiles.end(), tile_order_less);
  if (std::adjacent_find(tiles.begin(), tiles.end()) != tiles.end())
    raise<ValueError>("TileSet coordinates contain a duplicate");
}

void check_selection_axes(const TileAxes& per_axis, const TileDescriber& describe) {
  if (per_axis.empty()) raise<ValueError>("TileSelection needs at least one axis");
  for (size_t i = 0; i < per_axis.size(); ++i) {
    const std::vector<int64_t>& axis = per_axis[i];
    if (axis.empty()) raise<ValueError>("TileSelection axis ", i, " is empty");
    std::vector<int64_t> sorted = axis;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      raise<ValueError>("TileSelection axis ", i, " contains a duplicate: ", described(describe, i, axis));
    if (sorted.front() < 0)
      raise<ValueError>("TileSelection axis ", i, " contains a negative coordinate: ", described(describe, i, axis),
                        " (coordinates must be non-negative)");
  }
}

std::vector<TileCoord> selection_tiles(const TileAxes& per_axis, bool canonical) {
  TileAxes axes = per_axis;
  // Note [Canonical tile order]: over sorted axes, the compact (first axis fastest) enumeration is canonical.
  if (canonical)
    for (auto& axis : axes) std::sort(axis.begin(), axis.end());
  size_t total = 1;
  for (const auto& axis : axes) total *= axis.size();
  std::vector<TileCoord> out;
  out.reserve(total);
  std::vector<size_t> at(axes.size(), 0);  // an odometer over the axes, first axis fastest
  for (size_t n = 0; n < total; ++n) {
    TileCoord c(axes.size());
    for (size_t k = 0; k < axes.size(); ++k) c[k] = axes[k][at[k]];
    out.push_back(std::move(c));
    for (size_t k = 0; k < axes.size() && ++at[k] == axes[k].size(); ++k) at[k] = 0;
  }
  return out;
}

}  // namespace sw
