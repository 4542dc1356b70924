"""Local-tier pieces between memory and RAM-disk files, with as few passes over the bytes as the
kernel allows.

Where a RAM-disk save and restore spent their time (a 916 MB state, 2 cores): allocating the
file's pages (tmpfs zeroes each new page: as costly as the copy itself), the copy, zlib's CRC-32,
and on restore a fresh `bytes` object per piece, copied again into the assembled array and once
more into the device buffer. What is left:

- a write goes into a recycled data file where there is one (`LocalTier` keeps the step it drops
  as the next write's file): overwriting allocated pages runs at about twice the speed of a new
  file;
- a read lands directly in the array it assembles (`os.preadv` into its bytes), in buffers aligned
  to 64 bytes, which the CPU backend takes as device buffers without a copy
  (`jax.make_array_from_callback`; a GPU copies them to the device as before);
- the CRC-32 is ISA-L's (`checksum.crc32`);
- reads run on a few threads (file reads, page faults and the CRC release the GIL). Writes to one
  tmpfs file do not overlap (the kernel holds the file's lock), so a commit writes from one thread.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np

ALIGN = 64  # XLA's CPU client aliases host buffers aligned to this instead of copying them
READERS = max(1, min(8, os.cpu_count() or 1))  # threads a restore reads pieces with

T = TypeVar("T")
R = TypeVar("R")


def aligned_empty(shape: Iterable[int], dtype: Any) -> np.ndarray:
    """An uninitialised C-order array whose data starts on an `ALIGN`-byte boundary."""
    shape = tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    # Placed by offset, not by slicing: numpy keeps an empty slice's data pointer at its base's
    # start, so a zero-size piece sliced out would be aligned only when the allocation was.
    return np.ndarray(shape, dtype, buffer=raw, offset=start)


def as_bytes(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, writable if the array is."""
    return memoryview(array.reshape(-1).view(np.uint8))


def read_into(fd: int, buffer: memoryview, offset: int) -> int:
    """Fills `buffer` from `fd` at `offset`; returns the bytes read (fewer only at end of file)."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def write_at(fd: int, buffer: memoryview, offset: int) -> None:
    """Writes all of `buffer` to `fd` at `offset`."""
    done = 0
    while done < len(buffer):
        done += os.pwrite(fd, buffer[done:], offset + done)


def parallel_map(fn: Callable[[T], R], items: list[T], workers: int = READERS) -> list[R]:
    """`[fn(item) for item in items]` on up to `workers` threads, in order; the first error
    raised by any call is raised here."""
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(min(workers, len(items))) as pool:
        return list(pool.map(fn, items))
