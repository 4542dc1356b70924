"""Slices of several processes in elastic mode, the parts that need no second process: the
supervisor's bookkeeping of a slice's processes (lost with any of them, done with all of them),
their records for a takeover, the processes of a slice acting as one member (a quorum shared,
every exchange agreed on), and the state as this process's pieces of it."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import MemoryKeyValueStore, assert_bitwise, in_threads, run_context, tiny_config

from resilient_jax.control import elastic_state
from resilient_jax.control.elastic_slice import SliceProcesses, output_file, runtime_env


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_a_slice_is_lost_with_any_of_its_processes_and_the_others_are_ended():
    sleeper = _start("import time; time.sleep(60)")
    failing = _start("raise SystemExit(3)")
    processes = SliceProcesses([sleeper, failing])
    assert processes.wait(timeout=30) == 3
    assert sleeper.returncode == -9  # ended with the slice, not left to train alone
    assert processes.poll() == 3 and processes.pid == sleeper.pid


def test_a_slice_is_done_when_every_process_exited_0():
    quick, slower = _start("pass"), _start("import time; time.sleep(1)")
    processes = SliceProcesses([quick, slower])
    quick.wait(timeout=30)
    assert processes.poll() is None  # one still runs: not done yet
    assert processes.wait(timeout=30) == 0


def test_each_process_of_a_slice_gets_its_place_in_the_slice_runtime():
    assert runtime_env(1) == [{}]  # one process: no runtime of its own to join
    envs = runtime_env(2)
    assert [e["RJ_PROCESS_ID"] for e in envs] == ["0", "1"]
    assert {e["RJ_NUM_PROCESSES"] for e in envs} == {"2"}
    assert {e["RJ_NUM_SLICES"] for e in envs} == {"1"}
    assert envs[0]["RJ_COORDINATOR_ADDRESS"] == envs[1]["RJ_COORDINATOR_ADDRESS"]
    assert runtime_env(2)[0]["RJ_COORDINATOR_ADDRESS"] != envs[0]["RJ_COORDINATOR_ADDRESS"]
    assert (output_file(0), output_file(1)) == ("output.log", "output.p1.log")


def test_every_process_of_a_slice_is_recorded_for_a_takeover(tmp_path):
    sleeper = _start("import time; time.sleep(60)")
    ended = _start("pass")
    ended.wait(timeout=30)
    try:
        records = elastic_state.process_records(SliceProcesses([sleeper, ended]))
        assert records is not None and [r.pid for r in records] == [sleeper.pid, ended.pid]
        state = elastic_state.ElasticState("127.0.0.1:1", 1, "t", {1: records}, [0], records)
        elastic_state.write_state(str(tmp_path), state)
        read = elastic_state.read_state(str(tmp_path))
        assert read is not None and read.slices == {1: records} and read.standby == records
        # Running while any of its processes runs; adopted as a whole, lost with the one gone.
        assert read.running() == {1: records}
        adopted = elastic_state.adopt(records, str(tmp_path))
        assert adopted.pids == [sleeper.pid, ended.pid]
        assert adopted.wait(timeout=30) == elastic_state.NO_STOP_EVENT
        assert elastic_state.start_time(sleeper.pid) is None
    finally:
        sleeper.kill()
        sleeper.wait()
    assert elastic_state.process_records(SliceProcesses([ended])) is None


def test_a_state_file_of_single_process_slices_is_still_read(tmp_path):
    with open(os.path.join(tmp_path, elastic_state.STATE_FILE), "w") as f:
        f.write(
            '{"address": "h:1", "supervisor_pid": 1, "token_sha256": "t", '
            '"slices": {"0": [11, 22]}, "done": [], "standby": [33, 44]}'
        )
    state = elastic_state.read_state(str(tmp_path))
    assert state is not None
    assert state.slices == {0: (elastic_state.SliceRecord(11, 22),)}
    assert state.standby == (elastic_state.SliceRecord(33, 44),)


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
