"""Files of a given size for the tests' FileBacked carriers and BlockDevice arenas.

* ``sized_file(path, nbytes)``: the file at `path` created (or emptied) with `nbytes` zero bytes; returns `path`.
* ``block_device(path, nbytes)``: a ``sw.BlockDevice`` over such a file (`path` passed on as given: str or Path).
"""

from __future__ import annotations

import strideweave as sw


def sized_file(path, nbytes):
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return path


def block_device(path, nbytes):
    return sw.BlockDevice(sized_file(path, nbytes))
