"""Ray actors: one rollout engine per agent, and the reward workers.

    EngineActor   holds one agent's engine (embedded transformers, vLLM, SGLang) in its own process
    RemoteEngine  the RolloutEngine interface over an EngineActor handle (what weight sync talks to)
    RewardActor   holds a RewardPool: math-verify (or a plug-in) in worker processes with time limits

Actors restart when their process dies (`max_restarts`); a restarted engine has lost its weights,
so the training loop pushes them again before it retries the step (see training/loop.py). An engine
that runs a process of its own (vLLM's engine core) can lose it while the actor lives on: the actor
then ends its own process, so that Ray restarts it and callers see one kind of failure, a dead actor.
A weight call to a dead actor raises `EngineLost` (rollout/base.py), which the weight sync reports.
Ray restarts an actor on its own, so a call made after a death that went unseen (Ray's memory
monitor ends engines between calls) reaches a new engine without the trainer's weights: an engine
actor refuses to generate until a whole weight update has arrived (`EngineWithoutWeights`), and the
loop asks `holds_weights` before every step and pushes to any engine that says no
(orchestrator/weight_delivery.py).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import ray
import torch

from hacpo_megatron.orchestrator.generation_schedule import TimedAnswers
from hacpo_megatron.orchestrator.shared_memory import record_engine_files, remove_files_of_ended_engine
from hacpo_megatron.rollout.base import (
    Completion, EngineLost, EngineWithoutWeights, RolloutEngine, SamplingParams, WeightCheck,
)

ACTOR_RESTARTS = 3  # calls made again after an actor's death, at most, one failure at a time
# Engines and reward workers are scheduled without reserving Ray CPUs: the trainers (torchrun
# processes Ray does not see) use the same cores, and phases alternate rather than overlap. Ray may
# restart them any number of times over a run (its memory monitor ends them when the node runs
# short); what bounds the retries is each call's and each step's own limit.
ACTOR_OPTIONS = dict(num_cpus=0, max_restarts=-1, max_task_retries=0)
ACTOR_DEATHS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def restarts_when_engine_lost(method):
    """An EngineActor method that ends the actor's process when the engine says its own process is
    gone (`RolloutEngine.process_lost`): the engine can never serve again, and a new actor can."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as error:
            if not self.engine.process_lost(error):
                raise
            print(f"engine actor {os.getpid()}: {method.__name__} found the engine's own process gone "
                  f"({type(error).__name__}: {error}); ending this actor so that Ray restarts it", flush=True)
            os._exit(1)
    return guarded


