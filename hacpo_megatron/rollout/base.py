"""The rollout engine interface: generate G samples per prompt, take new weights, free memory.

Every engine (embedded transformers, vLLM, SGLang) returns the same `Completion` records, so the
orchestrator, the bridge and the trainer never know which engine produced a response.

Log-probs: `Completion.logprobs[t]` is log softmax(logits_t / temperature)[y_t] under the engine's
weights, the same quantity the trainer computes (`models/logprobs.py` divides logits by the
sampling temperature too). top-p only decides which tokens may be drawn; it does not renormalise
the reported log-probs, as in vLLM's processed-logprob mode without top-p renormalisation.

Weights arrive in three calls, so that a trainer can stream a model of any size in bounded memory:

    engine.begin_weight_update()
    for bucket in weight_buckets(hf_named_tensors, bucket_bytes):   # lists of (HF name, full tensor)
        engine.update_weights(bucket)
    engine.finish_weight_update()                                    # the new weights serve from here on

`send_weights_in_buckets` does exactly this; `rollout/weight_sync.py` does it from a Megatron model. An engine
may apply each bucket at once (embedded, SGLang) or stage them and apply at the end (vLLM's reload
path wants the whole model); either way generation must not run between begin and finish.

An engine in another process can die in the middle of an update (vLLM's engine core killed for its
memory, a node lost). Its proxy then raises `EngineLost` from the weight call, and the weight sync
finishes its side of the stream and reports the loss, so that the loop can send the weights again
to the restarted engine instead of ending the run.
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Literal, Optional, Sequence, Tuple

import torch

# The weight path reads one way: engines (this module) use the transports (transport.py), never the reverse.
from hacpo_megatron.rollout.transport import BucketReceiver, WeightBucket, copy_ipc_bucket, join_group

FinishReason = Literal["stop", "length"]
NamedTensors = Iterable[Tuple[str, torch.Tensor]]  # (Hugging Face name, full tensor) pairs

DEFAULT_BUCKET_BYTES = 256 * 2**20  # big enough to amortise a call, small next to any GPU's memory


class EngineLost(RuntimeError):
    """The engine's process died during a call: it has lost its weights (it is restarted elsewhere)."""


class EngineWithoutWeights(RuntimeError):
    """Asked to generate before a whole set of weights arrived: a restarted engine (its process died
    between calls) holds its initial weights, not the trainer's, and must not serve."""


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt (G)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: Optional[int] = None  # same seed, same weights, same prompts -> same samples
    greedy: bool = False  # argmax decoding (evaluation); log-probs are still reported at `temperature`

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature <= 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    token_ids: List[int]  # response tokens, including the end-of-sequence token when it stopped
    text: str  # decoded response, special tokens skipped
    logprobs: List[float]  # one per token in token_ids
    finish_reason: FinishReason
    # MoE routing replay r3 (docs/moe.md): the experts the engine sent each token of the prompt and of this answer
    # to, a torch int16 tensor [prompt + answer tokens, MoE layers, top-k] (-1: a token the engine never fed
    # through the model, the answer's last); None: the engine records none
    routes: Optional[Any] = None

    @property
    def truncated(self) -> bool:
        """Cut at max_new_tokens before the model ended its answer."""
        return self.finish_reason == "length"

    @property
    def logprob_sum(self) -> float:
        return float(sum(self.logprobs))


@dataclass
class WeightCheck:
    """Result of comparing an engine's weights with the trainer's (the weight-sync check mode)."""

    equal: bool
    max_abs_diff: float  # over the tensors both sides have, with equal shapes
    mismatched: List[str] = field(default_factory=list)  # differ beyond atol, or in shape
    missing: List[str] = field(default_factory=list)  # sent by the trainer, unknown to the engine
    unsent: List[str] = field(default_factory=list)  # engine weights the trainer did not send

    @staticmethod
    def merge(checks: Sequence["WeightCheck"]) -> "WeightCheck":
        """One verdict from several partial checks (e.g. one per engine worker)."""
        return WeightCheck(
            equal=all(c.equal for c in checks),
            max_abs_diff=max((c.max_abs_diff for c in checks), default=0.0),
            mismatched=[m for c in checks for m in c.mismatched],
            missing=[m for c in checks for m in c.missing],
            unsent=[m for c in checks for m in c.unsent],
        )


