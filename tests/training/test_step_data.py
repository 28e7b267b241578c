"""The step's data as plain Python: over-long prompts left out, Naive's old log-probs of shared rows, each learner's
rows (learner_rows: the advantage and old log-prob every row carries)."""
import math

import pytest
import torch

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


# ---- learner_rows: which advantage and which old log-prob each of a learner's rows carries ----

def _two_agent_step():
    """Agent 0 (Qwen3 tokens) and agent 1 (Llama 3.2 tokens), B = 3 prompts, G = 2 answers each. Every advantage
    effective[k, j, b, i] and every log-prob is a different number, so a row that takes the wrong one shows."""
    from hacpo_megatron.rollout.base import Completion
    from hacpo_megatron.training.step_data import OldLogProbs

    qwen, llama = load_tokenizer("qwen3"), load_tokenizer("llama3.2")
    tokenizers = [qwen, llama]
    prompts = [record(f"What is {b} + {b}?") for b in range(3)]
    B, G = 3, 2
    texts = [[[f"agent {j} prompt {b} answer {i}: {2 * b}" for i in range(G)] for b in range(B)] for j in range(2)]
    rollouts = []
    for j, tokenizer in enumerate(tokenizers):
        agent = []
        for b in range(B):
            group = []
            for i in range(G):
                ids = tokenizer.encode(texts[j][b][i], add_special_tokens=False) + [tokenizer.eos_token_id]
                logprobs = [-0.01 * (1 + j * 100 + b * 10 + i) * (t + 1) for t in range(len(ids))]
                group.append(Completion(ids, texts[j][b][i], logprobs, "stop"))
            agent.append(group)
        rollouts.append(agent)
    # the old log-probs: the trainer's own pass over each agent's answers, (prompt, sample) order, unlike the engine's
    old = []
    for j in range(2):
        tokens = [[x - 0.5 for x in c.logprobs] for group in rollouts[j] for c in group]
        old.append(OldLogProbs(sums=[sum(t) for t in tokens], lengths=[len(t) for t in tokens], tokens=tokens))
    k_, j_, b_, i_ = torch.meshgrid(*(torch.arange(d, dtype=torch.float64) for d in (2, 2, B, G)), indexing="ij")
    effective = 1.0 + k_ + 0.1 * j_ + 0.01 * b_ + 0.001 * i_  # effective[k, j, b, i] = (1 + k).jbi in decimals
    prompt_ids = [[render_prompt(t, p.messages) for p in prompts] for t in tokenizers]
    return dict(prompts=prompts, rollouts=rollouts, old=old, effective=effective, tokenizers=tokenizers,
                prompt_ids=prompt_ids), texts


def test_learner_rows_carry_their_own_advantage_and_old_log_prob():
    """Learner 0's own rows: effective[0, 0, b, i], its trainer's mean old log-prob, the sampled ids. Agent 1's rows:
    effective[0, 1, b, i] (learner first, source second: omega[1, 0] is already in it), in Qwen3's tokens, against
    the source's sum / L_j in Llama tokens (the cross ratio's pi_j)."""
    from hacpo_megatron.training.step_data import learner_rows

    step, texts = _two_agent_step()
    qwen, llama = step["tokenizers"]
    rows, stats = learner_rows(0, trains_on=torch.ones(2, 2, dtype=torch.bool), **step)
    assert stats == {"bridge/dropped": 0.0}
    assert [(r.source, r.prompt_index, r.sample_index) for r in rows] == [
        (j, b, i) for j in range(2) for b in range(3) for i in range(2)]
    for r in rows:
        j, b, i = r.source, r.prompt_index, r.sample_index
        assert r.advantage == pytest.approx(1.0 + 0.1 * j + 0.01 * b + 0.001 * i, abs=1e-12)
        assert r.is_cross == (j == 1)
        assert r.prompt_ids == render_prompt(qwen, step["prompts"][b].messages)
        completion = step["rollouts"][j][b][i]
        old_mean = (completion.logprob_sum - 0.5 * len(completion.token_ids)) / len(completion.token_ids)
        assert r.old_seq_logp == pytest.approx(old_mean, rel=1e-12)  # sum / L_j in the source's tokens
        if j == 0:
            assert r.response_ids == completion.token_ids
            assert r.old_token_logp == pytest.approx([x - 0.5 for x in completion.logprobs])
        else:
            assert r.response_ids == qwen.encode(texts[1][b][i], add_special_tokens=False) + [qwen.eos_token_id]
            assert r.old_token_logp is None
    # learner 1 sees the mirror image: effective[1, 0] on agent 0's answers, in Llama's tokens
    rows, _ = learner_rows(1, trains_on=torch.ones(2, 2, dtype=torch.bool), **step)
    cross = [r for r in rows if r.is_cross]
    expected = [2.0 + 0.01 * b + 0.001 * i for b in range(3) for i in range(2)]  # effective[1, 0, b, i]
    assert [r.advantage for r in cross] == pytest.approx(expected, abs=1e-12)
    assert cross[3].response_ids == llama.encode(texts[0][1][1], add_special_tokens=False) + [llama.eos_token_id]
    # a single-agent algorithm's learner trains on its own rows only
    rows, _ = learner_rows(1, trains_on=torch.eye(2, dtype=torch.bool), **step)
    assert {r.source for r in rows} == {1} and len(rows) == 6


