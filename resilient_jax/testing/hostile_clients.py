"""Connections that are not a run's, against one of its control ports: for the soak test and the
control-port benchmark. Traffic goes to the address given (127.0.0.1 in both), every loop is
bounded, and each connection waits for the server to close it.

Kinds: `silent` (connects, sends nothing), `slow` (a byte every 0.1 s, never a line),
`oversized` (more than `MAX_LINE_BYTES` without a newline), `wrong_token` (a well-formed
registration with a guessed token), `random` (random bytes, then a newline).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import random
import socket
import time
from collections.abc import Callable, Sequence

from resilient_jax.control import protocol, wire
from resilient_jax.control.agent_protocol import Register

KINDS = ("silent", "slow", "oversized", "wrong_token", "random")
_WAIT_FOR_CLOSE_S = 10.0  # far above any auth timeout a test or benchmark sets
_SLOW_BYTES = 100  # at 0.1 s each: a slow client gives up after 10 s


@dataclasses.dataclass(frozen=True)
class Outcome:
    kind: str
    closed: bool  # the server closed it (EOF or reset) within the bound
    answered: bytes  # what the server sent before that (a refusal sends nothing)


def hostile_connection(address: tuple[str, int], kind: str, seed: int) -> Outcome:
    """One connection of `kind` (the randomness from `seed`), until the server closes it."""
    rng = random.Random(seed)
    answered = b""
    with socket.create_connection(address, timeout=_WAIT_FOR_CLOSE_S) as sock:
        try:
            if kind == "slow":  # the auth timeout, not a line, must end it
                sock.settimeout(0.1)
                for _ in range(_SLOW_BYTES):
                    sock.sendall(b"{")
                    try:
                        data = sock.recv(4096)
                    except TimeoutError:
                        continue
                    answered += data
                    if not data:
                        return Outcome(kind, True, answered)
                return Outcome(kind, False, answered)
            if kind == "oversized":
                sock.sendall(b"{" * (protocol.MAX_LINE_BYTES + rng.randint(1, 60000)))
            elif kind == "wrong_token":
                register = Register(slice=0)
                sock.sendall(wire.encode(register, token=f"guess-{seed}", host="intruder"))
            elif kind == "random":
                sock.sendall(rng.randbytes(rng.randint(1, 2000)) + b"\n")
            elif kind != "silent":
                raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
            sock.settimeout(_WAIT_FOR_CLOSE_S)
            while data := sock.recv(4096):
                answered += data
        except (ConnectionResetError, BrokenPipeError):
            pass  # closed by the server while this side was still sending
        except TimeoutError:
            return Outcome(kind, False, answered)
    return Outcome(kind, True, answered)


def attack(
    address: tuple[str, int],
    kinds: Sequence[str],
    concurrency: int,
    seed: int = 0,
    while_running: Callable[[], None] | None = None,
) -> list[Outcome]:
    """One connection per entry of `kinds`, `concurrency` at a time; `while_running` is called
    about every 50 ms until they are all closed (to sample the server's process)."""
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [
            pool.submit(hostile_connection, address, kind, seed + i) for i, kind in enumerate(kinds)
        ]
        while not all(f.done() for f in futures):
            if while_running is not None:
                while_running()
            time.sleep(0.05)
        return [f.result() for f in futures]


def rss_kb(pid: int) -> int:
    """Resident memory of process `pid` (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise ProcessLookupError(f"no VmRSS for process {pid}")


def open_fds(pid: int) -> int:
    """Open file descriptors of process `pid` (Linux)."""
    return len(os.listdir(f"/proc/{pid}/fd"))
