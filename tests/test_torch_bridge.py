"""The PyTorch bridge (docs/guide.md, "PyTorch") and the tiny Hugging Face MoE models of tests/hf_models.py.

``strideweave.torch.to_torch`` / ``from_torch`` share memory both ways, never copying (checked by data addresses
and by writes seen on the other side), map the five dtypes that travel, keep shapes and strides, and refuse what
cannot be shared with a clear error that changes nothing. ``import strideweave`` never imports torch.

The tiny models' checkpoints open with ``sw.safetensors.open`` and their experts view as ``ckpt.tiled(names)``
(one tile per expert) with exactly the model's values, and each family's block computes what tests/hf_models.py
documents (checked against a Float64 model of that math, read from the checkpoint).

Values that cross the bridge are compared exactly (the same bytes on both sides).
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import hf_models
from test_dlpack import address, cpu_tensor, non_native_tensors  # shared helpers of the DLPack tests
import strideweave as sw
from strideweave import Layout, Shape, Stride, Tensor, friendly
from strideweave.torch import from_torch, to_torch

F32, BF16, F16, I32, BOOL = (sw.DType.Float32, sw.DType.BFloat16, sw.DType.Float16, sw.DType.Int32,
                             sw.DType.Bool)

# (StrideWeave dtype, torch dtype, six values exact in both)
DTYPES = [
    (F32, torch.float32, [0.5, -1.25, 3.0, 2.0 ** -30, 7.0, -0.0]),
    (BF16, torch.bfloat16, [0.5, -1.25, 3.0, 2.0 ** -20, 7.0, -0.0]),
    (F16, torch.float16, [0.5, -1.25, 3.0, 2.0 ** -20, 7.0, -0.0]),
    (I32, torch.int32, [1, -2, 2**31 - 1, -(2**31), 0, 42]),
    (BOOL, torch.bool, [True, False, False, True, True, False]),
]
DTYPE_IDS = ["Float32", "BFloat16", "Float16", "Int32", "Bool"]


# ============================================================ torch is imported lazily


def test_importing_strideweave_never_imports_torch():
    script = (
        "import sys\n"
        "import strideweave as sw\n"
        "assert 'torch' not in sys.modules, 'import strideweave imported torch'\n"
        "assert 'strideweave.torch' not in sys.modules, 'import strideweave imported strideweave.torch'\n"
        "import strideweave.torch as swt\n"
        "assert 'torch' not in sys.modules, 'import strideweave.torch imported torch'\n"
        "assert 'transformers' not in sys.modules\n"
        "t = sw.friendly.tensor([1.0, 2.0])\n"
        "x = swt.to_torch(t)\n"
        "assert 'torch' in sys.modules and x.tolist() == [1.0, 2.0]\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# ============================================================ no copy, both ways, every dtype that travels


@pytest.mark.parametrize("dtype, torch_dtype, values", DTYPES, ids=DTYPE_IDS)
def test_from_torch_shares_memory(dtype, torch_dtype, values):
    x = torch.tensor(values, dtype=torch_dtype).reshape(2, 3)
    t = from_torch(x)
    assert t.dtype() is dtype and t.carrier.__class__ is sw.CPU
    assert address(t) == x.data_ptr()  # no copy
    assert t.layout == Layout(Shape(2, 3), Stride(3, 1))
    assert [[t[(i, j)] for j in range(3)] for i in range(2)] == x.tolist()
    t[(1, 0)] = values[5]  # StrideWeave writes, torch sees
    assert x[1, 0].item() == values[5]
    x[0, 2] = values[1]  # torch writes, StrideWeave sees
    assert t[(0, 2)] == values[1]


@pytest.mark.parametrize("dtype, torch_dtype, values", DTYPES, ids=DTYPE_IDS)
def test_to_torch_shares_memory(dtype, torch_dtype, values):
    t = cpu_tensor(values, dtype, friendly.row_major(2, 3))
    x = to_torch(t)
    assert x.dtype == torch_dtype and x.device.type == "cpu" and not x.requires_grad
    assert x.data_ptr() == address(t)  # no copy
    assert tuple(x.shape) == (2, 3) and x.stride() == (3, 1)
    assert x.tolist() == [[t[(i, j)] for j in range(3)] for i in range(2)]
    x[1, 1] = values[0]  # torch writes, StrideWeave sees
    assert t[(1, 1)] == values[0]
    t[(0, 0)] = values[3]  # StrideWeave writes, torch sees
    assert x[0, 0].item() == values[3]


def test_strides_and_offsets_are_kept_both_ways():
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    view = base[1:, ::2].T  # (4, 5), strides (2, 8), offset 8
    t = from_torch(view)
    assert t.layout == Layout(Shape(4, 5), Stride(2, 8)) and address(t) == view.data_ptr()
    assert np.array_equal(np.asarray(t), view.numpy())
    back = to_torch(t)
    assert back.data_ptr() == view.data_ptr() and back.stride() == (2, 8) and torch.equal(back, view)

    c = cpu_tensor([float(i) for i in range(24)], F32).carrier
    s = Tensor(c, 5, Layout(Shape(3, 4), Stride(1, 4)))  # column-major with an offset
    y = to_torch(s)
    assert y.stride() == (1, 4) and y.data_ptr() == address(Tensor(c, 0, friendly.column_major(24))) + 5 * 4
    assert y.tolist() == [[5.0 + i + 4 * j for j in range(4)] for i in range(3)]
    again = from_torch(y)
    assert address(again) == y.data_ptr() and again.layout == s.layout


def test_operations_run_on_shared_memory_and_write_back():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)  # torch's (out, in) weight
    with sw.no_grad():
        out = sw.matmul(from_torch(x), from_torch(w))  # x @ w.T
    y = to_torch(out)
    assert torch.equal(y, x @ w.T)  # small integers: exact in Float32
    y.zero_()
    assert np.count_nonzero(np.asarray(out)) == 0  # the result's own memory


def test_lifetimes_outlive_the_other_side():
    n = 1 << 18  # 1 MiB: a freed buffer would be handed to the next allocation of that size
    x = torch.arange(n, dtype=torch.float32)
    t = from_torch(x)
    del x
    other = torch.full((n,), -1.0)
    assert np.array_equal(np.asarray(t), np.arange(n, dtype=np.float32)) and other[0].item() == -1.0
    c = sw.CPU(n)
    np.asarray(Tensor(c, 0, friendly.column_major(n)))[:] = 7.0
    y = to_torch(Tensor(c, 0, friendly.column_major(n)))
    c.release()
    assert bool((y == 7.0).all())


# ============================================================ refusals: clear, and nothing changes


def test_to_torch_refuses_what_cannot_be_shared():
    with pytest.raises(TypeError, match="to_torch: expected a strideweave Tensor, got ndarray"):
        to_torch(np.zeros(3, np.float32))

    for kind, t in non_native_tensors().items():  # FileBacked, Generic, TiledEvictable over the values 0..7
        before = np.asarray(t).copy()
        version = t.carrier.version
        with pytest.raises(BufferError, match=f"to_torch: .*cannot export {kind} tensor .* its carrier keeps no host "
                                              "memory to share"):
            to_torch(t)
        assert t.carrier.version == version and np.array_equal(np.asarray(t), before)

    values = [float(i) for i in range(8)]
    c = cpu_tensor(values * 2, F32).carrier
    hierarchical = Tensor(c, 0, Layout(Shape(2, [2, 2]), Stride(1, [2, 8])))  # mode 1's leaves do not coalesce
    with pytest.raises(BufferError, match="to_torch: .*a mode whose leaves no single stride describes"):
        to_torch(hierarchical)
    assert c.version == 16

    frozen = Tensor(sw.CPU(4, mutable=False), 0, friendly.column_major(4))
    with pytest.raises(BufferError, match="to_torch: the Float32 tensor of layout .* is immutable and PyTorch has no "
                                          "read-only tensors"):
        to_torch(frozen)
    copied = torch.from_dlpack(frozen.__dlpack__(max_version=(1, 0), copy=True))  # the way the message gives
    assert copied.tolist() == [0.0] * 4 and copied.data_ptr() != address(frozen)


def test_from_torch_refuses_what_cannot_be_shared():
    with pytest.raises(TypeError, match="from_torch: expected a torch.Tensor, got ndarray"):
        from_torch(np.zeros(3, np.float32))
    for dtype in (torch.float64, torch.int64, torch.uint8, torch.complex64, torch.int16):
        x = torch.ones(3, dtype=dtype)
        with pytest.raises(TypeError, match=rf"from_torch: {dtype} has no StrideWeave dtype \(shared: torch.float32, "
                                            "torch.bfloat16, torch.float16, torch.int32, torch.bool"):
            from_torch(x)
        assert torch.equal(x, torch.ones(3, dtype=dtype))

    # No CUDA here: the meta device stands for any device other than the CPU (the check is the same).
    meta = torch.empty(4, device="meta")
    with pytest.raises(BufferError, match="from_torch: the tensor is on device meta; StrideWeave shares CPU memory "
                                          "only"):
        from_torch(meta)

    sparse = torch.eye(3).to_sparse()
    with pytest.raises(BufferError, match="from_torch: a torch.sparse_coo tensor has no strides to share"):
        from_torch(sparse)
    assert torch.equal(sparse.to_dense(), torch.eye(3))

    p = torch.nn.Parameter(torch.arange(4, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"from_torch: the tensor of shape \(4,\) requires grad, and its autograd "
                                         "history would not cross; x.detach\\(\\) is the same memory without it"):
        from_torch(p)
    assert p.requires_grad and p.grad is None and p.tolist() == [0.0, 1.0, 2.0, 3.0]
    detached = from_torch(p.detach())  # what the message offers: the same memory
    assert address(detached) == p.data_ptr()

    empty = torch.zeros(0, 3)
    with pytest.raises(BufferError, match="mode 0 has extent 0"):
        from_torch(empty)
    assert tuple(empty.shape) == (0, 3)


# ============================================================ the tiny Hugging Face models

FAMILIES = [f for f in hf_models.FAMILIES if hf_models.FAMILIES[f].available]
DTYPE_NAMES = ["float32", "bfloat16"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every family's seeded tiny model, saved in Float32 and BFloat16: {family: (f32 model, {dtype: folder})}."""
    root = tmp_path_factory.mktemp("hf")
    return {f: (hf_models.build_model(f, seed=0), hf_models.saved_models(f, root / f, seed=0)) for f in FAMILIES}


