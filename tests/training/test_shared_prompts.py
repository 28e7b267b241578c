"""A trainer that packs answers behind one copy of their prompt computes what one row per sequence computes."""
import pytest
import torch

from tests.models.torchrun import REPO, run_torchrun

pytestmark = pytest.mark.distributed  # a torchrun world: not in make test-fast

WORKER = REPO / "tests" / "training" / "workers" / "shared_prompts_worker.py"


@pytest.fixture(scope="module")
def report(module_tmp):
    out = module_tmp("shared") / "report.pt"
    run_torchrun(WORKER, 1, str(out), timeout=300)
    return torch.load(out, weights_only=False, map_location="cpu")


def test_the_cpu_trainer_shares_prompts_when_asked(report):
    assert report["shared"]["share_prompts"] is True and report["separate"]["share_prompts"] is False


@pytest.mark.parametrize("variant", ["shared", "packed", "shared_packed", "shared_packed_sdpa"])
def test_old_logprobs_come_back_in_the_callers_order(report, variant):
    shared, separate = report[variant]["logprobs"], report["separate"]["logprobs"]
    assert torch.equal(shared.lengths, separate.lengths)
    assert (shared.token_logprobs - separate.token_logprobs).abs().max() <= 1e-5


@pytest.mark.parametrize("variant", ["shared", "packed", "shared_packed", "shared_packed_sdpa"])
def test_updates_are_the_same(report, variant):
    shared, separate = report[variant], report["separate"]
    for update, (a, b) in enumerate(zip(shared["metrics"], separate["metrics"])):
        # A row matched to another row's advantage or old log-prob would move loss, ratios and gradient by
        # far more (ratios by ~1e-1). The first update agrees to float reassociation (~1e-7); Adam at lr 1e-2
        # amplifies that into ratios ~1e-5 apart by the fourth update, and the loss there is a sum of terms
        # of ~0.1 cancelling to 0.005, so it moves by as much absolutely (megatron-core 0.19.2, shared and
        # packed rows: 1.25e-5 apart; ratios 1.1e-5; the gradient norm 4.6e-5 of 3.6).
        for key in ("loss", "grad_norm", "own_ratio_mean", "cross_ratio_mean", "num_own", "num_cross"):
            assert a[key] == pytest.approx(b[key], rel=1e-5 if update == 0 else 3e-4,
                                           abs=1e-8 if update == 0 else 3e-5), (update, key)
        # the shared rows hold fewer tokens for the same work: the prompt's model FLOPs count once per row
        assert a["perf/model_flops_per_s"] > 0
    for p, q in zip(shared["params"], separate["params"]):
        # Adam: an entry whose gradient is ~0 moves by up to lr per update either way, float reassociation
        # deciding which (the shared rows' blocked attention sums in another order than the plain rows'
        # causal one: up to 0.15 % of a matrix's entries ended over 1e-5 apart, the largest by 2e-4, on one
        # machine; 0.92 % on another CPU of the same kind, with the losses and ratios above still in tolerance);
        # a wrong mask or row would move every entry, and the log-prob and loss checks above.
        apart = (p - q).abs()
        assert (apart > 1e-5).float().mean() < 2e-2 and apart.max() <= 4 * 1e-2
    losses = [m["loss"] for m in shared["metrics"]]
    assert len(set(round(x, 7) for x in losses)) > 1


def test_a_token_budget_bounds_every_micro_batch_and_removes_the_padding(report):
    """Rows of 6 + 1..5 tokens: by rows, micro-batches of 5 are padded to their longest; packed end to end to 16
    tokens, no micro-batch holds more than 16 tokens (all rows here are shorter) and only a last row is padded."""
    for name in ("packed", "shared_packed", "shared_packed_sdpa"):
        for m in report[name]["metrics"]:
            assert 0 < m["micro_batch_tokens_max"] <= 16, name
    separate = [m["padding_frac"] for m in report["separate"]["metrics"]]
    packed = [m["padding_frac"] for m in report["packed"]["metrics"]]
    assert min(separate) > 0.1 and max(packed) < min(separate)
