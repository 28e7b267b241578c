"""The held-out evaluation's figures per problem (rollout_pipeline.held_out_of): the mean score of a problem's
answers, the share of them cut at the length limit, their mean tokens, in the order the engines return them."""
import pytest

from hacpo_megatron.orchestrator.rollout_pipeline import held_out_of
from hacpo_megatron.rollout.base import Completion


def answer(tokens, finish):
    return Completion(token_ids=list(range(tokens)), text="x", logprobs=[0.0] * tokens, finish_reason=finish)


def test_each_problem_gets_the_mean_over_its_own_answers():
    groups = [[answer(4, "stop"), answer(96, "length")],  # problem 0: one of two answers cut at the limit
              [answer(10, "stop"), answer(20, "stop")],
              [answer(96, "length"), answer(96, "length")]]
    held_out = held_out_of(groups, [1.0, 0.0, 0.5, 1.0, 0.0, 0.0])
    assert held_out.scores == pytest.approx([0.5, 0.75, 0.0])
    assert held_out.truncated == pytest.approx([0.5, 0.0, 1.0])
    assert held_out.tokens == pytest.approx([50.0, 15.0, 96.0])
    greedy = held_out_of([[answer(3, "stop")], [answer(7, "length")]], [1.0, 0.0])  # one answer a problem
    assert (greedy.scores, greedy.truncated, greedy.tokens) == ([1.0, 0.0], [0.0, 1.0], [3.0, 7.0])


def test_scores_that_do_not_match_the_answers_are_an_error_not_a_misaligned_table():
    with pytest.raises(ValueError, match="3 scores for groups of sizes"):
        held_out_of([[answer(1, "stop"), answer(1, "stop")], [answer(1, "stop"), answer(1, "stop")]], [1.0] * 3)
    with pytest.raises(ValueError, match="groups of sizes \\[1, 2\\]"):
        held_out_of([[answer(1, "stop")], [answer(1, "stop"), answer(1, "stop")]], [1.0] * 3)
