"""A survivor re-initialising its JAX runtime in place, against a warm standby and a cold process.

    python experiments/inplace_reinit.py [--repeats=3] [--state_mb=42]
    -> experiments/results/inplace_reinit.json

After a slice is lost, the job's next mesh needs a JAX runtime with fewer processes. Three ways
to get one for the process that carries on, timed side by side in one run, each from the moment
it is told to go (detection is the same for all three and not counted) to its first step on the
new mesh:

- in place: the surviving process itself copies its state to host memory, shuts its JAX runtime
  down (`jax.distributed.shutdown`, `jax.extend.backend.clear_backends`) and initialises a
  one-process runtime. `jax_enable_recoverability` is on: without it the shutdown waits at a
  barrier for the dead peer until the heartbeat timeout, then the process is terminated.
- warm standby (the framework's default): a process that has imported JAX and waits; it
  initialises the runtime and reads the state from the RAM-disk copy the survivor wrote (the
  local tier).
- cold process: the same as the standby, started only when told to go.

All three load the same serialized executable of the step, compiled ahead for the one-process
mesh (as the framework's compile-ahead helper does), and put the same state on the devices. The
state is `--state_mb` of float32 arrays sharded over the devices (tiny_cpu's train state is 42 MB);
the step is one elementwise update plus a cross-device mean per array.

Phases: `state_to_host` is the survivor's device-to-host copy of its replica (in place) or the
read of the RAM-disk copy (standby, cold); `shutdown` is the old runtime's shutdown and backend
clearing; `jax_init` the one-process runtime's start; `load` the executable's deserialization;
`step` the first step; `process_start` the interpreter and imports of a cold process.

A last measurement shows the limit of re-initialising in place on this backend: the peer is
SIGKILLed while the survivor is stepping, so the survivor is inside a gloo collective with a dead
peer, and the run reports whether it came out (an error) within `--hang_s` or hung.
"""

from __future__ import annotations

import json
import os
import platform
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import report
from absl import app, flags

_REPEATS = flags.DEFINE_integer("repeats", 3, "Repetitions of each scenario (medians reported).")
_STATE_MB = flags.DEFINE_integer("state_mb", 42, "Size of the train state in MB.")
_HANG_S = flags.DEFINE_float("hang_s", 10.0, "How long a survivor mid-collective is given.")
_OUT = flags.DEFINE_string("out", "experiments/results/inplace_reinit.json", "Result file.")
_ROLE = flags.DEFINE_string("role", "", "Internal: the role of a child process.")
_PROCESS = flags.DEFINE_integer("process", 0, "Internal: the child's JAX process id.")
_PORT = flags.DEFINE_integer("port", 0, "Internal: the coordinator port of the child's job.")
_DIR = flags.DEFINE_string("dir", "", "Internal: where state and executable files live.")

_DEVICES_PER_PROCESS = 2
_ARRAYS = 8
_PHASES = (
    "process_start",
    "state_to_host",
    "shutdown",
    "jax_init",
    "state_to_devices",
    "load",
    "step",
)


# ------------------------------------------------------------------------------ child processes


def _child_env() -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={_DEVICES_PER_PROCESS}",
        "JAX_PLATFORMS": "cpu",
    }


def _jax_setup():
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    return jax


def _shapes(state_mb: int) -> list[tuple[int, int]]:
    rows = state_mb * 2**20 // 4 // 1024 // _ARRAYS
    rows -= rows % (2 * _DEVICES_PER_PROCESS)  # divisible by every mesh's device count
    return [(rows, 1024)] * _ARRAYS


def _step_fn(mesh):
    """A step with a cross-process all-reduce, as the gradient mean across replicas has."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    def update(p):
        return p * 0.999 + jax.lax.pmean(jnp.mean(p), ("replica", "d")) * 0.001

    spec = PartitionSpec("d")
    # check_vma off: the state is the same on every replica, and the all-reduce is the point.
    sharded = jax.shard_map(update, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return jax.jit(lambda state: [sharded(p) for p in state])


def _mesh_and_sharding():
    """Slices on `replica`, each process's devices on `d`: every process holds a whole replica."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array(jax.devices()).reshape(jax.process_count(), -1)
    mesh = Mesh(devices, ("replica", "d"))
    return mesh, NamedSharding(mesh, PartitionSpec("d"))


def _host_replica(a) -> object:
    """This process's replica of `a` in host memory (the device-to-host copy)."""
    import numpy as np

    out = np.empty(a.shape, a.dtype)
    for shard in a.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def _put(host: list, sharding) -> list:
    import jax

    return [jax.device_put(a, sharding) for a in host]


def _load_executable(directory: str, devices) -> object:
    import pickle

    from jax.experimental import serialize_executable

    with open(os.path.join(directory, "step.bin"), "rb") as f:
        payload, in_tree, out_tree = pickle.load(f)
    return serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=devices
    )


