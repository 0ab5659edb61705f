"""A typed user of strideweave: `make test` type-checks this file against the installed stubs (tests/typing/check.py),
then runs it.

Expert weights live in a raw file opened in place as the secondary tier of a TiledEvictable (docs/guide.md,
"Mixture-of-Experts weights in a file"); two experts are projected, multiplied with activations, and backward fills
the gradients. Every call below goes through the public API as docs/guide.md shows it.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import numpy.typing as npt

import strideweave as sw

EXPERTS, OUT, IN, TOKENS = 4, 3, 2, 5


def write_checkpoint(directory: str, experts: npt.NDArray[np.float32]) -> str:
    path = os.path.join(directory, "w.f32")
    np.ascontiguousarray(experts.transpose(0, 2, 1)).tofile(path)  # each expert column-major, one after another
    return path


def activations(values: npt.NDArray[np.float32]) -> sw.Tensor:
    rows, cols = values.shape
    x = sw.Tensor(sw.CPU(rows * cols), 0, sw.column_major(rows, cols))
    for i in range(rows):
        for j in range(cols):
            x[i, j] = float(values[i, j])
    return x


def main() -> None:
    rng = np.random.default_rng(0)
    experts = rng.standard_normal((EXPERTS, OUT, IN)).astype(np.float32)
    tokens = rng.standard_normal((TOKENS, 2 * IN)).astype(np.float32)
    with tempfile.TemporaryDirectory() as directory:
        secondary = sw.FileBacked(write_checkpoint(directory, experts), mutable=False)
        carrier = sw.TiledEvictable(sw.CPU(0), secondary, (1, EXPERTS), (OUT, IN))
        full = sw.Tensor(carrier, 0, sw.Layout(sw.Shape(OUT, [IN, EXPERTS]), sw.Stride(1, [OUT, OUT * IN])))
        carrier.promote_async(sw.TileSet(((0, 2),))).wait()
        selection = sw.TileSelection(((0,), (2, 1)))
        w = carrier.project(full, selection).wait()  # experts 2 and 1: (OUT, 2 * IN)
        x = activations(tokens)
        y = sw.matmul(x, w)  # (TOKENS, OUT)
        loss = sw.reduce_sum(y, "a b ->")
        loss.backward()

        reference = tokens[:, :IN] @ experts[2].T + tokens[:, IN:] @ experts[1].T
        got = np.asarray(y)
        assert np.allclose(got, reference, rtol=1e-5, atol=1e-5), (got, reference)
        grad = x.grad
        assert grad is not None
        expected_dx = np.concatenate([experts[2].sum(axis=0), experts[1].sum(axis=0)])
        for t in range(TOKENS):
            for k in range(2 * IN):
                value = grad[t, k]
                assert isinstance(value, float) and abs(value - float(expected_dx[k])) < 1e-5
        assert full.grad is not None
        carrier.release()
    print(f"user_script: loss {float(np.asarray(loss)):.4f}, y and x.grad match NumPy")


if __name__ == "__main__":
    main()
