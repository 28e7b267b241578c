"""Rollout throughput of the embedded and the vLLM engine on CPU, and the cost of a weight sync.

    .venv/bin/python benchmarks/bench_rollout.py [--batch-sizes 1 4 16] [--samples 8] [--new-tokens 64]
                                                 [--engines embedded vllm] [--json OUT]

One tiny model for both engines: Qwen3 architecture, hidden 128, 2 layers, head_dim 64 (vLLM's CPU
attention does not take 16), the real Qwen3 vocabulary (151,936 rows: at this size the output layer
is most of the work, as it is for small real models), random weights. The same chat prompts (math
questions rendered with Qwen3's template), G samples each, a fixed number of new tokens (random
weights rarely end early; what ends early is counted, generated tokens are what is reported).

vLLM's CPU build lives in its own environment (.venv-vllm, it pins torch and transformers), so this
script runs its vLLM part by starting itself with .venv-vllm's Python (`--engines vllm --worker`),
which also times the engine side of a weight update (bucketed staging + vLLM's reload) there.
The Megatron side of the sync (TP=1 agent -> HF tensors -> buckets -> embedded engine) runs in the
main environment in a one-process gloo world.

Figures on a shared 2-core machine vary with its load: the load average is recorded with them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
VLLM_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")

MODEL = dict(model_type="qwen3", vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
             tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643,
             eos_token_id=151645)
QUESTIONS = [
    "What is 17 times 23?", "Solve for x: 3x + 5 = 20.", "What is the sum of the first ten positive integers?",
    "A rectangle is 7 cm by 4 cm. What is its area?", "Simplify 48/64.", "What is 2 to the power 10?",
    "How many minutes are there in 3.5 hours?", "What is the remainder when 100 is divided by 7?",
]


# ------------------------------------------------------------------------------------------------
def build_model_folder(path: str, seed: int = 0) -> None:
    """config.json, random fp32 weights and the Qwen3 tokenizer: what every engine loads."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hacpo_megatron.bridge.tokenizers import load_tokenizer

    fields = {k: v for k, v in MODEL.items() if k != "model_type"}
    config = AutoConfig.for_model(MODEL["model_type"], **fields)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    load_tokenizer("qwen3").save_pretrained(path)


def chat_prompts(count: int) -> List[List[int]]:
    from hacpo_megatron.bridge.tokenizers import load_tokenizer

    tokenizer = load_tokenizer("qwen3")
    return [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(count)]


def end_tokens(model_dir: str):
    from transformers import AutoTokenizer

    from hacpo_megatron.bridge.tokenizers import eos_token_ids, pad_token_id

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return sorted(eos_token_ids(tokenizer)), pad_token_id(tokenizer)


def time_generation(engine, prompts: List[List[int]], samples: int, new_tokens: int, repeats: int) -> Dict:
    """Best and median tokens/s of `repeats` generate calls (after one warm-up call)."""
    from hacpo_megatron.rollout.base import SamplingParams

    params = SamplingParams(n=samples, temperature=1.0, max_new_tokens=new_tokens, seed=0)
    engine.generate(prompts[:1], SamplingParams(n=2, max_new_tokens=4, seed=0))  # warm-up
    rates, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for group in out for c in group)
        rates.append(tokens / seconds)
    return dict(prompts=len(prompts), sequences=len(prompts) * samples, generated_tokens=tokens,
                tokens_per_s_best=max(rates), tokens_per_s_median=statistics.median(rates))


# ------------------------------------------------------------------------------------------------
def bench_embedded(model_dir: str, batch_sizes: List[int], samples: int, new_tokens: int, repeats: int) -> Dict:
    from hacpo_megatron.rollout import make_engine

    eos, pad = end_tokens(model_dir)
    # At most 64 sequences per transformers call (the engine's default): transformers keeps every
    # step's logits, 64 x 64 steps x 151,936 x 4 B = 2.5 GB; 128 sequences would need 5 GB.
    engine = make_engine("embedded", model_path=model_dir, eos_token_ids=eos, pad_token_id=pad,
                         max_batch_sequences=64)
    return {"generation": [time_generation(engine, chat_prompts(b), samples, new_tokens, repeats)
                           for b in batch_sizes]}