_MARK = "@reply "  # gloo writes to stdout too, sometimes with no newline before ours


def _say(**fields) -> None:
    print(f"\n{_MARK}{json.dumps(fields)}", flush=True)


def _role_compile() -> None:
    """Compiles the one-process step ahead and serializes it (the compile-ahead helper's job)."""
    import pickle

    import numpy as np
    from jax.experimental import serialize_executable

    jax = _jax_setup()
    jax.distributed.initialize(f"127.0.0.1:{_PORT.value}", num_processes=1, process_id=0)
    mesh, sharding = _mesh_and_sharding()
    state = _put([np.zeros(s, np.float32) for s in _shapes(_STATE_MB.value)], sharding)
    compiled = _step_fn(mesh).lower(state).compile()
    with open(os.path.join(_DIR.value, "step.bin"), "wb") as f:
        pickle.dump(serialize_executable.serialize(compiled), f)
    _say(compiled=True)


def _role_job() -> None:
    """One process of the two-process job; process 0 survives and then does what it is told."""
    import numpy as np

    jax = _jax_setup()
    jax.distributed.initialize(
        f"127.0.0.1:{_PORT.value}",
        num_processes=2,
        process_id=_PROCESS.value,
        heartbeat_timeout_seconds=60,
    )
    mesh, sharding = _mesh_and_sharding()
    step = _step_fn(mesh)
    state = [
        jax.make_array_from_callback(s, sharding, lambda idx, s=s: np.ones(s, np.float32)[idx])
        for s in _shapes(_STATE_MB.value)
    ]
    for _ in range(3):
        state = step(state)
    jax.block_until_ready(state)
    if _PROCESS.value == 0:  # the local tier's copy on the RAM disk, for the standbys
        for i, a in enumerate(state):
            np.save(os.path.join(_DIR.value, f"state{i}.npy"), _host_replica(a))
    _say(ready=True)
    command = sys.stdin.readline().strip()
    if command == "inplace":
        _in_place(state)
    elif command == "keep_stepping":
        while True:
            state = step(state)
            jax.block_until_ready(state)
            _say(stepped=time.time())


def _in_place(state: list) -> None:
    jax = sys.modules["jax"]
    start = time.perf_counter()
    marks = {}
    host = [_host_replica(a) for a in state]  # every array of its replica, off the devices
    del state
    marks["state_to_host"] = time.perf_counter()
    jax.distributed.shutdown()
    from jax.extend import backend

    backend.clear_backends()
    marks["shutdown"] = time.perf_counter()
    jax.distributed.initialize(f"127.0.0.1:{_PORT.value + 1}", num_processes=1, process_id=0)
    marks["jax_init"] = time.perf_counter()
    _finish_on_new_runtime(host, start, marks)


def _finish_on_new_runtime(host: list, start: float, marks: dict) -> None:
    jax = sys.modules["jax"]
    mesh, sharding = _mesh_and_sharding()
    state = _put(host, sharding)
    jax.block_until_ready(state)
    marks["state_to_devices"] = time.perf_counter()
    step = _load_executable(_DIR.value, list(mesh.devices.flat))
    marks["load"] = time.perf_counter()
    jax.block_until_ready(step(state))
    marks["step"] = time.perf_counter()
    phases, last = {}, start
    for name, mark in sorted(marks.items(), key=lambda item: item[1]):  # in the order they ran
        phases[name] = mark - last
        last = mark
    _say(phases=phases, total=last - start)


def _role_standby() -> None:
    """A process that has imported JAX and waits; told to go, it takes over from the RAM disk."""
    import numpy as np

    jax = _jax_setup()
    _say(ready=True)
    sys.stdin.readline()
    start = time.perf_counter()
    marks = {}
    jax.distributed.initialize(f"127.0.0.1:{_PORT.value}", num_processes=1, process_id=0)
    marks["jax_init"] = time.perf_counter()
    host = [np.load(os.path.join(_DIR.value, f"state{i}.npy")) for i in range(_ARRAYS)]
    marks["state_to_host"] = time.perf_counter()
    _finish_on_new_runtime(host, start, marks)


# --------------------------------------------------------------------------------- orchestrator


