"""The gloo exchange among real processes: sums agree bitwise, a killed peer aborts the others'
exchange within the timeout, and the survivors re-form a smaller quorum and go on."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("torch")

from resilient_jax.elastic.exchange import ExchangeError, Member, Quorum, make_exchange

TIMEOUT_S = 2.0


def _run(slice_id: int, n: int, to_parent, from_parent) -> None:
    """One member: exchange with everyone, then (if it survives) re-form without slice n-1."""
    exchange = make_exchange("gloo", "127.0.0.1", TIMEOUT_S)
    to_parent.put(("store", slice_id, exchange.store_address))
    stores = from_parent.get()
    quorum = Quorum("q1", tuple(Member(s, 0, stores[s]) for s in range(n)))
    exchange.configure(quorum, slice_id)
    buffer = np.full(1000, 0.1 * (slice_id + 1), np.float32)
    total = exchange.allreduce_sum(buffer)
    root = exchange.broadcast(np.arange(5, dtype=np.int64) * (slice_id + 1), root=1)
    to_parent.put(("sum", slice_id, total.tobytes(), root.tolist()))
    if slice_id == n - 1:
        time.sleep(60)  # the parent kills this one
        return
    start = time.monotonic()
    try:
        exchange.allreduce_sum(buffer)
        outcome = "completed"
    except ExchangeError as e:
        outcome = f"failed: {e}"
    to_parent.put(("dead_peer", slice_id, outcome, time.monotonic() - start))
    smaller = Quorum("q2", quorum.members[:-1])
    exchange.configure(smaller, slice_id)
    total = exchange.allreduce_sum(buffer)
    to_parent.put(("reformed", slice_id, total.tolist()[:3]))
    exchange.close()


def _gather(queues, kind: str, slices) -> dict[int, tuple]:
    """One message of `kind` from each of `slices`, each on its own queue: a process killed
    right after its last message can die holding its queue's write lock, which would block every
    other writer of a shared queue for good."""
    out = {}
    for s in slices:
        message = queues[s].get(timeout=30)
        assert message[0] == kind, message
        out[message[1]] = message[2:]
    return out


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(signal.SIGKILL, id="killed"),
        pytest.param(signal.SIGSTOP, id="hung", marks=pytest.mark.slow),  # waits out the timeout
    ],
)
def test_exchange_sums_aborts_on_a_dead_peer_and_reforms(fault):
    n = 3
    ctx = mp.get_context("spawn")
    to_parent = [ctx.Queue() for _ in range(n)]
    from_parent = [ctx.Queue() for _ in range(n)]
    procs = [ctx.Process(target=_run, args=(s, n, to_parent[s], from_parent[s])) for s in range(n)]
    for p in procs:
        p.start()
    try:
        stores = {s: v[0] for s, v in _gather(to_parent, "store", range(n)).items()}
        for q in from_parent:
            q.put(stores)
        sums = _gather(to_parent, "sum", range(n))
        expected = sum(np.full(1000, 0.1 * (s + 1), np.float32) for s in range(n))
        bits = {v[0] for v in sums.values()}
        assert len(bits) == 1  # the same bits on every member
        np.testing.assert_allclose(np.frombuffer(bits.pop(), np.float32), expected, rtol=1e-6)
        assert all(v[1] == [0, 2, 4, 6, 8] for v in sums.values())  # rank 1's buffer
        os.kill(procs[-1].pid, fault)
        aborted = _gather(to_parent, "dead_peer", range(n - 1))
        for outcome, waited_s in aborted.values():
            assert outcome.startswith("failed"), outcome
            # A killed peer resets its connections (at once); a hung one times out.
            bound = 0.5 if fault == signal.SIGKILL else TIMEOUT_S + 1.0
            assert waited_s < bound, waited_s
            print(f"aborted after {waited_s:.3f} s")
        reformed = _gather(to_parent, "reformed", range(n - 1))
        assert [v[0] for v in reformed.values()] == [pytest.approx([0.3] * 3)] * (n - 1)
    finally:
        if procs[-1].is_alive():
            procs[-1].kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
