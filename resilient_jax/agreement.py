"""Agreement among the processes of one JAX runtime, with every wait bounded.

The checkpoint tiers need it: restore must pick the same step and tier on every process, and a
save at a time-based step must happen at the same step everywhere, since an Orbax save is
collective. An elastic slice of several processes needs it as well: process 0 alone talks to the
quorum server and shares each answer, and after every exchange the slice's processes agree whether
all of theirs completed.

Device collectives (`multihost_utils.process_allgather`) wait forever for a dead peer, so the
agreement goes through the key-value store of JAX's coordination service instead, whose reads
take a timeout. A peer silent past the bound is reported through the caller's `silent` factory:
`CheckpointError` for the tiers, `SliceLost` for an elastic slice. With one process every call
returns at once.

Calls are matched by order: every process makes the same sequence of `all_gather`, `share` and
`agree` calls. Each call is a numbered round. A process deletes its key of round k when it reaches
round k + 2: by then every peer has read it, since no peer could have written round k + 1 without
finishing round k.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol


class KeyValueClient(Protocol):
    """What the agreement uses of `jax.distributed`'s coordination-service client."""

    def key_value_set(self, key: str, value: str) -> None: ...

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...

    def key_value_delete(self, key: str) -> None: ...


# (the silent process, what was being agreed on, the bound in seconds, the client's error) -> the
# exception to raise.
Silence = Callable[[int, str, float, str], Exception]


class Agreement:
    """All-gather, share and vote of small JSON values among `process_count` processes, under
    `namespace` in `client`'s store (None: a runtime of one process)."""

    def __init__(
        self,
        client: KeyValueClient | None,
        process_index: int,
        process_count: int,
        namespace: str,
        timeout_s: float,
        silent: Silence,
    ) -> None:
        self._client = client if process_count > 1 else None
        self.process_index = process_index
        self.process_count = process_count
        self.namespace = namespace
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._silent = silent
        self._round = 0
        self._own_keys: dict[int, str] = {}

    @classmethod
    def of_runtime(cls, namespace: str, timeout_s: float, silent: Silence) -> Agreement:
        """The agreement of this process's JAX runtime (`jax.distributed`, or one process)."""
        import jax
        from jax._src import distributed  # the coordination-service client; no public handle

        count = jax.process_count()
        client = distributed.global_state.client if count > 1 else None
        return cls(client, jax.process_index(), count, namespace, timeout_s, silent)

    @property
    def distributed(self) -> bool:
        return self._client is not None

    def all_gather(self, name: str, value: Any) -> list[Any]:
        """Every process's `value`, in process order."""
        if self._client is None:
            return [value]
        self._round += 1
        base = f"{self.namespace}/{name}/{self._round}"
        own = f"{base}/{self.process_index}"
        self._client.key_value_set(own, json.dumps(value))
        self._own_keys[self._round] = own
        what = f"{name} (round {self._round})"
        values = [self._get(f"{base}/{i}", i, what) for i in range(self.process_count)]
        stale = self._own_keys.pop(self._round - 2, None)
        if stale is not None:
            self._client.key_value_delete(stale)
        return values

    def share(self, name: str, value: Any) -> Any:
        """Process 0's `value` on every process (the others' values are ignored)."""
        return self.all_gather(name, value)[0]

    def agree(self, name: str, ok: bool) -> bool:
        """True when every process passed ok=True to this call."""
        return all(self.all_gather(name, bool(ok)))

    def publish(self, key: str, value: Any) -> None:
        if self._client is not None:
            self._client.key_value_set(f"{self.namespace}/pub/{key}", json.dumps(value))

    def fetch(self, key: str) -> Any:
        """A value some process published under `key`, waiting for it up to the bound."""
        return self._get(f"{self.namespace}/pub/{key}", -1, key)

    def delete(self, key: str) -> None:
        if self._client is not None:
            self._client.key_value_delete(f"{self.namespace}/pub/{key}")

    def _get(self, full_key: str, process: int, what: str) -> Any:
        assert self._client is not None
        try:
            raw = self._client.blocking_key_value_get(full_key, self._timeout_ms)
        except Exception as e:  # jax's runtime error: DEADLINE_EXCEEDED, or the service gone
            detail = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise self._silent(process, what, self._timeout_ms / 1000, detail) from e
        return json.loads(raw)
