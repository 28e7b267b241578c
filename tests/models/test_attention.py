"""Blocked shared-prompt attention (models/attention.py) against dense masked attention in float64.

The reference is the textbook formula over the whole row with the mask pack_sequences builds for
shared-prompt rows: softmax(scale * Q K^T, masked) V. Blocked attention must give every real token the
same context and the same gradients, for rows of different prompt lengths, one or many responses,
grouped-query heads, and zero at padding.
"""
import math

import pytest
import torch

from hacpo_megatron.models.attention import Document, attend_in_blocks, attention_blocks
from hacpo_megatron.models.packing import pack_sequences


def _dense_reference(query, key, value, mask, scale):
    """query [S, rows, heads, d], key/value [S, rows, groups, d], mask [rows, 1, S, S] (True: may not attend)."""
    heads, groups = query.shape[2], key.shape[2]
    key = key.repeat_interleave(heads // groups, dim=2)
    value = value.repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", query, key) * scale
    scores = scores.masked_fill(mask, -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked padding rows: zero
    context = torch.einsum("bhqk,kbhd->qbhd", probs, value)
    return context.reshape(*query.shape[:2], -1)


def _packed(prompt_lengths, response_lengths):
    sequences, indices = [], []
    for p, (prompt_length, lengths) in enumerate(zip(prompt_lengths, response_lengths)):
        prompt = [100 + p] * prompt_length
        for length in lengths:
            indices.append(len(sequences))
            sequences.append((prompt, [7] * length))
    return pack_sequences(sequences, indices, share_prompts=True)


@pytest.mark.parametrize("prompt_lengths,response_lengths,heads,groups", [
    ([5, 9], [[3, 7, 1], [4, 2]], 4, 2),  # two rows, different prompts and padding, GQA
    ([6], [[5, 5, 5, 5]], 3, 3),  # one row, equal responses, multi-head
    ([1, 4], [[1, 1], [6]], 2, 1),  # one-token prompt and responses; a row with one response
    ([4, 6], [[40, 3, 30], [2, 25]], 4, 2),  # long and short answers: stacks of similar lengths
])
def test_blocked_attention_matches_dense_masked_attention(prompt_lengths, response_lengths, heads, groups):
    torch.manual_seed(0)
    packed = _packed(prompt_lengths, response_lengths)
    rows, width = packed.tokens.shape
    dim, scale = 8, 0.3
    query = torch.randn(width, rows, heads, dim, dtype=torch.float64, requires_grad=True)
    key = torch.randn(width, rows, groups, dim, dtype=torch.float64, requires_grad=True)
    value = torch.randn(width, rows, groups, dim, dtype=torch.float64, requires_grad=True)

    blocked = attend_in_blocks(query, key, value, attention_blocks(packed.documents, rows), scale)
    reference = _dense_reference(query, key, value, packed.attention_mask(), scale)

    real = torch.zeros(width, rows, dtype=torch.bool)  # real tokens of each row, [S, rows]
    for r, (prompt_length, lengths) in enumerate(packed.layout):
        real[: prompt_length + sum(lengths), r] = True
    assert torch.allclose(blocked[real], reference[real], atol=1e-12, rtol=0)
    assert torch.count_nonzero(blocked[~real]) == 0

    weights = torch.randn_like(reference) * real[..., None]  # a loss reading real tokens only
    grads = torch.autograd.grad((blocked * weights).sum(), (query, key, value))
    expected = torch.autograd.grad((reference * weights).sum(), (query, key, value))
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)


def test_blocks_cover_only_what_a_response_sees():
    """One prompt of 3 and two responses of 2: the response blocks hold the prompt and their own tokens."""
    prompt_block, response_block = attention_blocks([Document(0, 0, 3, (2, 2))], 1)
    assert prompt_block.queries.tolist() == [[0, 1, 2]]
    assert prompt_block.allowed[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert response_block.queries.tolist() == [[3, 4], [5, 6]]
    assert response_block.keys.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, 6]]
    assert response_block.allowed[1, 0].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_answers_of_very_different_lengths_go_to_different_stacks():
    """A 3-token answer is not padded to a 40-token one's width: the prompt stack, then long, then short."""
    stacks = attention_blocks([Document(0, 0, 4, (40, 3, 30))], 1)
    assert [tuple(s.queries.shape) for s in stacks] == [(1, 4), (2, 40), (1, 3)]
    assert stacks[2].keys.shape == (1, 7)  # the prompt's 4 keys and its own 3


# ------------------------------------------------------------------------------------------------
# Every kernel of train.attention against each sequence's own causal attention
# ------------------------------------------------------------------------------------------------
from hacpo_megatron.models.attention import attend_causal, attend_flex  # noqa: E402
from hacpo_megatron.models.packing import token_budget_groups  # noqa: E402

# prompts of different lengths, several answers each (shared prompts), answers longer than a small window
SEQUENCES = [([1] * 5, [2] * 7), ([1] * 5, [3] * 2), ([9] * 3, [4] * 9), ([1] * 5, [5] * 4), ([8] * 8, [6] * 4),
             ([8] * 8, [7]), ([9] * 3, [2] * 3)]


