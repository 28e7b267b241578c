import pytest
import torch

from hacpo_megatron.rollout.base import SamplingParams, WeightCheck, send_weights_in_buckets, weight_buckets
from hacpo_megatron.rollout.embedded import EmbeddedEngine, hf_model_from_config

TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=50257, hidden_size=32,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5)


def make_engine(tokenizer, seed=0, eos=None):
    model = hf_model_from_config(TINY, seed=seed)
    eos = eos if eos is not None else [tokenizer.eos_token_id]
    return EmbeddedEngine(model, tokenizer, eos_token_ids=eos, pad_token_id=tokenizer.eos_token_id,
                          max_batch_sequences=5)


PROMPTS = [[464, 3139, 286], [40, 588, 257, 1598, 13, 318]]  # different lengths: left padding is exercised


def test_generates_n_completions_per_prompt_with_consistent_fields(tokenizer):
    engine = make_engine(tokenizer)
    out = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=6, seed=1))
    assert [len(group) for group in out] == [3, 3]
    for group in out:
        for c in group:
            assert 1 <= len(c.token_ids) <= 6
            assert len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length")
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_a_teacher_forced_forward_at_the_temperature(tokenizer, temperature):
    engine = make_engine(tokenizer)
    out = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5, temperature=temperature, seed=3))
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = engine.model(ids).logits[0].float()
            logp = torch.log_softmax(logits / temperature, -1)
            expected = [logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(c.token_ids)]
            assert c.logprobs == pytest.approx(expected, abs=2e-4)


def test_same_seed_same_samples_and_global_rng_untouched(tokenizer):
    engine = make_engine(tokenizer)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=7))
    after = torch.rand(1)
    b = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=7))
    c = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=8))
    assert [[x.token_ids for x in g] for g in a] == [[x.token_ids for x in g] for g in b]
    assert [[x.token_ids for x in g] for g in a] != [[x.token_ids for x in g] for g in c]
    assert torch.equal(before, after)


def test_end_of_sequence_cuts_the_response_and_length_marks_truncation(tokenizer):
    every_token_ends = make_engine(tokenizer, eos=list(range(TINY["vocab_size"])))
    out = every_token_ends.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" and not c.truncated for g in out for c in g)
    never_ends = make_engine(tokenizer, eos=[-1])
    out = never_ends.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=4, seed=0))
    assert all(len(c.token_ids) == 4 and c.truncated for g in out for c in g)


def test_weight_update_changes_generation_and_check_mode_confirms_equality(tokenizer):
    engine = make_engine(tokenizer, seed=0)
    other = hf_model_from_config(TINY, seed=1)
    new_weights = list(other.state_dict().items())
    params = SamplingParams(n=2, max_new_tokens=8, seed=5)
    before = engine.generate(PROMPTS, params)
    assert not engine.check_weights(new_weights).equal
    calls = []
    buckets = send_weights_in_buckets(engine, new_weights, bucket_bytes=64 * 1024,
                                      each_call=lambda bucket, seconds: calls.append((bucket, seconds)))
    assert buckets > 3
    # every engine call reported: begin, each bucket in order (all of the weights, each once), finish
    assert [bucket is None for bucket, _ in calls] == [True] + [False] * buckets + [True]
    assert [name for bucket, _ in calls[1:-1] for name, _ in bucket] == [name for name, _ in new_weights]
    assert all(seconds >= 0 for _, seconds in calls)
    check = engine.check_weights(iter(new_weights))  # a generator works: weights arrive streamed
    assert check.equal and check.max_abs_diff == 0.0
    after = engine.generate(PROMPTS, params)
    assert [[c.token_ids for c in g] for g in before] != [[c.token_ids for c in g] for g in after]
    reference = EmbeddedEngine(other, tokenizer, eos_token_ids=[tokenizer.eos_token_id],
                               pad_token_id=tokenizer.eos_token_id, max_batch_sequences=5).generate(PROMPTS, params)
    assert [[c.token_ids for c in g] for g in after] == [[c.token_ids for c in g] for g in reference]


