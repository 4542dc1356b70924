"""The quorum server's decisions and the split of the global batch into parts (no JAX, no torch)."""

from __future__ import annotations

import io
import os
import signal
import socket
import threading
import time

import pytest
from conftest import elastic_stand_in_process, stand_in_elastic_config, wait_for_events

from resilient_jax.control.quorum import QuorumServer
from resilient_jax.elastic.data import owned_parts
from resilient_jax.elastic.quorum_client import QuorumClient
from resilient_jax.events import read_events

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


def _ask_all(clients, steps, reform=False, timeout_s=3.0, last=None):
    """Every client asks at once (each from its own thread, training on `last` if given); their
    answers by index."""
    out = [None] * len(clients)

    def ask(i):
        out[i] = clients[i].request(steps[i], f"127.0.0.1:{1000 + i}", reform, timeout_s, last)

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


def test_a_slice_left_out_while_hung_is_not_waited_for_again_and_is_let_back_in(server):
    s = server(join_timeout_s=0.3, expected=3, settle_s=10.0)
    clients = [QuorumClient(s.address, TOKEN, i) for i in range(3)]
    _ask_all(clients, [0, 0, 0])
    # Slice 2 hangs with its connection open; the others' exchange fails and they re-form.
    reformed = _ask_all(clients[:2], [1, 1], reform=True)
    assert reformed[0].slices == (0, 1)
    # The next steps are decided as soon as the members ask: no wait for the hung slice.
    for step in (2, 3):
        start = time.monotonic()
        steady = _ask_all(clients[:2], [step, step], timeout_s=3.0)
        assert time.monotonic() - start < 0.25
        assert steady[0] == steady[1] and steady[0].quorum_id == reformed[0].quorum_id
    # Slice 2 comes back and asks at the step it was at: it is not answered alone, but let in
    # with the members' next step, behind them (the members heal it).
    returned = []
    asking = threading.Thread(
        target=lambda: returned.append(clients[2].request(1, "127.0.0.1:1002", False, 3.0))
    )
    asking.start()
    time.sleep(0.3)
    assert not returned  # not decided on its own
    back = _ask_all(clients[:2], [4, 4])
    asking.join(timeout=10)
    assert back[0] == back[1] == returned[0]
    assert back[0].slices == (0, 1, 2) and back[0].max_step == 4
    assert back[0].quorum_id != reformed[0].quorum_id


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


def _restart(server, old):
    """Closes `old` (its process died) and starts a server on the same address."""
    host, port = old.address.split(":")
    old.close()
    return server(host=host, port=int(port), expected=2, settle_s=10.0)


def test_a_restarted_server_rebuilds_the_quorum_from_its_slices_without_stalling_them(server):
    s = server(expected=2, settle_s=10.0)
    clients = [QuorumClient(s.address, TOKEN, i, retry_s=0.0) for i in range(2)]
    steady = _ask_all(clients, [0, 0])[0]
    s = _restart(server, s)
    # The first asks after the restart find the old connections closed: train on.
    assert _ask_all(clients, [1, 1], last=steady) == [None, None]
    # Slice 0 is back, slice 1 not yet: slice 0 (training on `steady`) is answered at once.
    start = time.monotonic()
    assert clients[0].request(2, "127.0.0.1:1000", False, 5.0, steady) is None
    assert time.monotonic() - start < 0.5
    # Slice 1 comes back at step 2 or 3: told the same as slice 0 for the same step, and at the
    # step after, the quorum both train on is taken over, id and all (no re-forming).
    assert clients[1].request(2, "127.0.0.1:1001", False, 1.0, steady) is None
    for step in (3, 4):
        again = _ask_all(clients, [step, step], last=steady)
        assert again[0] == again[1]
        if again[0] is not None:
            break
    assert again[0].slices == (0, 1) and again[0].quorum_id == steady.quorum_id
    assert s.decided[0]["carried_over"] and s.last_slices() == [0, 1]


