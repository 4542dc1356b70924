"""`Exchange` on the gloo process group of `torch.distributed` (CPU, TCP): the reference backend.

Every process hosts a `TCPStore` for its whole life; a quorum rendezvouses on the store of its
first member (its process 0's), under the quorum's id as key prefix, so groups of successive
quorums never mix; in slices of several processes, process p of each member forms a group of its
own with process p of the others, under a prefix of its own. The
group is created directly (`ProcessGroupGloo(store, rank, size, timeout)`), not through
`init_process_group`, so that it can be dropped and formed again in the same process. Gloo
notices a killed peer at once (its TCP connection resets) and a hung one after `timeout_s`; both
surface here as `ExchangeError`.
"""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np

from resilient_jax.elastic.exchange import ExchangeError, Quorum

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "elastic mode needs torch (the gloo exchange): pip install 'resilient_jax[elastic]' "
        "--extra-index-url https://download.pytorch.org/whl/cpu"
    ) from e


class GlooExchange:
    def __init__(self, host: str, timeout_s: float, process: int = 0) -> None:
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._process = process  # this process's index in its slice: its group's key prefix
        # Port 0: the kernel picks a free port; members learn it from the quorum.
        self._own_store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=self._timeout
        )
        self.store_address = f"{host}:{self._own_store.port}"
        self._group: dist.ProcessGroup | None = None
        self._rank = 0
        self._size = 1

    def configure(self, quorum: Quorum, slice_id: int) -> None:
        self._group = None
        self._rank, self._size = quorum.rank_of(slice_id), len(quorum.members)
        if self._size == 1:
            return  # alone: every collective is the identity
        host, _, port = quorum.members[0].store.rpartition(":")
        try:
            store = dist.TCPStore(
                host, int(port), is_master=False, wait_for_workers=False, timeout=self._timeout
            )
            # Process p of each member slice forms the group of index p: each its own keys.
            prefix = f"quorum/{quorum.quorum_id}"
            if self._process:
                prefix = f"quorum-p{self._process}/{quorum.quorum_id}"
            prefixed = dist.PrefixStore(prefix, store)
            self._group = dist.ProcessGroupGloo(prefixed, self._rank, self._size, self._timeout)
        except (RuntimeError, ValueError) as e:  # DistStoreError, DistNetworkError, timeouts
            raise ExchangeError(f"forming quorum {quorum.quorum_id}: {_one_line(e)}") from e

    def allreduce_sum(self, buffer: np.ndarray) -> np.ndarray:
        if self._size == 1:
            return buffer
        tensor = torch.from_numpy(np.array(buffer, copy=True))  # the caller's stays as it was
        self._run(lambda g: g.allreduce([tensor]), "allreduce")
        return tensor.numpy()

    def broadcast(self, buffer: np.ndarray, root: int) -> np.ndarray:
        return self.start_broadcast(np.array(buffer, copy=True), root).wait()

    def start_broadcast(self, buffer: np.ndarray, root: int) -> _Transfer:
        tensor = torch.from_numpy(buffer)  # in place: the caller leaves it alone until wait()
        if self._size == 1:
            return _Transfer(self, None, tensor, "broadcast")
        options = dist.BroadcastOptions()
        options.rootRank = root
        work = self._start(lambda g: g.broadcast([tensor], options), "broadcast")
        return _Transfer(self, work, tensor, "broadcast")

    def close(self) -> None:
        self._group = None
        self._own_store = None

    def _run(self, op, name: str) -> None:
        self._wait(self._start(op, name), name)

    def _start(self, op, name: str) -> Any:
        if self._group is None:
            raise ExchangeError(f"{name}: no group formed (the last quorum failed)")
        try:
            return op(self._group)
        except RuntimeError as e:
            self._group = None
            raise ExchangeError(f"{name}: {_one_line(e)}") from e

    def _wait(self, work: Any, name: str) -> None:
        try:
            work.wait(self._timeout)
        except RuntimeError as e:  # gloo: peer closed, connection reset, timed out
            self._group = None  # a failed group is never used again: form the next quorum
            raise ExchangeError(f"{name}: {_one_line(e)}") from e


class _Transfer:
    """A gloo collective in flight (or none, for a group of one) on `tensor`, in place."""

    def __init__(self, exchange: GlooExchange, work: Any, tensor: torch.Tensor, name: str):
        self._exchange, self._work, self._tensor, self._name = exchange, work, tensor, name

    def wait(self) -> np.ndarray:
        if self._work is not None:
            work, self._work = self._work, None
            self._exchange._wait(work, self._name)
        return self._tensor.numpy()


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
