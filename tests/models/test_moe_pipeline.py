"""An MoE agent in pipeline stages (issue 52) in a torchrun world: at PP 2 x EP 2 it computes what the same agent
computes at PP 1 x EP 2: its live and replayed log-prob passes, one update's gradients (policy and load-balancing
loss, clipped) and weights, the router's figures (each stage routes its own layer: summed over the stages), the
weights it pushes to an engine; each stage keeps the engine's routes of its own layer (r3), and the update replays
them (tests/models/workers/moe_pp_worker.py)."""
import pytest
import torch

from hacpo_megatron.models.moe_router import ROUTER_METRICS
from tests.models.test_moe_expert_parallel_world import EPS, ULPS, _worst_relative
from tests.models.torchrun import REPO, run_torchrun

pytestmark = pytest.mark.distributed  # a torchrun world: not in make test-fast

WORKER = REPO / "tests" / "models" / "workers" / "moe_pp_worker.py"


@pytest.fixture(scope="module")
def saved(module_tmp):
    out = module_tmp("moe_pp") / "report.pt"
    run_torchrun(WORKER, 4, str(out), timeout=900)
    return torch.load(out, map_location="cpu", weights_only=False)


def test_each_stage_holds_its_layer_and_each_ep_rank_its_experts(saved):
    for rank, report in enumerate(saved["ranks"]):
        layout = report["pp2"]
        assert layout["place"] == dict(pp_rank=rank // 2, dp_rank=rank % 2, ep_rank=rank % 2)
        assert layout["layers"] == [rank // 2]
        assert layout["local_experts"] == [list(range(4 * (rank % 2), 4 * (rank % 2) + 4))]


def test_the_weight_push_from_two_stages_leaves_the_engine_equal_to_the_trainer(saved):
    for name, rank in (("pp1", 0), ("pp2", 2)):  # the engine rank: DP 0 of the last stage
        push = saved["ranks"][rank][name]["push"]
        assert push["equal"] and push["max_abs_diff"] == 0.0 and not push["missing"] and not push["unsent"], name
        assert push["tensors"] == push["expected"], name


def test_the_passes_at_pp2_are_pp1s(saved):
    reference = saved["ranks"][0]["pp1"]
    for report in saved["ranks"]:
        for key in ("live", "forced"):
            scale = max(t.abs().max().item() for t in reference[key])
            for ours, theirs in zip(report["pp2"][key], reference[key]):
                assert (ours - theirs).abs().max().item() <= ULPS * EPS * scale, key
    # forcing the routes moved the log-probs: the routers took them
    assert max((a - b).abs().max().item() for a, b in zip(reference["live"], reference["forced"])) > 0.1


def test_each_stage_keeps_the_engines_routes_of_its_own_layer(saved):
    forced = saved["forced"]
    for rank, report in enumerate(saved["ranks"]):
        if rank < 2:
            assert all(torch.equal(kept, route) for kept, route in zip(report["pp1"]["kept"], forced))
        stage = rank // 2
        assert all(torch.equal(kept, route[:, [stage]]) for kept, route in zip(report["pp2"]["kept"], forced)), rank


def test_an_update_at_pp2_is_pp1s_and_replays_the_routes(saved):
    reference = saved["ranks"][0]["pp1"]
    loss_bound = 2 * ULPS * EPS * max(t.abs().max().item() for t in reference["forced"])
    for rank, report in enumerate(saved["ranks"]):
        ours = report["pp2"]["figures"]  # every stage reports the update: the pipeline's sums
        assert abs(ours["loss"] - reference["figures"]["loss"]) <= loss_bound, rank
        for key in ("grad_norm", "num_own", *ROUTER_METRICS):
            assert ours[key] == pytest.approx(reference["figures"][key], rel=1e-5, abs=1e-7), (rank, key)
        if rank >= 2:  # the last stage computes the loss: the update's log-probs are the pass's (routes replayed)
            assert report["pp2"]["log_ratio_max"] <= 1e-5, rank
    assert reference["figures"]["grad_norm"] > 1.0  # the clipping acted
    assert reference["figures"]["moe/aux_loss"] > 0
    layout = saved["ranks"][0]["pp2"]
    worst, where = _worst_relative(layout["grads"], reference["grads"])
    assert worst <= 1e-5, where
    assert any(".mlp.experts." in n and g.abs().max() > 0 for n, g in layout["grads"].items())
    assert all(layout["grads"][f"model.layers.{i}.mlp.gate.weight"].abs().max() > 0 for i in range(2))
    difference = max((layout["weights"][n] - w).abs().max().item() for n, w in reference["weights"].items())
    assert set(layout["weights"]) == set(reference["weights"]) and difference <= 1e-6
