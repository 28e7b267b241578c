"""The data of one HACPO step across agents, as plain Python: rollouts -> rewards -> learner rows.

    rollouts[j][b][i]   agent j's i-th completion of prompt b (rollout.base.Completion)
    rewards  [n, B, G]  one score per completion
    OldLogProbs[j]      the source trainer's log-probs of its own completions (sum, length, per token)
    learner_rows(k)     learner k's SequenceRows: own completions + bridged ones of the other agents

And the run's prompt sets, overlong prompts left out (`load_prompt_sets`). No collectives here: the loop
(training/loop.py) moves these objects between ranks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hacpo_megatron.algorithms.staleness import DEFAULT_BEHAVIOUR_WEIGHT_CAP, behaviour_weights
from hacpo_megatron.bridge import bridge_responses, render_prompt
from hacpo_megatron.config.schema import DataConfig
from hacpo_megatron.data import load_prompts
from hacpo_megatron.data.records import PromptRecord
from hacpo_megatron.rollout.base import Completion
from hacpo_megatron.training.batch import SequenceRow

Rollouts = List[List[List[Completion]]]  # [agent][prompt][sample]


@dataclass
class OldLogProbs:
    """One agent's old log-probs of its own completions, flattened in (prompt, sample) order."""

    sums: List[float]
    lengths: List[int]
    tokens: List[List[float]]  # per token, for GRPO's token-level ratio

    def mean(self, index: int) -> float:
        return self.sums[index] / self.lengths[index]


def engine_old_logprobs(completions: Sequence[Sequence[Completion]]) -> OldLogProbs:
    """The engine's own log-probs of one agent's completions ([prompt][sample]) as its old log-probs."""
    tokens = [list(c.logprobs) for group in completions for c in group]
    return OldLogProbs(sums=[sum(t) for t in tokens], lengths=[len(t) for t in tokens], tokens=tokens)


def check_engine_logprobs(gaps: Dict[str, Dict[str, float]], *, clip: float) -> None:
    """Refuse the engine's log-probs as old log-probs unless they move a sequence's mean log-prob (GSPO's
    ratio) by under a tenth of the clip range: `gaps` is {agent: its rollout/logprob_diff_* figures}."""
    bound = 0.1 * clip
    for name, gap in gaps.items():
        if gap["rollout/logprob_diff_mean"] > bound:
            raise RuntimeError(
                f"rollout.old_logprobs=engine: agent {name}'s engine log-probs differ from its trainer's by "
                f"{gap['rollout/logprob_diff_mean']:.2e} per token on average (max "
                f"{gap['rollout/logprob_diff_max']:.2e}), above {bound:.1e} (a tenth of the clip range); "
                f"use rollout.old_logprobs=trainer")


def rewards_tensor(scores: Sequence[float], n: int, B: int, G: int) -> torch.Tensor:
    if len(scores) != n * B * G:
        raise ValueError(f"expected {n * B * G} scores (n={n}, B={B}, G={G}), got {len(scores)}")
    return torch.tensor(list(scores), dtype=torch.float64).reshape(n, B, G)


def own_sequences(prompt_ids: Sequence[List[int]],
                  completions: List[List[Completion]]) -> List[Tuple[List[int], List[int]]]:
    """(prompt ids, response ids) of one agent's completions in (prompt, sample) order."""
    return [(prompt_ids[b], c.token_ids) for b, group in enumerate(completions) for c in group]


def rollout_stats(completions: List[List[Completion]]) -> Dict[str, float]:
    flat = [c for group in completions for c in group]
    return {
        "response_length_mean": sum(len(c.token_ids) for c in flat) / len(flat),
        "truncated_frac": sum(c.truncated for c in flat) / len(flat),
    }


