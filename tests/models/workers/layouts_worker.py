"""Same weights, three layouts, two ranks: TP=1 (rank 0), TP=2 (ranks 0-1), PP=2 (ranks 0-1).

For every test architecture: load one HF model's weights into each layout, compute response
log-probs (temperature 0.7, several micro-batches) and the gradients of their sum, export weights
and gradients back to HF names; the same for sequences whose responses share prompts, packed with
shared-prompt rows. Rank 0 saves everything, plus the HF references, to OUT/results.pt.

usage: torchrun --nproc_per_node 2 layouts_worker.py OUT
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from hacpo_megatron.checkpoint.hf_mapping import export_hf_state_dict, load_hf_state_dict_into_model
from hacpo_megatron.config.schema import AgentConfig, ParallelConfig
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.models.logprobs import compute_sequence_logprobs, make_forward_step, run_schedule
from hacpo_megatron.models.packing import (
    PackedBatch, micro_batch_indices, pack_sequences, packed_micro_batches, prompt_grouped,
)
from hacpo_megatron.parallel.groups import AgentParallel, create_agent_groups, init_distributed
from tests.models.workers.reference import (
    SEQUENCES, SHARED_PROMPT_SEQUENCES, TEMPERATURE, TEST_CONFIGS, hf_grads_of_logprob_sum, hf_model, hf_token_logprobs,
)

KERNELS = ("local", "sdpa", "flex")
# SHARED_PROMPT_SEQUENCES packed to 20 tokens: the 16-token document of one prompt, then two documents (11 + 5) in
# one row; SEQUENCES: rows of 7 + 3 + 7 and 8 + 7 tokens
PACKED_TOKENS = 20

LAYOUTS = [
    AgentConfig(name="tp1", parallel=ParallelConfig(tensor=1, first_rank=0)),
    AgentConfig(name="tp2", parallel=ParallelConfig(tensor=2, first_rank=0)),
    AgentConfig(name="pp2", parallel=ParallelConfig(pipeline=2, first_rank=0)),
]


def logprob_sum_grads(agent, sequences, *, share_prompts: bool = False, max_tokens: Optional[int] = None) -> None:
    """Backward of sum(response log-probs) through megatron's schedule, without DDP."""
    agent.config.calculate_per_token_loss = True  # megatron then leaves the loss unscaled

    def loss_fn(token_logprobs: torch.Tensor, mb: PackedBatch):
        return token_logprobs.sum(), torch.tensor(len(token_logprobs)), {}

    if max_tokens is not None:  # packed end to end to a token budget: rows of several documents
        micro_batches = packed_micro_batches(sequences, max_sequences=None, max_tokens=max_tokens,
                                             share_prompts=share_prompts)
    elif share_prompts:  # 5 sequences per micro-batch: rows of 4 and 1, then 2, 1 and 1 responses
        micro_batches = [pack_sequences(sequences, g, share_prompts=True) for g in prompt_grouped(sequences, 5)]
    else:
        micro_batches = [pack_sequences(sequences, g) for g in micro_batch_indices(
            [len(p) + len(r) for p, r in sequences], max_sequences=2)]
    agent.model.zero_grad()
    run_schedule(agent, micro_batches, make_forward_step(agent, temperature=TEMPERATURE, loss_fn=loss_fn),
                 forward_only=False)
    reduce_grads_like_finalize_model_grads(agent)


def kernel_checks(agent, sequences, shared_sequences, budget: int, export_grads) -> dict:
    """Per kernel of train.attention (models/attention.py): log-probs of plain rows, of shared-prompt rows, of
    sequences packed end to end to `budget` tokens with and without shared prompts, and the gradients of the packed
    shared rows' log-prob sum (not FlexAttention's: torch has no CPU backward for it)."""
    out = {}
    for kernel in KERNELS:
        timed = time.time()
        a = dataclasses.replace(agent, attention=kernel)
        entry = {
            "logprobs": compute_sequence_logprobs(a, sequences, temperature=TEMPERATURE,
                                                  max_sequences_per_micro_batch=2),
            "packed_logprobs": compute_sequence_logprobs(a, sequences, temperature=TEMPERATURE,
                                                         max_tokens_per_micro_batch=budget),
            "shared_logprobs": compute_sequence_logprobs(a, shared_sequences, temperature=TEMPERATURE,
                                                         max_sequences_per_micro_batch=5, share_prompts=True),
            "shared_packed_logprobs": compute_sequence_logprobs(a, shared_sequences, temperature=TEMPERATURE,
                                                                max_tokens_per_micro_batch=budget, share_prompts=True),
        }
        if kernel != "flex":
            logprob_sum_grads(a, shared_sequences, share_prompts=True, max_tokens=budget)
            entry["shared_packed_grads"] = export_grads()
        entry["seconds"] = time.time() - timed
        out[kernel] = entry
    return out


