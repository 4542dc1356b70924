"""The supervisor's control port under 1,000 hostile connections while a run trains.

A `launch/local_cluster.py` run (2 slices of the simulated worker, the run token set) is attacked
from 127.0.0.1 while it trains: connections that stay silent, trickle bytes, send an over-long
line, send a well-formed message with a wrong token, or send random bytes, many at once. The run
must end as an undisturbed one does (exit 0, every step, the exact final value, one generation),
no hostile connection may be answered or kept, every one must be accounted for in the events
(logged one by one, or counted in a suppressed-refusals summary), and the supervisor's memory
and open files must stay bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from resilient_jax.control import agent_protocol, protocol
from resilient_jax.events import read_events
from resilient_jax.testing.hostile_clients import KINDS, attack, open_fds, rss_kb
from tests.test_coordinator_cluster import (
    REPO,
    alive,
    expected_value,
    saved_step,
    worker_pids,
    write_config,
)

MAX_PENDING = 32
# Phase 1: each kind of hostile connection, fewer at once than the cap on unauthenticated ones,
# so each is refused for what it did. Phase 2: silent ones all at once, far over the cap.
SPREAD, SPREAD_CONCURRENCY = 900, 24
BURST = 100
CONNECTIONS = SPREAD + BURST
AUTH_TIMEOUT_S = 0.5
TOTAL_STEPS = 600  # at 0.05 s a step: long enough to be attacked throughout
RSS_GROWTH_LIMIT_KB = 50 * 1024


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_training_run_holds_against_1000_hostile_connections(tmp_path):
    workdir = tmp_path / "run"
    config_path = write_config(
        tmp_path / "config.py",
        {
            "total_steps": TOTAL_STEPS,
            "coordinator.auth_timeout_s": AUTH_TIMEOUT_S,
            "coordinator.max_pending_connections": MAX_PENDING,
            "coordinator.refusal_log_window_s": 2.0,
        },
    )
    env = {**os.environ, "RJ_RUN_TOKEN": "soak-token-0123", "PYTHONPATH": REPO}
    log_path = tmp_path / "supervisor.log"
    with open(log_path, "w") as log:
        supervisor = subprocess.Popen(
            [
                sys.executable,
                os.path.join(REPO, "launch", "local_cluster.py"),
                f"--config={config_path}",
                f"--workdir={workdir}",
                "--num_slices=2",
                "--worker=-m resilient_jax.testing.sim_worker --sim_step_time_s=0.05",
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 90
        while saved_step(workdir) < 5:
            assert supervisor.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never started training"
            time.sleep(0.05)
        address = protocol.split_address(agent_protocol.read_supervisor_address(str(workdir)))
        rss_before = rss_kb(supervisor.pid)
        fds_before = open_fds(supervisor.pid)
        attack_started = time.monotonic()
        fds_seen = [fds_before]
        outcomes = []
        for kinds, concurrency in (
            ([KINDS[i % len(KINDS)] for i in range(SPREAD)], SPREAD_CONCURRENCY),
            (["silent"] * BURST, BURST),
        ):
            outcomes += attack(
                address,
                kinds,
                concurrency,
                seed=len(outcomes),
                while_running=lambda: fds_seen.append(open_fds(supervisor.pid)),
            )
        attack_s = time.monotonic() - attack_started
        rss_after = rss_kb(supervisor.pid)
        still_training = supervisor.poll() is None and saved_step(workdir) < TOTAL_STEPS
        assert still_training, f"the run ended before the attack did ({attack_s:.1f}s)"
        exit_code = supervisor.wait(timeout=120)
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
            supervisor.wait()
        survivors = [pid for pid in worker_pids(workdir) if alive(pid)]
        for pid in survivors:
            os.killpg(pid, signal.SIGKILL)
    output = log_path.read_text()
    assert not survivors
    # The run, as an undisturbed one ends (test_coordinator_cluster's undisturbed run).
    assert exit_code == 0, output[-3000:]
    state = json.loads((workdir / "sim_state.json").read_text())
    assert state["step"] == TOTAL_STEPS
    assert state["value"] == pytest.approx(expected_value(TOTAL_STEPS), rel=1e-12)
    events = [e for e in read_events(str(workdir)) if e.get("source") == "supervisor"]
    assert not [e for e in events if e["type"] in ("failure_detected", "restart", "host_lost")]
    starts = [e for e in events if e["type"] == "process_start"]
    assert [(e["process"], e["generation"]) for e in starts] == [(0, 0), (1, 0)]
    # Nothing hostile was answered or kept open; every connection was refused exactly once.
    assert all(o.closed for o in outcomes), "a hostile connection was kept open"
    assert not any(o.answered for o in outcomes), "a hostile connection was answered"
    logged = [e for e in events if e["type"] == "connection_refused"]
    summaries = [e for e in events if e["type"] == "connection_refusals_suppressed"]
    assert len(logged) + sum(e["count"] for e in summaries) == CONNECTIONS
    reasons: dict[str, int] = {}
    for e in logged:
        reasons[e["why"]] = reasons.get(e["why"], 0) + 1
    for e in summaries:
        for why, count in e["reasons"].items():
            reasons[why] = reasons.get(why, 0) + count
    per_kind = SPREAD // len(KINDS)
    capped = sum(n for why, n in reasons.items() if "max_pending_connections" in why)
    assert 0 < capped < BURST  # the burst: the first MAX_PENDING wait for the auth timeout
    timeout = f"no message with the run token within {AUTH_TIMEOUT_S:g}s"
    assert reasons.pop(f"{timeout} (coordinator.auth_timeout_s)") == 2 * per_kind + BURST - capped
    assert reasons.pop(f"a line longer than {protocol.MAX_LINE_BYTES} bytes") == per_kind
    assert reasons.pop(protocol.WRONG_TOKEN) == per_kind
    not_json = {why: n for why, n in reasons.items() if why.startswith("not JSON")}
    assert sum(not_json.values()) == per_kind, reasons  # the random bytes
    # Rate-limited: 10 a peer per 2 s window, far fewer lines than connections.
    assert len(logged) < CONNECTIONS // 4
    assert output.count("refused a connection from") == len(logged)
    # Bounded: memory, and open files (the unauthenticated cap plus the run's own).
    assert rss_after - rss_before < RSS_GROWTH_LIMIT_KB
    assert max(fds_seen) <= fds_before + MAX_PENDING + 8, (fds_before, max(fds_seen))
    print(
        f"soak: {CONNECTIONS} connections in {attack_s:.1f}s, {len(logged)} logged, "
        f"{sum(e['count'] for e in summaries)} suppressed, reasons {reasons}, "
        f"RSS {rss_before} -> {rss_after} kB, fds {fds_before} -> max {max(fds_seen)}"
    )
