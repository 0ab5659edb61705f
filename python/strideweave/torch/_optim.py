"""One optimizer for a whole model whose experts are offloaded: ``SGD``, ``Adam``, ``AdamW`` (``torch.optim``
subclasses), and ``clip_grad_norm_`` over torch's gradients and the tiled expert gradients (docs/guide.md,
"Fine-tuning with your own loop").

Note [One optimizer over torch and tiled parameters]
Each class derives from torch's own class (``strideweave.torch.AdamW`` is a ``torch.optim.AdamW``), so torch's
parameters are stepped by torch's ``step`` - its arithmetic, its state, its validation, its hooks - unchanged.
A parameter group may also hold the tiled tensors of bound experts modules (``binding.tiled[role]``, or the
binding itself, which stands for all of its tiled tensors); those are taken out of the group before torch sees it
(torch optimizes torch Tensors only) and handed to one ``strideweave.optim`` engine per group, kept beside the group
(``tiled_param_groups``). ``param_groups`` stay torch's dicts: a learning-rate scheduler writes ``group["lr"]``
(and anything else it drives), and every ``step()`` first pushes each group's lr, weight decay, betas, eps,
momentum, dampening and nesterov to that group's engine, then runs torch's step, then each engine's step.

The tiled state (momenta, per-tile step counts) is never gathered into RAM: ``save_state(folder)`` /
``load_state(folder)`` write and read torch's state dict (``optimizer.pt``) and each engine's state streamed to
``tiled_state.<group>.safetensors`` in that folder. ``state_dict()`` / ``load_state_dict()`` do the same when
``state_folder`` is set (the dict then names the files); without it, an optimizer with tiled parameters refuses
``state_dict()`` rather than return a dict that silently leaves the experts' state out.

Note [Optimizer state across ranks]
With the experts sharded over the N > 1 ranks of a process group (Note [Experts across ranks] in ``_distributed``),
``save_state(folder)`` is collective: each rank's engines hold state only for the rank's own experts' tiles (the
others are implicit zeros, ``state_tiles`` 0 in the file), and each rank writes its engine files as
``tiled_state.<group>.rank<r>-of-<N>.safetensors`` into the one `folder` (shared by the ranks); once every rank has
written (their errors exchanged by ``all_gather_object``: any error raises on every rank), rank 0 writes
``optimizer.pt`` last: torch's state dict of the replicated parameters (the same on every rank) with the
``"strideweave"`` entry naming every rank's files (``"ranks"``). An ``optimizer.pt`` thus only ever names complete
files; rank 0 removes the previous one first, so a failed save leaves none.

``load_state(folder)`` reads torch's state from ``optimizer.pt`` on every rank and, per group, the tiled state:
  * saved by as many ranks as now (the same shares, ``expert_share``): each rank loads its own rank's file, so the
    next steps are exactly those of the uninterrupted run;
  * saved by another number of ranks (one process included, whose single file holds every expert): the experts are
    re-sharded on load (``_resharding.reshard``): the rank builds, in a temporary sparse file, an engine state file
    holding only the tiles of the experts it owns now, each copied byte for byte (values, per-tile step count)
    from the one saved file whose ``state_tiles`` marks it, and loads that. A rank reads only its own experts'
    state. The moments and step counts are the saved ones exactly; the runs then differ only as runs on different
    numbers of ranks do (the reduction orders of the all-reduce and of the token split).
The weights are reopened from the checkpoint ``save_pretrained`` wrote (``from_pretrained(..., process_group=)``):
a resume is ``save_pretrained(model, CKPT)`` and ``opt.save_state(STATE)`` on every rank, then ``from_pretrained(
CKPT, budget, process_group=group)``, the same optimizer built over it and ``opt.load_state(STATE)``.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Iterator, Optional

from ._bridge import _sw, _torch

__all__ = ["SGD", "Adam", "AdamW", "clip_grad_norm_"]

STATE_FILE = "optimizer.pt"
_FORMAT = 1


def _tiled_file(i: int) -> str:
    return f"tiled_state.{i}.safetensors"


def _tiled_file_of_rank(i: int, rank: int, world: int) -> str:
    return f"tiled_state.{i}.rank{rank}-of-{world}.safetensors"


def _describe(x: Any) -> str:
    return type(x).__name__


def _tiled_of(x: Any, what: str) -> Optional[list]:
    """The tiled tensors `x` stands for (a bound expert's tiled tensor, or an OffloadedExperts binding), None for
    anything else; a StrideWeave tensor that is not a bound expert's is refused."""
    from ._experts import OffloadedExperts, owner_of
    sw = _sw()
    if isinstance(x, OffloadedExperts):
        return list(x.tiled.values())
    if isinstance(x, sw.Tensor):
        if owner_of(x) is None:
            raise ValueError(f"{what}: a strideweave Tensor that is not the tiled tensor of a bound experts module "
                             "(strideweave.torch.offloaded_experts(model)[path].tiled[role]); for tiled tensors of "
                             "your own, use strideweave.optim")
        return [x]
    return None


def _model_params(model: Any) -> list:
    """A model's trainable torch parameters, then every bound experts module's tiled tensors, in module order."""
    from ._offload import offloaded_experts
    params: list = [p for p in model.parameters() if p.requires_grad]
    for b in offloaded_experts(model).values():
        params.extend(b.tiled.values())
    return params


def _split_params(items: Any, what: str, where: str) -> tuple:
    """(torch params (or (name, param) pairs) as given, tiled tensors) of one group's params."""
    torch = _torch()
    sw = _sw()
    if isinstance(items, torch.Tensor):
        return [items], []
    if isinstance(items, set):
        raise TypeError(f"{what}: {where}: parameters must be an ordered collection (a list), not a set")
    tiled_one = _tiled_of(items, what) if isinstance(items, sw.Tensor) or hasattr(items, "tiled") else None
    if tiled_one is not None:
        return [], tiled_one
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise TypeError(f"{what}: {where}: parameters must be an iterable of torch Parameters, tiled expert "
                        f"tensors or OffloadedExperts bindings, got {_describe(items)}")
    plain: list = []
    tiled: list = []
    for i, x in enumerate(items):
        value = x[1] if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) else x
        if isinstance(value, torch.Tensor):
            plain.append(x)
            continue
        t = _tiled_of(value, what)
        if t is None or value is not x:
            raise TypeError(f"{what}: {where}: parameter {i} must be a torch Parameter, a tiled tensor of a bound "
                            f"experts module or an OffloadedExperts binding, got {_describe(x)}")
        tiled.extend(t)
    return plain, tiled


