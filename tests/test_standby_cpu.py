"""The warm standby's CPU priority (`control.standby_cpu`): every thread of a process put under
SCHED_IDLE, threads it creates afterwards inheriting it, every one put back under the supervisor's
policy, and its session's autogroup lowered and put back (where the kernel groups by session);
and the elastic supervisor doing so around a standby's wait (stand-in processes, no JAX)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, stand_in_elastic_config

from resilient_jax.control import elastic, processes, standby_cpu
from resilient_jax.control.elastic import ElasticSupervisor
from resilient_jax.events import read_events

pytestmark = pytest.mark.skipif(
    not standby_cpu.raising_permitted(),
    reason="needs Linux and the right to raise a thread out of SCHED_IDLE",
)

# Starts 3 threads, says "ready"; at a line on stdin one of those threads starts another, which
# says "made"; at end of input it exits.
_THREADS = """
import sys, threading
made = threading.Event()
def wait():
    made.wait()
def maker():
    sys.stdin.readline()
    threading.Thread(target=wait, daemon=True).start()
    print("made", flush=True)
    sys.stdin.readline()
    made.set()
threads = [threading.Thread(target=wait, daemon=True) for _ in range(2)]
threads.append(threading.Thread(target=maker))
for t in threads:
    t.start()
print("ready", flush=True)
threads[-1].join()
"""


def _policies(pid: int) -> list[int]:
    return [os.sched_getscheduler(tid) for tid in standby_cpu.thread_ids(pid)]


def test_every_thread_is_lowered_inherits_it_and_is_restored():
    child = subprocess.Popen(
        [sys.executable, "-c", _THREADS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own autogroup, as a standby's
    )
    own_group = standby_cpu.read_autogroup("self")
    try:
        assert child.stdout.readline() == "ready\n"
        own_policy, _ = standby_cpu.own_policy()
        assert set(_policies(child.pid)) == {own_policy}
        assert standby_cpu.lower(child.pid) == 4  # the main thread and its 3
        assert set(_policies(child.pid)) == {os.SCHED_IDLE}
        if own_group is not None:
            assert standby_cpu.read_autogroup(child.pid)[1] == standby_cpu.LOWEST_NICE
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "made\n"
        # made by a lowered thread: lowered too
        assert _policies(child.pid) == [os.SCHED_IDLE] * 5
        assert standby_cpu.restore(child.pid) == 5
        assert _policies(child.pid) == [own_policy] * 5
        if own_group is not None:
            assert standby_cpu.read_autogroup(child.pid)[1] == own_group[1]
        assert standby_cpu.restore(child.pid) == 0  # nothing left under SCHED_IDLE
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=10) == 0
    finally:
        child.kill()
        child.wait()
    assert standby_cpu.lower(child.pid) == 0  # an ended process: nothing to change


def test_the_own_autogroup_is_never_changed():
    """A process in this one's session shares its autogroup: lowering it would lower this one."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not standby_cpu.set_autogroup_nice(child.pid, standby_cpu.LOWEST_NICE)
        assert standby_cpu.read_autogroup("self") == standby_cpu.read_autogroup(child.pid)
    finally:
        child.kill()
        child.wait()


def test_a_supervisor_in_the_root_autogroup_still_lowers_and_restores_the_standby_group(
    monkeypatch,
):
    """Under an init that never called setsid (many containers and CI runners) the supervisor is in
    the kernel's root group, whose /proc file reads empty; a standby in a session of its own still
    has a group to lower, and is put back at nice 0, where its slices' groups are."""
    if standby_cpu.read_autogroup("self") is None:
        pytest.skip("the kernel does not group tasks by session")
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True
    )
    read = standby_cpu.read_autogroup
    monkeypatch.setattr(
        standby_cpu,
        "read_autogroup",
        lambda pid: (standby_cpu.ROOT_AUTOGROUP, 0) if pid == "self" else read(pid),
    )
    try:
        standby_cpu.lower(child.pid)
        assert read(child.pid)[1] == standby_cpu.LOWEST_NICE
        standby_cpu.restore(child.pid)
        assert read(child.pid)[1] == 0
        # a standby in the root group too (started without a session of its own): nothing to
        # set (the kernel refuses the root group a nice), and no error
        monkeypatch.setattr(
            standby_cpu, "read_autogroup", lambda pid: (standby_cpu.ROOT_AUTOGROUP, 0)
        )
        assert not standby_cpu.set_autogroup_nice(child.pid, standby_cpu.LOWEST_NICE)
        assert read(child.pid)[1] == 0
    finally:
        child.kill()
        child.wait()


