"""Small Python models of the engine's rules that several test modules check against (docs/guide.md).

* ``binary32(x)``: x rounded to binary32, as Float32 storage rounds it; overflow rounds to +-inf.
* ``column_major_strides(shape)``: the dense strides of `shape`, first axis fastest.
* ``leaves(modes)``: the leaf extents of a nested mode list, in order.
* Mode trees (an int leaf, or a list or tuple of trees): ``tree_size``, ``tree_leaves`` and ``decode_model``
  (the colexicographic decode of an ordinal, first mode fastest at every level).
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


def tree_size(t):
    return t if isinstance(t, int) else math.prod(tree_size(c) for c in t)


def tree_leaves(t):
    if isinstance(t, int):
        return [t]
    return [x for c in t for x in tree_leaves(c)]


def decode_model(t, i):
    """Colexicographic decode of ordinal i over the tree t (first mode fastest at every level)."""
    if isinstance(t, int):
        return i
    out = []
    for c in t:
        n = tree_size(c)
        out.append(decode_model(c, i % n))
        i //= n
    return tuple(out)
