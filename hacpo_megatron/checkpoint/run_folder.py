"""A run's checkpoint folder: the step folders' names, the `latest` pointer, rotation and what a resume may try.

A training run keeps its checkpoints side by side and names the newest in a one-line file:

    <root>/
      latest               "step_00000020": always a complete step (written last, by rename)
      step_00000010/<agent name>/...    one agent folder per agent (checkpoint/format.py)
      step_00000010/trainer_state.pt    optional: the trainer's own state (step, RNG, data position, ...)
      step_00000010/manifest.json       size and SHA-256 of every file above (checkpoint/integrity.py),
                                        verified before a resume loads the step
      step_00000020/...
      step_00000030.tmp/   a save that was interrupted: never read, removed by the next save

`step_folder` is the one name of a step's folder, also for the saved rollouts of the debug modes
(rollout/replay.py). Only files here: what goes into a step folder, and the collective save that fills it,
are checkpoint/megatron_io.py's.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional

from hacpo_megatron.checkpoint.format import (
    METADATA_FILE, CheckpointError, PathLike, is_agent_checkpoint, read_checkpoint_metadata,
)
from hacpo_megatron.checkpoint.hf_io import fsync_tree, write_file_atomically
from hacpo_megatron.checkpoint.integrity import write_manifest

LATEST_FILE = "latest"
TRAINER_STATE_FILE = "trainer_state.pt"
TMP_SUFFIX = ".tmp"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """The folder name of step `step` (1-based): `_STEP_DIR` reads it back."""
    return f"step_{step:08d}"


def step_folder(root: PathLike, step: int) -> Path:
    return Path(root) / step_dir_name(step)


def publish_step(temporary: Path, final: Path, root: Path) -> None:
    """Manifest, fsync, rename the finished step into place, then move `latest` to it (rank 0)."""
    write_manifest(temporary)
    fsync_tree(temporary)
    if final.exists():  # the same step saved again (e.g. after a resume): the new one wins
        stale = final.with_name(final.name + ".old" + TMP_SUFFIX)
        os.replace(final, stale)
        os.replace(temporary, final)
        shutil.rmtree(stale)
    else:
        os.replace(temporary, final)
    write_file_atomically(root / LATEST_FILE, final.name + "\n")


def remove_interrupted_saves(root: PathLike) -> List[Path]:
    """Delete `*.tmp` folders (saves that never finished) under `root`; the deleted paths."""
    removed = []
    for path in sorted(Path(root).glob("*" + TMP_SUFFIX)):
        if path.is_dir():
            shutil.rmtree(path)
            removed.append(path)
    return removed


def checkpoint_steps(root: PathLike) -> List[int]:
    """The steps with a finished folder under `root`, ascending."""
    steps = []
    for path in Path(root).iterdir() if Path(root).is_dir() else []:
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            steps.append(int(match.group(1)))
    return sorted(steps)


def prune_checkpoints(root: PathLike, keep_last: int) -> List[Path]:
    """Delete all but the newest `keep_last` steps (never the one `latest` names); the deleted paths."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    latest = latest_checkpoint(root)
    removed = []
    for step in checkpoint_steps(root)[:-keep_last]:
        path = step_folder(root, step)
        if latest is not None and path.resolve() == latest.resolve():
            continue
        shutil.rmtree(path)
        removed.append(path)
    return removed


def latest_checkpoint(root: PathLike) -> Optional[Path]:
    """The step folder `<root>/latest` names; None if nothing was saved yet."""
    pointer = Path(root) / LATEST_FILE
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = Path(root) / name
    if not _STEP_DIR.match(name) or not path.is_dir():
        raise CheckpointError(f"{pointer}: names {name!r}, which is not a checkpoint folder under {root}")
    return path


def resume_candidates(root: PathLike) -> List[Path]:
    """Step folders to try when resuming, newest first: the one `latest` names (if it names one),
    then every other finished step folder."""
    root = Path(root)
    try:
        latest = latest_checkpoint(root)
    except CheckpointError:  # `latest` itself damaged: the step folders remain
        latest = None
    others = [step_folder(root, s) for s in reversed(checkpoint_steps(root))]
    return ([latest] if latest is not None else []) + [p for p in others if p != latest]


def latest_step(root: PathLike) -> Optional[int]:
    path = latest_checkpoint(root)
    return None if path is None else int(_STEP_DIR.match(path.name).group(1))


def find_agent_checkpoints(path: PathLike) -> Dict[str, Path]:
    """{agent name: folder} for an agent folder, a step folder, or a run root (its `latest` step)."""
    path = Path(path)
    if is_agent_checkpoint(path):
        return {read_checkpoint_metadata(path).agent_name or path.name: path}
    step_dir = latest_checkpoint(path) if (path / LATEST_FILE).is_file() else path
    if step_dir is None or not step_dir.is_dir():
        raise CheckpointError(f"{path}: neither an agent checkpoint ({METADATA_FILE}), nor a step folder, "
                              f"nor a run folder with `{LATEST_FILE}`")
    found = {p.name: p for p in sorted(step_dir.iterdir()) if p.is_dir() and is_agent_checkpoint(p)}
    if not found:
        raise CheckpointError(f"{step_dir}: holds no agent checkpoint folders")
    return found
