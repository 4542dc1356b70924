"""The one agreement primitive among a runtime's processes (`resilient_jax.agreement`), on an
in-memory stand-in for the coordination service's key-value store: what the checkpoint tiers and
an elastic slice of several processes both rely on."""

from __future__ import annotations

import time

import pytest
from conftest import MemoryKeyValueStore, in_threads

from resilient_jax.agreement import Agreement


class Silent(RuntimeError):
    pass


def _silent(process: int, what: str, seconds: float, detail: str) -> Silent:
    return Silent(f"process {process} silent on {what} for {seconds:.1f} s: {detail}")


def _group(count: int, timeout_s: float = 5.0) -> tuple[MemoryKeyValueStore, list[Agreement]]:
    store = MemoryKeyValueStore()
    return store, [Agreement(store, p, count, "ns", timeout_s, _silent) for p in range(count)]


def test_every_process_gets_every_value_in_process_order_and_keys_go_two_rounds_later():
    store, group = _group(3)
    for _ in range(3):
        results = in_threads(*(lambda a=a: a.all_gather("step", [a.process_index]) for a in group))
        assert results == [[[0], [1], [2]]] * 3
    # Round 1's keys were deleted at round 3; rounds 2 and 3 remain until rounds 4 and 5.
    assert sorted(store.values) == [f"ns/step/{r}/{p}" for r in (2, 3) for p in range(3)]


def test_share_gives_process_0s_value_and_agree_is_true_only_when_all_are():
    _, group = _group(2)
    shared = in_threads(lambda: group[0].share("q", "answer"), lambda: group[1].share("q", None))
    assert shared == ["answer", "answer"]
    votes = in_threads(lambda: group[0].agree("ok", True), lambda: group[1].agree("ok", False))
    assert votes == [False, False]
    votes = in_threads(lambda: group[0].agree("ok", True), lambda: group[1].agree("ok", True))
    assert votes == [True, True]


def test_a_silent_peer_is_the_callers_exception_within_the_bound():
    _, group = _group(2, timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(Silent, match=r"process 0 silent on q \(round 1\) for 0.2 s: DEADLINE"):
        group[1].share("q", None)
    assert time.monotonic() - started < 2.0


def test_published_values_are_fetched_by_key_and_one_process_needs_no_store():
    store, group = _group(2)
    group[0].publish("plan", {"step": 7})
    assert group[1].fetch("plan") == {"step": 7}
    group[0].delete("plan")
    assert store.values == {}
    alone = Agreement(None, 0, 1, "ns", 1.0, _silent)
    assert not alone.distributed
    assert alone.all_gather("x", 3) == [3] and alone.share("x", 4) == 4 and alone.agree("x", True)
