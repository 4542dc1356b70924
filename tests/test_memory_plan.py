"""The memory plan (`launch/train.py --plan`) of the Llama-2 7B recipe against a hand calculation,
made without allocating the model, and the refusal of a cluster description it cannot read."""

from __future__ import annotations

import dataclasses
import resource

import jax
import pytest
from conftest import run_python

from configs import llama_7b
from resilient_jax.config import BadInput
from resilient_jax.train import memory_plan

GB = 1e9

# Llama-2 7B by hand: d 4096, 32 layers, 32 heads x 128, MLP 11008, vocabulary 32000, untied.
D, LAYERS, HEADS, HEAD_DIM, FF, VOCAB, SEQ = 4096, 32, 32, 128, 11008, 32000, 4096
LAYER_PARAMS = 4 * D * HEADS * HEAD_DIM + 3 * D * FF + 2 * D  # q, k, v, o; gate, up, down; norms
PARAMS = 2 * VOCAB * D + LAYERS * LAYER_PARAMS + D  # embed, unembed, blocks, final norm
FSDP = 8  # 8 devices per slice; replicas (slices) hold whole copies of a slice's shards
PARAM_BYTES = PARAMS * 4 / FSDP  # float32 master weights
ADAM_BYTES = 2 * PARAM_BYTES  # two float32 moments
GRAD_BYTES = 2 * PARAM_BYTES  # running sum over microbatches + one microbatch's gradients
# Two layers' matrices gathered in bf16 (the one computing, the next in flight).
WEIGHT_BYTES = 2 * (4 * D * HEADS * HEAD_DIM + 3 * D * FF) * 2
# One row of 4096 tokens, bf16, rematerialised blocks: each block keeps its input (D per token);
# one block's working set at a time (4 D + q, k, v, attention output 4 x 4096 + attention
# probabilities 32 heads x 4096 in float32 and in bf16, and the causal mask's byte + 4 x MLP 11008);
# float32 logits and their gradient.
WORKING_SET = (4 * D + 4 * HEADS * HEAD_DIM + 4 * FF) * 2 + HEADS * SEQ * (4 + 2 + 1)
BACKWARD = HEADS * SEQ * 4  # the backward pass's gradient of one layer's probabilities, float32
ACTIVATION_BYTES = SEQ * (LAYERS * D * 2 + WORKING_SET + BACKWARD + 2 * 4 * VOCAB)


def close(actual: float, expected: float, rel: float = 0.02) -> bool:
    return abs(actual - expected) <= rel * expected


@pytest.fixture(scope="module")
def seven_b_plan():
    live_before = len(jax.live_arrays())
    result = memory_plan.plan(
        llama_7b.get_config(), memory_plan.parse_cluster("devices=64,memory_gb=80,slices=8")
    )
    return result, live_before


def test_7b_plan_matches_the_hand_calculation(seven_b_plan):
    result, _ = seven_b_plan
    assert result.num_params == PARAMS == 6_738_415_616
    full = result.candidates[0]
    mem = full.memory
    assert (full.slices, mem.plan.replica, mem.plan.fsdp, mem.plan.tensor) == (8, 8, 8, 1)
    assert (mem.plan.microbatches, mem.plan.rows_per_device) == (16, 1)  # 1024 rows / 64 devices
    assert close(mem.params, PARAM_BYTES, rel=1e-6)
    assert close(mem.optimizer, ADAM_BYTES)
    assert close(mem.gradients, GRAD_BYTES)
    assert close(mem.weights, WEIGHT_BYTES)
    assert close(mem.activations, ACTIVATION_BYTES)
    assert close(mem.checkpoint, PARAM_BYTES + ADAM_BYTES)
    assert close(result.checkpoint_total, 3 * PARAMS * 4)
    total = PARAM_BYTES + ADAM_BYTES + GRAD_BYTES + WEIGHT_BYTES + ACTIVATION_BYTES
    assert close(mem.total, total) and mem.fits  # ~21.5 GB of 80
    # 7 or 6 slices leave 56 or 48 data-parallel devices: 1024 rows do not divide.
    assert [c.slices for c in result.candidates] == [8, 7, 6]
    assert all(c.memory is None and "global_batch_size" in c.reason for c in result.candidates[1:])


