"""A learner's share of the HACPO batch: rows, mini-batches, data-parallel shards, micro-batches.

One step gives learner k a row for every response it trains on: its own G responses per prompt and,
when rollouts are shared, every other agent's responses retokenized into k's tokens. A row carries
what the loss needs: the effective advantage (omega already applied) and the old sequence log-prob
(k's own old policy for own rows; the source agent's sum / L_j for other agents' rows).

Mini-batch m holds every row of a contiguous block of prompts, so own and other agents' answers to
the same prompt are updated together (as in the authors' verl code, where a mini-batch is a set of
prompts with all their responses). Pure Python; no processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence


@dataclass
class SequenceRow:
    prompt_ids: List[int]  # the prompt in the learner's chat template and tokens
    response_ids: List[int]  # the response in the learner's tokens (L_k of them)
    advantage: float  # effective advantage for this learner
    old_seq_logp: float  # old mean log-prob per token the ratio is taken against
    is_cross: bool  # produced by another agent
    source: int  # index of the agent that generated the response
    prompt_index: int  # b: the prompt within the step's batch
    old_token_logp: Optional[List[float]] = None  # own rows only: per-token old log-probs (GRPO)
    ref_token_logp: Optional[List[float]] = None  # own rows only: reference policy log-probs (KL penalty)

    def __post_init__(self):
        if not self.response_ids:
            raise ValueError(f"empty response for prompt {self.prompt_index} from agent {self.source}")
        if self.old_token_logp is not None and len(self.old_token_logp) != len(self.response_ids):
            raise ValueError("old_token_logp must have one entry per response token")


def mini_batches(rows: Sequence[SequenceRow], num_prompts: int, prompts_per_mini_batch: int) -> List[List[SequenceRow]]:
    """Split the rows into M = num_prompts / prompts_per_mini_batch mini-batches by prompt block."""
    if prompts_per_mini_batch < 1 or num_prompts % prompts_per_mini_batch:
        raise ValueError(f"{prompts_per_mini_batch} prompts per mini-batch must divide the {num_prompts} prompts")
    batches: List[List[SequenceRow]] = [[] for _ in range(num_prompts // prompts_per_mini_batch)]
    for row in rows:
        if not 0 <= row.prompt_index < num_prompts:
            raise ValueError(f"row prompt_index {row.prompt_index} outside [0, {num_prompts})")
        batches[row.prompt_index // prompts_per_mini_batch].append(row)
    return batches


def data_parallel_shard(rows: Sequence[SequenceRow], dp_rank: int, dp_size: int) -> List[SequenceRow]:
    """This data-parallel rank's rows: a contiguous, nearly equal share (sizes differ by at most one).

    The loss divides by the mini-batch's global row count, so unequal shares stay exact.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
    base, extra = divmod(len(rows), dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return list(rows[start:start + base + (1 if dp_rank < extra else 0)])


def micro_batches(rows: Sequence[SequenceRow], micro_batch_size: int) -> List[List[SequenceRow]]:
    """Consecutive chunks of at most micro_batch_size rows (the last may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(rows[i:i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
