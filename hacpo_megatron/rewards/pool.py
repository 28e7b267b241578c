"""Scoring many responses in worker processes, with time limits, so that no model output can hang or kill a run.

Time is counted in the worker's CPU seconds, not on the clock: a response costs what it costs whatever else the
machine runs, so a loaded machine (a busy cluster node, CI's two cores under four training ranks) scores the
same answers the same way, and a resumed run reproduces the one it continues. The clock only catches a function
that waits instead of computing (a socket, a lock), at ten times the CPU limit. Two limits guard every response:
- a soft limit (``timeout_s`` CPU seconds, or ``wall_limit_s`` on the clock): the worker arms timers in its main
  thread around the reward call (SIGPROF, SIGALRM); when one fires the call is abandoned, the response scores 0
  and is counted as ``timeout``;
- a hard limit (``kill_after_s`` CPU seconds, or twice ``wall_limit_s`` plus a second on the clock): a signal
  cannot interrupt a long C-level call (a huge integer power, a regex), so the parent also reads the worker's
  CPU time; a worker past a hard limit is killed and replaced, its response scores 0 and is counted as
  ``killed``.
Before anything is sent to a worker, a cheap screen in the parent (``answers.reject_reason``) scores 0 the
responses that are huge, have no final answer, or whose answer is too long or too deeply nested, and
counts each under its reason.

Workers are started with the 'spawn' method (the training process holds threads, which fork would copy
in a broken state) once per run; use the pool as a context manager or call ``close()``, which leaves no
child process behind.
"""

from __future__ import annotations

import math
import multiprocessing
import signal
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import psutil

from hacpo_megatron.rewards.answers import REJECT_REASONS, reject_oversize, reject_reason
from hacpo_megatron.rewards.math_verify import compute_score

RewardFn = Callable[..., float]
Screen = Callable[[Any], Optional[str]]

# Outcomes of a dispatched response, besides "ok". Together with the screen's reasons they are the
# counters of the stats dict, always present (0 when nothing happened) so that logs have stable keys.
WORKER_OUTCOMES = ("timeout", "killed", "crashed", "error")
WORKER_START_TIMEOUT_S = 120.0  # importing sympy on a busy machine takes seconds; a broken env takes forever
SHUTDOWN_GRACE_S = 2.0
WALL_LIMIT_PER_CPU_LIMIT = 10  # a worker given a tenth of a core still scores by CPU time