def test_the_pinned_transformers_has_all_three_families():
    assert FAMILIES == ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_checkpoint_views_one_tile_per_expert(saved, family, dtype_name):
    model, folders = saved[family]
    config = model.config
    E = hf_models.moe_block(model, 0).experts.num_experts
    I, H = hf_models.moe_block(model, 0).experts.intermediate_dim, config.hidden_size
    dtype = {"float32": F32, "bfloat16": BF16}[dtype_name]
    ckpt = sw.safetensors.open(folders[dtype_name])
    assert ckpt.bytes_read == 0 and ckpt.metadata == {"format": "pt"}
    for layer in range(config.num_hidden_layers):
        block = hf_models.moe_block(model, layer)
        names = hf_models.expert_names(family, layer, E)
        gate_up = block.experts.gate_up_proj.detach().to(getattr(torch, dtype_name))
        expected = {"gate": gate_up[:, :I], "up": gate_up[:, I:],
                    "down": block.experts.down_proj.detach().to(getattr(torch, dtype_name))}
        for part, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            for name in names[part]:
                assert ckpt.shape(name) == shape and ckpt.dtype(name) is dtype
            full = ckpt.tiled(names[part])
            assert full.shape.extents == (*shape, E)
            before = ckpt.bytes_read
            pair = full.carrier.project(full, sw.TileSelection([[0], [0], [E - 1, 1]])).wait()
            assert ckpt.bytes_read - before == 2 * math.prod(shape) * (4 if dtype is F32 else 2)  # two tiles
            got = to_torch(pair)  # the projection's memory, no copy
            want = torch.stack([expected[part][E - 1], expected[part][1]], dim=-1)
            assert got.dtype == want.dtype and torch.equal(got, want)  # the same bytes
            everything = np.asarray(full.carrier.project(full, sw.TileSelection([[0], [0], list(range(E))])).wait())
            assert torch.equal(torch.from_numpy(everything.astype(np.float32)),
                               expected[part].permute(1, 2, 0).float())
            full.carrier.release()
        router = ckpt.tensor(names["router"])
        assert torch.equal(torch.from_numpy(np.asarray(router).astype(np.float32)),
                           block.gate.weight.detach().to(getattr(torch, dtype_name)).float())


