"""Health of a run seen from the host: the escalation policy over the in-band anomaly verdicts the
jitted step computes (`resilient_jax.train.in_band`), and the hang watchdog."""

from resilient_jax.health.monitor import HealthMonitor, anomaly_cause
from resilient_jax.health.watchdog import Watchdog

__all__ = ["HealthMonitor", "Watchdog", "anomaly_cause"]
