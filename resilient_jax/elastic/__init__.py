"""Elastic data parallelism across slices: each slice its own JAX runtime (of one or several
processes, `slice_link`), gradients averaged over a membership that may change every step
(`exchange`), survivors taking over a lost slice's rows, a returning slice healing from a live
one."""
