"""The pure parts of sequence log-probs and of the HF mapping: no processes."""
import pytest
import torch

from hacpo_megatron.checkpoint.hf_mapping import Kind, shard, to_hf, to_megatron, unshard
from hacpo_megatron.models.architectures import read_architecture
from hacpo_megatron.models.logprobs import SequenceLogProbs, token_logprobs_from_logits
from hacpo_megatron.models.packing import micro_batch_indices, pack_sequences, prompt_grouped
from tests.models.workers.reference import TEST_CONFIGS


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_logprob_at_temperature_is_log_softmax_of_scaled_logits(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=g) * 3
    targets = torch.randint(0, 40, (3, 5), generator=g)
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[..., None])[..., 0]
    got = token_logprobs_from_logits(logits, targets, temperature=temperature)
    torch.testing.assert_close(got, expected)


def test_padded_vocabulary_rows_take_no_probability():
    logits = torch.zeros(1, 1, 8)
    logits[..., 6:] = 50.0  # padding rows with large logits must not matter
    got = token_logprobs_from_logits(logits, torch.tensor([[2]]), vocab_size=6)
    torch.testing.assert_close(got, torch.log(torch.tensor([[1 / 6]])))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_target_logprob_value_and_gradient_match_the_composed_float64_reference(monkeypatch, temperature):
    import hacpo_megatron.models.logprobs as logprobs

    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * 40 + 1)  # chunks of 3 rows: 13 rows end mid-chunk
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(13, 40, generator=g, dtype=torch.float64) * 4).requires_grad_()
    targets = torch.randint(0, 40, (13,), generator=g)
    weights = torch.randn(13, generator=g, dtype=torch.float64)  # a loss that weighs rows differently
    got = logprobs.TargetLogProb.apply(logits, targets, temperature)
    (got * weights).sum().backward()
    reference_logits = logits.detach().clone().requires_grad_()
    expected = torch.log_softmax(reference_logits / temperature, -1).gather(-1, targets[:, None])[:, 0]
    (expected * weights).sum().backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(logits.grad, reference_logits.grad, rtol=0, atol=1e-12)


