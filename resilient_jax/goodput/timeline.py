"""The timeline picture of a run: a lane per process (steps, saves, restores, compiles, failures,
chaos) under the accounting lane, which shows how `goodput.accounting` classified each moment of
the wall clock. matplotlib is imported only when a picture is drawn."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from resilient_jax.contracts.event_types import EventType
from resilient_jax.goodput.accounting import (
    BADPUT,
    LABELS,
    PRODUCTIVE,
    Goodput,
    event_interval,
    event_lane,
)

CATEGORY_COLOURS = {
    PRODUCTIVE: "#2ca02c",
    "initialisation": "#7f7f7f",
    "compilation": "#ff7f0e",
    "data_loading": "#bcbd22",
    "evaluation": "#aec7e8",
    "profiling": "#c5b0d5",
    "checkpoint_save": "#1f77b4",
    "checkpoint_restore": "#9467bd",
    "lost_progress": "#d62728",
    "failure_detection": "#8c564b",
    "restart": "#e377c2",
    "anomaly": "#ff9896",
    "stragglers": "#17becf",
    "idle": "#f0f0f0",
}
# Events drawn as bars on their process's lane, by the category whose colour they take.
_LANE_BARS = {
    EventType.STEP: PRODUCTIVE,
    EventType.COMPILE: "compilation",
    EventType.SAVE: "checkpoint_save",
    EventType.RESTORE: "checkpoint_restore",
    EventType.EVAL: "evaluation",
    EventType.PROFILE: "profiling",
    EventType.JAX_INIT: "initialisation",
    EventType.INIT: "initialisation",
}
# Events drawn as points on their lane: (matplotlib marker, colour).
_LANE_MARKS = {
    EventType.FAILURE_DETECTED: ("X", "#d62728"),
    EventType.CHAOS: ("*", "black"),
    EventType.ANOMALY: ("v", "#ff7f0e"),
    EventType.STOP: ("s", "#7f7f7f"),
    # Hosts: an agent up, attached to a supervisor (again after a restart), admitted, lost.
    EventType.AGENT_START: ("^", "#1f77b4"),
    EventType.SUPERVISOR_ATTACH: ("o", "#9467bd"),
    EventType.HOST_JOINED: ("P", "#2ca02c"),
    EventType.HOST_LOST: ("x", "#d62728"),
}
# Events that concern the whole job: a dashed line across every lane.
_VERTICAL = {
    EventType.RESTART: "#e377c2",
    EventType.EVICT: "#8c564b",
    EventType.SCALE_UP: "#2ca02c",
}


def _lane_order(lane: str) -> tuple[int, int]:
    return (0, 0) if lane == "supervisor" else (1, int(lane) if lane.isdigit() else 0)


def plot_timeline(events: Sequence[dict[str, Any]], result: Goodput, path: str) -> None:
    """A lane per process (steps, saves, restores, compiles, failures, chaos) under the
    accounting lane (how each moment of the wall clock was classified)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = result.segments[0][0] if result.segments else 0.0
    lanes = sorted({event_lane(e) for e in events}, key=_lane_order)
    rows = ["accounting", *[f"process {x}" if x != "supervisor" else x for x in lanes]]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.5 * len(rows)))
    for start, end, category in result.segments:
        ax.broken_barh(
            [(start - t0, end - start)], (-0.4, 0.8), color=CATEGORY_COLOURS[category], lw=0
        )
    for row, lane in enumerate(lanes, start=1):
        mine = [e for e in events if event_lane(e) == lane]
        bars: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        previous_end = None
        for e in mine:
            if e["type"] in _LANE_BARS:
                # A step without a duration started at the lane's previous event.
                after = previous_end if e["type"] == EventType.STEP else None
                start, end = event_interval(e, after)
                bars[_LANE_BARS[e["type"]]].append((start - t0, end - start))
            previous_end = float(e["time"])
        for category, spans in bars.items():
            ax.broken_barh(spans, (row - 0.35, 0.7), color=CATEGORY_COLOURS[category], lw=0)
        for typ, (marker, colour) in _LANE_MARKS.items():
            xs = [float(e["time"]) - t0 for e in mine if e["type"] == typ]
            if xs:
                ax.plot(xs, [row] * len(xs), marker, color=colour, ms=8, ls="none", label=str(typ))
    for e in events:
        colour = _VERTICAL.get(e["type"])
        if colour:
            ax.axvline(float(e["time"]) - t0, color=colour, ls="--", lw=1)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run began")
    ax.set_title(f"goodput {100 * result.goodput:.1f}% of {result.wall_s:.1f} s")
    used = [c for c in (PRODUCTIVE, *BADPUT) if result.seconds[c] > 1e-3 * result.wall_s]
    handles = [Patch(color=CATEGORY_COLOURS[c], label=LABELS[c]) for c in used]
    seen: dict[str, Any] = {}
    for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
        seen.setdefault(label, handle)
    ax.legend(
        handles=handles + list(seen.values()),
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
