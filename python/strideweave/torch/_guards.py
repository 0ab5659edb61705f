"""What a model with offloaded experts refuses at the call (docs/guide.md, "Opening a Hugging Face MoE bigger than
RAM"):

* dtype and device changes (``model.to(dtype)``, ``.half()``, ``.bfloat16()``, ``.float()`` when it changes the
  dtype, ``.to("meta")``, ``.cuda()``): the experts are tiles of a checkpoint in its dtype, on the CPU; converting
  them would copy every expert. The check runs before anything converts (the ``_apply`` of the model and of every
  module above a bound experts module probes the conversion on an empty tensor), so a refused call changes
  nothing.
* ``model.zero_grad()`` drops the experts' tiled gradients too (an ordinary loop and transformers' ``Trainer``
  call it between steps).
* ``state_dict()`` and the model's own ``save_pretrained`` (refused before it writes anything): the experts are not
  parameters, and a state dict without them would save a model whose experts are lost;
  ``strideweave.torch.save_pretrained`` writes them.
"""

from __future__ import annotations

import threading
import types
from typing import Any

from ._bridge import _torch

_SAVING = threading.local()  # set while strideweave.torch.save_pretrained reads the non-expert state


class saving_state:
    """Context in which the state-dict guard lets ``state_dict()`` through (the non-expert weights alone)."""

    def __enter__(self) -> None:
        _SAVING.depth = getattr(_SAVING, "depth", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _SAVING.depth -= 1


def _state_dict_hook(module: Any, prefix: str, keep_vars: bool) -> None:
    if getattr(_SAVING, "depth", 0):
        return
    b = module.__dict__.get("_strideweave")
    raise RuntimeError(f"state_dict: the experts of {b.name if b else prefix.rstrip('.')} are offloaded to a "
                       "checkpoint's tiles and are not parameters; a state dict would silently leave them out. "
                       "strideweave.torch.save_pretrained(model, folder) writes the whole model, experts "
                       "included")


def _refused_save_pretrained(self: Any, *args: Any, **kwargs: Any) -> None:
    """The model's own ``save_pretrained`` while experts are bound: refused before it writes anything (it would
    write the config, then fail at the state dict)."""
    raise RuntimeError(f"{type(self).__name__}.save_pretrained: its experts are offloaded to a checkpoint's tiles and "
                       "are not parameters, so transformers would save the model without them (nothing was "
                       "written); strideweave.torch.save_pretrained(model, folder) writes the whole model, experts "
                       "included")


def _guarded_apply(self: Any, fn: Any, recurse: bool = True) -> Any:
    torch = _torch()
    dtype = self.__dict__["_strideweave_dtype"]
    probe = fn(torch.empty(0, dtype=dtype))
    if isinstance(probe, torch.Tensor):
        if probe.device.type != "cpu":
            raise RuntimeError(f"{type(self).__name__}: its experts are offloaded to CPU tiles of a checkpoint and "
                               f"cannot move to {probe.device} (nothing was moved)")
        if probe.dtype != dtype:
            raise TypeError(f"{type(self).__name__}: its experts are offloaded tiles of a {dtype} checkpoint; "
                            f"converting the model to {probe.dtype} would copy every expert (nothing was "
                            "converted). Open the model in that dtype from a checkpoint saved in it "
                            "(strideweave.torch.save_pretrained, then from_pretrained)")
    return type(self)._apply(self, fn, recurse)


def _zero_grad(self: Any, set_to_none: bool = True) -> None:
    """``model.zero_grad()`` also drops the bound experts' tiled gradients (torch's alone does not reach them; an
    implicit-zero tile and a zeroed one are the same gradient, so ``set_to_none=False`` drops them too)."""
    type(self).zero_grad(self, set_to_none)
    for m in self.modules():
        b = m.__dict__.get("_strideweave")
        if b is not None:
            b.zero_grad()


def install_guards(model: Any) -> None:
    """Installs the guards on `model`'s bound experts modules and every module above them."""
    bound = {path: m for path, m in model.named_modules() if "_strideweave" in m.__dict__}
    if not bound:
        return
    dtype = next(iter(bound.values()))._strideweave.spec.dtype
    guarded = set()
    for path in bound:
        parts = path.split(".") if path else []
        for i in range(len(parts) + 1):
            guarded.add(".".join(parts[:i]))
    for path, m in model.named_modules():
        if path in guarded and "_strideweave_dtype" not in m.__dict__:
            m.__dict__["_strideweave_dtype"] = dtype
            m._apply = types.MethodType(_guarded_apply, m)
    if "zero_grad" not in model.__dict__:
        model.zero_grad = types.MethodType(_zero_grad, model)
    if hasattr(model, "save_pretrained") and "save_pretrained" not in model.__dict__:
        model.save_pretrained = types.MethodType(_refused_save_pretrained, model)
    for m in bound.values():
        if not m.__dict__.get("_strideweave_state_hook"):
            m.register_state_dict_pre_hook(_state_dict_hook)
            m.__dict__["_strideweave_state_hook"] = True
