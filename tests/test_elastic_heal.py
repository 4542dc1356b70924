"""A slice that falls several steps behind inside the loop (cut off while the others trained on)
is healed to the newest state, not replaced: its state, step count and data position jump, and
it ends bitwise equal to the others and to a lone slice's run. Two slices in this process, each
running the real train loop, over a real quorum server and gloo."""

from __future__ import annotations

import functools
import threading
import time

import jax
import pytest
from conftest import assert_bitwise, events_of, run_context, run_slices, tiny_config

pytest.importorskip("torch")

TOTAL = 12
CUT_AFTER = 3  # slice 1 is cut off (its quorum connection closed, silent) after this step ...
BACK_AFTER = 7  # ... until slice 0 has trained alone to this one


def test_a_slice_cut_off_for_several_steps_heals_inside_the_loop(tmp_path):
    from resilient_jax.control.quorum import QuorumServer
    from resilient_jax.data import make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.elastic.trainer import ElasticStep, compile_programs
    from resilient_jax.train.hooks import Hook
    from resilient_jax.train.loop import Loop
    from resilient_jax.train.state import init_state

    config = tiny_config(
        total_steps=TOTAL,
        **{
            "elastic.enabled": True,
            "elastic.slices": 2,
            "elastic.timeout_s": 2.0,  # the survivor gives up on the silent peer's exchange
            "elastic.quorum_timeout_s": 60.0,
        },
    )
    programs = compile_programs(run_context(config, str(tmp_path / "compile"), devices=2))
    back = threading.Event()
    results: dict = {}

    class Recorder(Hook):
        """What the hooks see: (step, batch index, next batch) per step, the metrics' steps;
        slice 1 is cut off after CUT_AFTER until slice 0 is at BACK_AFTER."""

        def __init__(self, slice_id: int, paired: bool, client, server) -> None:
            self.slice_id, self.paired, self.client, self.server = slice_id, paired, client, server
            self.steps: list[tuple[int, int, int]] = []
            self.metrics: list[int] = []

        def after_step(self, ctx, state, info) -> None:
            self.steps.append((info.step, info.batch_index, info.data_position.next_batch))
            if not self.paired:
                return
            if self.slice_id == 1 and info.step == CUT_AFTER:
                self.client.close()  # its link is cut: the server drops it at once
                assert back.wait(120), "slice 0 never trained on alone"
            if self.slice_id == 0 and info.step == BACK_AFTER:
                back.set()
                # On only once slice 1 asks again (after its exchange with the silent slice 0
                # timed out): at tiny_cpu's 20 ms steps slice 0 would otherwise finish first.
                deadline = time.monotonic() + 120
                while 1 not in self.server.connected_slices():
                    assert time.monotonic() < deadline, "slice 1 never asked again"
                    time.sleep(0.01)

        def on_metrics(self, ctx, step, metrics) -> None:
            self.metrics.append(step)

    def slice_run(slice_id: int, exchange, client, paired: bool, server) -> None:
        """Slice 0 alone (the reference, in `lone/`), or either slice of the pair (`s<id>/`)."""
        ctx = run_context(config, str(tmp_path / (f"s{slice_id}" if paired else "lone")), devices=2)
        step = ElasticStep(
            ctx, make_source(config), exchange, exchange.store_address, client, slice_id, programs
        )
        state, _ = step.join(lambda: (init_state(config, ctx.mesh), DataPosition()))
        recorder = Recorder(slice_id, paired, client, server)
        state, _ = Loop(ctx, step, step.index, [recorder], lambda max_step: None).run(state)
        results[slice_id] = jax.device_get(state.params)
        results[(slice_id, "hooks")] = recorder
        results[(slice_id, "next")] = step.index.position.next_batch

    def job(slices: list[int]) -> None:
        """The slices from a fresh state, starting together: the first quorum waits for all."""
        server = QuorumServer("t", join_timeout_s=0.5, expected=len(slices), settle_s=60.0)
        body = functools.partial(slice_run, paired=len(slices) > 1, server=server)
        try:
            run_slices(server.address, slices, body, exchange_timeout_s=1.0, on_error=back.set)
        finally:
            server.close()

    job([0])
    reference = results.pop(0)
    job([0, 1])
    assert_bitwise(results[0], reference)
    assert_bitwise(results[1], reference)

    # The job's start: both slices in the first quorum, neither with a state, both load it. The
    # one heal is slice 1's, from where it was cut off.
    (heal,) = events_of(str(tmp_path / "s1"), "elastic_heal")
    assert (heal["role"], heal["source_slice"], heal["from_step"]) == ("received", 0, CUT_AFTER)
    healed_to = heal["step"]
    assert healed_to > BACK_AFTER  # several steps ahead of where it hung
    # The hooks saw the jump: the step healed to, its batch and the next batch, then every step.
    hooks = results[(1, "hooks")]
    expected = [(s, s - 1, s) for s in [*range(1, CUT_AFTER + 1), *range(healed_to, TOTAL + 1)]]
    assert hooks.steps == expected
    assert hooks.metrics == [s for s, _, _ in expected]
    assert results[(1, "next")] == results[(0, "next")] == TOTAL
    # Slice 1 computed its own part of every step it took: none while cut off.
    own = [e["step"] for e in events_of(str(tmp_path / "s1"), "elastic_step") if e["owned"] == [1]]
    assert own == [*range(1, CUT_AFTER + 1), *range(healed_to + 1, TOTAL + 1)]
