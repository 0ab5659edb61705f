"""Promotion by the cheaper path (Note [Promotion by the cheaper path] in cpp/src/carriers/checkpoint.cpp).

A read-only checkpoint tier promotes a tile of 1 MiB and more either by mapping the file's pages copy-on-write or
by reading them into a buffer of the tile's own, recycled through the mapping cache. ``"auto"`` maps a first
promotion and a range the page cache holds in 2 MiB folios, and otherwise takes the path whose measured cost (CPU
time per MiB, moving averages) is lower; ``sw.safetensors.set_promotion_path`` forces either path;
``CheckpointCarrier.promotion_stats()`` counts them and reports the estimates.

What these tests pin: both paths give the package's bytes bit for bit (also in a recycled buffer that held another
tile); under churn the read path takes buffers already faulted in from the mapping cache; auto measures both paths
and every promotion is counted on one; the override forces each path and refuses anything else without changing
the setting; a read buffer evicted while mapping is the path holds no memory in the pool; a tile read into a
buffer and then written never changes the checkpoint file (the dirty tile goes to the overlay); a ResidencyBudget
counts the same bytes whichever path brought the tiles; a truncated or replaced file is refused with the same
messages as before, and a refused promotion changes nothing. Values are compared exactly (``assert_array_equal``
on the raw bits): a promotion copies or maps bytes and computes nothing, so there is
no rounding to bound. Which path auto takes depends on the machine's costs, so no test asserts it beyond the first
promotion.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import strideweave as sw

SEED = 3400
ROWS, COLS = 512, 1024  # one Float32 tile: 2 MiB, one huge page; BFloat16: 1 MiB
EXPERTS = 4
DTYPES = ["float32", "bfloat16"]
MiB = 1 << 20


@pytest.fixture
def path_setting():
    """Restores the process-wide promotion path (and the mapping cache's settings) after the test."""
    previous = sw.safetensors.set_promotion_path("auto")
    decay = sw.set_mapping_cache_decay(3600)  # no buffer leaves the cache by age while a test runs
    limit = sw.set_mapping_cache_limit(1 << 30)
    yield
    sw.safetensors.set_promotion_path(previous)
    sw.set_mapping_cache_decay(decay)
    sw.set_mapping_cache_limit(limit)


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def names(n=EXPERTS):
    return [f"experts.{e}.weight" for e in range(n)]


def write_checkpoint(path, dtype, seed, rows=ROWS, cols=COLS, n=EXPERTS):
    """A safetensors file of `n` random (rows, cols) tensors written by the package; returns their raw bits."""
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    values = {k: rng.standard_normal((rows, cols)).astype(np.float32) for k in names(n)}
    if dtype == "float32":
        safetensors.numpy.save_file(values, str(path))
        return {k: v.view(np.uint32) for k, v in values.items()}
    tensors = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in values.items()}
    safetensors.torch.save_file(tensors, str(path))
    return {k: t.view(torch.int16).numpy().view(np.uint16) for k, t in tensors.items()}


def bits(full, dtype) -> np.ndarray:
    """The tiled tensor's values as raw bits of its dtype, (rows, cols, experts). BFloat16 widens exactly to
    Float32 (the 16 bits become the top half), so the top half of the Float32 bits is the BFloat16 value."""
    f32 = np.ascontiguousarray(np.asarray(full), dtype=np.float32).view(np.uint32)
    return f32 if dtype == "float32" else (f32 >> 16).astype(np.uint16)


def expected(raw) -> np.ndarray:
    return np.stack([raw[k] for k in names(len(raw))], axis=-1)


def every_tile(n=EXPERTS):
    return sw.TileSet([(0, 0, e) for e in range(n)])


