"""`--config.profile.steps=START:STOP`: a jax.profiler trace of those steps under
<workdir>/profile/, the same losses as without it, and bad values refused with one line."""

from __future__ import annotations

import pytest
from conftest import events_of, run_python, tiny_config

from resilient_jax import config as config_lib
from resilient_jax.contracts.exit_codes import ExitCode


@pytest.mark.parametrize("value", ["5:5", "6:5", "0:3", "abc", "5", "1:2:3", "a:b", "3:"])
def test_bad_profile_steps_are_refused(value):
    with pytest.raises(config_lib.ConfigError, match=r"^config\.profile\.steps="):
        config_lib.validate(tiny_config(**{"profile.steps": value}))


def test_profile_steps_name_a_half_open_window():
    assert config_lib.profile_steps("3:6") == range(3, 6)
    assert config_lib.profile_steps("") is None


def test_bad_profile_steps_exit_2_with_one_line(tmp_path):
    result = run_python(
        [
            "launch/train.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={tmp_path / 'run'}",
            "--config.profile.steps=7:3",
        ],
        timeout=120,
    )
    assert result.returncode == ExitCode.BAD_INPUT, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "config.profile.steps='7:3'" in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # two 6-step runs, one under the profiler: 15-30 s on 2 cores
def test_a_profiled_run_writes_a_trace_and_trains_the_same(tmp_path):
    from resilient_jax.run import train

    def losses(workdir, **overrides) -> dict[int, float]:
        config = tiny_config(total_steps=6, **{"eval.every_steps": 0, **overrides})
        assert train(config, str(workdir)) == 0
        return {e["step"]: e["loss"] for e in events_of(str(workdir), "step")}

    profiled = losses(tmp_path / "profiled", **{"profile.steps": "3:5"})
    assert profiled == losses(tmp_path / "plain")
    assert len(profiled) == 6

    traces = tmp_path / "profiled" / "profile" / "process_0" / "plugins" / "profile"
    (run,) = list(traces.iterdir())
    names = [p.name for p in run.iterdir()]
    assert any(n.endswith(".xplane.pb") for n in names), names  # TensorBoard's profile plugin
    assert "perfetto_trace.json.gz" in names  # Perfetto
    assert all(p.stat().st_size > 0 for p in run.iterdir())
    start, stop = events_of(str(tmp_path / "profiled"), "profile")
    assert (start["action"], stop["action"]) == ("start", "stop")
    assert (stop["first_step"], stop["last_step"]) == (3, 4)
    assert not (tmp_path / "plain" / "profile").exists()
