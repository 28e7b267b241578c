"""Per-agent Megatron distributed checkpoints: saving and loading each agent's model and optimizer state, one
self-describing folder per agent (checkpoint/format.py), loadable at any TP/PP; a training step's save of every
agent into a run's folder, atomically (checkpoint/run_folder.py).

Collectives. `dist_checkpointing.save` has no process-group argument: it synchronises the whole world
and global rank 0 writes its bookkeeping. So every save here is entered by EVERY rank, with the agents
in the same order; ranks outside an agent contribute an empty state. A write that fails on one rank fails
the save on every rank (checkpoint/save_agreement.py). Loading reads only what this rank
needs (megatron's torch_dist loader does not communicate once access validation is off): loads are not
collective and each agent's members load on their own.

Resharding. Tensors are saved as global tensors with their TP/PP slice offsets, so a checkpoint
saved at TP=2 loads at TP=1, PP=2, ... The padded vocabulary depends on TP (rows are padded to a
multiple of 128·TP); megatron marks the embedding and output layer `allow_shape_mismatch`, so
they load across paddings (the padding rows are zeros).
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hacpo_megatron import megatron_cpu
from hacpo_megatron.checkpoint.format import (
    DIST_CHECKPOINT_DIR, HF_CONFIG_FILE, METADATA_FILE, TOKENIZER_DIR, CheckpointError, CheckpointMetadata, PathLike,
    check_compatible, optimizer_layout_problem, read_checkpoint_hf_config, read_checkpoint_metadata,
)
from hacpo_megatron.checkpoint.hf_io import copy_tokenizer_files
from hacpo_megatron.checkpoint.run_folder import (
    LATEST_FILE, TMP_SUFFIX, TRAINER_STATE_FILE, latest_checkpoint, prune_checkpoints, publish_step,
    remove_interrupted_saves, step_folder,
)
from hacpo_megatron.checkpoint.save_agreement import (
    CheckpointSaveError, every_rank_learns_of_a_failure, megatron_writers_own_reason, save_failure_message,
)
from hacpo_megatron.models.architectures import HFConfig
from hacpo_megatron.models.build import AgentModel, build_agent_model
from hacpo_megatron.parallel.groups import AgentParallel

# Non-tensor state (optimizer hyper-parameters, step counters) saved as one object owned by the agent's
# first rank; see `_agent_owned_common_state`.
AGENT_COMMON_STATE_KEY = "agent_common_state"


@dataclass
class AgentState:
    """What one agent contributes to a save (and receives in a load), on one rank.

    Every rank lists every agent; `model` (and `optimizer`) are None on ranks outside the agent.
    `model` is the agent's `AgentModel`; its `.model` may be the plain GPTModel or a DDP wrapper.
    """

    parallel: AgentParallel
    hf_config: Optional[HFConfig] = None  # needed on the agent's members
    model: Optional[AgentModel] = None
    optimizer: Optional[Any] = None  # a megatron optimizer (MegatronOptimizer / ChainedOptimizer)
    tokenizer_dir: Optional[PathLike] = None


# ------------------------------------------------------------------------------------------------
# The sharded state of one agent
# ------------------------------------------------------------------------------------------------
def _unwrapped(module: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def agent_sharded_state_dict(agent: AgentModel, optimizer: Optional[Any] = None, *,
                             is_loading: bool = False) -> Dict[str, Any]:
    """{"model": ..., "optimizer": ...} as megatron `ShardedTensor`s: global shapes + this rank's slice.

    The data-parallel group decides which replica writes (replica 0); the model's own process
    groups give the TP/PP offsets.
    """
    megatron_cpu.apply()
    metadata = {"dp_cp_group": agent.parallel.pg_collection.dp_cp}
    with _data_parallel_rank_of(agent.parallel):
        model_state = _unwrapped(agent.model).sharded_state_dict(metadata=metadata)
    state: Dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        # GPU (distributed optimizer): its state gathered per parameter at save, so that a run resumes under
        # another TP/PP/DP layout as the CPU optimizer's does; megatron's default format ("fully sharded model
        # space") is refused by its own checkpointing. The CPU optimizer ignores the key.
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    return _agent_owned_common_state(state, agent.parallel)


def _give_adam_its_state(optimizer: Any) -> None:
    """A fresh distributed optimizer (GPU) holds no Adam state until its first step, and megatron's
    `DistributedOptimizer.state_dict()` (which a load describes its target with) then fails on the missing
    step counter when Apex/TE's fused Adam is absent (seen on an H200, docs/gpu.md). Megatron's own remedy for
    its FSDP format: one step on zero gradients, whose values the load then overwrites in place. The CPU
    optimizer (not distributed) has no such method and needs nothing."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(inner, "_init_optimizer_states_with_dummy_values") and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


