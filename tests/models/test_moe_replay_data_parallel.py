"""Routing replay at DP 2: every replica's update meets the routes of its rows, which another replica's share of the
old-log-prob pass may have computed (one 2-rank torchrun launch)."""
import pytest
import torch

from tests.models.torchrun import REPO, run_torchrun

pytestmark = pytest.mark.distributed  # a torchrun world: not in make test-fast

WORKER = REPO / "tests" / "models" / "workers" / "moe_replay_worker.py"


@pytest.fixture(scope="module")
def reports(module_tmp):
    out = module_tmp("moe_replay_dp") / "report.pt"
    run_torchrun(WORKER, 2, str(out), timeout=600)
    return torch.load(out, map_location="cpu")


def test_every_replica_holds_every_sequences_routes_after_the_pass(reports):
    """The pass's routes are gathered over the replicas with its log-probs (training/logprob_passes.py)."""
    assert [report["dp2"]["kept"] for report in reports] == [4, 4]
    assert reports[0]["dp1"]["kept"] == 4


def test_the_first_updates_ratio_is_one_on_every_replica(reports):
    """Routes forced far from the model's own: a row routed live in the update would move its log ratio by ~1."""
    for value in [reports[0]["dp1"]["log_ratio_max"]] + [report["dp2"]["log_ratio_max"] for report in reports]:
        assert value < 1e-5
