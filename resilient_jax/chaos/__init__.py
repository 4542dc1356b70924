"""Fault injection for tests, experiments and demos, driven by a `--chaos` spec string:
`spec` parses it (jax-free), `hook.ChaosHook` acts out the faults that hit a process,
`faulty_step.wrap_step` scales the loss of the step a nan or spike fault hits, `record` keeps
`chaos_fired.json` (each fault fires once per run) and `corrupt` damages checkpoints.
The package imports nothing itself, so `import resilient_jax.chaos.spec` stays light."""
