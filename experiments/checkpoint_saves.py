"""The saves the checkpoint benchmarks time on one state, each by the same clock: the framework's
tiers and the plain Orbax saves and copies they are judged against.

Used by `bench_checkpoint.py` (CPU devices) and `gpu_check.py` (one accelerator). `SaveKinds`
owns one checkpointer per tier setting, all reading the state the caller's train step produced
and keeping (or not) through that step's `StateKeeper`:

- `local`, `persistent`: the checkpointer's RAM-disk tier and its persistent tier (async Orbax
  plus per-array digests in a writer thread), both reading the state itself, which the next step
  keeps (`train.keep`: it runs without donating);
- `local_copy`: the local tier copying the state first (`copying`: the one switch between the
  kept and the copying save), on the device (what a save does until the non-donating step is
  loaded);
- `local_host`, `persistent_host`: each tier with `checkpoint.keep_state=never`, the state
  copied straight to pinned host memory first (what `auto` picks where a kept state would not
  fit the device's memory);
- `orbax_async`: a plain async Orbax `CheckpointManager` save; `orbax_sync`: a plain synchronous
  Orbax save (`Checkpointer(StandardCheckpointHandler)`);
- `snapshot`: the device copy a copying save makes, waited for; `device_to_host`: the whole state
  copied to host memory (`jax.device_get`), what any save must move off the devices.

`save` returns the time the caller was blocked (for the tiers: the hook's `after_step`, what the
loop waits for); commit times come from the tiers' `save_committed` events (`commit_s`) and, for
plain async Orbax, from waiting for it right after the save.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from resilient_jax import mesh as mesh_lib
from resilient_jax import topology as topology_lib
from resilient_jax.checkpoint import Checkpointer
from resilient_jax.checkpoint.snapshot import device_snapshot
from resilient_jax.events import EventLog, read_events
from resilient_jax.run import prepare
from resilient_jax.train.context import RunContext
from resilient_jax.train.hooks import StepInfo
from resilient_jax.train.keep import StateKeeper
from resilient_jax.train.state import abstract_state

# The checkpointer's saves.
TIERS = ("local", "persistent", "local_copy", "local_host", "persistent_host")
PLAIN = ("orbax_async", "orbax_sync", "snapshot", "device_to_host")  # what they are judged against
SAVE_KINDS = TIERS + PLAIN


def context(
    base: ml_collections.ConfigDict,
    workdir: str,
    local_root: str,
    local: bool,
    persistent_every: int,
    devices: list[Any] | None = None,
    keep_state: str = "always",
) -> RunContext:
    """A run context of `base` saving to the local tier under `local_root` every step (`local`)
    and to the persistent tier in `workdir` every `persistent_every` steps (0: never); on
    `devices` (default: all)."""
    config = base.copy_and_resolve_references()
    config.checkpoint.local_dir = local_root if local else ""
    config.checkpoint.local_every_steps = 1 if local else 0
    config.checkpoint.local_auto_interval = False
    config.checkpoint.every_steps = persistent_every
    config.checkpoint.keep_state = keep_state
    if devices is None:
        return prepare(config, workdir, EventLog(workdir))
    topology = mesh_lib.discover(devices)
    plan = topology_lib.plan_mesh(config, topology)
    mesh = mesh_lib.make_mesh(plan, topology)
    return RunContext(
        config, workdir, topology, plan, mesh, EventLog(workdir), abstract_state(config, mesh)
    )


def copying(ctx: RunContext) -> RunContext:
    """`ctx` whose saves copy the state instead of keeping it: a keeper no step answers, so every
    save falls back to `device_snapshot` (what a save does while the non-donating step is not
    loaded)."""
    return dataclasses.replace(ctx, keeper=StateKeeper())


class SaveKinds:
    """One checkpointer per tier setting plus plain Orbax, saving states of one train step.

    `keeper`: the `StateKeeper` of the caller's compiled step (`ctx.keeper` of the context it was
    compiled for); the kept saves ask it to keep what they read."""

    def __init__(
        self, base: ml_collections.ConfigDict, root: str, local_root: str, keeper: StateKeeper
    ) -> None:
        self.root, self.local_root = root, local_root
        ctx_local = context(base, os.path.join(root, "local"), local_root, True, 0)
        ctx_persistent = context(base, os.path.join(root, "persistent"), local_root, False, 1)
        ctx_copy = copying(context(base, os.path.join(root, "local_copy"), local_root, True, 0))
        ctx_local_host = context(
            base, os.path.join(root, "local_host"), local_root, True, 0, keep_state="never"
        )
        ctx_persistent_host = context(
            base, os.path.join(root, "persistent_host"), local_root, False, 1, keep_state="never"
        )
        ctx_local.keeper = ctx_persistent.keeper = keeper  # the one step keeps what both read
        self.tiers: dict[str, tuple[Checkpointer, RunContext]] = {
            name: (Checkpointer(ctx, handle_sigterm=False).open(), ctx)
            for name, ctx in (
                ("local", ctx_local),
                ("persistent", ctx_persistent),
                ("local_copy", ctx_copy),
                ("local_host", ctx_local_host),
                ("persistent_host", ctx_persistent_host),
            )
        }
        self._sync_orbax = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        self._async_orbax = self._async_manager()
        self.async_commit_s: list[float] = []
        self.steps: dict[str, list[int]] = {kind: [] for kind in TIERS}

    def on_start(self, state: Any) -> None:
        for ck, ctx in self.tiers.values():
            ck.on_start(ctx, state)

    def wait(self) -> None:
        """Waits for every save in flight (each is timed alone)."""
        for ck, _ in self.tiers.values():
            ck.wait_until_finished()
        self._async_orbax.wait_until_finished()

    def save(self, kind: str, state: Any, info: StepInfo, record: bool = True) -> float:
        """Saves (or copies) `state` as step `info.step` by `kind`; the seconds the caller was
        blocked. `record`: keep its step and commit time (False for a warm-up)."""
        start = time.perf_counter()
        if kind in self.tiers:
            ck, ctx = self.tiers[kind]
            ck.after_step(ctx, state, info)
        elif kind == "orbax_async":
            self._async_orbax.save(info.step, args=ocp.args.StandardSave(state))
        elif kind == "orbax_sync":
            path = os.path.join(self.root, "orbax_sync", str(info.step))
            self._sync_orbax.save(path, args=ocp.args.StandardSave(state))
        elif kind == "snapshot":
            jax.block_until_ready(device_snapshot(state))
        elif kind == "device_to_host":
            jax.device_get(state)
        else:
            raise ValueError(f"unknown save kind {kind!r}; known: {SAVE_KINDS}")
        elapsed = time.perf_counter() - start
        if kind == "orbax_async":
            self._async_orbax.wait_until_finished()
            if record:
                self.async_commit_s.append(time.perf_counter() - start)
        if record and kind in self.steps:
            self.steps[kind].append(info.step)
        return elapsed

    def _async_manager(self) -> ocp.CheckpointManager:
        # The newest step only: on a device, each is the size of the whole state.
        return ocp.CheckpointManager(
            os.path.join(self.root, "orbax_async"),
            options=ocp.CheckpointManagerOptions(max_to_keep=1),
        )

    def drop_plain(self) -> None:
        """Deletes the plain Orbax saves, sync and async (nothing reads them back), after waiting
        for the async one: a disk that holds a few copies of a large state may not hold them
        beside the tiers' steps."""
        self._async_orbax.wait_until_finished()
        self._async_orbax.close()
        shutil.rmtree(os.path.join(self.root, "orbax_async"), ignore_errors=True)
        self._async_orbax = self._async_manager()
        shutil.rmtree(os.path.join(self.root, "orbax_sync"), ignore_errors=True)

    def _events(self, kind: str, event: str, field: str) -> list[float]:
        ctx = self.tiers[kind][1]
        by_step = {e["step"]: e[field] for e in read_events(ctx.workdir) if e["type"] == event}
        return [by_step[s] for s in self.steps[kind]]

    def commit_s(self) -> dict[str, list[float]]:
        """Per kind with a commit, its recorded saves' seconds from start to durable."""
        commits = {kind: self._events(kind, "save_committed", "commit_s") for kind in TIERS}
        return commits | {"orbax_async": self.async_commit_s}

    def event_s(self) -> dict[str, list[float]]:
        """Per tier, the duration its `save` events report for the recorded saves."""
        return {kind: self._events(kind, "save", "duration_s") for kind in TIERS}

    def close(self) -> None:
        for ck, _ in self.tiers.values():
            ck.close()
        self._async_orbax.close()

    def restore(self, base: ml_collections.ConfigDict, tier: str, devices=None) -> float:
        """Seconds to restore the newest step of `tier` (local | persistent) onto `devices`
        (default: all), through a fresh checkpointer, as a restarted run does."""
        name = "local" if tier == "local" else "persistent"
        ctx = context(
            base, os.path.join(self.root, name), self.local_root, tier == "local", 0, devices
        )
        ck = Checkpointer(ctx, handle_sigterm=False).open()
        try:
            start = time.perf_counter()
            restored = ck.restore_latest(ctx)
            if restored is None:
                raise RuntimeError(f"nothing to restore on the {tier} tier")
            jax.block_until_ready(restored.state)
            elapsed = time.perf_counter() - start
        finally:
            ck.close()
        if restored.tier != tier:
            raise RuntimeError(f"restored the {restored.tier} tier, not {tier}")
        return elapsed