def _own_attention(query, key, value, packed, scale, window):
    """Each sequence alone: its prompt's and response's tokens gathered from the packed rows, causal attention over
    them (keys at most `window` positions back), put back where they came from. [S, rows, ...] like the kernels."""
    S, rows, heads, dim = query.shape
    out = torch.zeros(S, rows, heads * dim, dtype=query.dtype)
    for doc in packed.documents:
        prompt = list(range(doc.start, doc.start + doc.prompt_length))
        offset = doc.start + doc.prompt_length
        for length in doc.response_lengths:
            slots = prompt + list(range(offset, offset + length))
            offset += length
            q, k, v = (x[slots, doc.row].transpose(0, 1) for x in (query, key, value))  # [heads or groups, n, d]
            k, v = (x.repeat_interleave(heads // key.shape[2], dim=0) for x in (k, v))
            n = len(slots)
            seen = torch.ones(n, n, dtype=torch.bool).tril()
            if window is not None:
                seen &= ~torch.ones(n, n, dtype=torch.bool).tril(-window - 1)
            probs = torch.softmax((q @ k.transpose(1, 2) * scale).masked_fill(~seen, -math.inf), dim=-1)
            out[slots, doc.row] = (probs @ v).transpose(0, 1).reshape(n, heads * dim)  # the prompt: the same each time
    return out


def _packings():
    """(name, PackedBatch): the arrangements the trainer builds."""
    indices = range(len(SEQUENCES))
    budget = 24
    shared_groups = token_budget_groups(SEQUENCES, budget, share_prompts=True)
    return [
        ("plain rows", pack_sequences(SEQUENCES, indices)),
        ("shared prompts", pack_sequences(SEQUENCES, indices, share_prompts=True)),
        ("packed to a budget", pack_sequences(SEQUENCES, indices, row_tokens=budget)),
        ("shared and packed", pack_sequences(SEQUENCES, [i for g in shared_groups for i in g], share_prompts=True,
                                             row_tokens=budget)),
    ]


def _qkv(packed, heads, groups, dtype, grad):
    torch.manual_seed(0)
    rows, width = packed.tokens.shape
    shapes = [(width, rows, heads, 8), (width, rows, groups, 8), (width, rows, groups, 8)]
    return [torch.randn(*shape, dtype=dtype, requires_grad=grad) for shape in shapes]


def _real(packed):
    return (packed.token_layout.document >= 0).T  # [S, rows]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("name,packed", _packings())
def test_blocks_and_the_causal_kernel_give_each_sequence_its_own_attention(name, packed, window):
    """Values and gradients in float64, for plain, shared-prompt and token-budget rows, grouped-query heads and a
    sliding window. The causal kernel serves only plain rows without a window (that is how CoreAttention uses it)."""
    query, key, value = _qkv(packed, 4, 2, torch.float64, True)
    layout = packed.token_layout
    reference = _own_attention(query, key, value, packed, 0.3, window)
    kernels = {"blocks": lambda: attend_in_blocks(query, key, value, layout.blocks, 0.3, window=window)}
    if layout.plain and window is None:
        kernels["sdpa causal"] = lambda: attend_causal(query, key, value, 0.3)
    real = _real(packed)
    weights = torch.randn_like(reference) * real[..., None]
    expected = torch.autograd.grad((reference * weights).sum(), (query, key, value))
    for kernel, attend in kernels.items():
        out = attend()
        assert torch.allclose(out[real], reference[real], atol=1e-12, rtol=0), kernel
        grads = torch.autograd.grad((out * weights).sum(), (query, key, value))
        for got, want in zip(grads, expected):
            assert torch.allclose(got, want, atol=1e-12, rtol=0), kernel


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("name,packed", _packings())
def test_flex_attention_gives_each_sequence_its_own_attention(name, packed, window):
    """FlexAttention's forward with the layout's block mask (on a CPU torch's reference implementation; the GPU run
    compares the compiled kernel, docs/gpu.md); float32, so 1e-5."""
    query, key, value = _qkv(packed, 4, 2, torch.float32, False)
    reference = _own_attention(query, key, value, packed, 0.3, window)
    out = attend_flex(query, key, value, packed.token_layout, 0.3, window=window)
    real = _real(packed)
    assert torch.allclose(out[real], reference[real], atol=1e-5, rtol=0)
    assert torch.isfinite(out).all()  # padding queries see themselves: no 0/0


def test_flex_attention_refuses_a_cpu_backward_with_a_clear_error():
    packed = _packings()[1][1]
    query, key, value = _qkv(packed, 2, 2, torch.float32, True)
    with pytest.raises(NotImplementedError, match="flex has no backward on a CPU"):
        attend_flex(query, key, value, packed.token_layout, 0.3)


def test_the_dense_reference_mask_is_the_rule_of_the_module():
    """TokenLayout.visible (the tests' dense mask, and FlexAttention's mask_mod, which states the same rule) against
    _own_attention's sequences: a query sees exactly its prompt and its own response's earlier tokens."""
    packed = _packings()[3][1]
    visible = packed.token_layout.visible()[:, 0]
    for doc in packed.documents:
        prompt = list(range(doc.start, doc.start + doc.prompt_length))
        offset = doc.start + doc.prompt_length
        for length in doc.response_lengths:
            own = list(range(offset, offset + length))
            for j, q in enumerate(own):
                assert torch.nonzero(visible[doc.row, q]).flatten().tolist() == prompt + own[:j + 1]
            offset += length
