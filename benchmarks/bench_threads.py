"""Which torch thread counts make a run's step fastest: trainer ranks x engine actors, in one invocation.

    .venv/bin/python benchmarks/bench_threads.py [--config configs/default.yaml] [--settings 1x1 2x1 1x2 2x2]
        [--steps 6] [--warmup 2] [--rounds 2] [--set KEY=VALUE ...] [--work-dir DIR] [--write-docs]

A setting TxE runs the config as a user launches it (`python -m hacpo_megatron.launch`) with
`train.cpu_threads: T` (every trainer rank) and `rollout.cpu_threads: E` (every engine: the embedded
engine's torch threads, vLLM's CPU worker's), for `--warmup` + `--steps` steps, without evaluation,
periodic checkpoints, TensorBoard or plots. A run's figure is the mean over the steps after the warm-up
ones (start-up, first calls) of `time/step`, of each phase (the slowest agent's, for the per-agent
phases), of the learners' phase as the step saw it (the step less rollout, reward and log-probs: the
agents' updates side by side, weight pushes, waits) and of the trainers' `perf/mfu`. Rounds alternate the
settings (1x1, 2x1, ..., 1x1, 2x1, ...), each run a fresh process, so the shared machine's load hits them
alike; the fastest round of each setting is kept. The load average is printed at the start and end.
`--write-docs` replaces the results block of docs/benchmarks.md's section "Threads per process".
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench_threads results: begin", "<!-- bench_threads results: end -->"
PHASES = ("time/rollout", "time/reward", "time/logprob", "time/train", "time/weight_sync")


SETTING = re.compile(r"^([1-9]\d*)x([1-9]\d*)$")  # trainer threads x engine threads
SHARED_PHASES = ("time/rollout", "time/reward", "time/logprob")  # driven once a step (every record the same)


def overrides(setting: str, args) -> List[str]:
    """The `--set` lines of one setting's run."""
    trainer_threads, engine_threads = SETTING.match(setting).groups()
    return [f"train.cpu_threads={trainer_threads}", f"rollout.cpu_threads={engine_threads}",
            f"run.total_steps={args.warmup + args.steps}", "data.eval_every=0", "checkpoint.save_every=0",
            "logging.trackers=[]", "logging.plots=false", "logging.progress_bar=false", *args.set]


def summarize(records: List[Dict], warmup: int) -> Dict[str, float]:
    """Means over the steps after `warmup` (steps count from 1; every agent's record of a step carries the
    step's time/step and shared phases, its own train and weight_sync, and its MFU) of the step time, each
    phase's slowest agent, the learners' phase and the trainers' MFU (over agents too)."""
    measured = [r for r in records if r.get("kind") == "train" and r["step"] > warmup]
    if not measured:
        raise RuntimeError(f"no training step after the {warmup} warm-up step(s)")
    steps: Dict[int, List[Dict]] = {}
    for r in measured:
        steps.setdefault(r["step"], []).append(r)
    per_step = []
    for rs in steps.values():
        figures = {key: max(r[key] for r in rs) for key in ("time/step",) + PHASES}
        figures["learners"] = figures["time/step"] - sum(figures[key] for key in SHARED_PHASES)
        per_step.append(figures)
    result = {key: sum(f[key] for f in per_step) / len(per_step) for key in per_step[0]}
    mfu = [r["perf/mfu"] for r in measured if r.get("perf/mfu") is not None]
    result["mfu"] = sum(mfu) / len(mfu) if mfu else float("nan")  # mean over steps and agents
    return result


def run_setting(setting: str, args, work: str) -> Dict[str, float]:
    run_dir = os.path.join(work, setting)
    command = [sys.executable, "-m", "hacpo_megatron.launch", "--config", args.config, "--output-dir", run_dir]
    command += [part for override in overrides(setting, args) for part in ("--set", override)]
    with open(os.path.join(work, f"{setting}.log"), "a") as log:
        subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    shutil.rmtree(run_dir, ignore_errors=True)
    return summarize(records, args.warmup)


def table(results: Dict[str, Dict[str, float]]) -> List[str]:
    base = results[next(iter(results))]["time/step"]
    lines = ["| setting (trainer x engine threads) | s/step | vs first | "
             + " | ".join(p.split("/")[1] for p in PHASES) + " | learners' phase | trainers' MFU |",
             "|" + " --- |" * (5 + len(PHASES))]
    for setting, r in results.items():
        lines.append(f"| {setting} | {r['time/step']:.2f} | {r['time/step'] / base:.2f} | "
                     + " | ".join(f"{r[p]:.2f}" for p in PHASES + ("learners",)) + f" | {100 * r['mfu']:.0f}% |")
    return lines


def write_docs(text: str) -> None:
    docs = DOCS.read_text()
    start, end = docs.index(BEGIN), docs.index(END)
    DOCS.write_text(docs[:start] + BEGIN + " (benchmarks/bench_threads.py --write-docs rewrites this block) -->\n"
                    + text + "\n" + docs[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--settings", nargs="+", default=["1x1", "2x1", "1x2", "2x2"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="another override for every run")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    for setting in args.settings:
        if not SETTING.match(setting):
            parser.error(f"--settings: {setting!r} is not TRAINERxENGINE threads, e.g. 2x1")
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-threads-")
    os.makedirs(work, exist_ok=True)
    start_load, started = os.getloadavg(), time.time()
    print(f"bench_threads: {args.config}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"load average at start {[round(x, 2) for x in start_load]}", flush=True)
    best: Dict[str, Dict[str, float]] = {}
    for round_index in range(args.rounds):
        for setting in args.settings:
            result = run_setting(setting, args, work)
            print(f"  {setting} round {round_index + 1}/{args.rounds}: {result['time/step']:.2f} s/step "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
            if setting not in best or result["time/step"] < best[setting]["time/step"]:
                best[setting] = result
    end_load = os.getloadavg()
    header = (f"Measured {datetime.date.today()}: {os.cpu_count()} cores, `{args.config}`"
              f"{''.join(f' --set {s}' for s in args.set)}, {args.steps} measured steps after {args.warmup}, "
              f"fastest of {args.rounds} alternating rounds; load average (1, 5, 15 min) "
              f"{[round(x, 2) for x in start_load]} at the start, {[round(x, 2) for x in end_load]} at the end; "
              f"{(time.time() - started) / 60:.1f} min in all.")
    text = "\n".join([header, ""] + table(best))
    print(text)
    if args.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
