"""Core attention for shared-prompt rows: only the query/key pairs a response can see are computed.

A shared-prompt row (models/logprobs.py) is [prompt, response 1, response 2, ...]; a response sees the
prompt and its own earlier tokens. Megatron's local attention computes every pair of the row and masks
most of them away: with 8 responses of 70 tokens after a 60-token prompt, 7 in 8 of the [S, S] scores are
thrown out, and the scores, mask and softmax are each a pass over [heads, S, S] in memory, forward and
backward. Here the row is cut into dense blocks instead:

    prompt block of a row:   its P prompt tokens over the same P tokens              (causal)
    block of each response:  its L tokens over [the prompt's P tokens, its L tokens]  (causal, shifted by P)

and blocks of one kind and similar length are stacked, right-padded, into one call of torch's
scaled_dot_product_attention (a fused kernel: flash on CPU and GPU). Within a block a query attends to a
key when the key's position in its own plain sequence is at most the query's and the key is not padding;
that is exactly the shared-prompt mask, so every real token gets what megatron's masked attention gives it,
up to the order of floating-point sums. Padding positions of the row get zeros (nothing reads them).
A sliding-window layer (Gemma 3: megatron's `window_size` on the layers `window_attn_skip_freq` names) also
drops the keys more than its window behind the query, by positions in the plain sequence as the model's own
mask does; its softmax scale is megatron's (`softmax_scale`, 1/sqrt(query_pre_attn_scalar) for Gemma 3).

    blocks = attention_blocks(packed.layout, device)          # once per micro-batch
    with blocked_attention(blocks):
        model(tokens, ...)                                     # every SharedPromptAttention reads them

Outside a `blocked_attention` block, the module is megatron's DotProductAttention, unchanged.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from hacpo_megatron.models import cpu_compat

cpu_compat.apply()
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402


@dataclass(frozen=True)
class AttentionBlocks:
    """Blocks of one kind, stacked: block i's queries attend to block i's keys where `allowed`.

    Token indices are flat positions in megatron's [S, rows] layout (s * rows + row); padding entries
    point at position 0 and are never allowed (keys) or kept (queries).
    """

    queries: torch.Tensor  # [blocks, Q] long
    keys: torch.Tensor  # [blocks, K] long
    allowed: torch.Tensor  # [blocks, 1, Q, K] bool
    real_queries: torch.Tensor  # [blocks, Q] bool: not padding
    real_query_index: torch.Tensor  # queries[real_queries]: where the stack's outputs go
    query_positions: torch.Tensor  # [blocks, Q] long: positions in the plain sequence (sliding windows)
    key_positions: torch.Tensor  # [blocks, K] long

    def allowed_within(self, window: Optional[int]) -> torch.Tensor:
        """`allowed`, less the keys more than `window` positions before the query (None: no window).

        Padded queries keep their keys: a query row with every key masked would make the kernel's softmax 0/0,
        and its NaN would reach the real tokens' gradients through the shared index 0.
        """
        if window is None:
            return self.allowed
        near = self.key_positions[:, None, :] >= self.query_positions[:, :, None] - window  # [blocks, Q, K]
        return self.allowed & (near | ~self.real_queries[:, :, None]).unsqueeze(1)


def _stack(blocks: Sequence[Tuple[List[int], List[int], List[int], List[int]]], device) -> AttentionBlocks:
    """(query indices, query positions, key indices, key positions) per block -> one padded stack."""
    width_q = max(len(b[0]) for b in blocks)
    width_k = max(len(b[2]) for b in blocks)

    def padded(values: List[List[int]], width: int, fill: int) -> torch.Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=torch.long)

    queries, keys = padded([b[0] for b in blocks], width_q, 0), padded([b[2] for b in blocks], width_k, 0)
    # padded queries take the last position, so they see the block's real keys (a fully masked row would
    # make the kernel's softmax 0/0); padded keys take a position no query reaches
    query_pos = padded([b[1] for b in blocks], width_q, 1 << 30)
    key_pos = padded([b[3] for b in blocks], width_k, (1 << 30) + 1)
    real_queries = padded([[1] * len(b[0]) for b in blocks], width_q, 0).bool()
    allowed = (key_pos[:, None, :] <= query_pos[:, :, None]).unsqueeze(1)
    return AttentionBlocks(queries.to(device), keys.to(device), allowed.to(device), real_queries.to(device),
                           queries[real_queries].to(device), query_pos.to(device), key_pos.to(device))


def attention_blocks(layout: Sequence[Tuple[int, Sequence[int]]], device=None) -> List[AttentionBlocks]:
    """The prompt blocks and the response blocks of rows laid out as `layout` (per row: prompt length,
    response lengths, as PackedBatch.layout); row r's token t sits at flat index t * rows + r."""
    rows = len(layout)
    prompt_blocks, response_blocks = [], []
    for r, (prompt_length, response_lengths) in enumerate(layout):
        prompt_index = [t * rows + r for t in range(prompt_length)]
        prompt_positions = list(range(prompt_length))
        prompt_blocks.append((prompt_index, prompt_positions, prompt_index, prompt_positions))
        start = prompt_length
        for length in response_lengths:
            index = [t * rows + r for t in range(start, start + length)]
            positions = list(range(prompt_length, prompt_length + length))
            response_blocks.append((index, positions, prompt_index + index, prompt_positions + positions))
            start += length
    return [_stack(stack, device) for stack in _similar_lengths(prompt_blocks) + _similar_lengths(response_blocks)]


