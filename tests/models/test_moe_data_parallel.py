"""An MoE agent's load-balancing loss and router figures at DP 2 equal DP 1's (one 2-rank torchrun launch)."""
import pytest
import torch

from hacpo_megatron.models.moe_router import ROUTER_METRICS
from tests.models.torchrun import REPO, run_torchrun

pytestmark = pytest.mark.distributed  # a torchrun world: not in make test-fast

WORKER = REPO / "tests" / "models" / "workers" / "moe_router_worker.py"


@pytest.fixture(scope="module")
def report(module_tmp):
    out = module_tmp("moe_dp") / "report.pt"
    run_torchrun(WORKER, 2, str(out), timeout=600)
    return torch.load(out, map_location="cpu")


def test_the_load_balancing_gradient_at_dp2_is_dp1s(report):
    """DP 1 runs the update's two micro-batches, DP 2 one on each replica: each replica's share of the loss is its
    micro-batch's tokens over both replicas' (the trainer packs the other replica's rows to count them), and DDP
    sums the replicas' gradients. The tolerance is test_moe's (fp32 noise of the policy gradient subtracted)."""
    for one, two in zip(report["dp1"]["aux_gradients"], report["dp2"]["aux_gradients"]):
        assert one.norm() > 1e-4 and ((one - two).norm() / one.norm()) < 1e-3


def test_the_router_figures_at_dp2_are_dp1s(report):
    """The figures are sums over the replicas: the same update's, whatever the coefficient."""
    for figures in ("figures", "figures_without"):
        for key in ROUTER_METRICS:
            assert report["dp2"][figures][key] == pytest.approx(report["dp1"][figures][key], rel=1e-6), key
    assert report["dp2"]["figures"]["loss"] == pytest.approx(report["dp1"]["figures"]["loss"], rel=1e-5)
