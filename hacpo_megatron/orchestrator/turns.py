"""Agents' updates in turns (`train.agents_take_turns`): for ranks that share a CPU's cores.

    for k in learner_turns(hosted=agents.trainers, n=len(agents.configs), take_turns=True):
        train learner k, push its weights          (this rank's part of agent k's turn)

Without turns every rank trains its learners as soon as it reaches the update phase, so agents on
disjoint ranks update at the same time: right on GPUs, where each rank has its own device. On one CPU
machine the ranks share its cores, and two updates at once ask for train.cpu_threads each: OpenMP
threads that outnumber the cores wait on each other (docs/benchmarks.md, "Threads per process"). With
turns, agent 0's ranks train while every other rank waits in a barrier, then agent 1's, and so on:
each update has the cores to itself. A barrier's waiters sleep in the collective rather than spin.
"""
from __future__ import annotations

from typing import Collection, Iterator

import torch.distributed as dist


def learner_turns(hosted: Collection[int], n: int, take_turns: bool) -> Iterator[int]:
    """The learners this rank trains, in agent order. With `take_turns`, the world's ranks pass a barrier
    after each agent's turn (whether or not they host it), so agent k+1 starts when agent k has finished
    everywhere; the caller's loop body (the update and the weight push) runs inside the turn."""
    for k in range(n):
        if k in hosted:
            yield k
        if take_turns:
            dist.barrier()
