"""Chaos specs parse (or fail with a one-line reason) and each fault does what it says."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest

from resilient_jax.chaos import record
from resilient_jax.chaos import spec as chaos_spec
from resilient_jax.chaos.faulty_step import wrap_step
from resilient_jax.chaos.hook import SCHEDULE_AHEAD_STEPS, ChaosHook
from resilient_jax.config import default_config
from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.faults import SPIKE_FACTOR, FaultKind
from resilient_jax.events import EventLog, read_events


def fake_ctx(workdir, process=0, num_processes=1, num_slices=1, generation=0):
    topology = types.SimpleNamespace(
        process_index=process,
        num_processes=num_processes,
        num_slices=num_slices,
        slice_index=process // (num_processes // num_slices),
    )
    return types.SimpleNamespace(
        workdir=str(workdir),
        events=EventLog(str(workdir), process=process),
        topology=topology,
        generation=generation,
        config=default_config(),
    )


def chaos_events(workdir):
    return [e for e in read_events(str(workdir)) if e["type"] == EventType.CHAOS]


# ------------------------------------------------------------------------------ parsing


def test_every_kind_parses():
    faults = chaos_spec.parse(
        "nan:step=5; spike:step=6,factor=8; slow:process=1,factor=2.5; "
        "hang:process=0,step=7,mode=stop; kill:process=2,step=9; "
        "lose_slice:slice=1,step=10,for=2m; corrupt_checkpoint:step=11"
    )
    got = {f.kind: f for f in faults}
    assert list(got) == [
        "nan",
        "spike",
        "slow",
        "hang",
        "kill",
        "lose_slice",
        "corrupt_checkpoint",
    ]
    assert got["nan"].step == 5
    assert (got["spike"].step, got["spike"].factor) == (6, 8.0)
    assert (got["slow"].process, got["slow"].factor, got["slow"].step) == (1, 2.5, 1)
    assert (got["hang"].process, got["hang"].step, got["hang"].mode) == (0, 7, "stop")
    assert (got["kill"].process, got["kill"].step) == (2, 9)
    assert (got["lose_slice"].slice, got["lose_slice"].for_s) == (1, 120.0)
    assert got["corrupt_checkpoint"].step == 11
    assert all(isinstance(f.kind, FaultKind) for f in faults)
    assert chaos_spec.parse("spike:step=1")[0].factor == SPIKE_FACTOR
    assert chaos_spec.parse("hang:process=0,step=1")[0].mode == "sleep"
    assert len({f.key for f in chaos_spec.parse("nan:step=1;nan:step=1")}) == 2
    assert chaos_spec.parse("") == []


@pytest.mark.parametrize(
    ("spec", "bad", "why"),
    [
        ("nan:step=5;boom:step=1", "boom:step=1", "unknown kind 'boom'"),
        ("kill:step=3", "kill:step=3", "kill needs process="),
        ("nan:step=x", "nan:step=x", "not an integer"),
        ("nan:step=0", "nan:step=0", "must be >= 1"),
        ("spike:step=2,factor=-1", "spike:step=2,factor=-1", "positive number"),
        ("nan:step=2,proces=1", "nan:step=2,proces=1", "unknown key 'proces'"),
        ("lose_slice:slice=0,step=2,for=soon", "lose_slice:slice=0,step=2,for=soon", "duration"),
        ("hang:process=0,step=2,mode=nap", "hang:process=0,step=2,mode=nap", "mode='nap'"),
        ("slow:process=0,factor=0.5", "slow:process=0,factor=0.5", "factor > 1"),
        ("nan:step", "nan:step", "not key=value"),
        ("random:seed=1", "random:seed=1", "random needs mtbf="),
        ("random:mtbf=1m,seed=1,kinds=nan+oops", "random:mtbf=1m,seed=1,kinds=nan+oops", "oops"),
    ],
)
def test_bad_specs_name_the_bad_part(spec, bad, why):
    with pytest.raises(ValueError) as error:
        chaos_spec.parse(spec)
    message = str(error.value)
    assert "\n" not in message and repr(bad) in message and why in message


def test_random_schedule_is_seeded():
    a = chaos_spec.parse("random:mtbf=60s,seed=1")
    assert a == chaos_spec.parse("random:mtbf=60s,seed=1")
    assert a != chaos_spec.parse("random:mtbf=60s,seed=2")
    assert len(a) == chaos_spec.RANDOM_DEFAULT_COUNT
    times = [f.at_s for f in a]
    assert times == sorted(times) and all(f.step is None for f in a)
    assert 30 < times[-1] / len(times) < 120  # mean gap near the mtbf
    assert {f.kind for f in a} == set(chaos_spec.RANDOM_DEFAULT_KINDS)
    few = chaos_spec.parse("random:mtbf=1h,seed=3,kinds=kill+lose_slice,count=5")
    assert len(few) == 5 and {f.kind for f in few} <= {"kill", "lose_slice"}


def test_supervisor_actions_list_slice_outages():
    actions = chaos_spec.supervisor_actions("nan:step=2;lose_slice:slice=1,step=10,for=45s")
    assert actions == [chaos_spec.SliceOutage(slice=1, duration_s=45.0, step=10)]
    randomised = chaos_spec.supervisor_actions(
        "random:mtbf=10s,seed=0,kinds=lose_slice,count=3", num_slices=2
    )
    assert len(randomised) == 3 and all(a.slice in (0, 1) and a.at_s for a in randomised)
    assert all(a.duration_s == 5.0 for a in randomised)


# --------------------------------------------------------------------- in-process faults


class FakeRun:
    """Drives a ChaosHook as the train loop does: `on_start` with the state it starts from, then
    per step the wrapped step (a fake compiled step that records its loss scale) and
    `after_step`. `work` runs inside each step (to advance a fake clock)."""

    def __init__(self, hook, ctx, start=0, work=lambda: None):
        self.hook, self.ctx, self.work = hook, ctx, work
        self.state = types.SimpleNamespace(step=start)
        self.scales = {}  # step -> loss scale it was taken with
        self.step_fn = wrap_step(self._compiled_step, hook)
        hook.on_start(ctx, self.state)

    def _compiled_step(self, state, batch, loss_scale):
        self.work()
        self.scales[state.step + 1] = float(loss_scale)
        return types.SimpleNamespace(step=state.step + 1), {"loss": loss_scale}

    def take(self):
        """Takes the next step; returns its loss scale."""
        self.state, _ = self.step_fn(self.state, None)
        self.hook.after_step(self.ctx, self.state, types.SimpleNamespace(step=self.state.step))
        return self.scales[self.state.step]

    def roll_back(self, to_step):
        """The loop restored the state of `to_step` (a new state object, as a restore gives)."""
        self.state = types.SimpleNamespace(step=to_step)


def test_nan_and_spike_scale_the_loss_once_per_run(tmp_path):
    ctx = fake_ctx(tmp_path)
    run = FakeRun(ChaosHook("nan:step=3;spike:step=4,factor=7"), ctx)
    scales = [run.take() for _ in range(6)]  # steps 1 to 6
    assert math.isnan(scales[2]) and scales[3] == 7.0
    assert [s for i, s in enumerate(scales) if i not in (2, 3)] == [1.0] * 4
    run.roll_back(to_step=2)
    assert run.take() == 1.0  # a rollback re-running step 3 does not re-fire
    events = chaos_events(tmp_path)
    assert [(e["kind"], e["step"]) for e in events] == [("nan", 3), ("spike", 4)]
    assert events[1]["factor"] == 7.0
    fired = json.loads((tmp_path / record.FIRED_FILE).read_text())
    assert set(fired["fired"]) == {"0:nan:step=3", "1:spike:step=4,factor=7"}

    # A restarted generation reaches step 3 again: the fault is spent.
    restarted = fake_ctx(tmp_path, generation=1)
    again = FakeRun(ChaosHook("nan:step=3;spike:step=4,factor=7"), restarted)
    assert [again.take() for _ in range(6)] == [1.0] * 6
    assert len(chaos_events(tmp_path)) == 2


def test_the_wrapped_step_numbers_steps_from_a_restored_state(tmp_path):
    run = FakeRun(ChaosHook("nan:step=5"), fake_ctx(tmp_path))
    assert [run.take() for _ in range(3)] == [1.0] * 3  # steps 1 to 3
    run.roll_back(to_step=1)
    assert [run.take() for _ in range(3)] == [1.0] * 3  # steps 2 to 4 again
    assert math.isnan(run.take()) and run.state.step == 5


def test_all_processes_of_one_generation_fire_a_loss_fault(tmp_path):
    scales = []
    for process in range(2):
        ctx = fake_ctx(tmp_path, process=process, num_processes=2)
        scales.append(FakeRun(ChaosHook("spike:step=2,factor=3"), ctx, start=1).take())
    assert scales == [3.0, 3.0]


def test_spent_rule():
    fault = chaos_spec.parse("nan:step=1")[0]
    data = {"fired": {fault.key: {"0": {"generation": 2, "pid": 10}}}, "scheduled": {}}
    assert record.is_spent(data, fault, generation=3, process=1, pid=11)  # older generation
    assert not record.is_spent(data, fault, generation=2, process=1, pid=11)  # a peer, same gen
    assert record.is_spent(data, fault, generation=2, process=0, pid=12)  # restarted process 0


def test_a_process_absent_at_its_step_gets_the_fault_when_it_next_runs(tmp_path):
    blocked = []
    spec = "hang:process=1,step=5"
    # Generation 1 runs on one process (process 1's slice evicted) past step 5: nothing fires.
    alone = ChaosHook(spec, block_forever=lambda: blocked.append("gen1"))
    run = FakeRun(alone, fake_ctx(tmp_path, process=0, num_processes=1, generation=1))
    for _ in range(8):
        run.take()
    assert blocked == [] and chaos_events(tmp_path) == []
    # Generation 2 is back on two processes, resumed at step 8: process 1 hangs at step 9.
    for process in range(2):
        hook = ChaosHook(spec, block_forever=lambda p=process: blocked.append(p))
        ctx = fake_ctx(tmp_path, process=process, num_processes=2, num_slices=2, generation=2)
        run = FakeRun(hook, ctx, start=8)
        for _ in range(3):  # steps 9 to 11
            run.take()
    assert blocked == [1]
    assert [(e["kind"], e["step"]) for e in chaos_events(tmp_path)] == [("hang", 9)]


def test_no_fault_fires_for_a_step_past_the_last(tmp_path):
    blocked = []
    ctx = fake_ctx(tmp_path)
    ctx.config.total_steps = 3
    hook = ChaosHook("hang:process=0,step=4", block_forever=lambda: blocked.append(4))
    run = FakeRun(hook, ctx)
    for _ in range(3):
        run.take()
    FakeRun(
        ChaosHook("hang:process=0,step=4", block_forever=lambda: blocked.append(3)), ctx, start=3
    )
    assert blocked == [] and chaos_events(tmp_path) == []


def test_slow_stretches_only_the_target_process(tmp_path):
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    def work():  # the step's own work
        now[0] += 0.5

    hook = ChaosHook("slow:process=1,factor=3,step=2", clock=lambda: now[0], sleep=sleep)
    run = FakeRun(hook, fake_ctx(tmp_path, process=1, num_processes=2), work=work)
    for _ in range(4):
        run.take()
    assert slept == pytest.approx([1.0, 1.0, 1.0])  # (3 - 1) x 0.5 s for steps 2, 3 and 4
    other = ChaosHook("slow:process=1,factor=3", clock=lambda: now[0], sleep=sleep)
    run = FakeRun(other, fake_ctx(tmp_path, process=0, num_processes=2), work=work)
    for _ in range(3):
        run.take()
    assert len(slept) == 3
    assert [e["kind"] for e in chaos_events(tmp_path)] == ["slow"]


def make_checkpoint(root, step, payload=b"\x01" * 64):
    state = root / str(step) / "state"
    (state / "ocdbt.process_0" / "d").mkdir(parents=True)
    (state / "_METADATA").write_bytes(b'{"tree": 1}')
    (state / "manifest.ocdbt").write_bytes(b"manifest")
    (state / "ocdbt.process_0" / "d" / "abc").write_bytes(payload)
    return state


def test_corrupt_checkpoint_flips_array_bytes_of_the_newest_committed_step(tmp_path):
    ctx = fake_ctx(tmp_path)
    root = tmp_path / "checkpoints"
    old = make_checkpoint(root, 5)
    new = make_checkpoint(root, 10)
    (root / "12.orbax-checkpoint-tmp-99").mkdir()  # in progress: not committed
    local = tmp_path / "local"
    local_new = make_checkpoint(local, 10)
    hook = ChaosHook("corrupt_checkpoint:step=11", local_checkpoint_dir=str(local))
    run = FakeRun(hook, ctx, start=10)  # step 11 is the first step it takes
    assert run.take() == 1.0
    assert (new / "ocdbt.process_0" / "d" / "abc").read_bytes() != b"\x01" * 64
    assert (local_new / "ocdbt.process_0" / "d" / "abc").read_bytes() != b"\x01" * 64
    assert (new / "_METADATA").read_bytes() == b'{"tree": 1}'
    assert (new / "manifest.ocdbt").read_bytes() == b"manifest"
    assert (old / "ocdbt.process_0" / "d" / "abc").read_bytes() == b"\x01" * 64
    (event,) = chaos_events(tmp_path)
    assert event["files"] == 2 and sorted(event["checkpoint"]) == sorted(
        [str(local / "10"), str(root / "10")]
    )


def test_random_loss_faults_hit_every_process_at_the_same_step(tmp_path):
    now = [0.0]
    spec = "random:mtbf=10s,seed=0,kinds=nan,count=1"
    at_s = chaos_spec.parse(spec)[0].at_s
    ctxs = [fake_ctx(tmp_path, process=p, num_processes=2) for p in range(2)]
    runs = [FakeRun(ChaosHook(spec, clock=lambda: now[0]), ctx) for ctx in ctxs]
    fired_at = {0: [], 1: []}
    for done in range(20):
        now[0] = at_s * done / 8  # the fault comes due at step 9
        for p in (1, 0):  # process 1 runs ahead of process 0
            if math.isnan(runs[p].take()):
                fired_at[p].append(done + 1)
    assert fired_at[0] == fired_at[1] == [9 + SCHEDULE_AHEAD_STEPS]


# --------------------------------------------------------------------- process faults

DRIVER = """
import sys, time, types
from resilient_jax.chaos.hook import ChaosHook
from resilient_jax.chaos.faulty_step import wrap_step
from resilient_jax.config import default_config
from resilient_jax.events import EventLog
workdir, spec, process, processes, slices = sys.argv[1:6]
process, processes, slices = int(process), int(processes), int(slices)
topology = types.SimpleNamespace(process_index=process, num_processes=processes,
    num_slices=slices, slice_index=process // (processes // slices))
ctx = types.SimpleNamespace(workdir=workdir, events=EventLog(workdir, process=process),
    topology=topology, generation=0, config=default_config())
hook = ChaosHook(spec)
state = types.SimpleNamespace(step=0)
step_fn = wrap_step(lambda s, batch, scale: (types.SimpleNamespace(step=s.step + 1), {}), hook)
hook.on_start(ctx, state)
for _ in range(5):
    state, _ = step_fn(state, None)
    print("took", state.step, flush=True)
    hook.after_step(ctx, state, types.SimpleNamespace(step=state.step))
    time.sleep(0.01)
print("done", flush=True)
"""


def start_driver(workdir, spec, process=0, processes=1, slices=1):
    argv = [str(workdir), spec, str(process), str(processes), str(slices)]
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(DRIVER), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc, timeout=60):
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kill_sigkills_only_the_target_process(tmp_path):
    victim = start_driver(tmp_path, "kill:process=1,step=3", process=1, processes=2)
    bystander = start_driver(tmp_path, "kill:process=1,step=3", process=0, processes=2)
    out, err = finish(victim)
    assert victim.returncode == -signal.SIGKILL, err
    assert out.split("\n")[:2] == ["took 1", "took 2"] and "took 3" not in out
    out, err = finish(bystander)
    assert bystander.returncode == 0 and "done" in out, err
    (event,) = chaos_events(tmp_path)
    assert (event["kind"], event["step"], event["process"]) == ("kill", 3, 1)


def test_lose_slice_kills_every_process_of_the_slice(tmp_path):
    spec = "lose_slice:slice=1,step=2,for=30s"
    procs = [start_driver(tmp_path, spec, process=p, processes=4, slices=2) for p in range(4)]
    codes = []
    for proc in procs:
        finish(proc)
        codes.append(proc.returncode)
    assert codes == [0, 0, -signal.SIGKILL, -signal.SIGKILL]
    events = chaos_events(tmp_path)
    assert sorted(e["process"] for e in events) == [2, 3]
    assert all(e["slice"] == 1 and e["for_s"] == 30.0 for e in events)


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def process_state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("mode", ["sleep", "stop"])
def test_hang_stops_progress_without_exiting(tmp_path, mode):
    proc = start_driver(tmp_path, f"hang:process=0,step=2,mode={mode}")
    try:
        assert wait_for(lambda: chaos_events(tmp_path))
        if mode == "stop":
            assert wait_for(lambda: process_state(proc.pid) == "T")
        else:
            time.sleep(0.5)
        assert proc.poll() is None  # still there, but making no progress
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    assert "took 1" in out and "took 2" not in out
    (event,) = chaos_events(tmp_path)
    assert (event["kind"], event["mode"], event["step"]) == ("hang", mode, 2)


def test_host_faults_parse_and_are_the_supervisors():
    spec = "lose_host:slice=1,step=10,for=5s; freeze_host:slice=0,step=12; kill:process=0,step=3"
    spec += "; partition_host:slice=1,step=20,for=2s"
    hosts = chaos_spec.host_faults(spec)
    assert [(f.kind, f.slice, f.step, f.for_s) for f in hosts] == [
        ("lose_host", 1, 10, 5.0),
        ("freeze_host", 0, 12, 0.0),
        ("partition_host", 1, 20, 2.0),
    ]
    with pytest.raises(chaos_spec.FaultSpecError, match="partition_host needs for="):
        chaos_spec.parse("partition_host:slice=1,step=2")
