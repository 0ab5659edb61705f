"""A short tour of StrideWeave: layouts, carriers, tensors and asynchronous movement.

Run with `python examples/demo.py`. The main job, a Mixture-of-Experts layer
whose expert weights live in a file, is examples/moe_offload.py (`make demo`);
this tour shows the pieces it stands on.
"""

import os
import tempfile
import time

import numpy as np

import strideweave as sw


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 60 - len(title)))


def main() -> None:
    section("Layouts: hierarchical, first mode fastest")
    shape = sw.Shape(5, [20, 4])
    print(f"{shape!r}: size {shape.size}, extents {shape.extents}, depth {shape.depth}")
    print(f"decode(214) -> {shape.decode(214)}")
    print(f"encode((4, (2, 2))) = encode((4, 42)) = {shape.encode((4, 42))}")
    layout = sw.Layout(sw.Shape([2, [3, 4]]), sw.Stride([1, [10, 100]]))
    print(f"{layout!r}([1, [2, 3]]) = {layout([1, [2, 3]])}; cosize {layout.cosize}; injective {layout.is_injective}")
    print(f"column_major(2, 3) = {sw.friendly.column_major(2, 3)!r}; row_major(2, 3, 4) = {sw.friendly.row_major(2, 3, 4)!r}")
    print(f"broadcast: {sw.Layout(sw.Shape(1, 3), sw.Stride(0, 1)).broadcast_to(sw.Shape(4, 3))!r}")

    section("DTypes")
    for d in sw.DType.registered():
        print(f"{d!r}: {d.bits} bits")
    print(f"Float32 stores 0.1 as {sw.DType.Float32.convert(0.1)!r}")

    section("Tensors are views of carriers")
    t = sw.friendly.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    print(t)
    view = np.asarray(t)  # zero-copy for dense CPU tensors
    view[1, 2] = 60.0
    print(f"t[(1, 2)] after writing through NumPy: {t[(1, 2)]}; carrier version {t.version}")

    section("Movement: CPU -> file -> CPU, asynchronously")
    n = 64 << 20  # 256 MiB of Float32
    big = sw.Tensor(sw.CPU(n), 0, sw.friendly.column_major(n))
    arr = np.asarray(big)
    arr[:] = np.arange(n, dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "weights.bin")
        start = time.perf_counter()
        handle = sw.move_async(big, sw.FileBacked(path))
        print(f"move_async returned at once: done={handle.done}")
        on_file = handle.wait()
        mid = time.perf_counter()
        back = sw.move(on_file, sw.CPU(0))
        end = time.perf_counter()
        ok = np.array_equal(np.asarray(back), np.arange(n, dtype=np.float32))
        gb = n * 4 / 1e9
        print(f"to file {gb / (mid - start):.1f} GB/s, back {gb / (end - mid):.1f} GB/s, bit-exact: {ok}")
        print(f"the source carrier was consumed: released={big.carrier.is_released()}")
        back.carrier.release()


if __name__ == "__main__":
    main()
