"""Sequence log-probabilities of responses under one agent's (TP x PP x DP-split) megatron model.

The math (`token_logprobs_from_logits`) is separate from the plumbing:

    sequences (prompt ids, response ids)  ->  micro-batches    ->  bounded memory per forward
                                          ->  pack_sequences   ->  rows of documents (a prompt, its responses)
                                          ->  megatron's pipeline schedule (forward_step below)
                                          ->  last stage: vocab-parallel log-softmax at the response tokens
                                          ->  broadcast to every pipeline stage
                                          ->  SequenceLogProbs: per-token [N, T], sums, lengths

The micro-batches and their rows (PackedBatch: padding, shared prompts, packing to a token budget) are
models/packing.py's.

Temperature: rollout engines (vLLM, SGLang) sample from softmax(logits / T), so the log-probs of
those samples, old and new, are log_softmax(logits / T).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hacpo_megatron import megatron_cpu
from hacpo_megatron.models.attention import attention_over
from hacpo_megatron.models.build import AgentModel
from hacpo_megatron.models.packing import PackedBatch, PromptResponse, filler_micro_batch, packed_micro_batches
from hacpo_megatron.parallel.groups import collective_device


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
    megatron_cpu.apply()
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = vocab_parallel_logits
    if vocab_size is not None:
        local_size = logits.shape[-1]
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        first_row = tp_rank * local_size
        if first_row + local_size > vocab_size:
            is_padding = torch.arange(first_row, first_row + local_size, device=logits.device) >= vocab_size
            logits = logits.masked_fill(is_padding, float("-inf"))
    if tp_group is None or tp_group.size() == 1:
        rows = TargetLogProb.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), temperature)
        return rows.view(targets.shape)
    logits = logits.float() / temperature  # a new tensor: megatron edits its input
    return -vocab_parallel_cross_entropy(logits, targets, tp_group=tp_group)


CHUNK_ELEMENTS = 1 << 20  # fp32 logits per chunk on a CPU (4 MB): a chunk's temporaries stay in its cache
# On a GPU a chunk costs kernel launches (about six per chunk and pass), not cache misses: with 4 MB chunks
# Qwen3's 150k-word vocabulary made a micro-batch 512 chunks, and its log-prob pass on an H200 took 2.5x the wall
# time of transformers' for the same GPU time (the CPU launching, docs/gpu.md). 256 MB of fp32 a chunk there.
ACCELERATOR_CHUNK_ELEMENTS = 1 << 26


def chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows of [N, vocab] logits that TargetLogProb turns to fp32 at once on this device."""
    elements = CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    return max(1, elements // vocab)


class TargetLogProb(torch.autograd.Function):
    """log softmax(logits / T)[target] of each row of [N, V] logits, with no [N, V] temporary beyond one buffer.

    Composed (divide, log_softmax, gather), every step writes an [N, V] tensor, and so does every step of
    the backward (gather's zeros, log_softmax's and the divide's gradients): with a 150k-word vocabulary
    those memory passes cost more than the output layer's matmul. Both paths give
    d/dlogits = (onehot(target) - softmax(logits / T)) * grad / T, a chunk of rows at a time:

    - fp32 (or fp64) logits: the forward keeps logits / T and each row's log-sum-exp, and the backward turns that
      buffer into the gradient in place.
    - bf16 / fp16 logits (a GPU's): no fp32 copy of the [N, V] logits at all (it would be twice their size). The
      forward reads them a chunk at a time in fp32 for the log-sum-exp and keeps the logits themselves (alive
      anyway until the output layer's backward); the backward writes the gradient in their dtype, each chunk
      computed in fp32.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits: fp32 log-probs, as before
        rows = chunk_rows(logits.shape[-1], logits.device)
        ctx.rows, ctx.temperature = rows, temperature
        if logits.dtype == dtype:
            scaled = logits.div(temperature)
            log_sum_exp = torch.cat([torch.logsumexp(chunk, dim=-1) for chunk in scaled.split(rows)])
            ctx.buffer = scaled
            ctx.save_for_backward(log_sum_exp, targets)
            return scaled.gather(-1, targets[:, None])[:, 0] - log_sum_exp
        log_sum_exp = torch.cat([torch.logsumexp(chunk.to(dtype) / temperature, dim=-1)
                                 for chunk in logits.split(rows)])
        ctx.buffer = True  # the logits themselves, saved below (autograd checks nothing changed them in between)
        ctx.save_for_backward(log_sum_exp, targets, logits)
        return logits.gather(-1, targets[:, None])[:, 0].to(dtype) / temperature - log_sum_exp

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        log_sum_exp, targets, *low_precision_logits = ctx.saved_tensors
        buffer, ctx.buffer = ctx.buffer, None  # fp32: the forward's own tensor, reused: one backward per forward
        if buffer is None:
            raise RuntimeError("TargetLogProb: backward through the same log-probs twice (retain_graph)")
        scale = grad.to(log_sum_exp.dtype) / ctx.temperature  # fp32, or fp64 for fp64 logits
        if not low_precision_logits:  # fp32 / fp64 logits: the buffer is logits / T, made the gradient in place
            for chunk, chunk_lse, chunk_scale in zip(buffer.split(ctx.rows), log_sum_exp.split(ctx.rows),
                                                     scale.split(ctx.rows)):
                chunk.sub_(chunk_lse[:, None]).exp_().mul_(-chunk_scale[:, None])  # -softmax * grad / T
            buffer.scatter_add_(-1, targets[:, None], scale[:, None])  # + onehot(target) * grad / T
            return buffer, None, None
        (buffer,) = low_precision_logits
        out = torch.empty_like(buffer)  # the logits' dtype: a bf16 gradient for bf16 logits
        for chunk, out_chunk, chunk_lse, chunk_scale, chunk_targets in zip(
                buffer.split(ctx.rows), out.split(ctx.rows), log_sum_exp.split(ctx.rows), scale.split(ctx.rows),
                targets.split(ctx.rows)):
            probs = (chunk.to(chunk_lse.dtype) / ctx.temperature).sub_(chunk_lse[:, None]).exp_()
            probs.mul_(-chunk_scale[:, None])
            probs.scatter_add_(-1, chunk_targets[:, None], chunk_scale[:, None])
            out_chunk.copy_(probs)
        return out, None, None


# ------------------------------------------------------------------------------------------------
# Expert parallelism: every EP rank runs as many micro-batches as its peers
# ------------------------------------------------------------------------------------------------
def expert_exchange_group(agent: AgentModel) -> Optional[dist.ProcessGroup]:
    """The ranks whose MoE layers exchange tokens with this rank's in every forward and backward pass (megatron's
    tp_ep group: EP x ETP ranks) where they reach beyond this rank's data-parallel replica; None where they do not (a
    dense model; experts at EP 1 and ETP = TP)."""
    parallel = agent.parallel
    if agent.arch.moe is None or (parallel.ep_size == 1 and parallel.etp_size == parallel.tp_size):
        return None
    return parallel.pg_collection.tp_ep


def in_step_with_expert_peers(agent: AgentModel, micro_batches: Sequence[PackedBatch]) -> List[PackedBatch]:
    """`micro_batches`, then as many filler micro-batches as make this rank run as many as the most any rank of its
    expert-exchange group runs (`expert_exchange_group`). At EP > 1 every MoE layer's forward and backward pass is an
    all-to-all over those ranks, which are data-parallel replicas: their shares of a pass or of an update may differ
    in micro-batches (rows, a token budget), or be empty. Collective over that group (the max of one number); the
    list as it is where there is no such group."""
    micro_batches = list(micro_batches)
    group = expert_exchange_group(agent)
    if group is None:
        return micro_batches
    count = torch.tensor([len(micro_batches)], dtype=torch.long, device=collective_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return micro_batches + [filler_micro_batch() for _ in range(int(count.item()) - len(micro_batches))]


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
    # MoE routing replay: each sequence's routes as the pass took them ([prompt + response tokens, layers, k])
    routes: Optional[List[torch.Tensor]] = None

    @staticmethod
    def from_token_logprobs(token_logprobs: torch.Tensor, lengths: torch.Tensor) -> "SequenceLogProbs":
        mask = torch.arange(token_logprobs.shape[1]).expand(len(lengths), -1) < lengths.unsqueeze(1)
        token_logprobs = token_logprobs * mask
        return SequenceLogProbs(token_logprobs, mask, token_logprobs.sum(dim=1), lengths.clone())


# ------------------------------------------------------------------------------------------------
# Plumbing: megatron's schedule
# ------------------------------------------------------------------------------------------------
# A loss on one micro-batch: (log-probs of its response tokens [T], the micro-batch) -> what megatron's
# loss_func returns: (loss, num_tokens, metrics) or (loss, metrics). None: inference only.
MicroBatchLoss = Callable[[torch.Tensor, PackedBatch], Tuple[Any, ...]]


def make_forward_step(agent: AgentModel, *, temperature: float = 1.0,
                      loss_fn: Optional[MicroBatchLoss] = None, route_replay: Any = None,
                      record_routes: bool = False) -> Callable[..., Any]:
    """The `forward_step_func` megatron's schedules call once per micro-batch.

    On the last stage the logits become the log-probs of the response tokens; with `loss_fn` those feed
    the loss (training), without it they are returned as the micro-batch's result (inference).
    `route_replay` (an MoE model's RouteReplay, models/moe_replay.py): each micro-batch's `routes` are imposed on
    the routers (live where it has none); with `record_routes` the routes taken are left in its `recorded_routes`.
    """
    tp_group = agent.parallel.tp_group
    moe = agent.arch.moe is not None

    def loss_func(micro_batch: PackedBatch, response_logits: torch.Tensor) -> Tuple[Any, ...]:
        # response_logits [T, 1, V/TP]: one row per response token, at the position that predicts it
        # squeeze(1) is a view; indexing [:, 0] would write a zeroed [T, 1, V] gradient in backward
        token_logprobs = token_logprobs_from_logits(
            response_logits.squeeze(1), micro_batch.targets.to(response_logits.device), temperature=temperature,
            vocab_size=agent.vocab_size, tp_group=tp_group,
        )
        if micro_batch.filler and loss_fn is not None:  # a backward pass of zeros, in step with the EP peers
            return token_logprobs.sum() * 0.0, torch.zeros((), dtype=torch.int), {}
        if loss_fn is not None:
            return loss_fn(token_logprobs, micro_batch)
        zero = torch.zeros((), device=response_logits.device)
        return zero, {"token_logprobs": token_logprobs.detach(), "micro_batch": micro_batch}

    def forward_step(data_iterator: Iterator[PackedBatch], model: Any) -> Tuple[torch.Tensor, Callable]:
        micro_batch = next(data_iterator)
        device = _model_device(model)
        layout = micro_batch.token_layout.to(device)
        if not layout.plain and not agent.takes_attention_mask:
            raise ValueError(f"{agent.parallel.name}: shared-prompt or packed rows need the project's core attention "
                             "(megatron's local layers, unfused RoPE); Transformer Engine's takes one sequence a row")
        # MoE: megatron's padding mask for the routers (True: padding), which the load-balancing loss leaves out
        # (models/moe_router.py); routing itself is per token either way. A filler is padding throughout
        padding = dict(padding_mask=(layout.document < 0) | micro_batch.filler) if moe else {}
        replaying = (route_replay.applied(micro_batch, record=record_routes) if route_replay is not None
                     else nullcontext())
        with rotary_at_positions(model, None if layout.plain else layout.position), \
                attention_over(layout, agent.attention), replaying:
            output = model(micro_batch.tokens.to(device), layout.position, attention_mask=None,
                           output_processor=_response_positions_logits,
                           output_processor_context=(micro_batch.logit_rows.to(device),
                                                     micro_batch.logit_positions.to(device)), **padding)
        return output, partial(loss_func, micro_batch)

    return forward_step


def _response_positions_logits(*, hidden_states: torch.Tensor, output_layer: Any, output_weight: Any,
                               context: Tuple[torch.Tensor, torch.Tensor], **_unused: Any) -> torch.Tensor:
    """GPTModel's output hook: logits only where a response token is predicted.

    The output layer (hidden x vocabulary) is most of a small model's cost, and prompts are most of
    an RL sequence; computing it for the response positions alone is exact and several times cheaper.
    hidden_states [S, rows, h] -> [T, 1, V/TP] at context = (rows [T], positions [T]); with shared
    prompts the prompt's last position appears once per response it starts.
    """
    rows, positions = context
    selected = hidden_states[positions, rows].unsqueeze(1)
    logits, _ = output_layer(selected, weight=output_weight, runtime_gather_output=False)
    return logits


@contextmanager
def rotary_at_positions(model: Any, position_ids: Optional[torch.Tensor]) -> Iterator[None]:
    """Make the model's RoPE rotate each token by its entry of `position_ids` [rows, S] (None: by its index
    in the row, megatron's own behaviour) for the forward passes inside the block.

    Megatron's GPTModel rotates token t of every row by t. Shared-prompt rows need the positions the tokens
    have in their own sequence; the unfused RoPE kernel takes per-row frequencies ([S, rows, 1, dim], as
    for mRoPE), so the model's rotary module returns those instead. The backward pass needs nothing from
    here (the rotation's cos/sin are saved by autograd).
    """
    from hacpo_megatron.models.attention import rotary_freqs_at_positions

    gpt = _unwrap(model)
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if position_ids is None or rotary is None:
        yield
        return
    freqs = rotary_freqs_at_positions(rotary, position_ids)  # [S, rows, 1, dim]; Gemma 3: one per layer type
    rotary.forward = lambda *args, **kwargs: freqs
    try:
        yield
    finally:
        del rotary.forward  # back to the class's forward


def _unwrap(model: Any) -> Any:
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def run_schedule(agent: AgentModel, micro_batches: List[PackedBatch], forward_step: Callable[..., Any],
                 *, forward_only: bool) -> List[Any]:
    """Run megatron's pipeline schedule over `micro_batches`; the loss_func results on the last stage, those of filler
    micro-batches (`in_step_with_expert_peers`) left out."""
    megatron_cpu.apply()
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    parallel = agent.parallel
    schedule = get_forward_backward_func(pp_size=parallel.pp_size, vp_size=None)
    results = schedule(
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
    fillers = [getattr(mb, "filler", False) for mb in micro_batches]  # a tool's own micro-batches have none
    if not any(fillers):
        return results
    return [result for result, filler in zip(results, fillers) if not filler]  # one result per micro-batch


@torch.no_grad()
def compute_sequence_logprobs(
    agent: AgentModel,
    sequences: Sequence[PromptResponse],
    *,
    temperature: float = 1.0,
    max_sequences_per_micro_batch: Optional[int] = 8,
    max_tokens_per_micro_batch: Optional[int] = None,
    share_prompts: bool = False,
    pad_id: int = 0,
    route_replay: Any = None,
) -> SequenceLogProbs:
    """Per-token log-probs of every response under `agent`, on every rank of its model replica.

    Collective over the agent's TP x PP ranks holding this data-parallel replica; each DP replica
    passes its own sequences. Runs in eval mode (no dropout). Micro-batches: with `max_tokens_per_micro_batch`,
    sequences packed end to end up to that many tokens (token_budget_groups: no padding FLOPs); otherwise
    <= max_sequences_per_micro_batch sequences, in prompt order with `share_prompts` (the responses to one prompt
    share a document, PackedBatch), by length without.

    `route_replay` (an MoE model's RouteReplay): the sequences it holds routes of are routed as those say, the others
    live; the result's `routes` then holds every sequence's routes as this pass took them (in this pipeline stage's
    MoE layers).

    At expert parallelism > 1 also collective over the EP ranks, which are data-parallel replicas: each runs as many
    micro-batches as the most any of them runs (`in_step_with_expert_peers`), with no sequences too.
    """
    micro_batches = packed_micro_batches(sequences, max_sequences=max_sequences_per_micro_batch,
                                         max_tokens=max_tokens_per_micro_batch, share_prompts=share_prompts,
                                         pad_id=pad_id) if sequences else []
    in_step = in_step_with_expert_peers(agent, micro_batches)  # fillers after this rank's own micro-batches
    if not sequences:
        if in_step:
            _run_forward_only(agent, in_step, make_forward_step(agent, temperature=temperature))
        empty = torch.zeros(0, 0)
        return SequenceLogProbs(empty, empty.bool(), torch.zeros(0), torch.zeros(0, dtype=torch.long),
                                routes=[] if route_replay is not None else None)  # no sequence, no routes
    if route_replay is not None:
        for mb in micro_batches:
            mb.routes = route_replay.layout(mb, sequences)
    lengths = torch.tensor([len(r) for _, r in sequences], dtype=torch.long)
    max_response = max(1, int(lengths.max()))
    results = _run_forward_only(agent, in_step, make_forward_step(agent, temperature=temperature,
                                                                  route_replay=route_replay,
                                                                  record_routes=route_replay is not None))

    token_logprobs = torch.zeros(len(sequences), max_response, dtype=torch.float32)
    if agent.parallel.is_last_stage:
        for result in results:
            mb: PackedBatch = result["micro_batch"]
            token_logprobs[mb.indices] = mb.response_logprobs(result["token_logprobs"].cpu(), max_response)
    token_logprobs = _from_last_stage(token_logprobs, agent)
    out = SequenceLogProbs.from_token_logprobs(token_logprobs, lengths)
    if route_replay is not None:
        out.routes = [None] * len(sequences)
        for mb in micro_batches:
            for i, route in route_replay.unpack(mb, sequences):
                out.routes[i] = route
    return out


def _run_forward_only(agent: AgentModel, micro_batches: List[PackedBatch],
                      forward_step: Callable[..., Any]) -> List[Any]:
    """The schedule's forward passes in eval mode (no dropout), the model's mode restored afterwards."""
    was_training = agent.model.training
    agent.model.eval()
    try:
        return run_schedule(agent, micro_batches, forward_step, forward_only=True)
    finally:
        agent.model.train(was_training)


def _from_last_stage(tensor: torch.Tensor, agent: AgentModel) -> torch.Tensor:
    """Broadcast the last stage's tensor over the pipeline (its TP ranks already agree)."""
    parallel = agent.parallel
    if parallel.pp_size == 1:
        return tensor
    buffer = tensor.to(collective_device())
    dist.broadcast(buffer, group=parallel.pp_group, group_src=parallel.pp_size - 1)
    return buffer.cpu()


def _model_device(model: Any) -> torch.device:
    return next(model.parameters()).device