def _groups_of(model_or_params: Any, what: str) -> list:
    """[{"params": torch params, **options}, ...] and the tiled tensors of each: [(group, tiled)]."""
    torch = _torch()
    if isinstance(model_or_params, torch.nn.Module):
        items: Any = [_model_params(model_or_params)]
        dicts = False
    else:
        if isinstance(model_or_params, dict):
            raise TypeError(f"{what}: params must be a model, an iterable of parameters or of parameter-group "
                            "dicts, got a dict (put it in a list)")
        if isinstance(model_or_params, torch.Tensor) or _is_tiled_like(model_or_params):
            items = [[model_or_params]]
            dicts = False
        else:
            if isinstance(model_or_params, set):
                raise TypeError(f"{what}: parameters must be an ordered collection (a list), not a set")
            if isinstance(model_or_params, (str, bytes)) or not hasattr(model_or_params, "__iter__"):
                raise TypeError(f"{what}: params must be a model, an iterable of parameters or of parameter-group "
                                f"dicts, got {_describe(model_or_params)}")
            listed = list(model_or_params)
            dicts = bool(listed) and isinstance(listed[0], dict)
            items = listed if dicts else [listed]
    out = []
    for g, item in enumerate(items):
        if dicts:
            if not isinstance(item, dict):
                raise TypeError(f"{what}: parameter group {g} must be a dict like the others, got {_describe(item)}")
            if "params" not in item:
                raise ValueError(f"{what}: parameter group {g} has no 'params'")
            group = dict(item)
        else:
            group = {"params": item}
        plain, tiled = _split_params(group["params"], what, f"parameter group {g}")
        group["params"] = plain
        out.append((group, tiled))
    if not any(group["params"] or tiled for group, tiled in out):
        raise ValueError(f"{what}: got an empty parameter list (no torch parameter requires grad and no experts "
                         "module is bound)")
    return out


