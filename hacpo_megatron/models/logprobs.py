"""Sequence log-probabilities of responses under one agent's (TP x PP x DP-split) megatron model.

The math (`token_logprobs_from_logits`) is separate from the plumbing:

    sequences (prompt ids, response ids)  ->  pack_sequences   ->  padded tokens [N, S] + masks
                                          ->  micro_batches    ->  bounded memory per forward
                                          ->  megatron's pipeline schedule (forward_step below)
                                          ->  last stage: vocab-parallel log-softmax at the targets
                                          ->  broadcast to every pipeline stage
                                          ->  SequenceLogProbs: per-token [N, T], sums, lengths

Sequences are right-padded. Under the causal mask a real token attends only to earlier positions,
which are all real, so padding never enters a real token's context and no extra mask is needed.

Temperature: rollout engines (vLLM, SGLang) sample from softmax(logits / T), so the log-probs of
those samples, old and new, are log_softmax(logits / T).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hacpo_megatron.models import cpu_compat
from hacpo_megatron.models.build import AgentModel

PromptResponse = Tuple[Sequence[int], Sequence[int]]  # (prompt token ids, response token ids)


# ------------------------------------------------------------------------------------------------
# The math
# ------------------------------------------------------------------------------------------------
def token_logprobs_from_logits(
    vocab_parallel_logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """log softmax(logits / T)[target] at every position, from this TP rank's slice of the vocabulary.

    `vocab_parallel_logits` [..., V_local] holds vocabulary rows [r * V_local, (r+1) * V_local) of
    TP rank r; the full-vocabulary logits are never gathered: megatron's
    `vocab_parallel_cross_entropy` all-reduces only the max and the sum of exponentials.
    Rows at or beyond `vocab_size` (megatron's padding) get -inf, so they take no probability mass.
    Differentiable (the same function serves the training loss).
    """
    cpu_compat.apply()
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = vocab_parallel_logits.float() / temperature  # a new tensor: megatron edits its input
    if vocab_size is not None:
        local_size = logits.shape[-1]
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        first_row = tp_rank * local_size
        if first_row + local_size > vocab_size:
            is_padding = torch.arange(first_row, first_row + local_size, device=logits.device) >= vocab_size
            logits = logits.masked_fill(is_padding, float("-inf"))
    if tp_group is None or tp_group.size() == 1:
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return -vocab_parallel_cross_entropy(logits, targets, tp_group=tp_group)


# ------------------------------------------------------------------------------------------------
# Packing: lists of token ids -> padded tensors
# ------------------------------------------------------------------------------------------------
@dataclass
class PackedBatch:
    """Right-padded sequences. Position t's logits predict `targets[:, t]` = tokens[:, t + 1]."""

    tokens: torch.Tensor  # [n, S] long, padded with `pad_id`
    position_ids: torch.Tensor  # [n, S]
    targets: torch.Tensor  # [n, S] next token (pad after the end)
    response_mask: torch.Tensor  # [n, S] bool: target is a response token
    prompt_lengths: torch.Tensor  # [n]
    response_lengths: torch.Tensor  # [n]
    indices: torch.Tensor  # [n] rows of the caller's batch these sequences are

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    def response_logprobs(self, position_logprobs: torch.Tensor, max_response_length: int) -> torch.Tensor:
        """[n, S] log-probs at positions -> [n, T] aligned with the response tokens (0 at padding)."""
        n = self.num_sequences
        out = position_logprobs.new_zeros(n, max_response_length)
        j = torch.arange(max_response_length, device=out.device).expand(n, -1)
        valid = j < self.response_lengths.unsqueeze(1)
        # response token j sits at position P + j and is predicted at position P + j - 1
        positions = (self.prompt_lengths.unsqueeze(1) - 1 + j).clamp(max=position_logprobs.shape[1] - 1)
        gathered = position_logprobs.gather(1, positions)
        return torch.where(valid, gathered, out)


def pack_sequences(sequences: Sequence[PromptResponse], indices: Sequence[int], pad_id: int = 0) -> PackedBatch:
    """Right-pad `sequences[i] for i in indices` into one batch."""
    rows = [list(sequences[i][0]) + list(sequences[i][1]) for i in indices]
    prompt_lengths = torch.tensor([len(sequences[i][0]) for i in indices])
    response_lengths = torch.tensor([len(sequences[i][1]) for i in indices])
    if (prompt_lengths < 1).any():
        raise ValueError("every sequence needs at least one prompt token (the first response token's context)")
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for n, row in enumerate(rows):
        tokens[n, : len(row)] = torch.tensor(row, dtype=torch.long)
    targets = torch.full_like(tokens, pad_id)
    targets[:, :-1] = tokens[:, 1:]
    t = torch.arange(width).expand(len(rows), -1)
    target_position = t + 1
    response_mask = (target_position >= prompt_lengths.unsqueeze(1)) & (
        target_position < (prompt_lengths + response_lengths).unsqueeze(1)
    )
    return PackedBatch(
        tokens=tokens, position_ids=t.clone(), targets=targets, response_mask=response_mask,
        prompt_lengths=prompt_lengths, response_lengths=response_lengths,
        indices=torch.tensor(list(indices), dtype=torch.long),
    )


def micro_batch_indices(
    lengths: Sequence[int], *, max_sequences: Optional[int] = None, max_tokens: Optional[int] = None
) -> List[List[int]]:
    """Group sequence indices into micro-batches of <= max_sequences rows and <= max_tokens padded tokens.

    Longest first, so sequences of similar length share a micro-batch (less padding). A sequence
    longer than `max_tokens` gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: List[List[int]] = []
    for i in order:
        if groups:
            current = groups[-1]
            rows = len(current) + 1
            padded = rows * lengths[current[0]]  # current[0] is the longest of the group
            if (max_sequences is None or rows <= max_sequences) and (max_tokens is None or padded <= max_tokens):
                current.append(i)
                continue
        groups.append([i])
    return groups


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------
@dataclass
class SequenceLogProbs:
    """Log-probs of each response token, in the caller's order."""

    token_logprobs: torch.Tensor  # [N, T] fp32, 0 where response_mask is False
    response_mask: torch.Tensor  # [N, T] bool
    sums: torch.Tensor  # [N] sum over the response tokens
    lengths: torch.Tensor  # [N] number of response tokens (L in the paper)

    @staticmethod
    def from_token_logprobs(token_logprobs: torch.Tensor, lengths: torch.Tensor) -> "SequenceLogProbs":
        mask = torch.arange(token_logprobs.shape[1]).expand(len(lengths), -1) < lengths.unsqueeze(1)
        token_logprobs = token_logprobs * mask
        return SequenceLogProbs(token_logprobs, mask, token_logprobs.sum(dim=1), lengths.clone())


# ------------------------------------------------------------------------------------------------
# Plumbing: megatron's schedule
# ------------------------------------------------------------------------------------------------
# A loss on one micro-batch: (per-position log-probs [n, S], the micro-batch) -> what megatron's
# loss_func returns: (loss, num_tokens, metrics) or (loss, metrics). None: inference only.
MicroBatchLoss = Callable[[torch.Tensor, PackedBatch], Tuple[Any, ...]]


def make_forward_step(agent: AgentModel, *, temperature: float = 1.0,
                      loss_fn: Optional[MicroBatchLoss] = None) -> Callable[..., Any]:
    """The `forward_step_func` megatron's schedules call once per micro-batch.

    On the last stage the logits become per-position log-probs; with `loss_fn` those feed the loss
    (training), without it they are returned as the micro-batch's result (inference).
    """
    tp_group = agent.parallel.tp_group

    def loss_func(micro_batch: PackedBatch, response_logits: torch.Tensor) -> Tuple[Any, ...]:
        # response_logits [T, 1, V/TP]: only the positions that predict a response token
        mask = micro_batch.response_mask.to(response_logits.device)
        response_logprobs = token_logprobs_from_logits(
            response_logits[:, 0], micro_batch.targets.to(response_logits.device)[mask], temperature=temperature,
            vocab_size=agent.vocab_size, tp_group=tp_group,
        )
        position_logprobs = torch.zeros(mask.shape, dtype=response_logprobs.dtype,
                                        device=mask.device).masked_scatter(mask, response_logprobs)
        if loss_fn is not None:
            return loss_fn(position_logprobs, micro_batch)
        zero = torch.zeros((), device=response_logits.device)
        return zero, {"position_logprobs": position_logprobs.detach(), "micro_batch": micro_batch}

    def forward_step(data_iterator: Iterator[PackedBatch], model: Any) -> Tuple[torch.Tensor, Callable]:
        micro_batch = next(data_iterator)
        device = _model_device(model)
        output = model(micro_batch.tokens.to(device), micro_batch.position_ids.to(device), attention_mask=None,
                       output_processor=_response_positions_logits,
                       output_processor_context=micro_batch.response_mask.to(device))
        return output, partial(loss_func, micro_batch)

    return forward_step


def _response_positions_logits(*, hidden_states: torch.Tensor, output_layer: Any, output_weight: Any,
                               context: torch.Tensor, **_unused: Any) -> torch.Tensor:
    """GPTModel's output hook: logits only where a response token is predicted.

    The output layer (hidden x vocabulary) is most of a small model's cost, and prompts are most of
    an RL sequence; computing it for the response positions alone is exact and several times cheaper.
    hidden_states [S, n, h] -> [T, 1, V/TP], T = number of True entries of `context` ([n, S]).
    """
    selected = hidden_states.transpose(0, 1)[context].unsqueeze(1)
    logits, _ = output_layer(selected, weight=output_weight, runtime_gather_output=False)
    return logits


def run_schedule(agent: AgentModel, micro_batches: List[PackedBatch], forward_step: Callable[..., Any],
                 *, forward_only: bool) -> List[Any]:
    """Run megatron's pipeline schedule over `micro_batches`; the loss_func results on the last stage."""
    cpu_compat.apply()
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    parallel = agent.parallel
    schedule = get_forward_backward_func(pp_size=parallel.pp_size, vp_size=None)
    return schedule(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[agent.model],
        num_microbatches=len(micro_batches),
        # Shapes are exchanged per micro-batch (config.variable_seq_lengths); these are only hints.
        seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
        micro_batch_size=max(mb.num_sequences for mb in micro_batches),
        forward_only=forward_only,
        p2p_communicator=P2PCommunicator(pp_group=parallel.pp_group, config=agent.config),
        pg_collection=parallel.pg_collection,
    )


@torch.no_grad()
def compute_sequence_logprobs(
    agent: AgentModel,
    sequences: Sequence[PromptResponse],
    *,
    temperature: float = 1.0,
    max_sequences_per_micro_batch: Optional[int] = 8,
    max_tokens_per_micro_batch: Optional[int] = None,
    pad_id: int = 0,
) -> SequenceLogProbs:
    """Per-token log-probs of every response under `agent`, on every rank of its model replica.

    Collective over the agent's TP x PP ranks holding this data-parallel replica; each DP replica
    passes its own sequences. Runs in eval mode (no dropout).
    """
    if not sequences:
        empty = torch.zeros(0, 0)
        return SequenceLogProbs(empty, empty.bool(), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    micro_batches = [
        pack_sequences(sequences, group, pad_id)
        for group in micro_batch_indices([len(p) + len(r) for p, r in sequences],
                                         max_sequences=max_sequences_per_micro_batch,
                                         max_tokens=max_tokens_per_micro_batch)
    ]
    lengths = torch.tensor([len(r) for _, r in sequences], dtype=torch.long)
    max_response = max(1, int(lengths.max()))
    was_training = agent.model.training
    agent.model.eval()
    try:
        results = run_schedule(agent, micro_batches, make_forward_step(agent, temperature=temperature),
                               forward_only=True)
    finally:
        agent.model.train(was_training)

    token_logprobs = torch.zeros(len(sequences), max_response, dtype=torch.float32)
    if agent.parallel.is_last_stage:
        for result in results:
            mb: PackedBatch = result["micro_batch"]
            token_logprobs[mb.indices] = mb.response_logprobs(result["position_logprobs"].cpu(), max_response)
    token_logprobs = _from_last_stage(token_logprobs, agent)
    return SequenceLogProbs.from_token_logprobs(token_logprobs, lengths)


def _from_last_stage(tensor: torch.Tensor, agent: AgentModel) -> torch.Tensor:
    """Broadcast the last stage's tensor over the pipeline (its TP ranks already agree)."""
    parallel = agent.parallel
    if parallel.pp_size == 1:
        return tensor
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    buffer = tensor.to(device)
    dist.broadcast(buffer, group=parallel.pp_group, group_src=parallel.pp_size - 1)
    return buffer.cpu()


def _model_device(model: Any) -> torch.device:
    return next(model.parameters()).device
