"""Slices of several processes in elastic mode, the parts that need no second process: the
supervisor's bookkeeping of a slice's processes (lost with any of them, done with all of them),
their records for a takeover, the processes of a slice acting as one member (a quorum shared,
every exchange agreed on), and the state as this process's pieces of it."""

from __future__ import annotations

import os
import signal

import jax
import numpy as np
import pytest
from conftest import MemoryKeyValueStore, assert_bitwise, in_threads, run_context, tiny_config

from resilient_jax.control import elastic_state
from resilient_jax.control.elastic_slice import SliceProcesses, output_file, runtime_env


class _Member:
    """A slice's process as an agent reports it (`hosts.RemoteWorker`'s interface)."""

    def __init__(self, pid: int, exit_code: int | None = None) -> None:
        self.pid, self.exit_code, self.slice, self.host = pid, exit_code, 3, "host3"
        self.signals: list[tuple[int, bool]] = []

    def poll(self) -> int | None:
        return self.exit_code

    def signal(self, signum: int, group: bool = False) -> None:
        self.signals.append((signum, group))
        if signum == signal.SIGKILL and self.exit_code is None:
            self.exit_code = -signal.SIGKILL  # as its agent reports it

    def wait(self, timeout: float) -> None:
        pass


def test_a_slice_is_lost_with_any_of_its_processes_and_the_others_are_ended():
    running, failed = _Member(11), _Member(12, exit_code=3)
    processes = SliceProcesses([running, failed], launch=5)
    assert processes.wait(timeout=30) == 3
    # The other process ended with the slice (its process group), not left to train alone.
    assert (signal.SIGKILL, True) in running.signals and running.exit_code == -signal.SIGKILL
    assert processes.poll() == 3 and processes.pid == 11 and processes.pids == [11, 12]
    assert (processes.launch, processes.host_slice, processes.host) == (5, 3, "host3")


def test_a_slice_is_done_when_every_process_exited_0():
    quick, slower = _Member(11, exit_code=0), _Member(12)
    processes = SliceProcesses([quick, slower], launch=0)
    assert processes.poll() is None  # one still runs: not done yet
    slower.exit_code = 0
    assert processes.wait(timeout=30) == 0 and not slower.signals


def test_each_process_of_a_slice_gets_its_place_in_the_slice_runtime():
    assert runtime_env(1) == [{}]  # one process: no runtime of its own to join
    envs = runtime_env(2, "10.0.0.7")
    assert [e["RJ_PROCESS_ID"] for e in envs] == ["0", "1"]
    assert {e["RJ_NUM_PROCESSES"] for e in envs} == {"2"}
    assert {e["RJ_NUM_SLICES"] for e in envs} == {"1"}
    assert envs[0]["RJ_COORDINATOR_ADDRESS"] == envs[1]["RJ_COORDINATOR_ADDRESS"]
    assert envs[0]["RJ_COORDINATOR_ADDRESS"].startswith("10.0.0.7:")  # on its host
    assert runtime_env(2)[0]["RJ_COORDINATOR_ADDRESS"] != envs[0]["RJ_COORDINATOR_ADDRESS"]
    assert (output_file(0), output_file(1)) == ("output.log", "output.p1.log")


def test_each_slice_is_recorded_by_its_launch_for_a_takeover(tmp_path):
    processes = {4: [[11, 101], [12, 102]], 2: [[13, 103]], 6: [[14, 104]]}
    state = elastic_state.ElasticState(
        "127.0.0.1:1", 1, "t", {1: 4, 0: 2}, [2], 6, next_launch=7, processes=processes
    )
    elastic_state.write_state(str(tmp_path), state)
    assert elastic_state.read_state(str(tmp_path)) == state


def test_a_state_file_of_slices_run_without_agents_is_not_taken_over(tmp_path):
    with open(os.path.join(tmp_path, elastic_state.STATE_FILE), "w") as f:
        f.write(
            '{"address": "h:1", "supervisor_pid": 1, "token_sha256": "t", '
            '"slices": {"0": [[11, 22]]}, "done": [], "standby": [[33, 44]]}'
        )
    assert elastic_state.read_state(str(tmp_path)) is None


class _Exchange:
    store_address = "h:1"

    def __init__(self, fails: bool) -> None:
        self._fails = fails

    def allreduce_sum(self, buffer):
        from resilient_jax.elastic.exchange import ExchangeError

        if self._fails:
            raise ExchangeError("allreduce: connection reset")
        return buffer + 1


def test_the_processes_of_a_slice_share_quorums_and_agree_on_every_exchange():
    from resilient_jax.elastic.exchange import ExchangeError
    from resilient_jax.elastic.slice_link import SliceExchange, SliceLost, slice_agreement

    store = MemoryKeyValueStore()
    links = [slice_agreement(5.0, store, p, 2) for p in (0, 1)]
    shared = in_threads(lambda: links[0].share("q", "q1"), lambda: links[1].share("q", None))
    assert shared == ["q1"] * 2
    # Process 1's exchange failed where process 0's completed: both treat it as failed.
    exchanges = [SliceExchange(_Exchange(fails=p == 1), links[p]) for p in (0, 1)]
    buffer = np.zeros(3, np.float32)
    results = in_threads(*(lambda e=e: e.allreduce_sum(buffer) for e in exchanges))
    assert all(isinstance(r, ExchangeError) for r in results), results
    assert "another process of this slice" in str(results[0])
    # Both completed: agreed; each process's key of a call is deleted two calls later.
    exchanges = [SliceExchange(_Exchange(fails=False), link) for link in links]
    results = in_threads(*(lambda e=e: e.allreduce_sum(buffer) for e in exchanges))
    assert all(np.array_equal(r, buffer + 1) for r in results)
    rounds = sorted(store.values)
    assert rounds == [f"rj_elastic/allreduce/{r}/{p}" for r in (2, 3) for p in (0, 1)], rounds
    # A process of the slice that stays silent: the slice is lost, within the bound.
    alone = slice_agreement(0.2, MemoryKeyValueStore(), 1, 2)
    with pytest.raises(SliceLost, match="process 0 of this slice silent"):
        alone.share("q", None)


def test_state_bytes_are_this_process_pieces_and_heal_bitwise(tmp_path):
    from resilient_jax.elastic import slice_step as elastic_step
    from resilient_jax.train.state import init_state

    config = tiny_config(**{"elastic.enabled": True})
    ctx = run_context(config, str(tmp_path), devices=4)
    state = init_state(config, ctx.mesh)
    sharded = [a for a in jax.tree.leaves(state) if not a.is_fully_replicated]
    assert sharded, "the test needs leaves split over the slice's devices"
    buffer = elastic_step.state_bytes(state)
    # One copy of each distinct piece: the whole state once, whatever is replicated.
    whole = sum(a.nbytes for a in jax.tree.leaves(state))
    assert buffer.size == elastic_step.state_nbytes(ctx) == whole
    healed = elastic_step.state_from_bytes(ctx, buffer.copy())
    assert_bitwise(healed, state)
    same = jax.tree.map(lambda a, b: a.sharding == b.sharding, healed, state)
    assert all(jax.tree.leaves(same))
