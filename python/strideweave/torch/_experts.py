"""The experts implementation StrideWeave registers in transformers' experts interface, and the binding of one
experts module to tiles of a checkpoint (docs/guide.md, "Opening a Hugging Face MoE bigger than RAM").

Note [Experts on transformers' interface]
transformers 5.x runs the experts module of every family declared with ``use_experts_implementation`` through one
registry, ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``, chosen by ``config._experts_implementation``;
the module's forward is ``(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``. Routing
(softmax or sigmoid scores, group-limited top-k, correction biases, jitter, tie-breaking) happens before, in the
family's own code, so it is transformers' by construction. We register "strideweave" there. A bound module gets a
shallow copy of its config whose ``_experts_implementation`` is "strideweave", so only bound modules dispatch to
us (unbound layers keep the model's implementation); its weight parameters are deleted (they were never allocated
when the model was opened by ``from_pretrained``) and replaced by the binding, ``module._strideweave``.

Two ways compute a bound module, both projecting each routed expert's tiles under the residency budget, one
expert at a time (the next one's projection in flight), and saving no weight for backward:

* the SparseMoE node (C++, cpp/src/moe): SwiGLU experts with separate gate/up/down tensors per expert, no bias,
  the interface's default gate (``act_fn(gate) * up`` with ``act_fn`` silu) - most families;
* per-expert math in torch over projected tiles: anything else the family declares (fused ``(E, 2I, H)`` tiles,
  transposed or interleaved gate/up, biases, another activation or the family's own ``_apply_gate`` such as
  GPT-OSS's clamped one, Llama4's input-scaled experts). Each expert's tiles are projected (C++), exported to
  torch without a copy of the tile (DLPack), and the family's own functions compute on them; backward projects
  them again, recomputes the expert with torch's autograd on that expert's tokens and adds the weight gradients
  into the tiled gradients through StrideWeave's autograd (the projection's scatter-add).

Note [Quantized experts]
A checkpoint may store the experts quantized (``sw.safetensors.Quantized``: DeepSeek-V3's FP8 weights with
``weight_scale_inv`` per 128 x 128 block, GPT-OSS's MXFP4 ``*_blocks``/``*_scales``). The binding then opens them
with ``ckpt.tiled(..., dtype=<the module's dtype>)``: each promotion reads the quantized bytes and their scales and
dequantizes them (C++) into a primary tile of the module's dtype, which is all the computation ever sees. Such a
tensor matches the module by its dequantized shape (any format the reader knows); its tiles are never written back
into the checkpoint (writes, an optimizer step's, go to the scratch overlay in the module's dtype). MXFP4 stores a
transposed module's matrices untransposed (GPT-OSS's ``gate_up_proj`` (E, H, 2I) as blocks of (E, 2I, H)): the
tiles are then (out, in) matrices (``tiles_transposed`` False) and the per-expert math uses ``F.linear`` on them;
``gather`` gives the module's own form.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Optional

from .._core import _dlpack_read_only
from ._bridge import _leaf_grads, _sw, _sw_dtype, _torch, from_torch, to_torch
from ._optim import push_in_backward
from .families import COMMON_FORMS, Family, Fused, Separate, checkpoint_prefix

IMPLEMENTATION = "strideweave"
_REGISTERED = False
# id(tiled tensor) -> the live binding that holds it (strideweave.torch's optimizers accept only these).
_OWNERS: "weakref.WeakValueDictionary[int, OffloadedExperts]" = weakref.WeakValueDictionary()


def owner_of(t: Any) -> "Optional[OffloadedExperts]":
    """The live binding whose ``tiled`` holds exactly `t`, else None."""
    b = _OWNERS.get(id(t))
    return b if b is not None and any(x is t for x in b.tiled.values()) else None


def register() -> None:
    """Registers "strideweave" in transformers' ``ALL_EXPERTS_FUNCTIONS`` (once)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers.integrations import moe as hf_moe
    hf_moe.ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    _REGISTERED = True


