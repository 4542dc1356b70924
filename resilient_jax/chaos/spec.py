"""The `--chaos` spec: faults separated by `;`, each `kind:key=value,...`. Jax-free, so the
supervisor and launchers can check a spec without loading a device runtime.

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

The kinds, their keys and defaults are the vocabulary of `resilient_jax.contracts.faults`.
The supervisor gets the same spec and calls `supervisor_actions(spec, num_slices)` to learn which
slice outages to honour (and for how long).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

from resilient_jax.config import BadInput
from resilient_jax.contracts.faults import (
    HANG_MODES,
    HOST_FAULT_KINDS,
    KEYS,
    SPIKE_FACTOR,
    FaultKind,
)

RANDOM_DEFAULT_KINDS = (
    FaultKind.NAN,
    FaultKind.SPIKE,
    FaultKind.KILL,
    FaultKind.HANG,
    FaultKind.CORRUPT_CHECKPOINT,
)
RANDOM_SLOW_FACTOR = 3.0
RANDOM_DEFAULT_COUNT = 100
_RANDOM_KEYS = ("mtbf", "seed", "kinds", "count")
_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: FaultKind
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


class FaultSpecError(BadInput, ValueError):
    """A `--chaos` spec that does not parse: fatal, like any bad flag."""


def _bad(part: str, why: str) -> FaultSpecError:
    return FaultSpecError(f"invalid --chaos spec {part!r}: {why}")


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


def _kind(part: str, name: str, where: str = "") -> FaultKind:
    """The single fault kind `name` (not `random`), or a ValueError listing the allowed ones."""
    if name not in KEYS:
        allowed = [*KEYS] if where else [*KEYS, FaultKind.RANDOM]
        raise _bad(part, f"unknown kind {name!r}{where}; allowed: {', '.join(allowed)}")
    return FaultKind(name)


def _parse_fault(part: str, index: int) -> Fault:
    name, _, body = part.partition(":")
    kind = _kind(part, name.strip())
    required, optional = KEYS[kind]
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
            if value not in HANG_MODES:
                raise _bad(part, f"mode={value!r}; allowed: {', '.join(HANG_MODES)}")
            values[key] = value
    if kind == FaultKind.SLOW and values["factor"] <= 1.0:
        raise _bad(part, "slow needs factor > 1")
    return Fault(kind=kind, key=f"{index}:{part}", text=part, **values)


def _random_fault(
    kind: FaultKind, index: int, j: int, part: str, at_s: float, target: int, mtbf: float
) -> Fault:
    """Fault `j` of a random schedule; its target is taken modulo the live topology."""
    required = KEYS[kind][0]
    return Fault(
        kind=kind,
        key=f"{index}:random#{j}:{kind}",
        text=f"{kind} (random #{j} of {part})",
        at_s=round(at_s, 3),
        process=target if "process" in required else None,
        slice=target if "slice" in required else None,
        factor={FaultKind.SPIKE: SPIKE_FACTOR, FaultKind.SLOW: RANDOM_SLOW_FACTOR}.get(kind, 1.0),
        for_s=mtbf / 2 if "for" in required else 0.0,
        wrap=True,
    )


def _parse_random(part: str, index: int) -> list[Fault]:
    fields = _split_fields(part, part.partition(":")[2])
    for key in ("mtbf", "seed"):
        if key not in fields:
            raise _bad(part, f"random needs {key}=")
    unknown = sorted(set(fields) - set(_RANDOM_KEYS))
    if unknown:
        allowed = ", ".join(_RANDOM_KEYS)
        raise _bad(part, f"unknown key {unknown[0]!r} for random; allowed: {allowed}")
    mtbf = parse_duration(part, "mtbf", fields["mtbf"])
    seed = _parse_int(part, "seed", fields["seed"], 0)
    count = _parse_int(part, "count", fields.get("count", str(RANDOM_DEFAULT_COUNT)), 1)
    if "kinds" in fields:
        kinds = tuple(_kind(part, k, " in kinds") for k in fields["kinds"].split("+"))
    else:
        kinds = RANDOM_DEFAULT_KINDS
    rng = random.Random(seed)
    faults, at_s = [], 0.0
    for j in range(count):
        at_s += rng.expovariate(1.0 / mtbf)
        kind = rng.choice(kinds)
        faults.append(_random_fault(kind, index, j, part, at_s, rng.randrange(1 << 16), mtbf))
    return faults


def parse(spec: str) -> list[Fault]:
    """All faults of a spec, in order. Raises ValueError naming the bad part."""
    faults: list[Fault] = []
    for index, part in enumerate(p.strip() for p in spec.split(";")):
        if not part:
            continue
        if part.partition(":")[0].strip() == FaultKind.RANDOM:
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
        if f.kind == FaultKind.LOSE_SLICE
    ]


def host_faults(spec: str) -> list[Fault]:
    """The host faults of a spec (`lose_host`, `freeze_host`, `partition_host`): the supervisor
    carries them out through the agents; workers skip them."""
    return [f for f in parse(spec) if f.kind in HOST_FAULT_KINDS]
