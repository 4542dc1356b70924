"""What a supervisor's `run` returns, whichever way it keeps the job training: the restart path
(`supervisor.Supervisor`, a new generation after a failure) or elastic mode
(`elastic.ElasticSupervisor`, a failed slice replaced while the others train on)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SupervisorResult:
    exit_code: int  # 0 only when the run finished training
    reason: str
    failures: int  # failures seen: workers' (restart path) or slices' and standbys' (elastic)
    generations: int = 1  # job-wide starts: one more per restart or reshape (restart path)
    replacements: int = 0  # slices replaced while the others trained on (elastic mode)
