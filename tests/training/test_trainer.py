"""The training step of one agent under Megatron DDP on CPU/gloo (one 2-rank torchrun launch)."""
import json

import pytest
import torch
import yaml

from tests.models.torchrun import REPO, run_torchrun
from tests.models.workers.reference import TEST_CONFIGS

pytestmark = pytest.mark.distributed  # a torchrun world: not in make test-fast

WORKER = REPO / "tests" / "training" / "workers" / "train_worker.py"


@pytest.fixture(scope="module")
def run(module_tmp):
    work = module_tmp("train")
    agents = []
    # three agents, three architectures, three layouts, all time-sharing ranks 0-1
    for name, arch, parallel in [("qwen", "qwen3", {"tensor": 2}), ("llama", "llama", {"data": 2}),
                                 ("qwen2", "qwen2", {"pipeline": 2, "first_rank": 0})]:
        folder = work / arch
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(TEST_CONFIGS[arch]))
        agents.append({"name": name, "model": str(folder), "parallel": dict(parallel, first_rank=0)})
    config = {"run": {"seed": 7}, "agents": agents, "algorithm": {"name": "hacpo"},
              "data": {"prompt_batch_size": 4}, "train": {"mini_batch_size": 2, "micro_batch_size": 3, "lr": 1e-3},
              "rollout": {"samples_per_prompt": 2}}
    path = work / "agents.yaml"
    path.write_text(yaml.safe_dump(config))
    run_torchrun(WORKER, 2, str(path), str(work), timeout=600)
    reports = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    return work, reports


def test_gradients_of_an_update_are_the_same_at_every_layout(run):
    work, _ = run
    reference = torch.load(work / "grads_tp1.pt", map_location="cpu")
    assert reference and all(g.abs().sum() > 0 for n, g in reference.items() if "norm" not in n)
    for layout in ("tp2", "dp2", "pp2"):
        grads = torch.load(work / f"grads_{layout}.pt", map_location="cpu")
        assert grads.keys() == reference.keys(), layout
        worst = max((grads[n] - reference[n]).abs().max().item() for n in reference)
        scale = max(g.abs().max().item() for g in reference.values())
        assert worst <= 5e-5 * scale, (layout, worst, scale)  # fp32 sums in another order (TP-split vocab)


def test_loss_trajectory_is_the_same_at_every_layout(run):
    _, reports = run
    layouts = {**reports[0]["layouts"], **reports[1]["layouts"]}
    reference = layouts["tp1"]["losses"]
    assert len(reference) == 6 and len(set(round(x, 6) for x in reference)) == 6  # 3 steps x M=2 updates
    for layout in ("tp2", "dp2", "pp2"):
        assert layouts[layout]["losses"] == pytest.approx(reference, rel=1e-4, abs=1e-6), layout
    metrics = layouts["tp1"]["metrics"]
    assert metrics["num_own"] == 4 and metrics["num_cross"] == 4  # 2 prompts x G=2 per mini-batch
    # the source's old log-probs were set 0.1 below the learner's: cross ratios start near e^0.1 > 1, capped at 1
    assert metrics["cross_ratio_mean"] > 1 and metrics["cross_clip_frac_upper"] > 0
    # the fitted cross-clip bound (algorithm.cross_clip_fit_quantile 0.5): the last step's ratios of the other
    # agent's rows counted whole at every layout (not one replica's or one stage's share), the same bound fitted;
    # the source's log-probs 0.1 below the learner's put most ratios at s >= 1: the median's bin starts at 1
    counted = layouts["tp1"]["ratios_counted"]
    assert 0 < counted <= 2 * metrics["num_cross"]  # rows with an advantage, of the 2 updates' 4 other-agent rows
    for layout, report in layouts.items():
        assert report["ratios_counted"] == counted and report["fitted_bound"] == 1.0, layout
    # utilisation: model FLOP/s of the update and its fraction of the GEMM peak measured at the trainer's start
    for layout, report in layouts.items():
        m = report["metrics"]
        assert m["perf/model_flops_per_s"] > 0 and m["perf/gemm_peak_flops_per_s"] > 0, layout
        assert m["perf/mfu"] == pytest.approx(m["perf/model_flops_per_s"] / m["perf/gemm_peak_flops_per_s"]), layout


def test_every_agent_of_the_config_trains_and_its_objective_goes_down(run):
    _, reports = run
    agents = reports[0]["agents"]
    assert set(agents) == {"qwen", "llama", "qwen2"}  # a third agent: a config entry, no code
    for name, info in agents.items():
        objective = info["objective"]
        assert objective[-1] < objective[0] - 1e-3, (name, objective)
        # 3 sources x B=4 x G=2 rows, mini_batch_size 2 prompts x G=2 = 4 rows per update: M = 6
        assert info["num_updates"] == 6 and info["num_own"] + info["num_cross"] == info["num_rows"] == 24
        assert info["num_cross"] == 2 * info["num_own"]  # two other agents


@pytest.mark.parametrize("layout", ["tp1", "dp2"])
def test_kl_covers_own_rows_anywhere_in_mixed_micro_batches(run, layout):
    _, reports = run
    kl = {**reports[0]["kl"], **reports[1]["kl"]}[layout]
    assert kl["first_update_rows"] == 7  # 2 prompts x (2 own + 2 other) minus one dropped bridged answer
    assert any(0 < c < 3 for c in kl["micro_batch_cross_counts"])  # micro-batches mix own and other rows
    assert kl["kl_reference"] > 1e-3
    assert kl["kl_logged"] == pytest.approx(kl["kl_reference"], rel=1e-5)
    assert kl["loss_difference"] == pytest.approx(kl["kl_coef"] * kl["kl_reference"], rel=1e-4)
