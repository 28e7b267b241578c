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
