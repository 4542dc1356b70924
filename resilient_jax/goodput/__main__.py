"""python -m resilient_jax.goodput WORKDIR: goodput table, WORKDIR/goodput.json, timeline.png."""

import sys

from resilient_jax.goodput.report import main

sys.exit(main(sys.argv))
