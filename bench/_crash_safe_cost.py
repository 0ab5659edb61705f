"""What a crash-safe tier costs: eviction throughput of dirty tiles, plain FileBacked vs FileBacked(crash_safe=True).

Not part of bench/run_all.py (the leading "_"). A measurement for docs/reliability.md, "Crash-safe tiers and atomic saves":

    .venv/bin/python bench/_crash_safe_cost.py [--dir DIR] [--repeats N]

For each shape (64 tiles of 1 MiB, 8 tiles of 32 MiB; Float32) and each mode, a TiledEvictable over a named
FileBacked file in DIR (default: TMPDIR) has every tile promoted and dirtied (one slot written), then all of them
evicted in one request (timed: the writes, and for crash-safe the journal's records and one fsync each). The file
stays in the page cache: the plain mode's eviction is a copy into it; the crash-safe mode writes every byte twice
and waits for the journal's fsync per tile, which reaches the device. Prints the median of N repeats as MiB/s and
the slowdown, one line per shape, and one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

import strideweave as sw
from strideweave.carriers.tiled_evictable import TiledEvictable, TileSet


def evict_seconds(folder: str, tiles: int, tile_values: int, crash_safe: bool) -> float:
    path = os.path.join(folder, f"cost-{tiles}x{tile_values}.f32")
    np.zeros(tiles * tile_values, np.float32).tofile(path)
    f = sw.FileBacked(path, crash_safe=crash_safe)
    c = TiledEvictable(sw.CPU(0), f, (tiles,), (tile_values,))
    every = TileSet([(t,) for t in range(tiles)])
    c.promote(every)
    for t in range(tiles):
        c[t * tile_values] = float(t + 1)  # dirty
    t0 = time.perf_counter()
    c.evict(every)
    seconds = time.perf_counter() - t0
    c.release()
    f.release()
    os.unlink(path)
    return seconds


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    folder = a.dir or tempfile.gettempdir()
    out = {}
    for tiles, mib in ((64, 1), (8, 32)):
        values = mib * (1 << 20) // 4
        row = {}
        for mode in ("plain", "crash_safe"):
            runs = [evict_seconds(folder, tiles, values, mode == "crash_safe") for _ in range(a.repeats)]
            row[mode] = tiles * mib / statistics.median(runs)
        row["slowdown"] = row["plain"] / row["crash_safe"]
        out[f"{tiles}x{mib}MiB"] = row
        print(f"{tiles} x {mib} MiB dirty tiles: plain {row['plain']:.0f} MiB/s, crash-safe {row['crash_safe']:.0f} "
              f"MiB/s ({row['slowdown']:.1f}x slower)", flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