def test_bad_weight_names_and_shapes_are_rejected(tokenizer):
    engine = make_engine(tokenizer)
    with pytest.raises(KeyError, match="no weight named"):
        engine.update_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
    check = engine.check_weights([("model.nope", torch.zeros(1)), ("model.norm.weight", torch.zeros(32))])
    assert not check.equal and check.missing == ["model.nope"] and check.mismatched
    assert "model.embed_tokens.weight" in check.unsent and "model.norm.weight" not in check.unsent


def test_check_mode_counts_a_tied_weight_once():
    tied = hf_model_from_config(dict(TINY, tie_word_embeddings=True), seed=0)
    engine = EmbeddedEngine(tied, None, eos_token_ids=[0], pad_token_id=0)
    sent = [(n, t) for n, t in tied.state_dict().items() if n != "lm_head.weight"]  # as the trainer sends it
    assert engine.check_weights(sent).equal


def test_buckets_keep_order_respect_the_size_and_never_split_a_tensor():
    sizes = [10, 10, 30, 5, 5, 100, 1]  # fp32 elements: 40, 40, 120, 20, 20, 400, 4 bytes
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    buckets = list(weight_buckets(tensors, bucket_bytes=80))
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"], ["t6"]]
    assert [name for b in buckets for name, _ in b] == [name for name, _ in tensors]
    with pytest.raises(ValueError):
        list(weight_buckets(tensors, bucket_bytes=0))


def test_weight_checks_merge_into_one_verdict():
    merged = WeightCheck.merge([WeightCheck(True, 0.0), WeightCheck(False, 0.5, ["a"], ["b"], ["c"])])
    assert (merged.equal, merged.max_abs_diff, merged.mismatched, merged.missing, merged.unsent) == \
        (False, 0.5, ["a"], ["b"], ["c"])


def test_sampling_params_are_validated():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)


def test_greedy_decoding_takes_the_argmax_and_ignores_the_seed(tokenizer):
    engine = make_engine(tokenizer)
    a = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5, greedy=True, seed=1))
    b = engine.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=5, greedy=True, seed=2))
    for prompt, group_a, group_b in zip(PROMPTS, a, b):
        assert group_a[0].token_ids == group_a[1].token_ids == group_b[0].token_ids
        tokens = group_a[0].token_ids
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + tokens])).logits[0]
        argmax = logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].argmax(-1).tolist()
        assert tokens == argmax


@pytest.mark.parametrize("block", [1024, 2, 4])  # one block; three; two with the last one padded
def test_draw_samples_each_token_with_its_probability_and_never_an_impossible_one(block):
    from hacpo_megatron.rollout.embedded import draw

    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.1, 0.0, 0.2, 0.7, 0.0])
    rows = 200_000
    counts = torch.bincount(draw(probs.repeat(rows, 1), block=block), minlength=6).double() / rows
    assert counts[[0, 2, 5]].sum() == 0  # zero-probability tokens, first and last included
    assert torch.allclose(counts, probs.double(), atol=0.005)  # 0.005 is > 4 standard errors at 200k draws
    unnormalised = draw((probs * 3).repeat(rows, 1), block=block)  # `draw` needs no normalisation
    assert torch.allclose(torch.bincount(unnormalised, minlength=6).double() / rows, probs.double(), atol=0.005)


def test_nucleus_keeps_the_likeliest_tokens_up_to_top_p():
    from hacpo_megatron.rollout.embedded import nucleus

    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.97, 0.01, 0.01, 0.01]])
    assert torch.equal(nucleus(probs, 1.0), probs)
    # row 0: 0.5 + 0.3 reaches 0.8, so 0.15 and 0.05 go; row 1: the top token alone exceeds 0.8
    assert torch.equal(nucleus(probs, 0.8), torch.tensor([[0.0, 0.5, 0.0, 0.3], [0.97, 0.0, 0.0, 0.0]]))
    assert torch.equal(nucleus(probs, 0.81), torch.tensor([[0.0, 0.5, 0.15, 0.3], [0.97, 0.0, 0.0, 0.0]]))
