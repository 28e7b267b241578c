"""Core attention over the rows the trainer builds, with one of four kernels (`train.attention`).

A micro-batch's rows (models/packing.py: PackedBatch) hold *documents*: a prompt followed by one response
(a plain sequence) or by several (shared prompts), and a row may hold several documents end to end (token-budget
packing). Who sees whom is a property of each token, given per row by three [rows, S] tensors (`TokenLayout`):

    document   which document of the micro-batch the token is in (-1: padding)
    segment    0 in the prompt, a + 1 in response a (-1: padding)
    position   its position in its own plain sequence (prompt 0..P-1, every response P..P+L-1)

A query token sees a key token of its row when both are in the same document, the key is in the prompt or in the
query's own response, the key's position is at most the query's, and, on a sliding-window layer (Gemma 3:
megatron's `window_size` on the layers `window_attn_skip_freq` names), at most `window` positions behind it. For
a row holding one plain sequence from position 0 that is the causal mask.

The kernels (`train.attention`; `resolve_attention` picks one for `auto`):

    local  megatron's DotProductAttention (baddbmm, softmax, bmm) where every row is one plain sequence; any
           other row in dense blocks (below) through torch's scaled_dot_product_attention. Today's CPU path.
    sdpa   torch's scaled_dot_product_attention for everything: is_causal where every row is one plain
           sequence and no window applies (flash / cuDNN / efficient kernels on a GPU), dense blocks otherwise.
    flex   torch's FlexAttention: one kernel over the whole row, the rule above compiled into a block mask
           (compiled with torch.compile on a GPU; on a CPU torch has no FlexAttention backward, so there it
           serves forward passes only: log-probs, evaluation).
    auto   on a GPU: SDPA's causal kernel where every row is one plain sequence and no window applies, FlexAttention
           for every other mask; on a CPU: local (CPU measurements: docs/benchmarks.md).

Dense blocks (`attention_blocks`): the prompt of each document over itself (causal), and each response over
[its prompt, itself] (causal, shifted by P); blocks of similar length are stacked, right-padded, into one SDPA
call with a boolean mask. Only the pairs a response can see are computed: with 8 responses of 70 tokens after a
60-token prompt, megatron's masked attention would compute 8 times as many.

    layout = packed.token_layout.to(device)                 # once per micro-batch (models/logprobs.py)
    with attention_over(layout, agent.attention):
        model(tokens, ...)                                   # every CoreAttention reads it

Outside an `attention_over` block, CoreAttention is megatron's DotProductAttention, unchanged. The softmax scale
is megatron's (`softmax_scale`: 1/sqrt(query_pre_attn_scalar) for Gemma 3), grouped-query heads are shared
without copies where the kernel allows (`enable_gqa`).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from hacpo_megatron import megatron_cpu

megatron_cpu.apply()
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402

ATTENTION_CHOICES = ("auto", "flex", "sdpa", "local")


def flex_attention_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attention(choice: str, device: torch.device) -> str:
    """The kernel `choice` means on `device`: auto -> 'auto-gpu' (SDPA causal + FlexAttention) on CUDA with
    FlexAttention, 'sdpa' on CUDA without it, 'local' on a CPU; the others as they are."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"train.attention must be one of {', '.join(ATTENTION_CHOICES)}, got {choice!r}")
    if choice == "flex" and not flex_attention_available():
        raise ValueError("train.attention: flex needs torch.nn.attention.flex_attention (torch >= 2.5)")
    if choice != "auto":
        return choice
    if device.type == "cuda":
        return "auto-gpu" if flex_attention_available() else "sdpa"
    return "local"


# ------------------------------------------------------------------------------------------------
# Who sees whom, per token
# ------------------------------------------------------------------------------------------------
class Document(NamedTuple):
    """One prompt and the responses computed with it, at `start` of row `row` of a micro-batch."""

    row: int
    start: int
    prompt_length: int
    response_lengths: Tuple[int, ...]

    @property
    def length(self) -> int:
        return self.prompt_length + sum(self.response_lengths)


