"""Built-in residency policies: ordinary ResidencyPolicy implementations.

A policy only optimises: the engine makes every required tile available with
or without one, and defers every eviction until no running work needs the tile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from . import _core
from .carriers.tiled_evictable import ResidencyPlan, TileSelection, TileSet

__all__ = ["LRUPolicy", "PinnedPolicy"]


def _tiles(tiles: Any, what: str) -> TileSet:
    if isinstance(tiles, TileSet):
        return tiles
    if isinstance(tiles, TileSelection):
        # Bounded before the Cartesian product is enumerated: the axes hold distinct coordinates, so a selection of
        # more tiles than any tile grid has reaches out of every grid (Note [Tile table limits]).
        count = 1
        for n in tiles.compact_grid_shape:
            count *= n
        if count > _core._TILED_MAX_TILES:
            shape = " x ".join(str(n) for n in tiles.compact_grid_shape)
            raise ValueError(
                f"{what}: the TileSelection names {count} tiles ({shape}), more than any tile grid has (a "
                f"TiledEvictable has at most 2**24 = {_core._TILED_MAX_TILES}): some of its coordinates are out of "
                "range for every tile grid")
        return tiles.tile_set
    if hasattr(tiles, "tile_set"):
        return TileSet(coordinates=tiles.tile_set.coordinates)
    return TileSet(coordinates=tiles)


class LRUPolicy:
    """Keeps at most ``capacity`` tiles resident, evicting the least recently required.

    The policy tracks the tiles its requests made resident. Each plan marks the
    required tiles most recent; when more than ``capacity`` tiles would be
    resident, the least recently required others are evicted after the request
    (the engine defers them until no running work needs them).

    Thread-safe: the engine asks the policy from whichever thread starts a request, so two threads
    projecting from one carrier call ``plan`` concurrently; the recency list is updated under a lock.
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError("LRUPolicy capacity must be an int")
        if capacity < 1:
            raise ValueError("LRUPolicy capacity must be >= 1")
        self.capacity = capacity
        self._recent: OrderedDict = OrderedDict()  # tile -> None, least recent first
        self._lock = threading.Lock()

    def plan(self, required: TileSet, purpose: str) -> ResidencyPlan:
        with self._lock:
            return self._plan(required.coordinates)

    def _plan(self, needed: tuple) -> ResidencyPlan:
        for tile in needed:
            self._recent.pop(tile, None)
            self._recent[tile] = None
        victims = []
        excess = len(self._recent) - max(self.capacity, len(needed))
        if excess > 0:
            keep = set(needed)
            for tile in list(self._recent):
                if excess == 0:
                    break
                if tile in keep:
                    continue
                del self._recent[tile]
                victims.append(tile)
                excess -= 1
        return ResidencyPlan(retain=TileSet(coordinates=needed), evict=TileSet(coordinates=victims))

    def __repr__(self) -> str:
        return f"LRUPolicy(capacity={self.capacity})"


class PinnedPolicy:
    """Keeps a fixed set of tiles resident: promotes them with the first request and never evicts."""

    def __init__(self, tiles: TileSet | TileSelection | Any) -> None:
        self.tiles = _tiles(tiles, "PinnedPolicy")

    def plan(self, required: TileSet, purpose: str) -> ResidencyPlan:
        pinned = set(self.tiles.coordinates)
        needed = set(required.coordinates)
        promote = [t for t in self.tiles.coordinates if t not in needed]
        retain = [t for t in required.coordinates if t in pinned]
        return ResidencyPlan(promote=TileSet(coordinates=promote), retain=TileSet(coordinates=retain))

    def __repr__(self) -> str:
        return f"PinnedPolicy({self.tiles!r})"
