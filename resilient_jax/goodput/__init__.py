"""Goodput: the share of wall-clock time spent on steps that count, measured from a run's events
(`accounting`), drawn as a timeline, predicted by an analytic model (`model`) and by replaying a
run's failures through it (`replay`). `python -m resilient_jax.goodput WORKDIR` reports a run."""
