"""A counting storage provider for user-defined carrier kinds (practices: "Lifetimes proven by counting").

A ``Ledger`` keeps one ``Record`` per carrier its provider allocated (in order of construction) and every
contract breach its callbacks saw (asserting inside a callback would be swallowed by the engine), so a test
proves that each carrier's storage was released exactly once:

    LEDGER = Ledger()
    register_carrier_definition(MyKind, CarrierDefinition(LEDGER.storage(lambda c, d: d is F32)))
    ...
    start = len(LEDGER); ...; LEDGER.check(start)   # no breach; no storage released twice since `start`
"""

from __future__ import annotations

from strideweave import DType
from strideweave.carriers.extension import StorageProvider

ZERO = {DType.Float32: 0.0, DType.Int32: 0, DType.Bool: False}
PY_TYPE = {DType.Float32: float, DType.Int32: int, DType.Bool: bool}


class Record:
    """The provider's record of one carrier: its slots (a list; None once released), how often it was allocated
    and released, and faults a test injects into its reads and writes."""

    def __init__(self):
        self.values = []
        self.allocations = 0
        self.releases = 0
        self.fail_read = False
        self.fail_write = False


def record_of(c) -> Record:
    """The Record of a carrier of a kind whose provider a Ledger made."""
    return c.__dict__["_record"]


class Ledger:
    """Every Record a provider made, in order (``len``, indexing and slicing as a list), and its breaches."""

    def __init__(self):
        self.records: list[Record] = []
        self.violations: list[str] = []

    def __len__(self):
        return len(self.records)

    def __getitem__(self, key):
        return self.records[key]

    def check(self, start=0):
        """No callback saw a contract breach; no storage recorded since `start` was released twice."""
        assert self.violations == []
        assert all(r.releases <= 1 for r in self.records[start:])

    def allocate(self, c, slots):
        record = c.__dict__.get("_record")
        if record is None:
            record = c.__dict__["_record"] = Record()
            self.records.append(record)
        if record.releases:
            self.violations.append("allocate after release")
        record.allocations += 1
        record.values = [ZERO[c.dtype()]] * slots

    def release(self, c):
        record = record_of(c)
        record.releases += 1
        if record.releases > 1:
            self.violations.append("release called twice")
        record.values = None

    def size(self, c):
        record = record_of(c)
        if record.values is None:
            self.violations.append("physical_size after release")
            return 0
        return len(record.values)

    def read(self, c, i):
        record = record_of(c)
        if record.values is None:
            self.violations.append("read after release")
        if record.fail_read:
            raise OSError("injected read fault")
        return record.values[i]

    def write(self, c, i, value):
        record = record_of(c)
        if record.values is None:
            self.violations.append("write after release")
        if record.fail_write:
            raise OSError("injected write fault")
        if type(value) is not PY_TYPE[c.dtype()]:
            self.violations.append(f"write of unconverted {type(value).__name__} into {c.dtype().name}")
        record.values[i] = value

    def storage(self, supports_dtype, *, elementwise_fallback=False) -> StorageProvider:
        """A StorageProvider whose callbacks keep this ledger."""
        return StorageProvider(
            supports_dtype=supports_dtype,
            physical_size=self.size,
            allocate=self.allocate,
            release=self.release,
            read=self.read,
            write=self.write,
            elementwise_fallback=elementwise_fallback,
        )