@dataclass(frozen=True)
class RewardItem:
    """One response to score, with the arguments of a reward function."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: Optional[dict] = None


class RewardTimeout(BaseException):
    """Raised by the worker's timer; a BaseException, so ``except Exception`` in sympy or a plug-in can't swallow it."""


# ----------------------------------------------------------------------------------------------------------
# Worker side: runs in a child process, in its main thread.


def _worker_main(conn, reward_fn: RewardFn, timeout_s: float, wall_limit_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then closes the pool
    signal.signal(signal.SIGPROF, _raise_timeout)  # the CPU-time limit
    signal.signal(signal.SIGALRM, _raise_timeout)  # the clock's, for a function that waits
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if message is None:
            return
        index, item = message
        score, outcome, detail = _score_with_time_limit(reward_fn, item, timeout_s, wall_limit_s)
        conn.send((index, score, outcome, detail))


_scoring = False  # in the worker: a reward call is under way, and a timer's signal ends it


def _raise_timeout(signum, frame):
    if _scoring:  # one timer may fire while the other is being disarmed: after the call it means nothing
        raise RewardTimeout()


def _arm(timeout_s: float, wall_limit_s: float) -> None:
    global _scoring
    _scoring = True
    # ITIMER_PROF counts this process's CPU time. The clock's timer is armed too, so that math-verify sees an outer
    # limit and leaves its own (signal.alarm, on the clock) off: see math_verify.py.
    signal.setitimer(signal.ITIMER_PROF, timeout_s)
    signal.setitimer(signal.ITIMER_REAL, wall_limit_s)


def _disarm() -> None:
    global _scoring
    _scoring = False
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.setitimer(signal.ITIMER_PROF, 0)


def _score_with_time_limit(
    reward_fn: RewardFn, item: RewardItem, timeout_s: float, wall_limit_s: float
) -> Tuple[float, str, str]:
    """(score, outcome, detail) of one response; any failure scores 0.0."""
    try:
        _arm(timeout_s, wall_limit_s)
        try:
            raw = reward_fn(item.data_source, item.solution_str, item.ground_truth, item.extra_info)
        finally:
            _disarm()
        score = float(raw)
    except RewardTimeout:
        _disarm()  # again: a timer that fired inside the first one cut it short
        return 0.0, "timeout", ""
    except Exception as exc:  # a plug-in's bug must not end the run; it is counted and reported
        return 0.0, "error", f"{type(exc).__name__}: {exc}"[:300]
    if not math.isfinite(score):
        return 0.0, "error", f"reward function returned {raw!r}"
    return score, "ok", ""


# ----------------------------------------------------------------------------------------------------------
# Parent side.


class _Worker:
    """A worker process, its end of the pipe, and the response it is scoring (None when idle)."""

    def __init__(self, context, reward_fn: RewardFn, timeout_s: float, wall_limit_s: float):
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_worker_main, args=(child_conn, reward_fn, timeout_s, wall_limit_s), daemon=True,
            name="hacpo-reward-worker",
        )
        self.process.start()
        child_conn.close()
        self._ps = psutil.Process(self.process.pid)
        self.ready = False
        self.started_at = time.monotonic()  # of the process until ready, then of the current response
        self.cpu_at_start = 0.0  # the process's CPU seconds when the current response was sent
        self.index: Optional[int] = None

    def cpu_seconds(self) -> float:
        """CPU seconds the process has used (0.0 once it is gone: the pipe then tells what happened)."""
        try:
            times = self._ps.cpu_times()
        except psutil.Error:
            return 0.0
        return times.user + times.system

    @property
    def busy(self) -> bool:
        return not self.ready or self.index is not None

    def assign(self, index: int, item: RewardItem) -> None:
        self.index = index
        self.started_at = time.monotonic()
        self.cpu_at_start = self.cpu_seconds()
        self.conn.send((index, item))

    def stop(self) -> None:
        """Ask the process to exit, then insist; always reaps it, so no zombie or orphan remains."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(SHUTDOWN_GRACE_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


def _stop_all(workers: List[_Worker]) -> None:
    for worker in workers:
        worker.stop()
    workers.clear()