@dataclass
class TokenLayout:
    """The per-token description of a micro-batch's rows (module docstring), with what each kernel derives
    from it, built on first use: the dense blocks, and FlexAttention's block mask per window."""

    document: torch.Tensor  # [rows, S] long, -1 at padding
    segment: torch.Tensor  # [rows, S] long, -1 at padding
    position: torch.Tensor  # [rows, S] long
    documents: List[Document]
    plain: bool  # every row one sequence (one prompt, one response) from position 0: the causal mask
    _blocks: Optional[List["AttentionBlocks"]] = field(default=None, repr=False)
    _block_masks: Dict[Optional[int], object] = field(default_factory=dict, repr=False)

    @staticmethod
    def of_documents(documents: Sequence[Document], rows: int, width: int, device=None) -> "TokenLayout":
        document = torch.full((rows, width), -1, dtype=torch.long)
        segment = torch.full((rows, width), -1, dtype=torch.long)
        position = torch.arange(width).repeat(rows, 1)  # padding keeps its index in the row
        per_row = [0] * rows
        for d, doc in enumerate(documents):
            per_row[doc.row] += 1
            P, start = doc.prompt_length, doc.start
            document[doc.row, start:start + doc.length] = d
            segment[doc.row, start:start + P] = 0
            position[doc.row, start:start + P] = torch.arange(P)
            offset = start + P
            for a, L in enumerate(doc.response_lengths):
                segment[doc.row, offset:offset + L] = a + 1
                position[doc.row, offset:offset + L] = torch.arange(P, P + L)
                offset += L
        plain = all(n == 1 for n in per_row) and all(len(d.response_lengths) == 1 and d.start == 0 for d in documents)
        return TokenLayout(document.to(device), segment.to(device), position.to(device), list(documents), plain)

    def to(self, device) -> "TokenLayout":
        """The same layout with its tensors on `device` (what it derives is built there on first use)."""
        return TokenLayout(self.document.to(device), self.segment.to(device), self.position.to(device),
                           self.documents, self.plain)

    def visible(self, window: Optional[int] = None) -> torch.Tensor:
        """[rows, 1, S, S] bool: may query q see key k (padding queries see themselves, so no softmax is 0/0).
        A dense reference; the kernels never build it."""
        d, s, p = self.document, self.segment, self.position
        seen = (d[:, :, None] == d[:, None, :]) & (d[:, :, None] >= 0) \
            & ((s[:, None, :] == 0) | (s[:, None, :] == s[:, :, None])) & (p[:, None, :] <= p[:, :, None])
        if window is not None:
            seen &= p[:, None, :] >= p[:, :, None] - window
        width = d.shape[1]
        seen |= (d[:, :, None] < 0) & torch.eye(width, dtype=torch.bool, device=d.device)
        return seen.unsqueeze(1)

    @property
    def blocks(self) -> List["AttentionBlocks"]:
        if self._blocks is None:
            self._blocks = attention_blocks(self.documents, self.document.shape[0], self.document.device)
        return self._blocks

    def block_mask(self, window: Optional[int]):
        """FlexAttention's BlockMask of the rule above (one per window; built once per micro-batch)."""
        if window not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            doc, seg, pos = self.document, self.segment, self.position

            def mask_mod(b, h, q, k):
                seen = (doc[b, q] == doc[b, k]) & (doc[b, q] >= 0) & ((seg[b, k] == 0) | (seg[b, k] == seg[b, q])) \
                    & (pos[b, k] <= pos[b, q])
                if window is not None:
                    seen = seen & (pos[b, k] >= pos[b, q] - window)
                return seen | ((doc[b, q] < 0) & (q == k))

            rows, width = doc.shape
            self._block_masks[window] = create_block_mask(mask_mod, rows, None, width, width, device=doc.device)
        return self._block_masks[window]


# ------------------------------------------------------------------------------------------------
# Dense blocks
# ------------------------------------------------------------------------------------------------
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


def attention_blocks(documents: Sequence[Document], rows: int, device=None) -> List[AttentionBlocks]:
    """The prompt blocks and the response blocks of `documents` in `rows` rows; row r's token t sits at flat
    index t * rows + r (megatron's [S, rows] layout)."""
    prompt_blocks, response_blocks = [], []
    for doc in documents:
        r, P = doc.row, doc.prompt_length
        prompt_index = [t * rows + r for t in range(doc.start, doc.start + P)]
        prompt_positions = list(range(P))
        prompt_blocks.append((prompt_index, prompt_positions, prompt_index, prompt_positions))
        start = doc.start + P
        for length in doc.response_lengths:
            index = [t * rows + r for t in range(start, start + length)]
            positions = list(range(P, P + length))
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