def test_7b_plan_allocates_nothing(seven_b_plan):
    _, live_before = seven_b_plan
    assert len(jax.live_arrays()) == live_before
    # The state alone is 81 GB in float32: any materialised copy would dwarf this bound.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 8 * GB


def test_plan_after_losing_slices_and_a_device_too_small():
    config = llama_7b.get_config()
    result = memory_plan.plan(config, memory_plan.parse_cluster("devices=32,memory_gb=16,slices=4"))
    four, three, two = result.candidates
    assert four.memory.plan.microbatches == 32 and not four.memory.fits  # 21.5 GB > 90% of 16
    assert three.memory is None
    # Two slices: 16 data-parallel devices, 64 microbatches of one row; same shards per device.
    assert (two.memory.plan.replica, two.memory.plan.microbatches) == (2, 64)
    assert two.memory.params == four.memory.params
    text = memory_plan.format_plan(result)
    assert "no mesh" in text and " NO" in text


@pytest.mark.parametrize(
    "text, why",
    [
        ("devices=64", "memory_gb is missing"),
        ("devices=64,memory_gb=80,slices=7", "slices=7 must divide devices=64"),
        ("devices=64,memory=80", "unknown key 'memory'"),
        ("devices=sixty,memory_gb=80", "not a number"),
        ("devices=64,memory_gb=0", "memory_gb > 0"),
        ("64 devices", "is not KEY=VALUE"),
    ],
)
def test_bad_cluster_descriptions_are_refused(text, why):
    with pytest.raises(BadInput, match=why) as e:
        memory_plan.parse_cluster(text)
    assert "\n" not in str(e.value) and memory_plan.CLUSTER_SYNTAX in str(e.value)


def test_the_save_peak_counts_the_kept_state_and_decides_keep_state_auto(seven_b_plan):
    mem = seven_b_plan[0].candidates[0].memory
    assert mem.save_peak_kept == mem.total + mem.params + mem.optimizer and mem.keeps_state
    squeezed = dataclasses.replace(mem, capacity=int(mem.save_peak_kept / 0.9) - 1)
    assert squeezed.fits and not squeezed.keeps_state


def test_launcher_prints_the_plan_and_refuses_a_bad_cluster():
    args = ["launch/train.py", "--config=configs/llama_7b.py", "--plan"]
    ok = run_python([*args, "--cluster=devices=64,memory_gb=80,slices=8"], timeout=120)
    assert ok.returncode == 0, ok.stderr
    row = next(line.split() for line in ok.stdout.splitlines() if line.strip().startswith("8 "))
    printed = [float(x) for x in row[4:11]]
    parts = [PARAM_BYTES, ADAM_BYTES, GRAD_BYTES, WEIGHT_BYTES, ACTIVATION_BYTES]
    expected = [*parts, sum(parts), PARAM_BYTES + ADAM_BYTES]  # ..., total, checkpoint
    assert all(close(p, e / GB) for p, e in zip(printed, expected, strict=True)), row
    # Fits; the save step's peak (total + checkpoint: the kept state) fits as well.
    assert row[11] == "yes" and close(float(row[12]), (sum(parts) + expected[-1]) / GB)
    assert row[13:] == ["yes"]
    # 32 GB devices: the steady state (21.5 GB) fits 90%, the save peak (31.6 GB) does not, so
    # keep_state=auto copies the state to host at a save.
    small = run_python([*args, "--cluster=devices=64,memory_gb=32,slices=8"], timeout=120)
    row = next(line.split() for line in small.stdout.splitlines() if line.strip().startswith("8 "))
    assert row[11] == "yes" and row[13:] == ["no:", "copies", "to", "host"], row
    bad = run_python([*args, "--cluster=devices=64,slices=3,memory_gb=80"], timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: --cluster='devices=64,slices=3,memory_gb=80' is invalid: slices=3 must divide "
        f"devices=64 (equal slices); expected {memory_plan.CLUSTER_SYNTAX}"
    ]