class RolloutEngine(abc.ABC):
    """One agent's generator. Prompts are token ids already rendered with the agent's chat template."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> List[List[Completion]]:
        """For each prompt, `params.n` completions."""

    def begin_weight_update(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """A new set of weights follows in buckets (see the module docstring). Default: nothing."""

    @abc.abstractmethod
    def update_weights(self, bucket: Sequence[Tuple[str, torch.Tensor]]) -> None:
        """Take one bucket of new weights: (Hugging Face name, full tensor) pairs."""

    def finish_weight_update(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """All buckets are in: serve the new weights from the next `generate`. Default: nothing."""

    @abc.abstractmethod
    def check_weights(self, named_tensors: NamedTensors, atol: float = 0.0) -> WeightCheck:
        """Compare the engine's weights with the given ones (equality within atol); the check mode.

        `named_tensors` may be a generator (weights streamed from the trainer): an engine reads it
        once, to the end, and may keep only what it needs for the comparison.
        """

    # ---- weights broadcast in a group of their own, or mapped by CUDA IPC (rollout/transport.py).
    # Defaults for engines whose weights live in this process; vLLM forwards each call to its workers.
    def weight_receivers(self) -> int:
        """How many processes of this engine receive broadcast weights (vLLM: one per worker)."""
        return 1

    def join_weight_group(self, address: Any) -> None:
        """Join the sender's weight group (a `transport.GroupAddress`) as rank 1; blocks until all joined."""
        # NCCL broadcasts into GPU memory: the receiving buffer is on this process's GPU
        device = torch.device("cuda", torch.cuda.current_device()) if address.backend == "nccl" else None
        self._bucket_receiver = BucketReceiver(join_group(address, rank=1), device)

    def receive_bucket(self, header: Any) -> None:
        """Take the bucket the sender broadcasts now (between begin and finish of an update)."""
        self.update_weights(self._bucket_receiver.receive(header))

    def receive_ipc_bucket(self, header: Any, handle: Any) -> None:
        """Take a bucket shared through a CUDA IPC handle: copy it before returning (run on an H200: docs/gpu.md)."""
        self.update_weights(copy_ipc_bucket(header, handle))

    def end_bucket_stream(self, buckets_sent: int) -> None:
        """The sender's count of this update's buckets: raises if any was lost on the way."""
        receiver = getattr(self, "_bucket_receiver", None)
        if receiver is not None:
            receiver.finish(buckets_sent)

    def release_memory(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """Free what the engine can (KV cache, weights on GPU) while the trainer runs. Default: nothing."""

    def resume_memory(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """Undo release_memory before the next generate. Default: nothing."""

    def shutdown(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """Stop background processes; the engine is unusable afterwards."""

    def process_lost(self, error: BaseException) -> bool:
        """Does `error` (raised by one of this engine's calls) mean a process the engine needs is gone
        for good, so that only a new engine can serve? vLLM: its engine core died. Default: no."""
        return False


def weight_buckets(named_tensors: NamedTensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]:
    """Group (name, tensor) pairs, in order, into lists of at most bucket_bytes.

    A tensor bigger than bucket_bytes travels alone: tensors are never split, because every engine
    loads whole HF tensors.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: WeightBucket = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def send_weights_in_buckets(engine, named_tensors: NamedTensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                            each_call: Optional[Callable[[Optional[WeightBucket], float], None]] = None) -> int:
    """Send a whole set of weights to any object with the engine's weight methods; returns the bucket count.
    `each_call(bucket, seconds)`: told of every engine call as it ends, one that raised included (bucket None for
    begin and finish), for a sender's metrics."""
    def timed(call: Callable[..., None], bucket: Optional[WeightBucket] = None) -> None:
        start = time.perf_counter()
        try:
            if bucket is None:
                call()
            else:
                call(bucket)
        finally:
            if each_call is not None:
                each_call(bucket, time.perf_counter() - start)

    timed(engine.begin_weight_update)
    count = 0
    for bucket in weight_buckets(named_tensors, bucket_bytes):
        timed(engine.update_weights, bucket)
        count += 1
    timed(engine.finish_weight_update)
    return count


def compare_state(own: Dict[str, torch.Tensor], named_tensors: NamedTensors, atol: float = 0.0) -> WeightCheck:
    """The check mode for engines that can read their weights by HF name (`own`, e.g. a state dict).

    Every weight of `own` must have been sent, except aliases of a sent one (tied embeddings: HF
    state dicts list the shared tensor as both embed_tokens and lm_head).
    """
    worst, mismatched, missing, sent_storage, sent_names = 0.0, [], [], set(), set()
    for name, tensor in named_tensors:
        sent_names.add(name)
        mine = own.get(name)
        if mine is None:
            missing.append(name)
            continue
        sent_storage.add(mine.data_ptr())
        if mine.shape != tensor.shape:
            mismatched.append(f"{name}: shape {tuple(mine.shape)} vs {tuple(tensor.shape)}")
            continue
        diff = (mine.detach().float().cpu() - tensor.detach().float().cpu()).abs().max().item() if mine.numel() else 0.0
        worst = max(worst, diff)
        if diff > atol:
            mismatched.append(f"{name}: max |diff| {diff:.3e}")
    unsent = sorted(n for n, t in own.items() if n not in sent_names and t.data_ptr() not in sent_storage)
    return WeightCheck(not (mismatched or missing or unsent), worst, mismatched, missing, unsent)
