"""Push an agent's Megatron weights to its rollout engine after every update, and check them.

The path of one weight, from the trainer's shards to the engine:

    TP shards of a stage --all-gather (TP group)--> full Megatron tensor --send--> engine rank
        --Megatron->HF mapping--> HF tensors --buckets of <= bucket_bytes--> engine.update_weights

`checkpoint/hf_mapping.iter_hf_tensors` does the first three steps one tensor at a time, so at most
one full tensor plus one bucket is held at once, whatever the model's size. This module feeds that
stream to `rollout/base.send_weights_in_buckets`, the one place that groups weights into buckets and drives the
engine's three-call update (`begin_weight_update`, `update_weights(bucket)` per bucket, `finish_weight_update`),
and counts what it sent.

Collective over the agent's ranks: every rank of the agent calls `sync_weights` (and
`check_engine_weights`) together. Only the engine rank (`engine_rank`: last pipeline stage, TP rank
0, data-parallel replica 0 — the agent's output rank) talks to the engine; the other ranks of
replica 0 take part in the gathers and sends; other data-parallel replicas hold the same weights
and return at once, except, at expert parallelism > 1, the EP ranks that hold the other experts (ranks of other
replicas): each sends its own experts, so every expert is sent once. Pass `engine=None` on every rank but the engine
rank.

The engine may be any object with the engine's methods: an engine in this process, or a proxy for
one in another process (the orchestrator wraps Ray actor handles so). Nothing here knows Ray.
An engine whose process died in the middle (its proxy raises `EngineLost`) is not called again: the
engine rank reads the rest of the stream, so that the other ranks finish their sends, and reports
`engine_lost`; orchestrator/weight_delivery.py sends the weights again once the engine is back.
Any other error of an engine call leaves the other ranks waiting in their sends and ends the run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from hacpo_megatron.checkpoint.hf_mapping import iter_hf_tensors
from hacpo_megatron.models.architectures import HFConfig
from hacpo_megatron.parallel.groups import AgentParallel
from hacpo_megatron.rollout.base import (
    DEFAULT_BUCKET_BYTES, EngineLost, WeightBucket, WeightCheck, send_weights_in_buckets, tensor_bytes,
)


@dataclass
class WeightSyncMetrics:
    """What one weight sync cost. On ranks other than the engine rank only the times are filled."""

    seconds: float = 0.0  # wall time of the push on this rank (gathers, conversion, engine calls)
    engine_seconds: float = 0.0  # of which inside engine calls (staging, loading, applying)
    bytes: int = 0  # sent to the engine
    tensors: int = 0
    buckets: int = 0
    largest_bucket_bytes: int = 0
    check: Optional[WeightCheck] = None  # set when the check mode ran, on the engine rank
    check_seconds: float = 0.0
    engine_lost: bool = False  # the engine's process died during the sync: it holds no weights now

    def count_call(self, bucket: Optional[WeightBucket], seconds: float) -> None:
        """One engine call of the update (send_weights_in_buckets' `each_call`): its time, and its bucket's size
        (a bucket whose call found the engine dead counts: `buckets` is how far the stream got)."""
        self.engine_seconds += seconds
        if bucket is not None:
            size = sum(tensor_bytes(t) for _, t in bucket)
            self.buckets += 1
            self.tensors += len(bucket)
            self.bytes += size
            self.largest_bucket_bytes = max(self.largest_bucket_bytes, size)

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self, prefix: str = "weight_sync/") -> Dict[str, float]:
        """Flat numbers for the run's metrics log."""
        values = dict(seconds=self.seconds, engine_seconds=self.engine_seconds, bytes=float(self.bytes),
                      bytes_per_second=self.bytes_per_second, tensors=float(self.tensors),
                      buckets=float(self.buckets), largest_bucket_bytes=float(self.largest_bucket_bytes),
                      engine_losses=float(self.engine_lost))
        if self.check is not None:
            values.update(check_equal=float(self.check.equal), check_max_abs_diff=self.check.max_abs_diff,
                          check_seconds=self.check_seconds)
        return {prefix + key: value for key, value in values.items()}


def engine_rank(agent_parallel: AgentParallel) -> int:
    """The global rank that talks to the agent's engine: the output rank of data-parallel replica 0.

    The last stage is chosen because it already reports the agent's results; with tied embeddings
    and PP > 1 the embedding comes from stage 0 like every other tensor of that stage.
    """
    return agent_parallel.global_rank_of(tp_rank=0, dp_rank=0, pp_rank=agent_parallel.pp_size - 1)


def sync_weights(
    model: Any,
    hf_config: HFConfig,
    agent_parallel: AgentParallel,
    engine: Optional[Any],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: Optional[torch.dtype] = None,
    check: bool = False,
    atol: float = 0.0,
) -> WeightSyncMetrics:
    """Send the model's current weights to `engine` in buckets of at most `bucket_bytes`. Collective.

    `model` is this rank's Megatron GPTModel (unwrapped from DDP); `dtype` casts before sending
    (e.g. bf16 for a bf16 engine: half the bytes of fp32 master weights). With `check`, the weights
    are streamed a second time and compared by the engine (`check_engine_weights`).
    """
    is_engine_rank = _require_engine_where_needed(agent_parallel, engine)
    start = time.perf_counter()
    metrics = WeightSyncMetrics()
    stream = _hf_stream(model, hf_config, agent_parallel, dtype)
    if is_engine_rank:
        try:
            send_weights_in_buckets(engine, stream, bucket_bytes, each_call=metrics.count_call)
        except EngineLost as error:
            print(f"agent {agent_parallel.name!r}: {error}; finishing the weight stream without it", flush=True)
            metrics.engine_lost = True
    _exhaust(stream)  # elsewhere: take part in the gathers and sends (this rank receives nothing)
    metrics.seconds = time.perf_counter() - start
    if check and metrics.engine_lost:
        _exhaust(_hf_stream(model, hf_config, agent_parallel, dtype))  # nothing to check; the others stream
    elif check:
        metrics.check, metrics.check_seconds = check_engine_weights(
            model, hf_config, agent_parallel, engine, atol=atol, dtype=dtype)
    return metrics


def check_engine_weights(
    model: Any,
    hf_config: HFConfig,
    agent_parallel: AgentParallel,
    engine: Optional[Any],
    *,
    atol: float = 0.0,
    dtype: Optional[torch.dtype] = None,
) -> Tuple[Optional[WeightCheck], float]:
    """The check mode: does the engine hold exactly the trainer's weights? Collective.

    Streams the same HF tensors a sync sends into `engine.check_weights`. Returns (verdict, seconds)
    on the engine rank and (None, seconds) elsewhere. `atol=0` asks for bitwise equality, which a
    sync in the engine's own dtype gives.
    """
    is_engine_rank = _require_engine_where_needed(agent_parallel, engine)
    start = time.perf_counter()
    stream = _hf_stream(model, hf_config, agent_parallel, dtype)
    verdict = engine.check_weights(stream, atol=atol) if is_engine_rank else None
    _exhaust(stream)  # an engine that stopped reading early must not leave the senders waiting
    return verdict, time.perf_counter() - start


# ------------------------------------------------------------------------------------------------
def _hf_stream(model: Any, hf_config: HFConfig, agent_parallel: AgentParallel,
               dtype: Optional[torch.dtype]) -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, full tensor) on the engine rank, in HF order; nothing elsewhere (but the generator
    must still be exhausted everywhere: it carries the gathers and sends)."""
    for name, tensor in iter_hf_tensors(model, hf_config, agent_parallel, dst_rank=engine_rank(agent_parallel)):
        yield name, (tensor if dtype is None else tensor.to(dtype))


def _require_engine_where_needed(agent_parallel: AgentParallel, engine: Optional[Any]) -> bool:
    """True on the engine rank; raises there if no engine was given."""
    if not agent_parallel.is_member:
        raise RuntimeError(f"rank {agent_parallel.rank} is not a member of agent {agent_parallel.name!r}")
    is_engine_rank = agent_parallel.rank == engine_rank(agent_parallel)
    if is_engine_rank and engine is None:
        raise ValueError(f"agent {agent_parallel.name!r}: rank {agent_parallel.rank} is its engine rank "
                         "(last stage, TP rank 0, DP replica 0) and needs the engine")
    return is_engine_rank


def _exhaust(stream: Iterator) -> None:
    for _ in stream:
        pass
