"""A run's Ray actors, started once: every agent's engine on its engine rank's node, the reward actor,
and each engine rank's weight sender to its agent's engine.

    engines, senders, reward = start_actors(cfg, agent_parallel, hf_configs, tokenizer_names, rank, output_dir)

Collective over the torchrun world. Rank 0 creates the engine actors (named) and the reward actor;
engine ranks look theirs up by name and make their sender (`rollout.weight_transport`). Every rank
then watches the job's nodes (placement.NodeWatch); run_info.json records where each actor runs.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import ray
import torch.distributed as dist

from hacpo_megatron.config.schema import Config
from hacpo_megatron.orchestrator import placement
from hacpo_megatron.orchestrator.actors import ACTOR_OPTIONS, EngineActor, RewardActor, engine_actor_name
from hacpo_megatron.orchestrator.weight_senders import make_sender
from hacpo_megatron.parallel.groups import AgentParallel, local_gpu
from hacpo_megatron.rollout import engine_options
from hacpo_megatron.rollout.weight_sync import engine_rank


def start_actors(cfg: Config, agent_parallel: Sequence[AgentParallel], hf_configs: Sequence[Dict[str, Any]],
                 tokenizer_names: Sequence[str], rank: int,
                 output_dir: str) -> Tuple[Dict[int, Any], Dict[int, Any], Optional[Any]]:
    """(engine actor handles: all on rank 0, its own on an engine rank; weight senders of this rank's
    engine ranks; the reward actor on rank 0, else None)."""
    from hacpo_megatron.reporting import update_run_info

    names = [a.name for a in cfg.agents]
    rank_nodes = placement.gather_rank_nodes()  # collective: rank 0 learns every engine rank's node
    engine_nodes = placement.engine_nodes(agent_parallel, rank_nodes)
    engines: Dict[int, Any] = {}
    reward_actor = None
    if rank == 0:
        for k, agent_cfg in enumerate(cfg.agents):
            options = dict(ACTOR_OPTIONS, name=engine_actor_name(cfg.run.name, agent_cfg.name), lifetime=None,
                           **placement.pinned_to(engine_nodes[k]))
            kwargs = engine_options(agent_cfg.engine, model_path=agent_cfg.init_from, rollout=cfg.rollout,
                                    record_routes=agent_cfg.moe.routing_replay == "r3")
            engines[k] = EngineActor.options(**options).remote(
                agent_cfg.engine, hf_configs[k], tokenizer_names[k], cfg.run.seed + k, kwargs, cfg.rollout.cpu_threads,
                agent_cfg.prompt_format, local_gpu(engine_rank(agent_parallel[k])))
        ray.get([handle.pid.remote() for handle in engines.values()])  # constructed and alive
        reward_actor = RewardActor.options(**ACTOR_OPTIONS).remote(
            cfg.reward.function, cfg.reward.num_workers, cfg.reward.timeout_s)
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
                engines[k] = ray.get_actor(engine_actor_name(cfg.run.name, names[k]))
            senders[k] = make_sender(cfg.rollout.weight_transport, engines[k])
    return engines, senders, reward_actor