def bench_vllm_here(model_dir: str, batch_sizes: List[int], samples: int, new_tokens: int, repeats: int) -> Dict:
    """Runs in .venv-vllm: generation, then the engine side of a weight update and of the check mode."""
    import torch
    from safetensors.torch import load_file

    from hacpo_megatron.rollout import make_engine
    from hacpo_megatron.rollout.base import push_weights

    eos, _ = end_tokens(model_dir)
    start = time.perf_counter()
    engine = make_engine("vllm", model_path=model_dir, eos_token_ids=eos, seed=0, max_model_len=512)
    result = {"startup_s": time.perf_counter() - start,
              "generation": [time_generation(engine, chat_prompts(b), samples, new_tokens, repeats)
                             for b in batch_sizes]}
    weights = sorted(load_file(os.path.join(model_dir, "model.safetensors")).items())
    weights = [(n, t + 0.001 * torch.randn_like(t)) for n, t in weights]  # new values, as after a step
    result["weight_update"] = [engine_side_update(engine, weights, bucket, push_weights)
                               for bucket in (16 * 2**20, 256 * 2**20)]
    start = time.perf_counter()
    check = engine.check_weights(iter(weights))
    result["check"] = dict(equal=check.equal, max_abs_diff=check.max_abs_diff, seconds=time.perf_counter() - start)
    engine.shutdown()
    return result


def engine_side_update(engine, weights, bucket_bytes: int, push_weights) -> Dict:
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    start = time.perf_counter()
    buckets = push_weights(engine, weights, bucket_bytes)
    seconds = time.perf_counter() - start
    return dict(bucket_bytes=bucket_bytes, buckets=buckets, bytes=nbytes, seconds=seconds,
                bytes_per_s=nbytes / seconds)


def bench_vllm(model_dir: str, args) -> Dict:
    """Run the vLLM part in .venv-vllm (this script again, as a worker)."""
    if not os.path.exists(VLLM_PYTHON):
        return {"skipped": "no .venv-vllm (bash tools/setup_env.sh --with-vllm)"}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    command = [VLLM_PYTHON, os.path.abspath(__file__), "--worker", "--engines", "vllm", "--model-dir", model_dir,
               "--json", out, "--samples", str(args.samples), "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats), "--batch-sizes", *map(str, args.batch_sizes)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO)
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)["vllm"]


# ------------------------------------------------------------------------------------------------
def bench_megatron_sync(model_dir: str, repeats: int) -> List[Dict]:
    """Megatron TP=1 agent -> embedded engine, through weight_sync, in a one-process gloo world."""
    import torch.distributed as dist

    from hacpo_megatron.config.schema import AgentConfig, ParallelConfig
    from hacpo_megatron.models.build import build_agent_model
    from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
    from hacpo_megatron.rollout import make_engine
    from hacpo_megatron.rollout.weight_sync import sync_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed("gloo")
    (parallel,) = create_agent_groups([AgentConfig(name="bench", parallel=ParallelConfig())])
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_config = json.load(f)
    agent = build_agent_model(hf_config, parallel, seed=1)
    eos, pad = end_tokens(model_dir)
    engine = make_engine("embedded", model_path=model_dir, eos_token_ids=eos, pad_token_id=pad)
    rows = []
    for bucket_bytes in (16 * 2**20, 256 * 2**20):
        runs = [sync_weights(agent.model, hf_config, parallel, engine, bucket_bytes=bucket_bytes)
                for _ in range(repeats)]
        best = min(runs, key=lambda m: m.seconds)
        rows.append(dict(bucket_bytes=bucket_bytes, buckets=best.buckets, bytes=best.bytes, seconds=best.seconds,
                         engine_seconds=best.engine_seconds, bytes_per_s=best.bytes_per_second))
    checked = sync_weights(agent.model, hf_config, parallel, engine, check=True)
    rows.append(dict(check_equal=checked.check.equal, check_max_abs_diff=checked.check.max_abs_diff,
                     check_seconds=checked.check_seconds))
    dist.destroy_process_group()
    return rows