def test_a_restarted_server_leaves_out_a_member_that_died_meanwhile(server):
    s = server(expected=2, settle_s=10.0, join_timeout_s=0.3)
    clients = [QuorumClient(s.address, TOKEN, i, retry_s=0.0) for i in range(2)]
    steady = _ask_all(clients, [0, 0])[0]
    s = _restart(server, s)
    clients[1].close()  # slice 1 died while the server was away
    assert clients[0].request(1, "127.0.0.1:1000", False, 1.0, steady) is None
    assert clients[0].request(1, "127.0.0.1:1000", False, 1.0, steady) is None  # not yet
    # Its exchange with the dead slice failed: it asks to re-form, and goes on alone.
    quorum = clients[0].request(1, "127.0.0.1:1000", True, timeout_s=3.0)
    assert quorum is not None and quorum.slices == (0,)
    assert quorum.quorum_id != steady.quorum_id


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

    from resilient_jax.control.elastic import ElasticSupervisor

    config = stand_in_elastic_config(2)  # test_elastic_standby.py has the standby's
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

    from resilient_jax.control.elastic import ElasticSupervisor

    config = stand_in_elastic_config(2)  # test_elastic_standby.py has the standby's
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


# A slice stand-in: runs for a while, then writes the `stop` event a finished worker writes.
_FINISHING_SLICE = (
    "import json, os, sys, time; time.sleep(float(sys.argv[2])); "
    "f = open(os.path.join(sys.argv[1], 'events.jsonl'), 'a'); "
    "f.write(json.dumps({'type': 'stop', 'pid': os.getpid(), 'exit_code': 0}) + '\\n')"
)


def _elastic_supervisor(workdir, token, sleep_s=2.0, out=None):
    import io
    import sys

    from resilient_jax.control.elastic import ElasticSupervisor

    config = stand_in_elastic_config(2)  # test_elastic_standby.py has the standby's
    return ElasticSupervisor(
        config,
        lambda slice_id, slice_dir: [
            sys.executable,
            "-c",
            _FINISHING_SLICE,
            slice_dir,
            str(sleep_s),
        ],
        str(workdir),
        devices_per_process=1,
        out=out if out is not None else io.StringIO(),
        token=token,
    )


def test_a_supervisor_started_again_takes_over_the_running_slices(tmp_path):
    """The supervisor's process dies (SIGKILL) with its slices running under their hosts'
    agents: one started with another run token is refused (one line, nothing taken over), and
    one started with the job's listens on the same quorum address, adopts both slices (none
    restarted) and sees them finish."""
    import json
    import sys

    from resilient_jax.control.local_hosts import ForeignAgent

    workdir = str(tmp_path)
    argv = [sys.executable, "-c", _FINISHING_SLICE, "{workdir}", "8"]
    first = elastic_stand_in_process(workdir, {0: argv, 1: argv}, TOKEN)
    try:
        starts = wait_for_events(workdir, "elastic_slice_start", 2)
    finally:
        first.kill()  # SIGKILL: its agents and slices stay behind
        first.wait(timeout=10)
    pids = {e["slice"]: e["pid"] for e in starts}
    with open(tmp_path / "elastic.json") as f:
        address = json.load(f)["address"]
    refused = _elastic_supervisor(tmp_path, "u" * 32)
    with pytest.raises(ForeignAgent, match="another run token"):
        refused.open()
    second = _elastic_supervisor(tmp_path, TOKEN).open()
    assert second.quorum.address == address
    result = second.run(time_limit_s=30)
    assert (result.exit_code, result.replacements) == (0, 0), result
    assert second.adopted == [0, 1]
    events = [e for e in read_events(workdir) if e["type"].startswith("elastic_slice")]
    assert [(e["type"], e["slice"], e["pid"]) for e in events] == [
        ("elastic_slice_start", 0, pids[0]),
        ("elastic_slice_start", 1, pids[1]),
        ("elastic_slice_adopted", 0, pids[0]),
        ("elastic_slice_adopted", 1, pids[1]),
    ]


