"""Immutable entries of Carrier.operation_capabilities()."""

from __future__ import annotations

import dataclasses
import enum

from ._core import DType

__all__ = ["OperandRole", "OperandCapability", "OperationCapability"]


class OperandRole(enum.Enum):
    """What an operand position accepts."""

    TENSOR = "tensor"
    WEAK_SCALAR = "weak_scalar"


@dataclasses.dataclass(frozen=True)
class OperandCapability:
    role: OperandRole
    dtype: DType


@dataclasses.dataclass(frozen=True)
class OperationCapability:
    """One accepted operand signature of an operation."""

    operation: str
    operands: tuple


def _operand(role: str, dtype: DType) -> OperandCapability:
    return OperandCapability(OperandRole(role), dtype)
