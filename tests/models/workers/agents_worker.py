"""Three agents with different layouts in one 3-rank world.

    A  qwen3  TP=2  ranks 0-1
    B  llama  TP=1  rank 2          (computes while A does)
    C  qwen2  DP=2  ranks 1-2       (first_rank=1: time-shares ranks with A and B)

Every rank writes OUT/rank{r}.json: its groups' members, a DP all-reduce, and for each agent it
belongs to the largest difference between its log-probs and a single-process HF reference.

usage: torchrun --nproc_per_node 3 agents_worker.py OUT
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
from hacpo_megatron.config.schema import AgentConfig, ParallelConfig
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.parallel.groups import collective_device
from hacpo_megatron.models.logprobs import compute_sequence_logprobs
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
from tests.models.workers.reference import SEQUENCES, TEMPERATURE, TEST_CONFIGS, hf_model, hf_token_logprobs

AGENTS = [
    AgentConfig(name="A", model="qwen3", parallel=ParallelConfig(tensor=2)),
    AgentConfig(name="B", model="llama", parallel=ParallelConfig(tensor=1)),
    AgentConfig(name="C", model="qwen2", parallel=ParallelConfig(data=2, first_rank=1)),
]


def main(out: Path) -> None:
    init_distributed()
    rank = dist.get_rank()
    start = time.time()
    agents = create_agent_groups(AGENTS)
    report = {"rank": rank, "group_creation_s": time.time() - start, "agents": {}}
    for config, parallel in zip(AGENTS, agents):
        if not parallel.is_member:
            continue
        info = {
            "tp_rank": parallel.tp_rank, "pp_rank": parallel.pp_rank, "dp_rank": parallel.dp_rank,
            "tp_group": dist.get_process_group_ranks(parallel.tp_group),
            "pp_group": dist.get_process_group_ranks(parallel.pp_group),
            "dp_group": dist.get_process_group_ranks(parallel.dp_group),
        }
        # A sum over the data-parallel group must see exactly this agent's replicas.
        value = torch.tensor([float(rank)], device=collective_device())
        dist.all_reduce(value, group=parallel.dp_group)
        info["dp_sum_of_ranks"] = value.item()

        hf = hf_model(config.model)
        agent = build_agent_model(TEST_CONFIGS[config.model], parallel, params_dtype=torch.float32)
        load_hf_state_dict_into_model(agent.model, hf.state_dict(), TEST_CONFIGS[config.model], parallel)
        mine = SEQUENCES[parallel.dp_rank::parallel.dp_size]  # each DP replica its share
        t0 = time.time()
        logprobs = compute_sequence_logprobs(agent, mine, temperature=TEMPERATURE, max_tokens_per_micro_batch=16)
        info["logprob_s"] = time.time() - t0
        reference = hf_token_logprobs(hf, mine)
        info["num_sequences"] = len(mine)
        info["max_diff_vs_hf"] = max(
            (logprobs.token_logprobs[i, : len(r)] - r).abs().max().item() for i, r in enumerate(reference))
        info["sums_diff"] = max(abs(logprobs.sums[i].item() - r.sum().item()) for i, r in enumerate(reference))
        info["lengths"] = logprobs.lengths.tolist()
        report["agents"][config.name] = info
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
