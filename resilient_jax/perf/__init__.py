"""Performance arithmetic without JAX: the step-time model (`step_time`) and the choice among
reconfiguration plans by expected cost (`plans`), shared by the supervisor and the simulators."""
