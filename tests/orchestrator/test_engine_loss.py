"""How an engine's death reaches the weight sync, unit by unit (no Ray runtime): an engine actor ends
its own process when its engine's process is gone, and a weight call to a dead actor raises EngineLost.
The whole path runs end to end in tests/e2e/test_reliability.py; vLLM's EngineDeadError in
tests/rollout/test_vllm.py."""
import os

import pytest
import ray

from hacpo_megatron.orchestrator.actors import engine_lost_if_actor_dies, restarts_when_engine_lost
from hacpo_megatron.rollout.base import EngineLost


class CoreGone(RuntimeError):
    """What an engine raises once its own process died (vLLM: EngineDeadError)."""


class Engine:
    def process_lost(self, error):
        return isinstance(error, CoreGone)


class Actor:
    """The part of EngineActor the decorator needs: an `engine`."""

    engine = Engine()

    @restarts_when_engine_lost
    def call(self, error=None):
        if error is not None:
            raise error
        return "answer"


class Exited(BaseException):
    pass


@pytest.fixture
def exits(monkeypatch):
    codes = []

    def fake_exit(code):
        codes.append(code)
        raise Exited()

    monkeypatch.setattr(os, "_exit", fake_exit)
    return codes


def test_an_actor_whose_engine_process_is_gone_ends_its_own_process(exits, capsys):
    with pytest.raises(Exited):
        Actor().call(CoreGone("engine core died"))
    assert exits == [1]
    assert "call found the engine's own process gone (CoreGone: engine core died)" in capsys.readouterr().out


def test_other_errors_reach_the_caller_and_the_actor_lives_on(exits):
    with pytest.raises(ValueError, match="bad prompt"):
        Actor().call(ValueError("bad prompt"))
    assert Actor().call() == "answer" and exits == []


@pytest.mark.parametrize("death", [ray.exceptions.RayActorError(), ray.exceptions.ActorUnavailableError("gone", None)])
def test_a_weight_call_to_a_dead_actor_raises_engine_lost(death):
    with pytest.raises(EngineLost, match="died during a weight update") as raised:
        with engine_lost_if_actor_dies("handle"):
            raise death
    assert raised.value.__cause__ is death


def test_other_errors_of_a_weight_call_are_not_taken_for_a_loss():
    with pytest.raises(ValueError):
        with engine_lost_if_actor_dies("handle"):
            raise ValueError("a bucket out of order")