def reduce_grads_like_finalize_model_grads(agent) -> None:
    """What megatron's finalize_model_grads does for these models (training will use it with DDP):
    sum QK-norm grads over TP (each TP rank normalises only its heads) and the tied embedding's
    two copies over the embedding group (first and last pipeline stage)."""
    parallel: AgentParallel = agent.parallel
    for name, param in agent.model.named_parameters():
        if parallel.tp_size > 1 and ("q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(param.grad, group=parallel.tp_group)
    if agent.arch.tie_word_embeddings and parallel.pp_size > 1:
        weight = agent.model.shared_embedding_or_output_weight()
        dist.all_reduce(weight.grad, group=parallel.pg_collection.embd)


@torch.no_grad()
def single_stage_logits_diff(agent, hf) -> float:
    """max |megatron logits - HF logits| over the true vocabulary, one padded batch."""
    batch = pack_sequences(SEQUENCES, range(len(SEQUENCES)))
    agent.model.eval()
    device = next(agent.model.parameters()).device
    logits = agent.model(batch.tokens.to(device), batch.position_ids.to(device),
                         attention_mask=None)[..., : agent.vocab_size].cpu()
    reference = hf(batch.tokens).logits  # right padding: real positions see no padding in either
    real = torch.arange(batch.tokens.shape[1]) < torch.tensor([len(p) + len(r) for p, r in SEQUENCES])[:, None]
    return (logits - reference).abs()[real].max().item()


def main(out: Path) -> None:
    init_distributed()
    rank = dist.get_rank()
    layouts = create_agent_groups(LAYOUTS)
    results = {"timings": {}}
    for arch in TEST_CONFIGS:
        hf = hf_model(arch)  # same seed on every rank: identical weights
        hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        entry = {"hf_logprobs": [t.detach() for t in hf_token_logprobs(hf, SEQUENCES)],
                 "hf_grads": hf_grads_of_logprob_sum(hf, SEQUENCES), "hf_state": hf_state,
                 "hf_shared_logprobs": [t.detach() for t in hf_token_logprobs(hf, SHARED_PROMPT_SEQUENCES)],
                 "hf_shared_grads": hf_grads_of_logprob_sum(hf, SHARED_PROMPT_SEQUENCES)}
        for parallel in layouts:
            if not parallel.is_member:
                continue
            start = time.time()
            agent = build_agent_model(TEST_CONFIGS[arch], parallel, seed=1, params_dtype=torch.float32)
            load_hf_state_dict_into_model(agent.model, hf_state, TEST_CONFIGS[arch], parallel)
            logprobs = compute_sequence_logprobs(agent, SEQUENCES, temperature=TEMPERATURE,
                                                 max_sequences_per_micro_batch=2)
            exported = export_hf_state_dict(agent.model, TEST_CONFIGS[arch], parallel)
            if parallel.name == "tp1":
                entry["logits_max_diff"] = single_stage_logits_diff(agent, hf)
            logprob_sum_grads(agent, SEQUENCES)
            grads = export_hf_state_dict(agent.model, TEST_CONFIGS[arch], parallel, tensor_of=lambda p: p.grad)
            shared_logprobs = compute_sequence_logprobs(agent, SHARED_PROMPT_SEQUENCES, temperature=TEMPERATURE,
                                                        max_sequences_per_micro_batch=5, share_prompts=True)
            logprob_sum_grads(agent, SHARED_PROMPT_SEQUENCES, share_prompts=True)
            shared_grads = export_hf_state_dict(agent.model, TEST_CONFIGS[arch], parallel, tensor_of=lambda p: p.grad)
            kernels = kernel_checks(agent, SEQUENCES, SHARED_PROMPT_SEQUENCES, PACKED_TOKENS,
                                    lambda agent=agent, arch=arch, parallel=parallel: export_hf_state_dict(
                                        agent.model, TEST_CONFIGS[arch], parallel, tensor_of=lambda p: p.grad))
            # every rank of the agent has the log-probs; record rank 1's copy too for the test
            entry[parallel.name] = {"logprobs": logprobs, "exported": exported, "grads": grads,
                                    "shared_logprobs": shared_logprobs, "shared_grads": shared_grads,
                                    "kernels": kernels}
            if rank == 1:
                entry[parallel.name] = {"logprobs": logprobs, "shared_logprobs": shared_logprobs}
            results["timings"][f"{arch}/{parallel.name}"] = time.time() - start
        results[arch] = entry
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