def test_chunks_are_cache_sized_on_a_cpu_and_few_on_a_gpu():
    """A GPU pays a kernel launch per chunk op: Qwen3's 151,936-word logits of a 3,072-token micro-batch were 512
    chunks when a GPU chunked them like a CPU cache (launch-bound on an H200); a CPU keeps its 4 MB chunks."""
    from hacpo_megatron.models.logprobs import CHUNK_ELEMENTS, chunk_rows

    vocab, tokens = 151_936, 3_072
    assert chunk_rows(vocab, torch.device("cpu")) * vocab <= CHUNK_ELEMENTS
    assert -(-tokens // chunk_rows(vocab, torch.device("cpu"))) > 500
    assert -(-tokens // chunk_rows(vocab, torch.device("cuda"))) <= 8
    assert chunk_rows(vocab, torch.device("cuda")) * vocab * 4 <= 512 * 2**20  # fp32 temporaries stay bounded
    assert chunk_rows(10**9, torch.device("cuda")) == 1


def test_target_logprob_gives_bf16_logits_a_bf16_gradient_and_refuses_a_second_backward():
    from hacpo_megatron.models.logprobs import TargetLogProb

    logits = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.tensor([0, 5, 31, 7])
    out = TargetLogProb.apply(logits, targets, 1.0)
    assert out.dtype == torch.float32  # log-probs in fp32, as the composed version computed them
    expected = torch.log_softmax(logits.detach().float(), -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(out.detach(), expected)
    out.sum().backward(retain_graph=True)
    assert logits.grad.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="backward through the same log-probs twice"):
        out.sum().backward()


def test_padded_vocabulary_rows_get_no_gradient():
    logits = torch.randn(2, 3, 8, requires_grad=True)
    token_logprobs_from_logits(logits, torch.tensor([[1, 2, 3], [0, 4, 5]]), vocab_size=6).sum().backward()
    assert torch.all(logits.grad[..., 6:] == 0) and torch.all(logits.grad[..., :6] != 0)


def test_pack_sequences_one_row_per_sequence_predicts_each_token_from_the_position_before():
    batch = pack_sequences([([1, 2], [3, 4, 5]), ([7], [8])], [0, 1], pad_id=0)
    assert batch.tokens.tolist() == [[1, 2, 3, 4, 5], [7, 8, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert batch.attention_mask() is None  # plain causal attention
    assert batch.targets.tolist() == [3, 4, 5, 8]
    assert list(zip(batch.logit_rows.tolist(), batch.logit_positions.tolist())) == [(0, 1), (0, 2), (0, 3), (1, 0)]
    assert batch.layout == [(2, [3]), (1, [1])]
    assert batch.response_logprobs(torch.tensor([1.0, 2.0, 3.0, 5.0]), 3).tolist() == [[1, 2, 3], [5, 0, 0]]


def test_pack_sequences_with_shared_prompts_puts_each_prompt_once_and_keeps_positions():
    sequences = [([1, 2], [3, 4]), ([9], [8]), ([1, 2], [5, 6, 7]), ([1, 2], [4])]
    batch = pack_sequences(sequences, [0, 1, 2, 3], pad_id=0, share_prompts=True)
    # rows in order of first appearance: [1, 2] with responses 0, 2, 3; then [9] with response 1
    assert batch.indices.tolist() == [0, 2, 3, 1]
    assert batch.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 4], [9, 8, 0, 0, 0, 0, 0, 0]]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 2, 3, 4, 2]  # every response starts at P = 2
    assert batch.targets.tolist() == [3, 4, 5, 6, 7, 4, 8]
    # each response's first token is predicted by the prompt's last position (1), the others by their own
    assert list(zip(batch.logit_rows.tolist(), batch.logit_positions.tolist())) == [
        (0, 1), (0, 2), (0, 1), (0, 4), (0, 5), (0, 1), (1, 0)]
    assert batch.layout == [(2, [2, 3, 1]), (1, [1])]
    allowed = ~batch.attention_mask()[:, 0]
    # response 2 ([5, 6, 7] at 4-6) sees the prompt (0-1) and itself, not response 1 (2-3) nor response 3 (7)
    assert allowed[0, 6].tolist() == [True, True, False, False, True, True, True, False]
    assert allowed[0, 7].tolist() == [True, True, False, False, False, False, False, True]
    assert allowed[0, 1].tolist() == [True, True] + [False] * 6  # the prompt stays causal
    assert allowed[1, 1].tolist() == [True, True] + [False] * 6
    logp = batch.response_logprobs(torch.arange(1.0, 8.0), 3)  # rows in batch.indices order
    assert logp.tolist() == [[1, 2, 0], [3, 4, 5], [6, 0, 0], [7, 0, 0]]


def test_a_shared_prompt_row_stops_growing_at_its_token_limit(monkeypatch):
    from hacpo_megatron.models import packing

    monkeypatch.setattr(packing, "MAX_SHARED_ROW_TOKENS", 8)
    sequences = [([1, 2], [3, 4, 5]), ([1, 2], [6, 7, 8]), ([1, 2], [9]), ([1, 2], [1] * 9)]
    batch = pack_sequences(sequences, range(4), share_prompts=True)
    # 2 + 3 + 3 = 8 fits; the third response would make 9: a new row, which the fourth (alone 11) cannot join
    assert batch.layout == [(2, [3, 3]), (2, [1]), (2, [9])]
    assert batch.indices.tolist() == [0, 1, 2, 3] and batch.tokens.shape == (3, 11)


def test_prompt_grouped_micro_batches_keep_a_prompts_sequences_together():
    sequences = [([1], [2]), ([5], [2]), ([1], [3]), ([5], [4]), ([1], [4])]
    assert prompt_grouped(sequences, 2) == [[0, 2], [4, 1], [3]]
    assert prompt_grouped(sequences, None) == [[0, 2, 4, 1, 3]]


def test_micro_batches_respect_limits_and_cover_everything():
    lengths = [5, 17, 3, 9, 9, 2, 30]
    groups = micro_batch_indices(lengths, max_sequences=2, max_tokens=20)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) <= 2
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 20


