"""A test carrier whose transfers stay pending until the test settles them.

Modelled on TensorStore's ``mock_kvstore``: ``PendingCarrier`` is a
user-defined carrier kind (registered once, when this module is imported) with
a registered route ``PendingCarrier -> PendingCarrier``. The route's
``submit()`` does no work: it queues a :class:`Transfer` and returns it as the
completion object the engine waits on. The test then calls
``transfer.complete()`` (which performs the copy and lets the move finish) or
``transfer.fail(exc)``. Nothing sleeps: a move stays pending exactly until
the test says otherwise, so pending states, ordering and failures are tested
deterministically.

Per-instance knobs let a test make one carrier's provider callbacks misbehave
(the spec's "a provider exception fails the request that called it"):

* ``carrier.prepare_error = exc``: ``TransferProvider.prepare`` raises ``exc``.
* ``carrier.submit_error = exc``: ``PreparedTransfer.submit`` raises ``exc``.
* ``carrier.unsupported = "reason"``: ``prepare`` answers ``Unsupported``.
* ``carrier.read_error = exc``: ``StorageProvider.read`` raises ``exc``
  (used by the element-wise fallback between PendingCarrier and the shipped
  carriers).
* ``carrier.on_release = fn``: ``fn(carrier)`` runs inside the provider's
  ``release``, i.e. at the moment a move consumes its source, so a test can
  observe the state of the move from inside the engine.

Each knob applies to the *source* carrier of a move (routes and reads are the
source's). ``carrier.release_calls`` counts provider releases and
``carrier.released`` is a ``threading.Event`` set by the first one, so a test
can observe a move finishing without holding its handle.

``SealedCarrier`` is a second kind with no routes and no element-wise fallback:
every move between it and another kind has no route.

Helpers: :func:`pending_tensor`, :func:`sealed_tensor`, :func:`destination`,
:func:`pending_transfers`, :func:`take`, :func:`settle_all`,
:func:`wait_handle` (wait with a deadline, so a bug fails a test instead of
hanging the suite).

Example::

    t = pending_tensor([1.0, 2.0, 3.0])
    h = sw.move_async(t, destination())   # submit() ran: one transfer is queued
    assert not h.done and t.carrier.is_owned()
    take().complete()                     # or take().fail(RuntimeError("..."))
    result = wait_handle(h)

Caveat: while a transfer is pending, one of the engine's move threads blocks in
``Transfer.wait()`` (the pool has max(4, cores) threads). Keep fewer pending
transfers than that at once, or every other move queues behind them; and settle
everything a test starts (``settle_all`` in a fixture teardown).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import strideweave as sw
from strideweave.carriers.extension import (
    CarrierDefinition,
    PreparedTransfer,
    StorageProvider,
    TransferProvider,
    TransferRoute,
    Unsupported,
    register_carrier_definition,
)

__all__ = [
    "PendingCarrier",
    "SealedCarrier",
    "Transfer",
    "destination",
    "pending_tensor",
    "pending_transfers",
    "sealed_tensor",
    "settle_all",
    "take",
    "wait_handle",
]

# How long a test waits for something that, when the engine is correct,
# happens at once. It bounds a failure; it never paces a passing test.
DEADLINE_S = 10.0

_lock = threading.Lock()
_queue: list["Transfer"] = []  # submitted, not yet settled, oldest first


class Transfer:
    """One submitted transfer: the engine waits on it until the test settles it.

    ``done`` and ``wait()`` are the completion protocol the engine requires
    of ``PreparedTransfer.submit``'s result.
    """

    def __init__(self, request):
        self.request = request
        self._event = threading.Event()
        self._error: Optional[BaseException] = None
        self._settled = False
        self.wait_calls = 0

    # -- the completion protocol (called by the engine, from its threads)
    @property
    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self.wait_calls += 1
        self._event.wait()
        if self._error is not None:
            raise self._error

    # -- driven by the test
    @property
    def source(self):
        return self.request.tensor.carrier

    @property
    def destination(self):
        return self.request.destination

    def complete(self, copy: bool = True) -> None:
        """Copies the source's values into the destination, then succeeds."""
        if copy:
            src = self.request.tensor
            dst = self.request.destination
            layout = self.request.layout
            for i in range(layout.size):
                off = layout(i)
                dst._slots[off] = src.carrier._slots[src.offset + off]
        self._settle(None)

    def fail(self, error: BaseException) -> None:
        """Fails the transfer: the engine's wait on it raises ``error``."""
        if not isinstance(error, BaseException):
            raise TypeError("fail() needs an exception instance")
        self._settle(error)

    def _settle(self, error: Optional[BaseException]) -> None:
        with _lock:
            if self._settled:
                raise RuntimeError("this transfer was already settled")
            self._settled = True
            _queue.remove(self)
        self._error = error
        self._event.set()

    def __repr__(self) -> str:
        state = "settled" if self._settled else "pending"
        return f"Transfer({self.request.source_class.__name__} -> {self.request.destination_class.__name__}, {state})"