def test_an_elastic_supervisor_touches_nothing_until_opened(tmp_path, monkeypatch):
    """Construction keeps its arguments: no workdir, no token file read, no port; `open` does
    all of it, and a second `open` (the one `run` does) is a no-op."""
    from resilient_jax.contracts import env_vars

    workdir = tmp_path / "job"
    monkeypatch.delenv(env_vars.RUN_TOKEN, raising=False)
    monkeypatch.setenv(env_vars.RUN_TOKEN_FILE, str(tmp_path / "absent"))  # read: an error
    supervisor = _elastic_supervisor(workdir, token=None)
    assert not workdir.exists() and not hasattr(supervisor, "quorum")
    with pytest.raises(ValueError, match="cannot read it"):
        supervisor.open()
    monkeypatch.setenv(env_vars.RUN_TOKEN, TOKEN)
    monkeypatch.delenv(env_vars.RUN_TOKEN_FILE)
    opened = _elastic_supervisor(workdir, token=None)
    assert opened.open() is opened and opened.open() is opened
    try:
        assert workdir.is_dir()
        host, _, port = opened.quorum.address.rpartition(":")
        socket.create_connection((host, int(port)), timeout=5).close()  # listening
    finally:
        opened._close()  # nothing was started: no agent, no slice
        opened._plane.close()


# A slice stand-in that counts the SIGTERMs it gets, and exits 0 once `exit` appears.
_STOPPABLE_SLICE = """
import os, signal, sys, time
def on_term(signum, frame):
    with open(os.path.join(sys.argv[1], "signals"), "a") as f:
        f.write("TERM\\n")
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(sys.argv[1], "ready"), "w").close()
while not os.path.exists(os.path.join(sys.argv[1], "exit")):
    time.sleep(0.02)
"""


def test_a_stop_request_reaches_every_slice_once_and_nothing_replaces_them(tmp_path):
    """SIGTERM to the elastic supervisor (twice: the second cuts the save short) is passed on to
    every slice exactly once each, and the slices that stop are not replaced."""
    import io
    import sys

    from resilient_jax.control.elastic import ElasticSupervisor, slice_workdir

    config = stand_in_elastic_config(2)  # test_elastic_standby.py has the standby's
    out = io.StringIO()
    supervisor = ElasticSupervisor(
        config,
        lambda _, slice_dir: [sys.executable, "-c", _STOPPABLE_SLICE, slice_dir],
        str(tmp_path),
        devices_per_process=1,
        out=out,
        token=TOKEN,
    )
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=supervisor.run(time_limit_s=60)))
    thread.start()
    dirs = [slice_workdir(str(tmp_path), s) for s in (0, 1)]

    def terms(d: str) -> int:
        try:
            with open(os.path.join(d, "signals")) as f:
                return f.read().count("TERM")
        except FileNotFoundError:
            return 0

    try:
        _wait_until(lambda: all(os.path.exists(os.path.join(d, "ready")) for d in dirs))
        supervisor.request_stop(signal.SIGTERM)
        _wait_until(lambda: all(terms(d) == 1 for d in dirs))
        supervisor.request_stop(signal.SIGTERM)
        _wait_until(lambda: all(terms(d) == 2 for d in dirs))
        time.sleep(0.5)  # 10 of the supervisor's polls: nothing is passed on twice
        assert [terms(d) for d in dirs] == [2, 2]
    finally:
        for d in dirs:
            open(os.path.join(d, "exit"), "w").close()
        thread.join(timeout=30)
    assert (result["r"].exit_code, result["r"].replacements) == (0, 0), result["r"]
    # The verdict as the restart path gives it (`supervisor_core`): one `stop` event, one line.
    stops = [e for e in read_events(str(tmp_path)) if e["type"] == "stop"]
    assert [(e["exit_code"], e["reason"], e["replacements"]) for e in stops] == [(0, "finished", 0)]
    assert out.getvalue().splitlines()[-1] == "[elastic] stop (exit 0): finished"