def test_sequence_logprobs_sums_and_mask():
    result = SequenceLogProbs.from_token_logprobs(torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 9.0, 9.0]]),
                                                  torch.tensor([2, 1]))
    assert result.sums.tolist() == [-3.0, -0.5]
    assert result.response_mask.tolist() == [[True, True, False], [True, False, False]]


@pytest.mark.parametrize("kind,hf_shapes", [
    (Kind.QKV, [(128, 16), (64, 16), (64, 16)]),  # 4 query heads, 2 kv groups, head_dim 32
    (Kind.QKV, [(128,), (64,), (64,)]),  # qkv bias
    (Kind.GATED, [(24, 16), (24, 16)]),
    (Kind.ROW, [(16, 24)]),
    (Kind.VOCAB, [(1000, 16)]),
    (Kind.REPLICATED, [(16,)]),
])
@pytest.mark.parametrize("tp", [1, 2])
def test_mapping_round_trips_through_tp_shards(kind, hf_shapes, tp):
    arch = read_architecture(TEST_CONFIGS["qwen3"])  # 4 heads, 2 groups, head_dim 32, vocab 1000
    hf = [torch.randn(s) for s in hf_shapes]
    full = to_megatron(kind, hf, arch, padded_vocab=1024)
    shards = [shard(kind, full, r, tp) for r in range(tp)]
    assert torch.equal(unshard(kind, shards), full)
    for a, b in zip(to_hf(kind, full, arch), hf):
        assert torch.equal(a, b)


def test_each_tp_rank_holds_the_slice_megatrons_layers_compute_with():
    """What rank r of TP=2 holds, from the HF tensors directly (the round trip above passes any shard/unshard pair that
    invert each other, such as one giving rank 0 all of the gate and rank 1 all of up). Megatron's layers define it:
    the gated MLP's fc1 output is chunked in two on each rank (silu(first half) * second half), so a rank holds its
    own slice of gate and of up; a row-parallel weight is split along its input (columns); the QKV projection along
    whole query groups; the vocabulary along padded rows."""
    arch = read_architecture(TEST_CONFIGS["qwen3"])  # 4 query heads, 2 groups, head_dim 32, hidden 16
    gate, up = torch.randn(24, 16), torch.randn(24, 16)
    full = to_megatron(Kind.GATED, [gate, up], arch, padded_vocab=0)
    for r in range(2):
        mine = slice(12 * r, 12 * (r + 1))
        assert torch.equal(shard(Kind.GATED, full, r, 2), torch.cat([gate[mine], up[mine]]))
    down = torch.randn(16, 24)  # [hidden, intermediate]: rank r multiplies its 12 intermediate features
    for r in range(2):
        assert torch.equal(shard(Kind.ROW, down, r, 2), down[:, 12 * r:12 * (r + 1)])
    q, k, v = torch.randn(128, 16), torch.randn(64, 16), torch.randn(64, 16)  # group g: q heads 2g, 2g+1; k, v head g
    full = to_megatron(Kind.QKV, [q, k, v], arch, padded_vocab=0)
    for g in range(2):  # rank g: its group's two query heads, then that group's key and value head
        assert torch.equal(shard(Kind.QKV, full, g, 2), torch.cat([q[64 * g:64 * (g + 1)], k[32 * g:32 * (g + 1)],
                                                                   v[32 * g:32 * (g + 1)]]))
    embedding = torch.randn(1000, 16)
    full = to_megatron(Kind.VOCAB, [embedding], arch, padded_vocab=1024)
    assert torch.equal(shard(Kind.VOCAB, full, 0, 2), embedding[:512])
    second = shard(Kind.VOCAB, full, 1, 2)
    assert torch.equal(second[:488], embedding[512:]) and not second[488:].any()  # 24 padding rows, zero


