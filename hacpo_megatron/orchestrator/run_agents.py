"""What the orchestrator needs of the run's agents, as a Protocol: the loop's `Agents` (training/agents.py) is
one, and the orchestrator, a layer below training, names this instead of importing it."""
from __future__ import annotations

from typing import Any, Dict, List, Protocol, runtime_checkable

from hacpo_megatron.parallel.groups import AgentParallel


@runtime_checkable
class RunAgents(Protocol):
    configs: list  # every agent's AgentConfig
    parallel: List[AgentParallel]  # every agent's layout, seen from this rank
    hf_configs: List[Dict[str, Any]]
    tokenizers: list
    engines: Dict[int, Any]  # EngineActor handles (rank 0 and engine ranks)
    senders: Dict[int, Any]  # weight transport to agent k's engine (k's engine rank)

    @property
    def names(self) -> List[str]: ...

    @property
    def hosted(self) -> List[int]: ...

    def policy(self, k: int) -> Any:
        """Agent k's model on this rank: the weights its engine is given."""
        ...