# ------------------------------------------------------------------------------------------------
def print_report(results: Dict) -> None:
    print(f"\nmachine: {results['cpus']} cores, load average before {results['load_before']}, "
          f"after {results['load_after']}; torch threads {results['torch_threads']}")
    print(f"model: qwen3, hidden 128, 2 layers, head_dim 64, vocab 151936; G={results['samples']}, "
          f"{results['new_tokens']} new tokens\n")
    print("| engine | prompts | sequences | generated tokens | tokens/s (best) | tokens/s (median) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for engine in ("embedded", "vllm"):
        for row in results.get(engine, {}).get("generation", []):
            print(f"| {engine} | {row['prompts']} | {row['sequences']} | {row['generated_tokens']} | "
                  f"{row['tokens_per_s_best']:.0f} | {row['tokens_per_s_median']:.0f} |")
    if "vllm" in results and "startup_s" in results["vllm"]:
        print(f"\nvLLM start-up: {results['vllm']['startup_s']:.1f} s")
    print("\n| weight sync | bucket MiB | buckets | MB | seconds | MB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, rows in (("Megatron TP=1 -> embedded", results.get("megatron_sync", [])),
                       ("HF tensors -> vLLM (engine side)", results.get("vllm", {}).get("weight_update", []))):
        for row in rows:
            if "bucket_bytes" in row:
                print(f"| {name} | {row['bucket_bytes'] / 2**20:.0f} | {row['buckets']} | {row['bytes'] / 1e6:.1f} | "
                      f"{row['seconds']:.3f} | {row['bytes_per_s'] / 1e6:.0f} |")
    for row in results.get("megatron_sync", []):
        if "check_equal" in row:
            print(f"\ncheck mode (Megatron -> embedded): equal={row['check_equal']}, "
                  f"max |diff|={row['check_max_abs_diff']}, {row['check_seconds']:.3f} s")
    if "check" in results.get("vllm", {}):
        c = results["vllm"]["check"]
        print(f"check mode (vLLM): equal={c['equal']}, max |diff|={c['max_abs_diff']}, {c['seconds']:.3f} s")


def quiet_libraries() -> None:
    """No progress bars and fallback warnings between the figures."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", nargs="+", default=["embedded", "vllm"], choices=["embedded", "vllm"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model-dir", default=None, help="reuse a model folder made by this script")
    parser.add_argument("--no-sync", action="store_true", help="skip the Megatron weight-sync timing")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    quiet_libraries()

    if args.worker:  # the vLLM part, inside .venv-vllm
        result = {"vllm": bench_vllm_here(args.model_dir, args.batch_sizes, args.samples, args.new_tokens,
                                          args.repeats)}
        with open(args.json, "w") as f:
            json.dump(result, f)
        return

    import torch

    model_dir = args.model_dir or tempfile.mkdtemp(prefix="bench_rollout_")
    if args.model_dir is None:
        build_model_folder(model_dir)
    results = dict(cpus=os.cpu_count(), load_before=[round(x, 2) for x in os.getloadavg()],
                   torch_threads=torch.get_num_threads(), samples=args.samples, new_tokens=args.new_tokens)
    if "embedded" in args.engines:
        results["embedded"] = bench_embedded(model_dir, args.batch_sizes, args.samples, args.new_tokens, args.repeats)
    if "vllm" in args.engines:
        results["vllm"] = bench_vllm(model_dir, args)
    if not args.no_sync:
        results["megatron_sync"] = bench_megatron_sync(model_dir, args.repeats)
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print_report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