class _Child:
    def __init__(self, role: str, directory: str, process: int = 0, port: int = 0) -> None:
        argv = [
            sys.executable,
            os.path.abspath(__file__),
            f"--role={role}",
            f"--process={process}",
            f"--port={port}",
            f"--dir={directory}",
            f"--state_mb={_STATE_MB.value}",
        ]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=_child_env(),
            start_new_session=True,
        )
        self._buffer = ""

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float) -> dict | None:
        """The child's next reply, or None if it gave none for `timeout_s` (or exited)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            line, newline, rest = self._buffer.partition("\n")
            if newline:
                self._buffer = rest
                if _MARK in line:
                    return json.loads(line.split(_MARK, 1)[1])
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)  # unbuffered: select() sees all that is not read yet
            if not chunk:
                return None  # exited
            self._buffer += chunk.decode(errors="replace")

    def expect(self, key: str, timeout_s: float = 120.0) -> dict:
        reply = self.read(timeout_s)
        if reply is None or key not in reply:
            self.kill()
            raise RuntimeError(f"child {self.proc.args[2]} did not answer {key!r}: {reply}")
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _free_ports() -> int:
    """A port P with P + 1 free as well (the in-place runtime's coordinator)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000:
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two adjacent free ports")


def _two_process_job(directory: str) -> tuple[_Child, _Child]:
    port = _free_ports()
    job = (_Child("job", directory, 0, port), _Child("job", directory, 1, port))
    for child in job:
        child.expect("ready")
    return job


def _in_place_run(directory: str) -> dict:
    survivor, peer = _two_process_job(directory)
    peer.kill()
    survivor.send("inplace")
    reply = survivor.expect("phases")
    survivor.kill()
    return reply


def _standby_run(directory: str, cold: bool) -> dict:
    port = _free_ports()
    spawned = time.perf_counter()
    standby = _Child("standby", directory, port=port)
    if not cold:
        standby.expect("ready")
        spawned = time.perf_counter()
    standby.send("go")
    if cold:
        standby.expect("ready")
    reply = standby.expect("phases")
    standby.kill()
    if cold:  # the time before the child could take the command: interpreter and imports
        waited = time.perf_counter() - spawned
        reply["phases"]["process_start"] = waited - reply["total"]
        reply["total"] = waited
    return reply


def _mid_collective_run(directory: str) -> dict:
    survivor, peer = _two_process_job(directory)
    survivor.send("keep_stepping")
    peer.send("keep_stepping")
    survivor.expect("stepped")
    peer.kill()
    killed = time.time()
    last = killed
    while True:
        reply = survivor.read(_HANG_S.value)
        if reply is None:
            break
        last = reply.get("stepped", last)
    alive = survivor.proc.poll() is None
    survivor.kill()
    return {
        "hung": alive,
        "exit_code": None if alive else survivor.proc.returncode,
        "steps_after_kill_s": max(0.0, last - killed),
    }


def _table(rows: dict[str, dict]) -> str:
    header = "| scenario | " + " | ".join(_PHASES) + " | total |"
    lines = [header, "| --- " * (len(_PHASES) + 2) + "|"]
    for name, row in rows.items():
        cells = [f"{row['phases'].get(p, 0.0):.3f}" if p in row["phases"] else "-" for p in _PHASES]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | **{row['total']:.3f}** |")
    return "\n".join(lines)


def _median_row(runs: list[dict]) -> dict:
    phases = {p for r in runs for p in r["phases"]}
    return {
        "phases": {p: statistics.median(r["phases"].get(p, 0.0) for r in runs) for p in phases},
        "total": statistics.median(r["total"] for r in runs),
        "totals": [r["total"] for r in runs],
    }


def main(argv: list[str]) -> None:
    del argv
    roles = {"compile": _role_compile, "job": _role_job, "standby": _role_standby}
    if _ROLE.value:
        roles[_ROLE.value]()
        return
    ram_disk = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = tempfile.mkdtemp(prefix="inplace_", dir=ram_disk)
    try:
        compiler = _Child("compile", directory, port=_free_ports())
        compiler.expect("compiled", timeout_s=300)
        compiler.kill()
        runs: dict[str, list[dict]] = {"in place": [], "warm standby": [], "cold process": []}
        for _ in range(_REPEATS.value):  # interleaved: the machine's load hits all alike
            runs["in place"].append(_in_place_run(directory))
            runs["warm standby"].append(_standby_run(directory, cold=False))
            runs["cold process"].append(_standby_run(directory, cold=True))
        rows = {name: _median_row(r) for name, r in runs.items()}
        mid = _mid_collective_run(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    standby = rows["warm standby"]["total"]
    print(f"State {_STATE_MB.value} MB, {_REPEATS.value} runs each, medians in seconds:\n")
    print(_table(rows))
    for name, row in rows.items():
        print(f"{name}: {row['total'] / standby:.2f}x the warm standby")
    outcome = f"hung for {_HANG_S.value:.0f} s" if mid["hung"] else f"exit {mid['exit_code']}"
    print(f"\nPeer SIGKILLed while the survivor steps: {outcome}")
    result = {
        "state_mb": _STATE_MB.value,
        "repeats": _REPEATS.value,
        "rows": rows,
        "ratio_to_warm_standby": {n: r["total"] / standby for n, r in rows.items()},
        "mid_collective": mid,
        "hang_s": _HANG_S.value,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    report.write_json(_OUT.value, result)


if __name__ == "__main__":
    app.run(main)
