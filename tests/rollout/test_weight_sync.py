"""Weight sync from a Megatron agent at TP=2 and at PP=2 into an embedded engine (one 2-process launch).

The worker (tests/rollout/workers/weight_sync_worker.py) does the work; these tests read its facts.
"""
from pathlib import Path

import pytest
import torch

from tests.models.torchrun import run_torchrun
from tests.rollout.workers.weight_sync_worker import BUCKET_BYTES, HF_CONFIG

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "weight_sync_worker.py"
LAYOUTS = ["tp2", "pp2"]


@pytest.fixture(scope="module")
def results(module_tmp):
    out = module_tmp("weight_sync")
    run_torchrun(WORKER, 2, str(out), timeout=240)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def on_engine_rank(results, layout):
    rank = results[0][layout]["engine_rank"]
    return results[rank][layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_engine_rank_is_the_last_stage_tp_rank_0(results, layout):
    assert results[0][layout]["engine_rank"] == {"tp2": 0, "pp2": 1}[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_starts_with_other_weights_and_the_check_mode_sees_it(results, layout):
    before = on_engine_rank(results, layout)["check_before"]
    assert not before.equal and before.mismatched and before.max_abs_diff > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_after_sync_the_check_mode_says_equal_with_max_diff_zero(results, layout):
    facts = on_engine_rank(results, layout)
    for metrics in (facts["metrics"], facts["metrics_after_step"]):  # first sync, and after a "training step"
        check = metrics.check
        assert check.equal and check.max_abs_diff == 0.0, (check.mismatched, check.missing, check.unsent)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_several_bounded_buckets_carry_every_byte(results, layout):
    facts = on_engine_rank(results, layout)
    metrics = facts["metrics"]
    assert metrics.bytes == facts["model_bytes"]
    # a bucket exceeds the bound only when one tensor does: the 1000 x hidden fp32 embedding
    embedding_bytes = HF_CONFIG["vocab_size"] * HF_CONFIG["hidden_size"] * 4
    assert metrics.largest_bucket_bytes == embedding_bytes > BUCKET_BYTES
    # greedy packing: every bucket but the embedding's holds at most BUCKET_BYTES
    assert metrics.buckets >= 1 + -(-(facts["model_bytes"] - embedding_bytes) // BUCKET_BYTES)
    assert metrics.buckets >= 5
    assert metrics.tensors == 46  # embedding, 4 layers x 11 HF tensors, final norm (lm_head is tied)
    assert metrics.seconds > 0 and metrics.bytes_per_second > 0
    assert metrics.as_dict()["weight_sync/buckets"] == metrics.buckets


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_generates_exactly_like_transformers_with_the_exported_weights(results, layout):
    facts = on_engine_rank(results, layout)
    assert facts["reference_missing_keys"] == ["lm_head.weight"]  # tied to the embedding
    tokens, logprobs = facts["engine_generation"]
    assert (tokens, logprobs) == facts["reference_generation"]  # same tokens, same log-probs, bitwise


@pytest.mark.parametrize("layout", LAYOUTS)
def test_other_ranks_take_part_but_talk_to_no_engine(results, layout):
    other = results[1 - results[0][layout]["engine_rank"]][layout]
    assert other["metrics"].bytes == 0 and other["metrics"].check is None and other["metrics"].seconds > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_engine_lost_mid_sync_ends_the_sync_on_every_rank_and_the_next_sync_delivers_all(results, layout):
    engine_side = on_engine_rank(results, layout)
    lost = engine_side["metrics_engine_lost"]
    assert lost.engine_lost and lost.check is None and lost.buckets == 3  # the third bucket found it dead
    assert lost.as_dict()["weight_sync/engine_losses"] == 1.0
    other = results[1 - results[0][layout]["engine_rank"]][layout]
    assert not other["metrics_engine_lost"].engine_lost  # only the engine rank knows; the loop tells the rest
    resent = engine_side["metrics_resent"]
    assert not resent.engine_lost and resent.check.equal and resent.check.max_abs_diff == 0.0
    assert resent.bytes == engine_side["model_bytes"]
