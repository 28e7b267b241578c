"""Run checkpoints: every agent's model and optimizer (Megatron distributed checkpoints, any layout)
plus the run state — step, LR schedules, capability tracker, data position, RNG — in one atomic step
folder under `<output_dir>/checkpoints/` (layout and crash safety: checkpoint/megatron_io.py).
"""
from __future__ import annotations

import os
import random
from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist

from hacpo_megatron.checkpoint.megatron_io import AgentState, load_agents_checkpoint, save_agents_checkpoint


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def tokenizer_dir(output_dir: str, agent_name: str) -> str:
    return os.path.join(output_dir, "tokenizers", agent_name)


def save_tokenizers(output_dir: str, agents) -> None:
    """Rank 0 writes each agent's tokenizer once, so every checkpoint can carry it (self-describing)."""
    if dist.get_rank() == 0:
        for name, tokenizer in zip(agents.names, agents.tokenizers):
            folder = tokenizer_dir(output_dir, name)
            if not os.path.isdir(folder):
                tokenizer.save_pretrained(folder)
    dist.barrier()


def _agent_states(output_dir: str, agents):
    states = []
    for k, parallel in enumerate(agents.parallel):
        trainer = agents.trainers.get(k)
        states.append(AgentState(
            parallel=parallel, hf_config=agents.hf_configs[k],
            model=trainer.agent if trainer else None, optimizer=trainer.optimizer if trainer else None,
            tokenizer_dir=tokenizer_dir(output_dir, agents.names[k])))
    return states


def _schedules(agents) -> Dict[str, Any]:
    """Every agent's LR schedule and step count, gathered from each agent's first rank."""
    local = {agents.names[k]: {"scheduler": t.scheduler.state_dict(), "steps_done": t.steps_done}
             for k, t in agents.trainers.items() if agents.parallel[k].agent_rank == 0}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {name: state for part in gathered for name, state in part.items()}


def save(output_dir: str, step: int, agents, tracker, sampler, *, keep_last: int) -> None:
    """Collective: every rank enters. The step becomes `latest` only once completely written."""
    trainer_state = {
        "step": step,
        "tracker": tracker.state_dict(),
        "sampler": sampler.state_dict(),
        "agents": _schedules(agents),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
    }
    save_agents_checkpoint(checkpoint_root(output_dir), step, _agent_states(output_dir, agents),
                           keep_last=keep_last, trainer_state=trainer_state)


def load_latest(output_dir: str, agents, tracker, sampler) -> int:
    """Restore everything from the latest complete checkpoint; returns the step to continue from."""
    _, state = load_agents_checkpoint(checkpoint_root(output_dir), _agent_states(output_dir, agents))
    if state is None:
        raise RuntimeError(f"{checkpoint_root(output_dir)}: the latest checkpoint has no run state")
    tracker.load_state_dict(state["tracker"])
    sampler.load_state_dict(state["sampler"])
    for k, trainer in agents.trainers.items():
        saved = state["agents"][agents.names[k]]
        trainer.scheduler.load_state_dict(saved["scheduler"])
        trainer.steps_done = saved["steps_done"]
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    dist.barrier()
    return int(state["step"])
