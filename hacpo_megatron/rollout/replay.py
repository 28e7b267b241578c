"""Saved rollouts, for the debug modes: each step's prompts, answers, engine log-probs and rewards, per agent.

    --save-rollouts DIR   (run.mode train or rollout_only) rank 0 writes, after each step's rewards,
                          DIR/step_00000001/<agent>.json for every agent and then DIR/step_00000001/step.json
    --load-rollouts DIR   (run.mode train_only) every rank reads a step's files instead of generating and scoring

A step's folder is named as a run's checkpoint of that step is (checkpoint/run_folder.py `step_folder`); rollouts
saved before that (six digits, step_000001) are still read. Files are
keyed by step and agent name, so the n agents of a run never overwrite each other. step.json is written
last and each file is written whole before it is renamed into place: a step folder without step.json (a run
killed while saving) is incomplete and never read. JSON keeps every float exactly (Python writes the shortest
repr that reads back to the same double), so a replayed step trains on bit-identical inputs.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from hacpo_megatron.checkpoint.run_folder import step_folder
from hacpo_megatron.rollout.base import Completion

STEP_FILE = "step.json"


class ReplayError(ValueError):
    """Saved rollouts that this run cannot use (missing, incomplete, or from other data or settings)."""


def save_step(root: os.PathLike, step: int, agent_names: Sequence[str], prompts: Sequence[Any],
              rollouts: Sequence[List[List[Completion]]], scores: Sequence[float],
              reward_stats: Dict[str, Any]) -> None:
    """Write step `step` (1-based, as metrics.jsonl counts): scores in [agent][prompt][sample] order."""
    folder = step_folder(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    per_agent = len(scores) // len(agent_names)
    for k, name in enumerate(agent_names):
        _write_json(folder / f"{name}.json", {
            "step": step, "agent": name, "prompt_uids": [p.uid for p in prompts],
            "completions": [[_saved(c) for c in group] for group in rollouts[k]],
            "scores": list(scores[k * per_agent:(k + 1) * per_agent])})
    _write_json(folder / STEP_FILE, {"step": step, "agents": list(agent_names), "reward_stats": dict(reward_stats)})


def load_step(root: os.PathLike, step: int, agent_names: Sequence[str], prompts: Sequence[Any],
              answers_per_prompt: int) -> Tuple[List[List[List[Completion]]], List[float], Dict[str, Any]]:
    """(rollouts [agent][prompt][sample], scores in the same order, reward stats) of a saved step; ReplayError if
    it is missing or was made from other prompts, agents or group size than this run's."""
    folder = _saved_step_folder(root, step)
    meta = _read_json(folder / STEP_FILE, f"no complete saved step {step}")
    rollouts, scores = [], []
    for name in agent_names:
        saved = _read_json(folder / f"{name}.json", f"no answers of agent {name!r} (the saved run's agents: "
                                                    f"{', '.join(meta.get('agents', []))})")
        if saved["prompt_uids"] != [p.uid for p in prompts]:
            raise ReplayError(f"{folder / (name + '.json')}: saved for other prompts than this run's step {step}; "
                              "replay with the saving run's data, run.seed and data.prompt_batch_size")
        sizes = {len(group) for group in saved["completions"]}
        if sizes != {answers_per_prompt}:
            raise ReplayError(f"{folder / (name + '.json')}: {sorted(sizes)} answers per prompt, this run needs "
                              f"{answers_per_prompt} (rollout.samples_per_prompt and the algorithm as when saved)")
        rollouts.append([[Completion(**c) for c in group] for group in saved["completions"]])
        scores.extend(saved["scores"])
    return rollouts, scores, meta["reward_stats"]


def missing_steps(root: os.PathLike, agent_names: Sequence[str], steps: Sequence[int]) -> List[str]:
    """What a train_only run over `steps` would miss under `root`, as paths (preflight: named before any work)."""
    if not Path(root).is_dir():
        return [f"{root}: no such folder"]
    missing = []
    for step in steps:
        folder = _saved_step_folder(root, step)
        for name in [STEP_FILE] + [f"{agent}.json" for agent in agent_names]:
            if not (folder / name).is_file():
                missing.append(str(folder / name))
    return missing


def _saved_step_folder(root: os.PathLike, step: int) -> Path:
    """Where step `step` was saved: `step_folder`, or the name saved rollouts had before they were named as the
    checkpoints are (step_000001: six digits, until 9492f63), where only that folder exists."""
    folder = step_folder(root, step)
    older = Path(root) / f"step_{step:06d}"
    return older if older.is_dir() and not folder.is_dir() else folder


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
    os.replace(temporary, path)


def _read_json(path: Path, what: str) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReplayError(f"{path}: {what}") from None
    except json.JSONDecodeError as error:
        raise ReplayError(f"{path}: not JSON ({error})") from None


def _saved(completion: Completion) -> dict:
    """A completion as saved: its engine routes (MoE routing replay r3, a tensor) are not (run.mode train_only trains
    with r2 or none, config/checks.py)."""
    fields = asdict(completion)
    fields.pop("routes", None)
    return fields