# A standby stand-in: waits until it runs under SCHED_IDLE (set by the supervisor after its spawn;
# bounded), starts a thread, writes the policy of every one of its threads and its autogroup's nice
# into `waiting.json` in its workdir (argv[1]), waits like the real one (`control.standby`), and as
# the slice given writes them again, and the slice's `stop` event.
_STANDBY = """
import json, os, sys, threading, time
from resilient_jax.control.standby_cpu import read_autogroup, thread_ids
from resilient_jax.control.standby import wait_on_quorum
deadline = time.monotonic() + 10
while os.sched_getscheduler(0) != os.SCHED_IDLE and time.monotonic() < deadline:
    time.sleep(0.01)
done = threading.Event()
threading.Thread(target=done.wait, daemon=True).start()
def policies():
    group = read_autogroup('self')
    return [os.sched_getscheduler(tid) for tid in thread_ids(os.getpid())], group and group[1]
with open(os.path.join(sys.argv[1], 'waiting.json'), 'w') as f:
    json.dump(policies(), f)
a = wait_on_quorum(os.environ['RJ_QUORUM_ADDRESS'], os.environ['RJ_RUN_TOKEN'], 30)
with open(os.path.join(a.workdir, 'policies.json'), 'w') as f:
    json.dump(policies(), f)
with open(os.path.join(a.workdir, 'events.jsonl'), 'a') as f:
    f.write(json.dumps({'type': 'stop', 'pid': os.getpid(), 'exit_code': 0}) + '\\n')
"""
# A slice stand-in: argv[1] its workdir, argv[2] seconds to run once the standby waits (bounded: on
# a busy host the standby starts on idle CPU only), argv[3] its exit code.
_SLICE = """
import json, os, sys, time
waiting = os.path.join(os.path.dirname(os.path.dirname(sys.argv[1])), 'standby', 'waiting.json')
deadline = time.monotonic() + 100
while not os.path.exists(waiting) and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(float(sys.argv[2]))
if sys.argv[3] == '0':
    with open(os.path.join(sys.argv[1], 'events.jsonl'), 'a') as f:
        f.write(json.dumps({'type': 'stop', 'pid': os.getpid(), 'exit_code': 0}) + '\\n')
sys.exit(int(sys.argv[3]))
"""


def test_the_supervisor_runs_the_standby_idle_until_it_is_given_a_slice(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", REPO)
    monkeypatch.setattr(elastic, "STANDBY_AFTER_S", 60.0)  # no second standby in this test
    config = stand_in_elastic_config(2, standby=True)
    runs = {0: (5.0, 0), 1: (0.5, 1)}  # slice 1 fails once the standby waits: it becomes slice 1

    def argv(slice_id: int, slice_dir: str) -> list[str]:
        if slice_id < 0:
            return [sys.executable, "-c", _STANDBY, slice_dir]
        seconds, code = runs[slice_id]
        return [sys.executable, "-c", _SLICE, slice_dir, str(seconds), str(code)]

    supervisor = ElasticSupervisor(
        config, argv, str(tmp_path), 1, out=io.StringIO(), token="c" * 32, cwd=REPO
    )
    result = supervisor.run(time_limit_s=150)
    assert (result.exit_code, result.replacements) == (0, 1), result
    with open(os.path.join(elastic.standby_workdir(str(tmp_path)), "waiting.json")) as f:
        waiting = json.load(f)
    with open(os.path.join(elastic.slice_workdir(str(tmp_path), 1), "policies.json")) as f:
        as_slice = json.load(f)
    own_policy, _ = standby_cpu.own_policy()
    group = standby_cpu.read_autogroup("self")
    nices = (standby_cpu.LOWEST_NICE, group[1]) if group else (None, None)
    assert waiting == [[os.SCHED_IDLE] * 2, nices[0]]
    assert as_slice == [[own_policy] * 2, nices[1]]
    given = [e for e in read_events(str(tmp_path)) if e["type"] == "elastic_slice_start"][-1]
    assert (given["standby"], given["threads_raised"]) == (True, 2)


def test_a_host_agents_standby_waits_under_sched_idle_and_works_at_the_agents_policy(tmp_path):
    # The restart path's standby (`worker.standby`), as a host agent spawns and assigns it: its
    # threads, the worker's thread included, wait under SCHED_IDLE; the worker it becomes reports
    # its own policy, which is the agent's (this process's).
    script = tmp_path / "worker.py"
    script.write_text(
        "import os\n"
        "print('policy', os.sched_getscheduler(0), os.environ['RJ_PROCESS_ID'], flush=True)\n"
    )
    out = io.StringIO()
    sink = processes.OutputSink(out)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = processes.standby_argv([sys.executable, str(script)], preload=("json",))
    waiting = processes.spawn_standby(argv, env, sink, cwd=str(tmp_path), idle_cpu=True)
    normal = processes.spawn_standby(argv, env, sink, cwd=str(tmp_path))
    try:
        assert waiting.idle and not normal.idle
        policies = _policies(waiting.popen.pid)
        assert policies and set(policies) == {os.SCHED_IDLE}
        assert os.SCHED_IDLE not in _policies(normal.popen.pid)
        worker = processes.assign(waiting, {**env, "RJ_PROCESS_ID": "2"}, "[g1 s0 p2] ", 2, 0, 1)
        assert worker.popen.wait(timeout=60) == 0
        worker.reader.join(timeout=5)
        assert f"[g1 s0 p2] policy {standby_cpu.own_policy()[0]} 2" in out.getvalue()
    finally:
        processes.discard([waiting, normal])
