"""The goodput model's elastic mode (`goodput.elastic`) against closed forms."""

from __future__ import annotations

import pytest

from resilient_jax.goodput.elastic import ElasticStrategy, monte_carlo_elastic, simulate_elastic
from resilient_jax.goodput.model import Cluster


def _strategy(**overrides) -> ElasticStrategy:
    fields = dict(
        name="elastic",
        step_s=1.0,
        exchange_s=0.25,
        slices=2,
        detection_s=0.0,
        replace_s=0.0,
        heal_s=0.0,
    )
    return ElasticStrategy(**{**fields, **overrides})


def test_without_failures_only_the_exchange_is_lost():
    never = Cluster(chips=1, chip_mtbf_s=float("inf"))
    result = simulate_elastic(_strategy(), never, horizon_s=1000.0)
    assert result.failures == 0
    assert result.goodput == pytest.approx(1.0 / 1.25, rel=1e-12)
    assert sum(result.seconds.values()) == pytest.approx(result.wall_s)


@pytest.mark.parametrize(
    ("overrides", "loss_per_failure_s"),
    [
        # detection and, on average, half the step in flight
        ({"exchange_s": 0.0, "detection_s": 10.0}, 10.0 + 0.5),
        # a round of 8 steps: half of it redone
        ({"exchange_s": 0.0, "detection_s": 10.0, "round_steps": 8}, 10.0 + 4.0),
        # 40 s alone on 2 slices (half the throughput) and a 2 s heal; a step joins a boundary
        ({"exchange_s": 0.0, "replace_s": 40.0, "heal_s": 2.0}, 0.5 + 20.0 + 2.0),
    ],
)
def test_each_failure_costs_what_the_survivors_lose(overrides, loss_per_failure_s):
    mtbf_s = 2000.0
    cluster = Cluster(chips=1, chip_mtbf_s=mtbf_s)
    mc = monte_carlo_elastic(_strategy(**overrides), cluster, failures=40_000, seed=1)
    expected = 1.0 - loss_per_failure_s / mtbf_s
    assert mc.goodput == pytest.approx(expected, abs=0.0015)


def test_elastic_mode_needs_two_slices():
    with pytest.raises(ValueError, match="2 or more slices"):
        _strategy(slices=1)
