"""The extension API under atheris: user carrier kinds whose providers misbehave at every callback.

Two registered kinds (``Src`` with a route to ``Dst``, both with the element-wise fallback) run every storage and
transfer callback through ``behave(name)``, which the fuzz input scripts per input: answer normally, raise (the
provider's own exception, or a built-in), return a value of the wrong type, never complete (a completion whose
``wait()`` blocks until the harness lets it go) or complete twice (``done`` true at once and a ``wait()`` that
may be called again, or a ``done`` that raises). Each input then constructs carriers, reads and writes slots,
moves tensors (to the other kind, to CPU, back), builds a TiledEvictable with a user tier and a scripted residency
policy, and releases everything.

Checked beyond "no crash" (docs/reliability.md, "Coverage-guided fuzzing"):

* every exception is the provider's own or one the API documents (TypeError, ValueError, RuntimeError,
  IndexError, OverflowError, NotImplementedError, MemoryError); a SystemError (an engine InternalError), an
  "unknown C++ exception" or any other type is a finding;
* a pending move is reported pending (``done`` false) while its completion is held, and finishes once it is let
  go: every wait is bounded (DEADLINE_S), a wait that does not end is a finding (the harness never hangs);
* after a move ends, neither carrier is owned by it any more; a move that succeeded with well-behaved callbacks
  holds the source's values.

Run by ``make fuzz`` (``python fuzz/py/extension_fuzz.py [libFuzzer flags] CORPUS...``).
"""

from __future__ import annotations

import os
import sys
import threading

import atheris

with atheris.instrument_imports(include=["strideweave"]):
    import strideweave as sw
    from strideweave.carriers import extension as ext
    from strideweave.carriers.tiled_evictable import ResidencyPlan, TiledEvictable, TileSelection, TileSet

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from pending_carrier import DEADLINE_S, wait_handle  # noqa: E402 - the suite's bounded wait (AssertionError: a hang)

F32, I32 = sw.DType.Float32, sw.DType.Int32
ALLOWED = (TypeError, ValueError, RuntimeError, IndexError, OverflowError, NotImplementedError, MemoryError)
CALLBACKS = ("supports_dtype", "physical_size", "allocate", "release", "read", "write", "prepare", "submit", "wait",
             "done", "plan")
BEHAVIOURS = ("ok", "ok", "ok", "ok", "raise", "builtin", "wrong", "never", "twice")
WRONG = (None, "1", 1.5, 2**70, -1, [1], object(), float("nan"), True, b"x", 2**64, 1j)


class Boom(Exception):
    """The provider's own exception: it must reach the caller unchanged (or as the documented wrapper)."""


class Finding(AssertionError):
    pass


class Script:
    """Per input: what each callback does, and the gates of completions that never complete."""

    def __init__(self, fdp: atheris.FuzzedDataProvider):
        self.fdp = fdp
        self.plan = {name: BEHAVIOURS[fdp.ConsumeIntInRange(0, len(BEHAVIOURS) - 1)] for name in CALLBACKS}
        self.wrong = {name: WRONG[fdp.ConsumeIntInRange(0, len(WRONG) - 1)] for name in CALLBACKS}
        self.gates: list[threading.Event] = []
        self.lock = threading.Lock()

    def misbehaves(self, *names: str) -> bool:
        return any(self.plan[n] != "ok" for n in names)

    def let_go(self) -> None:
        with self.lock:
            for g in self.gates:
                g.set()


SCRIPT: Script | None = None


def behave(name: str):
    """None to go on normally; raises, or returns the ("wrong", value) answer, as scripted."""
    s = SCRIPT
    how = "ok" if s is None else s.plan[name]
    if how == "raise":
        raise Boom(f"{name} refuses")
    if how == "builtin":
        raise KeyError(name)
    if how == "wrong":
        return ("wrong", s.wrong[name])
    return None


# ---------------------------------------------------------------- the providers


def _supports(c, dtype):
    w = behave("supports_dtype")
    return w[1] if w else dtype in (F32, I32)


def _physical_size(c):
    w = behave("physical_size")
    if w:
        return w[1]
    s = c.__dict__.get("_slots")
    return 0 if s is None else len(s)


def _allocate(c, n):
    w = behave("allocate")
    c._slots = [0.0 if c.dtype() is F32 else 0] * n
    return w[1] if w else None


