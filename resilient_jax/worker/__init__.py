"""The worker's side of supervision: join the JAX job the environment describes
(`distributed.initialize_from_env`), report phases, heartbeats and step progress to the supervisor
(`client.SupervisorClient`, a train-loop hook), and wait as a warm standby (`standby`)."""
