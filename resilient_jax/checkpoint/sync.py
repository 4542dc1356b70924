"""Agreement between the processes of a JAX job, with bounded waits.

Restore must pick the same step and tier on every process, and a time-based save must happen at
the same step everywhere (an Orbax save is collective). Device collectives
(`multihost_utils.process_allgather`) wait forever for a dead peer, so agreement goes through the
key-value store of JAX's coordination service instead, whose reads take a timeout. With one
process every call returns at once.
"""

from __future__ import annotations

import json
from typing import Any

import jax
from jax._src import distributed  # the coordination-service client; no public handle exists

from resilient_jax.checkpoint.errors import CheckpointError


def _client() -> Any | None:
    return distributed.global_state.client


class ProcessSync:
    """All-gather and publish/fetch of small JSON values under one namespace.

    Every process must make the same sequence of `all_gather` calls: each call is a numbered round,
    and a process's keys of round k are deleted once it reaches round k + 2 (by then every peer has
    read them, since it could not have written round k + 1 without finishing round k).
    """

    def __init__(self, namespace: str, timeout_s: float) -> None:
        self._namespace = namespace
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._client = _client() if jax.process_count() > 1 else None
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()
        self._round = 0
        self._own_keys: dict[int, str] = {}

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def distributed(self) -> bool:
        return self._client is not None

    def all_gather(self, name: str, value: Any) -> list[Any]:
        """Every process's `value`, in process order."""
        if self._client is None:
            return [value]
        self._round += 1
        base = f"{self._namespace}/{name}/{self._round}"
        own = f"{base}/{self.process_index}"
        self._client.key_value_set(own, json.dumps(value))
        self._own_keys[self._round] = own
        what = f"{name} (round {self._round})"
        values = [self._get(f"{base}/{i}", what) for i in range(self.process_count)]
        stale = self._own_keys.pop(self._round - 2, None)
        if stale is not None:
            self._client.key_value_delete(stale)
        return values

    def publish(self, key: str, value: Any) -> None:
        if self._client is not None:
            self._client.key_value_set(f"{self._namespace}/pub/{key}", json.dumps(value))

    def fetch(self, key: str) -> Any:
        """A value some process published under `key`, waiting for it up to the timeout."""
        return self._get(f"{self._namespace}/pub/{key}", key)

    def delete(self, key: str) -> None:
        if self._client is not None:
            self._client.key_value_delete(f"{self._namespace}/pub/{key}")

    def _get(self, full_key: str, what: str) -> Any:
        assert self._client is not None
        try:
            raw = self._client.blocking_key_value_get(full_key, self._timeout_ms)
        except Exception as e:  # the client raises a runtime error carrying DEADLINE_EXCEEDED
            seconds = self._timeout_ms / 1000
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(
                f"checkpoint: processes did not agree on {what} within {seconds:.0f}s "
                f"(a peer is dead or hung): {detail}"
            ) from e
        return json.loads(raw)
