"""Tiled gradient accumulation stays tiled (Note [Tiled gradient accumulation]).

A leaf over a TiledEvictable receives one fresh tiled gradient per projection
node. Accumulating into its ``.grad`` is tile by tile: implicit + implicit stays
implicit, no dense full-size temporary, and (while nothing else holds the
``.grad``) in place, so a batch that touches one expert costs one tile, not the
full extent. Gradient sums never consult the residency policy, which the
gradient carriers share with the weight (allocate_like keeps it).
"""

from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest

import strideweave as sw
from strideweave import friendly
from strideweave.carriers.tiled_evictable import TiledEvictable, TileSelection, TileSet
from strideweave.policies import LRUPolicy
from waiting import held

OUT, IN, E = 4, 3, 6


def expert_weight(rng, policy=None):
    w = rng.standard_normal((OUT, IN * E)).astype(np.float32)  # (out, in * expert), expert-last
    on_file = sw.move(friendly.tensor(w), sw.FileBacked())
    c = TiledEvictable(sw.CPU(0), on_file.carrier, (1, E), (OUT, IN), residency_policy=policy)
    full = sw.Tensor(c, 0, sw.Layout(sw.Shape(OUT, [IN, E]), sw.Stride(1, [OUT, OUT * IN])))
    return w, c, full


def expert_of(w, e):
    return w[:, IN * e:IN * (e + 1)]


def backward_through(c, full, e, seed):
    """Projects expert e and backpropagates `seed` (OUT, IN) through a matmul with the identity."""
    compact = c.project(full, TileSelection([[0], [e]])).wait()
    out = sw.mul(compact, 1.0)
    out.backward(friendly.tensor(seed))


def grad_values(full):
    g = full.grad
    with sw.no_grad():
        compact = g.carrier.project(g, TileSelection([[0], list(range(E))])).wait()
    return np.array(np.asarray(compact), copy=True)


def locations(full):
    g = full.grad.carrier
    return [g.tile_state((0, e)).location for e in range(E)]


@pytest.fixture
def rng():
    return np.random.default_rng(20250307)


def test_accumulation_is_in_place_and_tile_wise(rng):
    w, c, full = expert_weight(rng)
    s1, s2, s3 = (rng.standard_normal((OUT, IN)).astype(np.float32) for _ in range(3))
    backward_through(c, full, 1, s1)
    version = full.grad.carrier.version  # holding the carrier would make the next sums fresh (see below)
    backward_through(c, full, 4, s2)
    backward_through(c, full, 1, s3)
    # The same gradient carrier, advanced once per accumulation (a fresh sum would start again at 1).
    assert version == 1 and full.grad.carrier.version == version + 2
    want = np.zeros((OUT, IN * E), np.float32)
    want[:, IN:2 * IN] = s1 + s3
    want[:, 4 * IN:5 * IN] = s2
    np.testing.assert_array_equal(grad_values(full), want)
    assert locations(full) == ["implicit", "primary", "implicit", "implicit", "primary", "implicit"]


def test_a_held_gradient_is_never_mutated(rng):
    w, c, full = expert_weight(rng)
    s1, s2 = (rng.standard_normal((OUT, IN)).astype(np.float32) for _ in range(2))
    backward_through(c, full, 2, s1)
    held = full.grad
    before = grad_values(full)
    backward_through(c, full, 2, s2)
    assert full.grad is not held  # a fresh, tile-wise sum: the held tensor keeps its value
    np.testing.assert_array_equal(grad_values_of(held), before)
    np.testing.assert_allclose(grad_values(full)[:, 2 * IN:3 * IN], s1 + s2, rtol=1e-6)
    assert locations(full) == ["implicit", "implicit", "primary", "implicit", "implicit", "implicit"]


def grad_values_of(t):
    with sw.no_grad():
        compact = t.carrier.project(t, TileSelection([[0], list(range(E))])).wait()
    return np.array(np.asarray(compact), copy=True)


def test_an_evicted_gradient_tile_is_promoted_and_added(rng):
    w, c, full = expert_weight(rng)
    s1, s2 = (rng.standard_normal((OUT, IN)).astype(np.float32) for _ in range(2))
    backward_through(c, full, 3, s1)
    full.grad.carrier.evict(TileSet([(0, 3)]))
    stats = full.grad.carrier.stats()
    assert stats["bytes_evicted"] == OUT * IN * 4  # a dirty gradient tile is written
    backward_through(c, full, 3, s2)
    assert full.grad.carrier.stats()["promotions"] == stats["promotions"] + 1
    assert full.grad.carrier.tile_state((0, 3)).dirty
    np.testing.assert_allclose(grad_values(full)[:, 3 * IN:4 * IN], s1 + s2, rtol=1e-6)


