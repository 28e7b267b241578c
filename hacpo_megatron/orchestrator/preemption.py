"""Preemption: SIGTERM or SIGINT (how SLURM, Kubernetes and a terminal stop a job; torchrun forwards
them to every rank) ends the run at the next step boundary with a complete checkpoint.

    guard = PreemptionGuard.install()     every rank, before the first step
    ...one step...
    if guard.stop_requested():            collective: true on every rank once any rank was signalled
        save a checkpoint of the finished step; raise Preempted

The first signal only sets a flag (the step in flight finishes: its collectives cannot be left
half-way on some ranks); a second signal stops at once. torchrun waits 30 s after forwarding a
signal before it kills the ranks, which bounds how long a step plus its checkpoint may take.

torchrun sends the signal to each rank's whole process group, so the helper processes a rank starts
get it too. Those the step and its checkpoint still need live on until the rank stops them: Ray's are
started under `signal_blocked(SIGTERM)` (the mask is inherited through fork and exec;
orchestrator/ray_runtime.py), megatron's checkpoint writer's ignores SIGTERM (checkpoint/megatron_io.py).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Union

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: "stopped on request", as schedulers read it


@contextlib.contextmanager
def signal_blocked(sig: int) -> Iterator[None]:
    """Block `sig` in this thread meanwhile: processes started inside inherit the block (module docstring)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class Preempted(Exception):
    """The run stopped on a signal after saving the checkpoint of `step` (None: a run that keeps none)."""

    def __init__(self, signal_name: str, step: int, checkpoint: Union[str, os.PathLike, None]):
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint {checkpoint} is complete: "
                         f"run the same command with --resume to continue" if checkpoint else
                         f"stopped by {signal_name} after step {step} (run.mode rollout_only keeps no checkpoint)")
        self.step = step


@dataclass
class PreemptionGuard:
    received: Optional[int] = None  # the first signal's number
    _previous: Dict[int, object] = field(default_factory=dict)

    @classmethod
    def install(cls) -> "PreemptionGuard":
        guard = cls()
        for sig in SIGNALS:
            guard._previous[sig] = signal.signal(sig, guard._handle)
        return guard

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # the second signal: stop now
            self.uninstall()
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} received twice: stopping at once")
        self.received = signum
        print(f"{signal.Signals(signum).name} received: finishing the current step, then saving a checkpoint "
              f"(send it again to stop at once)", file=sys.stderr, flush=True)

    def stop_requested(self) -> bool:
        """Collective over the world: whether any rank has been signalled."""
        flag = torch.tensor([0 if self.received is None else self.received], dtype=torch.int64)
        if dist.is_initialized():
            if torch.cuda.is_available():
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        if signum and self.received is None:
            self.received = signum
        return bool(signum)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