@ray.remote
class EngineActor:
    """One agent's rollout engine, built from a Hugging Face config (weights arrive by weight sync)."""

    def __init__(self, kind: str, hf_config: Dict[str, Any], tokenizer_name: str, seed: int,
                 engine_kwargs: Optional[Dict[str, Any]] = None, threads: int = 1, prompt_format: str = "chat",
                 gpu: int = 0):
        torch.set_num_threads(threads)
        self._weights_complete = False  # no whole weight update has arrived in this process yet
        if ray.get_runtime_context().was_current_actor_reconstructed:  # the engine before it was SIGKILLed
            remove_files_of_ended_engine()
        from hacpo_megatron.bridge.tokenizers import eos_token_ids, load_tokenizer, pad_token_id

        tokenizer = load_tokenizer(tokenizer_name, prompt_format)  # the format's end tokens stop generation
        if kind == "embedded":
            from hacpo_megatron.rollout.embedded import EmbeddedEngine, hf_model_from_config

            model = hf_model_from_config(hf_config, seed=seed)
            if torch.cuda.is_available():  # beside its engine rank, in the trainer's dtype
                from hacpo_megatron.models.architectures import default_params_dtype

                torch.cuda.set_device(gpu)
                model = model.to(device=torch.device("cuda", gpu), dtype=default_params_dtype())
            self.engine: RolloutEngine = EmbeddedEngine(
                model, tokenizer, eos_token_ids=sorted(eos_token_ids(tokenizer)), pad_token_id=pad_token_id(tokenizer),
                **(engine_kwargs or {}))
        else:
            from hacpo_megatron.rollout import make_engine

            kwargs = dict(engine_kwargs or {})
            folder = kwargs.pop("model_path", None)
            if kind == "vllm":  # starts from the config alone: the trainer pushes the weights before any rollout
                with tempfile.TemporaryDirectory(prefix="hacpo-engine-") as config_only:
                    with open(os.path.join(config_only, "config.json"), "w") as f:
                        json.dump(hf_config, f)
                    self.engine = make_engine(kind, model_path=config_only,
                                              eos_token_ids=sorted(eos_token_ids(tokenizer)),
                                              tokenizer=tokenizer, seed=seed, load_format="dummy", cpu_threads=threads,
                                              **kwargs)
                record_engine_files()  # its engine core and workers talk through /dev/shm
                return
            if folder is None:
                raise ValueError(f"the {kind} engine needs a Hugging Face folder: set the agent's init_from")
            self.engine = make_engine(kind, model_path=folder, eos_token_ids=sorted(eos_token_ids(tokenizer)),
                                      pad_token_id=pad_token_id(tokenizer), seed=seed, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def gpu(self) -> Optional[int]:
        """The GPU this engine generates on, when it is this process's (the embedded engine); else None."""
        device = getattr(self.engine, "device", None)
        return device.index if isinstance(device, torch.device) and device.type == "cuda" else None

    def holds_weights(self) -> bool:
        """Has a whole weight update arrived in this process (False in an actor Ray just restarted)?"""
        return self._weights_complete

    @restarts_when_engine_lost
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> List[List[Completion]]:
        if not self._weights_complete:
            raise EngineWithoutWeights(f"engine actor {os.getpid()} has no complete set of the trainer's weights "
                                       "(restarted, or in the middle of an update)")
        return self.engine.generate(prompts, params)

    def generate_timed(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> TimedAnswers:
        """`generate`, with when it ran (the training steps' overlap metrics: orchestrator/pipeline.PhaseClock)."""
        started = time.time()
        answers = self.generate(prompts, params)
        return TimedAnswers(answers, started, time.time())

    @restarts_when_engine_lost
    def begin_weight_update(self) -> None:
        self._weights_complete = False
        self.engine.begin_weight_update()

    @restarts_when_engine_lost
    def update_weights(self, payload: bytes) -> None:
        self.engine.update_weights(_unpack(payload))

    @restarts_when_engine_lost
    def finish_weight_update(self, buckets_sent: Optional[int] = None) -> None:
        """`buckets_sent`: how many buckets the trainer broadcast in this update (weight groups only)."""
        if buckets_sent is not None:
            self.engine.end_bucket_stream(buckets_sent)
        self.engine.finish_weight_update()
        self._weights_complete = True
        record_engine_files()  # again each step: with what its engine made since (its /dev/shm files)

    # weights over a group of their own or CUDA IPC (rollout/transport.py, orchestrator/weight_senders.py)
    @restarts_when_engine_lost
    def weight_receivers(self) -> int:
        return self.engine.weight_receivers()

    @restarts_when_engine_lost
    def join_weight_group(self, address) -> None:
        self.engine.join_weight_group(address)

    @restarts_when_engine_lost
    def receive_bucket(self, header) -> None:
        self.engine.receive_bucket(header)

    @restarts_when_engine_lost
    def receive_ipc_bucket(self, header, handle) -> None:
        self.engine.receive_ipc_bucket(header, handle)

    @restarts_when_engine_lost
    def check_weights(self, payload: bytes, atol: float) -> WeightCheck:
        return self.engine.check_weights(_unpack(payload), atol)

    @restarts_when_engine_lost
    def release_memory(self) -> None:
        self.engine.release_memory()

    @restarts_when_engine_lost
    def resume_memory(self) -> None:
        self.engine.resume_memory()


class RemoteEngine(RolloutEngine):
    """An EngineActor seen through the RolloutEngine interface (blocking calls). Its weight calls are
    the `object_store` transport; orchestrator/weight_senders.py has the others."""

    def __init__(self, handle: Any):
        self.handle = handle

    def generate(self, prompts, params):
        return ray.get(self.handle.generate.remote(prompts, params))

    def begin_weight_update(self) -> None:
        with engine_lost_if_actor_dies(self.handle):
            ray.get(self.handle.begin_weight_update.remote())

    def update_weights(self, bucket) -> None:
        with engine_lost_if_actor_dies(self.handle):
            ray.get(self.handle.update_weights.remote(_pack(bucket)))

    def finish_weight_update(self) -> None:
        with engine_lost_if_actor_dies(self.handle):
            ray.get(self.handle.finish_weight_update.remote())

    def check_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], atol: float = 0.0) -> WeightCheck:
        # A remote call needs its arguments whole: the check sends the tensors in one message.
        return ray.get(self.handle.check_weights.remote(_pack(named_tensors), atol))

    def release_memory(self) -> None:
        ray.get(self.handle.release_memory.remote())

    def resume_memory(self) -> None:
        ray.get(self.handle.resume_memory.remote())


