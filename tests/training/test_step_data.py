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
