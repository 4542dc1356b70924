"""Run one experiment as a multi-process JAX job on this machine, with slices simulated.

    python launch/local_cluster.py --config=configs/tiny_cpu.py --workdir=/tmp/run \
        --num_slices=2 --processes_per_slice=1 --devices_per_process=2 [--spare_slices=1] \
        [--chaos='lose_slice:slice=1,step=30,for=20s'] [--config.total_steps=100]
        [--chaos='lose_host:slice=1,step=30,for=20s'] [--host_agents=external --listen=IP:PORT]

Starts num_slices x processes_per_slice workers (`--worker`, by default `launch/train.py`), each
with devices_per_process CPU devices, through one host agent per slice (`--host_agents=local`, or
agents started elsewhere with `--host_agents=external --listen=ADDR`), watches them and keeps the
job training through failures (see `resilient_jax.control`). The run's token comes from RJ_RUN_TOKEN
or RJ_RUN_TOKEN_FILE (mode 0600), else a fresh one is made for local agents. Worker output is kept
in DIR/logs/<host>/workers.log and followed here, each line prefixed with `[g<generation> s<slice>
p<process>]`. Local agents hold no pipe to this process: if it dies they and their workers train on,
and the same command (with the same run token) adopts them, starting agents only for hosts that have
none; with no supervisor for coordinator.orphan_timeout_s the agents have their workers save and
stop, and exit 6. With `--config.elastic.enabled=true` each slice is its own JAX runtime of
processes_per_slice processes (`resilient_jax.control.elastic`, DIR/slices/<id>/), and a lost slice
is replaced while the others train on; if this process dies, the slices train on, and the same
command (with the same run token) takes them over. Ctrl-C asks the workers to save and stop. Exits 0
only when training completed; otherwise non-zero with a one-line reason on stderr. Events:
DIR/events.jsonl.
"""

from __future__ import annotations

import os
import shlex
import sys

from absl import app, flags
from ml_collections import config_flags

from resilient_jax import config as config_lib
from resilient_jax.chaos import spec as chaos_spec
from resilient_jax.config import command_line
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.control import ClusterSpec, Supervisor, SupervisorAction
from resilient_jax.control.elastic import ElasticSupervisor

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (configs/*.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory shared by all workers.")
_NUM_SLICES = flags.DEFINE_integer("num_slices", 1, "Slices the job runs on.")
_PROCESSES = flags.DEFINE_integer("processes_per_slice", 1, "JAX processes per slice.")
_DEVICES = flags.DEFINE_integer("devices_per_process", 1, "CPU devices per process.")
_SPARES = flags.DEFINE_integer("spare_slices", 0, "Idle slices that replace lost ones.")
_CHAOS = flags.DEFINE_string("chaos", "", "Fault injection spec, passed to the workers.")
_WORKER = flags.DEFINE_string(
    "worker",
    "launch/train.py",
    "Worker program and its own flags, run with this Python: a script path or -m module.",
)
_TIME_LIMIT = flags.DEFINE_float("time_limit_s", 0.0, "Stop (asking for a save) after; 0 = none.")
_HOST_AGENTS = flags.DEFINE_enum(
    "host_agents",
    "local",
    ["local", "external"],
    "local: start one host agent per slice here; external: wait for agents started elsewhere "
    "(python -m resilient_jax.control.agent) to register.",
)
_LISTEN = flags.DEFINE_string(
    "listen",
    None,
    "host:port of the control channel (default: loopback, any port; after a restart the address "
    "in WORKDIR/supervisor.json).",
)
flags.mark_flags_as_required(["config", "workdir"])


def config_overrides(argv: list[str]) -> list[str]:
    """The `--config.key=value` flags of our command line, for the workers to get the same."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("--config."):
            has_value = "=" in arg or i + 1 >= len(argv) or argv[i + 1].startswith("--")
            out.append(arg if has_value else f"{arg}={argv[i + 1]}")
    return out


def worker_argv(worker: str, config_path: str, workdir: str, overrides: list[str]) -> list[str]:
    argv = [sys.executable, *shlex.split(worker), f"--config={config_path}", f"--workdir={workdir}"]
    argv += overrides
    if _CHAOS.value:
        argv.append(f"--chaos={_CHAOS.value}")
    return argv


def run_elastic(config, argv: list[str], workdir: str) -> int:
    """Elastic mode: elastic.slices slices of --processes_per_slice processes, each slice its own
    JAX runtime, and the quorum server here; a lost slice is replaced while the others train on."""
    if _HOST_AGENTS.value != "local" or _SPARES.value:
        print(
            "error: elastic.enabled runs its slices on this machine and keeps its own warm "
            "standby (--host_agents=local, no --spare_slices; see elastic.standby)",
            file=sys.stderr,
        )
        return ExitCode.BAD_INPUT

    def argv_for(slice_id: int, slice_dir: str) -> list[str]:
        return [f"--workdir={slice_dir}" if a.startswith("--workdir=") else a for a in argv]

    # A supervisor started again takes over the slices still running in `workdir`.
    supervisor = ElasticSupervisor(
        config, argv_for, workdir, _DEVICES.value, processes_per_slice=_PROCESSES.value
    )
    result = supervisor.run(time_limit_s=_TIME_LIMIT.value or None)
    if result.exit_code:
        print(f"error: {result.reason}", file=sys.stderr)
    return result.exit_code


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config = _CONFIG.value
    try:
        config_lib.validate(config)
        if _CHAOS.value:
            chaos_spec.supervisor_actions(_CHAOS.value, _NUM_SLICES.value)  # reject a bad spec now
        cluster = ClusterSpec(_NUM_SLICES.value, _PROCESSES.value, _DEVICES.value, _SPARES.value)
        # Host faults are the supervisor's to carry out, through the hosts' agents.
        actions = [
            SupervisorAction(
                f.kind,
                f.target_slice(cluster.num_slices + cluster.spare_slices) or 0,
                at_step=f.step,
                at_s=f.at_s if f.step is None else None,
                duration_s=f.for_s,
            )
            for f in chaos_spec.host_faults(_CHAOS.value)
        ]
    except ValueError as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        sys.exit(ExitCode.BAD_INPUT)
    workdir = os.path.abspath(_WORKDIR.value)
    # As given (with any `:argument`); the workers start in our working directory.
    config_path = config_flags.get_config_filename(flags.FLAGS["config"])
    argv = worker_argv(_WORKER.value, config_path, workdir, config_overrides(sys.argv))
    if config.elastic.enabled:
        sys.exit(run_elastic(config, argv, workdir))
    supervisor = Supervisor(
        config,
        cluster,
        argv,
        workdir,
        actions=actions,
        host_agents=_HOST_AGENTS.value,
        listen=_LISTEN.value,
    )
    result = supervisor.run(time_limit_s=_TIME_LIMIT.value or None)
    if result.exit_code:
        print(f"error: {result.reason}", file=sys.stderr)
    sys.exit(result.exit_code)


if __name__ == "__main__":
    app.run(main, flags_parser=command_line.parse_flags)