@contextlib.contextmanager
def _adam_step_left_to_param_groups(optimizer: Any) -> Iterator[None]:
    """megatron-core 0.19's `fully_reshardable` load leaves torch Adam's per-parameter "step" out of the tensors
    it copies into each parameter's state (it restores the step from the param groups), then copies every
    tensor of the target's state by name, "step" included: KeyError 'step' without Apex/TE (seen on an H200,
    docs/gpu.md). A `None` under "step" is what that copy already skips, so the step stays the one megatron
    set from the param groups."""
    patched = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(inner, "_set_main_param_and_optimizer_states", None)
        if original is not None:
            inner._set_main_param_and_optimizer_states = (
                lambda model_param, tensors, original=original: original(model_param, {"step": None, **tensors}))
            patched.append(inner)
    try:
        yield
    finally:
        for inner in patched:
            del inner._set_main_param_and_optimizer_states


@contextlib.contextmanager
def _data_parallel_rank_of(parallel: AgentParallel) -> Iterator[None]:
    """Let megatron's global `get_data_parallel_rank` answer with this agent's data-parallel rank.

    megatron-core 0.19 asks the global parallel state (never initialised here, see
    docs/parallelism.md) for the DP rank in one place: the replica id of the last stage's copy of
    tied embeddings when PP > 1 (`LanguageModule.tie_embeddings_and_output_weights_state_dict`).
    """
    from megatron.core import parallel_state

    original = parallel_state.get_data_parallel_rank
    parallel_state.get_data_parallel_rank = lambda *args, **kwargs: parallel.dp_rank
    try:
        yield
    finally:
        parallel_state.get_data_parallel_rank = original


def _agent_owned_common_state(state: Dict[str, Any], parallel: AgentParallel) -> Dict[str, Any]:
    """Move the plain (non-sharded) values of `state` into one ShardedObject owned by the agent.

    Megatron saves plain values ("common state", e.g. the optimizer's learning rate and step) from
    global rank 0 only, which need not belong to this agent. As a ShardedObject they are written by
    the agent's first rank instead (replica_id 0 there). Values megatron never persists
    (`LocalNonpersistentObject`, e.g. the optimizer's parameter ids) stay where they are.
    """
    from megatron.core.dist_checkpointing.dict_utils import merge
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

    nonpersistent, persistent = extract_nonpersistent(state)
    sharded, common = extract_sharded_base(persistent)
    if _has_values(common):
        sharded[AGENT_COMMON_STATE_KEY] = ShardedObject(
            AGENT_COMMON_STATE_KEY, common, global_shape=(1,), global_offset=(0,), replica_id=parallel.agent_rank
        )
    return merge(sharded, nonpersistent)


def _restore_common_state(loaded: Dict[str, Any]) -> Dict[str, Any]:
    from megatron.core.dist_checkpointing.dict_utils import merge

    common = loaded.pop(AGENT_COMMON_STATE_KEY, None)
    return merge(loaded, common) if common else loaded


def _has_values(nested: Any) -> bool:
    if isinstance(nested, dict):
        return any(_has_values(v) for v in nested.values())
    if isinstance(nested, list):
        return any(_has_values(v) for v in nested)
    return True


# ------------------------------------------------------------------------------------------------
# Saving one agent (collective over the world)
# ------------------------------------------------------------------------------------------------
def checkpoint_metadata_of(agent: AgentModel, *, has_optimizer: bool, step: Optional[int] = None) -> CheckpointMetadata:
    return CheckpointMetadata(
        hf_architecture=agent.arch.hf_architecture,
        vocab_size=agent.arch.vocab_size,
        padded_vocab_size=agent.padded_vocab_size,
        tensor_parallel=agent.parallel.tp_size,
        pipeline_parallel=agent.parallel.pp_size,
        expert_parallel=agent.parallel.ep_size,
        has_optimizer=has_optimizer,
        agent_name=agent.parallel.name,
        step=step,
        params_dtype=str(agent.config.params_dtype).replace("torch.", ""),
    )


