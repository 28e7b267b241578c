"""The ranks' agreement on a save: no rank goes on, and `latest` does not move, unless every rank's writes succeeded.

A checkpoint save is collective (checkpoint/megatron_io.py), but some of its writes are one rank's (the side
files, the manifest, the rename that publishes a step). A rank whose write fails on storage (a full disk, an
I/O error) must not leave the others waiting at the next barrier: each block of writes ends in an all-gather
of every rank's outcome, and if any rank failed, every rank raises the same CheckpointSaveError, naming each
such rank and why. The step's save then removes its partial folder and says what `latest` still names.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path
from typing import Iterator, List, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hacpo_megatron.checkpoint.format import CheckpointError
from hacpo_megatron.checkpoint.run_folder import LATEST_FILE


class CheckpointSaveError(CheckpointError):
    """A save that failed (a full or broken disk) on some rank; raised on every rank with every rank's reason."""


# What a failing disk raises: our own writes an OSError (or our CheckpointError), megatron's writer torch's
# CheckpointException (a BaseException) on every rank, holding each rank's cause.
STORAGE_ERRORS = (OSError, CheckpointError, CheckpointException)


def _cause(error: BaseException) -> str:
    """One line for a failed write: the OSError's reason and file, our CheckpointError's text, or (a
    CheckpointException whose writer logged no reason) the first rank's exception that megatron gathered."""
    failures = getattr(error, "failures", None)
    if failures:  # CheckpointException: {rank: (exception, traceback)}
        error = next(iter(failures.values()))[0]
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    text = (str(error).strip().splitlines() or [""])[0][:300]
    return text if isinstance(error, CheckpointError) else f"{type(error).__name__}: {text}"


@contextlib.contextmanager
def megatron_writers_own_reason() -> Iterator[None]:
    """Megatron's writer threads catch the real error of a failed write (on a full disk: "[Errno 28] No space
    left on device"), log it, and raise a CheckpointException that only says "<class 'RuntimeError'>"
    (filesystem_async.py, megatron-core 0.19). The logged line is the reason: raised as a CheckpointError."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reasons.append(record.getMessage())

    reasons: List[str] = []
    handler, logger = Collect(logging.ERROR), logging.getLogger(filesystem_async.__name__)
    logger.addHandler(handler)
    try:
        yield
    except CheckpointException as error:
        marker = "encountered an error: "  # "Local worker 0 encountered an error: <the exception>"
        worker = [reason.split(marker, 1)[1] for reason in reasons if marker in reason]
        if not worker and not reasons:
            raise
        raise CheckpointError(f"megatron's checkpoint writer: {(worker or reasons)[0]}") from error
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def every_rank_learns_of_a_failure(what: str) -> Iterator[None]:
    """Run the block on every rank, then agree (an all-gather: it is a barrier too). If any rank's block
    failed on storage, every rank raises CheckpointSaveError naming each such rank and why: a write that only
    one rank does (side files, manifest, rename) must not leave the others waiting at the next barrier."""
    error = None
    try:
        yield
    except STORAGE_ERRORS as caught:
        error = caught
    reports: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, None if error is None else f"rank {dist.get_rank()}: {_cause(error)}")
    failed = [report for report in reports if report]
    if failed:
        raise CheckpointSaveError(f"{what} failed ({'; '.join(failed)})") from error


def save_failure_message(error: CheckpointSaveError, temporary: Path, root: Path) -> str:
    """What failed where, the space left, and what `latest` still names; rank 0 removes the partial step
    folder first (on a full disk it holds the space a next save needs)."""
    if dist.get_rank() == 0:
        shutil.rmtree(temporary, ignore_errors=True)
    dist.barrier()
    # One reading, rank 0's, for every rank: each rank reading its own gave different figures while the filesystem
    # was still releasing space (0.00 and 0.09 GiB in one run under load), and every rank must say the same words.
    reading = [shutil.disk_usage(root).free if root.is_dir() else None]
    dist.broadcast_object_list(reading, src=0)
    free = reading[0]
    pointer = root / LATEST_FILE
    previous = pointer.read_text().strip() if pointer.is_file() else "no step yet"
    return (f"{error}. {temporary.name} was removed; "
            + (f"{free / 2**30:.2f} GiB free on {root}'s filesystem; " if free is not None else "")
            + f"`latest` still names {previous} (free space, then --resume continues from it)")
