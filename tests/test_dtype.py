"""Contract tests for DType (docs/guide.md, "DTypes").

Six singletons compared with `is` (BFloat16 and Float16: tests/test_dtype16.py); `name`, `bits`, `DType.registered()`; and
`dtype.convert(value)`, the storage rules applied to a Python element value:
Float32 rounds to binary32, Int32 raises OverflowError out of range, Bool
accepts only bool, any other type raises TypeError. Float64 is the accumulator
dtype: float and int, no rounding to a narrower format.
"""

import copy
import math
import pickle
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import strideweave as sw
import strideweave.carriers
from strideweave import DType
from models import binary32

PROPERTY = settings(derandomize=True, max_examples=300, deadline=None, database=None)

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


# ============================================================== identity


def test_dtype_is_reachable_from_both_modules_as_the_same_object():
    assert sw.DType is strideweave.carriers.DType
    assert "DType" in sw.__all__
    assert "DType" in strideweave.carriers.__all__


def test_singletons_compare_with_is():
    assert DType.Float32 is DType.Float32
    assert sw.DType.Int32 is strideweave.carriers.DType.Int32
    dtypes = [DType.Float32, DType.Int32, DType.Bool, DType.Float64]
    for a in dtypes:
        assert isinstance(a, DType)
        for b in dtypes:
            assert (a is b) == (a == b)
            assert (a != b) == (a is not b)


def test_registered_is_a_tuple_of_all_six_in_order():
    reg = DType.registered()
    assert type(reg) is tuple
    assert len(reg) == 6  # issue 18 added BFloat16 and Float16 after the first four
    assert reg[0] is DType.Float32
    assert reg[1] is DType.Int32
    assert reg[2] is DType.Bool
    assert reg[3] is DType.Float64
    assert reg[4] is DType.BFloat16
    assert reg[5] is DType.Float16
    assert all(a is b for a, b in zip(DType.registered(), reg))  # same singletons every call


def test_names():
    assert DType.Float32.name == "Float32"
    assert DType.Int32.name == "Int32"
    assert DType.Bool.name == "Bool"
    assert DType.Float64.name == "Float64"
    for d in DType.registered():
        assert getattr(DType, d.name) is d


def test_bits():
    assert DType.Float32.bits == 32
    assert DType.Int32.bits == 32
    assert DType.Bool.bits == 8
    assert DType.Float64.bits == 64
    assert all(type(d.bits) is int for d in DType.registered())


def test_dtype_cannot_be_constructed():
    with pytest.raises(TypeError, match="cannot be constructed"):
        DType()
    with pytest.raises(TypeError, match="cannot be constructed"):
        DType("Float32")
    with pytest.raises(TypeError, match="cannot be constructed"):
        DType(name="Float32", bits=32)


def test_dtype_is_immutable_and_hashable():
    for d in DType.registered():
        with pytest.raises(AttributeError):
            d.name = "x"
        with pytest.raises(AttributeError):
            d.bits = 1
        assert hash(d) == hash(d)
    assert len({d: d.name for d in DType.registered()}) == 6
    assert DType.Float32.name == "Float32" and DType.Float32.bits == 32


def test_copy_and_pickle_keep_the_singleton():
    for d in DType.registered():
        assert copy.copy(d) is d
        assert copy.deepcopy(d) is d
        assert pickle.loads(pickle.dumps(d)) is d


# ============================================================== Float32


def test_float32_rounds_to_binary32():
    out = DType.Float32.convert(0.1)
    assert type(out) is float
    assert out == struct.unpack("f", struct.pack("f", 0.1))[0]
    assert out != 0.1
    assert DType.Float32.convert(1.5) == 1.5
    assert DType.Float32.convert(-0.0) == 0.0 and math.copysign(1, DType.Float32.convert(-0.0)) == -1
    assert DType.Float32.convert(2.0**-149) == 2.0**-149  # smallest subnormal
    assert DType.Float32.convert(2.0**-151) == 0.0  # underflows to zero
    assert DType.Float32.convert(1 + 2.0**-30) == 1.0


def test_float32_huge_values_round_to_inf():
    assert DType.Float32.convert(1e300) == math.inf
    assert DType.Float32.convert(-1e300) == -math.inf
    assert DType.Float32.convert(3.5e38) == math.inf
    flt_max = struct.unpack("f", struct.pack("f", 3.4028234663852886e38))[0]
    assert DType.Float32.convert(flt_max) == flt_max
    assert DType.Float32.convert(2**200) == math.inf  # an int
    assert DType.Float32.convert(-(2**2000)) == -math.inf  # an int beyond any float


