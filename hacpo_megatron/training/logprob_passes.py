"""The step's log-prob passes (step 5 of Algorithm 1, and the KL reference's): each agent's trainer over sequences,
every data-parallel replica a share, gathered so that every rank holds every agent's figures."""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch.distributed as dist

from hacpo_megatron.models.build import AgentModel
from hacpo_megatron.training.agents import Agents
from hacpo_megatron.training.step_data import OldLogProbs, check_engine_logprobs, engine_old_logprobs, own_sequences
from hacpo_megatron.training.trainer import AgentTrainer


def behaviour_logprobs(agents: Agents, prompt_ids, rollouts, *, engine_clip: Optional[float]):
    """Every agent's old log-probs, and {k: engine/trainer gap} on the steps that ran the trainer's pass.
    `engine_clip` (rollout.old_logprobs engine; None: trainer): how close the trainer's pass on the run's first step
    must find the engines' own log-probs for them to stand in from then on.

    MoE routing replay (agents[k].moe.routing_replay): each hosted trainer forgets the last step's routes and, r3,
    keeps the engine's routes of its own answers, which its passes and updates of this step then replay."""
    for k, trainer in agents.trainers.items():
        trainer.begin_step_routes(own_sequences(prompt_ids[k], rollouts[k]),
                                  [c.routes for group in rollouts[k] for c in group])
    if engine_clip is not None and agents.engine_logprobs_checked:
        return [engine_old_logprobs(r) for r in rollouts], {}
    old = _old_logprobs(agents, prompt_ids, rollouts)
    gaps = {k: _engine_trainer_logprob_gap(rollouts[k], old[k]) for k in range(len(old))}
    if engine_clip is not None:
        check_engine_logprobs({agents.names[k]: gap for k, gap in gaps.items()}, clip=engine_clip)
        agents.engine_logprobs_checked = True
    return old, gaps


def _old_logprobs(agents: Agents, prompt_ids, rollouts) -> List[OldLogProbs]:
    local = {}
    for k, trainer in agents.trainers.items():
        result = agent_logprobs(trainer, None, own_sequences(prompt_ids[k], rollouts[k]))
        if agents.parallel[k].agent_rank == 0:
            local[k] = result
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {k: v for part in gathered for k, v in part.items()}
    return [OldLogProbs(sums=[sum(t) for t in merged[k]], lengths=[len(t) for t in merged[k]], tokens=merged[k])
            for k in range(len(agents.configs))]


def agent_logprobs(trainer: AgentTrainer, model: Optional[AgentModel], sequences) -> List[List[float]]:
    """Per-token log-probs of `sequences`, each data-parallel replica a share, gathered over DP."""
    parallel = trainer.parallel
    mine = sequences[parallel.dp_rank::parallel.dp_size]
    if model is None:
        result = trainer.sequence_logprobs(mine)
    else:  # a frozen reference model of the same layout
        from hacpo_megatron.models.logprobs import compute_sequence_logprobs

        result = compute_sequence_logprobs(model, mine, temperature=trainer.temperature,
                                           max_sequences_per_micro_batch=trainer.train.micro_batch_size,
                                           max_tokens_per_micro_batch=trainer.train.max_tokens_per_micro_batch,
                                           share_prompts=trainer.share_prompts)
    tokens = [result.token_logprobs[i, : int(result.lengths[i])].tolist() for i in range(len(mine))]
    if parallel.dp_size == 1:
        return tokens
    # the trainer's routes of its pass (routing replay) go with the log-probs: an update's replica takes other rows
    replayed = model is None and trainer.route_replay is not None
    shares = [None] * parallel.dp_size
    dist.all_gather_object(shares, (tokens, result.routes if replayed else None), group=parallel.dp_group)
    out, routes = [None] * len(sequences), [None] * len(sequences)
    for r, (share, share_routes) in enumerate(shares):
        out[r::parallel.dp_size] = share
        routes[r::parallel.dp_size] = share_routes or [None] * len(share)
    if replayed:
        trainer.route_replay.keep(sequences, routes)
    return out


def _engine_trainer_logprob_gap(completions, old: OldLogProbs) -> Dict[str, float]:
    """|engine log-prob - trainer log-prob| of the sampled tokens, largest and mean: ~0 when the engine
    samples from the trainer's weights at the trainer's temperature (a broken weight sync shows here)."""
    flat = [c for group in completions for c in group]
    gaps = [abs(a - b) for c, tokens in zip(flat, old.tokens) for a, b in zip(c.logprobs, tokens)]
    return {"rollout/logprob_diff_max": max(gaps), "rollout/logprob_diff_mean": float(np.mean(gaps))}
