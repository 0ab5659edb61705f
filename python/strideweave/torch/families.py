"""The MoE families the Hugging Face bridge knows, as declarations (docs/guide.md, "Opening a Hugging Face MoE
bigger than RAM").

A family is data: which experts modules it has, where a checkpoint keeps their weights (the names
``save_pretrained`` writes, relative to the experts module's path) and how those tensors relate to the module's
parameters. The computation is the family's own declaration in transformers (``use_experts_implementation``: gated
or not, concatenated or interleaved gate/up, transposed or not, biases, its activation and ``_apply_gate``);
routing stays transformers' code. Families on transformers' experts interface need no entry of their own when
their checkpoints use one of the common names below; an entry adds a family whose names differ, or one outside the
interface (Llama4, DBRX).

On-disk forms (``Separate`` / ``Fused``):

* ``Separate(gate, up, down)``: one tensor per expert and projection, PyTorch ``(out, in)`` matrices, names with
  ``{e}`` (Mixtral's ``{e}.w1.weight``; Qwen's ``{e}.gate_proj.weight``). ``down_transposed``: the down
  projection is stored ``(I, H)`` (DBRX). ``split``: the names hold every expert's rows of one 2-D tensor, split
  into ``E`` tiles (DBRX's ``mlp.w1`` of shape ``(E * I, H)``).
* ``Fused(gate_up, down, gate_up_bias=None, down_bias=None)``: one 3-D tensor per projection, ``(E, 2I, H)`` and
  ``(E, H, I)`` as the module holds them (or ``(E, H, 2I)``/``(E, I, H)`` when the module is transposed); biases
  stay ordinary torch parameters of the module.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

__all__ = ["Family", "Separate", "Fused", "FAMILIES", "COMMON_FORMS", "family_of"]


@dataclasses.dataclass(frozen=True)
class Separate:
    """One checkpoint tensor per expert and projection (names relative to the experts' checkpoint path, with
    ``{e}``)."""

    gate: str
    up: str
    down: str
    down_transposed: bool = False  # the down projection is stored (I, H): DBRX
    split: bool = False  # each name is ONE 2-D tensor holding every expert's rows, split into E tiles


@dataclasses.dataclass(frozen=True)
class Fused:
    """One 3-D checkpoint tensor per projection, in the experts module's own form."""

    gate_up: str
    down: str


@dataclasses.dataclass(frozen=True)
class Family:
    """A family: its display name, transformers ``model_type``s, the renames from an experts module's path to its
    checkpoint path (regex, replacement), the on-disk forms tried in order, and, outside the interface, how the
    block is computed."""

    name: str
    model_types: tuple
    renames: tuple = ()
    forms: tuple = ()
    # Outside transformers' experts interface: "llama4" (experts scale their input by the router score, the block
    # adds a shared expert), "dbrx" (DbrxExperts, the interface's signature without its dispatch).
    outside: Optional[str] = None
    tested: bool = True


_QWEN = Separate("{e}.gate_proj.weight", "{e}.up_proj.weight", "{e}.down_proj.weight")
_MIXTRAL = Separate("{e}.w1.weight", "{e}.w3.weight", "{e}.w2.weight")
_SAME = Fused("gate_up_proj", "down_proj")
# Forms any family on the interface is tried with, after its own.
COMMON_FORMS = (_QWEN, _MIXTRAL, _SAME)
_TO_BLOCK_SPARSE = ((r"\.mlp\.experts$", ".block_sparse_moe.experts"),)

FAMILIES = (
    Family("Mixtral", ("mixtral",), _TO_BLOCK_SPARSE, (_MIXTRAL,)),
    Family("Qwen2-MoE", ("qwen2_moe",), (), (_QWEN,)),
    Family("Qwen3-MoE", ("qwen3_moe",), (), (_QWEN,)),
    Family("Qwen3-Next", ("qwen3_next",), (), (_QWEN,)),
    Family("OLMoE", ("olmoe",), (), (_QWEN,)),
    Family("DeepSeek-V2", ("deepseek_v2",), (), (_QWEN,)),
    Family("DeepSeek-V3", ("deepseek_v3",), (), (_QWEN,)),
    Family("GLM4-MoE", ("glm4_moe",), (), (_QWEN,)),
    Family("GPT-OSS", ("gpt_oss",), (), (_SAME,)),
    Family("Granite-MoE", ("granitemoe",), ((r"\.experts$", ""),),
           (Fused("input_linear.weight", "output_linear.weight"),)),
    Family("Phi-MoE", ("phimoe",), _TO_BLOCK_SPARSE, (_MIXTRAL,)),
    Family("Jamba", ("jamba",), (), (_QWEN,)),
    Family("ERNIE-4.5-MoE", ("ernie4_5_moe",), (), (_QWEN,)),
    Family("Hunyuan-V1-MoE", ("hunyuan_v1_moe",), (), (_QWEN,)),
    Family("dots1", ("dots1",), (), (_QWEN,)),
    Family("MiniMax", ("minimax",), _TO_BLOCK_SPARSE, (_MIXTRAL,)),
    Family("Llama4", ("llama4", "llama4_text"), (), (_SAME,), outside="llama4"),
    Family("DBRX", ("dbrx",), (), (Separate("mlp.w1", "mlp.v1", "mlp.w2", down_transposed=True, split=True),),
           outside="dbrx"),
)


def family_of(model_type: str) -> Optional[Family]:
    """The declared family of a ``config.model_type``, or None."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def checkpoint_prefix(family: Optional[Family], module_path: str) -> str:
    """Where a checkpoint keeps the experts module at `module_path` (the family's renames applied)."""
    for pattern, replacement in (family.renames if family else ()):
        module_path = re.sub(pattern, replacement, module_path)
    return module_path
