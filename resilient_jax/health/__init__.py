"""Health of a run: in-band anomaly verdicts (inside the jitted step), the host-side escalation
policy, the learning-rate controller, straggler detection and the hang watchdog."""

from resilient_jax.health.in_band import HealthStats, assess, scale_updates, where_ok
from resilient_jax.health.monitor import ANOMALY_EXIT_CODE, HealthMonitor, anomaly_cause
from resilient_jax.health.straggler import StragglerDetector
from resilient_jax.health.watchdog import HANG_EXIT_CODE, Watchdog

__all__ = [
    "ANOMALY_EXIT_CODE",
    "HANG_EXIT_CODE",
    "HealthMonitor",
    "HealthStats",
    "StragglerDetector",
    "Watchdog",
    "anomaly_cause",
    "assess",
    "scale_updates",
    "where_ok",
]
