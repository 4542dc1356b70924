"""Fault injection for tests, experiments and demos, driven by a `--chaos` spec string.

Spec: faults separated by `;`, each `kind:key=value,...`. Steps are the step numbers the run logs
(the `step` of `StepInfo`, of the metrics and of `step` events): a fault at step K fires in the
`before_step` call just before step K is taken, so `nan:step=5` makes the step logged as 5 NaN.

    nan:step=K                          the loss of step K is NaN (the step multiplies it by NaN)
    spike:step=K[,factor=F]             the loss (and so the gradient) of step K is F times larger
    slow:process=P,factor=F[,step=K]    from step K (default 1) process P takes F times as long
    hang:process=P,step=K[,mode=M]      process P stops making progress at step K: mode `sleep`
                                        (default) blocks the main thread like a stuck collective,
                                        so the watchdog can see it; mode `stop` SIGSTOPs the whole
                                        process like a frozen host, so only a heartbeat sees it
    kill:process=P,step=K               process P SIGKILLs itself at step K
    lose_slice:slice=S,step=K,for=T     every process of slice S SIGKILLs itself at step K and the
                                        supervisor keeps the slice out for T (seconds; 30s, 2m, 1h)
    corrupt_checkpoint:step=K           at step K, flip bytes in the array files of the newest
                                        committed checkpoint step (persistent tier, and the local
                                        tier when the hook is given its directory)
    random:mtbf=D,seed=N[,kinds=a+b][,count=C]
                                        C (default 100) faults of the given kinds (default
                                        nan+spike+kill+hang+corrupt_checkpoint), seeded,
                                        exponential gaps of mean D, timed from the run's start

A fault with a step fires at the first step >= K that its target takes: a process or slice that
was not running at step K (evicted, or the run resumed past K) gets it when it next runs. Only
nan and spike fire at exactly step K (they must hit every process at one step, see below).

Each fault fires once per run, even across restarts: `<workdir>/chaos_fired.json` records who
fired what in which generation, and a fault recorded in an earlier generation (or by an earlier
incarnation of the same process) is spent. Every injected fault writes a `chaos` event first.

Faults that change the loss (nan, spike) must hit every process at the same step, or replicated
values would diverge. With explicit steps that holds by construction. For a random schedule,
which is timed by the clock, process 0 decides when the time has come and writes the step, a few
steps ahead, into `chaos_fired.json`, which every process polls (a `stat` per step).

The supervisor gets the same spec and calls `supervisor_actions(spec, num_slices)` to learn which
slice outages to honour (and for how long); the `chaos` event of a `lose_slice` names the slice
and its `for_s` as it happens.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from resilient_jax.train.hooks import Hook

if TYPE_CHECKING:
    from resilient_jax.train.context import RunContext
    from resilient_jax.train.state import TrainState

FIRED_FILE = "chaos_fired.json"
SCHEDULE_AHEAD_STEPS = 4  # synchronous processes are at most a couple of steps apart
SPIKE_FACTOR = 100.0
RANDOM_DEFAULT_KINDS = ("nan", "spike", "kill", "hang", "corrupt_checkpoint")
RANDOM_SLOW_FACTOR = 3.0
RANDOM_DEFAULT_COUNT = 100
LOSS_KINDS = ("nan", "spike")  # every process must apply these at the same step
FLIP_BYTES = 16

# kind -> (required keys, optional keys with defaults)
_KINDS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "nan": (("step",), {}),
    "spike": (("step",), {"factor": SPIKE_FACTOR}),
    "slow": (("process", "factor"), {"step": 1}),
    "hang": (("process", "step"), {"mode": "sleep"}),
    "kill": (("process", "step"), {}),
    "lose_slice": (("slice", "step", "for"), {}),
    "corrupt_checkpoint": (("step",), {}),
}
_HANG_MODES = ("sleep", "stop")
_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    key: str  # identity in chaos_fired.json: position in the spec and the text
    text: str
    step: int | None = None  # fires at this step; None: at `at_s`
    at_s: float | None = None  # seconds after the run's start (random schedules)
    process: int | None = None
    slice: int | None = None
    factor: float = 1.0
    for_s: float = 0.0
    mode: str = "sleep"
    wrap: bool = False  # random targets: process/slice taken modulo the live topology

    def target_process(self, num_processes: int) -> int | None:
        if self.process is None:
            return None
        return self.process % num_processes if self.wrap else self.process

    def target_slice(self, num_slices: int) -> int | None:
        if self.slice is None:
            return None
        return self.slice % num_slices if self.wrap else self.slice


@dataclasses.dataclass(frozen=True)
class SliceOutage:
    """For the supervisor: slice `slice` goes down at `step` (or `at_s` seconds into the run)
    and must not be given processes again for `duration_s` seconds."""

    slice: int
    duration_s: float
    step: int | None = None
    at_s: float | None = None


# ---------------------------------------------------------------------------- parsing


def _bad(part: str, why: str) -> ValueError:
    return ValueError(f"invalid --chaos spec {part!r}: {why}")


def _parse_int(part: str, key: str, value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise _bad(part, f"{key}={value!r} is not an integer") from None
    if number < minimum:
        raise _bad(part, f"{key}={number} must be >= {minimum}")
    return number


def _parse_float(part: str, key: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise _bad(part, f"{key}={value!r} is not a number") from None
    if not (math.isfinite(number) and number > 0):
        raise _bad(part, f"{key}={value!r} must be a positive number")
    return number


def parse_duration(part: str, key: str, value: str) -> float:
    """Seconds from `30`, `30s`, `2m` or `1.5h`."""
    scale = _DURATION_UNITS.get(value[-1:])
    try:
        seconds = float(value[:-1] if scale else value) * (scale or 1.0)
    except ValueError:
        seconds = -1.0
    if not (math.isfinite(seconds) and seconds > 0):
        raise _bad(part, f"{key}={value!r} is not a duration like 30s, 2m or 1h")
    return seconds


def _split_fields(part: str, body: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise _bad(part, f"{item!r} is not key=value")
        if key.strip() in fields:
            raise _bad(part, f"{key.strip()} given twice")
        fields[key.strip()] = value.strip()
    return fields


def _parse_fault(part: str, index: int) -> Fault:
    kind, _, body = part.partition(":")
    kind = kind.strip()
    if kind not in _KINDS:
        allowed = ", ".join([*_KINDS, "random"])
        raise _bad(part, f"unknown kind {kind!r}; allowed: {allowed}")
    required, optional = _KINDS[kind]
    fields = _split_fields(part, body)
    missing = [k for k in required if k not in fields]
    if missing:
        raise _bad(part, f"{kind} needs {', '.join(f'{k}=' for k in missing)}")
    unknown = sorted(set(fields) - set(required) - set(optional))
    if unknown:
        allowed = ", ".join([*required, *optional])
        raise _bad(part, f"unknown key {unknown[0]!r} for {kind}; allowed: {allowed}")
    values: dict[str, Any] = {**optional}
    for key, value in fields.items():
        if key == "step":
            values[key] = _parse_int(part, key, value, 1)
        elif key in ("process", "slice"):
            values[key] = _parse_int(part, key, value, 0)
        elif key == "factor":
            values[key] = _parse_float(part, key, value)
        elif key == "for":
            values["for_s"] = parse_duration(part, key, value)
        elif key == "mode":
            if value not in _HANG_MODES:
                raise _bad(part, f"mode={value!r}; allowed: {', '.join(_HANG_MODES)}")
            values[key] = value
    if kind == "slow" and values["factor"] <= 1.0:
        raise _bad(part, "slow needs factor > 1")
    return Fault(kind=kind, key=f"{index}:{part}", text=part, **values)


def _parse_random(part: str, index: int) -> list[Fault]:
    fields = _split_fields(part, part.partition(":")[2])
    for key in ("mtbf", "seed"):
        if key not in fields:
            raise _bad(part, f"random needs {key}=")
    unknown = sorted(set(fields) - {"mtbf", "seed", "kinds", "count"})
    if unknown:
        allowed = "mtbf, seed, kinds, count"
        raise _bad(part, f"unknown key {unknown[0]!r} for random; allowed: {allowed}")
    mtbf = parse_duration(part, "mtbf", fields["mtbf"])
    seed = _parse_int(part, "seed", fields["seed"], 0)
    count = _parse_int(part, "count", fields.get("count", str(RANDOM_DEFAULT_COUNT)), 1)
    kinds = tuple(fields["kinds"].split("+")) if "kinds" in fields else RANDOM_DEFAULT_KINDS
    for kind in kinds:
        if kind not in _KINDS:
            raise _bad(part, f"unknown kind {kind!r} in kinds; allowed: {', '.join(_KINDS)}")
    rng = random.Random(seed)
    faults, at_s = [], 0.0
    for j in range(count):
        at_s += rng.expovariate(1.0 / mtbf)
        kind = rng.choice(kinds)
        target = rng.randrange(1 << 16)
        fault = Fault(
            kind=kind,
            key=f"{index}:random#{j}:{kind}",
            text=f"{kind} (random #{j} of {part})",
            at_s=round(at_s, 3),
            process=target if kind in ("slow", "hang", "kill") else None,
            slice=target if kind == "lose_slice" else None,
            factor={"spike": SPIKE_FACTOR, "slow": RANDOM_SLOW_FACTOR}.get(kind, 1.0),
            for_s=mtbf / 2 if kind == "lose_slice" else 0.0,
            wrap=True,
        )
        faults.append(fault)
    return faults


def parse(spec: str) -> list[Fault]:
    """All faults of a spec, in order. Raises ValueError naming the bad part."""
    faults: list[Fault] = []
    for index, part in enumerate(p.strip() for p in spec.split(";")):
        if not part:
            continue
        if part.partition(":")[0].strip() == "random":
            faults.extend(_parse_random(part, index))
        else:
            faults.append(_parse_fault(part, index))
    return faults


def supervisor_actions(spec: str, num_slices: int = 1) -> list[SliceOutage]:
    """What the supervisor itself must do for a spec: hold lost slices out for their duration.

    Kills and hangs need nothing beyond the supervisor's usual failure handling. For random
    schedules the slice is resolved against `num_slices`; the `chaos` event is authoritative.
    """
    return [
        SliceOutage(slice=f.target_slice(num_slices), duration_s=f.for_s, step=f.step, at_s=f.at_s)
        for f in parse(spec)
        if f.kind == "lose_slice"
    ]


# ---------------------------------------------------------------------- fired record


class FiredRecord:
    """`chaos_fired.json`: the run's start time, who fired which fault, scheduled loss faults.

    Writers take an exclusive `flock` on a side file and replace the JSON atomically, so readers
    never need the lock and several processes can share one workdir.
    """

    def __init__(self, workdir: str) -> None:
        self.path = os.path.join(workdir, FIRED_FILE)
        self._lock_path = self.path + ".lock"
        self._cache: tuple[float, dict[str, Any]] | None = None

    def read(self) -> dict[str, Any]:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            data = {}
        data.setdefault("fired", {})
        data.setdefault("scheduled", {})
        return data

    def read_if_changed(self) -> dict[str, Any]:
        """The record, re-read only when the file's mtime moved (cheap to call every step)."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            mtime = -1
        if self._cache is None or self._cache[0] != mtime:
            self._cache = (mtime, self.read())
        return self._cache[1]

    def update(self, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self.read()
            change(data)
            tmp = f"{self.path}.tmp.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        return data


def is_spent(data: dict[str, Any], fault: Fault, generation: int, process: int, pid: int) -> bool:
    """Fired in an earlier generation, or by an earlier incarnation of this process."""
    records = data["fired"].get(fault.key, {})
    if any(r["generation"] < generation for r in records.values()):
        return True
    mine = records.get(str(process))
    return mine is not None and mine["pid"] != pid


# ------------------------------------------------------------------ checkpoint damage


def newest_committed_step(root: str) -> str | None:
    """The directory of the newest committed step under a checkpoint root (Orbax layout:
    committed steps are plain integer names; in-progress ones carry a tmp suffix)."""
    try:
        names = [n for n in os.listdir(root) if n.isdigit() and os.path.isdir(f"{root}/{n}")]
    except FileNotFoundError:
        return None
    return os.path.join(root, max(names, key=int)) if names else None


def _is_array_file(path: str) -> bool:
    name = os.path.basename(path)
    if name.startswith(("_", ".")) or name.endswith(".json") or name == "commit_success.txt":
        return False
    return name != "manifest.ocdbt" and "array_metadatas" not in path.split(os.sep)


def corrupt_step(step_dir: str) -> list[str]:
    """Flips `FLIP_BYTES` bytes in the middle of every array data file of a checkpoint step
    (OCDBT `d/` files or zarr chunks), leaving the metadata readable so that only a content
    check can tell. Returns the files changed."""
    changed = []
    for folder, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in sorted(files):
            path = os.path.join(folder, name)
            size = os.path.getsize(path)
            if not _is_array_file(path) or size == 0:
                continue
            offset = max(0, size // 2 - FLIP_BYTES // 2)
            with open(path, "r+b") as f:
                f.seek(offset)
                data = f.read(FLIP_BYTES)
                f.seek(offset)
                f.write(bytes(b ^ 0xFF for b in data))
            changed.append(path)
    return changed


def persistent_checkpoint_root(ctx: RunContext) -> str | None:
    configured = ctx.config.checkpoint.dir
    if configured.startswith("gs://"):
        return None  # object storage: nothing to flip bytes in from here
    return configured or os.path.join(ctx.workdir, "checkpoints")


# ---------------------------------------------------------------------------- the hook


def _block_forever() -> None:
    while True:
        threading.Event().wait(3600)


class ChaosHook(Hook):
    """Injects the faults of a spec. `local_checkpoint_dir`: this process's local tier root
    (holding `<step>/state`), also corrupted by `corrupt_checkpoint`."""

    def __init__(
        self,
        spec: str,
        *,
        local_checkpoint_dir: str | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        block_forever: Callable[[], None] = _block_forever,
    ) -> None:
        self.faults = parse(spec)
        self._local_dir = local_checkpoint_dir
        self._clock = clock
        self._sleep = sleep
        self._block_forever = block_forever
        self._done: set[str] = set()  # fired or spent in this process
        self._slow_factor = 1.0
        self._record: FiredRecord | None = None
        self._start_time = 0.0
        self._last_before: float | None = None
        self._last_sleep = 0.0

    def on_start(self, ctx: RunContext, state: TrainState) -> None:
        if self.faults:
            self._open(ctx)  # pins the run's start time for random schedules

    def _open(self, ctx: RunContext) -> FiredRecord:
        if self._record is None:
            self._record = FiredRecord(ctx.workdir)
            data = self._record.update(lambda d: d.setdefault("start_time", self._clock()))
            self._start_time = data["start_time"]
        return self._record

    def before_step(self, ctx: RunContext, step: int) -> float:
        # The loop passes the steps completed so far; faults name the step about to be taken,
        # the number its metrics and `step` event will carry.
        if not self.faults:
            return 1.0
        step += 1
        record = self._open(ctx)
        self._slow_down()
        scale = 1.0
        for fault in self.faults:
            if fault.key in self._done or not self._due(fault, ctx, step, record):
                continue
            self._done.add(fault.key)
            if not self._targets_me(fault, ctx):
                continue
            if self._claim(fault, ctx, step, record):
                scale *= self._inject(fault, ctx, step)
        return scale

    def _due(self, fault: Fault, ctx: RunContext, step: int, record: FiredRecord) -> bool:
        if fault.step is not None:
            return step == fault.step if fault.kind in LOSS_KINDS else step >= fault.step
        elapsed = self._clock() - self._start_time
        if fault.kind not in LOSS_KINDS:
            return elapsed >= (fault.at_s or 0.0)
        scheduled = record.read_if_changed()["scheduled"].get(fault.key)
        if scheduled is None and ctx.topology.process_index == 0 and elapsed >= fault.at_s:
            at_step = step + SCHEDULE_AHEAD_STEPS
            record.update(lambda d: d["scheduled"].setdefault(fault.key, at_step))
            return False
        return scheduled == step

    def _targets_me(self, fault: Fault, ctx: RunContext) -> bool:
        topo = ctx.topology
        process = fault.target_process(topo.num_processes)
        if process is not None:
            return process == topo.process_index
        slice_ = fault.target_slice(topo.num_slices)
        if slice_ is not None:
            return slice_ == topo.slice_index
        return True

    def _claim(self, fault: Fault, ctx: RunContext, step: int, record: FiredRecord) -> bool:
        """Records this process firing `fault`, unless it is spent; True if it should fire."""
        me, pid, generation = ctx.topology.process_index, os.getpid(), ctx.generation
        claimed = False

        def change(data: dict[str, Any]) -> None:
            nonlocal claimed
            if is_spent(data, fault, generation, me, pid):
                return
            data["fired"].setdefault(fault.key, {})[str(me)] = {
                "generation": generation,
                "pid": pid,
                "step": step,
                "time": self._clock(),
            }
            claimed = True

        record.update(change)
        return claimed

    def _inject(self, fault: Fault, ctx: RunContext, step: int) -> float:
        """Acts out one fault; returns its factor on the step's loss."""
        info: dict[str, Any] = {"kind": fault.kind, "fault": fault.text, "step": step}
        if fault.kind in ("spike", "slow"):
            info["factor"] = fault.factor
        elif fault.kind == "hang":
            info["mode"] = fault.mode
        elif fault.kind == "lose_slice":
            info.update(slice=ctx.topology.slice_index, for_s=fault.for_s)
        elif fault.kind == "corrupt_checkpoint":
            files, corrupted = self._corrupt(ctx)
            info.update(checkpoint=corrupted, files=len(files))
        ctx.events.emit("chaos", **info)

        if fault.kind == "nan":
            return float("nan")
        if fault.kind == "spike":
            return fault.factor
        if fault.kind == "slow":
            self._slow_factor = fault.factor
        elif fault.kind == "hang":
            if fault.mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                self._block_forever()
        elif fault.kind in ("kill", "lose_slice"):
            os.kill(os.getpid(), signal.SIGKILL)
        return 1.0

    def _corrupt(self, ctx: RunContext) -> tuple[list[str], list[str]]:
        roots = [self._local_dir] if self._local_dir else []
        if ctx.topology.process_index == 0:  # the persistent tier is shared: one writer
            roots.append(persistent_checkpoint_root(ctx))
        files, steps = [], []
        for root in filter(None, roots):
            step_dir = newest_committed_step(root)
            if step_dir:
                files += corrupt_step(step_dir)
                steps.append(step_dir)
        return files, steps

    def _slow_down(self) -> None:
        """Stretches this process's step time by the slow factor, measured without our sleep."""
        now = self._clock()
        if self._slow_factor > 1.0 and self._last_before is not None:
            natural = max(0.0, now - self._last_before - self._last_sleep)
            self._last_sleep = (self._slow_factor - 1.0) * natural
            self._sleep(self._last_sleep)
        self._last_before = now