def _release(c):
    w = behave("release")
    c._slots = None
    return w[1] if w else None


def _read(c, i):
    w = behave("read")
    return w[1] if w else c._slots[i]


def _write(c, i, v):
    w = behave("write")
    c._slots[i] = v
    return w[1] if w else None


class Completion:
    """What submit() returns: done/wait, scripted."""

    def __init__(self, request, copy):
        self.request = request
        self.copy = copy
        self.gate = threading.Event()
        self.waits = 0
        s = SCRIPT
        if s is not None and s.plan["wait"] == "never":
            with s.lock:
                s.gates.append(self.gate)
        else:
            self.gate.set()

    @property
    def done(self):
        w = behave("done")
        if w:
            return w[1]
        return self.gate.is_set() and self.waits > 0

    def wait(self):
        self.waits += 1
        if not self.gate.wait(DEADLINE_S):
            raise Finding("a never-completing transfer was never let go")
        if self.waits == 1:
            self.copy()
        s = SCRIPT
        if s is not None and s.plan["wait"] == "twice":
            self.copy()  # completes again: writes the destination a second time
        w = behave("wait")
        return w[1] if w else None


def _prepare(request):
    w = behave("prepare")
    if w:
        return w[1]
    if SCRIPT is not None and SCRIPT.plan["prepare"] == "never":
        return ext.Unsupported("not this one")

    def copy():
        t, dst, layout = request.tensor, request.destination, request.layout
        for i in range(layout.size):
            off = layout(i)
            dst[off] = t.carrier[t.offset + off]

    def submit():
        w = behave("submit")
        if w:
            return w[1]
        s = SCRIPT
        if s is not None and s.plan["submit"] == "twice":
            copy()
            return None  # done at once (and the completion below is never asked)
        return Completion(request, copy)

    return ext.PreparedTransfer(submit)


def _instrument_this_module() -> None:
    """Coverage of the harness and providers themselves (which callbacks ran, which branches of each behaviour):
    the extension is not built with coverage, so this is most of the feedback atheris gets. In place: the
    providers registered below are these same function objects."""
    import inspect

    for f in list(globals().values()):
        if inspect.isfunction(f) and f.__module__ == __name__:
            atheris.instrument_func(f)
        elif inspect.isclass(f) and f.__module__ == __name__:
            for g in vars(f).values():
                if inspect.isfunction(g):
                    atheris.instrument_func(g)


def _storage():
    return ext.StorageProvider(_supports, _physical_size, _allocate, _release, _read, _write, elementwise_fallback=True)


class Src(sw.Carrier):
    pass


class Dst(sw.Carrier):
    pass


ext.register_carrier_definition(Src, ext.CarrierDefinition(_storage(), transfers=(
    ext.TransferRoute(Src, Dst, "src->dst", ext.TransferProvider(_prepare)),)))
ext.register_carrier_definition(Dst, ext.CarrierDefinition(_storage(), transfers=(
    ext.TransferRoute(Dst, Src, "dst->src", ext.TransferProvider(_prepare)),)))


class Policy:
    def __init__(self, fdp):
        self.tiles = [(fdp.ConsumeIntInRange(0, 3),) for _ in range(fdp.ConsumeIntInRange(0, 3))]

    def plan(self, required, purpose):
        w = behave("plan")
        if w:
            return w[1]
        return ResidencyPlan(promote=TileSet([t for t in self.tiles if t not in required.coordinates][:1]))


# ---------------------------------------------------------------- the harness


def expected(e: BaseException) -> bool:
    if isinstance(e, Finding):
        raise e
    if isinstance(e, (Boom, KeyError)):
        return True
    if isinstance(e, SystemError) or "unknown C++ exception" in str(e):
        return False
    return isinstance(e, ALLOWED)


def attempt(what, fn, *args, **kwargs):
    try:
        return True, fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - classified below
        if not expected(e):
            raise Finding(f"{what}: undocumented {type(e).__name__}: {e}") from e
        return False, e


def new_carrier(fdp, cls):
    n = fdp.ConsumeIntInRange(0, 6)
    dtype = F32 if fdp.ConsumeBool() else I32
    ok, c = attempt("construct", cls, n, dtype=dtype)
    return c if ok else None