def test_gradient_sums_leave_the_weight_policy_alone(rng):
    policy = LRUPolicy(3)
    w, c, full = expert_weight(rng, policy)
    for e in (0, 1, 2, 0, 1):
        backward_through(c, full, e, np.ones((OUT, IN), np.float32))
    # Only the weight's projections drove the LRU: nothing was evicted, three experts are resident.
    assert set(c.primary_tiles.coordinates) == {(0, 0), (0, 1), (0, 2)}
    assert c.stats()["evictions"] == 0
    want = np.zeros((OUT, IN * E), np.float32)
    want[:, :2 * IN] = 2.0
    want[:, 2 * IN:3 * IN] = 1.0
    np.testing.assert_array_equal(grad_values(full), want)


def test_two_consumers_of_a_scatter_result_sum_tile_wise(rng):
    w, c, full = expert_weight(rng)
    compact = friendly.tensor(rng.standard_normal((OUT, 2 * IN)).astype(np.float32))
    sel = TileSelection([[0], [1, 5]])
    scattered = c.scatter(compact, full, sel).wait()
    sc = scattered.carrier
    a = sc.project(scattered, TileSelection([[0], [1]])).wait()
    b = sc.project(scattered, TileSelection([[0], [1, 5]])).wait()
    loss = sw.add(sw.reduce_sum(a, "o i ->"), sw.reduce_sum(b, "o i ->"))
    loss.backward()
    want = np.ones((OUT, 2 * IN), np.float32)
    want[:, :IN] = 2.0  # expert 1 is read by both projections
    np.testing.assert_array_equal(np.asarray(compact.grad), want)


# ---- Note [Gradient sinks]: a matmul's weight gradient added straight into the resident .grad tile


def matmul_step(c, full, e, x, seed):
    """y = x @ W_e^T (tokens x out) for expert e, backpropagating `seed`; returns the projected W_e."""
    compact = c.project(full, TileSelection([[0], [e]])).wait()
    y = sw.matmul(friendly.tensor(x), compact)
    y.backward(friendly.tensor(seed))
    return compact


@pytest.mark.parametrize("tokens", [1, 5, 40], ids=["one-token", "few-tokens", "many-tokens"])
def test_matmul_gradient_adds_into_the_resident_gradient_tile(rng, tokens):
    w, c, full = expert_weight(rng)
    xs = [rng.standard_normal((tokens, IN)).astype(np.float32) for _ in range(4)]
    gs = [rng.standard_normal((tokens, OUT)).astype(np.float32) for _ in range(4)]
    matmul_step(c, full, 2, xs[0], gs[0])  # creates .grad: expert 2's tile holds the first gradient
    # (Holding the gradient or its carrier would make the next sums fresh: only versions are kept here.)
    assert full.grad.carrier.version == 1
    assert full.grad.carrier.tile_state((0, 2)).location == "primary"
    matmul_step(c, full, 2, xs[1], gs[1])  # resident .grad tile, nothing else holds .grad: added in place
    matmul_step(c, full, 4, xs[2], gs[2])  # an implicit tile: takes the fresh gradient
    matmul_step(c, full, 2, xs[3], gs[3])
    assert full.grad.carrier.version == 4  # the same carrier, advanced once per step (a fresh sum restarts at 1)
    grad_carrier = full.grad.carrier
    expected = np.zeros((OUT, IN * E), np.float32)
    for (e, x, g) in [(2, xs[0], gs[0]), (2, xs[1], gs[1]), (4, xs[2], gs[2]), (2, xs[3], gs[3])]:
        expected[:, IN * e:IN * (e + 1)] += g.T.astype(np.float64) @ x.astype(np.float64)
    np.testing.assert_allclose(grad_values(full), expected, rtol=1e-5, atol=1e-5)
    assert locations(full) == ["implicit", "implicit", "primary", "implicit", "primary", "implicit"]
    state = grad_carrier.tile_state((0, 2))
    assert state.valid and state.dirty
    # The in-place update marked the tile dirty: evicting writes it, promoting reads it back unchanged.
    grad_carrier.evict(TileSet([(0, 2)]))
    assert grad_carrier.tile_state((0, 2)).location == "secondary"
    np.testing.assert_allclose(grad_values(full), expected, rtol=1e-5, atol=1e-5)