# Note [Stepping in backward through torch]: an optimizer built with step_in_backward=True steps each expert's tiles
# inside backward (Note [Stepping in backward] in strideweave/optim.hpp), before torch's step() runs; the experts
# Functions' backward (_experts.py) pushes every such optimizer's group options to its engines first, so a tile
# stepped in backward uses the lr a scheduler set after the previous step(), as step() would.
_IN_BACKWARD: "weakref.WeakSet[Any]" = weakref.WeakSet()


def push_in_backward() -> None:
    """Pushes the group options of every live optimizer with step_in_backward to its engines."""
    for opt in list(_IN_BACKWARD):
        for group, tg in zip(opt.param_groups, opt._tiled_groups):
            if tg.engine is not None:
                opt._push(tg.engine, group)


def _is_tiled_like(x: Any) -> bool:
    from ._experts import OffloadedExperts
    return isinstance(x, (_sw().Tensor, OffloadedExperts))


class _TiledGroup:
    """The tiled tensors of one parameter group and their engine (a ``strideweave.optim`` optimizer)."""

    def __init__(self, tensors: list, engine: Any) -> None:
        self.tensors = tensors
        self.engine = engine


def _number(v: Any) -> float:
    return float(v.item()) if hasattr(v, "item") else float(v)


class _Bridge:
    """What SGD, Adam and AdamW share (see Note [One optimizer over torch and tiled parameters])."""

    _ALGORITHM = ""
    # The group options the tiled engine does not implement, with the only value it accepts.
    _FIXED: dict = {}

    def _init(self, torch_cls: Any, model_or_params: Any, state_folder: Any, kwargs: dict,
              step_in_backward: bool = False) -> None:
        what = f"strideweave.torch.{type(self).__name__}"
        self._step_in_backward = bool(step_in_backward)
        self._what = what
        self._tiled_groups: list = []
        self.state_folder = state_folder
        groups = _groups_of(model_or_params, what)
        self._pending = [t for _, t in groups]
        self._check_duplicates([t for _, t in groups], what)
        # torch.optim.Optimizer.__init__ validates the options and calls add_param_group for each group.
        torch_cls.__init__(self, [g for g, _ in groups], **kwargs)
        del self._pending
        if self._step_in_backward:
            _IN_BACKWARD.add(self)

    def _check_duplicates(self, new: list, what: str) -> None:
        seen = {id(t) for g in self._tiled_groups for t in g.tensors}
        for tensors in new:
            for t in tensors:
                if id(t) in seen:
                    raise ValueError(f"{what}: some parameters appear in more than one parameter group (a tiled "
                                     "expert tensor is listed twice)")
                seen.add(id(t))

    def _check_group(self, group: dict, index: int) -> None:
        for key, value in self._FIXED.items():
            if bool(group.get(key, value)) != value:
                raise ValueError(f"{self._what}: parameter group {index} sets {key}={group.get(key)!r}, which the "
                                 f"tiled experts' optimizer does not implement (only {key}={value})")

    def _engine_for(self, tiled: list, group: dict) -> Any:
        raise NotImplementedError

    def _push(self, engine: Any, group: dict) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict) -> None:  # noqa: D102 (torch's, plus tiled tensors)
        torch = _torch()
        what = getattr(self, "_what", f"strideweave.torch.{type(self).__name__}")
        pending = getattr(self, "_pending", None)
        if pending is not None:  # from __init__: already split
            tiled = pending[len(self._tiled_groups)]
            group = param_group
        else:
            if not isinstance(param_group, dict):
                raise TypeError(f"{what}: param_group must be a dict, got {_describe(param_group)}")
            if "params" not in param_group:
                raise ValueError(f"{what}: param_group has no 'params'")
            plain, tiled = _split_params(param_group["params"], what, "param_group")
            self._check_duplicates([tiled], what)
            group = dict(param_group)
            group["params"] = plain
        index = len(self.param_groups)
        if tiled:
            probe = dict(self.defaults)
            probe.update(group)
            self._check_group(probe, index)
        torch.optim.Optimizer.add_param_group(self, group)  # torch's checks; appends the group
        engine = None
        if tiled:
            try:
                engine = self._engine_for(tiled, self.param_groups[-1])
            except Exception:
                self.param_groups.pop()
                raise
        self._tiled_groups.append(_TiledGroup(tiled, engine))

    @property
    def step_in_backward(self) -> bool:
        """Whether the experts' tiles are stepped in backward, each the moment its gradient is final (fixed at
        construction; docs/guide.md, "Stepping in backward")."""
        return self._step_in_backward

    @contextlib.contextmanager
    def no_step(self) -> Iterator[None]:
        """Gradient accumulation with ``step_in_backward``: backwards inside only add into the experts' ``.grad``
        (the micro-batches before the last); the last backward, outside, steps the experts it reaches and
        ``step()`` the rest. Without step_in_backward it changes nothing."""
        with contextlib.ExitStack() as stack:
            for tg in self._tiled_groups:
                if tg.engine is not None:
                    stack.enter_context(tg.engine.no_step())
            yield

    @property
    def tiled_param_groups(self) -> list:
        """The tiled tensors of each parameter group (parallel to ``param_groups``)."""
        return [list(g.tensors) for g in self._tiled_groups]

    def step(self, closure: Any = None) -> Any:
        """torch's step over the torch parameters, then each group's engine over its tiled tensors (the group's
        current lr and options pushed to it first). A closure is evaluated once, first, with grad enabled."""
        torch = _torch()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, (group, tg) in enumerate(zip(self.param_groups, self._tiled_groups)):
            if tg.engine is not None:
                self._check_group(group, i)
        for group, tg in zip(self.param_groups, self._tiled_groups):
            if tg.engine is not None:
                self._push(tg.engine, group)
        self._torch_cls.step(self)
        for tg in self._tiled_groups:
            if tg.engine is not None:
                tg.engine.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad, and every tiled gradient dropped (``.grad = None``; an expert whose gradient is
        dropped is skipped by the next step until a backward reaches it, whatever ``set_to_none`` says)."""
        self._torch_cls.zero_grad(self, set_to_none)
        for tg in self._tiled_groups:
            if tg.engine is not None:
                tg.engine.zero_grad()

    # ---- state ---------------------------------------------------------------------------------------------------

    def _with_tiled(self, folder: str, sd: dict, relative: bool) -> dict:
        files = []
        from ._distributed import world_size_of
        group = self._group()
        world = world_size_of(group)
        rank = _torch().distributed.get_rank(group) if world > 1 else 0
        for i, tg in enumerate(self._tiled_groups):
            if tg.engine is None:
                files.append(None)
                continue
            # experts sharded over ranks: a file of each rank's own, should the ranks share a state_folder
            name = _tiled_file_of_rank(i, rank, world) if world > 1 else _tiled_file(i)
            tg.engine.save_state(os.path.join(folder, name))
            files.append(name)
        sd["strideweave"] = {"format": _FORMAT, "folder": None if relative else os.path.abspath(folder),
                             "tiled": [len(tg.tensors) for tg in self._tiled_groups], "files": files}
        return sd

    def state_dict(self) -> dict:
        """torch's state dict of the torch parameters; the tiled state is streamed to files in ``state_folder``
        (``tiled_state.<group>.safetensors``, overwritten by the next call) that the dict names. Without
        ``state_folder``, an optimizer with tiled parameters raises RuntimeError (use ``save_state(folder)``).
        With experts sharded over ranks, each rank's dict names its own files (``tiled_state.<group>.rank<r>-of-
        <N>.safetensors``, holding its own experts' state; not collective), which ``load_state_dict`` on a rank
        with the same share reads back (Note [Optimizer state across ranks])."""
        sd = self._torch_cls.state_dict(self)
        if not any(tg.engine is not None for tg in self._tiled_groups):
            return sd
        if self.state_folder is None:
            raise RuntimeError(f"{self._what}.state_dict(): the experts' optimizer state is streamed to files, "
                               "never held in the dict: set opt.state_folder = FOLDER first, or use "
                               "opt.save_state(FOLDER) / opt.load_state(FOLDER)")
        os.makedirs(self.state_folder, exist_ok=True)
        return self._with_tiled(str(self.state_folder), sd, relative=False)

    def _check_tiled_entry(self, sd: Any, where: str) -> Optional[dict]:
        has_tiled = any(tg.engine is not None for tg in self._tiled_groups)
        if not isinstance(sd, dict):
            raise TypeError(f"{self._what}.load_state_dict(): expected a dict, got {_describe(sd)}")
        entry = sd.get("strideweave")
        if entry is None:
            if has_tiled:
                raise ValueError(f"{self._what}.load_state_dict(): {where} holds no tiled state (it was not saved "
                                 "by a strideweave.torch optimizer with tiled parameters)")
            return None
        counts = [len(tg.tensors) for tg in self._tiled_groups]
        if entry.get("format") != _FORMAT or entry.get("tiled") != counts:
            raise ValueError(f"{self._what}.load_state_dict(): {where} has tiled groups of sizes "
                             f"{entry.get('tiled')}, this optimizer {counts}")
        return entry

    def _load(self, sd: dict, folder: Optional[str], where: str) -> None:
        entry = self._check_tiled_entry(sd, where)
        if entry is not None:
            base = folder if folder is not None else entry.get("folder")
            # every rank's files (one rank when saved by one process), Note [Optimizer state across ranks]
            saved = entry.get("ranks") or [entry["files"]]
            from ._distributed import world_size_of
            group = self._group()
            world = world_size_of(group)
            rank = _torch().distributed.get_rank(group) if group is not None else 0
            paths = []
            for i, tg in enumerate(self._tiled_groups):
                if tg.engine is None:
                    continue
                sources = []
                for files in saved:
                    name = files[i] if i < len(files) else None
                    if base is None or name is None:
                        raise ValueError(f"{self._what}.load_state_dict(): {where} names no file for group {i}")
                    path = os.path.join(base, name)
                    if not os.path.isfile(path):
                        raise FileNotFoundError(f"{self._what}.load_state_dict(): {path} (the tiled state of group "
                                                f"{i}) does not exist")
                    sources.append(path)
                # the same number of ranks: each rank's own file (the same shares); else re-sharded on load
                paths.append((tg, sources[rank] if len(sources) == world else sources))
        torch_sd = {k: v for k, v in sd.items() if k != "strideweave"}
        self._torch_cls.load_state_dict(self, torch_sd)
        if entry is not None:
            for tg, source in paths:
                if isinstance(source, str):
                    tg.engine.load_state(source)
                    continue
                from ._experts import owner_of
                from ._resharding import reshard
                owned = [owner_of(t).experts_range for t in tg.tensors]
                reshard(source, owned, lambda path: tg.engine.load_state(path), self._what)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, and the tiled state from the files the dict names (``state_dict()``)."""
        self._load(state_dict, None, "the state dict")

    def _group(self) -> Any:
        """The process group the tiled tensors' experts are sharded over (None: one process, or no tiled tensor)."""
        from ._distributed import sharded_group
        from ._experts import owner_of
        return sharded_group(owner_of(t) for tg in self._tiled_groups for t in tg.tensors)

    def save_state(self, folder: Any) -> None:
        """Writes everything into `folder` (created): torch's state dict and the groups' options
        (``optimizer.pt``) and each group's tiled state streamed to ``tiled_state.<group>.safetensors``.

        For experts sharded over the ranks of a process group (Note [Optimizer state across ranks]) it is collective:
        every rank writes its own experts' state (``tiled_state.<group>.rank<r>-of-<N>.safetensors``) into the one
        `folder` (shared by the ranks), then rank 0 writes ``optimizer.pt`` naming every rank's files; an error on
        any rank raises on every rank, and ``optimizer.pt`` is then not written."""
        torch = _torch()
        folder = os.fspath(folder)
        group = self._group()
        from ._distributed import world_size_of
        if world_size_of(group) > 1:
            self._save_across_ranks(folder, group)
            return
        os.makedirs(folder, exist_ok=True)
        sd = self._with_tiled(folder, self._torch_cls.state_dict(self), relative=True)
        torch.save(sd, os.path.join(folder, STATE_FILE))

    def _save_across_ranks(self, folder: str, group: Any) -> None:
        torch = _torch()
        dist = torch.distributed
        rank, world = dist.get_rank(group), dist.get_world_size(group)

        def agree(error: Any, value: Any = None) -> list:
            out: list = [None] * world
            dist.all_gather_object(out, (None if error is None else f"{type(error).__name__}: {error}", value),
                                   group=group)
            failed = [(r, message) for r, (message, _) in enumerate(out) if message is not None]
            if failed:
                if error is not None:
                    raise error
                raise RuntimeError(f"{self._what}.save_state(): " + "; ".join(
                    f"rank {r} failed ({message})" for r, message in failed) + f" ({STATE_FILE} was not written)")
            return [value for _, value in out]

        error: Any = None
        files: list = []
        try:
            os.makedirs(folder, exist_ok=True)
            if rank == 0 and os.path.lexists(os.path.join(folder, STATE_FILE)):
                os.remove(os.path.join(folder, STATE_FILE))  # written again last, once every rank's files are
            for i, tg in enumerate(self._tiled_groups):
                if tg.engine is None:
                    files.append(None)
                    continue
                name = _tiled_file_of_rank(i, rank, world)
                tg.engine.save_state(os.path.join(folder, name))
                files.append(name)
        except Exception as e:  # noqa: BLE001 (raised on every rank by agree)
            error = e
        ranks = agree(error, files)
        try:
            if rank == 0:
                sd = self._torch_cls.state_dict(self)
                sd["strideweave"] = {"format": _FORMAT, "folder": None,
                                     "tiled": [len(tg.tensors) for tg in self._tiled_groups], "files": ranks[0],
                                     "ranks": ranks}
                part = os.path.join(folder, STATE_FILE + f".part-{os.getpid()}")
                torch.save(sd, part)
                os.replace(part, os.path.join(folder, STATE_FILE))
        except Exception as e:  # noqa: BLE001
            error = e
        agree(error)

    def load_state(self, folder: Any) -> None:
        """Restores what ``save_state(folder)`` wrote (the optimizer must hold the same groups)."""
        torch = _torch()
        folder = os.fspath(folder)
        path = os.path.join(folder, STATE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{self._what}.load_state(): {path} does not exist (written by save_state)")
        self._load(torch.load(path, weights_only=True), folder, path)


def _set(engine: Any, key: str, value: Any) -> None:
    """Sets one hyperparameter of a ``strideweave.optim`` engine when it changed (the engine validates it)."""
    if getattr(engine, key) != value:
        setattr(engine, key, value)


def _pair(betas: Any) -> tuple:
    b1, b2 = betas
    return _number(b1), _number(b2)


_CLASSES: Optional[dict] = None


def _classes() -> dict:
    """SGD, Adam and AdamW, defined on first use (they derive from torch's classes)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    torch = _torch()
    sw = _sw()

    class SGD(_Bridge, torch.optim.SGD):
        """``torch.optim.SGD`` over the torch parameters and ``strideweave.optim.SGD`` over the tiled experts of
        each group: ``SGD(model_or_params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False,
        *, state_folder=None, state_dtype=None, step_in_backward=False)`` (``state_dtype``: how the tiled engines store
        their state, ``strideweave.DType.Float32`` (None: the default), ``DType.BFloat16`` or ``"8bit"``
        (``strideweave.optim.STATE_8BIT``: 8-bit block-wise); torch's own state is
        torch's; ``step_in_backward``: the experts stepped in backward, Note [Stepping in backward through
        torch])."""

        _torch_cls = torch.optim.SGD
        _FIXED = {"maximize": False, "differentiable": False}

        def __init__(self, model_or_params: Any, lr: Any = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                     weight_decay: float = 0.0, nesterov: bool = False, *, state_folder: Any = None,
                     foreach: Optional[bool] = None, state_dtype: Any = None,
                     step_in_backward: bool = False) -> None:
            self._state_dtype = state_dtype
            self._init(torch.optim.SGD, model_or_params, state_folder,
                       dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                            nesterov=nesterov, foreach=foreach), step_in_backward)

        def _engine_for(self, tiled: list, group: dict) -> Any:
            return sw.optim.SGD(tiled, lr=_number(group["lr"]), momentum=_number(group["momentum"]),
                                dampening=_number(group["dampening"]), weight_decay=_number(group["weight_decay"]),
                                nesterov=bool(group["nesterov"]), state_dtype=self._state_dtype,
                                step_in_backward=self._step_in_backward)

        def _push(self, engine: Any, group: dict) -> None:
            nesterov = bool(group["nesterov"])
            if not nesterov:  # off first: momentum and dampening may then take any valid value
                _set(engine, "nesterov", False)
            for key in ("lr", "momentum", "dampening", "weight_decay"):
                _set(engine, key, _number(group[key]))
            if nesterov:
                _set(engine, "nesterov", True)

    def adam_engine(self: Any, tiled: list, group: dict) -> Any:
        cls = sw.optim.AdamW if self._decoupled else sw.optim.Adam
        return cls(tiled, lr=_number(group["lr"]), betas=_pair(group["betas"]), eps=_number(group["eps"]),
                   weight_decay=_number(group["weight_decay"]), state_dtype=self._state_dtype,
                   step_in_backward=self._step_in_backward)

    def adam_push(self: Any, engine: Any, group: dict) -> None:
        _set(engine, "lr", _number(group["lr"]))
        _set(engine, "betas", _pair(group["betas"]))
        _set(engine, "eps", _number(group["eps"]))
        _set(engine, "weight_decay", _number(group["weight_decay"]))

    class Adam(_Bridge, torch.optim.Adam):
        """``torch.optim.Adam`` over the torch parameters and ``strideweave.optim.Adam`` over the tiled experts
        of each group: ``Adam(model_or_params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
        *, state_folder=None, state_dtype=None, step_in_backward=False)`` (``state_dtype``, ``step_in_backward``: as
        SGD's)."""

        _torch_cls = torch.optim.Adam
        _decoupled = False
        _FIXED = {"amsgrad": False, "maximize": False, "differentiable": False, "decoupled_weight_decay": False}
        _engine_for = adam_engine
        _push = adam_push

        def __init__(self, model_or_params: Any, lr: Any = 1e-3, betas: Any = (0.9, 0.999), eps: float = 1e-8,
                     weight_decay: float = 0.0, *, state_folder: Any = None,
                     foreach: Optional[bool] = None, state_dtype: Any = None,
                     step_in_backward: bool = False) -> None:
            self._state_dtype = state_dtype
            self._init(torch.optim.Adam, model_or_params, state_folder,
                       dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach),
                       step_in_backward)

    class AdamW(_Bridge, torch.optim.AdamW):
        """``torch.optim.AdamW`` over the torch parameters and ``strideweave.optim.AdamW`` over the tiled
        experts of each group: ``AdamW(model_or_params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
        weight_decay=1e-2, *, state_folder=None, state_dtype=None, step_in_backward=False)`` (``state_dtype``,
        ``step_in_backward``: as SGD's)."""

        _torch_cls = torch.optim.AdamW
        _decoupled = True
        _FIXED = {"amsgrad": False, "maximize": False, "differentiable": False, "decoupled_weight_decay": True}
        _engine_for = adam_engine
        _push = adam_push

        def __init__(self, model_or_params: Any, lr: Any = 1e-3, betas: Any = (0.9, 0.999), eps: float = 1e-8,
                     weight_decay: float = 1e-2, *, state_folder: Any = None,
                     foreach: Optional[bool] = None, state_dtype: Any = None,
                     step_in_backward: bool = False) -> None:
            self._state_dtype = state_dtype
            self._init(torch.optim.AdamW, model_or_params, state_folder,
                       dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach),
                       step_in_backward)

    for cls in (SGD, Adam, AdamW):
        cls.__module__ = "strideweave.torch"
        cls.__qualname__ = cls.__name__
    _CLASSES = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}
    return _CLASSES