def size_of(c) -> int:
    ok, n = attempt("size", c.size)
    if ok and (not isinstance(n, int) or n < 0):
        raise Finding(f"size() returned {n!r}")
    return n if ok else 0


def fill(c, fdp):
    for i in range(size_of(c)):
        attempt("write", c.__setitem__, i, fdp.ConsumeIntInRange(-5, 5))


def move(fdp, s: Script, src, dest_cls):
    n = size_of(src)
    if n == 0:
        return
    before = [src._slots[i] for i in range(n)] if src._slots is not None else None
    ok, dest = attempt("construct", dest_cls, 0, dtype=src.dtype())
    if not ok:
        return
    ok, handle = attempt("move_async", sw.move_async, sw.Tensor(src, 0, sw.column_major(n)), dest)
    if not ok:
        if src.is_owned() or dest.is_owned():
            raise Finding("a refused move left a carrier owned")
        return
    with s.lock:
        held = any(not g.is_set() for g in s.gates)  # a submitted completion the harness still holds
    if held and s.plan["done"] == "ok" and handle.done:
        raise Finding("a move whose transfer never completed is reported done")
    s.let_go()
    ok, result = attempt("wait", wait_handle, handle)
    if src.is_owned() or dest.is_owned():
        raise Finding("a move that ended left a carrier owned")
    if ok and before is not None and not s.misbehaves("read", "write", "wait", "done", "submit", "prepare",
                                                        "physical_size", "supports_dtype", "allocate"):
        got = [result[i] for i in range(n)]
        if got != before:
            raise Finding(f"moved values {got} != {before}")


def tiled(fdp, s: Script):
    tiles = fdp.ConsumeIntInRange(1, 3)
    ok, secondary = attempt("construct", Src, 2 * tiles, dtype=F32)
    if not ok:
        return
    fill(secondary, fdp)
    ok, te = attempt("TiledEvictable", lambda: TiledEvictable(sw.CPU(0), secondary, (tiles,), (2,),
                                                                residency_policy=Policy(fdp)))
    if not ok:
        return
    full = sw.Tensor(te, 0, sw.column_major(2 * tiles))
    for _ in range(fdp.ConsumeIntInRange(1, 3)):
        op = fdp.ConsumeIntInRange(0, 4)
        tile = fdp.ConsumeIntInRange(0, tiles - 1)
        if op == 0:
            ok, h = attempt("project", te.project, full, TileSelection([[tile]]))
        elif op == 1:
            ok, h = attempt("promote_async", te.promote_async, TileSet([(tile,)]))
        elif op == 2:
            ok, h = attempt("evict_async", te.evict_async, TileSet([(tile,)]))  # a dirty tile: the tier's write
        elif op == 3:
            ok, h = attempt("slot write", te.__setitem__, 2 * tile, 1.5)  # promotes the tile and dirties it
            ok = False
        else:
            ok, h = attempt("flush_async", te.flush_async)
        if ok:
            attempt("wait", wait_handle, h)
    attempt("release", te.release)


def one_input(data: bytes) -> None:
    global SCRIPT
    fdp = atheris.FuzzedDataProvider(data)
    s = SCRIPT = Script(fdp)
    try:
        for _ in range(fdp.ConsumeIntInRange(1, 4)):
            step = fdp.ConsumeIntInRange(0, 3)
            if step == 3:
                tiled(fdp, s)
                continue
            src = new_carrier(fdp, Src if fdp.ConsumeBool() else Dst)
            if src is None:
                continue
            fill(src, fdp)
            if step == 0 and size_of(src):
                attempt("read", src.__getitem__, fdp.ConsumeIntInRange(-1, size_of(src)))
            else:
                move(fdp, s, src, (Dst, sw.CPU, Src)[fdp.ConsumeIntInRange(0, 2)] if type(src) is Src else
                     (Src, sw.CPU, Dst)[fdp.ConsumeIntInRange(0, 2)])
            if not src.is_owned():
                attempt("release", src.release)
    finally:
        s.let_go()
        SCRIPT = None


def main() -> None:
    _instrument_this_module()
    # libFuzzer reruns argv[0] (joined with its flags, through the shell) for -merge=1 and -fork: name this script
    # with the interpreter running it, so the virtual environment's Python is the one rerun.
    atheris.Setup([f"{sys.executable} {os.path.abspath(__file__)}"] + sys.argv[1:], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