def float64_block(ckpt, family: str, layer: int, config, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The block's output as tests/hf_models.py documents it, in Float64 from the checkpoint's tensors, with a
    bound on the Float32 computation's error per element (returns output, bound, top-k indices)."""
    f = hf_models.FAMILIES[family]
    E = config.num_local_experts if family == "mixtral" else config.num_experts
    k = config.num_experts_per_tok
    names = hf_models.expert_names(family, layer, E)

    def w(name):
        return np.asarray(ckpt.tensor(name)).astype(np.float64)

    u = 2.0 ** -24

    def gamma(n):
        return n * u / (1 - n * u)

    H = x.shape[1]
    ax = np.abs(x)

    def swiglu(xe, W1, W3, W2):
        """down(silu(gate x) * up x) in Float64, and a bound on its Float32 evaluation's error per element."""
        axe = np.abs(xe)
        g, up = xe @ W1.T, xe @ W3.T
        eg, eu = gamma(H) * axe @ np.abs(W1).T, gamma(H) * axe @ np.abs(W3).T
        s = g / (1 + np.exp(-g))
        # silu's derivative lies in [-0.1, 1.1]; its Float32 evaluation adds at most a few ulps (4u |silu|).
        es = 1.1 * eg + 4 * u * np.abs(s) + u * np.abs(g)
        h = s * up
        eh = np.abs(s) * eu + np.abs(up) * es + es * eu + u * np.abs(h)
        d = h @ W2.T
        return d, eh @ np.abs(W2).T + gamma(W2.shape[1]) * np.abs(h) @ np.abs(W2).T
    Wr = w(names["router"])
    logits = x @ Wr.T
    logit_err = gamma(H) * ax @ np.abs(Wr).T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    index = np.argsort(-p, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(p, index, axis=1)
    renormalise = family == "mixtral" or config.norm_topk_prob
    weights = top / top.sum(axis=1, keepdims=True) if renormalise else top
    # A probability's relative error from logit errors e is at most 2 max|e| (numerator and denominator each move by
    # at most a factor exp(max|e|)); the Float32 softmax adds a few roundings (exp, sum of E terms, division): 8u +
    # gamma(E). Renormalising adds the top-k sum's and the division's (gamma(k) + u), and the relative errors of
    # numerator and denominator add up.
    rel_p = 2 * logit_err.max(axis=1, keepdims=True) + 8 * u + gamma(E)
    rel_w = (2 * rel_p + gamma(k) + u) if renormalise else rel_p

    out = np.zeros_like(x)
    bound = np.zeros_like(x)
    for slot in range(k):
        for e in range(E):
            rows = np.nonzero(index[:, slot] == e)[0]
            if rows.size == 0:
                continue
            d, ed = swiglu(x[rows], w(names["gate"][e]), w(names["up"][e]), w(names["down"][e]))
            we = weights[rows, slot][:, None]
            out[rows] += we * d
            bound[rows] += we * ed + np.abs(we * d) * (rel_w[rows] + u) + np.abs(we) * ed * rel_w[rows]
    bound += gamma(k + 1) * np.abs(out) + 1e-30  # the sum over the k experts (and the zero it starts from)
    if f.shared_expert:
        Sg, Su, Sd = (w(f"model.layers.{layer}.mlp.shared_expert.{n}_proj.weight") for n in ("gate", "up", "down"))
        Sgate = w(f"model.layers.{layer}.mlp.shared_expert_gate.weight")
        d, ed = swiglu(x, Sg, Su, Sd)
        z = x @ Sgate.T
        sig = 1 / (1 + np.exp(-z))
        # sigmoid's derivative is at most 1/4; its Float32 evaluation adds a few ulps.
        esig = 0.25 * gamma(H) * ax @ np.abs(Sgate).T + 4 * u * sig
        shared = sig * d
        out += shared
        bound += sig * ed + esig * np.abs(d) + esig * ed + u * np.abs(shared) + u * np.abs(out)
    return out, bound, index


@pytest.mark.parametrize("family", FAMILIES)
def test_each_block_computes_what_hf_models_documents(saved, family):
    """Float32 model, read back with from_pretrained (so the checkpoint's per-expert tensors are what it fuses):
    the block's output is within the Float32 error bound of the documented math computed in Float64 from the
    checkpoint, and picks the same experts (tokens whose top-k is within rounding of a tie are skipped: none are at
    this seed)."""
    _, folders = saved[family]
    model = hf_models.load_model(family, folders["float32"], experts_implementation="eager")
    ckpt = sw.safetensors.open(folders["float32"])
    config = model.config
    x = hf_models.hidden_states(config, tokens=32, seed=3)
    for layer in range(config.num_hidden_layers):
        block = hf_models.moe_block(model, layer)
        ref = hf_models.block_reference(block, x)
        assert ref.output.dtype == torch.float32 and ref.topk_weights.dtype == torch.float32
        assert float(hf_models.routing_margin(ref.router_logits, config.num_experts_per_tok).min()) > 1e-5
        out, bound, index = float64_block(ckpt, family, layer, config, x.double().numpy())
        assert np.array_equal(np.sort(index, axis=1), np.sort(ref.topk_index.numpy(), axis=1))
        err = np.abs(ref.output.double().numpy() - out)
        assert np.all(err <= bound), f"{family} layer {layer}: max err/bound {float((err / bound).max()):.3g}"
        assert float((err / bound).max()) < 1  # (printed on failure above)
        grads = ref.grads
        assert grads["experts.gate_up_proj"].shape == block.experts.gate_up_proj.shape
        assert ref.grad_hidden.shape == x.shape and grads["gate.weight"] is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_implementations_agree(saved, family):
    """transformers' default experts implementation on the CPU ("grouped_mm") and the per-expert loop ("eager")
    give the same forward and backward within Float32 rounding: either is the reference. Both are sums of the same
    products in different orders; 1e-5 of the largest magnitude is far above the gamma_n (n <= 96, ~6e-6) bound of
    either's error and far below the effect of a wrong expert or a wrong half of gate_up_proj."""
    _, folders = saved[family]
    x = hf_models.hidden_states(hf_models.tiny_config(family), tokens=24, seed=4)
    refs = {}
    for impl in ("eager", "grouped_mm"):
        model = hf_models.load_model(family, folders["float32"], experts_implementation=impl)
        assert model.config._experts_implementation == impl
        refs[impl] = hf_models.block_reference(hf_models.moe_block(model, 1), x)
    a, b = refs["eager"], refs["grouped_mm"]
    for got, want in [(b.output, a.output), (b.grad_hidden, a.grad_hidden)] + [
            (b.grads[n], a.grads[n]) for n in a.grads]:
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