def learner_rows(
    k: int,
    *,
    prompts: Sequence[PromptRecord],
    rollouts: Rollouts,
    old: Sequence[OldLogProbs],
    effective: torch.Tensor,
    trains_on: torch.Tensor,
    tokenizers: Sequence,
    prompt_ids: Sequence[Sequence[List[int]]],
    ref_token_logp: Optional[Sequence[List[float]]] = None,
    behaviour: Optional[Sequence[OldLogProbs]] = None,
) -> Tuple[List[SequenceRow], Dict[str, float]]:
    """Learner k's rows for the step, and how many bridged responses were dropped (empty for k).

    Own rows keep the sampled ids, the learner's own old mean log-prob and per-token log-probs.
    Other agents' rows are bridged into k's tokens and carry the source's sum / L_j.

    `behaviour` (rollout.max_staleness >= 1: every agent's engine log-probs, from the weights that generated the
    answers): `old` is then the proximal policy (the trainer's pass at this step's weights) of own rows, whose
    advantages carry the behaviour weight (algorithms/staleness.py), and other agents' rows divide by their
    engine's log-probs instead of their trainer's present ones (docs/algorithm.md, "Answers from older weights").
    """
    n, B, G = effective.shape[1], len(prompts), len(rollouts[0][0])
    rows: List[SequenceRow] = []
    dropped = 0
    stats: Dict[str, float] = {}
    weights = None
    if behaviour is not None and trains_on[k, k]:
        weights = behaviour_weights(torch.tensor(old[k].sums, dtype=torch.float64),
                                    torch.tensor(behaviour[k].sums, dtype=torch.float64),
                                    torch.tensor(old[k].lengths))
        stats = {"staleness/behaviour_weight_mean": float(weights.mean()),
                 "staleness/behaviour_weight_capped_frac":
                     float((weights >= DEFAULT_BEHAVIOUR_WEIGHT_CAP).double().mean())}
    source_sums = [(behaviour if behaviour is not None else old)[j].sums for j in range(n)]
    for j in range(n):
        if not trains_on[k, j]:
            continue
        if j == k:
            for b in range(B):
                for i, completion in enumerate(rollouts[k][b]):
                    index = b * G + i
                    rows.append(SequenceRow(
                        prompt_ids=prompt_ids[k][b], response_ids=completion.token_ids,
                        advantage=float(effective[k, k, b, i])
                        * (float(weights[index]) if weights is not None else 1.0),
                        old_seq_logp=old[k].mean(index), is_cross=False,
                        source=k, prompt_index=b, sample_index=i, old_token_logp=old[k].tokens[index],
                        ref_token_logp=ref_token_logp[index] if ref_token_logp is not None else None))
            continue
        flat = [c for group in rollouts[j] for c in group]
        bridged = bridge_responses(
            tokenizers[j], tokenizers[k], [c.token_ids for c in flat],
            prompts_messages=[prompts[b].messages for b in range(B) for _ in range(G)],
            source_logprob_sums=source_sums[j], finish_reasons=[c.finish_reason for c in flat])
        for index, response in enumerate(bridged):
            b, i = divmod(index, G)
            if response.learner_length == 0:  # control tokens only: nothing for k to learn from
                dropped += 1
                continue
            rows.append(SequenceRow(
                prompt_ids=response.prompt_ids, response_ids=response.response_ids,
                advantage=float(effective[k, j, b, i]), old_seq_logp=response.old_seq_logp, is_cross=True,
                source=j, prompt_index=b, sample_index=i))
    return rows, {"bridge/dropped": float(dropped), **stats}


def with_learner_old_logprobs(rows: Sequence[SequenceRow],
                              cross_token_logp: Sequence[List[float]]) -> List[SequenceRow]:
    """Other agents' rows re-based on the learner's own old policy (Naive's reading, see the algorithm
    registry): `cross_token_logp` holds the learner's per-token log-probs of its cross rows, in order."""
    cross = [r for r in rows if r.is_cross]
    if len(cross) != len(cross_token_logp):
        raise ValueError(f"{len(cross_token_logp)} log-prob lists for {len(cross)} rows of other agents")
    means = iter(sum(t) / len(t) for t in cross_token_logp)
    return [dataclasses.replace(r, old_seq_logp=next(means)) if r.is_cross else r for r in rows]


def drop_overlong_prompts(prompts: Sequence[PromptRecord], tokenizers: Sequence, max_length: int
                          ) -> Tuple[List[PromptRecord], int]:
    """The prompts whose chat-rendered length is at most `max_length` tokens for every agent, and how
    many were left out (as verl's `filter_overlong_prompts` does: a prompt is never cut short)."""
    kept = [p for p in prompts if all(len(render_prompt(tok, p.messages)) <= max_length for tok in tokenizers)]
    return kept, len(prompts) - len(kept)


def load_prompt_sets(data: DataConfig, max_prompt_length: int, tokenizers: Sequence,
                     output_dir: str) -> Tuple[List[PromptRecord], List[PromptRecord]]:
    """Training and held-out prompts (the config's `data:`); those longer than `max_prompt_length`
    (rollout.max_prompt_length) for any agent are left out and counted (the log, run_info.json and the summary
    say how many)."""
    splits = {"train": load_prompts(data.train, "train"),
              "eval": load_prompts(data.eval, "eval")[: data.eval_max_prompts] if data.eval else []}
    skipped = {}
    for split, prompts in splits.items():
        splits[split], skipped[split] = drop_overlong_prompts(prompts, tokenizers, max_prompt_length)
        if prompts and not splits[split]:
            raise SystemExit(f"all {len(prompts)} {split} prompts of {getattr(data, split)} are longer than "
                             f"rollout.max_prompt_length={max_prompt_length} tokens")
    if dist.get_rank() == 0:
        if any(skipped.values()):
            print(f"skipped prompts longer than rollout.max_prompt_length={max_prompt_length} tokens: "
                  f"{skipped['train']} of {data.train}, {skipped['eval']} of {data.eval}", flush=True)
        from hacpo_megatron.reporting import update_run_info

        update_run_info(output_dir, {"prompts": {
            split: {"used": len(splits[split]), "skipped_overlong": skipped[split]} for split in splits}})
    return splits["train"], splits["eval"]
