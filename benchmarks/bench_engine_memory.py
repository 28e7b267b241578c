"""Does a vLLM engine's memory grow with its weight reloads? The resident memory of vLLM's processes (its
engine core, and the worker that holds the model) after each of --reloads weight pushes, on a real model.

    .venv/bin/python benchmarks/bench_engine_memory.py [--model gemma3-270m] [--reloads 12] [--via-actor]
                                                       [--prompt-format plain] [--json OUT]

The engine is built as a run's engine actor builds it (rollout/vllm_engine.py): config.json only,
"dummy" weights, the agent's tokenizer, fp32, a 1 GiB KV cache (`--kv-cache-gib`); in this process, or with
--via-actor as a run has it (an EngineActor in a private local Ray, weights over the process group).
Then, --reloads times: push the model's weights (its converted HF folder in .cache/models; the tied head
not sent, as a trainer sends it) in 256 MiB buckets as `send_weights_in_buckets` does, each push a little different (as
after an update), then one short generation (8 samples of one prompt, 48 tokens), then read the RSS of
vLLM's processes (summed). During each push their summed RSS is sampled every 20 ms, apart for its two halves:
the staging (every bucket received and kept) and the reload (`finish_weight_update`): the peaks, which Ray's
memory monitor sees and the readings after a push miss. The physical
reference is the model's own size in fp32: the memory a reload frees and takes again. Growth per reload
is the least-squares slope over reloads 3..N (the first ones settle the allocator and the KV cache).

This is what ended the first pair run (docs/real_model.md): Gemma 3's worker grew from 4.8 to 6.8 GB over
twelve reloads and the kernel killed it. docs/rollout.md has the figures before and after the fix.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run from a checkout
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GB = 1e9
QUESTION = "Ana has 5 pencils and buys 3 more. How many pencils does she have?"


def vllm_rss(parent) -> Dict[str, int]:
    """Resident bytes of each of vLLM's processes under `parent` (a psutil.Process): its engine core and,
    under it, the worker that holds the model (vLLM names them "VLLM::EngineCore", "VLLM::Worker...")."""
    found = {}
    for process in parent.children(recursive=True):
        title = " ".join(process.cmdline()) or process.name()
        if "EngineCore" in title or "Worker" in title:
            found[title.split("::")[-1].strip()[:40]] = process.memory_info().rss
    if not any("Worker" in name for name in found):
        raise RuntimeError(f"no vLLM worker process among {found}")
    return found


def stage(target, named, bucket_bytes: int) -> None:
    """The first half of `send_weights_in_buckets`: begin, then every bucket (received and staged by vLLM's worker
    on CPU)."""
    from hacpo_megatron.rollout.base import weight_buckets

    target.begin_weight_update()
    for bucket in weight_buckets(named, bucket_bytes):
        target.update_weights(bucket)


class PeakRSS:
    """The highest summed RSS of vLLM's processes while the `with` block runs, sampled every 20 ms in a
    thread: the reload's peak, which the readings after each reload miss (the run's memory monitor does not)."""

    def __init__(self, parent):
        self.parent, self.peak = parent, 0

    def __enter__(self):
        import threading

        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.02):
            try:
                self.peak = max(self.peak, sum(vllm_rss(self.parent).values()))
            except Exception:  # a process that ends while it is read
                pass

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


class InProcess:
    """The engine in this process; weights through `send_weights_in_buckets` (the object-store path's staging)."""

    def __init__(self, config_only: str, tokenizer, threads: int, kv_cache_gib: float):
        import psutil

        from hacpo_megatron.bridge.tokenizers import eos_token_ids
        from hacpo_megatron.rollout import make_engine

        self.engine = make_engine("vllm", model_path=config_only, eos_token_ids=sorted(eos_token_ids(tokenizer)),
                                  tokenizer=tokenizer, seed=0, load_format="dummy", cpu_threads=threads,
                                  max_model_len=512, cpu_kv_cache_gib=kv_cache_gib)
        self.parent = psutil.Process()

    @property
    def target(self):
        return self.engine

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def close(self):
        self.engine.shutdown()


class ThroughActor:
    """As a run does it: a private local Ray, the agent's EngineActor, weights over the process group."""

    def __init__(self, config: dict, tokenizer_name: str, prompt_format: str, threads: int, kv_cache_gib: float):
        import psutil
        import ray

        from hacpo_megatron.orchestrator.actors import ACTOR_OPTIONS, EngineActor, RemoteEngine, wait_until_alive
        from hacpo_megatron.orchestrator.ray_runtime import RayRuntime
        from hacpo_megatron.orchestrator.weight_senders import make_sender

        self.ray, self.runtime = ray, RayRuntime.connect(None)
        self.handle = EngineActor.options(**dict(ACTOR_OPTIONS, max_restarts=0)).remote(
            "vllm", config, tokenizer_name, 0, dict(max_model_len=512, cpu_kv_cache_gib=kv_cache_gib), threads,
            prompt_format)
        self.parent = psutil.Process(wait_until_alive(self.handle, timeout_s=600))
        self.sender, self.remote = make_sender("process_group", self.handle), RemoteEngine(self.handle)

    @property
    def target(self):
        return self.sender

    def generate(self, prompts, params):
        return self.remote.generate(prompts, params)

    def close(self):
        self.ray.kill(self.handle)
        self.runtime.shutdown()


def fmt(processes: Dict[str, int]) -> str:
    return ", ".join(f"{name} {rss / GB:.2f} GB" for name, rss in processes.items())


def slope(values):
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    return sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values)) / sum((i - mean_x) ** 2 for i in range(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3-270m", help="a known GGUF name or a Hugging Face folder")
    parser.add_argument("--tokenizer", default=None, help="the bridge's tokenizer name (default: the model folder's)")
    parser.add_argument("--reloads", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0,
                        help="each engine's KV cache (rollout.cpu_kv_cache_gib)")
    parser.add_argument("--prompt-format", default="plain", help="the agent's prompt format (its end tokens)")
    parser.add_argument("--via-actor", action="store_true",
                        help="as a run: the engine in an EngineActor of a private Ray, weights over the process group")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file

    from hacpo_megatron.bridge.retokenize import render_prompt
    from hacpo_megatron.bridge.tokenizers import load_tokenizer
    from hacpo_megatron.data.records import user_prompt
    from hacpo_megatron.checkpoint.gguf_sources import resolve_model_source
    from hacpo_megatron.rollout.base import SamplingParams

    folder = resolve_model_source(args.model)
    tokenizer_name = args.tokenizer or str(folder)
    tokenizer = load_tokenizer(tokenizer_name, args.prompt_format)
    weights = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    weights.pop("lm_head.weight", None)  # tied: a trainer sends the embedding once
    model_bytes = sum(t.numel() * 4 for t in weights.values())
    with open(folder / "config.json") as f:
        config = json.load(f)
    started = time.perf_counter()
    if args.via_actor:
        engine = ThroughActor(config, tokenizer_name, args.prompt_format, args.threads, args.kv_cache_gib)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-engine-memory-") as config_only:
            with open(os.path.join(config_only, "config.json"), "w") as f:
                json.dump(config, f)
            engine = InProcess(config_only, tokenizer, args.threads, args.kv_cache_gib)
    start_s = time.perf_counter() - started
    prompt = render_prompt(tokenizer, user_prompt(QUESTION))
    params = SamplingParams(n=8, temperature=0.7, max_new_tokens=48, seed=0)
    processes = [vllm_rss(engine.parent)]
    print(f"vLLM after start ({start_s:.0f} s): {fmt(processes[0])}", flush=True)
    seconds, peaks, phases, staged = [], [], [], []
    try:
        for reload in range(1, args.reloads + 1):
            t = time.perf_counter()
            update = [(name, tensor.float() * (1 + 1e-3 * reload)) for name, tensor in weights.items()]
            with PeakRSS(engine.parent) as staging:
                stage(engine.target, update, args.bucket_mib * 2**20)
            staged.append(sum(vllm_rss(engine.parent).values()))
            with PeakRSS(engine.parent) as reloading:  # the second half: vLLM's reload of the staged weights
                engine.target.finish_weight_update()
            del update
            peaks.append(max(staging.peak, reloading.peak))
            phases.append((staging.peak, reloading.peak))
            engine.generate([prompt] * 8, params)
            seconds.append(time.perf_counter() - t)
            processes.append(vllm_rss(engine.parent))
            print(f"reload {reload}: {fmt(processes[-1])}; during the push: staging peak {phases[-1][0] / GB:.2f} GB, "
                  f"staged {staged[-1] / GB:.2f} GB, reload peak {phases[-1][1] / GB:.2f} GB ({seconds[-1]:.1f} s)",
                  flush=True)
    finally:
        engine.close()
    rss = [sum(p.values()) for p in processes]
    growth = slope(rss[3:]) if len(rss) > 4 else float("nan")
    result = {
        "model": str(args.model), "via_actor": args.via_actor, "kv_cache_gib": args.kv_cache_gib,
        "model_fp32_bytes": model_bytes, "reloads": args.reloads,
        "rss_bytes": rss, "rss_bytes_by_process": processes, "growth_per_reload_bytes": growth,
        "growth_per_reload_over_model": growth / model_bytes,
        "rss_last_over_first_reload": rss[-1] / rss[1], "seconds_per_reload": seconds,
        "peak_rss_bytes_during_push": peaks, "peak_over_resting_bytes": [p - r for p, r in zip(peaks, rss)],
        "staging_peak_bytes": [a for a, _ in phases], "staged_bytes": staged,
        "reload_peak_bytes": [b for _, b in phases],
        "torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(f"model {model_bytes / GB:.2f} GB fp32; vLLM's processes {rss[1] / GB:.2f} GB after reload 1, "
          f"{rss[-1] / GB:.2f} GB after reload {args.reloads}; growth {growth / GB:.3f} GB per reload "
          f"({growth / model_bytes:.2f} x the model); a push's peak over the memory before it: median "
          f"{sorted(p - r for p, r in zip(peaks, rss))[len(peaks) // 2] / GB:.2f} GB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