def test_a_projection_of_the_gradient_keeps_its_values_when_a_sink_adds_into_the_tile(rng):
    """A one-tile projection of .grad shares the tile (Note [Shared snapshots]); the next matmul's sink adds into
    the tile in place, which first gives the tile memory of its own."""
    w, c, full = expert_weight(rng)
    x0, x1 = (rng.standard_normal((5, IN)).astype(np.float32) for _ in range(2))
    g0, g1 = (rng.standard_normal((5, OUT)).astype(np.float32) for _ in range(2))
    matmul_step(c, full, 2, x0, g0)
    with sw.no_grad():
        snap = full.grad.carrier.project(full.grad, TileSelection([[0], [2]])).wait()
    first = g0.T.astype(np.float64) @ x0.astype(np.float64)
    values = lambda t: np.array([t.carrier[k] for k in range(t.size())]).reshape(OUT, IN, order="F")  # noqa: E731
    np.testing.assert_allclose(values(snap), first, rtol=1e-5, atol=1e-5)
    matmul_step(c, full, 2, x1, g1)
    assert full.grad.carrier.version == 2  # added in place (a fresh sum would restart at 1)
    np.testing.assert_allclose(values(snap), first, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(expert_of(grad_values(full), 2), first + g1.T.astype(np.float64) @ x1,
                               rtol=1e-5, atol=1e-5)


def test_matmul_gradient_leaves_a_held_gradient_alone(rng):
    w, c, full = expert_weight(rng)
    x = rng.standard_normal((3, IN)).astype(np.float32)
    g = rng.standard_normal((3, OUT)).astype(np.float32)
    matmul_step(c, full, 1, x, g)
    held = full.grad
    before = grad_values(full)
    matmul_step(c, full, 1, x, g)  # .grad is held from Python: a new gradient, the held one unchanged
    assert full.grad is not held and full.grad.carrier is not held.carrier
    with sw.no_grad():
        held_now = np.asarray(held.carrier.project(held, TileSelection([[0], list(range(E))])).wait())
    np.testing.assert_array_equal(held_now, before)
    np.testing.assert_allclose(grad_values(full), 2 * before, rtol=1e-6, atol=1e-6)


def test_matmul_gradient_through_a_retained_projection_is_not_sunk(rng):
    w, c, full = expert_weight(rng)
    x = rng.standard_normal((3, IN)).astype(np.float32)
    g = rng.standard_normal((3, OUT)).astype(np.float32)
    matmul_step(c, full, 0, x, g)
    compact = c.project(full, TileSelection([[0], [0]])).wait()
    compact.retain_grad()  # the projection's output keeps its own gradient: it must see the contribution
    sw.matmul(friendly.tensor(x), compact).backward(friendly.tensor(g))
    one = g.T.astype(np.float64) @ x.astype(np.float64)
    np.testing.assert_allclose(np.asarray(compact.grad), one, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_values(full)[:, :IN], 2 * one, rtol=1e-5, atol=1e-5)


# ---- Note [Requests' own references]: a gradient sum meets residency requests of other tiles


@pytest.mark.parametrize("op", ["pwrite", "pread"], ids=["eviction-under-way", "read-back-under-way"])
@pytest.mark.parametrize("step", ["sum", "matmul-sink"])
def test_a_gradient_adds_in_place_while_another_tile_is_in_transfer(rng, held_io, op, step):
    w, c, full = expert_weight(rng)
    x = [rng.standard_normal((5, IN)).astype(np.float32) for _ in range(3)]
    g = [rng.standard_normal((5, OUT)).astype(np.float32) for _ in range(3)]

    def contribution(e, k):  # one step into expert e; returns the dense gradient it adds
        if step == "sum":
            seed = g[k].T @ x[k]
            backward_through(c, full, e, seed)
            return seed.astype(np.float64)
        matmul_step(c, full, e, x[k], g[k])
        return g[k].T.astype(np.float64) @ x[k].astype(np.float64)

    want = np.zeros((OUT, IN * E))
    want[:, IN:2 * IN] += contribution(1, 0)
    want[:, 3 * IN:4 * IN] += contribution(3, 1)
    if op == "pread":  # tile 3 is written out first, so that the request under way reads it back
        full.grad.carrier.evict(TileSet([(0, 3)]))
    version = full.grad.carrier.version
    held_io._io_hold(op)
    # The handle holds no reference to the gradient carrier; its request does, until its transfer ends.
    if op == "pwrite":
        pending = full.grad.carrier.evict_async(TileSet([(0, 3)]))
    else:
        pending = full.grad.carrier.promote_async(TileSet([(0, 3)]))
    assert pending.done is False
    want[:, IN:2 * IN] += contribution(1, 2)  # tile 1 is under no request: added in place, nothing waited for
    assert pending.done is False  # the sum neither waited for nor joined the transfer
    assert full.grad.carrier.version == version + 1  # the same carrier (a fresh sum would restart at 1)
    assert full.grad.carrier.tile_state((0, 1)).dirty
    held_io._io_unhold()
    pending.wait()
    assert full.grad.carrier.tile_state((0, 3)).location == ("secondary" if op == "pwrite" else "primary")
    np.testing.assert_allclose(grad_values(full), want, rtol=1e-5, atol=1e-5)


def test_a_gradient_tile_under_a_request_is_never_added_into(rng, held_io):
    w, c, full = expert_weight(rng)
    s1, s2 = (rng.standard_normal((OUT, IN)).astype(np.float32) for _ in range(2))
    backward_through(c, full, 3, s1)
    held_io._io_hold("pwrite")
    pending = full.grad.carrier.evict_async(TileSet([(0, 3)]))
    version = full.grad.carrier.version
    with pytest.raises(RuntimeError, match="incomplete residency request"):
        backward_through(c, full, 3, s2)  # the tile being written out: neither added into nor read
    assert full.grad.carrier.version == version
    held_io._io_unhold()
    pending.wait()
    assert full.grad.carrier.tile_state((0, 3)).location == "secondary"
    np.testing.assert_array_equal(expert_of(grad_values(full), 3), s1)  # what was written is the first gradient


def test_a_held_gradient_with_a_request_under_way_is_not_mutated(rng, held_io):
    w, c, full = expert_weight(rng)
    s1, s2 = (rng.standard_normal((OUT, IN)).astype(np.float32) for _ in range(2))
    backward_through(c, full, 1, s1)
    backward_through(c, full, 3, s1)
    held = full.grad  # a reference from Python besides the request's own: sums must not touch this carrier
    held_io._io_hold("pwrite")
    pending = held.carrier.evict_async(TileSet([(0, 3)]))
    before = held.carrier.version
    with pytest.raises(RuntimeError, match="incomplete residency request"):
        backward_through(c, full, 1, s2)  # a fresh sum reads every tile of the held one, tile 3 included
    assert held.carrier.version == before and full.grad is held
    held_io._io_unhold()
    pending.wait()
    backward_through(c, full, 1, s2)
    assert full.grad is not held
    np.testing.assert_array_equal(expert_of(grad_values_of(held), 1), s1)
    np.testing.assert_allclose(expert_of(grad_values(full), 1), s1 + s2, rtol=1e-6)


# ---- Note [Gradient sums hold their tiles]: another thread moves the gradient's tiles while backward adds into them


def test_backward_holds_the_gradient_tiles_it_adds_into(rng, held_io):
    """The sum is paused in the middle (the read-back of its evicted tile waits at the pread gate): the resident
    tile it adds into and the tile it reads back refuse every request meanwhile; the sum then lands whole."""
    w, c, full = expert_weight(rng)
    one = np.ones((OUT, IN), np.float32)
    backward_through(c, full, 1, one)
    backward_through(c, full, 3, one)
    full.grad.carrier.evict(TileSet([(0, 1)]))  # read back by the next sum
    version = full.grad.carrier.version
    compact = c.project(full, TileSelection([[0], [1, 3]])).wait()  # the weight's tiles are resident: no pread
    out = sw.mul(compact, 1.0)
    seed = friendly.tensor(np.full((OUT, 2 * IN), 2.0, np.float32))
    held_io._io_hold("pread")
    errors = []

    def run():
        try:
            out.backward(seed)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    held("pread")  # the sum is reading its evicted tile back
    g = full.grad.carrier  # a reference taken while the sum runs, as another thread would
    states = [g.tile_state((0, e)) for e in range(E)]
    with pytest.raises(RuntimeError, match="being added into by a gradient sum.*wait"):
        g.evict_async(TileSet([(0, 3)]))
    limit = sw.turn_wait_limit()
    sw.set_turn_wait_limit(0.05)  # the blocking form waits in turn (Note [Taking turns]), then refuses
    try:
        with pytest.raises(RuntimeError, match=r"waited 0.05 s for tile \(0, 3\).*holds \(a gradient sum"):
            g.evict(TileSet([(0, 3)]))
    finally:
        sw.set_turn_wait_limit(limit)
    with pytest.raises(RuntimeError, match="wait"):
        g.promote_async(TileSet([(0, 1)]))
    with pytest.raises(RuntimeError, match="wait"):
        g[4 * IN * 3]  # a slot of tile (0, 3)
    with pytest.raises(RuntimeError, match="wait"):
        g.project(full.grad, TileSelection([[0], [3]]))
    with pytest.raises(RuntimeError, match="wait"):
        g.release()
    assert [g.tile_state((0, e)) for e in range(E)] == states and g.version == version
    del g
    held_io._io_unhold()
    t.join(30)
    assert not t.is_alive() and not errors, errors
    assert full.grad.carrier.version == version + 1  # added in place, once
    want = np.zeros((OUT, IN * E), np.float32)
    want[:, IN:2 * IN] = 3.0
    want[:, 3 * IN:4 * IN] = 3.0
    np.testing.assert_array_equal(grad_values(full), want)
    assert [s.location for s in map(full.grad.carrier.tile_state, [(0, 1), (0, 3)])] == ["primary", "primary"]
    assert full.grad.carrier.tile_state((0, 1)).dirty


STRESS_SEED = int(os.environ.get("SW_STRESS_SEED", "20251201"))
STRESS_STEPS = max(1, int(float(os.environ.get("SW_STRESS_ROUNDS", "1")) * 1500))


@pytest.mark.parametrize("step", ["sum", "matmul-sink", "two-tiles"])
def test_backward_lands_whole_while_another_thread_moves_the_gradient_tiles(step):
    """One thread loops backward into experts 1 and 3 (a tile-wise sum, a matmul adding into the resident .grad
    tile, or one projection of both tiles); another loops evict/promote on the .grad's tiles, taking a fresh
    reference each time. Every backward either lands whole or refuses with 'wait' and changes nothing: each
    element ends exactly at (landed steps) x (one step's contribution), which is exact in Float32."""
    seed = STRESS_SEED + ["sum", "matmul-sink", "two-tiles"].index(step)
    print(f"stress seed {seed} (SW_STRESS_SEED replays it), at least {STRESS_STEPS} backward steps")
    pick = random.Random(seed)
    # Tiles of 48 KiB (a real expert's are MiBs): the time a sum spends writing a tile is what a move can hit.
    out_, in_, experts_ = 128, 96, 4
    values = np.random.default_rng(seed).standard_normal((out_, in_ * experts_)).astype(np.float32)
    on_file = sw.move(friendly.tensor(values), sw.FileBacked())
    c = TiledEvictable(sw.CPU(0), on_file.carrier, (1, experts_), (out_, in_))
    full = sw.Tensor(c, 0, sw.Layout(sw.Shape(out_, [in_, experts_]), sw.Stride(1, [out_, out_ * in_])))
    tokens = 2
    x = friendly.tensor(np.ones((tokens, in_), np.float32))
    graphs = {}  # expert(s) -> (output, seed): each step reruns one retained graph
    for e in (1, 3):
        compact = c.project(full, TileSelection([[0], [e]])).wait()
        if step == "matmul-sink":  # d W_e = seed^T x = tokens everywhere, added into the .grad tile in place
            graphs[(e,)] = (sw.matmul(x, compact), friendly.tensor(np.ones((tokens, out_), np.float32)))
        else:
            graphs[(e,)] = (sw.mul(compact, 1.0), friendly.tensor(np.full((out_, in_), 2.0, np.float32)))
    both = c.project(full, TileSelection([[0], [1, 3]])).wait()
    graphs[(1, 3)] = (sw.mul(both, 1.0), friendly.tensor(np.full((out_, 2 * in_), 2.0, np.float32)))
    per_step = float(tokens) if step == "matmul-sink" else 2.0
    landed = {1: 0, 3: 0}
    refused = {"backward": 0, "residency": 0}
    moves = [0]
    done = threading.Event()
    started = threading.Barrier(2)
    errors = []
    deadline = time.monotonic() + 60

    def backward_loop():
        try:
            started.wait()
            steps = 0
            # At least STRESS_STEPS steps, and on until the other thread has made as many requests (bounded).
            while steps < STRESS_STEPS or (moves[0] < STRESS_STEPS and time.monotonic() < deadline):
                steps += 1
                experts = (1, 3) if step == "two-tiles" else (pick.choice((1, 3)),)
                out, s = graphs[experts]
                try:
                    out.backward(s, retain_graph=True)
                except RuntimeError as e:
                    if "wait" not in str(e):
                        raise
                    refused["backward"] += 1
                    continue
                for e in experts:
                    landed[e] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            done.set()

    def residency_loop():
        r = random.Random(seed + 1)
        try:
            started.wait()
            while not done.is_set():
                tiles = TileSet(r.sample([(0, 1), (0, 3), (0, 0)], r.randint(1, 3)))
                try:
                    g = full.grad
                    if g is None:
                        continue
                    if r.random() < 0.5:
                        g.carrier.evict(tiles)
                    else:
                        g.carrier.promote(tiles)
                    del g
                    moves[0] += 1
                except RuntimeError as e:
                    if "wait" not in str(e):
                        raise
                    refused["residency"] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=f, daemon=True) for f in (backward_loop, residency_loop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "hang"
    assert not errors, errors
    print(f"landed {landed}, refused {refused}, {moves[0]} residency requests")
    assert landed[1] + landed[3] > 0 and moves[0] > 0
    want = np.zeros((out_, in_ * experts_), np.float32)
    want[:, in_:2 * in_] = per_step * landed[1]
    want[:, 3 * in_:4 * in_] = per_step * landed[3]

    def values_of_grad():
        g = full.grad
        with sw.no_grad():
            return np.asarray(g.carrier.project(g, TileSelection([[0], list(range(experts_))])).wait())

    np.testing.assert_array_equal(values_of_grad(), want)
    # Nothing is left held: every tile moves out and back.
    g = full.grad.carrier
    g.evict(TileSet([(0, e) for e in range(experts_)]))
    g.promote(TileSet([(0, e) for e in range(experts_)]))
    assert g.stats()["primary_tiles"] == experts_
    del g
    np.testing.assert_array_equal(values_of_grad(), want)


# ---- Note [A released gradient]


def test_backward_into_a_released_gradient_names_the_gradient(rng):
    w, c, full = expert_weight(rng)
    one = np.ones((OUT, IN), np.float32)
    backward_through(c, full, 1, one)
    released = full.grad
    released.carrier.release()
    b = friendly.tensor(np.full((OUT, IN), 3.0, np.float32))  # a second leaf, reached first
    b.grad = friendly.tensor(np.full((OUT, IN), 5.0, np.float32))
    b_grad, b_version = b.grad, b.grad.carrier.version
    compact = c.project(full, TileSelection([[0], [2]])).wait()
    out = sw.elementwise_mul(compact, b)
    stats, version = c.stats(), c.version
    for attempt in (lambda: out.backward(friendly.tensor(one), retain_graph=True),
                    lambda: full.backward(full)):  # the leaf itself as the root
        with pytest.raises(RuntimeError, match=r"the gradient of a TiledEvictable tensor of shape .* was released") as e:
            attempt()
        assert "cannot project" not in str(e.value)
        # Nothing changed: neither leaf's gradient, nor the weight.
        assert full.grad is released and b.grad is b_grad and b.grad.carrier.version == b_version
        np.testing.assert_array_equal(np.asarray(b.grad), np.full((OUT, IN), 5.0, np.float32))
        assert c.stats() == stats and c.version == version
    # A fresh gradient once .grad is cleared.
    full.grad = None
    out.backward(friendly.tensor(one))
    np.testing.assert_array_equal(expert_of(grad_values(full), 2), 3.0 * one)


def test_backward_into_a_released_cpu_gradient_names_the_gradient():
    a = friendly.tensor(np.ones(3, np.float32))
    a.grad = friendly.tensor(np.ones(3, np.float32))
    a.grad.carrier.release()
    y = sw.mul(a, 2.0)
    with pytest.raises(RuntimeError, match=r"the gradient of a CPU tensor of shape .* was released"):
        y.backward(friendly.tensor(np.ones(3, np.float32)))