def _similar_lengths(blocks: list, ratio: float = 0.75, slack: int = 16) -> List[list]:
    """Blocks longest first, cut into stacks whose blocks have at least `ratio` of their longest one's
    queries or at most `slack` fewer: an RL batch mixes 70-token answers with 3-token ones, and one stack
    would pad every short answer to the longest (the slack keeps short blocks from taking a call each)."""
    stacks: List[list] = []
    for block in sorted(blocks, key=lambda b: -len(b[0])):
        longest = len(stacks[-1][0][0]) if stacks else 0
        if stacks and (len(block[0]) >= ratio * longest or longest - len(block[0]) <= slack):
            stacks[-1].append(block)
        else:
            stacks.append([block])
    return stacks


_ACTIVE_BLOCKS: ContextVar[Optional[List[AttentionBlocks]]] = ContextVar("attention_blocks", default=None)


@contextmanager
def blocked_attention(blocks: Optional[List[AttentionBlocks]]) -> Iterator[None]:
    """Forward passes inside compute SharedPromptAttention over `blocks` (None: megatron's attention)."""
    token = _ACTIVE_BLOCKS.set(blocks)
    try:
        yield
    finally:
        _ACTIVE_BLOCKS.reset(token)


def attend_in_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: List[AttentionBlocks],
                     scale: float, window: Optional[int] = None) -> torch.Tensor:
    """query [S, rows, heads, d], key/value [S, rows, groups, d] -> context [S, rows, heads * d].

    `window`: a query sees keys at most this many positions before its own (megatron's window_size[0]); None: all.
    """
    S, rows, heads, dim = query.shape
    q, k, v = (x.reshape(S * rows, x.shape[2], dim) for x in (query, key, value))
    context = query.new_zeros(S * rows, heads, dim)

    def gathered(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # -> [blocks, heads, Q or K, d]
        # index_select, not x[index]: its backward is an index_add, advanced indexing's a much slower index_put
        return x.index_select(0, index.flatten()).view(*index.shape, x.shape[1], dim).transpose(1, 2)

    for block in blocks:
        out = F.scaled_dot_product_attention(
            gathered(q, block.queries), gathered(k, block.keys), gathered(v, block.keys),
            attn_mask=block.allowed_within(window), scale=scale, enable_gqa=heads != key.shape[2],
        ).transpose(1, 2)
        context = context.index_copy(0, block.real_query_index, out[block.real_queries])
    return context.view(S, rows, heads * dim)


class SharedPromptAttention(DotProductAttention):
    """Megatron's local core attention, computed in dense blocks inside `blocked_attention` (module docstring)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        blocks = _ACTIVE_BLOCKS.get()
        if blocks is None:
            if attention_mask is not None and self.scale_mask_softmax.window_size is not None:
                # megatron's softmax replaces a given mask by its sliding-window mask over row indices, which would
                # let responses of a shared-prompt row see each other and count the window in the wrong positions
                raise NotImplementedError("a sliding-window layer takes a shared-prompt mask only inside "
                                          "blocked_attention (models/logprobs.py does that)")
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        config = self.config
        if self.softmax_offset is not None or config.apply_query_key_layer_scaling \
                or (self.training and self.attention_dropout.p > 0):
            raise NotImplementedError("blocked attention: no softmax offset, query-key layer scaling "
                                      "or attention dropout")
        return attend_in_blocks(query, key, value, blocks, self.softmax_scale, window=self._window_behind())

    def _window_behind(self) -> Optional[int]:
        """How many positions before its own a query of this layer sees (None: all), from megatron's per-layer
        window (DotProductAttention gives it to its softmax: (left, right), or None on a full-attention layer)."""
        window = self.scale_mask_softmax.window_size
        if window is None:
            return None
        left, right = window
        if right != 0:
            raise NotImplementedError(f"blocked attention: a causal window looks no keys ahead, got {window}")
        return None if left < 0 else left


def rotary_freqs_at_positions(rotary, position_ids: torch.Tensor):
    """The rotary angles [S, rows, 1, dim] of megatron's RotaryEmbedding `rotary` at per-row `position_ids`
    [rows, S] (what its forward gives for plain rows, rows of positions 0..S-1). A module holding one
    embedding per layer type (models/gemma3.py: LayerTypeRotary) answers for each of them."""
    if hasattr(rotary, "at_positions"):
        return rotary.at_positions(position_ids)
    table = rotary.get_emb(int(position_ids.max()) + 1)[:, 0, 0, :]  # [positions, dim], llama3 scaling included
    return table[position_ids.transpose(0, 1)].unsqueeze(2)
