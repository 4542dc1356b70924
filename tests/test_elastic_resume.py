"""A whole elastic job with a sync interval (DiLoCo) stopped after a save taken between two syncs,
and started again from its slices' checkpoints, ends bitwise equal to the undisturbed job. Two
slices in this process, each running the real train loop with its checkpointer, over a real
quorum server and gloo."""

from __future__ import annotations

import contextlib

import jax
import pytest
from conftest import assert_bitwise, events_of, run_context, run_slices, tiny_config

pytest.importorskip("torch")

EVERY = 4  # steps per round
TOTAL = 3 * EVERY
STOP_AT = 6  # a save, mid-round (6 % 4 = 2), then every slice stops


@pytest.mark.slow  # three runs of two slices: about half a minute on 2 cores
def test_a_job_stopped_mid_round_resumes_to_the_undisturbed_bits(tmp_path):
    from resilient_jax.checkpoint import Checkpointer
    from resilient_jax.control.quorum import QuorumServer
    from resilient_jax.data import make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.elastic.diloco import SyncIntervalStep
    from resilient_jax.elastic.trainer import compile_programs
    from resilient_jax.train.hooks import Hook, StopTraining
    from resilient_jax.train.loop import Loop
    from resilient_jax.train.state import init_state

    config = tiny_config(
        total_steps=TOTAL,
        **{
            "elastic.enabled": True,
            "elastic.slices": 2,
            "elastic.sync_every_steps": EVERY,
            "elastic.timeout_s": 10.0,
            "elastic.quorum_timeout_s": 60.0,
            # The only save before the stop is STOP_AT's: with an earlier one (say at step 3)
            # still committing when STOP_AT's is due, STOP_AT's would be skipped.
            "checkpoint.every_steps": STOP_AT,
            "checkpoint.sync_timeout_s": 30.0,
        },
    )
    programs = compile_programs(run_context(config, str(tmp_path / "compile"), devices=2))

    class StopAfter(Hook):
        def after_step(self, ctx, state, info) -> None:
            if info.step == STOP_AT:
                raise StopTraining("the job is stopped")

    def job(workdir: str, stop: bool) -> dict:
        """Both slices from their checkpoints in `workdir` (none: from the seed); each slice's
        final parameters and the step each started from."""
        server = QuorumServer("t", join_timeout_s=1.0, expected=2, settle_s=30.0)
        results: dict = {}

        def slice_run(slice_id: int, exchange, client) -> None:
            ctx = run_context(config, f"{workdir}/slices/{slice_id}", devices=2)
            checkpointer = Checkpointer(ctx, handle_sigterm=False).open()
            try:
                step = SyncIntervalStep(
                    ctx,
                    make_source(config),
                    exchange,
                    exchange.store_address,
                    client,
                    slice_id,
                    programs,
                )

                def load():
                    restored = checkpointer.restore_latest(ctx)
                    if restored is None:
                        return init_state(config, ctx.mesh), DataPosition()
                    return restored.state, restored.data_position

                state, _ = step.join(load)
                results[(slice_id, "from")] = int(jax.device_get(state.step))
                hooks = [checkpointer, StopAfter()] if stop else [checkpointer]
                loop = Loop(ctx, step, step.index, hooks, lambda s: None)
                if stop:
                    with contextlib.suppress(StopTraining):
                        loop.run(state)
                else:
                    state, _ = loop.run(state)
                    results[slice_id] = jax.device_get(state.params)
                checkpointer.wait_until_finished()
            finally:
                checkpointer.close()

        try:
            run_slices(server.address, [0, 1], slice_run)
        finally:
            server.close()
        return results

    undisturbed = job(str(tmp_path / "undisturbed"), stop=False)
    assert_bitwise(undisturbed[1], undisturbed[0])  # the last step synced the slices
    stopped = job(str(tmp_path / "resumed"), stop=True)
    assert stopped[(0, "from")] == stopped[(1, "from")] == 0
    resumed = job(str(tmp_path / "resumed"), stop=False)
    assert resumed[(0, "from")] == resumed[(1, "from")] == STOP_AT  # each restored its own
    for slice_id in (0, 1):
        assert_bitwise(resumed[slice_id], undisturbed[0])
        events = events_of(str(tmp_path / "resumed" / "slices" / str(slice_id)), "restore")
        assert [e["step"] for e in events] == [STOP_AT]
