"""Coordinator pieces without training workers: protocol, heartbeat server and client over real
sockets, detection, stragglers, standby processes, restart policy, slice pool, config validation,
worker environment, compilation cache."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
import sys
import threading
import time

import jax
import pytest

from resilient_jax import config as config_lib
from resilient_jax.contracts import env_vars
from resilient_jax.contracts.faults import FaultKind, SupervisorFaultKind
from resilient_jax.contracts.messages import Phase
from resilient_jax.control import (
    ClusterSpec,
    SupervisorAction,
    compile_cache,
    detector,
    plan_for,
    processes,
    protocol,
    worker_env,
)
from resilient_jax.control.announced_outages import OutageReader
from resilient_jax.control.restart_policy import RestartPolicy, SlicePool, straggler_eviction_pays
from resilient_jax.control.server import HeartbeatServer, WorkerReport
from resilient_jax.control.stragglers import StragglerWatch
from resilient_jax.worker import standby
from resilient_jax.worker.client import SupervisorClient
from resilient_jax.worker.distributed import initialize_from_env, read_env

TOKEN = "t0ken"


def wait_for(predicate, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"condition not met within {timeout_s}s")


# Protocol.


def test_message_round_trip_and_rejections():
    def decode(line: bytes, token: str) -> dict:  # as the heartbeat server reads a worker's line
        message = protocol.read(line, token)
        protocol.worker_line(message)
        return message

    message = {"type": "heartbeat", "token": TOKEN, "generation": 1, "process": 3, "step": 7}
    assert decode(protocol.encode(message).strip(), TOKEN) == message
    with pytest.raises(protocol.ProtocolError, match="token"):
        decode(protocol.encode({**message, "token": "other"}), TOKEN)
    with pytest.raises(protocol.ProtocolError, match="JSON"):
        decode(b"{not json", TOKEN)
    with pytest.raises(protocol.ProtocolError, match="process"):
        decode(protocol.encode({**message, "process": "3"}), TOKEN)
    with pytest.raises(protocol.ProtocolError, match="type"):
        decode(protocol.encode({**message, "type": "shell"}), TOKEN)
    with pytest.raises(protocol.ProtocolError, match="longer"):
        decode(b"x" * (protocol.MAX_LINE_BYTES + 1), TOKEN)


# Heartbeat server and client.


def test_client_reports_phases_steps_and_median_to_server():
    server = HeartbeatServer(TOKEN)
    client = SupervisorClient(
        server.address, TOKEN, generation=2, process=1, slice_id=4, interval_s=0.05
    )
    try:
        first = wait_for(lambda: server.reports(2).get(1))
        assert (first.phase, first.step, first.slice, first.pid) == ("init", None, 4, os.getpid())
        client.set_phase(Phase.COMPILE)
        client.report_step(11, 9.0)  # the compile step: excluded from the median
        for step, seconds in ((12, 0.1), (13, 0.3), (14, 0.2)):
            client.report_step(step, seconds)
        report = wait_for(lambda: (r := server.reports(2).get(1)) and r.step == 14 and r)
        assert report.phase == Phase.TRAIN
        assert sorted(report.arrivals) == [11, 12, 13, 14]
        assert report.arrivals[11] <= report.arrivals[14] <= time.time()
        assert report.step_time_s == pytest.approx(0.2)
        assert report.last_progress is not None
        assert server.reports(1) == {}
        with client.phase(Phase.RESTORE):
            wait_for(lambda: server.reports(2)[1].phase == Phase.RESTORE)
        wait_for(lambda: server.reports(2)[1].phase == Phase.TRAIN)
        with pytest.raises(ValueError, match="phase"):
            client.set_phase("lunch")
    finally:
        client.close()
        assert wait_for(lambda: server.reports(2)[1].said_bye)
        server.close()


def test_reported_error_is_a_failure_at_once():
    server = HeartbeatServer(TOKEN)
    client = SupervisorClient(server.address, TOKEN, 0, 1, 1, interval_s=10.0)
    try:
        wait_for(lambda: server.reports(0).get(1))
        client.report_error("ValueError: " + "x" * 1000)
        client.report_step(5, 0.1)  # an error is final
        report = wait_for(lambda: (r := server.reports(0)[1]).phase == "error" and r, 2.0)
        assert report.error.startswith("ValueError: x") and len(report.error) == 300
        failure = detector.check(time.monotonic(), {1: 0.0}, {1: report}, THRESHOLDS)
        assert (failure.cause, failure.process) == ("error", 1)
    finally:
        client.close()
        server.close()


def test_silence_is_judged_only_up_to_what_the_server_has_read():
    """A supervisor paused (by the host, by its own garbage collection) blames no worker for the
    heartbeats that arrived meanwhile and are not read yet."""
    server = HeartbeatServer(TOKEN)
    held, resume = threading.Event(), threading.Event()
    pause = threading.Event()

    def tick() -> None:  # the server thread stops here, as in a pause of its whole process
        if pause.is_set():
            held.set()
            resume.wait(10)

    server._tick = tick
    spawned = {0: time.monotonic()}
    client = SupervisorClient(server.address, TOKEN, 0, 0, 0, interval_s=0.05)
    try:
        wait_for(lambda: server.reports(0).get(0))
        pause.set()
        assert held.wait(5)
        paused_at = time.monotonic()
        time.sleep(0.6)  # heartbeats keep arriving, unread
        now = time.monotonic()
        heard = server.heard_until(now)
        assert heard <= paused_at + 0.1
        reports = server.reports(0)
        thresholds = dataclasses.replace(THRESHOLDS, heartbeat_timeout_s=0.3)
        # judged up to `now`, the unread heartbeats would make process 0 silent for 0.6 s
        assert detector.check(now, spawned, reports, thresholds).cause == "heartbeat"
        assert detector.check(heard, spawned, reports, thresholds) is None
        resume.set()
        pause.clear()
        assert wait_for(lambda: server.reports(0)[0].last_seen > now)
        later = time.monotonic()
        assert server.heard_until(later) >= later - 0.2
    finally:
        resume.set()
        client.close()
        server.close()


def test_server_ignores_clients_without_the_token():
    server = HeartbeatServer(TOKEN)
    intruder = SupervisorClient(server.address, "guess", 0, 0, 0, interval_s=0.05)
    try:
        time.sleep(0.3)
        assert server.reports(0) == {}
    finally:
        intruder.close()
        server.close()


def test_dead_supervisor_never_blocks_the_worker():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    client = SupervisorClient(address, TOKEN, 0, 0, 0, interval_s=0.05)
    start = time.monotonic()
    for step in range(1000):
        client.report_step(step, 0.01)
    client.close()
    assert time.monotonic() - start < 1.5


def test_client_from_env_only_when_supervised():
    c = config_lib.default_config().coordinator
    assert SupervisorClient.from_env(c, environ={}) is None
    server = HeartbeatServer(TOKEN)
    env = {
        env_vars.SUPERVISOR_ADDRESS: server.address,
        env_vars.RUN_TOKEN: TOKEN,
        env_vars.GENERATION: "3",
        env_vars.PROCESS_ID: "1",
        env_vars.SLICE: "2",
    }
    excepthook = sys.excepthook
    client = SupervisorClient.from_env(c, environ=env)
    try:
        report = wait_for(lambda: server.reports(3).get(1))
        assert report.slice == 2
        assert sys.excepthook is not excepthook  # uncaught errors get reported
    finally:
        sys.excepthook = excepthook
        client.close()
        server.close()


# Detection.


def report(process: int, now: float, **fields) -> WorkerReport:
    values = dict(
        generation=0,
        process=process,
        slice=process,
        pid=100 + process,
        phase=Phase.TRAIN,
        step=10,
        step_time_s=0.1,
        first_seen=now - 50,
        last_seen=now,
        last_progress=now,
    )
    values.update(fields)
    return WorkerReport(**values)


THRESHOLDS = detector.Thresholds(
    heartbeat_timeout_s=5.0,
    hang_factor=10.0,
    hang_floor_s=3.0,
    startup_timeout_s=60.0,
    first_step_timeout_s=20.0,
)


def test_detector_healthy_job_passes():
    now = 1000.0
    reports = {0: report(0, now), 1: report(1, now - 1.0)}
    assert detector.check(now, {0: now - 50, 1: now - 50}, reports, THRESHOLDS) is None


def test_detector_missing_heartbeat_names_the_process():
    now = 1000.0
    reports = {0: report(0, now), 1: report(1, now, last_seen=now - 6.0)}
    failure = detector.check(now, {0: 0.0, 1: 0.0}, reports, THRESHOLDS)
    assert (failure.cause, failure.process, failure.since) == ("heartbeat", 1, now - 6.0)
    reports[1].said_bye = True  # a goodbye explains the silence
    assert detector.check(now, {0: 0.0, 1: 0.0}, reports, THRESHOLDS) is None


def test_detector_never_heard_from_within_startup_budget():
    now = 1000.0
    assert detector.check(now, {0: now - 59}, {}, THRESHOLDS) is None
    failure = detector.check(now, {0: now - 61}, {}, THRESHOLDS)
    assert (failure.cause, failure.process) == ("startup_timeout", 0)


def test_detector_hang_budget_from_median_step_time():
    now = 1000.0
    spawned = {0: now - 100, 1: now - 100}
    # median 0.5 s -> budget max(10 x 0.5, 3) = 5 s
    reports = {p: report(p, now, last_progress=now - 4.9, step_time_s=0.5) for p in (0, 1)}
    assert detector.check(now, spawned, reports, THRESHOLDS) is None
    reports = {p: report(p, now, last_progress=now - 5.1, step_time_s=0.5) for p in (0, 1)}
    failure = detector.check(now, spawned, reports, THRESHOLDS)
    assert (failure.cause, failure.process) == ("hang", None)  # all agree: no one stands out
    reports[1].step = 9  # the one behind is the stuck one
    assert detector.check(now, spawned, reports, THRESHOLDS).process == 1


def test_detector_slow_phases_get_the_startup_budget():
    now = 1000.0
    spawned = {0: now - 100, 1: now - 100}
    reports = {p: report(p, now, last_progress=now - 30) for p in (0, 1)}
    reports[0].phase = Phase.DONE
    assert detector.check(now, spawned, reports, THRESHOLDS) is None
    # Before the first step: compile and restore get the startup budget, then it is a stall.
    starting = {p: report(p, now, step=None, last_progress=None, phase="compile") for p in (0, 1)}
    assert detector.check(now, {0: now - 59, 1: now - 59}, starting, THRESHOLDS) is None
    failure = detector.check(now, {0: now - 61, 1: now - 61}, starting, THRESHOLDS)
    assert failure.cause == "startup_timeout"


def test_detector_first_step_budget_runs_from_the_last_process_ready():
    now = 1000.0
    spawned = {0: now - 100, 1: now - 100}
    # Process 1 compiled 40 s after process 0; process 0 dispatched its first step and waits.
    reports = {
        0: report(0, now, step=21, last_progress=now - 45, step_time_s=None),
        1: report(1, now, step=None, last_progress=None, phase="ready", ready_at=now - 19),
    }
    assert detector.check(now, spawned, reports, THRESHOLDS) is None
    reports[1].ready_at = now - 21
    failure = detector.check(now, spawned, reports, THRESHOLDS)
    assert (failure.cause, failure.process, failure.since) == ("hang", 1, now - 21)
    assert "first_step_timeout_s" in failure.detail
    # While a peer still compiles, the startup budget applies to everyone.
    reports[0].phase = "compile"
    assert detector.check(now, spawned, reports, THRESHOLDS) is None


def test_scale_up_pays_only_when_the_speed_up_outweighs_the_restart():
    from resilient_jax.control.restart_policy import ReshapeLedger, scale_up_pays

    ledger = ReshapeLedger()
    assert scale_up_pays(ledger, 1, 2, 60.0, 1000)[0]  # nothing measured: try it
    ledger.step_time_s.update({2: 0.5})
    assert scale_up_pays(ledger, 1, 2, 60.0, 1000)[0]  # restart cost unknown: try it
    ledger.restart_costs_s += [9.0, 10.0, 30.0]  # median 10 s
    assert not scale_up_pays(ledger, 1, 2, 60.0, 1000)[0]  # this mesh not measured: wait
    ledger.step_time_s[1] = 1.0
    # Twice as fast for the 60 s to the next failure: saves 60 s of work > 10 s restart.
    pays, why = scale_up_pays(ledger, 1, 2, 60.0, 1000)
    assert pays and "restart 10.0s" in why
    # 5% faster: 3 s saved over 60 s does not repay a 10 s restart; no failures yet: it does.
    ledger.step_time_s[2] = 1.0 / 1.05
    assert not scale_up_pays(ledger, 1, 2, 60.0, 1000)[0]
    assert scale_up_pays(ledger, 1, 2, None, 1000)[0]
    # Few steps left bound the horizon: 8 steps x 1 s x 1.0 = 8 s < 10 s.
    ledger.step_time_s[2] = 0.5
    assert not scale_up_pays(ledger, 1, 2, None, 8)[0]
    assert scale_up_pays(ledger, 1, 2, None, 12)[0]


# Standby workers.


def test_standby_arguments():
    assert standby.parse_args(["--preload=a,b", "--", "w.py", "--x=1"]) == (
        ["a", "b"],
        ["w.py", "--x=1"],
    )
    assert standby.parse_args(["--", "-m", "pkg.mod"]) == ([], ["-m", "pkg.mod"])
    for bad in ([], ["--"], ["--", "-m"], ["--nope", "--", "w.py"]):
        with pytest.raises(ValueError):
            standby.parse_args(bad)
    assert processes.standby_argv(["/bin/sh", "-c", "true"]) is None  # not a Python worker
    argv = processes.standby_argv([sys.executable, "w.py", "--x=1"], preload=("json",))
    assert argv[1:] == [
        "-m",
        "resilient_jax.worker.standby",
        "--preload=json",
        "--",
        "w.py",
        "--x=1",
    ]


def test_standby_runs_the_worker_with_its_assigned_environment(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys\n"
        "print('place', os.environ['RJ_PROCESS_ID'], sys.argv[1:], 'json' in sys.modules)\n"
        "sys.exit(7)\n"
    )
    out = io.StringIO()
    sink = processes.OutputSink(out)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = processes.standby_argv([sys.executable, str(script), "--x=1"], preload=("json",))
    ready = processes.spawn_standby(argv, env, sink, cwd=str(tmp_path))
    unused = processes.spawn_standby(argv, env, sink, cwd=str(tmp_path))
    worker = processes.assign(ready, {**env, "RJ_PROCESS_ID": "3"}, "[g1 s0 p3] ", 3, 0, 1)
    assert (worker.process, worker.slice, worker.generation) == (3, 0, 1)
    assert worker.popen.wait(timeout=30) == 7
    worker.reader.join(timeout=5)
    assert "[g1 s0 p3] place 3 ['--x=1'] True" in out.getvalue()
    processes.discard([unused])
    assert unused.popen.poll() is not None and not unused.alive


# Stragglers.


def arrivals_report(process: int, arrivals: dict[int, float]) -> WorkerReport:
    return report(process, 1000.0, arrivals=arrivals)


def test_server_keeps_the_newest_arrivals_of_well_formed_pairs():
    server = HeartbeatServer(TOKEN)
    try:
        with socket.create_connection(protocol.split_address(server.address)) as sock:
            base = {"type": "heartbeat", "token": TOKEN, "generation": 0, "process": 0}
            bad = [["700", 1.0], [800, "x"], [900], 1000]
            sock.sendall(protocol.encode({**base, "arrivals": bad}))
            pairs = [[step, 100.0 + step] for step in range(protocol.MAX_ARRIVALS_KEPT + 5)]
            sock.sendall(protocol.encode({**base, "arrivals": pairs}))
            kept = protocol.MAX_ARRIVALS_KEPT
            wait_for(lambda: (r := server.reports(0).get(0)) and len(r.arrivals) == kept)
        got = server.reports(0)[0].arrivals
        assert (min(got), max(got), got[5]) == (5, protocol.MAX_ARRIVALS_KEPT + 4, 105.0)
    finally:
        server.close()


def test_straggler_watch_finds_the_process_the_others_wait_for():
    # Process 1 needs 0.3 s per step; process 0 is ready 0.1 s after process 1 arrived.
    watch = StragglerWatch(factor=1.5, window=4, processes={0: 0, 1: 1})
    times = {0: {}, 1: {}}
    for step in range(1, 8):
        times[1][step] = 0.3 * step
        times[0][step] = 0.3 * (step - 1) + 0.1
    early = {
        p: arrivals_report(p, {s: t for s, t in a.items() if s <= 4}) for p, a in times.items()
    }
    assert watch.update(early) == []  # 3 own times each: the window is not full yet
    (found,) = watch.update({p: arrivals_report(p, a) for p, a in times.items()})
    assert (found.process, found.slice) == (1, 1)
    assert found.ratio == pytest.approx(3.0)
    assert (found.median_s, found.reference_s) == (pytest.approx(0.3), pytest.approx(0.1))
    assert watch.update({p: arrivals_report(p, a) for p, a in times.items()}) == []  # once


def test_straggler_watch_needs_every_process_and_consecutive_steps():
    watch = StragglerWatch(factor=1.5, window=1, processes={0: 0, 1: 1})
    assert watch.update({0: arrivals_report(0, {1: 0.0, 2: 1.0})}) == []  # process 1 unheard
    # Steps 1 and 3 only: no step with its predecessor reported, so nothing to judge.
    gaps = {0: arrivals_report(0, {1: 0.0, 3: 0.1}), 1: arrivals_report(1, {1: 0.0, 3: 5.0})}
    assert watch.update(gaps) == []
    healthy = StragglerWatch(factor=1.5, window=3, processes={0: 0, 1: 1})
    even = {p: arrivals_report(p, {s: s + 0.01 * p for s in range(1, 6)}) for p in (0, 1)}
    assert healthy.update(even) == []


def test_compilation_cache_env_is_under_the_workdir_unless_absolute_or_off(tmp_path):
    c = config_lib.default_config().coordinator
    env = compile_cache.cache_env(c, str(tmp_path))
    assert env[env_vars.JAX_COMPILATION_CACHE_DIR] == str(tmp_path / ".jax_cache")
    c.compilation_cache_dir = "/dev/shm/cache"
    assert (
        compile_cache.cache_env(c, str(tmp_path))[env_vars.JAX_COMPILATION_CACHE_DIR]
        == c.compilation_cache_dir
    )
    c.compilation_cache_dir = ""
    assert compile_cache.cache_env(c, str(tmp_path)) == {}


# Policy.


def coordinator_config(**overrides):
    c = config_lib.default_config().coordinator
    c.update(overrides)
    return c


def test_restart_policy_crash_loop_and_backoff():
    policy = RestartPolicy(coordinator_config(crash_loop_limit=3, backoff_s=1.0, backoff_max_s=3.0))
    policy.record_failure(50)
    assert (policy.streak, policy.backoff(), policy.stop_reason()) == (1, 0.0, None)
    policy.record_failure(45, hardware=True)  # a lost slice: no evidence about the program
    assert (policy.streak, policy.failures, policy.backoff()) == (1, 2, 0.0)
    policy.record_failure(48)  # restored from 40, failed before getting past 50
    assert (policy.streak, policy.backoff()) == (2, 1.0)
    policy.record_failure(70)  # got past 50: a new streak
    assert (policy.streak, policy.backoff()) == (1, 0.0)
    policy.record_failure(70)
    policy.record_failure(None)
    assert policy.backoff() == 2.0
    policy.record_failure(None, hardware=True)
    assert policy.backoff() == 0.0  # a lost slice restarts at once
    assert "crash loop: 3 failures in a row without getting past step 70" in policy.stop_reason()


class _Exited:
    """A worker as `generation.blame` sees it: its process index and its exit code."""

    def __init__(self, process: int, code: int | None) -> None:
        self.process, self._code = process, code

    def poll(self) -> int | None:
        return self._code


def test_a_peer_that_stops_the_run_on_purpose_outranks_an_error_then_a_death():
    from resilient_jax.control.generation import Outcome, Watched, blame

    error = detector.Failure(detector.FailureCause.EXIT, 0, "exit 1", since=0.0, exit_code=1)
    seen = Watched(Outcome.FAILURE, error)
    # Process 0 failed first (a collective with its peer); its peer stopped the run with exit 3.
    fatal = blame([_Exited(0, 1), _Exited(1, 3)], seen, 0.01)
    assert (fatal.outcome, fatal.failure.process, fatal.failure.exit_code) == (Outcome.FATAL, 1, 3)
    both = blame([_Exited(0, 1), _Exited(1, -9), _Exited(2, 3)], seen, 0.01)
    assert (both.outcome, both.failure.process) == (Outcome.FATAL, 2)
    killed = blame([_Exited(0, 1), _Exited(1, -9)], seen, 0.01)
    assert (killed.outcome, killed.failure.process, killed.failure.exit_code) == (
        Outcome.FAILURE,
        1,
        -9,
    )
    assert blame([_Exited(0, 1), _Exited(1, None)], seen, 0.01) is seen  # no cause found
    # A preempted peer: the generation was preempted, not failed (no failure counted).
    for preempted in (42, -15):
        assert blame([_Exited(0, 1), _Exited(1, preempted)], seen, 0.01).outcome == (
            Outcome.PREEMPTED
        )
    assert blame([_Exited(0, 1), _Exited(1, 42), _Exited(2, -9)], seen, 0.01).outcome == (
        Outcome.FAILURE
    )
    stopped = Watched(Outcome.FATAL, dataclasses.replace(error, exit_code=3))
    assert blame([_Exited(0, 3), _Exited(1, -9)], stopped, 0.01) is stopped


def test_one_look_at_the_exits_blames_the_cause_not_the_peers_error():
    from resilient_jax.control.generation import Outcome, poll_exits

    for codes, outcome, process in (
        ([1, 3], Outcome.FATAL, 1),  # a health verdict, and the peer's error in a collective
        ([1, -9], Outcome.FAILURE, 1),  # a kill, and the peer's error
        ([1, 42], Outcome.PREEMPTED, None),  # a preemption, and the peer's error
        ([42, -9], Outcome.FAILURE, 1),  # a kill outranks a preemption
    ):
        workers = [_Exited(i, code) for i, code in enumerate(codes)]
        for worker in workers:
            worker.started_at = 0.0
        _, _, watched = poll_exits(workers, 1.0, 0.1)
        assert watched.outcome == outcome, codes
        assert (watched.failure.process if watched.failure else None) == process, codes


def test_straggler_eviction_pays_only_when_the_rest_is_faster():
    assert straggler_eviction_pays(1.5, 2, 2) == (True, "a spare slice replaces it")
    assert straggler_eviction_pays(2.1, 2, 1)[0]  # one slice alone is 2x slower, the straggler 2.1x
    pays, why = straggler_eviction_pays(1.9, 2, 1)
    assert not pays and "ratio <= 2.00" in why


def test_restart_policy_retry_budget():
    policy = RestartPolicy(coordinator_config(max_restarts=2, crash_loop_limit=10))
    for step in (10, 20):
        policy.record_failure(step)
        assert policy.stop_reason() is None
    policy.record_failure(30)
    assert "max_restarts=2" in policy.stop_reason()


def test_slice_pool_evict_return_and_choose():
    pool = SlicePool(target=2, spares=1, readmit_after_s=10.0)
    assert pool.choose([]) == [0, 1]
    assert pool.evict(1, now=100.0) == 110.0
    assert pool.choose([0, 1]) == [0, 2]  # the spare steps in
    assert pool.choose([0, 1], exclude=(0,)) == [2]  # the choice without slice 0
    pool.announce_outage(0, until=130.0)
    assert pool.evict(0, now=101.0) == 130.0  # an announced outage beats the cooldown
    assert pool.choose([0, 2]) == [2]
    assert pool.next_return() == 110.0
    assert pool.refresh(now=111.0) == [1]
    assert pool.choose([2]) == [2, 1]
    cooling = SlicePool(target=3, spares=0, readmit_after_s=60.0)
    cooling.evict(0, now=5.0)
    cooling.evict(2, now=0.0)
    cooling.announce_outage(1, until=100.0)
    cooling.evict(1, now=0.0)
    assert cooling.readmit_suspects(now=6.0, count=1) == [2]  # due back soonest
    assert cooling.readmit_suspects(now=6.0, count=5) == [0]  # slice 1's outage is real
    assert cooling.healthy() == [0, 2]
    never = SlicePool(target=1, spares=0, readmit_after_s=-1.0)
    assert never.evict(0, now=0.0) is None and never.refresh(now=1e9) == []
    assert never.readmit_suspects(now=1e9, count=1) == []  # evicted for good


# Config, environment, plans.


def test_coordinator_config_validation():
    config = config_lib.default_config()
    config_lib.validate(config)
    config.coordinator.jax_heartbeat_timeout_s = 5
    with pytest.raises(config_lib.ConfigError, match=r"coordinator\.jax_heartbeat_timeout_s"):
        config_lib.validate(config)
    config = config_lib.default_config()
    config.coordinator.min_slices = 0
    with pytest.raises(config_lib.ConfigError, match=r"coordinator\.min_slices"):
        config_lib.validate(config)
    config = config_lib.default_config()
    config.coordinator.heartbeat_timeout_s = 0.6
    with pytest.raises(config_lib.ConfigError, match="heartbeat_interval_s"):
        config_lib.validate(config)


def test_read_env():
    assert read_env({}) is None
    env = read_env(
        {
            env_vars.COORDINATOR_ADDRESS: "127.0.0.1:1234",
            env_vars.NUM_PROCESSES: "4",
            env_vars.PROCESS_ID: "3",
            env_vars.NUM_SLICES: "2",
            env_vars.SLICE: "5",
            env_vars.GENERATION: "7",
        }
    )
    assert (env.processes_per_slice, env.slice_index, env.slice, env.generation) == (2, 1, 5, 7)
    with pytest.raises(ValueError, match="RJ_NUM_PROCESSES"):
        read_env({env_vars.COORDINATOR_ADDRESS: "127.0.0.1:1"})
    with pytest.raises(ValueError, match="inconsistent"):
        read_env(
            {
                env_vars.COORDINATOR_ADDRESS: "127.0.0.1:1",
                env_vars.NUM_PROCESSES: "3",
                env_vars.PROCESS_ID: "0",
                env_vars.NUM_SLICES: "2",
            }
        )


def test_worker_env_is_read_back_by_the_worker():
    shared = worker_env.shared_env(
        {env_vars.XLA_FLAGS: "--xla_force_host_platform_device_count=8 --other", "KEEP": "1"},
        "127.0.0.1:9",
        supervisor_pid=77,
        token=TOKEN,
        devices_per_process=2,
        cache_env={env_vars.JAX_COMPILATION_CACHE_DIR: "/tmp/cache"},
    )
    assert shared[env_vars.XLA_FLAGS] == "--other --xla_force_host_platform_device_count=2"
    assert (shared["KEEP"], shared[env_vars.RUN_TOKEN], shared[env_vars.SUPERVISOR_PID]) == (
        "1",
        TOKEN,
        "77",
    )
    assert shared[env_vars.JAX_COMPILATION_CACHE_DIR] == "/tmp/cache"
    place = worker_env.placement_env("127.0.0.1", 1234, 4, 3, 2, slice_id=5, generation=7)
    env = read_env({**shared, **place})
    assert (env.process_id, env.slice_index, env.slice, env.generation) == (3, 1, 5, 7)
    assert env.coordinator_address == "127.0.0.1:1234"


@pytest.mark.parametrize(
    ("mode", "tunables", "expected"),
    [
        ("always [madvise] never", None, "glibc.malloc.hugetlb=1"),
        (
            "[always] madvise never",
            "glibc.malloc.arena_max=2",
            "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1",
        ),
        ("always madvise [never]", None, None),  # the kernel hands out none: nothing to ask for
        ("always [madvise] never", "glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),  # opted out
    ],
)
def test_workers_ask_malloc_for_huge_pages_unless_told_otherwise(
    tmp_path, mode, tunables, expected
):
    mode_file = tmp_path / "enabled"
    mode_file.write_text(mode + "\n")
    environ = {"KEEP": "1"} | ({env_vars.GLIBC_TUNABLES: tunables} if tunables else {})
    env = worker_env.huge_page_malloc(environ, thp_mode_file=str(mode_file))
    assert env.get(env_vars.GLIBC_TUNABLES) == expected
    assert env["KEEP"] == "1"
    missing = worker_env.huge_page_malloc({}, thp_mode_file=str(tmp_path / "absent"))
    assert env_vars.GLIBC_TUNABLES not in missing


def test_exit_descriptions():
    assert processes.describe_exit(3) == "exited with code 3"
    assert processes.describe_exit(-9) == "was killed by SIGKILL"


def test_initialize_from_env_does_nothing_for_a_single_process():
    c = config_lib.default_config().coordinator
    assert initialize_from_env(c, environ={}) is None
    assert not jax.distributed.is_initialized()


def test_plan_for_keeps_the_global_batch_with_fewer_slices():
    config = config_lib.default_config()
    config.global_batch_size = 8
    config.per_device_batch_size = 2
    cluster = ClusterSpec(num_slices=2, processes_per_slice=1, devices_per_process=2)
    full, half = plan_for(config, 2, cluster), plan_for(config, 1, cluster)
    assert (full.replica, full.fsdp, full.microbatches) == (2, 2, 1)
    assert (half.replica, half.fsdp, half.microbatches) == (1, 2, 2)
    config.global_batch_size = 6
    with pytest.raises(config_lib.ConfigError, match="global_batch_size"):
        plan_for(config, 2, ClusterSpec(2, 1, 2))


def test_actions_and_cluster_are_checked():
    with pytest.raises(ValueError, match="kind"):
        SupervisorAction("reboot", slice=0, at_step=1)
    with pytest.raises(ValueError, match="kind"):
        SupervisorAction(
            FaultKind.NAN, slice=0, at_step=1
        )  # a worker's fault, not the supervisor's
    assert SupervisorAction("kill", slice=0, at_step=1).kind is FaultKind.KILL
    assert SupervisorAction("preempt", slice=0, at_s=1.0).kind is SupervisorFaultKind.PREEMPT
    with pytest.raises(ValueError, match="exactly one"):
        SupervisorAction("kill", slice=0)
    with pytest.raises(ValueError, match="num_slices"):
        ClusterSpec(num_slices=0)


def test_outage_reader_reads_lose_slice_events_incrementally(tmp_path):
    path = tmp_path / "events.jsonl"
    lines = [
        {
            "time": 100.0,
            "type": "chaos",
            "kind": "lose_slice",
            "slice": 1,
            "for_s": 20.0,
            "generation": 2,
        },
        {"time": 101.0, "type": "chaos", "kind": "nan", "step": 3},
        {"time": 102.0, "type": "step", "step": 4},
    ]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines) + '{"time": 103, "type": "cha')
    reader = OutageReader(str(tmp_path))
    (outage,) = reader.read_new()
    assert (outage.generation, outage.slice_index, outage.until) == (2, 1, 120.0)
    with open(path, "a") as f:  # the torn line completes
        f.write('os", "kind": "lose_slice", "slice": 0, "for_s": 1}\n')
    (outage,) = reader.read_new()
    assert (outage.generation, outage.slice_index, outage.until) == (None, 0, 104.0)
    assert reader.read_new() == []


def test_a_supervisor_touches_nothing_until_it_runs_and_a_bad_token_ends_it_in_one_line(
    tmp_path, monkeypatch
):
    """Construction keeps its arguments (no workdir, no token read, no thread); `run` opens
    what it needs, and a token file others may read ends it with exit 2 and one line."""
    from resilient_jax.contracts.exit_codes import ExitCode
    from resilient_jax.control import ClusterSpec, Supervisor

    token_file = tmp_path / "token"
    token_file.write_text("secret")
    token_file.chmod(0o644)
    monkeypatch.setenv(env_vars.RUN_TOKEN_FILE, str(token_file))
    workdir, out = tmp_path / "run", io.StringIO()
    threads = threading.active_count()
    config = config_lib.default_config()
    argv = [sys.executable, "-c", "pass"]
    supervisor = Supervisor(config, ClusterSpec(1, 1, 1), argv, str(workdir), out=out)
    assert not workdir.exists() and threading.active_count() == threads
    result = supervisor.run(time_limit_s=10)
    assert result.exit_code == ExitCode.BAD_INPUT and "mode 644; allowed: 600" in result.reason
    assert out.getvalue().count("\n") == 1 and "mode 644" in out.getvalue(), out.getvalue()
    with pytest.raises(ValueError, match="host_agents='remote'"):
        Supervisor(config, ClusterSpec(1, 1, 1), argv, str(workdir), host_agents="remote")
