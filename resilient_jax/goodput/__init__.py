"""Goodput: the share of wall-clock time spent on steps that count. Measured from a run's events
(`accounting`), drawn as a timeline (`timeline`), reported by `python -m resilient_jax.goodput
WORKDIR` (`report`); predicted by an analytic model (`model`) and a discrete-event simulation
(`simulation`); a recorded run's costs and failures read from its events (`replay`) and replayed
through the model against what was measured (`validation`)."""
