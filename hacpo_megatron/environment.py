"""The process environment, changed for a block: what processes started inside it inherit; and the
C library's allocator, where it is glibc."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
from typing import Any, Dict, Iterator, Optional


@contextlib.contextmanager
def environment_set(values: Dict[str, str]) -> Iterator[None]:
    """`values` in os.environ inside the block; every variable as it was (or absent) after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def glibc() -> Optional[Any]:
    """The C library (ctypes) where it is glibc, with `mallopt` and `malloc_trim`; None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_frozen = False  # return_freed_memory froze the objects alive at its first call


def return_freed_memory(*, freeze: bool = False) -> None:
    """Collect garbage cycles, then give the pages of freed blocks back to the system (malloc_trim):
    after a process freed big tensors that glibc would keep for reuse. Elsewhere: the collection only.

    `freeze` (a trainer rank, once per step): the first such call then moves every object still alive into the
    collector's permanent generation (gc.freeze). A rank's long-lived objects (modules, tokenizers, megatron's and
    Ray's state: ~520k in a tiny agent's rank) are never garbage, and a full collection over them cost ~0.3 s a
    call (benchmarks/bench_freed_memory.py); later calls traverse only what was made since, where a step's cycles
    are. What the freeze keeps that later turns into cyclic garbage stays for good (objects of the start-up and the
    first step: bounded, never growing), and so do their finalizers: not for processes whose cycles hold OS
    resources (a vLLM worker's multiprocessing semaphores), which call this without it.
    """
    global _frozen
    gc.collect()
    if freeze and not _frozen:
        gc.freeze()
        _frozen = True
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
