"""The routers' load-balancing loss at DP 2 is DP 1's (issue 52, item 3): one 2-rank world (gloo, CPU).

usage: torchrun --nproc_per_node 2 moe_router_worker.py OUT.pt

The same tiny random Qwen3-MoE weights at DP 1 (rank 0 alone) and DP 2 (ranks 0-1), each with moe.aux_loss_coeff
0.1 and 0: one GSPO update of 4 rows in micro-batches of 2 (DP 1: two micro-batches; DP 2: one on each replica, the
same two). Each replica weights its micro-batch by its share of every replica's router tokens, which it counts by
packing the other replica's rows itself, and the update's figures are sums over both. Rank 0 saves, per layout, the
routers' gradients with coefficient 0.1 minus those with 0 (the load-balancing loss's) and the update's figures.
"""
from __future__ import annotations

import sys
from typing import Dict, List

import torch

from hacpo_megatron.algorithms.registry import algorithm_spec
from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
from hacpo_megatron.config.schema import AgentConfig, AlgorithmConfig, MoEConfig, ParallelConfig
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
from hacpo_megatron.training.batch import SequenceRow
from hacpo_megatron.training.trainer import AgentTrainer
from tests.models.test_moe import VOCAB, random_hf_model, tiny_config
from tests.training.workers.trainer_config import trainer_config

COEFF = 0.1
LAYOUTS = {"dp1": ParallelConfig(data=1, first_rank=0), "dp2": ParallelConfig(data=2, first_rank=0)}


def rows_of(hf) -> List[SequenceRow]:
    """4 own rows, responses of 3, 5, 7 and 9 tokens, advantages +-1, old log-probs the model's (ratio 1)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, length in enumerate([3, 5, 7, 9]):
        prompt = torch.randint(2, VOCAB, (5,), generator=g).tolist()
        response = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
        old = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).mean()
        rows.append(SequenceRow(prompt_ids=prompt, response_ids=response, advantage=1.0 if i % 2 else -1.0,
                                old_seq_logp=float(old), is_cross=False, source=0, prompt_index=i))
    return rows


def run_layouts(layouts: Dict[str, ParallelConfig]) -> Dict[str, dict]:
    """Every layout this rank is a member of: {name: {"aux_gradients": [per layer], "figures": {...}}}."""
    groups = create_agent_groups([AgentConfig(name=n, model="x", parallel=p) for n, p in layouts.items()])
    hf_config = tiny_config().to_dict()
    hf = random_hf_model(tiny_config(), seed=7)
    state, rows = hf.state_dict(), rows_of(hf)
    report = {}
    for name, parallel in zip(layouts, groups):
        if not parallel.is_member:
            continue
        gradients, figures = {}, {}
        for coeff in (COEFF, 0.0):
            agent = build_agent_model(hf_config, parallel, seed=1, params_dtype=torch.float32)
            load_hf_state_dict_into_model(agent.model, state, hf_config, parallel)
            trainer = AgentTrainer(agent, algorithm_spec(AlgorithmConfig(name="gspo")),
                                   trainer_config(lr=1e-3, grad_clip=0.0, micro_batch_size=2),
                                   moe=MoEConfig(aux_loss_coeff=coeff))
            [figures[coeff]] = trainer.train_step([rows])
            gradients[coeff] = [layer.mlp.router.weight.main_grad.detach().double().clone()
                                for layer in trainer.ddp_model.module.decoder.layers]
        report[name] = {"aux_gradients": [a - b for a, b in zip(gradients[COEFF], gradients[0.0])],
                        "figures": figures[COEFF], "figures_without": figures[0.0]}
    return report


def main(out_path: str) -> None:
    init_distributed()
    torch.set_num_threads(1)
    report = run_layouts(LAYOUTS)
    if torch.distributed.get_rank() == 0:
        torch.save(report, out_path)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
