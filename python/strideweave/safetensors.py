"""Safetensors checkpoints opened where they lie (docs/guide.md, "Opening a Hugging Face checkpoint").

``sw.safetensors.open(path)`` reads and validates the headers of one file, a list of files, or a folder (with
``model.safetensors.index.json`` for a sharded checkpoint) and returns a :class:`Checkpoint`; its tensors and tiled
tensors read the files' bytes where they lie, no copy. ``sw.safetensors.save`` writes a safetensors file. The
engine (header rules, the checkpoint tier, the tiled geometry, writing) is C++
(cpp/include/strideweave/checkpoint/safetensors.hpp); this module only turns paths into strings.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Optional, Union

from . import _core
from ._core import Checkpoint, CheckpointCarrier, Tensor

__all__ = ["Checkpoint", "CheckpointCarrier", "open", "save", "set_promotion_path"]

StrPath = Union[str, "os.PathLike[str]"]


def open(path_or_paths: Union[StrPath, Iterable[StrPath]]) -> Checkpoint:  # noqa: A001 (the contract's name)
    """Opens a safetensors checkpoint: a file, a folder, or a list of files.

    ValueError, naming the file (and the tensor), for a malformed header, index or folder; nothing stays open then.
    """
    if isinstance(path_or_paths, (str, os.PathLike)):
        paths = [os.fspath(path_or_paths)]
    else:
        paths = [os.fspath(p) for p in path_or_paths]
    return _core._safetensors_open(paths)


def save(path: StrPath, tensors: Mapping[str, Tensor], metadata: Optional[Mapping[str, str]] = None) -> None:
    """Writes ``tensors`` (name -> Tensor, in the dict's order) to a safetensors file at ``path``.

    Each tensor is written row-major over its top-level modes; tiled tensors are read tile range by tile range,
    never gathered whole. The file appears whole or not at all (written under a temporary name, then renamed).
    """
    _core._safetensors_save(os.fspath(path), tensors, metadata)


def set_promotion_path(path: str) -> str:
    """How read-only checkpoint tiers promote tiles of 1 MiB and more, process-wide; returns the previous setting.

    ``"auto"`` (the default) chooses per promotion: a first promotion, or a range the page cache holds in 2 MiB
    folios, maps the file's pages; otherwise the path whose measured cost (CPU time per MiB, kept per tier) is
    lower: mapping, or reading into a buffer recycled through the mapping cache (Note [Promotion by the cheaper
    path] in cpp/src/carriers/checkpoint.cpp). ``"map"`` and ``"read"`` force one path (tests, benchmarks).
    ``CheckpointCarrier.promotion_stats()`` counts what each tier did and gives its estimates. ValueError for
    another string, TypeError for a value that is not a str.
    """
    return _core._set_promotion_path(path)


# SW_PROMOTION_PATH=auto|map|read in the environment sets the path at import (benchmarks compare the paths in
# fresh processes).
if os.environ.get("SW_PROMOTION_PATH"):
    set_promotion_path(os.environ["SW_PROMOTION_PATH"])
