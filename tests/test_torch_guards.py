"""What a transformers model with offloaded experts refuses, at the call and changing nothing (docs/guide.md, "Opening
a Hugging Face MoE bigger than RAM": dtype and device changes, saving; python/strideweave/torch/_guards.py), and
the refusal of a model without a MoE layer.

The tiny Qwen3-MoE of tests/hf_models.py (seeded random weights, never downloaded) is saved with
``save_pretrained`` in Float32 and BFloat16 and opened twice per test: by ``strideweave.torch.from_pretrained`` and
by transformers then ``offload_experts``. A refused call must raise at the call (``TypeError`` for a dtype,
``RuntimeError`` for a device) and leave every parameter and buffer the same object with the same dtype, device and
value (bit for bit), the experts bound to the same tiles, and the model computing the same logits, bit for bit (the
same computation on the same weights and inputs).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_models  # noqa: E402
import strideweave.torch as swt  # noqa: E402

FAMILY = "qwen3_moe"
BUDGET = 1 << 22  # 4 MiB: both layers' experts (2 x 8 x 3 x 96 x 64 x 4 bytes = 1.2 MB) stay resident


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"float32": folder, "bfloat16": folder}: the seed-0 tiny Qwen3-MoE saved twice."""
    return hf_models.saved_models(FAMILY, tmp_path_factory.mktemp("guards"), seed=0)


def opened(how: str, folder: str):
    """The model of `folder` with every experts module bound: by from_pretrained, or loaded by transformers and
    offloaded."""
    if how == "from_pretrained":
        return swt.from_pretrained(folder, BUDGET)
    model = hf_models.load_model(FAMILY, folder)
    swt.offload_experts(model, folder, BUDGET)
    return model


HOW = ["from_pretrained", "offload_experts"]
IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(11))


def snapshot(model) -> dict:
    """Everything a refused call must leave as it was: each parameter and buffer (the object, its dtype, device
    and a copy of its value), the bindings and their dtype, and the logits of IDS."""
    tensors = {f"param {n}": (p, p.dtype, p.device, p.detach().clone()) for n, p in model.named_parameters()}
    tensors.update({f"buffer {n}": (b, b.dtype, b.device, b.detach().clone()) for n, b in model.named_buffers()})
    bindings = swt.offloaded_experts(model)
    experts = {name: (b, b.spec.dtype, b.gather("gate_up_proj")) for name, b in bindings.items()}
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    return {"tensors": tensors, "experts": experts, "logits": logits}


def assert_unchanged(model, before: dict) -> None:
    now = {f"param {n}": p for n, p in model.named_parameters()}
    now.update({f"buffer {n}": b for n, b in model.named_buffers()})
    assert set(now) == set(before["tensors"])
    for name, (t, dtype, device, value) in before["tensors"].items():
        assert now[name] is t, name
        assert t.dtype == dtype and t.device == device, (name, t.dtype, t.device)
        assert torch.equal(t.detach(), value), name
    bindings = swt.offloaded_experts(model)
    assert set(bindings) == set(before["experts"])
    for name, (b, dtype, gate_up) in before["experts"].items():
        assert bindings[name] is b and b.spec.dtype == dtype
        assert torch.equal(b.gather("gate_up_proj"), gate_up), name
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, before["logits"])  # it still runs, the same


def refused_conversions(model) -> list:
    """(call, exception type, message fragment) of each dtype or device change refused on a Float32 model."""
    return [
        (lambda: model.to(torch.bfloat16), TypeError, "converting the model to torch.bfloat16 would copy every expert"),
        (lambda: model.half(), TypeError, "converting the model to torch.float16 would copy every expert"),
        (lambda: model.bfloat16(), TypeError, "converting the model to torch.bfloat16 would copy every expert"),
        (lambda: model.to(dtype=torch.float64), TypeError, "converting the model to torch.float64"),
        (lambda: model.to("meta"), RuntimeError, "cannot move to meta (nothing was moved)"),
        (lambda: model.to(torch.device("meta")), RuntimeError, "cannot move to meta"),
        (lambda: model.to("meta", torch.bfloat16), RuntimeError, "cannot move to meta"),
        # a module above the experts refuses as the model does
        (lambda: model.model.to(torch.float16), TypeError, "converting the model to torch.float16"),
        (lambda: model.model.layers[1].to("meta"), RuntimeError, "cannot move to meta"),
        (lambda: model.model.layers[0].mlp.experts.half(), TypeError, "converting the model to torch.float16"),
    ]


