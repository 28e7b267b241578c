"""Every agent's new weights into its rollout engine, even when an engine dies on the way.

    push_weights(agents, k, check)        one agent's push (its ranks together); its figures
    push_all_weights(agents, check)       every hosted agent's, at start-up or after engines restarted
    resend_to_lost_engines(agents, ...)   after a step's pushes: push again where an engine was lost
    restore_restarted_engines(agents, check)   before a step or an evaluation: push again to engines
                                          Ray restarted unseen, between calls (they hold no weights)

An engine's process can die in the middle of a push (vLLM's engine core killed for its memory, a
node lost). Only the agent's engine rank sees it (`rollout/weight_sync.py` finishes the stream and
reports `engine_losses`); Ray restarts the engine actor without weights. So the ranks first agree
on the lost agents (one all-gather), then each lost agent's ranks push again together, up to
ENGINE_RETRIES times. `agents` is the training loop's `Agents` (training/loop.py).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

import torch.distributed as dist

from hacpo_megatron.orchestrator.actors import call_with_restarts, wait_until_alive
from hacpo_megatron.orchestrator.run_agents import RunAgents
from hacpo_megatron.rollout.weight_sync import sync_weights

ENGINE_RETRIES = 3  # a step's rollout or push is redone at most this often before the run gives up
LOSSES = "weight_sync/engine_losses"


def push_weights(agents: RunAgents, k: int, check: bool) -> Dict[str, float]:
    """Agent k's weights to its engine (every rank of k calls it); `check`: verify them after. Nothing to
    do where no engine runs (run.mode train_only)."""
    if not agents.engines_running:
        return {}
    metrics = sync_weights(agents.policy(k), agents.hf_configs[k], agents.parallel[k],
                           agents.senders.get(k), check=check)
    if metrics.check is not None and not metrics.check.equal:
        raise RuntimeError(f"agent {agents.names[k]}: engine weights differ after sync: {metrics.check.mismatched[:5]}")
    return metrics.as_dict()


def push_all_weights(agents: RunAgents, check: bool, only: Optional[Sequence[int]] = None) -> None:
    """Every hosted agent's weights to its engine; `only`: engines that were just restarted. Collective."""
    if not agents.engines_running:
        return
    pushed = {}
    for k in agents.hosted:
        if only is None or k in only:
            if only is not None:
                _reconnect(agents, k)
            pushed[k] = push_weights(agents, k, check)
    resend_to_lost_engines(agents, check, pushed)


def resend_to_lost_engines(agents: RunAgents, check: bool, pushed: Dict[int, Dict[str, float]]) -> None:
    """Push again to every engine that died during its push in `pushed` ({agent: its metrics}, this
    rank's agents), until each has its weights. Collective. `pushed[k]` ends with the delivering
    push's figures and the count of the engine's losses on the way."""
    if not agents.engines_running:
        return
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
                pushed[k].update(push_weights(agents, k, check))
                if pushed[k][LOSSES]:
                    lost_here.add(k)
                pushed[k][LOSSES] += losses
    raise RuntimeError(f"the engines of {[agents.names[k] for k in lost]} died during {ENGINE_RETRIES + 1} "
                       "weight pushes")


def restore_restarted_engines(agents: RunAgents, check: bool) -> None:
    """Push again to every engine that holds no weights: Ray restarted it after its last push (its
    memory monitor ends engines when the node runs short), and its calls now reach a new process.
    Collective: rank 0 asks every engine actor, then the agents' ranks push together."""
    if not agents.engines_running:
        return
    missing = [None]
    if dist.get_rank() == 0:
        missing = [[k for k in range(len(agents.configs))
                    if not call_with_restarts(agents.engines[k], "holds_weights")]]
        if missing[0]:
            print(f"the engines of {[agents.names[k] for k in missing[0]]} were restarted since their last weight "
                  "push: pushing their weights again", flush=True)
    dist.broadcast_object_list(missing, src=0)
    if missing[0]:
        push_all_weights(agents, check, only=missing[0])


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
