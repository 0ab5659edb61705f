"""Small Python models of the engine's rules that several test modules check against (docs/guide.md).

* ``binary32(x)``: x rounded to binary32, as Float32 storage rounds it; overflow rounds to +-inf.
* ``column_major_strides(shape)``: the dense strides of `shape`, first axis fastest.
* ``leaves(modes)``: the leaf extents of a nested mode list, in order.
"""

from __future__ import annotations

import math
import struct


def binary32(x: float) -> float:
    """x rounded to binary32 (overflow to +-inf), as the storage rules demand."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def column_major_strides(shape) -> tuple:
    out, run = [], 1
    for e in shape:
        out.append(run)
        run *= e
    return tuple(out)


def leaves(modes) -> list[int]:
    """Leaf extents of a shape spec (a tuple of modes; a mode is an int or a tuple of modes)."""
    out = []
    for m in modes:
        out.extend(leaves(m) if isinstance(m, (list, tuple)) else [m])
    return out