def save_agent_checkpoint(folder: PathLike, agent: AgentState, *, step: Optional[int] = None) -> None:
    """Write one agent's checkpoint folder (checkpoint/format.py). Collective: every rank calls it.

    Writes into `folder` directly (created if missing); use `save_agents_checkpoint` for the
    crash-safe step/latest layout, or write to a temporary folder and rename it yourself.
    """
    megatron_cpu.apply()
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    dist_dir = folder / DIST_CHECKPOINT_DIR
    with every_rank_learns_of_a_failure(f"saving {folder}"):  # megatron's writers expect the folder on every rank
        if dist.get_rank() == 0:
            dist_dir.mkdir(parents=True, exist_ok=True)
    member = agent.parallel.is_member
    if member and agent.model is None:
        raise ValueError(f"rank {agent.parallel.rank} belongs to agent {agent.parallel.name!r} but passed no model")
    state = agent_sharded_state_dict(agent.model, agent.optimizer) if member else {}
    _start_writer_helper_outliving_sigterm()
    with every_rank_learns_of_a_failure(f"saving {folder}"):
        with megatron_writers_own_reason():
            dist_checkpointing.save(state, str(dist_dir))
        if member and agent.parallel.agent_rank == 0:
            _write_side_files(folder, agent, step)


def _start_writer_helper_outliving_sigterm() -> None:
    """Megatron's checkpoint writer collects its results through a multiprocessing Manager, a process it
    starts at the first save and keeps (filesystem_async.get_write_results_queue). torchrun forwards a
    preemption SIGTERM to the rank's whole process group, so that process would die with it, and the
    checkpoint the signal asks for would fail ("Broken pipe"). This starts it in megatron's place, the
    same way but ignoring SIGTERM; it ends with the rank (orchestrator/preemption.py).

    A spawned process imports the parent's main module first (the entry script: megatron, Ray, transformers,
    3.3 s here); the manager's server needs nothing of it, so the main module is not named to it (0.05 s)."""
    import functools
    import multiprocessing
    import signal
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # what get_write_results_queue makes
        with _main_module_hidden_from_spawn():
            manager.start(functools.partial(signal.signal, signal.SIGTERM, signal.SIG_IGN))
        filesystem_async._results_queue = manager.Queue()  # the queue's proxy keeps the manager alive


