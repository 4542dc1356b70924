"""Fault injection for tests, experiments and demos, driven by a `--chaos` spec string."""