def experts_forward(module: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The registered experts function: the module's binding computes it."""
    binding = module.__dict__.get("_strideweave")
    if binding is None:
        raise RuntimeError(f"strideweave experts implementation: {type(module).__name__} is not bound to tiles "
                           "(strideweave.torch.from_pretrained or offload_experts binds it)")
    return binding(hidden_states, top_k_index, top_k_weights)


def _default_gate() -> Any:
    from transformers.integrations import moe as hf_moe
    return hf_moe._default_apply_gate


class ExpertsSpec:
    """What an experts module computes, read from the module before its weights go: sizes, dtype, the
    transformers parameters the tiles replace and the flags of its declaration."""

    def __init__(self, module: Any, outside: Optional[str]) -> None:
        torch = _torch()
        self.outside = outside
        self.module_class = type(module).__name__
        if outside == "dbrx":
            mlp = module.mlp
            pending = module.__dict__.get("_strideweave_meta")
            self.params = dict(pending) if pending else {"mlp.w1": mlp.w1, "mlp.v1": mlp.v1, "mlp.w2": mlp.w2}
            self.experts = int(module.num_experts)
            self.inter, self.hidden = int(module.ffn_hidden_size), int(module.hidden_size)
            self.transposed, self.concatenated, self.has_bias, self.has_gate = False, True, False, True
            self.act = mlp.activation_fn
        else:
            pending = module.__dict__.get("_strideweave_meta")  # weights never allocated (from_pretrained)
            self.params = dict(pending) if pending else {n: p for n, p in module.named_parameters(recurse=False)
                                                         if n in ("gate_up_proj", "down_proj")}
            gu = self.params.get("gate_up_proj")
            down = self.params.get("down_proj")
            if gu is None or down is None:
                raise TypeError(f"{self.module_class} holds {sorted(self.params)}; the experts StrideWeave binds hold "
                                "gate_up_proj and down_proj (an experts module without a gate is not supported)")
            self.transposed = bool(getattr(module, "is_transposed", outside == "llama4"))
            self.concatenated = bool(getattr(module, "is_concatenated", True))
            self.has_bias = bool(getattr(module, "has_bias", False))
            self.has_gate = bool(getattr(module, "has_gate", True))
            if getattr(module, "has_post_expert_norm", False):
                raise TypeError(f"{self.module_class} normalizes each expert's output (has_post_expert_norm); "
                                "StrideWeave's experts do not")
            self.experts = int(gu.shape[0])
            two_i = gu.shape[2] if self.transposed else gu.shape[1]
            self.hidden = int(gu.shape[1] if self.transposed else gu.shape[2])
            self.inter = int(two_i) // 2
            self.act = getattr(module, "act_fn", None)
        self.dtype = next(iter(self.params.values())).dtype
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{self.module_class}'s experts are {self.dtype}; StrideWeave's experts take "
                            "torch.float32, torch.bfloat16 or torch.float16")
        self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        # Names only from here: holding the module's Parameters would keep the in-RAM experts alive after
        # offload_experts drops them from the module.
        self.params = dict.fromkeys(self.params)
        custom_gate = type(module).__dict__.get("_apply_gate") or getattr(type(module), "_apply_gate", None)
        self.default_gate = outside is not None or custom_gate is None or custom_gate is _default_gate()
        act_name = type(self.act).__name__ if self.act is not None else None
        self.silu = act_name in ("SiLUActivation", "SiLU")


def _quantized(ckpt: Any, name: str) -> Any:
    """The checkpoint's ``sw.safetensors.Quantized`` description of `name` (an FP8 weight with its scales, or
    MXFP4 ``name_blocks``/``name_scales``), else None."""
    q = getattr(_sw().safetensors, "Quantized", None)
    if q is None or (name not in ckpt and name + "_blocks" not in ckpt):
        return None
    stored = ckpt.dtype(name)
    return stored if isinstance(stored, q) else None


def _expect(ckpt: Any, name: str, shape: tuple, dtype: Any, what: str, untransposed: Optional[tuple] = None) -> bool:
    """ValueError/TypeError when the checkpoint's `name` is not of `shape` and `dtype` (a StrideWeave DType).
    A quantized tensor (Note [Quantized experts]) is accepted in any format the checkpoint reader knows, compared
    by its dequantized shape, which may also be `untransposed` (the module's transposed form stored (out, in));
    returns whether the tensor is stored in that untransposed form."""
    q = _quantized(ckpt, name)
    if q is not None:
        got = tuple(q.shape)
        # MXFP4 groups 32 values along the last axis, the contraction's: a transposed module's matrices are stored
        # (out, in). Another format is stored in the module's form, or (out, in) when that is not the same shape.
        flipped = untransposed is not None and (q.format == "mxfp4" or got != shape)
        want = untransposed if flipped else shape
        if got != want:
            raise ValueError(f"{name!r} ({q}) has shape {got}, the model's {what} {want}")
        return flipped
    got = tuple(ckpt.shape(name))
    if got != shape:
        raise ValueError(f"{name!r} has shape {got}, the model's {what} {shape}")
    if ckpt.dtype(name).name != dtype.name:
        raise TypeError(f"{name!r} is {ckpt.dtype(name).name}, the model's {what} {dtype.name} (nothing converts "
                        "implicitly; open the model in the checkpoint's dtype)")
    return False


