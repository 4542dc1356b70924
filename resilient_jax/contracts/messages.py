"""The name of every message that crosses a process boundary on the control plane's sockets (the
`type` field of each JSON line), and the phases a worker reports. Each name's payload is a typed
message (`control.wire`) of its channel: `control.protocol` (workers and supervisor),
`control.agent_protocol` (host agents), `control.standby` (every standby's role),
`control.quorum_protocol` (elastic slices),
`control.tier_service` (peers' local tiers)."""

from __future__ import annotations

from resilient_jax.contracts.names import Name


class Phase(Name):
    """What a worker is doing, in its heartbeats. Before its first step in a generation a worker
    is starting (JAX init, restore, compile); `done` (the final save and exit) is slow on purpose.
    `ready`: compiled and restored, taking the generation's first step (which sets up the
    collectives). Only `train` is judged by step time. `error`: the worker hit an error it cannot
    recover from; it says so at once because it may not manage to exit (JAX's exit-time shutdown
    barrier waits for peers that are stuck in a collective)."""

    INIT = "init"
    RESTORE = "restore"
    COMPILE = "compile"
    READY = "ready"
    TRAIN = "train"
    DONE = "done"
    ERROR = "error"


PHASES: tuple[Phase, ...] = tuple(Phase)


class WorkerMessage(Name):
    """Worker -> supervisor, and the one line the supervisor ever sends a worker."""

    HEARTBEAT = "heartbeat"
    BYE = "bye"  # the worker closes its client on purpose: silence after this is no failure
    # The answer to a heartbeat of a generation the supervisor gave up ({"type": "fenced",
    # "generation": the current one}); the worker stops.
    FENCED = "fenced"


class AgentMessage(Name):
    """Host agent -> supervisor."""

    REGISTER = "register"
    AGENT_HEARTBEAT = "agent_heartbeat"
    STARTED = "started"
    WORKER_EXIT = "worker_exit"
    PROBE = "probe"


class AgentCommand(Name):
    """Supervisor -> host agent."""

    WELCOME = "welcome"
    START = "start"
    SIGNAL = "signal"
    STANDBYS = "standbys"
    FENCE = "fence"
    FAULT = "fault"
    END = "end"


class StandbyMessage(Name):
    """To a warm standby: from its host agent on its stdin (restart path), or from the quorum
    server on its connection (elastic mode's standby slice)."""

    ROLE = "role"  # {"env", "whole_env", "workdir"}: what the standby becomes


class QuorumMessage(Name):
    """Between elastic slices (and their standbys) and the supervisor's quorum server."""

    QUORUM = "quorum"
    STANDBY = "standby"  # a standby slice, ready: {"pid"}; answered with its role (StandbyMessage)


class TierRequest(Name):
    """To a host's local-tier server, from a peer fetching checkpoint pieces."""

    LIST = "list"
    READ = "read"
