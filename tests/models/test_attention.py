"""Blocked shared-prompt attention (models/attention.py) against dense masked attention in float64.

The reference is the textbook formula over the whole row with the mask pack_sequences builds for
shared-prompt rows: softmax(scale * Q K^T, masked) V. Blocked attention must give every real token the
same context and the same gradients, for rows of different prompt lengths, one or many responses,
grouped-query heads, and zero at padding.
"""
import math

import pytest
import torch

from hacpo_megatron.models.attention import attend_in_blocks, attention_blocks
from hacpo_megatron.models.logprobs import pack_sequences


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

    blocked = attend_in_blocks(query, key, value, attention_blocks(packed.layout), scale)
    reference = _dense_reference(query, key, value, packed.attention_mask, scale)

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
    prompt_block, response_block = attention_blocks([(3, [2, 2])])
    assert prompt_block.queries.tolist() == [[0, 1, 2]]
    assert prompt_block.allowed[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert response_block.queries.tolist() == [[3, 4], [5, 6]]
    assert response_block.keys.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, 6]]
    assert response_block.allowed[1, 0].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_answers_of_very_different_lengths_go_to_different_stacks():
    """A 3-token answer is not padded to a 40-token one's width: the prompt stack, then long, then short."""
    stacks = attention_blocks([(4, [40, 3, 30])])
    assert [tuple(s.queries.shape) for s in stacks] == [(1, 4), (2, 40), (1, 3)]
    assert stacks[2].keys.shape == (1, 7)  # the prompt's 4 keys and its own 3
