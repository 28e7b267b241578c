"""Megatron agent checkpoint(s) -> Hugging Face folder(s) that transformers loads.

    python tools/convert_megatron_to_hf.py --load CKPT_DIR --save HF_DIR          # one agent
    python tools/convert_megatron_to_hf.py --load runs/my_run --save HF_DIRS       # every agent of a run's
                                                                                    # latest step: HF_DIRS/<agent>/

`--load` is an agent checkpoint folder, a step folder, or a training run folder (its `latest` step).
The output has config.json, sharded safetensors (with model.safetensors.index.json when more than one
shard), the tokenizer files and generation_config.json when the checkpoint has them. Vocabulary padding
is removed; with tied embeddings no lm_head is written (the HF model ties it to embed_tokens).

Memory: at TP=1, PP=1 (the default) one process holds the model once and one shard being written.
With --tp/--pp the model is split over TP x PP processes, and with --ep (a mixture-of-experts model: Qwen3-MoE)
each layer's experts over EP ranks, which are data-parallel replicas: TP x PP x DP processes, DP the fewest that EP
divides TP x DP by (hacpo_megatron/checkpoint/tool_layout.py). The processes are started by the tool when run
plainly (hacpo_megatron/checkpoint/local_world.py; torchrun's ranks otherwise) and tensors stream to rank 0 one at a
time, each expert from the rank holding it. The checkpoint loads at any layout, whatever it was saved at.
Output goes to `<save>.partial` and is renamed when complete.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hacpo_megatron.checkpoint.hf_io import (  # noqa: E402
    CONFIG_FILE, DEFAULT_MAX_SHARD_BYTES, GENERATION_CONFIG_FILE, check_empty_target, copy_tokenizer_files,
    parse_size, publish_folder, write_hf_weights,
)
from hacpo_megatron.checkpoint.hf_mapping import iter_hf_tensors  # noqa: E402
from hacpo_megatron.checkpoint.format import (  # noqa: E402
    checkpoint_tokenizer_dir, is_agent_checkpoint, read_checkpoint_hf_config, read_checkpoint_metadata,
)
from hacpo_megatron.checkpoint.local_world import (  # noqa: E402
    WorkerError, ensure_distributed, finish, is_first_rank, run_collective, single_agent_parallel,
)
from hacpo_megatron.checkpoint.megatron_io import load_agent_checkpoint  # noqa: E402
from hacpo_megatron.checkpoint.run_folder import find_agent_checkpoints  # noqa: E402
from hacpo_megatron.checkpoint.tool_layout import ToolLayout, check_tool_layout  # noqa: E402
from hacpo_megatron.models.architectures import read_architecture  # noqa: E402
from hacpo_megatron.models.build import build_agent_model  # noqa: E402

PARTIAL_SUFFIX = ".partial"


def convert_megatron_to_hf(load: str, save: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                           tensor_parallel: int = 1, pipeline_parallel: int = 1,
                           expert_parallel: int = 1) -> Dict[str, Path]:
    """Export one agent (or every agent of a run's latest step); {agent name: HF folder}. Collective.

    Called in a plain process (a world of one) with more than one process to the layout, it starts them itself.
    """
    load_path, save_path = Path(load), Path(save)
    layout = ToolLayout(tensor_parallel, pipeline_parallel, expert_parallel)
    # ---- checks before work ----
    checkpoints = find_agent_checkpoints(load_path)
    for name, folder in checkpoints.items():
        try:
            check_tool_layout(read_architecture(read_checkpoint_hf_config(folder)), layout)
        except ValueError as error:  # a run's agents: which one
            where = f"agent {name!r} ({folder}): " if len(checkpoints) > 1 else ""
            raise ValueError(f"{where}{error}") from None
    check_empty_target(save_path)
    return run_collective(_export, load_path, save_path, checkpoints, max_shard_bytes, layout,
                          world_size=layout.world_size)


def _export(load_path: Path, save_path: Path, checkpoints: Dict[str, Path], max_shard_bytes: int,
            layout: ToolLayout) -> Dict[str, Path]:
    """The export on one rank, after the checks."""
    ensure_distributed()
    partial = save_path.with_name(save_path.name + PARTIAL_SUFFIX)
    if dist.get_rank() == 0:
        if partial.exists():
            shutil.rmtree(partial)  # left by an interrupted export
        partial.mkdir(parents=True)
    dist.barrier()
    one_agent = is_agent_checkpoint(load_path)
    targets = {}
    for name, folder in checkpoints.items():
        target = partial if one_agent else partial / name
        export_agent(folder, target, name=name, max_shard_bytes=max_shard_bytes, layout=layout)
        targets[name] = save_path if one_agent else save_path / name
    if dist.get_rank() == 0:
        publish_folder(partial, save_path)
    dist.barrier()
    return targets


def export_agent(folder: Path, target: Path, *, name: str, max_shard_bytes: int, layout: ToolLayout) -> None:
    """Load one agent checkpoint at `layout` and write its HF folder from global rank 0."""
    metadata = read_checkpoint_metadata(folder)
    hf_config = read_checkpoint_hf_config(folder)
    parallel = single_agent_parallel(name, layout.tensor, layout.pipeline, layout.expert)
    if parallel.is_member:
        agent = build_agent_model(hf_config, parallel, params_dtype=getattr(torch, metadata.params_dtype),
                                  training=False)
        load_agent_checkpoint(folder, agent)
        tensors = iter_hf_tensors(agent.model, hf_config, parallel)  # yields on rank 0 only (experts: sent once)
        if dist.get_rank() == 0:
            target.mkdir(parents=True, exist_ok=True)
            write_hf_weights(tensors, target, max_shard_bytes=max_shard_bytes)
        else:
            for _ in tensors:  # take part in the gathers; nothing arrives here
                pass
    if dist.get_rank() == 0:
        config = dict(hf_config, dtype=metadata.params_dtype)
        (target / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer = checkpoint_tokenizer_dir(folder)
        if tokenizer is not None:
            copy_tokenizer_files(tokenizer, target)
        if (folder / GENERATION_CONFIG_FILE).is_file():
            shutil.copy2(folder / GENERATION_CONFIG_FILE, target / GENERATION_CONFIG_FILE)
    dist.barrier()


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="agent checkpoint, step folder, or training run folder")
    parser.add_argument("--save", required=True, help="new (or empty) folder for the Hugging Face model(s)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (e.g. 5GB, 500MB)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size to load at (memory per process)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size to load at (memory per process)")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size to load at (memory per process; a "
                        "mixture-of-experts model: Qwen3-MoE)")
    args = parser.parse_args(argv)
    try:
        targets = convert_megatron_to_hf(args.load, args.save, max_shard_bytes=parse_size(args.max_shard_size),
                                         tensor_parallel=args.tp, pipeline_parallel=args.pp, expert_parallel=args.ep)
    except (ValueError, FileExistsError, WorkerError) as error:
        sys.exit(f"convert_megatron_to_hf: error: {error}")
    if is_first_rank():
        for name, path in targets.items():
            print(f"exported {name} to {path}")
    finish()


if __name__ == "__main__":
    main()
