"""Elastic mode's slices under the hosts' agents, with stand-in slices (no JAX): a host found lost
has its slice's processes ended and a fresh agent, and its slice is replaced; a restarted
supervisor ends what this job started but does not take over, so no process trains beside a
slice's replacement."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
import time

from conftest import elastic_stand_in_process, stand_in_elastic_config, wait_for_events

from resilient_jax.control.elastic import ElasticSupervisor
from resilient_jax.control.elastic_state import STATE_FILE
from resilient_jax.control.local_hosts import process_gone
from resilient_jax.events import read_events

TOKEN = "h" * 32


def _events(workdir, kind: str) -> list[dict]:
    return [e for e in read_events(str(workdir)) if e["type"] == kind]


def _sleeper(seconds: float) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds})"]


def test_a_lost_host_has_its_slice_ended_and_replaced_and_gets_a_new_agent(tmp_path):
    """host1's agent is killed while slice 1 runs: the slice's process, out of every agent's
    reach now, is ended by its pid at once, host1 gets a fresh agent, and slice 1 is started
    again there (its first start would run 60 s; the second finishes in 1). Slice 0 runs until
    the replacement has started."""
    finish = tmp_path / "finish"
    starts = {0: 0, 1: 0}

    def argv(slice_id: int, _: str) -> list[str]:
        starts[slice_id] += 1
        if slice_id == 0:
            wait = f"import os, time\nwhile not os.path.exists({str(finish)!r}): time.sleep(0.05)"
            return [sys.executable, "-c", wait]
        return _sleeper(60.0 if starts[1] == 1 else 1.0)

    supervisor = ElasticSupervisor(
        stand_in_elastic_config(2),
        argv,
        str(tmp_path),
        devices_per_process=1,
        out=io.StringIO(),
        restart_delay_s=0.2,
        token=TOKEN,
    )
    seen: dict = {}

    def kill_host1_agent() -> None:
        try:
            starts = wait_for_events(str(tmp_path), "elastic_slice_start", 2)
            (seen["first"],) = [e["pid"] for e in starts if e["slice"] == 1]
            with open(tmp_path / "logs" / "host1" / "agent.json") as f:
                seen["agent"] = json.load(f)["pid"]
            os.kill(seen["agent"], signal.SIGKILL)
            wait_for_events(str(tmp_path), "elastic_slice_start", 3)  # its replacement started
            seen["gone_at_replacement"] = process_gone(seen["first"])
        finally:
            finish.touch()  # slice 0 finishes, whatever happened

    thread = threading.Thread(target=kill_host1_agent)
    thread.start()
    result = supervisor.run(time_limit_s=60)
    thread.join()
    assert (result.exit_code, result.failures, result.replacements) == (0, 1, 1), result
    agent, first_slice_1 = seen["agent"], seen["first"]
    assert seen["gone_at_replacement"]  # ended, not left to train beside its replacement
    lost = _events(tmp_path, "host_lost")
    assert [e["host"] for e in lost] == ["host1"]
    agents = [e for e in _events(tmp_path, "agent_start") if e["host"] == "host1"]
    assert len(agents) == 2 and agents[0]["pid"] == agent != agents[1]["pid"]
    slice_1 = [e for e in _events(tmp_path, "elastic_slice_start") if e["slice"] == 1]
    assert [e["host"] for e in slice_1] == ["host1", "host1"]
    assert slice_1[1]["pid"] != first_slice_1


def test_a_restarted_supervisor_ends_the_slices_it_cannot_take_over(tmp_path):
    """The supervisor dies (SIGKILL) and its state file is lost with it: the next one cannot
    know which slice the agents' workers are, so it ends them (through their agents) before it
    starts the job's slices afresh; none of the first slices trains beside its replacement."""
    workdir = str(tmp_path)
    first = elastic_stand_in_process(workdir, {0: _sleeper(60), 1: _sleeper(60)}, TOKEN)
    try:
        orphans = [e["pid"] for e in wait_for_events(workdir, "elastic_slice_start", 2)]
    finally:
        first.kill()  # SIGKILL: its agents and slices stay behind
        first.wait(timeout=10)
    os.remove(os.path.join(workdir, STATE_FILE))
    out = io.StringIO()
    second = ElasticSupervisor(
        stand_in_elastic_config(2),
        lambda *_: _sleeper(1.0),
        workdir,
        devices_per_process=1,
        out=out,
        token=TOKEN,
    )
    seen: dict = {}

    def at_the_new_starts() -> None:
        wait_for_events(workdir, "elastic_slice_start", 4)
        seen["orphans_gone"] = all(process_gone(pid) for pid in orphans)

    thread = threading.Thread(target=at_the_new_starts)
    thread.start()
    start = time.monotonic()
    result = second.run(time_limit_s=60)
    thread.join()
    assert (result.exit_code, result.replacements) == (0, 0), result
    assert time.monotonic() - start < 30  # the orphans' 60 s were not waited for
    assert seen["orphans_gone"]  # before the job's slices started afresh
    assert f"pids {sorted(orphans)}" in out.getvalue()
    assert not _events(tmp_path, "elastic_slice_adopted")
    starts = [e["pid"] for e in _events(tmp_path, "elastic_slice_start")]
    assert len(starts) == 4 and not set(starts[2:]) & set(orphans)