@contextlib.contextmanager
def _main_module_hidden_from_spawn() -> Iterator[None]:
    """multiprocessing's spawn re-imports `__main__` in the child by its module name or file
    (multiprocessing.spawn.get_preparation_data); without both, the child starts bare."""
    main = sys.modules["__main__"]
    saved = {key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None  # read without a default there
    try:
        yield
    finally:
        main.__dict__.update(saved)


def _write_side_files(folder: Path, agent: AgentState, step: Optional[int]) -> None:
    """hf_config.json, tokenizer/ and, last, metadata.json (its presence marks a complete folder)."""
    if agent.hf_config is None:
        raise ValueError(f"agent {agent.parallel.name!r}: save needs its hf_config")
    config = agent.hf_config.to_dict() if hasattr(agent.hf_config, "to_dict") else dict(agent.hf_config)
    (folder / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if agent.tokenizer_dir is not None:
        copied = copy_tokenizer_files(agent.tokenizer_dir, folder / TOKENIZER_DIR)
        if not copied:
            raise CheckpointError(f"{agent.tokenizer_dir}: no tokenizer files to copy (looked for tokenizer.json, ...)")
    metadata = checkpoint_metadata_of(agent.model, has_optimizer=agent.optimizer is not None, step=step)
    (folder / METADATA_FILE).write_text(json.dumps(asdict(metadata), indent=2) + "\n")


# ------------------------------------------------------------------------------------------------
# Saving a training step: every agent, atomically, with `latest`
# ------------------------------------------------------------------------------------------------
def save_agents_checkpoint(
    root: PathLike,
    step: int,
    agents: Sequence[AgentState],
    *,
    keep_last: Optional[int] = None,
    trainer_state: Optional[Dict[str, Any]] = None,
) -> Path:
    """Save every agent at `step` under `<root>/step_N/<agent name>/`, then point `latest` at it.

    Collective: every rank calls it with every agent, in the same order. Crash safety:
      1. everything is written into `<root>/step_N.tmp/` (left-overs of an earlier crash removed first);
      2. rank 0 flushes it to disk (fsync), renames it to `step_N/`, then replaces `latest` by
         write-to-temporary-and-rename.
    A crash before 2 leaves `latest` on the previous step; a reader that follows `latest` always finds
    a complete checkpoint. `keep_last`: afterwards delete all but the newest N steps.
    `trainer_state` (rank 0's) is saved with torch.save as `trainer_state.pt`.
    """
    root = Path(root)
    final = step_folder(root, step)
    temporary = root / (final.name + TMP_SUFFIX)
    names = [a.parallel.name for a in agents]
    if len(set(names)) != len(names):
        raise ValueError(f"agent names must be distinct, got {names}")
    try:
        with every_rank_learns_of_a_failure(f"saving step {step}"):
            if dist.get_rank() == 0:
                root.mkdir(parents=True, exist_ok=True)
                remove_interrupted_saves(root)
                temporary.mkdir()
        for agent in agents:  # each agrees at its end: every rank's files exist before rank 0 lists them
            save_agent_checkpoint(temporary / agent.parallel.name, agent, step=step)
        with every_rank_learns_of_a_failure(f"saving step {step}"):
            if dist.get_rank() == 0:
                if trainer_state is not None:
                    _write_trainer_state(trainer_state, temporary / TRAINER_STATE_FILE)
                publish_step(temporary, final, root)
                if keep_last:
                    prune_checkpoints(root, keep_last)
    except CheckpointSaveError as error:  # disk full, I/O error: the previous step stays `latest`
        raise CheckpointSaveError(save_failure_message(error, temporary, root)) from error.__cause__
    return final


def _write_trainer_state(state: Dict[str, Any], path: Path) -> None:
    """torch.save to memory, then one plain write: a full disk raises OSError here, not torch's zip writer's
    RuntimeError, which could not be told from a bug."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path.write_bytes(buffer.getvalue())


# ------------------------------------------------------------------------------------------------
# Loading (not collective)
# ------------------------------------------------------------------------------------------------
def load_agent_checkpoint(folder: PathLike, agent: AgentModel, optimizer: Optional[Any] = None) -> CheckpointMetadata:
    """Load the model (and `optimizer`, if given) of this rank's slice from an agent folder.

    Any TP/PP/EP layout: megatron reads the slices this rank needs from the saved global tensors (each expert by its
    global index). The optimizer's state only at the EP it was saved at (format.py: `optimizer_layout_problem`). Not
    collective: each member rank loads on its own. Returns the folder's metadata.
    """
    megatron_cpu.apply()
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    metadata = read_checkpoint_metadata(folder)
    check_compatible(folder, metadata, agent.arch)
    if optimizer is not None and not metadata.has_optimizer:
        raise CheckpointError(f"{folder}: holds no optimizer state (a converted model?); load without optimizer")
    if optimizer is not None:
        problem = optimizer_layout_problem(folder, metadata, agent.parallel.ep_size)  # weights: any EP; this: its own
        if problem:
            raise CheckpointError(problem)
        _give_adam_its_state(optimizer)
    state = agent_sharded_state_dict(agent, optimizer, is_loading=True)
    # Access validation would all-gather over the world; a load must not depend on other agents.
    loaded = dist_checkpointing.load(state, str(folder / DIST_CHECKPOINT_DIR), validate_access_integrity=False)
    loaded = _restore_common_state(loaded)
    _unwrapped(agent.model).load_state_dict(loaded["model"], strict=True)
    if optimizer is not None:
        with _adam_step_left_to_param_groups(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
    return metadata


def build_agent_from_checkpoint(folder: PathLike, parallel: AgentParallel, **build_kwargs: Any) -> AgentModel:
    """Build the agent's model from the folder's hf_config.json at `parallel`'s layout and load it."""
    hf_config = read_checkpoint_hf_config(folder)
    agent = build_agent_model(hf_config, parallel, **build_kwargs)
    load_agent_checkpoint(folder, agent)
    return agent


def load_agents_checkpoint(path: PathLike, agents: Sequence[AgentState]) -> Tuple[Path, Optional[Dict[str, Any]]]:
    """Resume: load each agent this rank belongs to from a run root (`latest`) or a step folder.

    Returns (the step folder, its trainer state or None). Not collective.
    """
    path = Path(path)
    step_dir = latest_checkpoint(path) if (path / LATEST_FILE).is_file() else path
    if step_dir is None:
        raise CheckpointError(f"{path}: no checkpoint saved yet (no `{LATEST_FILE}`)")
    for agent in agents:
        if agent.parallel.is_member:
            load_agent_checkpoint(step_dir / agent.parallel.name, agent.model, agent.optimizer)
    state_path = step_dir / TRAINER_STATE_FILE
    trainer_state = torch.load(state_path, weights_only=True) if state_path.is_file() else None
    return step_dir, trainer_state
