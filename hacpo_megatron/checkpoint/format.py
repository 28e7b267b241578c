"""The agent checkpoint format: what one agent's folder holds, and reading and checking it without Megatron.

One agent's checkpoint folder:

    <agent>/
      metadata.json        this format's version, architecture, true and padded vocabulary, the TP/PP
                           (and EP) it was saved at, whether optimizer state is inside (written last)
      hf_config.json       the Hugging Face config.json: the model can be rebuilt from the folder alone
      tokenizer/           the tokenizer files, when the model came with them
      dist_checkpoint/     megatron `dist_checkpointing` (torch_dist) files: the model under "model",
                           the optimizer (optional) under "optimizer", keys as Megatron-LM names them

Its own module so that the checks before a run (training/preflight.py) and the tools that only look at a
folder read it without importing Megatron; writing and loading the state are checkpoint/megatron_io.py's,
where the folders of a run live checkpoint/run_folder.py's.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Union

from hacpo_megatron.models.architectures import Architecture, read_architecture

PathLike = Union[str, os.PathLike]

FORMAT_NAME = "hacpo_megatron.agent_checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
HF_CONFIG_FILE = "hf_config.json"
TOKENIZER_DIR = "tokenizer"
DIST_CHECKPOINT_DIR = "dist_checkpoint"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used: the message names the folder and the file."""


@dataclass(frozen=True)
class CheckpointMetadata:
    """metadata.json of one agent's checkpoint."""

    hf_architecture: str
    vocab_size: int  # the tokenizer's vocabulary (rows of the HF embedding)
    padded_vocab_size: int  # rows of megatron's embedding at the TP it was saved at
    tensor_parallel: int
    pipeline_parallel: int
    has_optimizer: bool
    agent_name: str = ""
    step: Optional[int] = None
    params_dtype: str = "float32"
    expert_parallel: int = 1  # a mixture of experts' EP at the save (loads at any other, as TP and PP)
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION


def read_checkpoint_metadata(folder: PathLike) -> CheckpointMetadata:
    """metadata.json of an agent folder, after checking that the folder has all its parts."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    for required in (METADATA_FILE, HF_CONFIG_FILE, f"{DIST_CHECKPOINT_DIR}/metadata.json",
                     f"{DIST_CHECKPOINT_DIR}/.metadata"):
        if not (folder / required).is_file():
            raise CheckpointError(f"{folder}: not a complete agent checkpoint, {required} is missing")
    path = folder / METADATA_FILE
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None
    if values.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path}: format {values.get('format')!r}, expected {FORMAT_NAME!r}")
    if values.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {values.get('format_version')!r}; "
                              f"this code reads version {FORMAT_VERSION}")
    try:
        return CheckpointMetadata(**values)
    except TypeError as error:
        raise CheckpointError(f"{path}: unexpected or missing fields ({error})") from None


def read_checkpoint_hf_config(folder: PathLike) -> Dict[str, Any]:
    read_checkpoint_metadata(folder)
    path = Path(folder) / HF_CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None


def checkpoint_tokenizer_dir(folder: PathLike) -> Optional[Path]:
    path = Path(folder) / TOKENIZER_DIR
    return path if path.is_dir() else None


def is_agent_checkpoint(folder: PathLike) -> bool:
    return (Path(folder) / METADATA_FILE).is_file() and (Path(folder) / DIST_CHECKPOINT_DIR).is_dir()


def check_compatible(folder: Path, metadata: CheckpointMetadata, arch: Architecture) -> None:
    if metadata.hf_architecture != arch.hf_architecture or metadata.vocab_size != arch.vocab_size:
        raise CheckpointError(
            f"{folder / METADATA_FILE}: holds a {metadata.hf_architecture} with vocabulary {metadata.vocab_size}, "
            f"the model is a {arch.hf_architecture} with vocabulary {arch.vocab_size}")


def optimizer_layout_problem(folder: PathLike, metadata: CheckpointMetadata, expert_parallel: int) -> Optional[str]:
    """Why the optimizer state in `folder` cannot be loaded by an agent at `expert_parallel`; None when it can.

    The weights load at any EP (megatron keys each expert by its global index), the optimizer's state only at the EP
    it was saved at: at EP > 1 megatron's optimizer is two (ChainedOptimizer: the dense weights', the experts'), whose
    states are saved under keys of their own (`chained_0.`, `chained_1.`) with a parameter-group list each, at EP 1
    it is one; a load across that finds neither its keys nor its groups (megatron fails on a missing key). Another
    EP > 1 keeps the two parts but has not been run, so it is refused too."""
    if not metadata.has_optimizer or metadata.expert_parallel == expert_parallel:
        return None
    return (f"{Path(folder) / METADATA_FILE}: saved at expert parallelism {metadata.expert_parallel}, the agent now "
            f"has parallel.expert {expert_parallel}; the weights would load at any EP, the optimizer's state only at "
            f"the EP it was saved at (at EP > 1 it is the dense weights' and the experts' optimizers, keyed apart). "
            f"Resume with parallel.expert: {metadata.expert_parallel}, or export the weights "
            f"(tools/convert_megatron_to_hf.py) and start a new run from them, without the optimizer's state")


def architecture_of_checkpoint(folder: PathLike) -> Architecture:
    return read_architecture(read_checkpoint_hf_config(folder))
