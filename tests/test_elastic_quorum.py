"""The quorum server's decisions and the split of the global batch into parts (no JAX, no torch)."""

from __future__ import annotations

import threading
import time

import pytest

from resilient_jax.control.quorum import QuorumServer
from resilient_jax.elastic.data import owned_parts
from resilient_jax.elastic.quorum_client import QuorumClient

TOKEN = "t" * 32


@pytest.fixture
def server():
    servers = []

    def make(**kwargs) -> QuorumServer:
        servers.append(QuorumServer(TOKEN, settle_s=kwargs.pop("settle_s", 0.0), **kwargs))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _ask_all(clients, steps, reform=False, timeout_s=3.0):
    """Every client asks at once (each from its own thread); their answers by index."""
    out = [None] * len(clients)

    def ask(i):
        out[i] = clients[i].request(steps[i], f"127.0.0.1:{1000 + i}", reform, timeout_s)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return out


def test_steady_quorum_keeps_its_id_and_a_closed_connection_leaves_at_once(server):
    s = server(join_timeout_s=5.0, expected=3, settle_s=10.0)
    clients = [QuorumClient(s.address, TOKEN, i) for i in range(3)]
    first = _ask_all(clients, [0, 0, 0])
    assert {q.quorum_id for q in first} == {first[0].quorum_id}
    assert first[0].slices == (0, 1, 2)
    again = _ask_all(clients, [1, 1, 1])
    assert {q.quorum_id for q in again} == {first[0].quorum_id}  # no re-forming when steady
    clients[2].close()  # slice 2 dies: its connection closes
    start = time.monotonic()
    survivors = _ask_all(clients[:2], [2, 2])
    assert time.monotonic() - start < 1.0  # no join timeout waited for a closed connection
    assert survivors[0] == survivors[1]
    assert survivors[0].slices == (0, 1) and survivors[0].quorum_id != first[0].quorum_id


def test_a_slow_slice_is_waited_for_and_a_silent_one_left_out_only_on_reform(server):
    s = server(join_timeout_s=0.3, expected=2, settle_s=10.0)
    clients = [QuorumClient(s.address, TOKEN, i) for i in range(2)]
    _ask_all(clients, [0, 0])
    # Slice 1 is connected but does not ask: slice 0 is not split off on its own.
    assert clients[0].request(1, "127.0.0.1:1000", False, timeout_s=1.0) is None
    clients[0].close()
    clients[0] = QuorumClient(s.address, TOKEN, 0)
    # Its exchange failed: after the join timeout the silent slice is left out.
    start = time.monotonic()
    quorum = clients[0].request(1, "127.0.0.1:1000", True, timeout_s=3.0)
    assert quorum is not None and quorum.slices == (0,)
    assert 0.25 < time.monotonic() - start < 2.0


def test_a_member_behind_gets_a_new_quorum_naming_the_newest_state(server):
    s = server(expected=2, settle_s=10.0)
    clients = [QuorumClient(s.address, TOKEN, i) for i in range(2)]
    _ask_all(clients, [5, 5])
    joined = _ask_all(clients, [6, 0])  # slice 1 was replaced: it starts from nothing
    assert joined[0] == joined[1]
    assert joined[0].max_step == 6 and joined[0].source_rank == 0


def test_a_fresh_server_waits_for_the_expected_slices(server):
    s = server(expected=2, settle_s=10.0)
    clients = [QuorumClient(s.address, TOKEN, i) for i in range(2)]
    # Alone, slice 0 gets no quorum: a restarted server does not split the job.
    assert clients[0].request(0, "127.0.0.1:1000", False, timeout_s=0.5) is None
    clients[0] = QuorumClient(s.address, TOKEN, 0)
    both = _ask_all(clients, [3, 3])
    assert both[0].slices == (0, 1)


def test_no_server_is_none_within_the_bound():
    client = QuorumClient("127.0.0.1:9", TOKEN, 0)  # nothing listens on the discard port
    start = time.monotonic()
    assert client.request(0, "127.0.0.1:1000", False, timeout_s=5.0) is None
    assert time.monotonic() - start < 1.0


def test_a_wrong_token_gets_no_quorum(server):
    s = server()
    client = QuorumClient(s.address, "wrong", 0)
    assert client.request(0, "127.0.0.1:1000", False, timeout_s=0.5) is None


@pytest.mark.parametrize(
    ("members", "parts", "expected"),
    [
        ((0, 1), 2, {0: [0], 1: [1]}),
        ((0,), 2, {0: [0, 1]}),  # the survivor takes over the lost slice's part
        ((1, 3), 4, {1: [0, 1], 3: [2, 3]}),
        ((0, 2), 3, {0: [0, 1], 2: [2]}),
    ],
)
def test_owned_parts_cover_the_global_batch_once(members, parts, expected):
    owned = {m: owned_parts(members, m, parts) for m in members}
    assert owned == expected
    assert sorted(p for ps in owned.values() for p in ps) == list(range(parts))


def test_a_replacement_still_waiting_when_a_slice_finishes_the_run_is_never_started(tmp_path):
    """Slice 1 fails; before its replacement's delay is over, slice 0 finishes the run: the job
    is done, and no replacement trains the whole run again alone."""
    import io
    import sys

    from resilient_jax.config import default_config
    from resilient_jax.control.elastic import ElasticSupervisor

    config = default_config()
    config.elastic.slices = 2
    config.coordinator.startup_timeout_s = 1.0
    outcomes = {0: "import time; time.sleep(0.5)", 1: "raise SystemExit(1)"}
    supervisor = ElasticSupervisor(
        config,
        lambda slice_id, _: [sys.executable, "-c", outcomes[slice_id]],
        str(tmp_path),
        devices_per_process=1,
        out=io.StringIO(),
        restart_delay_s=3.0,
    )
    result = supervisor.run(time_limit_s=30)
    assert (result.exit_code, result.replacements) == (0, 0), result


def test_a_slice_not_in_the_last_quorum_when_the_run_finishes_is_ended(tmp_path):
    """Slice 0 finishes the run while slice 1 (a replacement still starting up: in no quorum) is
    alive: the supervisor ends slice 1 instead of letting it train the whole run again alone."""
    import io
    import json
    import sys
    import time

    from resilient_jax.config import default_config
    from resilient_jax.control.elastic import ElasticSupervisor

    config = default_config()
    config.elastic.slices = 2
    config.coordinator.startup_timeout_s = 1.0
    outcomes = {0: "import time; time.sleep(0.5)", 1: "import time; time.sleep(60)"}
    supervisor = ElasticSupervisor(
        config,
        lambda slice_id, _: [sys.executable, "-c", outcomes[slice_id]],
        str(tmp_path),
        devices_per_process=1,
        out=io.StringIO(),
    )
    start = time.monotonic()
    result = supervisor.run(time_limit_s=30)
    assert (result.exit_code, result.replacements) == (0, 0), result
    assert time.monotonic() - start < 20
    with open(tmp_path / "events.jsonl") as f:
        exits = [e for e in map(json.loads, f) if e["type"] == "elastic_slice_exit"]
    assert [(e["slice"], e["reason"]) for e in exits] == [(1, "the run finished before it joined")]
