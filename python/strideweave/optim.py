"""Optimizers on tiled parameters: ``SGD``, ``Adam`` and ``AdamW``, stepped tile by tile in the C++ engine.

A parameter is a ``Tensor`` over the whole extent of a ``TiledEvictable`` (one tile per expert) or a dense CPU
tensor. Each tile is stepped as ``torch.optim`` steps one ``nn.Parameter``: a tile whose gradient tile is an
implicit zero is skipped, and each tile keeps its own step count. The state (momentum buffer, ``exp_avg``,
``exp_avg_sq``) is Float32, or BFloat16 with ``state_dtype=DType.BFloat16`` (widened for the update, rounded once
to nearest even when stored: half the bytes), or 8-bit block-wise with ``state_dtype=STATE_8BIT`` (``"8bit"``: the
scheme of bitsandbytes' AdamW8bit, blocks of 256 values with a Float32 absmax each and 8-bit codes into a dynamic
quantization map: about a quarter of the bytes), in TiledEvictables beside the weight (their own scratch file, the
weight's residency budget). docs/guide.md, "Optimizers on tiled parameters".
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

from . import _core
from ._core import Optimizer as _Engine
from ._core import Tensor

__all__ = ["SGD", "Adam", "AdamW", "STATE_8BIT", "grad_norm", "scale_grads"]

#: ``state_dtype=STATE_8BIT`` (the string ``"8bit"``): 8-bit block-wise optimizer state (Dettmers et al. 2021, as
#: bitsandbytes' AdamW8bit): each state tile in blocks of 256 values, one Float32 absmax per block and an 8-bit code
#: per value into a 256-entry dynamic quantization map (signed for the momentum buffer and ``exp_avg``, unsigned for
#: ``exp_avg_sq``); decoded to Float32 for each update and encoded again. ``state(p)`` then gives decoded Float32
#: copies. docs/guide.md, "Optimizers on tiled parameters".
STATE_8BIT = "8bit"


def grad_norm(params: Tensor | Iterable[Tensor], norm_type: float = 2.0) -> float:
    """The norm of the gradients of ``params`` (a Tensor or an iterable of Tensors) all together, as
    ``torch.nn.utils.get_total_norm`` computes it, accumulated in Float64 in one pass over the gradient tiles (each
    present tile promoted under its budget; implicit-zero tiles skipped; a parameter without a gradient adds
    nothing): ``(sum |x|^p)^(1/p)`` for ``norm_type`` p > 0, the largest magnitude for ``float('inf')``.

    TypeError naming the argument for a non-number norm_type or a non-Tensor in params; ValueError for
    ``norm_type <= 0`` or NaN, or a gradient that is not its tiled carrier's whole extent.
    """
    return _core._optim_grad_norm(params, norm_type)


def scale_grads(params: Tensor | Iterable[Tensor], factor: float) -> None:
    """Multiplies every present gradient tile of ``params`` by ``factor`` in place (rounded as torch's
    ``g.mul_(factor)``), one tile at a time under the budget; implicit-zero tiles stay implicit. With
    :func:`grad_norm` this clips by the norm: ``scale_grads(params, min(1, max_norm / (norm + 1e-6)))``.

    The same errors as grad_norm (factor for norm_type); nothing is scaled then.
    """
    _core._optim_scale_grads(params, factor)


# Hyperparameters by algorithm: reading or setting one that the optimizer's algorithm lacks is an AttributeError.
_HYPERPARAMETERS = {"lr", "weight_decay", "momentum", "dampening", "nesterov", "betas", "eps"}


class _Optimizer:
    """What the three share: the engine object and its methods."""

    _engine: _Engine

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HYPERPARAMETERS and not hasattr(type(self), name):
            raise AttributeError(f"{type(self).__name__} has no hyperparameter {name!r}")
        object.__setattr__(self, name, value)

    def _get(self, name: str) -> Any:
        return self._engine.hyperparameters()[name]

    @property
    def lr(self) -> float:
        """The learning rate; settable between steps (the next step uses it), validated as the constructor does."""
        return self._get("lr")

    @lr.setter
    def lr(self, value: float) -> None:
        self._engine.set_hyperparameters({"lr": value})

    @property
    def weight_decay(self) -> float:
        """The weight decay (Adam: added to the gradient; SGD: too; AdamW: decoupled); settable between steps."""
        return self._get("weight_decay")

    @weight_decay.setter
    def weight_decay(self, value: float) -> None:
        self._engine.set_hyperparameters({"weight_decay": value})

    @property
    def params(self) -> list[Tensor]:
        """The parameters, in the order given."""
        return list(self._engine.params)

    @property
    def state_dtype(self) -> Any:
        """How the state is stored: ``DType.Float32`` (the default), ``DType.BFloat16`` or :data:`STATE_8BIT`
        (``"8bit"``) (fixed at construction)."""
        return self._engine.state_dtype

    @property
    def prefetch(self) -> bool:
        """Whether a step starts the next tile's promotions during the current tile's update (default False)."""
        return self._engine.prefetch

    @prefetch.setter
    def prefetch(self, on: bool) -> None:
        self._engine.prefetch = bool(on)

    @property
    def step_in_backward(self) -> bool:
        """Whether tiled parameters are stepped in backward, each tile the moment its gradient is final (fixed at
        construction; docs/guide.md, "Stepping in backward")."""
        return self._engine.step_in_backward

    @contextlib.contextmanager
    def no_step(self) -> Iterator[None]:
        """For gradient accumulation with ``step_in_backward``: backwards run inside only add into ``.grad``
        (the micro-batches before the last); the last backward, outside, steps the tiles it reaches, and
        :meth:`step` the rest. Without step_in_backward it changes nothing. Not reentrant."""
        previous = self._engine.accumulating
        self._engine.accumulating = True
        try:
            yield
        finally:
            self._engine.accumulating = previous

    def step(self) -> None:
        """One step over every parameter with a gradient, tile by tile (the GIL is released meanwhile). With
        ``step_in_backward``: the dense parameters and the tiles not stepped in backward; call it after every
        backward all the same (a tile stepped in backward refuses a new forward use until it has run)."""
        self._engine.step()

    def zero_grad(self) -> None:
        """Drops every parameter's gradient (``.grad = None``); nothing is allocated."""
        self._engine.zero_grad()

    def state(self, param: Tensor) -> dict[str, Any]:
        """``{"step": [per-tile counts], ...}`` with the state tensors of ``param`` (of the state dtype, its shape and
        layout). With :data:`STATE_8BIT` state they are decoded copies (``map[code] * absmax``, Float32, dense CPU
        tensors of the parameter's shape and layout: the full Float32 size, made on each call; writing them changes
        nothing)."""
        return self._engine.state(param)

    def save_state(self, path: str | os.PathLike[str]) -> None:
        """Writes the state (``param{i}.exp_avg``, ... as ``(tiles, tile size)`` tensors of the state dtype, streamed
        tile range by tile range), the per-tile step counts, the state dtype and the hyperparameters (JSON in
        ``__metadata__``) to one safetensors file at ``path``, atomically (as ``sw.safetensors.save``)."""
        self._engine.save_state(os.fspath(path))

    def load_state(self, path: str | os.PathLike[str]) -> None:
        """Restores a file of :meth:`save_state` into this optimizer (same algorithm, state dtype, parameter shapes
        and tile grids: ValueError naming what differs, nothing changed), tile by tile under the parameters' residency
        budget; tiles never stepped stay implicit zeros."""
        self._engine.load_state(os.fspath(path))

    def stats(self) -> dict[str, Any]:
        """Steps, tiles stepped and skipped, prefetches, and transfers per tier (weights, gradients, state)."""
        return self._engine.stats()