@pytest.mark.parametrize("how", HOW)
def test_dtype_and_device_changes_are_refused_at_the_call_and_change_nothing(folders, how):
    model = opened(how, folders["float32"])
    before = snapshot(model)
    for call, kind, fragment in refused_conversions(model):
        with pytest.raises(kind) as info:
            call()
        message = str(info.value)
        assert fragment in message, (fragment, message)
        assert "offloaded" in message, message
        assert_unchanged(model, before)
    # a dtype change names the way to get the model in another dtype
    with pytest.raises(TypeError, match=r"strideweave\.torch\.save_pretrained, then from_pretrained"):
        model.half()
    assert_unchanged(model, before)


@pytest.mark.parametrize("how", HOW)
def test_conversions_to_the_dtype_and_device_it_has_are_allowed_and_change_nothing(folders, how):
    model = opened(how, folders["float32"])
    before = snapshot(model)
    for call in (model.float, lambda: model.to(torch.float32), lambda: model.to("cpu"),
                 lambda: model.to("cpu", torch.float32), lambda: model.model.float()):
        assert call() is not None
        assert_unchanged(model, before)


@pytest.mark.parametrize("how", HOW)
def test_a_bfloat16_model_refuses_float_and_allows_bfloat16(folders, how):
    """``.float()`` would convert a BFloat16 model's experts: refused. ``.bfloat16()`` leaves them as they are:
    allowed, and it does what it does to the model in RAM (its parameters are bf16 already; its Float32 buffers,
    the rotary frequencies, become bf16 as torch converts every floating buffer)."""
    model = opened(how, folders["bfloat16"])
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    before = snapshot(model)
    for call in (model.float, lambda: model.to(torch.float32)):
        with pytest.raises(TypeError, match=r"tiles of a torch\.bfloat16 checkpoint; converting the model to "
                                            r"torch\.float32 would copy every expert"):
            call()
        assert_unchanged(model, before)
    reference = hf_models.load_model(FAMILY, folders["bfloat16"]).bfloat16()
    assert model.bfloat16() is model
    buffers = dict(model.named_buffers())
    assert buffers and set(buffers) == set(dict(reference.named_buffers()))
    for name, b in reference.named_buffers():
        assert buffers[name].dtype == b.dtype and torch.equal(buffers[name], b), name
    params = {f"param {n}": p for n, p in model.named_parameters()}
    assert set(params) == {name for name in before["tensors"] if name.startswith("param ")}
    for name, t in params.items():
        was, dtype, device, value = before["tensors"][name]
        assert t is was and t.dtype == dtype == torch.bfloat16 and torch.equal(t.detach(), value), name
    for name, (b, dtype, gate_up) in before["experts"].items():
        assert swt.offloaded_experts(model)[name] is b and torch.equal(b.gather("gate_up_proj"), gate_up)
    with torch.no_grad():
        assert bool(model(input_ids=IDS).logits.isfinite().all())  # it still runs


def folder_entries(path) -> list | None:
    """The sorted names in the folder `path`, or None when there is no such folder."""
    return sorted(os.listdir(path)) if os.path.isdir(path) else None


