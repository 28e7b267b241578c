"""Checkpoint integrity: a manifest of every file (size, SHA-256) written into each step folder before
it is published, verified before a resume loads it.

    write_manifest(step_dir)                 rank 0, after every rank has written its files
    verify_manifest(step_dir)                raises DamagedCheckpoint naming the first bad file
    choose_resume_checkpoint(root)           `latest` if intact, else the newest intact step, with
                                             what was found damaged on the way

A step folder without a manifest is treated as damaged: a resume never loads a checkpoint it cannot
verify. Pure file-system code: no processes, no Megatron.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from hacpo_megatron.checkpoint.hf_io import write_file_atomically

PathLike = Union[str, os.PathLike]
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "hacpo-checkpoint-manifest/1"
_CHUNK = 8 << 20


class DamagedCheckpoint(Exception):
    """A step folder that fails verification; `path` is the file (or folder) at fault."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def file_sha256(path: PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> List[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def write_manifest(folder: PathLike) -> Path:
    """Record every file under `folder` (relative path -> size, sha256) in `folder/manifest.json`."""
    folder = Path(folder)
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": file_sha256(p)}
             for p in _files(folder)}
    path = folder / MANIFEST_FILE
    write_file_atomically(path, json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1, sort_keys=True))
    return path


def verify_manifest(folder: PathLike) -> int:
    """Check every file the manifest lists (present, same size, same SHA-256); returns how many.

    Sizes are checked for all files first, so a truncated file is found without hashing the rest.
    """
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
        files: Dict[str, Dict] = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"unknown format {manifest.get('format')!r}")
        if not files:  # write_manifest lists every file of a step, and a step always has some
            raise ValueError("it lists no files")
    except FileNotFoundError:
        raise DamagedCheckpoint(path, "missing: the checkpoint cannot be verified (incomplete, or written by an "
                                      "older version)") from None
    except (ValueError, KeyError, TypeError) as error:
        raise DamagedCheckpoint(path, f"unreadable manifest ({error})") from None
    for name, entry in files.items():
        target = folder / name
        if not target.is_file():
            raise DamagedCheckpoint(target, "listed in the manifest but missing")
        size = target.stat().st_size
        if size != entry["size"]:
            raise DamagedCheckpoint(target, f"{size} bytes, the manifest says {entry['size']}")
    for name, entry in files.items():
        if file_sha256(folder / name) != entry["sha256"]:
            raise DamagedCheckpoint(folder / name, "content differs from the manifest's SHA-256")
    return len(files)


@dataclass
class ResumeChoice:
    step_dir: Optional[Path]  # the newest intact step folder; None: nothing intact
    damaged: List[DamagedCheckpoint] = field(default_factory=list)  # newer folders passed over, newest first


def choose_resume_checkpoint(step_dirs_newest_first: List[Path]) -> ResumeChoice:
    """The first folder of the list that verifies, and every damaged one met before it."""
    choice = ResumeChoice(step_dir=None)
    for step_dir in step_dirs_newest_first:
        try:
            verify_manifest(step_dir)
        except DamagedCheckpoint as damage:
            choice.damaged.append(damage)
            continue
        choice.step_dir = step_dir
        break
    return choice


def describe(choice: ResumeChoice, root: PathLike) -> Tuple[List[str], Optional[str]]:
    """(warnings to print, the error if nothing can be resumed) for a user."""
    warnings = [f"checkpoint {d.path.relative_to(root) if d.path.is_relative_to(root) else d.path} is damaged: "
                f"{d.reason}" for d in choice.damaged]
    if choice.step_dir is not None:
        if choice.damaged:
            warnings.append(f"resuming from {choice.step_dir.name}, the newest intact checkpoint")
        return warnings, None
    if not choice.damaged:
        return warnings, f"{root}: no checkpoint saved yet; start without --resume"
    return warnings, f"{root}: no intact checkpoint to resume from ({len(choice.damaged)} damaged)"