def mapped(path) -> bool:
    resolved = os.path.realpath(path)
    with open("/proc/self/maps") as fh:
        return any(line.rstrip("\n").endswith(resolved) for line in fh)


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_paths_give_bit_identical_tiles(tmp_path, path_setting, dtype):
    """The same tiles promoted by mapping and by reading (into fresh buffers, then into recycled buffers that held
    other tiles) hold the package's bytes bit for bit. The tile size is no multiple of a page (edges)."""
    rows, cols = ROWS + 8, COLS + 6  # Float32 2,142,400 bytes; BFloat16 1,071,200 (just over 1 MiB)
    path = tmp_path / "model.safetensors"
    raw = write_checkpoint(path, dtype, SEED, rows, cols)
    want = expected(raw)
    full = sw.safetensors.open(path).tiled(names())
    carrier, tier = full.carrier, full.carrier.secondary
    tiles = every_tile()

    sw.safetensors.set_promotion_path("map")
    carrier.promote(tiles)
    assert mapped(path)
    tile_bytes = rows * cols * (4 if dtype == "float32" else 2)
    assert tier.promotion_stats()["mapped_live_bytes"] == EXPERTS * tile_bytes
    by_map = bits(full, dtype)
    carrier.evict(tiles)
    assert tier.promotion_stats()["mapped_live_bytes"] == 0  # every mapping given back
    stats = tier.promotion_stats()
    assert (stats["mapped"], stats["read"], stats["read_reused"]) == (EXPERTS, 0, 0)

    sw.safetensors.set_promotion_path("read")
    carrier.promote(tiles)
    assert not mapped(path)
    by_read = bits(full, dtype)
    # Churn in another order: each tile now lands in a recycled buffer that held another tile's bytes.
    for order in ([3, 2, 1, 0], [1, 3, 0, 2]):
        carrier.evict(tiles)
        for e in order:
            carrier.promote(sw.TileSet([(0, 0, e)]))
        np.testing.assert_array_equal(bits(full, dtype), want)
    stats = tier.promotion_stats()
    assert stats["read"] == 3 * EXPERTS and stats["mapped"] == EXPERTS

    np.testing.assert_array_equal(by_map, want)
    np.testing.assert_array_equal(by_read, want)
    carrier.release()


def test_the_pool_reuses_buffers_under_churn(tmp_path, path_setting):
    """Reads go into buffers of the tiles' own; at eviction those go to the mapping cache, and the next round of
    promotions takes them back, already faulted in (read_reused; the cache's bytes drop by exactly those buffers)."""
    path = tmp_path / "model.safetensors"
    raw = write_checkpoint(path, "float32", SEED + 1)
    full = sw.safetensors.open(path).tiled(names())
    carrier, tier = full.carrier, full.carrier.secondary
    tiles = every_tile()
    tile_bytes = ROWS * COLS * 4  # 2 MiB: the buffers' mapped length exactly
    sw.safetensors.set_promotion_path("read")

    carrier.promote(tiles)  # into whatever buffers of the length the cache has, or fresh ones
    assert tier.promotion_stats()["read"] == EXPERTS and not mapped(path)
    assert tier.promotion_stats()["read_live_bytes"] == EXPERTS * tile_bytes  # the tiles' buffers, alive
    np.testing.assert_array_equal(bits(full, "float32"), expected(raw))
    before = tier.promotion_stats()
    cached = sw.mapping_cache_bytes()
    carrier.evict(tiles)  # the four buffers go back to the cache
    assert sw.mapping_cache_bytes() == cached + EXPERTS * tile_bytes
    assert tier.promotion_stats()["read_live_bytes"] == 0
    assert tier.promotion_stats()["read_peak_bytes"] == EXPERTS * tile_bytes

    carrier.promote(tiles)
    after = tier.promotion_stats()
    assert after["read"] - before["read"] == EXPERTS
    assert after["read_reused"] - before["read_reused"] == EXPERTS  # no fresh page, no fault
    assert after["mapped"] == 0
    assert sw.mapping_cache_bytes() == cached
    np.testing.assert_array_equal(bits(full, "float32"), expected(raw))
    carrier.release()


def test_auto_maps_a_first_promotion_then_measures_both_paths(tmp_path, path_setting):
    """Auto: the first promotions map (nothing is measured yet) and measure the mapping; the next choice also
    measures a read (a probe), and the evictions time the munmaps; every promotion is counted on one path and
    leaves the package's bytes. Which path wins afterwards is this machine's (the estimates decide)."""
    path = tmp_path / "model.safetensors"
    raw = write_checkpoint(path, "float32", SEED + 8)
    full = sw.safetensors.open(path).tiled(names())
    carrier, tier = full.carrier, full.carrier.secondary
    tiles = every_tile()
    assert tier.promotion_stats()["map_ns_per_mib"] == -1 and tier.promotion_stats()["read_ns_per_mib"] == -1
    carrier.promote(sw.TileSet([(0, 0, 0)]))
    first = tier.promotion_stats()
    assert first["mapped"] == 1 and first["read"] == 0 and mapped(path)
    assert first["map_ns_per_mib"] > 0 and first["read_ns_per_mib"] == -1 and first["unmap_ns_per_mib"] == -1
    carrier.promote(tiles)
    carrier.evict(tiles)
    for _ in range(3):
        carrier.promote(tiles)
        np.testing.assert_array_equal(bits(full, "float32"), expected(raw))
        carrier.evict(tiles)
    stats = tier.promotion_stats()
    print(stats)
    assert stats["mapped"] + stats["read"] == 1 + (EXPERTS - 1) + 3 * EXPERTS  # tile 0 was resident
    assert stats["map_ns_per_mib"] > 0 and stats["read_ns_per_mib"] > 0 and stats["unmap_ns_per_mib"] >= 0
    carrier.release()


