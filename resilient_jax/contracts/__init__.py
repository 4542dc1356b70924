"""The names every part of a run agrees on: exit codes, environment variables, event types,
messages and fault kinds. These modules import nothing of the project outside this package (and
nothing heavy), so the supervisor, the workers, the goodput report and the tests all spell each
name from one place."""
