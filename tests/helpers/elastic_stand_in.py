"""An elastic supervisor over stand-in slices, as a process of its own: a test kills it (SIGKILL)
to leave its agents and slices behind for the next supervisor to take over.

    python tests/helpers/elastic_stand_in.py SPEC.json

SPEC: {"workdir", "slices", "standby", "restart_delay_s", "argv": {slice id (-1: the standby):
argv, "{workdir}" replaced by the slice's workdir}}; the run token comes from RJ_RUN_TOKEN.
"""

from __future__ import annotations

import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conftest import stand_in_elastic_config

from resilient_jax.control.elastic import ElasticSupervisor


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    config = stand_in_elastic_config(spec["slices"], standby=spec["standby"])
    config.elastic.standby_idle_cpu = False
    argv = {int(s): a for s, a in spec["argv"].items()}

    def argv_for(slice_id: int, slice_dir: str) -> list[str]:
        return [a.replace("{workdir}", slice_dir) for a in argv[slice_id]]

    supervisor = ElasticSupervisor(
        config,
        argv_for,
        spec["workdir"],
        devices_per_process=1,
        out=io.StringIO(),
        restart_delay_s=spec["restart_delay_s"],
    )
    sys.exit(supervisor.run(time_limit_s=120).exit_code)


if __name__ == "__main__":
    main()
