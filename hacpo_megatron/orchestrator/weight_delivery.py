"""Every agent's new weights into its rollout engine, even when an engine dies on the way.

    deliver_weights(agents, updated, check)   the loop's one weight call: at start-up every hosted agent, after
                                              each step the agents that trained; pushed again where an engine
                                              died during its push
    restore_engines(agents, check[, restarted])   before generating (the rollout pipeline, an evaluation):
                                              weights again to engines Ray restarted, named or found unseen

An engine's process can die in the middle of a push (vLLM's engine core killed for its memory, a
node lost). Only the agent's engine rank sees it (`rollout/weight_sync.py` finishes the stream and
reports `engine_losses`); Ray restarts the engine actor without weights. So the ranks first agree
on the lost agents (one all-gather), then each lost agent's ranks push again together, up to
ENGINE_RETRIES times. `agents` is the training loop's `Agents` (training/agents.py), seen as RunAgents.
"""
from __future__ import annotations

import time
from typing import Dict, Iterable, List, Optional, Sequence

import torch.distributed as dist

from hacpo_megatron.orchestrator.actors import call_with_restarts, wait_until_alive
from hacpo_megatron.orchestrator.run_agents import RunAgents
from hacpo_megatron.rollout.weight_sync import sync_weights

ENGINE_RETRIES = 3  # a step's rollout or push is redone at most this often before the run gives up
LOSSES = "weight_sync/engine_losses"


def deliver_weights(agents: RunAgents, updated: Iterable[int], check: bool) -> Dict[int, Dict[str, float]]:
    """The weights of each agent in `updated` that this rank hosts, to its engine; then again to every engine
    that died during its push, until each holds them. Collective: every rank calls it, an agent's ranks with the same
    `updated` (each rank may name only the agents it hosts; they push in the order given).
    `check`: compare the engine's weights with the trainer's after each push. Returns this rank's figures per
    pushed agent: the delivering push's, the engine's losses on the way, the first push's `time/weight_sync`."""
    pushed: Dict[int, Dict[str, float]] = {}
    for k in updated:
        if k in agents.hosted:
            t = time.perf_counter()
            pushed[k] = _push(agents, k, check)
            pushed[k]["time/weight_sync"] = time.perf_counter() - t
    _resend_to_lost_engines(agents, check, pushed)
    return pushed


def restore_engines(agents: RunAgents, check: bool, restarted: Optional[Sequence[int]] = None) -> None:
    """Weights again to engines Ray restarted (they hold none): `restarted` (the same on every rank), or where
    None every engine that says it holds no weights, restarted unseen since its last push (Ray's memory monitor
    ends engines between calls when the node runs short). Collective: rank 0 asks the engine actors."""
    if restarted is None:
        restarted = _engines_without_weights(agents)
    if not restarted:
        return
    for k in restarted:
        if k in agents.hosted:
            _reconnect(agents, k)
    deliver_weights(agents, restarted, check)


def _push(agents: RunAgents, k: int, check: bool) -> Dict[str, float]:
    """Agent k's weights to its engine (every rank of k calls it); `check`: verify them after."""
    metrics = sync_weights(agents.policy(k), agents.hf_configs[k], agents.parallel[k],
                           agents.senders.get(k), check=check)
    if metrics.check is not None and not metrics.check.equal:
        raise RuntimeError(f"agent {agents.names[k]}: engine weights differ after sync: {metrics.check.mismatched[:5]}")
    return metrics.as_dict()


def _resend_to_lost_engines(agents: RunAgents, check: bool, pushed: Dict[int, Dict[str, float]]) -> None:
    """Push again to every engine that died during its push in `pushed` ({agent: its metrics}, this
    rank's agents), until each has its weights. Collective. `pushed[k]` ends with the delivering
    push's figures and the count of the engine's losses on the way."""
    lost_here = {k for k, m in pushed.items() if m[LOSSES]}
    for attempt in range(ENGINE_RETRIES + 1):
        lost = _union_over_ranks(lost_here)
        if not lost:
            return
        if attempt == ENGINE_RETRIES:
            break
        if dist.get_rank() == 0:
            print(f"the engines of {[agents.names[k] for k in lost]} died during their weight push: "
                  "waiting for their restart, then pushing again", flush=True)
        lost_here = set()
        for k in lost:
            if k in agents.hosted:
                _reconnect(agents, k)
                losses = pushed[k][LOSSES]
                pushed[k].update(_push(agents, k, check))
                if pushed[k][LOSSES]:
                    lost_here.add(k)
                pushed[k][LOSSES] += losses
    raise RuntimeError(f"the engines of {[agents.names[k] for k in lost]} died during {ENGINE_RETRIES + 1} "
                       "weight pushes")


def _engines_without_weights(agents: RunAgents) -> List[int]:
    """Every agent whose engine holds no weights, on every rank (rank 0 asks, then broadcasts)."""
    missing: List[Optional[List[int]]] = [None]
    if dist.get_rank() == 0:
        missing = [[k for k in range(len(agents.configs))
                    if not call_with_restarts(agents.engines[k], "holds_weights")]]
        if missing[0]:
            print(f"the engines of {[agents.names[k] for k in missing[0]]} were restarted since their last weight "
                  "push: pushing their weights again", flush=True)
    dist.broadcast_object_list(missing, src=0)
    return missing[0]


def _union_over_ranks(mine: Iterable[int]) -> List[int]:
    """The union of every rank's agent indices (every rank calls it at the same point)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(mine))
    return sorted({k for part in gathered for k in part})


def _reconnect(agents: RunAgents, k: int) -> None:
    """On k's engine rank: wait for k's restarted engine actor (its sender then sees the new process
    and makes its weight group anew)."""
    if k in agents.senders:
        wait_until_alive(agents.engines[k])