# ------------------------------------------------------------------------------------------------
# The other kernels
# ------------------------------------------------------------------------------------------------
def attend_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA's causal kernel over rows that each hold one sequence from position 0 (right padding is never seen
    by a real token). [S, rows, heads, d] -> [S, rows, heads * d]."""
    S, rows, heads, dim = query.shape
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [rows, heads or groups, S, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=heads != key.shape[2])
    return out.permute(2, 0, 1, 3).reshape(S, rows, heads * dim)


_COMPILED_FLEX = None


def _flex_kernel(device: torch.device):
    """torch.compile(flex_attention) on a GPU (the fused Triton kernel); eager elsewhere (an unfused reference
    implementation: on a CPU, forward only)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
    return _COMPILED_FLEX


def attend_flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: TokenLayout, scale: float,
                window: Optional[int] = None) -> torch.Tensor:
    """FlexAttention over whole rows with `layout`'s block mask. [S, rows, heads, d] -> [S, rows, heads * d]."""
    S, rows, heads, dim = query.shape
    if query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad:
        raise NotImplementedError("train.attention: flex has no backward on a CPU (torch's FlexAttention); "
                                  "train with local or sdpa there (auto picks local)")
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
    with warnings.catch_warnings():  # eager off a GPU on purpose: torch's warning that it is unfused says nothing new
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = _flex_kernel(query.device)(q, k, v, block_mask=layout.block_mask(window), scale=scale,
                                         enable_gqa=heads != key.shape[2])
    return out.permute(2, 0, 1, 3).reshape(S, rows, heads * dim)


# ------------------------------------------------------------------------------------------------
# The module megatron's layer spec builds
# ------------------------------------------------------------------------------------------------
_ACTIVE: ContextVar[Optional[Tuple[TokenLayout, str]]] = ContextVar("attention_layout", default=None)


@contextmanager
def attention_over(layout: Optional[TokenLayout], kernel: str = "local") -> Iterator[None]:
    """Forward passes inside compute every CoreAttention over `layout` with `kernel` (a resolved choice:
    local, sdpa, flex or auto-gpu). None: megatron's own attention."""
    token = _ACTIVE.set(None if layout is None else (layout, kernel))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class CoreAttention(DotProductAttention):
    """Megatron's local core attention, computed with the kernel `attention_over` names (module docstring)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        active = _ACTIVE.get()
        window = self._window_behind()
        if active is None or (active[1] == "local" and active[0].plain):
            if active is None and attention_mask is not None and window is not None:
                # megatron's softmax replaces a given mask by its sliding-window mask over row indices, which would
                # let responses of a shared-prompt row see each other and count the window in the wrong positions
                raise NotImplementedError("a sliding-window layer takes a shared-prompt mask only inside "
                                          "attention_over (models/logprobs.py does that)")
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        layout, kernel = active
        config = self.config
        if self.softmax_offset is not None or config.apply_query_key_layer_scaling \
                or (self.training and self.attention_dropout.p > 0):
            raise NotImplementedError(f"attention {kernel}: no softmax offset, query-key layer scaling "
                                      "or attention dropout")
        if kernel in ("sdpa", "auto-gpu") and layout.plain and window is None:
            return attend_causal(query, key, value, self.softmax_scale)
        if kernel in ("flex", "auto-gpu"):
            return attend_flex(query, key, value, layout, self.softmax_scale, window=window)
        return attend_in_blocks(query, key, value, layout.blocks, self.softmax_scale, window=window)

    def _window_behind(self) -> Optional[int]:
        """How many positions before its own a query of this layer sees (None: all), from megatron's per-layer
        window (DotProductAttention gives it to its softmax: (left, right), or None on a full-attention layer)."""
        window = self.scale_mask_softmax.window_size
        if window is None:
            return None
        left, right = window
        if right != 0:
            raise NotImplementedError(f"attention: a causal window looks no keys ahead, got {window}")
        return None if left < 0 else left


def rotary_freqs_at_positions(rotary, position_ids: torch.Tensor):
    """The rotary angles [S, rows, 1, dim] of megatron's RotaryEmbedding `rotary` at per-row `position_ids`
    [rows, S] (what its forward gives for plain rows, rows of positions 0..S-1). A module holding one
    embedding per layer type (models/gemma3.py: LayerTypeRotary) answers for each of them."""
    if hasattr(rotary, "at_positions"):
        return rotary.at_positions(position_ids)
    table = rotary.get_emb(int(position_ids.max()) + 1)[:, 0, 0, :]  # [positions, dim], llama3 scaling included
    return table[position_ids.transpose(0, 1)].unsqueeze(2)
