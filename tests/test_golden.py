"""The default run's loss curve: `configs/tiny_cpu.py` as its docstring runs it (one CPU device)
must give the losses in `golden/tiny_cpu.json` at steps 10, 50 and 100, so any change in numerics
(model, initialisation, data order, optimizer, the step) is seen.

The golden losses were first made before the layout redesign (which reproduced them bit for bit),
then made again when the default run moved to the bundled 1024-token BPE with a held-out
evaluation split (losses per subword token), again when the token stream began ending every
document with end-of-text (the same initialisation as before), and again when the default model
got an untied output layer initialised to zero (a first loss of ln V), and again when the layers
were stacked and scanned (each layer's initial weights now come from its own split of the
parameter key; the scanned and the unrolled program of that layout agree far inside the
tolerance: experiments/compile_depth.py). The comparison allows a
relative 1e-4: far below what any change in what is computed moves a loss (1e-2 and more by step
10), and above the float32 reduction-order noise another CPU's vectorisation or another XLA
version may add over 100 steps."""

from __future__ import annotations

import json
import os

import pytest

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "tiny_cpu.json")


@pytest.mark.slow  # 200 steps of the full tiny model: one to three minutes on two cores
def test_default_run_reproduces_the_golden_losses(tmp_path, launcher):
    with open(GOLDEN) as f:
        golden = {int(step): loss for step, loss in json.load(f)["loss_at_step"].items()}
    workdir = tmp_path / "run"
    assert launcher.finish(launcher.start(workdir, devices=1, small=False), timeout=580) == 0
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if row["step"] in golden}
    assert losses.keys() == golden.keys()
    for step, loss in golden.items():
        assert losses[step] == pytest.approx(loss, rel=1e-4, abs=0), (step, losses[step], loss)
