"""Step time and held-out accuracy with rollout and training one after another (k = 0) and overlapped (k = 1),
side by side in one invocation, on one config.

    .venv/bin/python benchmarks/bench_staleness.py [--config configs/default.yaml] [--k 0 1] [--steps 30]
        [--out runs/bench_staleness] [--set KEY=VALUE ...] [--json OUT]

Each k is a whole run of `python -m hacpo_megatron.launch` (the same seed, data and warm-up cache; nothing else
differs), one after the other. Reported per k: the mean and median step time over the steps after the first
(start-up and the first generation are paid once), the time the loop waited for answers (`time/rollout`: at
k = 0 all of the generation, at k = 1 only what training did not hide), the other phases, the staleness of the
trained answers, and the last held-out accuracy of every agent. On a machine whose cores are shared by the
engines and the trainers (this project's 2-core CPU machine) the overlap can only move work between phases that
compete for the same cores: `benchmarks/predict_pipeline.py` gives the prediction for separate devices from the
k = 0 run's phase times. Never run beside other heavy work: the figures are wall-clock times.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
PHASES = ("time/rollout", "time/reward", "time/logprob", "time/bridge", "time/train", "time/weight_sync")
OVERLAP = ("pipeline/hidden_frac", "pipeline/engine_idle_s")  # per step: the agents' mean


def run_once(config: str, k: int, steps: int, out: Path, overrides: List[str]) -> float:
    """One run at rollout.max_staleness = k; its wall-clock seconds."""
    command = [sys.executable, "-m", "hacpo_megatron.launch", "--config", config, "--output-dir", str(out),
               "--set", f"rollout.max_staleness={k}", "--set", f"run.total_steps={steps}",
               "--set", "logging.progress_bar=false", "--set", "checkpoint.save_every=0"]
    for override in overrides:
        command += ["--set", override]
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True)
    return time.perf_counter() - start


def summarise(out: Path) -> Dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    by_step: Dict[int, Dict] = {}
    for r in train:  # every agent's record carries the step's time; phases: the slowest agent's
        step = by_step.setdefault(r["step"], {"time/step": r["time/step"], **{p: 0.0 for p in PHASES},
                                               "staleness": 0.0, **{o: [] for o in OVERLAP}})
        for p in PHASES:
            step[p] = max(step[p], float(r.get(p, 0.0)))
        for o in OVERLAP:
            if o in r:
                step[o].append(float(r[o]))
        step["staleness"] = max(step["staleness"], float(r.get("staleness/versions_behind", 0.0)))
    later = [by_step[s] for s in sorted(by_step) if s > 1]
    evals = [r for r in records if r.get("kind") == "eval"]
    last_step = max(r["step"] for r in evals) if evals else None
    return dict(steps=len(by_step),
                step_mean_s=statistics.mean(s["time/step"] for s in later),
                step_median_s=statistics.median(s["time/step"] for s in later),
                phases_mean_s={p: statistics.mean(s[p] for s in later) for p in PHASES},
                staleness_mean=statistics.mean(s["staleness"] for s in later),
                overlap_mean={o: statistics.mean(v for s in later for v in s[o]) for o in OVERLAP
                              if any(s[o] for s in later)},
                held_out={r["agent"]: r["eval/accuracy"] for r in evals if r["step"] == last_step},
                held_out_step=last_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--k", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="runs/bench_staleness")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = dict(config=args.config, steps=args.steps, overrides=args.overrides, cpus=os.cpu_count(),
                   load_before=list(os.getloadavg()), runs={})
    for k in args.k:
        out = Path(args.out) / f"k{k}"
        wall = run_once(args.config, k, args.steps, out, args.overrides)
        results["runs"][k] = dict(wall_s=wall, **summarise(out))
    results["load_after"] = list(os.getloadavg())
    base = results["runs"].get(0)
    print(f"\n{args.config}, {args.steps} steps, {results['cpus']} cores; load {results['load_before']} -> "
          f"{results['load_after']}\n")
    print("| k | step mean s | step median s | vs k=0 | waited for answers s | train s | weight sync s | "
          "staleness | generation hidden | engine waited s | held-out (last) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for k, r in results["runs"].items():
        ratio = f"{r['step_mean_s'] / base['step_mean_s']:.2f}x" if base else "-"
        held = ", ".join(f"{a} {v:.3f}" for a, v in r["held_out"].items())
        print(f"| {k} | {r['step_mean_s']:.2f} | {r['step_median_s']:.2f} | {ratio} | "
              f"{r['phases_mean_s']['time/rollout']:.2f} | {r['phases_mean_s']['time/train']:.2f} | "
              f"{r['phases_mean_s']['time/weight_sync']:.2f} | {r['staleness_mean']:.2f} | "
              + " | ".join(f"{r['overlap_mean'][o]:.2f}" if o in r["overlap_mean"] else "n/a" for o in OVERLAP)
              + f" | {held} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
