"""Ranks that share a GPU (two one-GPU agents on a one-GPU machine: found on an H200, docs/gpu.md).

NCCL refuses a communicator with two members on one device, so such groups must be gloo, while a group
whose ranks each have their own GPU keeps NCCL. The GPU count is faked: these machines have none.
"""
from __future__ import annotations

import pytest
import torch

from hacpo_megatron.checkpoint import megatron_io
from hacpo_megatron.parallel import groups


@pytest.fixture
def machine(monkeypatch):
    """machine(gpus, ranks_here): a torchrun machine with that many GPUs and local ranks."""
    def make(gpus: int, ranks_here: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks_here))
    return make


def test_two_ranks_on_one_gpu_share_it_and_only_single_rank_groups_keep_nccl(machine):
    machine(gpus=1, ranks_here=2)
    assert groups.gpus_shared()
    assert [groups.local_gpu(r) for r in (0, 1)] == [0, 0]
    assert groups.group_backend([0, 1], "nccl") == "gloo"
    assert groups.group_backend([1], "nccl") == "nccl"


def test_ranks_wrap_round_the_gpus_of_their_own_machine(machine):
    machine(gpus=2, ranks_here=4)  # a second machine's ranks 4-7 map like 0-3
    assert [groups.local_gpu(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert groups.group_backend([0, 1], None) == "nccl"  # distinct GPUs
    assert groups.group_backend([0, 2], None) == "gloo"  # both on GPU 0
    assert groups.group_backend([4, 5, 6], None) == "gloo"


def test_one_gpu_per_rank_leaves_the_default_backend(machine):
    machine(gpus=8, ranks_here=8)
    assert not groups.gpus_shared()
    assert groups.group_backend([0, 1, 2], None) is None  # the world's (NCCL) by torch's default
    machine(gpus=0, ranks_here=2)
    assert not groups.gpus_shared() and groups.group_backend([0, 1], "gloo") == "gloo"


class _Adam:
    def __init__(self, state):
        self.state = state


class _DistributedOptimizer:
    """The two members of megatron's DistributedOptimizer that the loader relies on."""

    def __init__(self, state):
        self.optimizer = _Adam(state)
        self.dummy_steps = 0

    def _init_optimizer_states_with_dummy_values(self):
        self.dummy_steps += 1
        self.optimizer.state = {"p": {"step": torch.tensor(1.0)}}


class _Chained:
    def __init__(self, *optimizers):
        self.chained_optimizers = list(optimizers)


def test_a_fresh_distributed_optimizer_gets_adam_state_before_a_load_and_a_trained_one_keeps_its_own():
    fresh, trained = _DistributedOptimizer({}), _DistributedOptimizer({"p": {"step": torch.tensor(7.0)}})
    megatron_io._give_adam_its_state(_Chained(fresh, trained))
    assert fresh.dummy_steps == 1 and trained.dummy_steps == 0
    assert trained.optimizer.state["p"]["step"].item() == 7.0
    megatron_io._give_adam_its_state(fresh)  # not chained; has state now: nothing more
    assert fresh.dummy_steps == 1
    megatron_io._give_adam_its_state(object())  # the CPU optimizer: no such method, nothing to do


class _MegatronCopy:
    """Just what megatron-core's own `DistributedOptimizer._set_main_param_and_optimizer_states` reads: one model
    parameter whose fp32 main copy has torch Adam's state (a tensor "step" among it)."""

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    _set_main_param_and_optimizer_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def __init__(self, model_param):
        self.main = torch.zeros(4)
        self.config = type("Config", (), {"use_precision_aware_optimizer_no_fp8_or_ds_fp8": False})()
        self.model_param_group_index_map = {model_param: (0, 0)}
        state = {self.main: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}}
        self.optimizer = type("Adam", (), {"param_groups": [{"params": [self.main]}], "state": state})()


def test_a_fully_reshardable_load_copies_adam_state_and_leaves_the_step_to_the_param_groups():
    """megatron 0.19.2's fully_reshardable load passes each parameter's tensors without "step" (its step comes from
    the param groups) to a copy that looks up every state tensor by name: KeyError 'step' on a GPU without
    Apex/TE. Inside the loader's context the copy skips the step and copies the rest."""
    model_param = torch.nn.Parameter(torch.zeros(4))
    inner = _MegatronCopy(model_param)
    source = {"param": torch.full((4,), 1.0), "exp_avg": torch.full((4,), 2.0), "exp_avg_sq": torch.full((4,), 5.0)}
    with pytest.raises(KeyError, match="step"):
        inner._set_main_param_and_optimizer_states(model_param, source)  # megatron's own behaviour, unpatched
    with megatron_io._adam_step_left_to_param_groups(_Chained(inner)):
        inner._set_main_param_and_optimizer_states(model_param, source)
    state = inner.optimizer.state[inner.main]
    assert inner.main.tolist() == [1.0] * 4 and state["exp_avg"].tolist() == [2.0] * 4
    assert state["exp_avg_sq"].tolist() == [5.0] * 4 and state["step"].item() == 3.0
    assert "_set_main_param_and_optimizer_states" not in vars(inner)  # megatron's method again after the load