@contextlib.contextmanager
def engine_lost_if_actor_dies(handle: Any):
    """A weight call whose actor died (its process ended; Ray restarts it without the weights) raises
    EngineLost, the weight sync's signal to finish its side and report the loss (rollout/base.py)."""
    try:
        yield
    except ACTOR_DEATHS as error:
        raise EngineLost(f"the engine actor {handle} died during a weight update ({type(error).__name__})") from error


def _pack(named_tensors) -> bytes:
    """Tensors travel to engines as safetensors bytes, not pickles: once Megatron is imported, torch
    pickles name `megatron.core.safe_globals`, which an engine's process need not (and on CPU cannot)
    import. The order of the names is kept."""
    from safetensors.torch import save

    named = [(name, tensor.detach().contiguous()) for name, tensor in named_tensors]
    order = json.dumps([name for name, _ in named])
    return save({name: tensor.clone() for name, tensor in named}, metadata={"order": order})


def _unpack(payload: bytes) -> List[Tuple[str, torch.Tensor]]:
    from safetensors.torch import load

    tensors = load(payload)
    order = json.loads(_safetensors_metadata(payload)["order"])
    return [(name, tensors[name]) for name in order]


def _safetensors_metadata(payload: bytes) -> Dict[str, str]:
    header_size = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8:8 + header_size]).get("__metadata__", {})


@ray.remote
class RewardActor:
    """Scores responses with a reward function in a pool of worker processes with time limits."""

    def __init__(self, function: str, num_workers: int, timeout_s: float):
        from hacpo_megatron.rewards import RewardPool, load_reward_function

        self.pool = RewardPool(load_reward_function(function), num_workers=num_workers, timeout_s=timeout_s)

    def pid(self) -> int:
        return os.getpid()

    def score(self, items: list) -> Tuple[List[float], Dict[str, float]]:
        return self.pool.score(items)

    def close(self) -> None:
        self.pool.close()


def wait_until_alive(handle: Any, timeout_s: float = 300.0) -> int:
    """Block until an actor (possibly restarting after a crash) answers; returns its process id."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(handle.pid.remote(), timeout=30)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"actor {handle} did not come back within {timeout_s:.0f} s") from None
            time.sleep(0.5)


def call_with_restarts(handle: Any, method: str, *args: Any, attempts: int = ACTOR_RESTARTS + 1) -> Any:
    """`ray.get(handle.<method>.remote(*args))`; when the actor's process died (Ray restarts it), wait
    for the new one and call again. Only for calls that give the same answer however often they run
    (scoring): nothing is lost or counted twice."""
    for attempt in range(attempts):
        try:
            return ray.get(getattr(handle, method).remote(*args))
        except ACTOR_DEATHS as error:
            if attempt == attempts - 1:
                raise
            print(f"{method} on {handle}: the actor died ({type(error).__name__}); waiting for its restart, "
                  f"then calling again", flush=True)
            wait_until_alive(handle)


def engine_actor_name(run_name: str, agent_name: str) -> str:
    return f"hacpo-engine-{run_name}-{agent_name}"