def test_float32_special_values():
    assert DType.Float32.convert(math.inf) == math.inf
    assert DType.Float32.convert(-math.inf) == -math.inf
    assert math.isnan(DType.Float32.convert(math.nan))


def test_float32_accepts_int():
    out = DType.Float32.convert(3)
    assert type(out) is float and out == 3.0
    assert DType.Float32.convert(2**24 + 1) == 2.0**24  # rounds
    assert DType.Float32.convert(-7) == -7.0
    assert DType.Float32.convert(2**100) == 2.0**100


@pytest.mark.parametrize(
    "value, fragment",
    [(True, "bool"), (False, "bool"), ("1.0", "str"), (None, "NoneType"), (1 + 2j, "complex"), ([1.0], "list"), (b"1", "bytes")],
)
def test_float32_rejects_other_types(value, fragment):
    with pytest.raises(TypeError, match=fragment):
        DType.Float32.convert(value)


# ============================================================== Int32


def test_int32_accepts_ints_in_range():
    for v in (0, 1, -1, 123456, INT32_MAX, INT32_MIN):
        out = DType.Int32.convert(v)
        assert type(out) is int and out == v


@pytest.mark.parametrize("value", [INT32_MAX + 1, INT32_MIN - 1, 2**40, -(2**40), 2**63 - 1, -(2**63), 2**63, 2**64, -(2**64) - 1, 2**200, -(2**2000)])
def test_int32_out_of_range_raises_overflow_error(value):
    with pytest.raises(OverflowError, match="out of range"):
        DType.Int32.convert(value)


@pytest.mark.parametrize(
    "value, fragment",
    [(True, "bool"), (False, "bool"), (1.0, "float"), (0.0, "float"), (1e300, "float"), ("1", "str"), (None, "NoneType"), (1 + 0j, "complex")],
)
def test_int32_rejects_other_types(value, fragment):
    with pytest.raises(TypeError, match=fragment):
        DType.Int32.convert(value)


def test_int32_rejects_a_float_even_when_out_of_range():
    # The type rule comes first: a float is never an Int32 value.
    with pytest.raises(TypeError):
        DType.Int32.convert(2.0**40)


# ============================================================== Bool


def test_bool_accepts_only_bool():
    assert DType.Bool.convert(True) is True
    assert DType.Bool.convert(False) is False


@pytest.mark.parametrize("value, fragment", [(1, "int"), (0, "int"), (1.0, "float"), (0.0, "float"), ("True", "str"), (None, "NoneType"), (2**70, "int")])
def test_bool_rejects_other_types(value, fragment):
    with pytest.raises(TypeError, match="bool"):  # the message names the rule ...
        DType.Bool.convert(value)
    with pytest.raises(TypeError, match=fragment):  # ... and the offending type
        DType.Bool.convert(value)


# ============================================================== Float64


def test_float64_accepts_float_and_int_without_rounding():
    assert DType.Float64.convert(0.1) == 0.1
    assert DType.Float64.convert(1 + 2.0**-52) == 1 + 2.0**-52
    assert DType.Float64.convert(1e300) == 1e300
    out = DType.Float64.convert(3)
    assert type(out) is float and out == 3.0
    assert DType.Float64.convert(2**53) == 2.0**53
    assert DType.Float64.convert(2**24 + 1) == 2.0**24 + 1  # no binary32 rounding
    assert math.isnan(DType.Float64.convert(math.nan))


@pytest.mark.parametrize("value, fragment", [(True, "bool"), ("0.1", "str"), (None, "NoneType"), (1j, "complex")])
def test_float64_rejects_other_types(value, fragment):
    with pytest.raises(TypeError, match=fragment):
        DType.Float64.convert(value)


# ============================================================== properties


@PROPERTY
@given(st.floats(allow_nan=False))
def test_property_float32_convert_is_binary32_rounding(x):
    out = DType.Float32.convert(x)
    assert type(out) is float
    assert out == binary32(x)
    if out != 0:
        assert math.copysign(1, out) == math.copysign(1, x)


@PROPERTY
@given(st.integers(-(2**53), 2**53))
def test_property_float32_convert_of_exact_ints(n):
    assert DType.Float32.convert(n) == binary32(float(n))


@PROPERTY
@given(st.floats(allow_nan=False))
def test_property_float64_convert_is_identity(x):
    assert DType.Float64.convert(x) == x


@PROPERTY
@given(st.integers(-(2**70), 2**70))
def test_property_int32_range(n):
    if INT32_MIN <= n <= INT32_MAX:
        assert DType.Int32.convert(n) == n
    else:
        with pytest.raises(OverflowError):
            DType.Int32.convert(n)