class RewardPool:
    """A fixed set of worker processes scoring responses with a reward function under time limits.

    Args:
        reward_fn: ``fn(data_source, solution_str, ground_truth, extra_info=None) -> float``; must be
            importable by name (a module-level function), since workers are spawned.
        num_workers: worker processes.
        timeout_s: soft limit per response, in the worker's CPU seconds (a timer in the worker).
        kill_after_s: hard limit per response, in the worker's CPU seconds, enforced by the parent; default
            ``2 * timeout_s + 1``.
        wall_limit_s: soft limit on the clock, for a function that waits; default ``10 * timeout_s``. The hard one
            on the clock is ``2 * wall_limit_s + 1``.
        screen: cheap parent-side check returning a reason to score 0 unparsed, or None. Default:
            ``answers.reject_reason`` for ``compute_score``, ``answers.reject_oversize`` for any other
            reward function (which may read answers in its own format).
    """

    def __init__(
        self,
        reward_fn: RewardFn = compute_score,
        *,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        kill_after_s: Optional[float] = None,
        wall_limit_s: Optional[float] = None,
        screen: Optional[Screen] = None,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        self.kill_after_s = kill_after_s if kill_after_s is not None else 2 * timeout_s + 1
        self.wall_limit_s = wall_limit_s if wall_limit_s is not None else WALL_LIMIT_PER_CPU_LIMIT * timeout_s
        self.screen = screen or (reject_reason if reward_fn is compute_score else reject_oversize)
        self._context = multiprocessing.get_context("spawn")
        self._workers: List[_Worker] = [self._new_worker() for _ in range(num_workers)]
        # Safety net if close() is never called: stop the workers when the pool is collected or at exit.
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._finalizer()  # runs _stop_all once; later calls do nothing

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def worker_pids(self) -> List[int]:
        return [worker.process.pid for worker in self._workers]

    def score(self, items: Sequence[RewardItem]) -> Tuple[List[float], Dict[str, Any]]:
        """Scores of ``items`` (in order) and stats: counts per outcome and screen reason, time, rate."""
        if self.closed:
            raise RuntimeError("RewardPool.score called after close()")
        start = time.monotonic()
        scores = [0.0] * len(items)
        stats: Dict[str, Any] = {"total": len(items), "nonzero": 0, "ok": 0}
        stats.update({name: 0 for name in REJECT_REASONS + WORKER_OUTCOMES})
        pending = deque()
        for index, item in enumerate(items):
            reason = self.screen(item.solution_str)
            if reason is None:
                pending.append(index)
            else:
                stats[reason] = stats.get(reason, 0) + 1
        while pending or any(worker.busy for worker in self._workers):
            self._dispatch(pending, items)
            self._collect(scores, stats)
            self._replace_overdue(scores, stats)
        stats["nonzero"] = sum(1 for score in scores if score != 0.0)
        stats["seconds"] = time.monotonic() - start
        stats["answers_per_s"] = len(items) / stats["seconds"] if stats["seconds"] > 0 else float("inf")
        return scores, stats

    # -- the scheduling loop ---------------------------------------------------------------------------

    def _new_worker(self) -> _Worker:
        return _Worker(self._context, self.reward_fn, self.timeout_s, self.wall_limit_s)

    def _dispatch(self, pending: deque, items: Sequence[RewardItem]) -> None:
        for worker in self._workers:
            if pending and not worker.busy:
                index = pending.popleft()
                try:
                    worker.assign(index, items[index])
                except OSError:  # it died while idle; the response was never tried, so it goes back in line
                    pending.appendleft(index)
                    worker.index = None
                    self._swap(worker)

    def _collect(self, scores: List[float], stats: Dict[str, Any]) -> None:
        """Wait (at most until the nearest deadline) for messages from busy workers and record them."""
        busy = [worker for worker in self._workers if worker.busy]
        if not busy:
            return
        timeout = max(0.0, min(self._seconds_to_limit(worker) for worker in busy))
        ready_conns = wait([worker.conn for worker in busy], timeout=timeout)
        for worker in busy:
            if worker.conn not in ready_conns:
                continue
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                self._replace(worker, scores, stats, outcome="crashed")  # died: segfault, out of memory
                continue
            if message == "ready":
                worker.ready = True
                continue
            index, score, outcome, detail = message
            scores[index] = score
            stats[outcome] += 1
            if detail and "first_error" not in stats:
                stats["first_error"] = detail
            worker.index = None

    def _seconds_to_limit(self, worker: _Worker) -> float:
        """The least time before ``worker`` can pass a hard limit: its CPU time grows no faster than the clock."""
        elapsed = time.monotonic() - worker.started_at
        if not worker.ready:
            return WORKER_START_TIMEOUT_S - elapsed
        cpu_left = self.kill_after_s - (worker.cpu_seconds() - worker.cpu_at_start)
        return min(cpu_left, 2 * self.wall_limit_s + 1 - elapsed)

    def _replace_overdue(self, scores: List[float], stats: Dict[str, Any]) -> None:
        for worker in list(self._workers):
            if not worker.busy or self._seconds_to_limit(worker) > 0:
                continue
            if not worker.ready:
                raise RuntimeError(
                    f"a reward worker did not start within {WORKER_START_TIMEOUT_S:.0f} s "
                    f"(reward function {getattr(self.reward_fn, '__qualname__', self.reward_fn)!r})"
                )
            self._replace(worker, scores, stats, outcome="killed")

    def _replace(self, worker: _Worker, scores: List[float], stats: Dict[str, Any], outcome: str) -> None:
        """Kill ``worker``, score its response 0 under ``outcome``, and put a fresh worker in its place."""
        if worker.index is None and not worker.ready:
            raise RuntimeError("a reward worker died while starting; run the reward function alone to see why")
        if worker.index is not None:
            scores[worker.index] = 0.0
            stats[outcome] += 1
        self._swap(worker)

    def _swap(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = self._new_worker()


def score_batch(
    items: Sequence[RewardItem],
    *,
    reward_fn: RewardFn = compute_score,
    timeout_s: float = 5.0,
    num_workers: int = 2,
    kill_after_s: Optional[float] = None,
) -> Tuple[List[float], Dict[str, Any]]:
    """One-off form of ``RewardPool.score``; a training run should keep one pool instead (workers start slowly)."""
    with RewardPool(reward_fn, num_workers=num_workers, timeout_s=timeout_s, kill_after_s=kill_after_s) as pool:
        return pool.score(items)
