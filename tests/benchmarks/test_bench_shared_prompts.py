"""benchmarks/bench_shared_prompts.py without a model: its step has the real-model run's shape, and its rows
fill a HACPO learner's update grid (own and other answers of every prompt, old log-probs where they belong)."""
import argparse

import torch

from hacpo_megatron.models.logprobs import SequenceLogProbs
from hacpo_megatron.training.batch import mini_batches
from tests.benchmarks.scripts import load_benchmark

bench = load_benchmark("bench_shared_prompts")
ARGS = argparse.Namespace(prompts=4, samples=3, prompt_length=20, own_length=10, cross_length=3)


def test_step_draws_lengths_around_the_means_and_is_seeded():
    batch = bench.step_sequences(ARGS, vocab=100)
    assert len(batch) == 4 and batch == bench.step_sequences(ARGS, vocab=100)
    for prompt, own, cross in batch:
        assert 12 <= len(prompt) <= 28 and len(own) == len(cross) == 3
        assert all(6 <= len(a) <= 14 for a in own) and all(2 <= len(a) <= 4 for a in cross)
        assert all(3 <= t < 100 for t in prompt + sum(own, []) + sum(cross, []))


def test_rows_fill_the_learners_update_grid():
    batch = bench.step_sequences(ARGS, vocab=100)
    own = [(p, a) for p, answers, _ in batch for a in answers]
    lengths = torch.tensor([len(a) for _, a in own])
    logprobs = SequenceLogProbs.from_token_logprobs(-torch.ones(len(own), int(lengths.max())), lengths)
    rows = bench.learner_rows(batch, logprobs)
    updates = mini_batches(rows, bench.update_schedule(ARGS))
    assert [len(u) for u in updates] == [12, 12]  # M = 2 updates, as in the run: 2 prompts x 3 samples x 2 sources
    for row in rows:
        prompt, answers, others = batch[row.prompt_index]
        assert row.prompt_ids == prompt
        if row.is_cross:
            assert row.response_ids == others[row.sample_index] and row.source == 1
        else:  # the mean old log-prob per token of its own answer: -1
            assert row.response_ids == answers[row.sample_index] and row.old_seq_logp == -1.0
    assert {r.advantage for r in rows} == {1.0, -1.0}
