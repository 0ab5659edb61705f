"""Loading the tiled optimizer state that N ranks saved into an optimizer whose experts are shared out differently
(Note [Optimizer state across ranks] in ``_optim``)."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from typing import Any, Callable

_ALIGN = 8


def _header(path: str) -> tuple:
    """(header dict, offset of the data area) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def _prod(xs: Any) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def reshard(sources: list, owned: list, load: Callable[[str], None], what: str) -> None:
    """Builds, in a temporary file, the state file of one ``strideweave.optim`` engine whose parameter k owns the
    experts `owned[k]` (a range along the last axis of its (rows, cols, experts) tiles) from the files `sources`
    that the engines of the saving ranks wrote (Note [Optimizer state files] in strideweave/optim.hpp: per parameter
    a (tiles, slots) tensor per state, per-tile step counts and ``state_tiles``), calls ``load(path)`` on it and
    removes it. Each owned tile is copied, bytes for bytes, from the one source whose ``state_tiles`` marks it (a
    rank saves only its own experts' state); a tile no source holds stays an implicit zero, and the tiles of
    experts not owned are neither read nor marked (their rows stay a hole of the sparse file). ValueError when the
    sources disagree (algorithm, state dtype, shapes, tile grids) or two of them hold one tile."""
    headers = [_header(p) for p in sources]
    metas = [h["__metadata__"] for h, _ in headers]
    for key in ("format", "algorithm", "state_dtype", "params"):
        values = {m.get(key) for m in metas}
        if len(values) != 1:
            raise ValueError(f"{what}.load_state(): the ranks' state files disagree on {key}: {sorted(map(str, values))}")
    params = json.loads(metas[0]["params"])
    if params != len(owned):
        raise ValueError(f"{what}.load_state(): the state files hold {params} parameters, this group has {len(owned)}")
    meta = dict(metas[0])
    tensors: dict = {}  # name -> (dtype, shape, [(source index, tile) per tile or None])
    for k in range(params):
        key = f"param{k}"
        pj = [json.loads(m[key]) for m in metas]
        for field in ("shape", "grid", "tile"):
            if any(p[field] != pj[0][field] for p in pj):
                raise ValueError(f"{what}.load_state(): the ranks' state files disagree on parameter {k}'s {field}")
        grid, tile = pj[0]["grid"], pj[0]["tile"]
        tiles = _prod(grid)
        inner = _prod(grid[:-1])
        steps, stateful, holder = [0] * tiles, [0] * tiles, [None] * tiles
        for i in range(tiles):
            c = i // inner  # the tile's coordinate along the experts axis (tiles colex, the first axis fastest)
            experts = range(c * tile[-1], (c + 1) * tile[-1])
            if not all(e in owned[k] for e in experts):
                continue
            holders = [s for s, p in enumerate(pj) if p["state_tiles"][i]]
            if len(holders) > 1:
                raise ValueError(f"{what}.load_state(): parameter {k}'s tile {i} has state in several ranks' files")
            steps[i] = max(p["step"][i] for p in pj)
            if holders:
                stateful[i], holder[i] = 1, holders[0]
        meta[key] = json.dumps({**pj[0], "step": steps, "state_tiles": stateful})
        prefix = key + "."
        for s, (h, _) in enumerate(headers):
            for name, info in h.items():
                if not name.startswith(prefix):
                    continue
                if name not in tensors:
                    begin, end = info["data_offsets"]
                    tensors[name] = (info["dtype"], info["shape"], [None] * tiles, end - begin)
                elif [info["dtype"], info["shape"]] != list(tensors[name][:2]):
                    raise ValueError(f"{what}.load_state(): the ranks' state files disagree on {name}")
                rows = tensors[name][2]
                for i in range(tiles):
                    if holder[i] == s:
                        rows[i] = s
    # The new file: header, then each tensor's rows (a hole where no row is copied: zeros).
    header: dict = {"__metadata__": meta}
    offset = 0
    layout = []
    for name in sorted(tensors):
        dtype, shape, rows, nbytes = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        layout.append((name, offset, nbytes, rows))
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % _ALIGN)
    fd, path = tempfile.mkstemp(prefix="strideweave-state-", suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            start = 8 + len(text)
            out.truncate(start + offset)
            handles: dict = {}
            try:
                for name, begin, nbytes, rows in layout:
                    row = nbytes // len(rows)
                    for i, s in enumerate(rows):
                        if s is None:
                            continue
                        if s not in handles:
                            handles[s] = open(sources[s], "rb")
                        src_begin = headers[s][1] + headers[s][0][name]["data_offsets"][0] + i * row
                        data = os.pread(handles[s].fileno(), row, src_begin)
                        if len(data) != row:
                            raise ValueError(f"{what}.load_state(): {sources[s]} is cut short")
                        os.pwrite(out.fileno(), data, start + begin + i * row)
            finally:
                for h in handles.values():
                    h.close()
        load(path)
    finally:
        os.remove(path)
