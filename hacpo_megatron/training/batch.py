"""A learner's share of the HACPO batch: rows, mini-batches, data-parallel shards, micro-batches.

One step gives learner k a row for every response it trains on: its own G responses per prompt and,
when rollouts are shared, every other agent's responses retokenized into k's tokens. A row carries
what the loss needs: the effective advantage (omega already applied) and the old sequence log-prob
(k's own old policy for own rows; the source agent's sum / L_j for other agents' rows).

Updates per step (`UpdateSchedule`): `train.mini_batch_size` means what it means in verl and in the
paper, prompts x G responses per update, for every algorithm ("a consistent number of rollouts per
update"). A learner that trains on S sources' responses (S = n for HACPO/Naive, 1 for GSPO/GRPO) at
G' samples per prompt (2G for GSPO x2) has S * B * G' rows, so it makes
M = S * B * G' / (mini_batch_size * G) updates: paper 2 * 128 * 8 / (64 * 8) = 4 for HACPO and Naive,
4 for GSPO x2, 2 for GSPO. Rows are laid out prompt by prompt, within a prompt sample by sample with
the sources interleaved, and cut into M equal blocks of that grid: every update holds own and other
agents' answers to the same prompts. A row's block is fixed by its place in the grid, so a bridged
answer that was dropped makes its update one row shorter and never moves another row.
Pure Python; no processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


@dataclass
class SequenceRow:
    prompt_ids: List[int]  # the prompt in the learner's chat template and tokens
    response_ids: List[int]  # the response in the learner's tokens (L_k of them)
    advantage: float  # effective advantage for this learner
    old_seq_logp: float  # old mean log-prob per token the ratio is taken against
    is_cross: bool  # produced by another agent
    source: int  # index of the agent that generated the response
    prompt_index: int  # b: the prompt within the step's batch
    sample_index: int = 0  # i: the sample of the source agent for that prompt
    old_token_logp: Optional[List[float]] = None  # own rows only: per-token old log-probs (GRPO)
    ref_token_logp: Optional[List[float]] = None  # own rows only: reference policy log-probs (KL penalty)

    def __post_init__(self):
        if not self.response_ids:
            raise ValueError(f"empty response for prompt {self.prompt_index} from agent {self.source}")
        if self.old_token_logp is not None and len(self.old_token_logp) != len(self.response_ids):
            raise ValueError("old_token_logp must have one entry per response token")


@dataclass(frozen=True)
class UpdateSchedule:
    """How one learner's rows of a step split into its M mini-batch updates (module docstring)."""

    num_prompts: int  # B
    answers_per_prompt: int  # G': responses per prompt of each source (2G for GSPO x2)
    sources: Tuple[int, ...]  # the agents whose responses the learner trains on, own included
    rows_per_update: int  # train.mini_batch_size * G (G: rollout.samples_per_prompt)

    def __post_init__(self):
        grid = len(self.sources) * self.num_prompts * self.answers_per_prompt
        if self.rows_per_update < 1 or not self.sources or grid % self.rows_per_update:
            raise ValueError(f"{self.rows_per_update} rows per update must divide the learner's {grid} rows "
                             f"({len(self.sources)} sources x {self.num_prompts} prompts x {self.answers_per_prompt})")

    @property
    def num_updates(self) -> int:
        return len(self.sources) * self.num_prompts * self.answers_per_prompt // self.rows_per_update

    def slot(self, row: "SequenceRow") -> int:
        """The row's place in the (prompt, sample, source) grid."""
        if not 0 <= row.prompt_index < self.num_prompts or not 0 <= row.sample_index < self.answers_per_prompt:
            raise ValueError(f"row (prompt {row.prompt_index}, sample {row.sample_index}) outside the step's "
                             f"{self.num_prompts} prompts x {self.answers_per_prompt} samples")
        if row.source not in self.sources:
            raise ValueError(f"row from agent {row.source}, not among the learner's sources {list(self.sources)}")
        position = self.sources.index(row.source)
        return (row.prompt_index * self.answers_per_prompt + row.sample_index) * len(self.sources) + position


def mini_batches(rows: Sequence[SequenceRow], schedule: UpdateSchedule) -> List[List[SequenceRow]]:
    """The M mini-batches of `schedule`, each in grid order (own and other agents' rows interleaved)."""
    ordered = sorted(rows, key=schedule.slot)
    batches: List[List[SequenceRow]] = [[] for _ in range(schedule.num_updates)]
    for row in ordered:
        batches[schedule.slot(row) // schedule.rows_per_update].append(row)
    return batches


def rows_with_gradient(rows: Sequence[SequenceRow], *, kl_coef: float) -> List[SequenceRow]:
    """The rows an update must run forward and backward: every policy loss here is the advantage times a
    ratio term, so a row whose advantage is 0 adds exactly nothing to the gradient, unless the KL penalty
    covers it (own rows when kl_coef > 0). The mini-batch means still divide by all rows."""
    return [r for r in rows if r.advantage != 0 or (kl_coef > 0 and not r.is_cross)]


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