@pytest.mark.parametrize("how", HOW)
def test_state_dict_and_the_models_own_save_pretrained_name_the_bridges_save(folders, how, tmp_path):
    model = opened(how, folders["float32"])
    before = snapshot(model)
    for call in (model.state_dict, lambda: model.model.state_dict(), lambda: model.model.layers[0].state_dict()):
        with pytest.raises(RuntimeError, match=r"strideweave\.torch\.save_pretrained\(model, folder\)") as info:
            call()
        assert "would silently leave them out" in str(info.value)
        assert_unchanged(model, before)
    # a module without experts keeps its state dict
    assert set(model.model.layers[0].mlp.gate.state_dict()) == {"weight"}

    absent, empty = tmp_path / "absent", tmp_path / "empty"
    empty.mkdir()
    for folder in (absent, empty):
        for call in (lambda: model.save_pretrained(folder), lambda: model.save_pretrained(str(folder),
                                                                                         safe_serialization=True)):
            with pytest.raises(RuntimeError, match=r"strideweave\.torch\.save_pretrained\(model, folder\)") as info:
                call()
            assert "nothing was written" in str(info.value)
            assert type(model).__name__ + ".save_pretrained" in str(info.value)
    assert folder_entries(absent) is None and folder_entries(empty) == []  # no files
    assert sorted(os.listdir(tmp_path)) == ["empty"]
    assert_unchanged(model, before)


def test_a_partly_offloaded_model_refuses_too(folders):
    """With one layer's experts bound, the guards hold for the whole model (its state dict would lose that
    layer's experts; converting would copy them)."""
    model = hf_models.load_model(FAMILY, folders["float32"])
    swt.offload_experts(model, folders["float32"], BUDGET, layers=[1])
    before = snapshot(model)
    with pytest.raises(TypeError, match="would copy every expert"):
        model.half()
    with pytest.raises(RuntimeError, match=r"strideweave\.torch\.save_pretrained"):
        model.state_dict()
    assert_unchanged(model, before)
    # layer 0 holds its experts in RAM: its own state dict is whole
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= set(model.model.layers[0].state_dict())


def test_a_model_without_a_moe_layer_is_refused_naming_its_class(tmp_path):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path / "llama"
    model.save_pretrained(folder)
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    attributes = sorted(model.__dict__)
    with pytest.raises(TypeError) as info:
        swt.offload_experts(model, str(folder), BUDGET)
    message = str(info.value)
    assert "offload_experts: LlamaForCausalLM has no experts module" in message and "MoEBlock" in message, message
    # nothing changed: the same parameters and values, no guard installed
    now = dict(model.named_parameters())
    assert set(now) == set(params) and all(now[n] is p and torch.equal(p, v) for n, (p, v) in params.items())
    assert sorted(model.__dict__) == attributes and swt.offloaded_experts(model) == {}
    model.half()  # an ordinary model converts as torch does
    assert model.lm_head.weight.dtype == torch.float16

    entries = sorted(os.listdir(folder))
    with pytest.raises(TypeError) as info:
        swt.from_pretrained(folder, BUDGET)
    message = str(info.value)
    assert "from_pretrained: LlamaForCausalLM has no experts module" in message and "MoEBlock" in message, message
    assert sorted(os.listdir(folder)) == entries


def test_model_zero_grad_drops_the_experts_gradients_too(tmp_path):
    """transformers' Trainer and ordinary loops call model.zero_grad() between steps: the experts' tiled
    gradients go with torch's, or they would accumulate across steps."""
    folder = hf_models.saved_models(FAMILY, tmp_path)["float32"]
    model = swt.from_pretrained(folder, 1 << 20)
    ids = torch.arange(12).reshape(1, 12) % 100
    model(input_ids=ids, labels=ids).loss.backward()
    bindings = list(swt.offloaded_experts(model).values())
    assert all(t.grad is not None for b in bindings for t in b.tiled.values())
    for set_to_none in (True, False):
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=set_to_none)
        assert all(t.grad is None for b in bindings for t in b.tiled.values()), set_to_none
        assert all(p.grad is None if set_to_none else not p.grad.any() for p in model.parameters()), set_to_none