# ---- clipping ------------------------------------------------------------------------------------------------------


def clip_grad_norm_(model_or_parameters: Any, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None, *,
                    process_group: Any = None) -> Any:
    """``torch.nn.utils.clip_grad_norm_`` over torch's gradients and the tiled expert gradients together.

    ``model_or_parameters``: a model (its parameters and every bound experts module's tiled tensors) or an
    iterable of torch parameters, tiled expert tensors and OffloadedExperts bindings (or one of them). The total
    norm is the ``norm_type`` norm of the per-tensor norms of torch's gradients (as torch computes them) and the
    norm of all tiled gradients (``strideweave.optim.grad_norm``: one pass over the gradient tiles under the
    budget); it is returned as a torch tensor. When ``max_norm / (total + 1e-6) < 1`` every gradient is scaled by
    it (torch's in place, the tiled ones by ``strideweave.optim.scale_grads``). ``error_if_nonfinite``: a
    non-finite total raises RuntimeError and nothing is scaled.

    Across ranks (a model opened with a process group, or ``process_group`` given; Note [Experts across ranks] in
    ``_distributed``) the norm is the global one, the same on every rank: torch's gradients are taken as replicated
    (``all_reduce_gradients`` made them equal) and counted once, the tiled ones (each rank's own experts) summed
    over the ranks; the call is then collective.
    """
    torch = _torch()
    sw = _sw()
    what = "strideweave.torch.clip_grad_norm_"
    from ._distributed import check_group, global_tiled_norm, group_of, sharded_group
    from ._experts import owner_of
    pg = check_group(process_group, what)
    if isinstance(model_or_parameters, torch.nn.Module):
        plain: list = [p for p in model_or_parameters.parameters()]
        from ._offload import offloaded_experts
        tiled = [t for b in offloaded_experts(model_or_parameters).values() for t in b.tiled.values()]
        if pg is None:
            pg = group_of(model_or_parameters)
    else:
        plain, tiled = _split_params(model_or_parameters, what, "parameters")
        plain = [x[1] if isinstance(x, tuple) else x for x in plain]
        if pg is None:
            pg = sharded_group(owner_of(t) for t in tiled)
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) and not \
            (isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1):
        raise TypeError(f"{what}: max_norm must be a number, got {_describe(max_norm)}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"{what}: norm_type must be a number, got {_describe(norm_type)}")
    norm_type = float(norm_type)
    for t in tiled:
        if sw._core._steps_in_backward(t):
            raise ValueError(f"{what}: the experts' optimizer has step_in_backward=True: each expert is stepped in "
                             "backward before the other gradients exist, so clipping by the total norm cannot apply "
                             "(build it with step_in_backward=False to clip; nothing was scaled)")
    from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support
    grads = [p.grad for p in plain if p.grad is not None]
    tiled_with_grad = [t for t in tiled if t.grad is not None]
    if not grads and not tiled_with_grad and pg is None:
        return torch.tensor(0.0)
    with torch.no_grad():
        # torch's get_total_norm: per-tensor norms by (device, dtype), foreach where supported.
        norms = []
        by_kind: dict = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_kind.items():
            if (foreach is None and _has_foreach_support(group, device)) or \
                    (foreach and _device_has_foreach_support(device)):
                norms.extend(torch._foreach_norm(group, norm_type))
            elif foreach:
                raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} "
                                   "tensors")
            else:
                norms.extend(torch.linalg.vector_norm(g, norm_type) for g in group)
        first = grads[0] if grads else None
        dtype = first.dtype if first is not None else torch.float32
        device = first.device if first is not None else torch.device("cpu")
        if pg is not None:  # every rank's tiled gradients (each expert on one rank): collective
            local = sw.optim.grad_norm(tiled_with_grad, norm_type) if tiled_with_grad else 0.0
            norms.append(torch.tensor(global_tiled_norm(local, norm_type, pg), dtype=dtype, device=device))
        elif tiled_with_grad:  # one norm over every tiled gradient, one pass over the tiles
            norms.append(torch.tensor(sw.optim.grad_norm(tiled_with_grad, norm_type), dtype=dtype, device=device))
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                               "by the non-finite norm anyway, set `error_if_nonfinite=False`")
        if grads:
            torch.nn.utils.clip_grads_with_norm_(plain, float(max_norm), total, foreach)
        # torch's factor, as torch computes it; torch also multiplies by 1.0, which changes nothing.
        factor = float(torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
        if tiled_with_grad and not factor >= 1.0:
            sw.optim.scale_grads(tiled_with_grad, factor)
    return total


def __getattr__(name: str) -> Any:
    if name in ("SGD", "Adam", "AdamW"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


