"""The supervisor's control port under hostile connections while a run trains: what they cost.

    python experiments/control_port_soak.py [--connections=1000] [--concurrency=24]

A `launch/local_cluster.py` run (2 slices of the simulated worker, 0.05 s steps, the run token
set) is attacked from 127.0.0.1 once it trains: `--connections` connections of every kind of
`resilient_jax.testing.hostile_clients` (silent, trickling, over-long, wrong token, random
bytes), `--concurrency` at a time, then a burst of `--burst` silent ones at once (over the cap
on unauthenticated connections). Measured: the attack's rate, the run's step rate before and
during it, the supervisor's resident memory and open files (before, peak, after), how the
refusals were reported (one by one, or counted in a window's summary), and whether the run still
ended as an undisturbed one does (exit 0, every step, the exact final value).
Writes experiments/results/control_port_soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from resilient_jax.control import agent_protocol, protocol  # noqa: E402
from resilient_jax.events import read_events  # noqa: E402
from resilient_jax.testing.hostile_clients import KINDS, attack, open_fds, rss_kb  # noqa: E402

BATCH = 8


def _expected_value(total_steps: int) -> float:
    """The simulated worker's state after `total_steps` (its contract: sum of the batch rows)."""
    return sum(float(sum(range(s * BATCH, (s + 1) * BATCH))) * 1e-6 for s in range(total_steps))


def _step(workdir: str) -> int:
    try:
        with open(os.path.join(workdir, "sim_state.json")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError):
        return 0


def _config(path: str, args: argparse.Namespace) -> None:
    keys = {
        "total_steps": args.total_steps,
        "global_batch_size": BATCH,
        "checkpoint.every_steps": 50,
        "coordinator.probe_jax": False,
        "coordinator.auth_timeout_s": args.auth_timeout_s,
        "coordinator.max_pending_connections": args.max_pending,
        "coordinator.refusal_log_window_s": 2.0,
    }
    lines = [f"    c.{key} = {value!r}" for key, value in keys.items()]
    with open(path, "w") as f:
        f.write(
            "from resilient_jax.config import default_config\n\n\ndef get_config():\n"
            "    c = default_config()\n" + "\n".join(lines) + "\n    return c\n"
        )


def run(args: argparse.Namespace) -> dict:
    root = tempfile.mkdtemp(prefix="rj-soak-")
    workdir, config_path = os.path.join(root, "run"), os.path.join(root, "config.py")
    _config(config_path, args)
    env = {**os.environ, "RJ_RUN_TOKEN": "soak-token-0123", "PYTHONPATH": REPO}
    with open(os.path.join(root, "supervisor.log"), "w") as log:
        supervisor = subprocess.Popen(
            [
                sys.executable,
                os.path.join(REPO, "launch", "local_cluster.py"),
                f"--config={config_path}",
                f"--workdir={workdir}",
                "--num_slices=2",
                f"--worker=-m resilient_jax.testing.sim_worker --sim_step_time_s={args.step_s}",
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while _step(workdir) < 5:
            if supervisor.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the run never trained: see {root}/supervisor.log")
            time.sleep(0.05)
        address = protocol.split_address(agent_protocol.read_supervisor_address(workdir))
        first, started = _step(workdir), time.monotonic()
        time.sleep(args.baseline_s)
        steps_per_s_before = (_step(workdir) - first) / (time.monotonic() - started)
        rss = [rss_kb(supervisor.pid)]
        fds = [open_fds(supervisor.pid)]

        def sample() -> None:
            rss.append(rss_kb(supervisor.pid))
            fds.append(open_fds(supervisor.pid))

        first, started = _step(workdir), time.monotonic()
        spread = [KINDS[i % len(KINDS)] for i in range(args.connections - args.burst)]
        outcomes = attack(address, spread, args.concurrency, while_running=sample)
        outcomes += attack(
            address, ["silent"] * args.burst, args.burst, seed=len(spread), while_running=sample
        )
        attack_s = time.monotonic() - started
        steps_during = _step(workdir) - first
        rss_after = rss_kb(supervisor.pid)
        exit_code = supervisor.wait(timeout=600)
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
            supervisor.wait()
    events = [e for e in read_events(workdir) if e.get("source") == "supervisor"]
    logged = [e for e in events if e["type"] == "connection_refused"]
    summaries = [e for e in events if e["type"] == "connection_refusals_suppressed"]
    with open(os.path.join(workdir, "sim_state.json")) as f:
        state = json.load(f)
    return {
        "machine": report.host_line(f", load {os.getloadavg()[0]:.1f}"),
        "connections": len(outcomes),
        "concurrency": args.concurrency,
        "burst": args.burst,
        "auth_timeout_s": args.auth_timeout_s,
        "max_pending_connections": args.max_pending,
        "attack_s": attack_s,
        "connections_per_s": len(outcomes) / attack_s,
        "kept_open": sum(not o.closed for o in outcomes),
        "answered": sum(bool(o.answered) for o in outcomes),
        "refusals_logged": len(logged),
        "refusals_suppressed": sum(e["count"] for e in summaries),
        "steps_per_s_before": steps_per_s_before,
        "steps_per_s_during": steps_during / attack_s,
        "supervisor_rss_kb": {"before": rss[0], "peak": max(rss), "after": rss_after},
        "supervisor_fds": {"before": fds[0], "peak": max(fds)},
        "exit_code": exit_code,
        "steps": state["step"],
        "final_value_exact": abs(state["value"] - _expected_value(args.total_steps)) < 1e-9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--burst", type=int, default=100)
    parser.add_argument("--auth_timeout_s", type=float, default=0.5)
    parser.add_argument("--max_pending", type=int, default=32)
    parser.add_argument("--step_s", type=float, default=0.05)
    parser.add_argument("--total_steps", type=int, default=800)
    parser.add_argument("--baseline_s", type=float, default=3.0)
    parser.add_argument(
        "--out", default=os.path.join(REPO, "experiments", "results", "control_port_soak.json")
    )
    result = run(parser.parse_args())
    rows = [
        (
            "connections (kept open, answered)",
            f"{result['connections']} ({result['kept_open']}, {result['answered']})",
        ),
        ("attack", f"{result['attack_s']:.1f} s, {result['connections_per_s']:.0f}/s"),
        (
            "refusals logged / counted",
            f"{result['refusals_logged']} / {result['refusals_suppressed']}",
        ),
        (
            "steps/s before / during",
            f"{result['steps_per_s_before']:.1f} / {result['steps_per_s_during']:.1f}",
        ),
        (
            "supervisor RSS kB before/peak/after",
            "/".join(str(v) for v in result["supervisor_rss_kb"].values()),
        ),
        ("supervisor fds before/peak", "/".join(str(v) for v in result["supervisor_fds"].values())),
        (
            "exit, steps, final value exact",
            f"{result['exit_code']}, {result['steps']}, {result['final_value_exact']}",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    report.write_json(parser.parse_args().out, result)


if __name__ == "__main__":
    main()
