"""Routing replay at DP 2 and at EP 2: every replica's update meets the routes of its rows, which another replica's
share of the old-log-prob pass may have computed; at EP 2 the routes are laid out on each rank's own tokens before
they are sent to their experts (one 2-rank torchrun launch: tests/models/workers/moe_replay_worker.py)."""
import pytest
import torch

from tests.models.test_moe import TOLERANCE, hf_forced_logprobs, random_hf_model, tiny_config
from tests.models.torchrun import REPO, run_torchrun

pytestmark = pytest.mark.distributed  # a torchrun world: not in make test-fast

WORKER = REPO / "tests" / "models" / "workers" / "moe_replay_worker.py"
RATIO = 1e-5  # first-update |log ratio| when every row meets its routes: fp32 noise of another packing (test_moe)
MOVED = 1e-2  # ... and at least this when a row routes live instead (2.7 measured in test_moe, routes forced)


@pytest.fixture(scope="module")
def report(module_tmp):
    out = module_tmp("moe_replay_dp") / "report.pt"
    run_torchrun(WORKER, 2, str(out), timeout=600)
    return torch.load(out, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def reference(report):
    """transformers' log-probs of each sequence alone, its routers forced to the routes given (the worker's weights:
    test_moe's random model, seed 7; temperature 1, the trainer's)."""
    hf = random_hf_model(tiny_config(), seed=7)
    return {key: hf_forced_logprobs(hf, report["sequences"], report[key], 1.0) for key in ("forced", "swapped")}


def worst(old, reference, indices=None):
    """Largest |pass log-prob - reference| over the sequences `indices` (all by default)."""
    indices = range(len(reference)) if indices is None else indices
    return max((torch.tensor(old[i]) - reference[i]).abs().max().item() for i in indices)


def assert_r3_pass_takes_the_given_routes(layout, forced, reference):
    """The pass recorded exactly the given routes of every sequence (what the routers took, gathered over the
    replicas) and its log-probs are transformers' routed alike."""
    assert layout["kept"] == len(forced) == len(layout["recorded"])
    for recorded, given in zip(layout["recorded"], forced):
        assert torch.equal(recorded, given)
    assert worst(layout["old"], reference) < TOLERANCE


def test_every_replica_holds_every_sequences_routes_after_the_pass(report):
    """The pass's routes are gathered over the replicas with its log-probs (training/logprob_passes.py)."""
    count = len(report["sequences"])
    assert report["ranks"][0]["dp1"]["kept"] == count
    for layout in ("dp2", "ep2"):
        assert [ranks[layout]["kept"] for ranks in report["ranks"]] == [count, count], layout


def test_the_first_updates_ratio_is_one_on_every_replica(report):
    """r3, routes forced far from the model's own: a row routed live in the update would move its log ratio by ~1."""
    values = [report["ranks"][0]["dp1"]["log_ratio_max"]] + [
        ranks[layout]["log_ratio_max"] for ranks in report["ranks"] for layout in ("dp2", "ep2")]
    print(f"\nfirst update's max |log ratio| (dp1, then each rank's dp2, ep2): {values}")
    assert max(values) < RATIO


def test_at_ep2_r3s_pass_records_the_engines_routes_and_gives_their_log_probs(report, reference):
    """On each EP rank: the routes the pass recorded are the engine's, exactly, and the log-probs transformers'
    routed alike (test_moe's bound). The same check fails with two sequences' prompt routes swapped (the routes
    recorded then are the swapped ones, and both sequences' log-probs move by more than 0.1): a route meeting the
    wrong row or token, on this rank or in the gather, would fail it."""
    for ranks in report["ranks"]:
        layout = ranks["ep2"]
        print(f"\nEP 2 r3 pass: max |log-prob - transformers forced| {worst(layout['old'], reference['forced']):.1e}")
        assert_r3_pass_takes_the_given_routes(layout, report["forced"], reference["forced"])
        swapped = layout["swapped"]
        assert_r3_pass_takes_the_given_routes(swapped, report["swapped"], reference["swapped"])
        assert not torch.equal(swapped["recorded"][0], report["forced"][0])
        assert worst(swapped["old"], reference["forced"], (0, 1)) > 0.1
        with pytest.raises(AssertionError):
            assert_r3_pass_takes_the_given_routes(swapped, report["forced"], reference["forced"])


def test_at_ep2_r2s_recorded_routes_reach_every_replicas_update(report):
    """r2: each replica's pass records the routes of its own share (forced there, far from the model's own); the
    update's rows, half of them from the other replica's share, meet them: |log ratio| < 1e-5 on each rank. Without
    the pass's gather each replica holds its own share's routes only, and routes the other rows live: more than
    1e-2."""
    count = len(report["sequences"])
    for rank, ranks in enumerate(report["ranks"]):
        r2, ungathered = ranks["ep2"]["r2"], ranks["ep2"]["r2_ungathered"]
        print(f"\nrank {rank} r2 at EP 2: first update's max |log ratio| {r2['log_ratio_max']:.1e}, "
              f"without the gather {ungathered['log_ratio_max']:.2f}")
        assert r2["kept"] == count and r2["log_ratio_max"] < RATIO
        assert ungathered["kept"] == len(range(rank, count, 2)) and ungathered["log_ratio_max"] > MOVED
