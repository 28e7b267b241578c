"""A run's Ray actors, started once: every agent's engine on its engine rank's node, the reward actor,
and each engine rank's weight sender to its agent's engine.

    engines, senders, reward = start_actors(settings, agents, rank, output_dir)   # settings: ActorSettings

Collective over the torchrun world. Rank 0 creates the engine actors (named) and the reward actor;
engine ranks look theirs up by name and make their sender (`rollout.weight_transport`). Every rank
then watches the job's nodes (placement.NodeWatch); run_info.json records where each actor runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import ray
import torch.distributed as dist

from hacpo_megatron.orchestrator import placement
from hacpo_megatron.orchestrator.actors import ACTOR_OPTIONS, EngineActor, RemoteEngine, RewardActor, engine_actor_name
from hacpo_megatron.orchestrator.run_agents import RunAgents
from hacpo_megatron.orchestrator.weight_senders import make_sender
from hacpo_megatron.parallel.groups import local_gpu
from hacpo_megatron.rollout.weight_sync import engine_rank

if TYPE_CHECKING:
    from ray.actor import ActorHandle


@dataclass(frozen=True)
class EngineSpec:
    """Agent k's engine actor: EngineActor's arguments but its HF config and GPU (orchestrator/actors.py)."""

    kind: str  # agents[k].engine
    tokenizer: str  # agents[k].tokenizer_source
    prompt_format: str  # agents[k].prompt_format
    seed: int  # run.seed + k
    options: Optional[Dict[str, Any]]  # the engine's constructor arguments (rollout/__init__.py engine_options)
    threads: int  # rollout.cpu_threads


@dataclass(frozen=True)
class ActorSettings:
    """What the run's actors are started with, resolved once from the config (training/settings.py)."""

    run_name: str  # run.name: part of the engine actors' names
    engines: Tuple[EngineSpec, ...]  # every agent's, in the agents' order
    reward_function: str  # reward.function, in reward.num_workers processes, reward.timeout_s per answer
    reward_workers: int
    reward_timeout_s: float
    weight_transport: str  # rollout.weight_transport


def start_actors(settings: ActorSettings, agents: RunAgents, rank: int, output_dir: str
                 ) -> Tuple[Dict[int, "ActorHandle"], Dict[int, RemoteEngine], Optional["ActorHandle"]]:
    """(engine actor handles: all on rank 0, its own on an engine rank; weight senders of this rank's
    engine ranks; the reward actor on rank 0, else None)."""
    from hacpo_megatron.reporting import update_run_info

    names, agent_parallel = agents.names, agents.parallel
    rank_nodes = placement.gather_rank_nodes()  # collective: rank 0 learns every engine rank's node
    engine_nodes = placement.engine_nodes(agent_parallel, rank_nodes)
    engines: Dict[int, ActorHandle] = {}
    reward_actor = None
    if rank == 0:
        for k, engine in enumerate(settings.engines):
            options = dict(ACTOR_OPTIONS, name=engine_actor_name(settings.run_name, names[k]), lifetime=None,
                           **placement.pinned_to(engine_nodes[k]))
            engines[k] = EngineActor.options(**options).remote(
                engine.kind, agents.hf_configs[k], engine.tokenizer, engine.seed, engine.options, engine.threads,
                engine.prompt_format, local_gpu(engine_rank(agent_parallel[k])))
        ray.get([handle.pid.remote() for handle in engines.values()])  # constructed and alive
        reward_actor = RewardActor.options(**ACTOR_OPTIONS).remote(
            settings.reward_function, settings.reward_workers, settings.reward_timeout_s)
        ray.get(reward_actor.pid.remote())
        where = {name: placement.actor_node(engines[k]) for k, name in enumerate(names)}
        update_run_info(output_dir, {"engines": {name: vars(node) for name, node in where.items()},
                                     "reward": vars(placement.actor_node(reward_actor)),
                                     "ranks": [vars(node) for node in rank_nodes]})
    placement.NodeWatch(rank_nodes, dict(zip(names, engine_nodes)), rank).start()
    dist.barrier()
    senders = {}
    for k, parallel in enumerate(agent_parallel):
        if parallel.is_member and rank == engine_rank(parallel):
            if k not in engines:
                engines[k] = ray.get_actor(engine_actor_name(settings.run_name, names[k]))
            senders[k] = make_sender(settings.weight_transport, engines[k])
    return engines, senders, reward_actor
