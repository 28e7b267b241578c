"""What oneDNN's primitive cache costs a vLLM CPU worker in memory, and what capping it costs its generation.

    .venv/bin/python benchmarks/bench_primitive_cache.py [--model tiny-qwen3|smollm2-shape] [--rounds 100]
                                                         [--capacities 1024,0] [--json OUT]

vLLM's CPU build runs each linear layer through a oneDNN matmul made for the batch's row count (the tokens of
one forward), and oneDNN keeps every primitive it builds in a process-wide cache, 1,024 by default: a run whose
batches keep bringing new token counts (prompts of varied lengths, evaluation batches) fills it over hundreds
of steps, and the worker's resident memory rises with it until it is full (docs/reliability.md). The
variable ONEDNN_PRIMITIVE_CACHE_CAPACITY sets that size as the worker starts.

Per capacity, in a fresh child process: a vLLM engine built as a run's engine actor builds it (config.json only,
dummy weights, fp32, one thread, rollout/vllm_engine.py), then --rounds rounds of what a training step asks of
it: the weights pushed again (a reload), then a step's batch (16 prompts of 10-60 random tokens, 8 samples
each, --max-new-tokens), and every 25th round an evaluation batch (216 prompts, 4 samples each). After each
round the worker's resident memory. Reported: the mean seconds of a step's generation and of an evaluation
(after the first 3 rounds; the first evaluation left out), the worker's memory at rounds 3 and 24 and at the end,
and what the last 10 rounds added to it. --json keeps each capacity's per-round figures too.
The peer is the same work at the default capacity, in the same invocation.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run from a checkout
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from bench_engine_memory import vllm_rss  # noqa: E402  (this folder: vLLM's processes by name)

MIB = 1 << 20
VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
# SmolLM2-135M-Instruct's shapes (30 layers sharing five matmul shapes), random weights: no download needed
SMOLLM2_SHAPE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", hidden_size=576,
                     intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                     rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def hf_config(model: str) -> dict:
    from hacpo_megatron.models.presets import load_hf_config_dict

    return dict(SMOLLM2_SHAPE) if model == "smollm2-shape" else load_hf_config_dict(model)


def worker_rss(parent) -> int:
    """Resident bytes of vLLM's worker process(es) under `parent`: the one that holds the model."""
    return sum(rss for name, rss in vllm_rss(parent).items() if "Worker" in name)


def random_prompts(rng: random.Random, count: int, vocab: int):
    return [[rng.randrange(100, vocab) for _ in range(rng.randrange(10, 61))] for _ in range(count)]


def child(args) -> dict:
    """One capacity: the rounds in this process (the variable set before vLLM's processes start)."""
    import psutil
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hacpo_megatron.bridge.tokenizers import load_tokenizer
    from hacpo_megatron.rollout import make_engine
    from hacpo_megatron.rollout.base import SamplingParams, send_weights_in_buckets

    config = hf_config(args.model)
    torch.manual_seed(0)
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields), dtype=torch.float32)
    weights = [(n, t) for n, t in model.state_dict().items() if n != "lm_head.weight"]  # tied: sent once
    tokenizer = load_tokenizer("qwen3" if config["model_type"] == "qwen3" else "llama3.2")
    with tempfile.TemporaryDirectory(prefix="bench-primitive-cache-") as folder:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        engine = make_engine("vllm", model_path=folder, eos_token_ids=[], tokenizer=tokenizer, seed=0,
                             load_format="dummy", cpu_threads=1, max_model_len=512, cpu_kv_cache_gib=1.0)
    parent, rng = psutil.Process(), random.Random(0)
    vocab = min(int(config["vocab_size"]), 49152)
    step_params = SamplingParams(n=8, temperature=1.0, max_new_tokens=args.max_new_tokens)
    eval_params = SamplingParams(n=4, temperature=1.0, max_new_tokens=args.max_new_tokens)
    generate_s, eval_s, reload_s, rss = [], [], [], []
    for round_ in range(args.rounds):
        started = time.perf_counter()
        send_weights_in_buckets(engine, weights)
        reload_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        engine.generate(random_prompts(rng, 16, vocab), step_params)
        generate_s.append(time.perf_counter() - started)
        if round_ % 25 == 0:
            started = time.perf_counter()
            engine.generate(random_prompts(rng, 216, vocab), eval_params)
            eval_s.append(time.perf_counter() - started)
        rss.append(worker_rss(parent))
    engine.shutdown()
    return {"generate_s": generate_s, "eval_s": eval_s, "reload_s": reload_s, "worker_rss": rss}


def summary(capacity: str, raw: dict) -> dict:
    """Means after the first rounds (they settle the allocator and compile the first shapes); the worker's memory
    at round 3, before the second evaluation (round 24) and at the end, and what the last 10 rounds added: an
    evaluation's big batches raise the worker once (more KV blocks and sampler rows), what a cache keeps goes on."""
    skip, rss = 3, raw["worker_rss"]
    mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731
    return {"capacity": capacity, "generate_s_mean": mean(raw["generate_s"][skip:]),
            "eval_s_mean": mean(raw["eval_s"][1:]), "reload_s_mean": mean(raw["reload_s"][skip:]),
            "worker_mib_at_round_3": rss[skip - 1] / MIB, "worker_mib_at_round_24": rss[min(23, len(rss) - 1)] / MIB,
            "worker_mib_at_end": rss[-1] / MIB,
            "worker_mib_last_10_rounds": (rss[-1] - rss[max(len(rss) - 11, 0)]) / MIB}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-qwen3", help="a preset name (models/presets.py) or smollm2-shape")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--capacities", default="1024,0",
                        help=f"comma-separated {VARIABLE} values; the first is the peer (1024: oneDNN's default)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with open(args.child, "w") as f:
            json.dump(child(args), f)
        return 0
    results = []
    for capacity in args.capacities.split(","):
        env = dict(os.environ, **{VARIABLE: capacity})  # set here, the engine keeps it (rollout/vllm_engine.py)
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, __file__, "--model", args.model, "--rounds", str(args.rounds),
                       "--max-new-tokens", str(args.max_new_tokens), "--child", out.name]
            subprocess.run(command, env=env, check=True, cwd=REPO)
            raw = json.load(open(out.name))
        results.append(dict(summary(capacity, raw), raw=raw))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "raw"}), flush=True)
    base = results[0]
    print(f"\n{args.model}, {args.rounds} rounds, {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print("| capacity | step generation s | ratio | evaluation s | reload s | worker MiB at rounds 3, 24, end | "
          "MiB over the last 10 rounds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        ev = f"{r['eval_s_mean']:.2f}" if r["eval_s_mean"] is not None else "-"
        print(f"| {r['capacity']} | {r['generate_s_mean']:.3f} | "
              f"{r['generate_s_mean'] / base['generate_s_mean']:.2f} | "
              f"{ev} | {r['reload_s_mean']:.2f} | {r['worker_mib_at_round_3']:.0f}, "
              f"{r['worker_mib_at_round_24']:.0f}, "
              f"{r['worker_mib_at_end']:.0f} | {r['worker_mib_last_10_rounds']:+.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rounds": args.rounds, "cores": os.cpu_count(), "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