def test_qkv_is_interleaved_per_query_group():
    arch = read_architecture(TEST_CONFIGS["qwen3"])  # 2 query heads per group, head_dim 32
    q, k, v = torch.full((128, 1), 0.0), torch.full((64, 1), 1.0), torch.full((64, 1), 2.0)
    q[64:] = 0.5  # heads of group 1
    full = to_megatron(Kind.QKV, [q, k, v], arch, padded_vocab=0)[:, 0]
    group0, group1 = full[:128], full[128:]
    assert group0[:64].eq(0).all() and group0[64:96].eq(1).all() and group0[96:].eq(2).all()
    assert group1[:64].eq(0.5).all() and group1[64:96].eq(1).all()


def test_a_token_budget_packs_sequences_end_to_end_and_no_micro_batch_passes_it():
    from hacpo_megatron.models.packing import token_budget_groups

    sequences = [([1, 2], [3, 4, 5]), ([7], [8]), ([1, 2], [6]), ([9] * 4, [5] * 12), ([7], [2, 2])]
    groups = token_budget_groups(sequences, 8, share_prompts=False)
    assert groups == [[0, 1], [2], [3], [4]]  # 5 + 2; 3 (+ 16 would pass); 16 alone (longer than the budget); 3
    shared = token_budget_groups(sequences, 8, share_prompts=True)
    # in prompt order 0, 2, 1, 4, 3: [1, 2] once (2 + 3 + 1), then [7] (1 + 1) make 8; [7]'s [2, 2] would add 2
    assert shared == [[0, 2, 1], [4], [3]]
    for group in groups:
        batch = pack_sequences(sequences, group, row_tokens=8)
        assert batch.tokens.shape[0] == 1  # one row: the documents end to end
        assert batch.tokens.shape[1] == sum(len(p) + len(r) for p, r in (sequences[i] for i in group))


def test_pack_sequences_to_a_budget_keeps_each_document_its_positions_and_predictions():
    sequences = [([1, 2], [3, 4]), ([7], [8]), ([1, 2], [5])]
    batch = pack_sequences(sequences, [0, 1, 2], row_tokens=6)
    # documents of 4, 2 and 3 tokens: 4 + 2 fill the first row, the third starts another
    assert batch.tokens.tolist() == [[1, 2, 3, 4, 7, 8], [1, 2, 5, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]]
    assert [(d.row, d.start, d.prompt_length, d.response_lengths) for d in batch.documents] == [
        (0, 0, 2, (2,)), (0, 4, 1, (1,)), (1, 0, 2, (1,))]
    assert batch.targets.tolist() == [3, 4, 8, 5]
    assert list(zip(batch.logit_rows.tolist(), batch.logit_positions.tolist())) == [(0, 1), (0, 2), (0, 4), (1, 1)]
    allowed = ~batch.attention_mask()[0, 0]
    assert allowed[5].tolist() == [False, False, False, False, True, True]  # [7, 8] sees only itself
    assert batch.layout == [(2, [2]), (1, [1]), (2, [1])]  # what training_flops counts


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_logits_get_the_float64_references_log_probs_and_gradient_to_bf16_rounding(monkeypatch, temperature):
    """bf16 logits (a GPU's) take the path without an fp32 copy of [N, V]: each chunk in fp32, the gradient written
    in bf16. Against the composed float64 formula on the same (bf16-representable) logits, chunks ending mid-batch."""
    import hacpo_megatron.models.logprobs as logprobs

    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * 40 + 1)
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(13, 40, generator=g) * 4).bfloat16().requires_grad_()
    targets = torch.randint(0, 40, (13,), generator=g)
    weights = torch.randn(13, generator=g)
    got = logprobs.TargetLogProb.apply(logits, targets, temperature)
    (got * weights).sum().backward()
    reference_logits = logits.detach().double().requires_grad_()
    expected = torch.log_softmax(reference_logits / temperature, -1).gather(-1, targets[:, None])[:, 0]
    (expected * weights.double()).sum().backward()
    assert got.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)  # fp32 arithmetic on exact inputs
    # the gradient: fp32 per chunk, rounded once to bf16 (8 bits of mantissa)
    torch.testing.assert_close(logits.grad.double(), reference_logits.grad, rtol=1e-2, atol=1e-3)
    assert (logits.grad.double() - reference_logits.grad.bfloat16().double()).abs().max() <= 1e-6
