"""Weight sync from a Megatron agent (TP=2, then PP=2, on ranks 0-1) into an embedded engine.

For each layout: a randomly initialised Megatron Qwen3-style agent, and on its engine rank an
embedded engine built from the same HF config with DIFFERENT random weights. Sync in small buckets
with the check mode, compare generation with a transformers model loaded with the exported HF state
dict, then change the trainer's weights ("a training step") and sync again. Each rank saves its
facts to OUT/rank{r}.pt.

usage: torchrun --nproc_per_node 2 weight_sync_worker.py OUT
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from hacpo_megatron.checkpoint.hf_mapping import export_hf_state_dict
from hacpo_megatron.config.schema import AgentConfig, ParallelConfig
from hacpo_megatron.models.architectures import normalized_hf_config
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
from hacpo_megatron.rollout.base import EngineLost, SamplingParams
from hacpo_megatron.rollout.embedded import EmbeddedEngine
from hacpo_megatron.rollout.weight_sync import check_engine_weights, engine_rank, sync_weights
from tests.models.workers.reference import TEST_CONFIGS

HF_CONFIG = TEST_CONFIGS["qwen3"]  # tied embeddings, QK-norm, GQA; vocabulary 1000 (padded to 1024)
# the embedding alone (1000 x hidden fp32) is bigger than a bucket; the rest needs several buckets
BUCKET_BYTES = 100 * 1024
LAYOUTS = [
    AgentConfig(name="tp2", parallel=ParallelConfig(tensor=2, first_rank=0)),
    AgentConfig(name="pp2", parallel=ParallelConfig(pipeline=2, first_rank=0)),
]
PROMPTS = [[11, 12, 13], [999, 5, 6, 7, 8]]
PARAMS = SamplingParams(n=2, temperature=0.7, max_new_tokens=8, seed=3)


class TokenIdsAsText:
    """The engine decodes responses; these tests need token ids only."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def hf_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(normalized_hf_config(HF_CONFIG), dtype=torch.float32).eval()


def embedded_engine(model: torch.nn.Module) -> EmbeddedEngine:
    return EmbeddedEngine(model, TokenIdsAsText(), eos_token_ids=[HF_CONFIG["eos_token_id"]],
                          pad_token_id=HF_CONFIG["eos_token_id"])


def generation(engine: EmbeddedEngine):
    out = engine.generate(PROMPTS, PARAMS)
    return [[c.token_ids for c in group] for group in out], [[c.logprobs for c in group] for group in out]


@torch.no_grad()
def one_training_step(model: torch.nn.Module) -> None:
    """Stand-in for an optimizer step: every parameter changes (same change on every TP rank)."""
    generator = torch.Generator().manual_seed(5)
    for _, param in sorted(model.named_parameters()):
        param.add_(0.01 * torch.randn(param.shape, generator=generator))


def run_layout(parallel) -> dict:
    agent = build_agent_model(HF_CONFIG, parallel, seed=1)
    mine = dist.get_rank() == engine_rank(parallel)
    engine = embedded_engine(hf_model(seed=7)) if mine else None  # weights unlike the trainer's
    facts = {"engine_rank": engine_rank(parallel)}

    before, _ = check_engine_weights(agent.model, HF_CONFIG, parallel, engine)
    metrics = sync_weights(agent.model, HF_CONFIG, parallel, engine, bucket_bytes=BUCKET_BYTES, check=True)
    exported = export_hf_state_dict(agent.model, HF_CONFIG, parallel, dst_rank=engine_rank(parallel))
    facts["metrics"] = metrics
    if mine:
        facts["check_before"] = before
        reference = hf_model(seed=0)
        result = reference.load_state_dict(exported, strict=False)
        facts["reference_missing_keys"] = list(result.missing_keys)  # only the tied lm_head
        facts["engine_generation"] = generation(engine)
        facts["reference_generation"] = generation(embedded_engine(reference))
        facts["model_bytes"] = sum(t.numel() * t.element_size() for t in exported.values())

    one_training_step(agent.model)
    facts["metrics_after_step"] = sync_weights(agent.model, HF_CONFIG, parallel, engine,
                                               bucket_bytes=BUCKET_BYTES, check=True)

    # the engine's process dies at the third bucket: the sync must end on every rank, and the next one
    # (to the engine "restarted") must deliver everything, the gathers and sends still in step
    one_training_step(agent.model)
    dying = DiesAtBucket(engine, 3) if mine else None
    facts["metrics_engine_lost"] = sync_weights(agent.model, HF_CONFIG, parallel, dying, bucket_bytes=BUCKET_BYTES,
                                                check=True)
    facts["metrics_resent"] = sync_weights(agent.model, HF_CONFIG, parallel, engine, bucket_bytes=BUCKET_BYTES,
                                           check=True)
    return facts


class DiesAtBucket:
    """An engine proxy whose engine process dies at bucket `n` (1-based): the proxy raises EngineLost
    from then on, as orchestrator/actors.py's does for a dead actor."""

    def __init__(self, engine, n: int):
        self.engine, self.n, self.seen = engine, n, 0

    def begin_weight_update(self):
        self.engine.begin_weight_update()

    def update_weights(self, bucket):
        self.seen += 1
        if self.seen >= self.n:
            raise EngineLost("the engine died (test)")
        self.engine.update_weights(bucket)

    def finish_weight_update(self):
        raise AssertionError("finish_weight_update called after the engine was lost")

    def check_weights(self, named_tensors, atol=0.0):
        raise AssertionError("check_weights called after the engine was lost")


def main(out: Path) -> None:
    init_distributed()
    layouts = create_agent_groups(LAYOUTS)
    results = {parallel.name: run_layout(parallel) for parallel in layouts}
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