def _betas(betas: Iterable[float], name: str) -> tuple[float, float]:
    values = tuple(betas)
    if len(values) != 2:
        raise ValueError(f"{name}: betas must be a pair (beta1, beta2), got {len(values)} values")
    return values[0], values[1]


class _AdamBase(_Optimizer):
    """Adam's and AdamW's hyperparameters besides lr and weight_decay."""

    @property
    def betas(self) -> tuple[float, float]:
        """``(beta1, beta2)``; settable between steps (a pair, each in [0, 1))."""
        h = self._engine.hyperparameters()
        return (h["beta1"], h["beta2"])

    @betas.setter
    def betas(self, value: Iterable[float]) -> None:
        b1, b2 = _betas(value, self._engine.algorithm)
        self._engine.set_hyperparameters({"beta1": b1, "beta2": b2})

    @property
    def eps(self) -> float:
        """The term added to the denominator; settable between steps (>= 0)."""
        return self._get("eps")

    @eps.setter
    def eps(self, value: float) -> None:
        self._engine.set_hyperparameters({"eps": value})


class SGD(_Optimizer):
    """``torch.optim.SGD``'s update, per tile: ``SGD(params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
    nesterov=False, *, state_dtype=DType.Float32)`` (or ``DType.BFloat16``, ``STATE_8BIT``)."""

    @property
    def momentum(self) -> float:
        """The momentum factor; settable between steps (>= 0; a tile's buffer starts from its gradient on its first
        step with momentum, as torch's)."""
        return self._get("momentum")

    @momentum.setter
    def momentum(self, value: float) -> None:
        self._engine.set_hyperparameters({"momentum": value})

    @property
    def dampening(self) -> float:
        """The dampening of the momentum; settable between steps (finite)."""
        return self._get("dampening")

    @dampening.setter
    def dampening(self, value: float) -> None:
        self._engine.set_hyperparameters({"dampening": value})

    @property
    def nesterov(self) -> bool:
        """Nesterov momentum; settable between steps (needs momentum > 0 and dampening 0)."""
        return self._get("nesterov")

    @nesterov.setter
    def nesterov(self, value: bool) -> None:
        self._engine.set_hyperparameters({"nesterov": bool(value)})

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, state_dtype: Any = None,
                 step_in_backward: bool = False) -> None:
        self._engine = _Engine("SGD", params, lr, momentum, dampening, bool(nesterov), 0.9, 0.999, 1e-8,
                               weight_decay, state_dtype, bool(step_in_backward))


class Adam(_AdamBase):
    """``torch.optim.Adam``'s update, per tile: ``Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.0, *, state_dtype=DType.Float32)`` (or ``DType.BFloat16``, ``STATE_8BIT``) (weight decay added to the gradient)."""

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, betas: Iterable[float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, state_dtype: Any = None,
                 step_in_backward: bool = False) -> None:
        b1, b2 = _betas(betas, "Adam")
        self._engine = _Engine("Adam", params, lr, 0.0, 0.0, False, b1, b2, eps, weight_decay, state_dtype,
                               bool(step_in_backward))


class AdamW(_AdamBase):
    """``torch.optim.AdamW``'s update, per tile: ``AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=1e-2, *, state_dtype=DType.Float32)`` (or ``DType.BFloat16``, ``STATE_8BIT``) (decoupled: the weight is scaled by ``1 - lr * weight_decay``
    first)."""

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, betas: Iterable[float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, state_dtype: Any = None,
                 step_in_backward: bool = False) -> None:
        b1, b2 = _betas(betas, "AdamW")
        self._engine = _Engine("AdamW", params, lr, 0.0, 0.0, False, b1, b2, eps, weight_decay, state_dtype,
                               bool(step_in_backward))
