"""A warm standby's CPU priority on a host it shares with training (Linux).

A standby's start-up is work nobody waits for: elastic mode's standby slice (Python imports, the
JAX runtime, loading the job's executables, a first run of its gradient-sums program: about 20 s
of CPU for tiny_cpu), the restart path's standby workers (imports: about 2 CPU-s each, right after
a generation starts). At normal priority it takes the training's CPU for those seconds. So it is
put under SCHED_IDLE (it runs only on CPU no other thread wants) until it is given its role, and
every thread of it back under its lowerer's own policy (the one the workers inherit) before the
role is sent: the takeover and the training run at full priority. The restart path's agent does
both for its standbys (`processes.spawn_standby`); elastic mode's supervisor does both for the
standby slice its local agent started (by pid, as soon as the agent reports it started).

A thread's policy alone does not do it where the kernel groups tasks by session (autogroup,
/proc/sys/kernel/sched_autogroup_enabled): the CPU is first shared fairly between the groups, and
the standby, started in a session of its own, is a group of its own, as is each slice. So its
session's group is lowered too, to the lowest nice (19: about 1.5% of a CPU against a busy group of
nice 0), and put back at the supervisor's group's nice with the threads. The threads' SCHED_IDLE
still counts: the kernel preempts a SCHED_IDLE thread at once for a woken thread that is not. (A
nice of the threads would not help: it too counts only inside the group.)

The policy belongs to each thread, and a thread inherits its creator's at creation. Set right
after the spawn (within milliseconds, long before its imports end), every thread the standby later
creates (XLA's pools, gloo's) inherits it; `set_policy` goes over /proc/<pid>/task again until a
pass finds nothing left to change, so a thread created meanwhile by one not yet changed is caught.
Taking a thread out of SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE of 20 (sched(7)); where that
is not permitted (`raising_permitted`) the standby keeps the normal priority, since a slice left
under SCHED_IDLE would starve.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

MAX_PASSES = 10  # passes over a process's threads; each finds only threads created meanwhile
LOWEST_NICE = 19
# The kernel lets a process without CAP_SYS_ADMIN set an autogroup's nice 10 times a second.
AUTOGROUP_TRIES = 5
AUTOGROUP_RETRY_S = 0.11
ROOT_AUTOGROUP = "root"  # how `read_autogroup` names the group of sessions older than grouping


def supported() -> bool:
    """Per-thread scheduling policies through /proc (Linux)."""
    return hasattr(os, "SCHED_IDLE") and os.path.isdir("/proc/self/task")


def thread_ids(pid: int) -> list[int]:
    """The ids of process `pid`'s threads ([] for a process that has ended)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def set_policy(pid: int, policy: int, priority: int = 0, only_from: int | None = None) -> int:
    """Sets `policy` on every thread of process `pid` (with `only_from`: on those under that
    policy), pass after pass until one changes nothing; returns how many threads it changed.
    Threads that end meanwhile are skipped; raises PermissionError where the change is refused."""
    changed_in_all = 0
    for _ in range(MAX_PASSES):
        changed = 0
        for tid in thread_ids(pid):
            try:
                current = os.sched_getscheduler(tid)
                if current == policy or (only_from is not None and current != only_from):
                    continue
                os.sched_setscheduler(tid, policy, os.sched_param(priority))
            except ProcessLookupError:  # the thread ended
                continue
            changed += 1
        if not changed:
            break
        changed_in_all += changed
    return changed_in_all


def own_policy() -> tuple[int, int]:
    """This process's policy and static priority: what the slices it starts inherit."""
    return os.sched_getscheduler(0), os.sched_getparam(0).sched_priority