def pending_transfers() -> tuple:
    """The transfers submitted and not yet settled, oldest first (a snapshot)."""
    with _lock:
        return tuple(_queue)


def take() -> Transfer:
    """The oldest pending transfer (it stays queued until settled)."""
    with _lock:
        if not _queue:
            raise AssertionError("no transfer is pending")
        return _queue[0]


def settle_all(error: Optional[BaseException] = None) -> int:
    """Fails (or, with error=None, completes) every pending transfer; returns how many.

    Fixtures call it at teardown so that no library thread stays blocked on a
    transfer a failed test left behind.
    """
    n = 0
    for t in pending_transfers():
        if error is None:
            t.complete()
        else:
            t.fail(error)
        n += 1
    return n


def wait_handle(handle, timeout: float = DEADLINE_S):
    """``handle.wait()`` with a deadline: returns its result or raises its exception.

    The wait runs on a helper thread; if it does not finish in ``timeout``
    seconds the test fails with AssertionError instead of hanging.
    """
    box: dict[str, Any] = {}
    finished = threading.Event()

    def run():
        try:
            box["value"] = handle.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            finished.set()

    threading.Thread(target=run, daemon=True).start()
    if not finished.wait(timeout):
        raise AssertionError(f"{handle!r} did not finish within {timeout} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---------------------------------------------------------------- PendingCarrier


class PendingCarrier(sw.Carrier):
    """Slots in a Python list; moves to another PendingCarrier stay pending."""


def _supports(c, dtype) -> bool:
    return dtype is sw.DType.Float32 or dtype is sw.DType.Int32 or dtype is sw.DType.Bool


def _physical_size(c) -> int:
    slots = c.__dict__.get("_slots")
    return 0 if slots is None else len(slots)


def _zero(c):
    d = c.dtype()
    return False if d is sw.DType.Bool else (0 if d is sw.DType.Int32 else 0.0)


def _allocate(c, n: int) -> None:
    # Knobs and counters live on the instance; the first allocate (from the
    # constructor) sets them up.
    if "release_calls" not in c.__dict__:
        c.release_calls = 0
        c.released = threading.Event()
        c.prepare_error = None
        c.submit_error = None
        c.read_error = None
        c.unsupported = None
        c.on_release = None
        c.prepare_calls = 0
        c.submit_calls = 0
    c._slots = [_zero(c)] * n


def _release(c) -> None:
    if c.on_release is not None:
        c.on_release(c)
    c.release_calls += 1
    c._slots = None
    c.released.set()


def _read(c, i: int):
    if c.read_error is not None:
        raise c.read_error
    return c._slots[i]


def _write(c, i: int, v) -> None:
    c._slots[i] = v


def _prepare(request):
    src = request.tensor.carrier
    src.prepare_calls += 1
    if src.prepare_error is not None:
        raise src.prepare_error
    if src.unsupported is not None:
        return Unsupported(src.unsupported)

    def submit():
        src.submit_calls += 1
        if src.submit_error is not None:
            raise src.submit_error
        t = Transfer(request)
        with _lock:
            _queue.append(t)
        return t

    return PreparedTransfer(submit)


register_carrier_definition(
    PendingCarrier,
    CarrierDefinition(
        StorageProvider(_supports, _physical_size, _allocate, _release, _read, _write, elementwise_fallback=True),
        transfers=(TransferRoute(PendingCarrier, PendingCarrier, "pending", TransferProvider(_prepare)),),
    ),
)


# ---------------------------------------------------------------- SealedCarrier


class SealedCarrier(sw.Carrier):
    """Slots in a Python list; no routes and no element-wise fallback."""


register_carrier_definition(
    SealedCarrier,
    CarrierDefinition(
        StorageProvider(_supports, _physical_size, _allocate, _release, _read, _write, elementwise_fallback=False)
    ),
)


# ---------------------------------------------------------------- helpers


def _filled(cls, values, dtype, size=None):
    n = len(values) if size is None else size
    c = cls(n, dtype=dtype)
    # Written through the storage, not the public API: the version stays 0.
    for i, v in enumerate(values):
        c._slots[i] = v
    return c


def pending_tensor(values, *, dtype=sw.DType.Float32, layout=None, offset=0, size=None):
    """A Tensor over a fresh PendingCarrier holding ``values`` in its first slots.

    Default layout: dense over ``len(values) - offset`` elements from ``offset``.
    """
    c = _filled(PendingCarrier, values, dtype, size)
    if layout is None:
        layout = sw.column_major(len(values) - offset)
    return sw.Tensor(c, offset, layout)


def sealed_tensor(values, *, dtype=sw.DType.Float32):
    """A dense Tensor over a fresh SealedCarrier (no routes, no fallback)."""
    c = _filled(SealedCarrier, values, dtype)
    return sw.Tensor(c, 0, sw.column_major(len(values)))


def destination(size: int = 0, *, dtype=sw.DType.Float32, mutable: bool = True) -> PendingCarrier:
    """A PendingCarrier move destination (allocatable when ``size == 0``)."""
    return PendingCarrier(size, dtype=dtype, mutable=mutable)
