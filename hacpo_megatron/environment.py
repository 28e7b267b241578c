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


def return_freed_memory() -> None:
    """Collect garbage cycles, then give the pages of freed blocks back to the system (malloc_trim):
    after a process freed big tensors that glibc would keep for reuse. Elsewhere: the collection only.

    The first call then moves every object still alive into the collector's permanent generation (gc.freeze):
    a process calls this once per step, and its long-lived objects (modules, tokenizers, megatron's and Ray's
    state: ~470k in a trainer rank of the default run) are never garbage; a full collection over them cost
    ~0.2 s a call. Later calls traverse only what was made since, where a step's cycles are. What the freeze
    keeps that later turns into cyclic garbage is kept for good: objects of the start-up and the first step,
    a bounded amount, never a growing one.
    """
    global _frozen
    gc.collect()
    if not _frozen:
        gc.freeze()
        _frozen = True
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
