"""Hugging Face model folder -> one agent's Megatron distributed checkpoint (self-describing).

    python tools/convert_hf_to_megatron.py --hf-path HF_DIR --save CKPT_DIR                 # TP=1, PP=1
    python tools/convert_hf_to_megatron.py --hf-path HF_DIR --save CKPT_DIR --tp 2 --pp 2   # starts 4 processes
    torchrun --nproc_per_node 4 tools/convert_hf_to_megatron.py --hf-path HF_DIR --save CKPT_DIR --tp 2 --pp 2
    python tools/convert_hf_to_megatron.py --hf-path MOE_DIR --save CKPT_DIR --ep 2         # Qwen3-MoE: 2 processes

The checkpoint loads at any TP/PP/EP later (megatron reshards on load); --tp/--pp/--ep only choose how the
conversion itself is split (memory per process: one TP x PP slice of the model, with a mixture of experts' share
of the experts at --ep, plus one HF tensor). --ep takes the processes of data-parallel replicas: TP x PP x DP of
them, DP the fewest that EP divides TP x DP by (hacpo_megatron/checkpoint/tool_layout.py).
Run plainly, the tool starts those processes itself (hacpo_megatron/checkpoint/local_world.py); under
torchrun it uses the ranks it is given. The output folder (see hacpo_megatron/checkpoint/format.py)
carries the HF config and tokenizer.

Everything that can be checked is checked before any work, and before any process starts: supported
architecture, complete weight files, TP dividing the heads, PP dividing the layers, EP dividing the experts
(and a model that has experts), an empty target.
The checkpoint is written to `<save>.partial` and renamed to `<save>` when complete: an interrupted
conversion never looks finished.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hacpo_megatron.checkpoint.hf_io import (  # noqa: E402
    GENERATION_CONFIG_FILE, HFWeights, check_empty_target, check_hf_weights_complete, has_tokenizer, publish_folder,
    read_hf_config,
)
from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model  # noqa: E402
from hacpo_megatron.checkpoint.local_world import (  # noqa: E402
    WorkerError, ensure_distributed, finish, is_first_rank, run_collective, single_agent_parallel,
)
from hacpo_megatron.checkpoint.megatron_io import AgentState, save_agent_checkpoint  # noqa: E402
from hacpo_megatron.checkpoint.tool_layout import ToolLayout, check_tool_layout  # noqa: E402
from hacpo_megatron.models.architectures import read_architecture  # noqa: E402
from hacpo_megatron.models.build import build_agent_model  # noqa: E402

PARTIAL_SUFFIX = ".partial"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert_hf_to_megatron(hf_path: str, save: str, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                           expert_parallel: int = 1, dtype: Optional[str] = None, name: Optional[str] = None) -> Path:
    """Convert; collective over the world (its first ToolLayout.world_size ranks hold the model). Returns the folder.

    Called in a plain process (a world of one) with more than one process to the layout, it starts them for the
    conversion itself (`run_collective`). `dtype`: the checkpoint's parameter dtype; default: that of
    the HF weights (exact round trip).
    """
    hf_path, save_path = Path(hf_path), Path(save)
    layout = ToolLayout(tensor_parallel, pipeline_parallel, expert_parallel)
    # ---- checks before work (every rank makes them, or the one process before it starts the others) ----
    hf_config = read_hf_config(hf_path)
    arch = read_architecture(hf_config)
    check_tool_layout(arch, layout)
    weights = check_hf_weights_complete(hf_path, arch)
    check_empty_target(save_path)
    params_dtype = DTYPES[dtype] if dtype else weights.dtype_of("model.embed_tokens.weight")
    return run_collective(_convert, hf_path, save_path, hf_config, params_dtype, layout, name or save_path.name,
                          world_size=layout.world_size)


def _convert(hf_path: Path, save_path: Path, hf_config: dict, params_dtype: torch.dtype, layout: ToolLayout,
             name: str) -> Path:
    """The conversion on one rank, after the checks."""
    ensure_distributed()
    parallel = single_agent_parallel(name, layout.tensor, layout.pipeline, layout.expert)
    partial = save_path.with_name(save_path.name + PARTIAL_SUFFIX)
    if dist.get_rank() == 0 and partial.exists():
        shutil.rmtree(partial)  # left by an interrupted conversion
    dist.barrier()

    agent = None
    if parallel.is_member:
        agent = build_agent_model(hf_config, parallel, params_dtype=params_dtype, training=False)
        # one tensor at a time; an EP rank its own experts
        load_hf_state_dict_into_model(agent.model, HFWeights(hf_path), hf_config, parallel)
    tokenizer_dir = hf_path if has_tokenizer(hf_path) else None
    save_agent_checkpoint(partial, AgentState(parallel, hf_config, agent, tokenizer_dir=tokenizer_dir))

    if dist.get_rank() == 0:
        if (hf_path / GENERATION_CONFIG_FILE).is_file():
            shutil.copy2(hf_path / GENERATION_CONFIG_FILE, partial / GENERATION_CONFIG_FILE)
        publish_folder(partial, save_path)
    dist.barrier()
    return save_path


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-path", required=True, help="Hugging Face model folder (config.json + safetensors)")
    parser.add_argument("--save", required=True, help="new (or empty) folder for the Megatron checkpoint")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size of the conversion")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size of the conversion")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert parallel size of the conversion (a mixture-of-experts model: Qwen3-MoE)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="parameter dtype of the checkpoint (default: that of the HF weights)")
    parser.add_argument("--name", default=None, help="agent name recorded in metadata.json (default: folder name)")
    args = parser.parse_args(argv)
    try:
        path = convert_hf_to_megatron(args.hf_path, args.save, tensor_parallel=args.tp, pipeline_parallel=args.pp,
                                      expert_parallel=args.ep, dtype=args.dtype, name=args.name)
    except (ValueError, FileExistsError, WorkerError) as error:  # bad input: a message, not a traceback
        sys.exit(f"convert_hf_to_megatron: error: {error}")
    if is_first_rank():
        print(f"saved Megatron checkpoint ({ToolLayout(args.tp, args.pp, args.ep)}) to {path}")
    finish()


if __name__ == "__main__":
    main()
