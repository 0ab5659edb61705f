"""A sparse Mixture-of-Experts block over tiled expert weights (docs/guide.md, "SparseMoE").

``sw.moe.SparseMoE(w1, w2, w3, top_k=2, *, normalize=True, routing_dtype=None, budget=None)``: SwiGLU experts whose
weights are TiledEvictables with one tile per expert, routed as transformers' Mixtral / Qwen MoE blocks route. The
block is C++ (cpp/include/strideweave/moe.hpp); this module only re-exports it.
"""

from __future__ import annotations

from ._core import SparseMoE

__all__ = ["SparseMoE"]
