"""Run checkpoints: every agent's model and optimizer (Megatron distributed checkpoints, any layout)
plus the run state — step, LR schedules, capability tracker, data position, RNG — in one atomic step
folder under `<output_dir>/checkpoints/` (layout: checkpoint/run_folder.py; crash safety: checkpoint/megatron_io.py).
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hacpo_megatron.checkpoint.format import (
    CheckpointError, is_agent_checkpoint, optimizer_layout_problem, read_checkpoint_metadata,
)
from hacpo_megatron.checkpoint.integrity import choose_resume_checkpoint, describe
from hacpo_megatron.checkpoint.megatron_io import AgentState, load_agents_checkpoint, save_agents_checkpoint
from hacpo_megatron.checkpoint.run_folder import resume_candidates


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
    local = {agents.names[k]: {"scheduler": t.scheduler.state_dict(), "steps_done": t.steps_done,
                               "cross_clip_fitted": t.cross_clip_fitted}
             for k, t in agents.trainers.items() if agents.parallel[k].agent_rank == 0}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {name: state for part in gathered for name, state in part.items()}


def _plain_numpy_rng_state() -> list:
    """numpy's global RNG state in plain Python values (its 624 uint32 keys as ints): the run state
    then holds only ints, floats, strings, lists, dicts and tensors, and loads with
    torch.load(weights_only=True), which runs no code from the file (checkpoint/megatron_io.py)."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return [name, keys.tolist(), int(position), int(has_gauss), float(cached_gaussian)]


def _numpy_rng_state(saved) -> tuple:
    name, keys, position, has_gauss, cached_gaussian = saved
    return (name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached_gaussian)


def save(output_dir: str, step: int, agents, tracker, sampler_state: dict, *, keep_last: int) -> Path:
    """Collective: every rank enters. The step becomes `latest` only once completely written; its folder
    (checkpoint/run_folder.py `step_folder`). `sampler_state`: the prompt sampler's, with any step whose answers are
    still being generated undrawn (orchestrator/rollout_pipeline.py)."""
    trainer_state = {
        "step": step,
        "tracker": tracker.state_dict(),
        "sampler": sampler_state,
        "agents": _schedules(agents),
        "rng": {"python": random.getstate(), "numpy": _plain_numpy_rng_state(), "torch": torch.get_rng_state()},
    }
    return save_agents_checkpoint(checkpoint_root(output_dir), step, _agent_states(output_dir, agents),
                                  keep_last=keep_last, trainer_state=trainer_state)


def choose_checkpoint(output_dir: str, agent_configs: Sequence[Any]) -> str:
    """Collective. Rank 0 verifies `latest` against its manifest, falls back to the newest intact step
    if it is damaged (saying which file is), and tells every rank; InputError if none is intact, or if an agent of
    `agent_configs` (the run's `agents:`) would load its optimizer's state at another expert parallelism than it
    was saved at (`layout_problems`).

    Called before any work (no model built, no Ray): a rank that failed later, behind a teardown, could be
    stopped by torchrun (another rank had already exited with the same error) before it said why."""
    from hacpo_megatron.training.preflight import InputError

    root = checkpoint_root(output_dir)
    decision = [None]
    if dist.get_rank() == 0:
        choice = choose_resume_checkpoint(resume_candidates(root))
        warnings, error = describe(choice, root)
        for line in warnings:
            print(f"warning: {line}", flush=True)
        problems = [error] if error else layout_problems(Path(choice.step_dir), agent_configs)
        decision = [(str(choice.step_dir) if choice.step_dir else None, problems)]
    dist.broadcast_object_list(decision, src=0)
    step_dir, problems = decision[0]
    if problems:
        raise InputError([f"--resume: {problem}" for problem in problems])
    return step_dir


def layout_problems(step_dir: Path, agent_configs: Sequence[Any]) -> List[str]:
    """What in a step folder the agents of `agent_configs` cannot resume from at their layout: an optimizer's state
    saved at another expert parallelism (checkpoint/format.py: `optimizer_layout_problem`). Raises nothing: rank 0
    runs it while the other ranks wait for its answer."""
    problems = []
    for agent in agent_configs:
        folder = step_dir / agent.name
        if is_agent_checkpoint(folder):
            try:
                problem = optimizer_layout_problem(folder, read_checkpoint_metadata(folder), agent.parallel.expert)
            except CheckpointError as error:
                problem = str(error)
            if problem:
                problems.append(problem)
    return problems


def load_checkpoint(step_dir: str, output_dir: str, agents, tracker, sampler) -> int:
    """Restore everything from `step_dir` (choose_checkpoint's); returns the step to continue from."""
    _, state = load_agents_checkpoint(step_dir, _agent_states(output_dir, agents))
    if state is None:
        raise RuntimeError(f"{step_dir}: the checkpoint has no run state (trainer_state.pt)")
    tracker.load_state_dict(state["tracker"])
    sampler.load_state_dict(state["sampler"])
    for k, trainer in agents.trainers.items():
        saved = state["agents"][agents.names[k]]
        trainer.scheduler.load_state_dict(saved["scheduler"])
        trainer.steps_done = saved["steps_done"]
        trainer.cross_clip_fitted = saved.get("cross_clip_fitted")  # absent from checkpoints before the option
    random.setstate(state["rng"]["python"])
    np.random.set_state(_numpy_rng_state(state["rng"]["numpy"]))
    torch.set_rng_state(state["rng"]["torch"])
    dist.barrier()
    return int(state["step"])