def test_an_elastic_run_that_cannot_start_ends_with_exit_2_and_one_line(tmp_path, monkeypatch):
    """A token file others may read: `run` refuses it before anything starts, as the restart
    path's supervisor does (exit 2, one line, no workdir written)."""
    from resilient_jax.contracts import env_vars

    token_file = tmp_path / "token"
    token_file.write_text("secret")
    token_file.chmod(0o644)
    monkeypatch.delenv(env_vars.RUN_TOKEN, raising=False)
    monkeypatch.setenv(env_vars.RUN_TOKEN_FILE, str(token_file))
    out = io.StringIO()
    supervisor = _elastic_supervisor(tmp_path / "job", token=None, out=out)
    result = supervisor.run(time_limit_s=10)
    assert result.exit_code == 2 and "mode 644; allowed: 600" in result.reason, result
    said = out.getvalue()
    assert said.count("\n") == 1 and said.startswith("[elastic] stop (exit 2): "), said
    assert not (tmp_path / "job").exists()


# A slice stand-in as the trainer takes SIGTERM: it saves (here: nothing) and exits 42.
_SAVING_SLICE = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(42))
open(os.path.join(sys.argv[1], "ready"), "w").close()
time.sleep(60)
"""


def test_slices_that_save_and_stop_on_request_end_the_run_interrupted_not_failed(tmp_path):
    """Stopped on request, slices exit 42 (saved): the verdict is 130 as on the restart path,
    with no failure counted and nothing replaced (it was 1, "every slice failed")."""
    import sys

    from resilient_jax.control.elastic import ElasticSupervisor, slice_workdir

    config = stand_in_elastic_config(2)  # test_elastic_standby.py has the standby's
    supervisor = ElasticSupervisor(
        config,
        lambda _, slice_dir: [sys.executable, "-c", _SAVING_SLICE, slice_dir],
        str(tmp_path),
        devices_per_process=1,
        out=io.StringIO(),
        token=TOKEN,
    )
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=supervisor.run(time_limit_s=60)))
    thread.start()
    dirs = [slice_workdir(str(tmp_path), s) for s in (0, 1)]
    try:
        _wait_until(lambda: all(os.path.exists(os.path.join(d, "ready")) for d in dirs))
        supervisor.request_stop(signal.SIGTERM)
    finally:
        thread.join(timeout=30)
    r = result["r"]
    assert (r.exit_code, r.failures, r.replacements) == (130, 0, 0), r
    assert r.reason == "interrupted by SIGTERM; slices asked to save and stop"
    exits = [e for e in read_events(str(tmp_path)) if e["type"] == "elastic_slice_exit"]
    assert sorted((e["slice"], e["exit_code"]) for e in exits) == [(0, 42), (1, 42)]


def test_a_stop_request_cancels_a_replacement_still_waiting_to_start(tmp_path):
    """Slice 0 fails; its cold replacement is due after the restart delay. A stop requested
    meanwhile cancels it: a slice started after the stop would never hear it and train on."""
    import sys

    from resilient_jax.control.elastic import ElasticSupervisor, slice_workdir

    config = stand_in_elastic_config(2)  # test_elastic_standby.py has the standby's

    def argv(slice_id: int, slice_dir: str) -> list[str]:
        program = "import sys; sys.exit(3)" if slice_id == 0 else _SAVING_SLICE
        return [sys.executable, "-c", program, slice_dir]

    supervisor = ElasticSupervisor(
        config, argv, str(tmp_path), 1, out=io.StringIO(), restart_delay_s=5.0, token=TOKEN
    )
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=supervisor.run(time_limit_s=60)))
    thread.start()

    def exits() -> list[dict]:
        return [e for e in read_events(str(tmp_path)) if e["type"] == "elastic_slice_exit"]

    try:
        _wait_until(lambda: os.path.exists(os.path.join(slice_workdir(str(tmp_path), 1), "ready")))
        _wait_until(lambda: len(exits()) == 1)  # slice 0 failed: its replacement is due in 5 s
        supervisor.request_stop(signal.SIGTERM)
    finally:
        thread.join(timeout=30)
    r = result["r"]
    assert (r.exit_code, r.failures, r.replacements) == (130, 1, 0), r
    starts = [e for e in read_events(str(tmp_path)) if e["type"] == "elastic_slice_start"]
    assert sorted(e["slice"] for e in starts) == [0, 1]


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