def test_a_read_buffer_holds_no_memory_once_reads_are_not_the_path(tmp_path, path_setting):
    """The pool is bounded by use: a read tile evicted while mapping is the path gives its buffer's pages back
    (the mapping cache keeps only the address range), so the next read into that buffer faults afresh
    (read_reused stays put) while the cache's bytes still drop by exactly those buffers."""
    path = tmp_path / "model.safetensors"
    raw = write_checkpoint(path, "float32", SEED + 9)
    full = sw.safetensors.open(path).tiled(names())
    carrier, tier = full.carrier, full.carrier.secondary
    tiles = every_tile()
    tile_bytes = ROWS * COLS * 4
    sw.safetensors.set_promotion_path("read")
    carrier.promote(tiles)
    sw.safetensors.set_promotion_path("map")
    cached = sw.mapping_cache_bytes()
    carrier.evict(tiles)  # reads are not the path now: the pages go, the ranges go to the cache
    assert sw.mapping_cache_bytes() == cached + EXPERTS * tile_bytes
    sw.safetensors.set_promotion_path("read")
    before = tier.promotion_stats()
    carrier.promote(tiles)
    after = tier.promotion_stats()
    assert after["read"] - before["read"] == EXPERTS
    assert after["read_reused"] == before["read_reused"]  # none was resident: their memory had been given back
    assert sw.mapping_cache_bytes() == cached
    np.testing.assert_array_equal(bits(full, "float32"), expected(raw))
    carrier.release()


def test_the_forced_path_overrides_auto_and_bad_values_change_nothing(tmp_path, path_setting):
    path = tmp_path / "model.safetensors"
    write_checkpoint(path, "bfloat16", SEED + 2, n=2)
    full = sw.safetensors.open(path).tiled(names(2))
    carrier, tier = full.carrier, full.carrier.secondary
    one = sw.TileSet([(0, 0, 0)])

    assert sw.safetensors.set_promotion_path("read") == "auto"
    carrier.promote(one)  # a first promotion, which auto would map
    assert tier.promotion_stats()["read"] == 1 and tier.promotion_stats()["mapped"] == 0 and not mapped(path)
    carrier.evict(one)
    assert sw.safetensors.set_promotion_path("map") == "read"
    carrier.promote(one)  # promoted again
    assert tier.promotion_stats()["mapped"] == 1 and tier.promotion_stats()["read"] == 1 and mapped(path)
    carrier.evict(one)

    for bad, error, fragment in [("mmap", ValueError, "takes 'auto', 'map' or 'read', got 'mmap'"),
                                 (1, TypeError, "must be a str, got int")]:
        with pytest.raises(error) as info:
            sw.safetensors.set_promotion_path(bad)
        print(info.value)
        assert fragment in str(info.value)
    assert sw.safetensors.set_promotion_path("auto") == "map"  # unchanged by the refused calls
    carrier.release()


@pytest.mark.parametrize("recycled", [False, True])
def test_a_read_tile_written_never_changes_the_checkpoint_file(tmp_path, path_setting, recycled):
    """A tile read into a buffer of its own (fresh, or recycled from another tile of the tier) and then written:
    the checkpoint's bytes never change; the dirty tile goes to the overlay and reads back its value."""
    path = tmp_path / "model.safetensors"
    raw = write_checkpoint(path, "float32", SEED + 3, n=2)
    before = sha256(path)
    full = sw.safetensors.open(path).tiled(names(2))
    carrier, tier = full.carrier, full.carrier.secondary
    one = sw.TileSet([(0, 0, 1)])
    sw.safetensors.set_promotion_path("read")
    if recycled:  # the other tile's buffer goes to the cache, and tile 1 is read into it
        other = sw.TileSet([(0, 0, 0)])
        carrier.promote(other)
        carrier.evict(other)
    carrier.promote(one)
    stats = tier.promotion_stats()
    assert stats["read"] == 1 + recycled and stats["read_reused"] >= recycled and not mapped(path)
    full[(7, 9, 1)] = 0.25
    carrier.evict(one)
    assert sha256(path) == before and tier.overlaid_ranges == 1
    want = expected(raw).view(np.float32).copy()
    want[7, 9, 1] = 0.25
    np.testing.assert_array_equal(np.asarray(full), want)
    assert sha256(path) == before
    carrier.release()


