"""Where each agent lives in the torchrun world: a contiguous block of global ranks per agent.

Agents are laid out one after another unless `parallel.first_rank` places them; agents whose blocks
overlap time-share those devices. Pure arithmetic, no processes.
"""
from __future__ import annotations

from typing import List, Sequence

from hacpo_megatron.config.schema import AgentConfig


def agent_rank_ranges(agents: Sequence[AgentConfig]) -> List[range]:
    """The global ranks of every agent, in config order."""
    ranges: List[range] = []
    next_free = 0
    for agent in agents:
        first = agent.parallel.first_rank if agent.parallel.first_rank is not None else next_free
        ranges.append(range(first, first + agent.parallel.world_size))
        next_free = max(next_free, first + agent.parallel.world_size)
    return ranges


def required_world_size(agents: Sequence[AgentConfig]) -> int:
    """The number of processes the job needs: the highest rank any agent uses, plus one."""
    return max((r.stop for r in agent_rank_ranges(agents)), default=0)
