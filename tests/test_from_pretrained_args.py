"""strideweave.torch.from_pretrained's arguments and the class wrap that keeps the experts unallocated
(Note [Opening without the experts] in python/strideweave/torch/_loading.py)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_families  # noqa: E402
import strideweave.torch as swt  # noqa: E402
from strideweave.torch import _loading  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_families.saved("qwen3_moe", tmp_path_factory.mktemp("fp"), seed=0)["float32"]


def test_dtype_under_transformers_name_is_torch_dtype(folder):
    a = swt.from_pretrained(folder, 1 << 20, dtype=torch.float32)
    b = swt.from_pretrained(folder, 1 << 20, torch_dtype=torch.float32)
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
    assert a.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("call, error, fragment", [
    (lambda f: swt.from_pretrained(f, 1 << 20, dtype=torch.float32, torch_dtype=torch.float32), TypeError,
     "give torch_dtype or dtype, not both"),
    (lambda f: swt.from_pretrained(f, 1 << 20, torch_dtype="float32"), TypeError, "torch_dtype must be a torch.dtype"),
    (lambda f: swt.from_pretrained(f + "-missing", 1 << 20), FileNotFoundError, "is not a folder"),
    (lambda f: swt.from_pretrained(42, 1 << 20), TypeError, "path must be a checkpoint folder, got int"),
    (lambda f: swt.from_pretrained(f, 1 << 20, prefetch=1), TypeError, "prefetch must be a bool, got int"),
    (lambda f: swt.from_pretrained(f, 1 << 20, mutable="yes"), TypeError, "mutable must be a bool, got str"),
    (lambda f: swt.from_pretrained(f, 0), ValueError, "from_pretrained: budget must be a byte count >= 1, got 0"),
    (lambda f: swt.from_pretrained(f, 1 << 20, layers=[7]), IndexError, "layer 7 is out of range"),
])
def test_bad_arguments_are_refused_before_anything_opens(folder, call, error, fragment):
    classes = {c: c.__dict__.get("__init__") for c in (transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts,)}
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call(folder)
    assert {c: c.__dict__.get("__init__") for c in classes} == classes  # the classes are as they were


def test_the_wrap_acts_in_the_loading_thread_only_and_is_undone():
    """A model of the same class built by another thread while the wrap is active keeps its weights; the loading
    thread's selected modules get meta placeholders; afterwards the class is as it was."""
    config = hf_families.tiny_config("qwen3_moe")
    cls = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts
    before = cls.__dict__.get("__init__")
    with _loading._without_weights({cls: None}, {"a"}, ["a", "b"]):
        built = {}
        t = threading.Thread(target=lambda: built.setdefault("other", cls(config)))
        t.start()
        t.join()
        mine = [cls(config), cls(config)]
    assert isinstance(built["other"].gate_up_proj, torch.nn.Parameter)  # another thread: built as usual
    assert "_strideweave_meta" not in built["other"].__dict__
    assert mine[0].gate_up_proj.device.type == "meta" and "gate_up_proj" not in mine[0]._parameters  # selected
    assert isinstance(mine[1].gate_up_proj, torch.nn.Parameter)  # "b": not selected
    assert cls.__dict__.get("__init__") is before
    assert isinstance(cls(config).gate_up_proj, torch.nn.Parameter)