def test_a_budget_counts_the_same_bytes_whichever_path(tmp_path, path_setting):
    """The budget counts resident tiles' bytes: the same for mapped tiles and for tiles read into (recycled)
    buffers; a buffer in the mapping cache holds no tile and is not counted (it is bounded by the cache's limit)."""
    path = tmp_path / "model.safetensors"
    write_checkpoint(path, "float32", SEED + 4)
    tile_bytes = ROWS * COLS * 4
    seen = {}
    for path_name in ("map", "read", "auto"):
        sw.safetensors.set_promotion_path(path_name)
        budget = sw.ResidencyBudget(2 * tile_bytes)
        full = sw.safetensors.open(path).tiled(names())
        carrier = full.carrier
        carrier.set_residency_budget(budget)
        for round_ in range(2):  # the second round evicts to make room: churn
            for e in range(EXPERTS):
                carrier.promote(sw.TileSet([(0, 0, e)]))
        s = budget.stats()
        seen[path_name] = (s["resident_tiles"], s["resident_bytes"], s["peak_bytes"], s["evictions"])
        stats = carrier.secondary.promotion_stats()
        assert stats["mapped"] + stats["read"] == 2 * EXPERTS
        if path_name != "auto":
            assert stats["mapped" if path_name == "map" else "read"] == 2 * EXPERTS
        carrier.release()
    assert seen["map"] == seen["read"] == seen["auto"] == (2, 2 * tile_bytes, 2 * tile_bytes, 2 * EXPERTS - 2)


@pytest.mark.parametrize("path_name", ["map", "read", "auto"])
def test_a_truncated_file_is_refused_with_the_same_message_and_nothing_changes(tmp_path, path_setting, path_name):
    """A range past a truncated end is left to the engine's read, which refuses it as before (the message of a
    short read naming the file), whichever path is set; the tile stays in the file and the counters do not move."""
    path = tmp_path / "model.safetensors"
    write_checkpoint(path, "float32", SEED + 5, n=2)
    full = sw.safetensors.open(path).tiled(names(2))
    carrier, tier = full.carrier, full.carrier.secondary
    one = sw.TileSet([(0, 0, 1)])
    if path_name == "auto":  # a range promoted before, both paths measured
        carrier.promote(one)
        carrier.evict(one)
        carrier.promote(one)
        carrier.evict(one)
    os.truncate(path, os.path.getsize(path) - MiB)
    sw.safetensors.set_promotion_path(path_name)
    stats, counts = carrier.stats(), tier.promotion_stats()
    with pytest.raises(RuntimeError) as info:
        carrier.promote(one)
    print(info.value)
    msg = str(info.value)
    assert str(path) in msg and f"expected {ROWS * COLS * 4} bytes but got {MiB}" in msg
    assert "(was it truncated while in use?)" in msg
    assert carrier.stats() == stats and tier.promotion_stats() == counts
    assert carrier.tile_state((0, 0, 1)).location == "secondary"
    carrier.release()


@pytest.mark.parametrize("path_name", ["map", "read"])
def test_an_in_place_tier_refuses_promotion_once_its_file_was_replaced(tmp_path, path_setting, path_name):
    """Tiers written in place always read (never mapped, never counted here) and refuse a promotion from a file
    replaced under its name, as before, whichever path is set."""
    path = tmp_path / "model.safetensors"
    write_checkpoint(path, "float32", SEED + 6, n=2)
    full = sw.safetensors.open(path).tiled(names(2), mutable=True)
    carrier, tier = full.carrier, full.carrier.secondary
    sw.safetensors.set_promotion_path(path_name)
    carrier.promote(sw.TileSet([(0, 0, 0)]))
    write_checkpoint(tmp_path / "other.safetensors", "float32", SEED + 7, n=2)
    os.replace(tmp_path / "other.safetensors", path)
    before = sha256(path)
    with pytest.raises(RuntimeError) as info:
        carrier.promote(sw.TileSet([(0, 0, 1)]))
    print(info.value)
    assert str(path) in str(info.value) and "was replaced" in str(info.value)
    assert carrier.tile_state((0, 0, 1)).location == "secondary"
    stats = tier.promotion_stats()
    assert (stats["mapped"], stats["mapped_huge"], stats["read"], stats["read_reused"]) == (0, 0, 0, 0)
    assert sha256(path) == before
    carrier.release()
