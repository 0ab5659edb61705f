"""Hostile use of the DLPack / PyTorch bridge and of the arguments the bindings convert (docs/reliability.md,
"Hostile use").

A tensor imported from PyTorch (``from_torch``, ``sw.from_dlpack`` of a ``torch.Tensor``) borrows the storage's
memory, which PyTorch may free in place afterwards: ``x.resize_`` past the storage's size reallocates it,
``x.untyped_storage().resize_`` too, and ``x.set_`` drops ``x``'s hold on it (Note [Borrowed memory] in
cpp/src/carriers/native.cpp). The import holds the storage itself, so ``set_`` leaves the imported bytes alive and
unchanged, and checks the storage before every use, so a moved one fails that use with RuntimeError instead of
reading or writing freed memory. Each error path checks that nothing changed.

The protocol's answers (``__dlpack_device__``, ``__dlpack__``) and out-of-range ints are refused with TypeError /
ValueError / OverflowError naming what was expected, never a C++ type name such as ``std::bad_cast``.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

import strideweave as sw
from strideweave.torch import from_torch, to_torch

# Under AddressSanitizer (make sanitize-py) freed memory stays mapped in quarantine, and ASan itself reports any read
# of it: the page probes below are left to it there.
SANITIZED = os.environ.get("SW_SANITIZED") == "1"

MOVED = r"the storage of a torch\.Tensor \(torch\.float32, shape \(6,\)\) that this CPU tensor borrows was " \
        r"resized or freed by PyTorch"


def mapped(address: int) -> bool:
    """Whether the page at `address` is mapped in this process: one page read through /proc/self/mem, which answers
    an error for unmapped memory instead of faulting (and a page-sized buffer, which never lands on a freed
    mapping)."""
    with open("/proc/self/mem", "rb", buffering=0) as mem:
        try:
            mem.seek(address)
            return len(mem.read(4096)) == 4096
        except OSError:
            return False


def every_use_fails(t: sw.Tensor, fragment: str) -> None:
    """Each way of reading or writing `t` raises RuntimeError with `fragment` and the use it refused."""
    for use, action in [
        (lambda: t[(0,)], "read a tensor element"),
        (lambda: t.__setitem__((0,), 9.0), "write a tensor element"),
        (lambda: t + t, "compute with it"),
        (lambda: np.asarray(t), "export a tensor to NumPy"),
        (lambda: to_torch(t), "export a tensor through DLPack"),
        (lambda: t.__dlpack__(max_version=(1, 0)), "export a tensor through DLPack"),
    ]:
        with pytest.raises(RuntimeError, match=rf"cannot {action}: {fragment}"):
            use()


# ============================================================ item U21: the source moved under an import


@pytest.mark.parametrize("importer", [from_torch, sw.from_dlpack], ids=["from_torch", "from_dlpack"])
def test_a_resize_that_reallocates_the_storage_fails_every_later_use(importer):
    x = torch.arange(6, dtype=torch.float32)
    t = importer(x)
    assert [t[(i,)] for i in range(6)] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    before = x.data_ptr()
    x.resize_(1 << 16)  # past the storage's 24 bytes: torch allocates anew, copies, and frees the imported bytes
    assert x.data_ptr() != before
    every_use_fails(t, MOVED)
    assert x[:6].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # the refused write reached nothing


def test_a_storage_resized_to_nothing_fails_every_later_use():
    x = torch.arange(6, dtype=torch.float32)
    t = from_torch(x)
    x.untyped_storage().resize_(0)  # frees the bytes in place; the storage object lives on
    every_use_fails(t, MOVED + r" after the import \(its memory moved from 0x[0-9a-f]+, 24 bytes used, to "
                           r"(0|0x0|\(nil\)), 0 bytes\)")


def test_a_resize_within_the_storage_keeps_the_import_valid():
    x = torch.arange(6, dtype=torch.float32)
    t = from_torch(x)
    x.resize_(2)  # smaller: the storage keeps its memory
    x.resize_(6)  # and back within it: still the same memory
    t[(5,)] = -1.0
    assert [t[(i,)] for i in range(6)] == [0.0, 1.0, 2.0, 3.0, 4.0, -1.0] and x[5].item() == -1.0
    assert np.asarray(t).ctypes.data == x.data_ptr()


def test_set_leaves_the_imported_bytes_alive_and_unchanged():
    # 64 MiB: above glibc's largest mmap threshold, so memory torch frees is unmapped at once; /proc/self/mem
    # then tells a freed storage from a live one without reading freed memory.
    n = 1 << 24
    x = torch.zeros(n, dtype=torch.float32)
    x[:6] = torch.arange(6, dtype=torch.float32)
    t = from_torch(x)
    address = x.data_ptr()
    x.set_(torch.full((8,), 7.0).untyped_storage())  # x lets go of the storage the import borrows
    assert SANITIZED or (mapped(address) and mapped(address + 4 * n - 4096))  # still held, by the import
    assert [t[(i,)] for i in range(6)] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    t[(0,)] = 9.0  # the import's own memory, no longer x's
    assert t[(0,)] == 9.0 and x.tolist() == [7.0] * 8
    assert np.asarray(t).ctypes.data == address
    del t
    gc.collect()
    assert SANITIZED or not mapped(address)  # the last holder gone, the storage is freed as before


def test_set_to_an_empty_storage_leaves_the_import_valid():
    x = torch.arange(6, dtype=torch.float32)
    t = from_torch(x)
    x.set_()  # x now over an empty storage of its own
    assert x.numel() == 0
    assert [t[(i,)] for i in range(6)] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert (t + t)[(5,)] == 10.0


def test_an_offset_view_is_checked_against_its_whole_storage():
    base = torch.arange(12, dtype=torch.float32)
    x = base[6:]  # an offset into the storage: the import reaches bytes 24..48 of it
    t = from_torch(x)
    assert t[(0,)] == 6.0
    base.untyped_storage().resize_(32)  # smaller than what the import reaches: reallocated and cut
    with pytest.raises(RuntimeError, match=r"cannot read a tensor element: the storage of a torch\.Tensor "
                                           r"\(torch\.float32, shape \(6,\)\) .* 48 bytes used"):
        t[(0,)]


# ============================================================ item U23c: the DLPack protocol's answers


class Producer:
    """An object with __dlpack__ whose answers the test chooses (NumPy's memory behind it)."""

    NUMPY = object()  # __dlpack__ answers NumPy's capsule

    def __init__(self, device=(1, 0), capsule=NUMPY):
        self.device, self.capsule, self.asked = device, capsule, False
        self.a = np.arange(3, dtype=np.float32)

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        self.asked = True
        return self.a.__dlpack__(**kwargs) if self.capsule is Producer.NUMPY else self.capsule


@pytest.mark.parametrize("device, shown", [
    (("cpu", "0"), r"\('cpu', '0'\)"),
    ((1,), r"\(1,\)"),
    ([1, "0"], r"\[1, '0'\]"),
    ((1.0, 0), r"\(1\.0, 0\)"),
    ("cpu", "'cpu'"),
    (None, "None"),
])
def test_a_device_that_is_not_a_pair_of_ints_is_a_type_error(device, shown):
    p = Producer(device=device)
    with pytest.raises(TypeError, match=r"from_dlpack: (\w+\.)*Producer\.__dlpack_device__\(\) must return a "
                                        rf"\(device_type, device_id\) tuple of two ints, got {shown}$"):
        sw.from_dlpack(p)
    assert not p.asked  # refused before the producer exported anything


def test_a_device_as_a_list_of_two_ints_is_read_as_the_tuple():
    p = Producer(device=[1, 0])
    t = sw.from_dlpack(p)
    assert p.asked and np.asarray(t).ctypes.data == p.a.ctypes.data


def test_a_device_beyond_int64_is_a_value_error():
    p = Producer(device=(1, 2**70))
    with pytest.raises(ValueError, match=r"the device_id of __dlpack_device__\(\) 1180591620717411303424 is out "
                                         "of range"):
        sw.from_dlpack(p)
    assert not p.asked


@pytest.mark.parametrize("answer, shown", [(5, "int"), ("capsule", "str"), (None, "NoneType")])
def test_dlpack_answering_something_else_than_a_capsule_is_a_type_error(answer, shown):
    p = Producer(capsule=answer)
    with pytest.raises(TypeError, match=rf"from_dlpack: (\w+\.)*Producer\.__dlpack__\(\) must return a DLPack capsule, "
                                        rf"got {shown}$"):
        sw.from_dlpack(p)
    assert p.asked and p.a.tolist() == [0.0, 1.0, 2.0]


# ============================================================ item U23a: ResidencyBudget's byte count


@pytest.mark.parametrize("value, shown", [
    (2**63, "9223372036854775808"),
    (2**64 + 5, "18446744073709551621"),
    (10**5000, "an int of 16610 bits"),
], ids=["2**63", "2**64+5", "10**5000"])
def test_a_budget_beyond_int64_is_an_overflow_error(value, shown):
    with pytest.raises(OverflowError, match=rf"^ResidencyBudget: max_bytes must be a byte count from 1 to "
                                            rf"9223372036854775807, got {shown}$"):
        sw.ResidencyBudget(value)


@pytest.mark.parametrize("value, shown", [
    (-1, "-1"),
    (0, "0"),
    (-(2**63) - 1, "-9223372036854775809"),
    (-(10**5000), "a negative int of 16610 bits"),
], ids=["-1", "0", "-2**63-1", "-10**5000"])
def test_a_budget_below_one_is_a_value_error(value, shown):
    with pytest.raises(ValueError, match=rf"^ResidencyBudget: max_bytes must be >= 1.*, got {shown}$"):
        sw.ResidencyBudget(value)


def test_the_largest_budget_is_accepted_and_a_non_int_is_a_type_error():
    assert sw.ResidencyBudget(2**63 - 1).max_bytes == 2**63 - 1
    for bad, name in [(1.0, "float"), ("8", "str"), (True, "bool")]:
        with pytest.raises(TypeError, match=rf"^ResidencyBudget: max_bytes must be an int, got {name}$"):
            sw.ResidencyBudget(bad)


# ============================================================ the backstop: no C++ type name reaches a user


def test_a_conversion_the_bindings_did_not_check_is_a_type_error_without_a_cpp_name():
    c = sw.CPU(2)
    with pytest.raises(TypeError, match="an argument could not be converted to what this call expects") as e:
        c.dispatch_op("add\ud800")  # a lone surrogate: a str with no UTF-8 form
    assert "std::" not in str(e.value) and "bad_cast" not in str(e.value)
    assert c.dispatch_op("add") is not None  # the carrier is as it was


@pytest.mark.parametrize("value, shown", [
    (2**70, "1180591620717411303424"),
    (-(2**63) - 1, "-9223372036854775809"),
    (10**5000, r"\(an int of 16610 bits\)"),
    (-(10**5000), r"\(a negative int of 16610 bits\)"),
], ids=["2**70", "-2**63-1", "10**5000", "-10**5000"])
def test_an_int_beyond_int64_is_a_value_error_with_the_range(value, shown):
    c = sw.CPU(4)
    c[0] = 1.0
    t = sw.Tensor(c, 0, sw.friendly.column_major(4))
    with pytest.raises(ValueError, match=rf"^coordinate {shown} is out of range \(an int64: from "
                                         r"-9223372036854775808 to 9223372036854775807\)$"):
        t[(value,)]
    assert [c[i] for i in range(4)] == [1.0, 0.0, 0.0, 0.0]