def read_autogroup(pid: int | str) -> tuple[str, int] | None:
    """Process `pid`'s autogroup and its nice ("/autogroup-12 nice 0"); None where the kernel
    does not group by session, or the process has ended. A process whose session began before the
    kernel grouped (none of its ancestors called setsid since boot, as under many container and CI
    init processes) is in the root group, whose file reads empty: (ROOT_AUTOGROUP, 0), the nice
    its threads count at."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            if f.read().strip() != "1":
                return None
        with open(f"/proc/{pid}/autogroup") as f:
            line = f.read().strip()
    except OSError:
        return None
    if not line:
        return ROOT_AUTOGROUP, 0
    try:
        group, _, nice = line.split()
        return group, int(nice)
    except ValueError:
        return None


def set_autogroup_nice(pid: int, nice: int, tries: int = AUTOGROUP_TRIES) -> bool:
    """Sets the nice of process `pid`'s autogroup, unless it is this process's own (the
    supervisor's session: never lowered) or the root group (which has no nice of its own to set).
    Whether it was set: not where the kernel's rate limit refused every try (the threads' policy
    still applies)."""
    theirs, own = read_autogroup(pid), read_autogroup("self")
    if theirs is None or own is None or theirs[0] in (own[0], ROOT_AUTOGROUP):
        return False
    for attempt in range(tries):
        try:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(nice))
            return True
        except BlockingIOError:  # EAGAIN: the kernel's rate limit on these writes (kernel-wide)
            if attempt + 1 < tries:
                time.sleep(AUTOGROUP_RETRY_S)
        except (FileNotFoundError, ProcessLookupError):  # it ended
            return False
    return False


def lower(pid: int, group_tries: int = AUTOGROUP_TRIES) -> int:
    """Puts process `pid`'s session's autogroup at the lowest nice, then every thread of it under
    SCHED_IDLE; returns how many threads it changed. The group first: a process that finds itself
    under SCHED_IDLE is already in the lowered group (the group's write may wait out the kernel's
    rate limit, `group_tries` times; a caller that must not wait tries once, and the threads'
    policy applies either way)."""
    set_autogroup_nice(pid, LOWEST_NICE, group_tries)
    return set_policy(pid, os.SCHED_IDLE)


def restore(pid: int) -> int:
    """Puts every SCHED_IDLE thread of process `pid` back under this process's own policy, and
    its autogroup at the nice of this process's; returns how many threads it changed."""
    own = read_autogroup("self")
    if own is not None:
        set_autogroup_nice(pid, own[1])
    policy, priority = own_policy()
    return set_policy(pid, policy, priority, only_from=os.SCHED_IDLE)


def group_left_lowered(pid: int) -> bool:
    """Whether process `pid`'s autogroup is still below this process's (a `restore` whose
    group write the kernel's rate limit refused every time): its threads would get a sliver of
    a busy CPU however they are scheduled."""
    theirs, own = read_autogroup(pid), read_autogroup("self")
    if theirs is None or own is None or theirs[0] in (own[0], ROOT_AUTOGROUP):
        return False
    return theirs[1] > own[1]


def raising_permitted() -> bool:
    """Whether this process may take a thread out of SCHED_IDLE (tried on a thread of its own,
    which ends after the try)."""
    if not supported():
        return False
    policy, priority = own_policy()
    permitted: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))  # lowering: always allowed
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(priority))
        except PermissionError:
            permitted.append(False)
        else:
            permitted.append(True)

    thread = threading.Thread(target=probe, name="sched-idle-probe", daemon=True)
    thread.start()
    thread.join()
    return permitted == [True]


def idle_usable(wanted: bool, who: str, say: Callable[[str], None]) -> bool:
    """Whether `who` waits under SCHED_IDLE: when `wanted` and this process may raise its
    threads back (a standby left idle would starve the job it joins); says why not otherwise."""
    if not wanted:
        return False
    if raising_permitted():
        return True
    say(
        f"{who} starts at normal CPU priority: this process may not raise a thread out of "
        "SCHED_IDLE (needs CAP_SYS_NICE or RLIMIT_NICE 20, on Linux)"
    )
    return False
