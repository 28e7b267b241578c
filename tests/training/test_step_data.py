"""The step's data as plain Python: over-long prompts left out, Naive's old log-probs of shared rows."""
import pytest

from hacpo_megatron.bridge import load_tokenizer, render_prompt
from hacpo_megatron.data.records import PromptRecord, user_prompt
from hacpo_megatron.training.batch import SequenceRow
from hacpo_megatron.training.step_data import drop_overlong_prompts, with_learner_old_logprobs


def record(question):
    return PromptRecord(question, user_prompt(question), "1", "test", {})


def test_a_prompt_too_long_for_any_agent_is_left_out_and_counted():
    qwen, llama = load_tokenizer("qwen3"), load_tokenizer("llama3.2")
    prompts = [record("What is 1 + 1?"), record("word " * 40), record("What is 2 + 2?" + " really" * 8)]
    lengths = [(len(render_prompt(qwen, p.messages)), len(render_prompt(llama, p.messages))) for p in prompts]
    assert lengths[0][0] != lengths[0][1]  # the two chat renderings differ in length
    limit = max(lengths[0])  # the first prompt fits both tokenizers exactly at the limit
    kept, skipped = drop_overlong_prompts(prompts, [qwen, llama], limit)
    assert kept == [prompts[0]] and skipped == 2
    # one token short for the tokenizer that renders it longer: left out for every agent
    assert drop_overlong_prompts(prompts[:1], [qwen, llama], limit - 1) == ([], 1)
    assert drop_overlong_prompts(prompts[:1], [qwen], min(lengths[0])) == (prompts[:1], 0)
    assert drop_overlong_prompts(prompts, [qwen, llama], 10_000) == (prompts, 0)


def test_naive_rates_shared_rows_against_the_learner_own_old_log_probs():
    rows = [SequenceRow([1], [2, 3], 0.5, -1.0, False, 0, 0, 0),
            SequenceRow([1], [4, 5, 6], 0.5, -7.0, True, 1, 0, 0),
            SequenceRow([1], [7], 0.5, -1.5, False, 0, 0, 1),
            SequenceRow([1], [8, 9], 0.5, -9.0, True, 1, 0, 1)]
    out = with_learner_old_logprobs(rows, [[-0.5, -1.0, -1.5], [-2.0, -4.0]])
    assert [r.old_seq_logp for r in out] == [-1.0, pytest.approx(-1.0), -1.5, pytest.approx(-3.0)]
    assert out[0] is rows[0] and rows[1].old_seq_logp == -7.0  # own rows untouched, inputs not mutated
    with pytest.raises(ValueError, match="2 rows of other agents"):
        with_learner_old_logprobs(rows, [[-1.0]])


def test_engine_log_probs_stand_in_for_old_ones_in_prompt_sample_order():
    from hacpo_megatron.rollout.base import Completion
    from hacpo_megatron.training.step_data import engine_old_logprobs

    completions = [[Completion([5, 6], "a", [-0.5, -1.5], "stop"), Completion([7], "b", [-2.0], "stop")],
                   [Completion([8, 9, 2], "c", [-0.1, -0.2, -0.3], "stop"), Completion([4], "d", [-4.0], "length")]]
    old = engine_old_logprobs(completions)
    assert old.tokens == [[-0.5, -1.5], [-2.0], [-0.1, -0.2, -0.3], [-4.0]]
    assert old.lengths == [2, 1, 3, 1] and old.sums == [-2.0, -2.0, pytest.approx(-0.6), -4.0]
    assert old.mean(2) == pytest.approx(-0.2)


def test_engine_log_probs_are_refused_beyond_a_tenth_of_the_clip_range():
    from hacpo_megatron.training.step_data import check_engine_logprobs

    close = {"rollout/logprob_diff_mean": 2e-7, "rollout/logprob_diff_max": 2e-6}
    check_engine_logprobs({"a": close, "b": close}, clip=3e-4)  # vLLM on CPU, fp32: accepted
    far = {"rollout/logprob_diff_mean": 4e-5, "rollout/logprob_diff_max": 1e-2}
    with pytest.raises(RuntimeError, match=r"agent b's engine log-probs .* 4.00e-05 .* above 3.0e-05"):
        check_engine_logprobs({"a": close, "b": far}, clip=3e-4)
