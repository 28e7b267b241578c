"""Feed one token batch through transformers and through the Megatron checkpoint; print max |Δlogit|.

    python tools/compare_hf_megatron.py --hf-path HF_DIR --megatron-path CKPT_DIR            # TP=1, PP=1
    python tools/compare_hf_megatron.py --hf-path HF_DIR --megatron-path CKPT_DIR --tp 2     # starts 2 processes
    torchrun --nproc_per_node 2 tools/compare_hf_megatron.py --hf-path HF_DIR --megatron-path CKPT_DIR --tp 2
    python tools/compare_hf_megatron.py --hf-path MOE_DIR --megatron-path CKPT_DIR --ep 2 --pp 2   # 4 processes

Runs in TP x PP processes, times the data-parallel replicas --ep needs (a mixture-of-experts model: TP x PP x DP,
DP the fewest that EP divides TP x DP by, hacpo_megatron/checkpoint/tool_layout.py; every replica computes the same
batch, its tokens going to the experts' EP ranks and back). They are started by the tool when run plainly (see
hacpo_megatron/checkpoint/local_world.py; torchrun's ranks otherwise). The checkpoint is loaded at this layout
whatever it was saved at. Both
models compute in --dtype (float32 by default). The Megatron logits (split over TP, on the last
pipeline stage) are gathered on the last stage's first rank and compared there with transformers'
over the true vocabulary (padding rows dropped). Exits 1 when the difference exceeds --tolerance.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hacpo_megatron.checkpoint.format import read_checkpoint_hf_config  # noqa: E402
from hacpo_megatron.checkpoint.hf_io import read_hf_config  # noqa: E402
from hacpo_megatron.checkpoint.local_world import (  # noqa: E402
    WorkerError, ensure_distributed, finish, is_first_rank, run_collective, single_agent_parallel,
)
from hacpo_megatron.checkpoint.megatron_io import load_agent_checkpoint  # noqa: E402
from hacpo_megatron.checkpoint.tool_layout import ToolLayout, check_tool_layout  # noqa: E402
from hacpo_megatron.models.architectures import read_architecture  # noqa: E402
from hacpo_megatron.models.build import AgentModel, build_agent_model  # noqa: E402
from hacpo_megatron.models.logprobs import run_schedule  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def token_batch(vocab_size: int, batch_size: int, seq_length: int, seed: int) -> torch.Tensor:
    """The same random token ids on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, seq_length), generator=generator)


class _TokenBatch:
    """One micro-batch as megatron's schedule (`run_schedule`) sees it."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens
        self.num_sequences = tokens.shape[0]


def megatron_logits(agent: AgentModel, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """Full-vocabulary logits [batch, seq, vocab] on the last stage's TP rank 0; None elsewhere."""
    device = next(agent.model.parameters()).device  # a GPU's, where there is one: inputs go to the model
    tokens = tokens.to(device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)

    def forward_step(data_iterator, model):
        output = model(next(data_iterator).tokens, positions, attention_mask=None)
        # on the last stage `output` is this TP rank's slice of the logits; keep it as the "loss" result
        return output, lambda logits: (torch.zeros(()), {"logits": logits.detach()})

    was_training = agent.model.training
    agent.model.eval()
    try:
        with torch.no_grad():
            results = run_schedule(agent, [_TokenBatch(tokens)], forward_step, forward_only=True)
    finally:
        agent.model.train(was_training)
    parallel = agent.parallel
    if not parallel.is_last_stage:
        return None
    local = results[0]["logits"]
    if parallel.tp_size > 1:
        parts = [torch.empty_like(local) for _ in range(parallel.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=parallel.tp_group)
        local = torch.cat(parts, dim=-1)
    return local[..., : agent.vocab_size].cpu() if parallel.tp_rank == 0 else None


def compare_hf_megatron(hf_path: str, megatron_path: str, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                        expert_parallel: int = 1, dtype: str = "float32", batch_size: int = 2, seq_length: int = 16,
                        seed: int = 0) -> float:
    """max |HF logits - Megatron logits| over the batch; the same number on every rank. Collective.

    Called in a plain process (a world of one) with more than one process to the layout, it starts them itself.
    """
    layout = ToolLayout(tensor_parallel, pipeline_parallel, expert_parallel)
    hf_config = read_checkpoint_hf_config(megatron_path)
    arch = read_architecture(hf_config)
    if read_architecture(read_hf_config(hf_path)) != arch:
        raise ValueError(f"{hf_path} and {megatron_path} hold different architectures")
    check_tool_layout(arch, layout)
    return run_collective(_compare, hf_path, megatron_path, hf_config, layout, dtype, batch_size, seq_length, seed,
                          world_size=layout.world_size)


def _compare(hf_path: str, megatron_path: str, hf_config: dict, layout: ToolLayout, dtype: str, batch_size: int,
             seq_length: int, seed: int) -> float:
    """The comparison on one rank, after the checks."""
    import transformers

    ensure_distributed()
    parallel = single_agent_parallel("compare", layout.tensor, layout.pipeline, layout.expert)
    tokens = token_batch(read_architecture(hf_config).vocab_size, batch_size, seq_length, seed)
    output_rank = parallel.global_rank_of(tp_rank=0, dp_rank=0, pp_rank=layout.pipeline - 1)

    difference = torch.zeros((), dtype=torch.float64)
    if parallel.is_member:  # every replica: at EP > 1 the MoE layers exchange its tokens with the others'
        agent = build_agent_model(hf_config, parallel, params_dtype=DTYPES[dtype], training=False)
        load_agent_checkpoint(megatron_path, agent)
        logits = megatron_logits(agent, tokens)
        if dist.get_rank() == output_rank:
            hf = transformers.AutoModelForCausalLM.from_pretrained(hf_path, dtype=DTYPES[dtype])
            with torch.no_grad():
                reference = hf(tokens).logits
            difference.fill_((logits.double() - reference.double()).abs().max().item())
    dist.broadcast(difference, src=output_rank)
    return difference.item()


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-path", required=True)
    parser.add_argument("--megatron-path", required=True, help="an agent checkpoint folder")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (a mixture-of-experts model)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="exit 1 above this max |Δlogit|")
    args = parser.parse_args(argv)
    try:
        difference = compare_hf_megatron(args.hf_path, args.megatron_path, tensor_parallel=args.tp,
                                         pipeline_parallel=args.pp, expert_parallel=args.ep, dtype=args.dtype,
                                         batch_size=args.batch_size, seq_length=args.seq_length, seed=args.seed)
    except (ValueError, FileNotFoundError, WorkerError) as error:
        sys.exit(f"compare_hf_megatron: error: {error}")
    within = difference <= args.tolerance
    if is_first_rank():
        print(f"max |logit difference| = {difference:.3e} ({ToolLayout(args.tp, args.pp, args.ep)}, {args.dtype}); "
              f"tolerance {args.tolerance:.1e}: {'OK' if within else 'EXCEEDED'}")
    finish()
    sys.exit(0 if within else 1)


if __name__ == "__main__":
    main()
