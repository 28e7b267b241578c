"""The supervised warm-up of the two default agents: its cost and the accuracy it leaves, reproducibly.

    .venv/bin/python benchmarks/bench_warmup.py [--seed 1234] [--steps 1500] [--stop-accuracy 0.3]
        [--batch-size 16] [--lr 5e-3] [--task synthetic:largest] [--cache-dir DIR] [--sequential] [--json OUT]
        [--set-qwen '{"num_hidden_layers": 3}'] [--set-llama '{...}'] [--eval-prompts N]

Both agents (tiny-qwen3 with the Qwen3 tokenizer, tiny-llama with Llama 3.2's) are warmed up with
`supervised_warmup`, in two processes at once with one thread each (as a run would do them), in a fresh
temporary cache unless --cache-dir is given (then a second call shows the cache hit). Then each warmed-up
model is measured with the embedded engine, as RL sees it:

  train T=1   the training split, G=4 samples per prompt at temperature 1.0 (what RL's rollouts score)
  eval T=1    the held-out split (problems never trained on), G=4 samples at temperature 1.0
  eval greedy the held-out split, greedy decoding
  stop        fraction of T=1 samples that ended with an end-of-turn token within max_new_tokens=8

plus the cheap teacher-forced estimates stored in the cache's warmup.json (p_exact: the probability that a
T=1 sample is exactly the target; greedy: argmax reproduces the target). Rewards are math-verify's.
Figures on a shared 2-core machine vary with its load: the load average is printed with them.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hacpo_megatron.training.warmup import RECOMMENDED  # noqa: E402

AGENTS = {"qwen3-tiny": ("tiny-qwen3", "qwen3"), "llama-tiny": ("tiny-llama", "llama3.2")}


def _config(preset: str, overrides: dict) -> dict:
    from hacpo_megatron.models.presets import PRESETS

    return dict(PRESETS[preset], **overrides)


def _warm_one(args):
    """In a child process: one thread, warm up one agent, return (name, seconds)."""
    name, config, tokenizer, settings = args
    import torch

    torch.set_num_threads(1)
    from hacpo_megatron.training.warmup import supervised_warmup

    started = time.perf_counter()
    supervised_warmup(config, tokenizer, **settings)
    return name, time.perf_counter() - started


def _accuracy(engine, tokenizer, records, *, n, greedy=False, seed=0):
    import torch

    from hacpo_megatron.bridge.retokenize import render_prompt
    from hacpo_megatron.rewards.math_verify import compute_score
    from hacpo_megatron.rollout.base import SamplingParams

    prompts = [render_prompt(tokenizer, r.messages) for r in records]
    if greedy:
        from hacpo_megatron.rollout.embedded import _left_pad

        texts, stops = [], []
        for start in range(0, len(prompts), 64):
            ids, attention = _left_pad(prompts[start:start + 64], engine.pad_token_id)
            with torch.no_grad():
                out = engine.model.generate(input_ids=ids, attention_mask=attention, do_sample=False,
                                            max_new_tokens=8, eos_token_id=engine.eos_token_ids,
                                            pad_token_id=engine.pad_token_id)
            for row in out[:, ids.shape[1]:].tolist():
                stops.append(any(t in engine.eos_token_ids for t in row))
                texts.append(tokenizer.decode(row, skip_special_tokens=True))
        groups = [[text] for text in texts]
    else:
        completions = engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=8, seed=seed))
        groups = [[c.text for c in group] for group in completions]
        stops = [c.finish_reason == "stop" for group in completions for c in group]
    scores = [compute_score(r.data_source, text, r.ground_truth) for r, group in zip(records, groups) for text in group]
    examples = [(r.question, r.ground_truth, group[:4]) for r, group in list(zip(records, groups))[:3]]
    return {"acc": sum(scores) / len(scores), "stop": sum(stops) / len(stops), "samples": len(scores),
            "examples": examples}


def _measure(name, config, tokenizer_name, settings, eval_prompts):
    import torch

    from hacpo_megatron.bridge.tokenizers import eos_token_ids, load_tokenizer, pad_token_id
    from hacpo_megatron.data import load_prompts
    from hacpo_megatron.rollout.embedded import EmbeddedEngine, hf_model_from_config
    from hacpo_megatron.training.warmup import INFO_FILE, supervised_warmup, warmup_key

    started = time.perf_counter()
    state = supervised_warmup(config, tokenizer_name, **settings)
    hit_seconds = time.perf_counter() - started
    model = hf_model_from_config(config, seed=settings["seed"])
    model.load_state_dict(state)
    tokenizer = load_tokenizer(tokenizer_name)
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=sorted(eos_token_ids(tokenizer)),
                            pad_token_id=pad_token_id(tokenizer))
    train = load_prompts(settings["task_spec"], "train")[:eval_prompts]
    evaluation = load_prompts(settings["task_spec"], "eval")[:eval_prompts]
    key = warmup_key(config, tokenizer_name, settings["task_spec"], steps=settings["steps"],
                     batch_size=settings["batch_size"], lr=settings["lr"], seed=settings["seed"],
                     stop_accuracy=settings["stop_accuracy"])
    with open(os.path.join(settings["cache_dir"], key, INFO_FILE)) as f:
        info = json.load(f)
    torch.manual_seed(0)
    return {
        "agent": name, "params": sum(p.numel() for p in model.parameters()),
        "cache_hit_seconds": round(hit_seconds, 3),
        "train_T1": _accuracy(engine, tokenizer, train, n=4, seed=1),
        "eval_T1": _accuracy(engine, tokenizer, evaluation, n=4, seed=2),
        "eval_greedy": _accuracy(engine, tokenizer, evaluation, n=1, greedy=True),
        "teacher_forced": info.get("metrics"), "final_loss": info.get("final_loss"),
        "train_seconds_in_cache": info.get("train_seconds"), "steps_run": info.get("steps_run"),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--steps", type=int, default=RECOMMENDED["steps"])
    parser.add_argument("--batch-size", type=int, default=RECOMMENDED["batch_size"])
    parser.add_argument("--lr", type=float, default=RECOMMENDED["lr"])
    parser.add_argument("--task", default=RECOMMENDED["task_spec"])
    parser.add_argument("--stop-accuracy", type=float, default=RECOMMENDED["stop_accuracy"],
                        help="stop once T=1 accuracy on training problems reaches this (0: run every step)")
    parser.add_argument("--cache-dir", default=None, help="default: a fresh temporary folder (always trains)")
    parser.add_argument("--sequential", action="store_true", help="warm up one agent after the other")
    parser.add_argument("--set-qwen", type=json.loads, default={}, help="JSON overrides of tiny-qwen3")
    parser.add_argument("--set-llama", type=json.loads, default={}, help="JSON overrides of tiny-llama")
    parser.add_argument("--eval-prompts", type=int, default=256, help="prompts per split to measure (at most)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="bench-warmup-")
    settings = dict(task_spec=args.task, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                    cache_dir=cache_dir, stop_accuracy=args.stop_accuracy or None)
    overrides = {"qwen3-tiny": args.set_qwen, "llama-tiny": args.set_llama}
    jobs = [(name, _config(preset, overrides[name]), tokenizer, settings)
            for name, (preset, tokenizer) in AGENTS.items()]

    load_before = os.getloadavg()
    started = time.perf_counter()
    if args.sequential:
        seconds = dict(_warm_one(job) for job in jobs)
    else:
        with mp.get_context("spawn").Pool(len(jobs)) as pool:
            seconds = dict(pool.map(_warm_one, jobs))
    wall = time.perf_counter() - started
    load_after = os.getloadavg()
    print(f"warm-up of both agents: {wall:.1f}s wall ({'sequential' if args.sequential else 'parallel'}; "
          + ", ".join(f"{name} {s:.1f}s" for name, s in seconds.items())
          + f"); load average before {load_before[0]:.2f}, after {load_after[0]:.2f} on {os.cpu_count()} cores")
    print(f"settings: {json.dumps({k: v for k, v in settings.items() if k != 'cache_dir'})}")

    results = []
    for name, config, tokenizer, _ in jobs:
        result = _measure(name, config, tokenizer, settings, args.eval_prompts)
        result["warmup_seconds"] = round(seconds[name], 1)
        results.append(result)
        tf = result["teacher_forced"] or {}
        print(f"{name:11s} params {result['params'] / 1e6:.1f}M | train T=1 acc {result['train_T1']['acc']:.3f} "
              f"(n={result['train_T1']['samples']}, stop {result['train_T1']['stop']:.2f}) | eval T=1 acc "
              f"{result['eval_T1']['acc']:.3f} (n={result['eval_T1']['samples']}) | eval greedy "
              f"{result['eval_greedy']['acc']:.3f} (stop {result['eval_greedy']['stop']:.2f}) | teacher-forced "
              f"p_exact train {tf.get('train', {}).get('p_exact', float('nan')):.3f} eval "
              f"{tf.get('eval', {}).get('p_exact', float('nan')):.3f} | cache hit {result['cache_hit_seconds']:.2f}s")
        print(f"{'':11s} e.g. {result['eval_T1']['examples']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=settings, wall_seconds=wall, load=[load_before, load_after], agents=results),
                      f, indent=1, default=str)


if __name__ == "__main__":
    main()