def test_learner_rows_from_older_weights_weigh_own_rows_and_rate_others_against_the_engine():
    """rollout.max_staleness >= 1: own advantages times min(2, (pi_prox / pi_behaviour) ** (1 / L)), other agents'
    rows against the source engine's sum / L_j (the weights that generated them), not its trainer's present one."""
    from hacpo_megatron.training.step_data import OldLogProbs, learner_rows

    step, _ = _two_agent_step()
    # the engines' log-probs at generation: agent 0's answers 0.02 per token below the proximal pass on prompt 0,
    # 0.8 per token below on prompt 1 (weight e^0.8 = 2.23, capped at 2), 0.1 above on prompt 2 (weight e^-0.1)
    shift = {0: -0.02, 1: -0.8, 2: 0.1}
    behaviour = []
    for j in range(2):
        tokens = [[x - 0.5 + shift[b] * (j == 0) - 0.3 * (j == 1) for x in c.logprobs]
                  for b, group in enumerate(step["rollouts"][j]) for c in group]
        behaviour.append(OldLogProbs(sums=[sum(t) for t in tokens], lengths=[len(t) for t in tokens], tokens=tokens))
    rows, stats = learner_rows(0, trains_on=torch.ones(2, 2, dtype=torch.bool), behaviour=behaviour, **step)
    weight = {0: math.exp(0.02), 1: 2.0, 2: math.exp(-0.1)}
    for r in rows:
        j, b, i = r.source, r.prompt_index, r.sample_index
        completion = step["rollouts"][j][b][i]
        L = len(completion.token_ids)
        if j == 0:
            assert r.advantage == pytest.approx((1.0 + 0.01 * b + 0.001 * i) * weight[b], rel=1e-12)
            assert r.old_seq_logp == pytest.approx(completion.logprob_sum / L - 0.5, rel=1e-12)  # proximal
        else:
            assert r.advantage == pytest.approx(1.1 + 0.01 * b + 0.001 * i, rel=1e-12)  # no weight on others' rows
            assert r.old_seq_logp == pytest.approx(completion.logprob_sum / L - 0.8, rel=1e-12)  # behaviour
    assert stats["staleness/behaviour_weight_mean"] == pytest.approx(sum(weight.values()) / 3, rel=1e-12)
    assert stats["staleness/behaviour_weight_capped_frac"] == pytest.approx(1 / 3)


def test_learner_rows_drop_an_answer_of_control_tokens_only_and_count_it():
    from hacpo_megatron.rollout.base import Completion
    from hacpo_megatron.training.step_data import learner_rows

    step, _ = _two_agent_step()
    llama = step["tokenizers"][1]
    header = llama.convert_tokens_to_ids("<|start_header_id|>")
    step["rollouts"][1][2][0] = Completion([header, header], "", [-1.0, -1.0], "length")
    old = step["old"][1]
    old.tokens[4], old.sums[4], old.lengths[4] = [-1.5, -1.5], -3.0, 2
    rows, stats = learner_rows(0, trains_on=torch.ones(2, 2, dtype=torch.bool), **step)
    assert stats["bridge/dropped"] == 1.0 and len(rows) == 11
    assert (1, 2, 0) not in {(r.source, r.prompt_index, r.sample_index) for r in rows}
    # the rows after it keep their own advantages: nothing shifts into the gap
    last = [r for r in rows if r.source == 1][-1]
    assert (last.prompt_index, last.sample_index) == (2, 1) and last.advantage == pytest.approx(1.121)
