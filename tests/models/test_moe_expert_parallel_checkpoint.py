"""A training run's checkpoint of an MoE agent at expert parallelism 2 (issue 52; docs/moe.md "Expert parallelism"):
saved and resumed through the run's own functions (training/run_checkpoints.py), in one 2-rank torchrun world (DP 2,
EP 2: rank r holds experts 4r .. 4r + 3 of both layers; megatron's optimizer is the dense weights' and the experts').
The worker (tests/models/workers/moe_ep_checkpoint_worker.py) says what each rank does.

What each test would catch:
- every weight, Adam moment and step equal after the load, each expert by its global index, in a model whose own
  weights all differed: an expert saved or loaded under its local index (both EP ranks writing experts 0-3, rank 1
  getting rank 0's), the experts' optimizer not saved or not loaded (no moments), a step count or the LR schedule's
  position lost (cosine over 4 steps);
- the second update after the load equals the one without it, bit for bit (bound 0: the same weights, moments,
  step, learning rate and rows give the same arithmetic on the same ranks): moments of the wrong parameter, a
  learning rate or step not restored;
- at EP 1 the weights load (each global expert equal to its EP 2 owner's), and resuming the optimizer's state is
  refused with the saved and the asked EP named, before any model is built (`choose_checkpoint`) and at the load.

Checked by deliberate breaks in the worker's one-process run (EP 1, DP 1, where it passes; not kept): the optimizer
not loaded fails the moments, and the second update's weights differ by up to 1.1e-2; the LR schedule's state not
loaded fails its step count (the second update alone would not show it: its LR comes from the optimizer's saved
groups; the third would)."""
import pytest
import torch

from tests.models.test_moe import EXPERTS
from tests.models.torchrun import REPO, run_torchrun

pytestmark = pytest.mark.distributed  # a torchrun world: not in make test-fast

WORKER = REPO / "tests" / "models" / "workers" / "moe_ep_checkpoint_worker.py"
WORLD = 2
LAYERS = 2


@pytest.fixture(scope="module")
def reports(module_tmp):
    out = module_tmp("moe_ep_checkpoint")
    run_torchrun(WORKER, WORLD, str(out), timeout=600)
    return [torch.load(out / f"rank{r}.pt", map_location="cpu", weights_only=False) for r in range(WORLD)]


def experts_of(names):
    """{layer: sorted global expert indices} among parameter names."""
    out = {}
    for name in names:
        if ".local_experts." in name:
            layer = int(name.split("decoder.layers.")[1].split(".")[0])
            out.setdefault(layer, set()).add(int(name.split(".local_experts.")[1].split(".")[0]))
    return {layer: sorted(v) for layer, v in out.items()}


def assert_equal_tensors(ours, theirs, what):
    assert ours.keys() == theirs.keys(), what
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), (what, name)


def assert_resumed_exactly(report):
    """The state loaded into the fresh trainer is the saved one, exactly, and the load changed every weight."""
    saved, fresh, loaded = report["saved"], report["fresh"], report["loaded"]
    assert saved["weights"].keys() == fresh["weights"].keys()
    assert not [n for n, w in fresh["weights"].items() if torch.equal(w, saved["weights"][n])]  # all differed
    assert_equal_tensors(loaded["weights"], saved["weights"], "weights")
    for key in ("exp_avg", "exp_avg_sq"):
        assert saved[key].keys() == saved["weights"].keys(), key  # every parameter has Adam state after a step
        assert_equal_tensors(loaded[key], saved[key], key)
    moved = {n for n, m in saved["exp_avg"].items() if m.abs().max() > 0}
    assert any(".local_experts." in n for n in moved) and any(".local_experts." not in n for n in moved)
    assert set(saved["step"].values()) == {1.0} and loaded["step"] == saved["step"]
    assert loaded["optimizer_of"] == saved["optimizer_of"]
    assert loaded["lr"] == saved["lr"] and loaded["lr"] != fresh["lr"]
    for key in ("steps_done", "scheduler_steps"):  # the trainer's and the LR schedule's
        assert loaded[key] == saved[key] == 1, key
    assert report["resumed_step"] == 1 and report["run_state"] == {"tracker": True, "sampler": True}


def assert_second_update_unchanged_by_the_resume(report):
    """Bound 0: every input of the second update is bitwise the same, and so is the arithmetic on the same ranks."""
    direct, resumed, saved = report["direct_2"], report["resumed_2"], report["saved"]
    for key in ("weights", "exp_avg", "exp_avg_sq"):
        assert_equal_tensors(resumed[key], direct[key], key)
    assert resumed["step"] == direct["step"] and set(direct["step"].values()) == {2.0}
    changed = [n for n, w in direct["weights"].items() if not torch.equal(w, saved["weights"][n])]
    assert any(".local_experts." in n for n in changed) and any(".local_experts." not in n for n in changed)


def test_each_ep_rank_saves_its_experts_by_their_global_index(reports):
    """The checkpoint says EP 2 and holds optimizer state; rank r's experts are 4r .. 4r + 3 of each layer, together
    every expert once; the experts are the second optimizer's parameters, everything else the first's."""
    share = EXPERTS // WORLD
    held = []
    for rank, report in enumerate(reports):
        assert report["ep_size"] == WORLD
        assert report["metadata"]["expert_parallel"] == WORLD and report["metadata"]["has_optimizer"]
        names = report["saved"]["weights"].keys()
        mine = list(range(share * rank, share * (rank + 1)))
        assert experts_of(names) == {layer: mine for layer in range(LAYERS)}
        assert {n: i for n, i in report["saved"]["optimizer_of"].items()} == {
            n: int(".local_experts." in n) for n in names}
        held += [n for n in names if ".local_experts." in n]
    assert len(held) == len(set(held)) and experts_of(held) == {layer: list(range(EXPERTS)) for layer in range(LAYERS)}


def test_resume_restores_every_weight_adam_moment_and_step_exactly(reports):
    for report in reports:
        assert_resumed_exactly(report)


def test_the_update_after_a_resume_is_the_update_without_one(reports):
    for report in reports:
        assert_second_update_unchanged_by_the_resume(report)


def test_at_ep1_the_weights_load_and_the_optimizers_state_is_refused_by_name(reports):
    """The EP 2 checkpoint at EP 1 (DP 2): each global expert's weights are its EP 2 owner's (and the dense ones
    rank 0's); the run's resume refuses, before building anything (`choose_checkpoint`) and at the load, naming the
    folder, the EP saved at and the one asked for."""
    saved = {}
    for report in reversed(reports):  # rank 0's dense weights last: the replicas' are equal anyway
        saved.update(report["saved"]["weights"])
    for report in reports:
        assert_equal_tensors(report["ep1_weights"], saved, "weights at EP 1")
        for key, kind in (("ep1_choose", "InputError: --resume: "), ("ep1_resume", "CheckpointError: ")):
            message = report[key]
            assert message.startswith(kind), (key, message)
            assert "moe/metadata.json: saved at expert parallelism 2, the agent now has parallel.expert 1" in message
            assert "Resume with parallel.expert: 2" in message