class OffloadedExperts:
    """One experts module bound to tiles of a checkpoint: ``module._strideweave``.

    ``name``: the module's path in the model; ``layer``: its decoder layer; ``family``: the declared family;
    ``tiled``: role -> the StrideWeave tiled tensor (``"gate"``, ``"up"``, ``"down"`` for tensors stored per expert,
    ``"gate_up"``, ``"down"`` for fused ones), shape ``(rows, cols, E)`` with each expert a tile as the checkpoint
    holds it (what ``strideweave.optim`` optimizers take); ``checkpoint_names``: role -> the checkpoint's names of
    its tiles; ``parameter_names``: the transformers parameters the tiles stand for (relative to the module).
    """

    def __init__(self, module: Any, name: str, layer: Optional[int], family: Optional[Family], spec: ExpertsSpec,
                 ckpt: Any, budget: Any, mutable: bool) -> None:
        self.name, self.layer, self.spec = name, layer, spec
        self.family = family.name if family else "other"
        self.module_class = spec.module_class
        self.budget = budget
        sw_dtype = _sw_dtype(spec.dtype)
        E, H, I = spec.experts, spec.hidden, spec.inter
        prefix = checkpoint_prefix(family, name)
        forms = tuple(family.forms if family else ()) + tuple(f for f in COMMON_FORMS
                                                             if not family or f not in family.forms)
        tried = []
        chosen = None
        for form in forms:
            if isinstance(form, Separate):
                if form.split:
                    names = {r: f"{prefix}.{getattr(form, r)}" for r in ("gate", "up", "down")}
                    if all(n in ckpt for n in names.values()):
                        chosen = (form, {r: [n] for r, n in names.items()})
                        break
                    tried.append(names["gate"])
                else:
                    names = {r: [f"{prefix}.{getattr(form, r).format(e=e)}" for e in range(E)]
                             for r in ("gate", "up", "down")}
                    if names["gate"][0] in ckpt:
                        chosen = (form, names)
                        break
                    tried.append(names["gate"][0])
            else:
                names = {"gate_up": [f"{prefix}.{form.gate_up}"], "down": [f"{prefix}.{form.down}"]}
                if names["gate_up"][0] in ckpt or names["gate_up"][0] + "_blocks" in ckpt:
                    chosen = (form, names)
                    break
                tried.append(names["gate_up"][0])
        if chosen is None:
            raise ValueError(f"the checkpoint has none of the tensors of {name} ({self.module_class}): tried "
                             f"{', '.join(repr(t) for t in tried)}")
        form, names = chosen
        self.form = form
        self.fused = isinstance(form, Fused)
        if self.fused and spec.outside == "dbrx":
            raise ValueError(f"{name}: DBRX experts are stored per projection (mlp.w1, mlp.v1, mlp.w2)")
        if not self.fused and not spec.concatenated:
            raise TypeError(f"{name}: {self.module_class} interleaves gate and up, but the checkpoint stores them "
                            "as separate tensors")
        # Shapes and dtypes, every tensor, before anything opens.
        # Whether the tiles are the module's transposed (in, out) form; a quantized checkpoint may store a transposed
        # module's matrices (out, in) (GPT-OSS's MXFP4 experts), computed then with F.linear.
        self.tiles_transposed = spec.transposed
        if self.fused:
            gu_shape = (H, 2 * I) if spec.transposed else (2 * I, H)
            down_shape = (I, H) if spec.transposed else (H, I)
            alt = {"gate_up": (E, 2 * I, H), "down": (E, H, I)} if spec.transposed else {"gate_up": None, "down": None}
            flipped = [_expect(ckpt, names["gate_up"][0], (E,) + gu_shape, sw_dtype, f"{name}.gate_up_proj",
                               alt["gate_up"]),
                       _expect(ckpt, names["down"][0], (E,) + down_shape, sw_dtype, f"{name}.down_proj", alt["down"])]
            if flipped[0] != flipped[1]:
                raise ValueError(f"{name}: the checkpoint stores gate_up_proj and down_proj in different forms (one "
                                 "transposed, one not)")
            if flipped[0]:
                self.tiles_transposed = False
                gu_shape, down_shape = (2 * I, H), (H, I)
            self.tile_shapes = {"gate_up": gu_shape, "down": down_shape}
        else:
            if spec.transposed:
                raise TypeError(f"{name}: {self.module_class} is transposed, but the checkpoint stores (out, in) "
                                "matrices per expert")
            down_shape = (I, H) if form.down_transposed else (H, I)
            self.tile_shapes = {"gate": (I, H), "up": (I, H), "down": down_shape}
            for role, ns in names.items():
                if form.split:
                    _expect(ckpt, ns[0], (E * self.tile_shapes[role][0], self.tile_shapes[role][1]), sw_dtype,
                            f"{name} {role} projection")
                else:
                    missing = [n for n in ns if n not in ckpt]
                    if missing:
                        raise ValueError(f"the checkpoint has no tensor {missing[0]!r} ({name} {role} projection; "
                                         f"{len(missing)} of {len(ns)} such names missing)")
                    for n in ns:
                        _expect(ckpt, n, self.tile_shapes[role], sw_dtype, f"{name} {role} projection")
        self.checkpoint_names = names
        self.checkpoint = ckpt  # the open strideweave.safetensors Checkpoint the tiles are over
        # name -> sw.safetensors.Quantized for the quantized tensors (Note [Quantized experts])
        self.quantized = {n: q for ns in names.values() for n in ns if (q := _quantized(ckpt, n)) is not None}
        if self.quantized and len(self.quantized) != sum(len(ns) for ns in names.values()):
            raise TypeError(f"{name}: some of its checkpoint tensors are quantized and some are not")
        self.tiled = {}
        for role, ns in names.items():
            kw = {"dtype": sw_dtype} if self.quantized else {}
            if self.fused:
                self.tiled[role] = ckpt.tiled(ns[0], mutable=mutable, **kw)
            elif form.split:
                self.tiled[role] = ckpt.tiled(ns[0], tiles=E, mutable=mutable, **kw)
            else:
                self.tiled[role] = ckpt.tiled(ns, mutable=mutable, **kw)
        for t in self.tiled.values():
            _OWNERS[id(t)] = self
        self.parameter_names = tuple(spec.params)
        self.expert_bytes = sum(_prod(s) for s in self.tile_shapes.values()) * (sw_dtype.bits // 8)
        self._moes: dict = {}
        # The C++ SparseMoE computes SwiGLU experts stored per expert, without bias, with the default gate.
        # (A down projection stored (I, H), DBRX's, is not a view SparseMoE can take of a tiled tensor.)
        self.native = (not self.fused and not form.down_transposed and spec.silu and spec.default_gate
                       and not spec.has_bias and spec.outside != "llama4")
        for t in self.tiled.values():  # the tiles draw from the budget from the start (SparseMoE joins it too)
            if t.carrier.residency_budget is None:
                t.carrier.set_residency_budget(budget)
        self._module_ref = module
        self.prefetch_next: Optional[OffloadedExperts] = None  # the binding whose backward runs after this one's
        self.record_routing = False
        self._last_index: Any = None
        # Expert parallelism (Note [Experts across ranks] in _distributed.py): the group the experts are sharded
        # over and this rank's share of them (every expert without a group).
        self.process_group: Any = None
        self.experts_range = range(E)

    # ---- computing -------------------------------------------------------------------------------------------

    def _sparse_moe(self, k: int, routing_dtype: Any) -> Any:
        """The SparseMoE over the tiles for top-k `k` and routing weights of `routing_dtype` (a torch dtype)."""
        key = (k, routing_dtype)
        moe = self._moes.get(key)
        if moe is None:
            sw = _sw()
            w1, w3, w2 = self.tiled["gate"], self.tiled["up"], self.tiled["down"]
            moe = sw.moe.SparseMoE(w1, w2, w3, k, normalize=False, routing_dtype=_sw_dtype(routing_dtype),
                                   budget=self.budget)
            self._moes[key] = moe
        return moe

    def __call__(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        torch = _torch()
        module = self._module_ref
        if hidden_states.dtype != self.spec.dtype:
            raise TypeError(f"{self.name}: hidden states are {hidden_states.dtype}, the experts {self.spec.dtype} "
                            "(nothing converts implicitly)")
        x = hidden_states.reshape(-1, self.spec.hidden)
        k = top_k_index.shape[-1]
        if self.process_group is not None:
            from ._distributed import experts_forward as sharded_forward
            return sharded_forward(self, x, top_k_index, top_k_weights)
        if self.native and top_k_weights.dtype in (torch.float32, self.spec.dtype):
            return _classes()["Native"].apply(x, top_k_weights.reshape(-1, k), self,
                                              top_k_index.reshape(-1, k))
        pairs = _dispatch(top_k_index.reshape(-1, k), k)
        biases = (getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None)) \
            if self.spec.has_bias else (None, None)
        return _classes()["Math"].apply(x, top_k_weights.reshape(-1), biases[0], biases[1], self, pairs, False)

    def llama4_block(self, block: Any, hidden_states: Any) -> Any:
        """Llama4TextMoe.forward with these experts: the router's scores scale each routed expert's input."""
        torch = _torch()
        hidden_states = hidden_states.reshape(-1, self.spec.hidden)
        router_scores, router_logits = block.router(hidden_states)
        T, E = router_scores.shape
        with torch.no_grad():
            mask = router_scores != 0
            flat = mask.reshape(-1).nonzero().squeeze(-1)  # t * E + e, ascending
            experts = flat % E
            order = torch.argsort(experts, stable=True)
            pos = flat[order]
            uniq, counts = torch.unique_consecutive(experts[order], return_counts=True)
            groups = [(int(e), p // E, p) for e, p in zip(uniq.tolist(), torch.split(pos, counts.tolist()))]
        if hidden_states.dtype != self.spec.dtype:
            raise TypeError(f"{self.name}: hidden states are {hidden_states.dtype}, the experts {self.spec.dtype}")
        routed = _classes()["Math"].apply(hidden_states, router_scores.reshape(-1), None, None, self, groups, True)
        out = block.shared_expert(hidden_states)
        out.add_(routed)
        return out, router_logits

    def llama4_experts(self, routed_in: Any) -> Any:
        """Llama4TextExperts.forward: (E * T, H) inputs, expert e's rows e*T..(e+1)*T already scaled by its score
        (0 for a token that did not pick it), to (E * T, H) outputs. A zero row's output is zero (no bias; silu(0)
        = 0), so only nonzero rows are computed, which is what the dense computation gives."""
        torch = _torch()
        E = self.spec.experts
        x = routed_in.reshape(-1, self.spec.hidden)
        T = x.shape[0] // E
        with torch.no_grad():
            nonzero = (x != 0).any(dim=-1).reshape(E, T)
            groups = []
            for e in range(E):
                rows = nonzero[e].nonzero().squeeze(-1) + e * T
                if rows.numel():
                    groups.append((e, rows, rows))
        ones = torch.ones(x.shape[0], dtype=x.dtype)
        return _classes()["Math"].apply(x, ones, None, None, self, groups, False)

    # ---- per-expert projections --------------------------------------------------------------------------------

    def _start(self, e: int, record: bool) -> dict:
        """Starts projecting expert `e`'s tiles (role -> pending projection)."""
        sw = _sw()
        sel = sw.TileSelection([[0], [0], [e]])
        previous = sw.is_grad_enabled()
        sw.set_grad_enabled(record)
        try:
            return {r: t.carrier.project(t, sel) for r, t in self.tiled.items()}
        finally:
            sw.set_grad_enabled(previous)

    @staticmethod
    def _finish(pending: dict) -> tuple:
        """(role -> StrideWeave (rows, cols, 1) projection, role -> torch (rows, cols) view of it)."""
        torch = _torch()
        compact = {r: p.wait() for r, p in pending.items()}
        # Read-only views of the projections' memory: a one-tile projection shares the resident tile's memory
        # (copy-on-write), which a writable export would first copy; the arithmetic only reads them (they are
        # detached leaves), and they are dropped before the next expert.
        return compact, {r: torch.from_dlpack(_dlpack_read_only(c))[..., 0] for r, c in compact.items()}

    def _depth(self, backward: bool) -> int:
        """Experts in flight beside the one computing: 1 when the budget holds two experts (with Float32
        gradients in backward), else 0."""
        per = self.expert_bytes + (2 * self.expert_bytes * 4 // max(1, self.spec.dtype.itemsize)
                                   if backward else 0)
        return 1 if self.budget.max_bytes >= 2 * per else 0

    def _expert(self, W: dict, e: int, x: Any, bgu: Any, bd: Any) -> Any:
        """One expert on its tokens `x` (n, H), in the family's own arithmetic."""
        torch = _torch()
        spec, module = self.spec, self._module_ref
        F = torch.nn.functional
        if self.fused:
            gu = x @ W["gate_up"] if self.tiles_transposed else F.linear(x, W["gate_up"])
            if bgu is not None:
                gu = gu + bgu[e]
            if spec.outside == "llama4":
                gate, up = gu.chunk(2, dim=-1)
                h = up * spec.act(gate)
            else:
                h = module._apply_gate(gu)
            y = h @ W["down"] if self.tiles_transposed else F.linear(h, W["down"])
            if bd is not None:
                y = y + bd[e]
            return y
        gate, up = F.linear(x, W["gate"]), F.linear(x, W["up"])
        if spec.outside == "dbrx":
            h = spec.act(gate) * up
        else:
            h = module._apply_gate(torch.cat([gate, up], dim=-1))
        return h @ W["down"] if self.form.down_transposed else F.linear(h, W["down"])

    # ---- tests, saving ---------------------------------------------------------------------------------------

    def gather(self, name: str, *, grad: bool = False, experts: Any = None) -> Any:
        """A torch COPY of transformers' parameter `name` (relative to the module, e.g. ``"gate_up_proj"``) in the
        module's own form and dtype, from the tiles; ``grad=True``: the accumulated gradient in that form (zeros
        where no backward reached; the gradient tiles' dtype, the weights'). Reads every expert: for tests and small
        models. ``experts``: only these experts (a range or list of indices; the expert axis then has their count),
        reading only their tiles; a binding sharded over several ranks takes only experts of its own share
        (``experts_range``) and requires it."""
        torch = _torch()
        import numpy as np
        if name not in self.spec.shapes:
            raise KeyError(f"{self.name} has no parameter {name!r} (it has {', '.join(self.spec.shapes)})")
        E = self.spec.experts
        if experts is None:
            if len(self.experts_range) != E:
                raise ValueError(f"{self.name}.gather: this rank owns experts [{self.experts_range.start}, "
                                 f"{self.experts_range.stop}) of {E}; give experts= (within binding.experts_range): "
                                 "another rank's experts are never read here")
            chosen = None
        else:
            chosen = [int(e) for e in experts]
            outside = [e for e in chosen if e not in self.experts_range]
            if outside:
                raise ValueError(f"{self.name}.gather: experts {outside} are not in this rank's share "
                                 f"[{self.experts_range.start}, {self.experts_range.stop}) of {E}")
        count = E if chosen is None else len(chosen)

        def full(role: str) -> Any:  # (count, rows, cols)
            t = self.tiled[role]
            if grad:
                g = t.grad
                if g is None or count == 0:
                    return torch.zeros((count,) + self.tile_shapes[role], dtype=self.spec.dtype)
                t = g
            if count == 0:
                return torch.zeros((0,) + self.tile_shapes[role], dtype=self.spec.dtype)
            if chosen is None:
                a = np.array(t)  # (rows, cols, E)
            else:
                sw = _sw()
                previous = sw.is_grad_enabled()
                sw.set_grad_enabled(False)
                try:  # (rows, cols, n): the chosen experts' tiles only
                    a = np.array(t.carrier.project(t, sw.TileSelection([[0], [0], chosen])).wait())
                finally:
                    sw.set_grad_enabled(previous)
            if a.dtype.name == "bfloat16":
                out = torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
            else:
                out = torch.from_numpy(np.ascontiguousarray(a))
            return out.permute(2, 0, 1).contiguous()

        shape = self.spec.shapes[name]
        shape = (shape[0] * count // E,) + tuple(shape[1:])
        if self.fused:
            value = full("gate_up" if name.startswith("gate_up") else "down")
            if self.tiles_transposed != self.spec.transposed:  # tiles (out, in), the module (in, out)
                value = value.transpose(1, 2).contiguous()
            return value.reshape(shape)
        if self.spec.outside == "dbrx":
            role = {"mlp.w1": "gate", "mlp.v1": "up", "mlp.w2": "down"}[name]
            return full(role).reshape(shape)
        if name == "gate_up_proj":
            return torch.cat([full("gate"), full("up")], dim=1)
        return full("down")

    def zero_grad(self) -> None:
        """Drops the tiled gradients (``tiled[role].grad`` becomes None)."""
        for t in self.tiled.values():
            t.grad = None

    def __repr__(self) -> str:
        s = self.spec
        return (f"OffloadedExperts({self.name!r}, family={self.family!r}, experts={s.experts}, hidden={s.hidden}, "
                f"intermediate={s.inter}, dtype={s.dtype}, {'fused' if self.fused else 'per expert'}, "
                f"{'SparseMoE' if self.native else 'per-expert math'})")


def _prod(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _dispatch(top_k_index: Any, k: int) -> list:
    """[(expert, tokens, positions)] for the routed experts, ascending; positions index the flat (T * k) routing."""
    torch = _torch()
    with torch.no_grad():
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
        return [(int(e), p // k, p) for e, p in zip(uniq.tolist(), torch.split(order, counts.tolist()))]


_CLASSES: dict = {}


def _classes() -> dict:
    """The torch.autograd.Functions, defined on first use (torch is imported lazily)."""
    if _CLASSES:
        return _CLASSES
    torch = _torch()

    class _Native(torch.autograd.Function):
        """SparseMoE.experts (C++) for the routing transformers chose; its node gives the gradients of the hidden
        states and the routing weights, and adds the experts' into the tiled gradients."""

        @staticmethod
        def forward(ctx: Any, x: Any, weights: Any, binding: Any, index: Any) -> Any:  # type: ignore[override]
            sw = _sw()
            moe = binding._sparse_moe(index.shape[-1], weights.dtype)
            xs = from_torch(x.detach().contiguous())
            ws = from_torch(weights.detach().contiguous())
            idx = from_torch(index.detach().to(torch.int32).contiguous())
            record = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
            previous = sw.is_grad_enabled()
            sw.set_grad_enabled(record)
            try:
                out = moe.experts(xs, ws, idx)
            finally:
                sw.set_grad_enabled(previous)
            ctx.graph = (xs, ws, out) if record else None
            ctx.binding = binding
            if binding.record_routing:
                binding._last_index = (index.shape[-1], weights.dtype, idx)
            ctx.inputs = ((tuple(x.shape), x.dtype), (tuple(weights.shape), weights.dtype))
            return to_torch(out)

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> Any:  # type: ignore[override]
            if ctx.graph is None:
                raise RuntimeError("strideweave experts: a second backward through one forward (its graph was "
                                   "freed; retain_graph is not supported)")
            xs, ws, out = ctx.graph
            ctx.graph = None
            push_in_backward()  # Note [Stepping in backward through torch]
            out.backward(from_torch(grad_out.detach().float().contiguous()))
            nxt = ctx.binding.prefetch_next
            if nxt is not None and nxt.native and nxt._last_index is not None:
                k, dtype, index = nxt._last_index
                nxt._sparse_moe(k, dtype).prefetch(index)  # arrives while torch runs the layer in between
            grads = _leaf_grads((xs, ws), ctx.inputs, ctx.needs_input_grad[:2])
            return grads[0], grads[1], None, None

    class _Math(torch.autograd.Function):
        """Per-expert math in torch over projected tiles (Note [Experts on transformers' interface])."""

        @staticmethod
        def forward(ctx: Any, x: Any, weights: Any, bgu: Any, bd: Any, binding: Any, groups: list,
                    scale_input: bool) -> Any:  # type: ignore[override]
            acc = torch.zeros(x.shape, dtype=torch.float32)
            _visit(binding, groups, False, lambda W, e, tokens, pos: acc.index_add_(
                0, tokens, _contribution(binding, W, e, x[tokens], weights[pos], bgu, bd, scale_input).float()))
            ctx.save_for_backward(x, weights, bgu, bd)
            ctx.binding, ctx.groups, ctx.scale_input = binding, groups, scale_input
            # Note [Gradient reservations]: the routed experts' tiles, each finished once backward has delivered
            # it (freed unfinished with the graph otherwise).
            experts = [e for e, _, _ in groups]
            ctx.reservations = [_sw()._core._reserve_gradients(t, experts) for t in binding.tiled.values()] \
                if any(ctx.needs_input_grad) else []
            return acc.to(x.dtype)

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> Any:  # type: ignore[override]
            x, weights, bgu, bd = ctx.saved_tensors
            binding = ctx.binding
            dx = torch.zeros(x.shape, dtype=torch.float32)
            dw = torch.zeros(weights.shape, dtype=torch.float32)
            leaves = [b.detach().requires_grad_(True) if b is not None else None for b in (bgu, bd)]
            g = grad_out.float()
            push_in_backward()  # Note [Stepping in backward through torch]

            def step(W: dict, e: int, tokens: Any, pos: Any, compact: dict) -> None:
                with torch.enable_grad():
                    Wl = {r: w.detach().requires_grad_(True) for r, w in W.items()}
                    xe = x[tokens].detach().requires_grad_(True)
                    we = weights[pos].detach().requires_grad_(True)
                    c = _contribution(binding, Wl, e, xe, we, leaves[0], leaves[1], ctx.scale_input)
                    torch.autograd.backward(c.float(), g[tokens])
                dx.index_add_(0, tokens, xe.grad.float())
                dw[pos] = we.grad.float()
                for r, w in Wl.items():
                    compact[r].backward(from_torch(w.grad.float().unsqueeze(-1).contiguous()))

            def delivered(e: int) -> None:  # the expert's gradients are in its tiled .grad; its tiles let go
                for r in ctx.reservations:
                    r.finish(e, True)

            _visit(binding, list(reversed(ctx.groups)), True, step, delivered)
            ctx.groups = None
            ctx.reservations = []
            gb = [None if leaf is None else (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
                  for leaf in leaves]
            return dx.to(x.dtype), dw.to(weights.dtype), gb[0], gb[1], None, None, None

    _CLASSES.update(Native=_Native, Math=_Math)
    return _CLASSES


def _contribution(binding: Any, W: dict, e: int, xe: Any, we: Any, bgu: Any, bd: Any, scale_input: bool) -> Any:
    """One expert's contribution to its tokens' outputs: ``w * expert(x)``, or Llama4's ``expert(w * x)``."""
    if scale_input:
        return binding._expert(W, e, xe * we[:, None], bgu, bd)
    return binding._expert(W, e, xe, bgu, bd) * we[:, None]


def _visit(binding: Any, groups: list, backward: bool, fn: Any, after: Any = None) -> None:
    """Calls fn(W, e, tokens, positions[, compact]) per routed expert, its tiles projected (the next expert's
    projection in flight when the budget holds two), then after(e), once its projections are dropped."""
    depth = binding._depth(backward)
    window: list = []
    nxt = 0
    for i in range(len(groups)):
        while nxt < len(groups) and nxt <= i + depth:
            window.append(binding._start(groups[nxt][0], backward))
            nxt += 1
        compact, W = binding._finish(window.pop(0))
        e, tokens, pos = groups[i]
        if backward:
            fn(W, e, tokens, pos, compact)
        else:
            fn(W, e, tokens, pos)
        del compact, W
        if after is not None:
            after(e)


def attach(module: Any, binding: OffloadedExperts) -> None:
    """Drops the module's weight parameters and dispatches its forward to the binding."""
    torch = _torch()
    register()
    spec = binding.spec
    if spec.outside == "dbrx":
        mlp = module.mlp
        for n in ("w1", "v1", "w2"):
            if n in mlp._parameters or n in mlp.__dict__:
                delattr(mlp, n)
            # A meta placeholder (not a parameter): transformers' init code may still touch it.
            object.__setattr__(mlp, n, torch.empty(spec.shapes["mlp." + n], dtype=spec.dtype, device="meta"))
        # DbrxExperts.forward: the interface's arguments, (batch, seq, H) in and out.
        module.forward = lambda hidden_states, top_k_index, top_k_weights: binding(
            hidden_states, top_k_index, top_k_weights).view(hidden_states.shape[0], -1, spec.hidden)
    else:
        for n in ("gate_up_proj", "down_proj"):
            if n in module._parameters or n in module.__dict__:
                delattr(module, n)
            object.__setattr__(module, n, torch.empty(spec.shapes[n], dtype=spec.dtype, device="meta"))
        if spec.outside == "llama4":
            module.forward = binding.llama4_experts
        if spec.outside is None:
            config = copy.copy(module.config)
            config._experts_implementation = IMPLEMENTATION
            module.config = config
    module.__dict__.pop("_strideweave_meta", None)
    module._strideweave = binding
