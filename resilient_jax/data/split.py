"""The validation split: the last `fraction` of a source's examples, held out from training (of
each dataset's examples, for a mixture: both parts keep the mixture's weights).

`holdout(source, fraction)` is a pure function of the source and the fraction: the training loader
and the evaluator both call it on the same source (`run.py`), so the examples evaluation reads are
never trained on, whether evaluation is on or off. Both parts are random-access sources of the
same kind as the one split (`__len__`, `__getitem__`), so the step-keyed loader shuffles and
batches them as it does any source.
"""

from __future__ import annotations

import math
from typing import Any

from resilient_jax.config import ConfigError
from resilient_jax.data.mixture import Mixture


class Subset:
    """Examples `[start, stop)` of a random-access source, indexed from 0; indices past the end
    wrap around, as the sources do for the loader's later epochs."""

    def __init__(self, source: Any, start: int, stop: int) -> None:
        self._source, self._start, self._len = source, start, stop - start

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        return self._source[self._start + index % self._len]

    def __repr__(self) -> str:
        return f"Subset({self._source!r}, {self._start}:{self._start + self._len})"


def holdout(source: Any, fraction: float) -> tuple[Any, Any]:
    """(training examples, validation examples): the last `ceil(len * fraction)` examples are the
    validation split. `fraction == 0`: the whole source trains and there is no split (None).
    Raises `ConfigError` when either part would be empty."""
    if fraction == 0:
        return source, None
    if isinstance(source, Mixture):
        parts = [holdout(component, fraction) for component in source.sources]
        return (
            Mixture([(train, w) for (train, _), w in zip(parts, source.weights, strict=True)]),
            Mixture([(held, w) for (_, held), w in zip(parts, source.weights, strict=True)]),
        )
    total = len(source)
    held_out = math.ceil(total * fraction)
    if held_out >= total:
        raise ConfigError(
            f"config.eval.fraction={fraction!r} is invalid: the data has only {total} examples, "
            "too few to hold any out and still train"
        )
    return Subset(source, 0, total - held_out), Subset(source, total - held_out, total)
