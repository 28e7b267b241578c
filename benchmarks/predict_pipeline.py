"""Predict a run's step time with rollout and training on separate devices, synchronous (k = 0) or pipelined
(rollout.max_staleness = k >= 1), from the phase times a real run measured: a model, stated as a prediction.

    python benchmarks/predict_pipeline.py RUN_DIR [--k 0 1 2] [--skip-first 1]

From RUN_DIR/metrics.jsonl, per step: the rollout side R_t = time/rollout + time/reward (generation and scoring:
the engines' devices and the reward workers), the learner side L_t = time/logprob + time/bridge + time/train of
the slowest agent (the trainers' devices), and the weight push W_t = time/weight_sync (the slowest agent's), which
needs both sides (the engine takes the new weights between two generations).

The model replays those measured steps as a two-stage pipeline (a discrete-event simulation, not a formula, so
that the steps' spread counts: a long-tailed generation on one step is absorbed by a buffer of k steps):

    k = 0   the loop as it is: R_t, then L_t, then W_t, one after another.
    k >= 1  the engines generate step t+1 ... t+k while the learners train step t; the generation of step s may
            start once the engines hold weights at most k versions older than step s will be trained with, and
            once their previous generation is done; a learner starts step t once step t's answers are scored and
            its own push of step t-1 is done; a push starts when the learners finished and the engine is between
            generations (a generation in progress finishes first).

A consequence of the last two rules, which the model makes visible: while a push blocks the learners (the
process-group transport's sender waits until the engine has taken the weights) and queues behind every generation
launched before it, a buffer deeper than one step gains nothing and can lose (the push after step t waits for the
generations of t+1 ... t+k). k >= 2 pays only once the push stops blocking the learners.

On a CPU machine the two sides share the same cores, so a run's measured times are those of phases that did not
overlap; the prediction is what they give on separate devices, where they can. What it leaves out: the rollout
and learner devices' own speeds (the measured times are taken as they are), contention on the network for the
push, and the answers' lengths changing as training goes on (a real pipelined run has them; this replay keeps
the measured ones).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence


@dataclass(frozen=True)
class StepPhases:
    rollout: float  # generation + scoring
    learner: float  # log-probs + bridge + training
    push: float     # the weight push to the engine


def read_phases(run_dir: Path, skip_first: int = 1) -> List[StepPhases]:
    """One StepPhases per training step of the run (the first `skip_first` left out: start-up costs). The rollout
    side is the step's (every agent's record carries it); the learner side and the push are the slowest agent's:
    agents on their own ranks train side by side, and the step waits for the last."""
    by_step: Dict[int, List[dict]] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            by_step.setdefault(record["step"], []).append(record)

    def get(record, key):
        value = record.get(key)
        return float(value) if isinstance(value, (int, float)) else 0.0

    return [StepPhases(rollout=max(get(r, "time/rollout") + get(r, "time/reward") for r in records),
                       learner=max(get(r, "time/logprob") + get(r, "time/bridge") + get(r, "time/train")
                                   for r in records),
                       push=max(get(r, "time/weight_sync") for r in records))
            for _, records in sorted(by_step.items())][skip_first:]


def simulate(phases: Sequence[StepPhases], k: int) -> float:
    """Total time to train every step in `phases` with at most k steps generated ahead (k = 0: synchronous).

    As the loop with orchestrator/generation_schedule.py runs: at the start of step t (once every push of step t-1
    is done) the steps up to t + k are launched; the engines run launched generations and pushes one at a time, in
    order; the learners train step t once its answers are scored; the push after step t waits for the learners and for
    every generation launched before it. With k = 0 that is rollout, learner, push, one after another.
    """
    n = len(phases)
    generated, pushed = [0.0] * n, [0.0] * n
    engine_free, launched = 0.0, -1  # when the engines are done with their queue; the last step launched
    for t in range(n):
        step_start = pushed[t - 1] if t else 0.0
        for s in range(launched + 1, min(t + k, n - 1) + 1):
            generated[s] = engine_free = max(engine_free, step_start) + phases[s].rollout
        launched = max(launched, min(t + k, n - 1))
        trained = max(generated[t], step_start) + phases[t].learner
        pushed[t] = engine_free = max(trained, engine_free) + phases[t].push
    return pushed[-1] if n else 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--skip-first", type=int, default=1, help="steps left out at the start (default 1)")
    args = parser.parse_args(argv)
    phases = read_phases(args.run_dir, args.skip_first)
    if not phases:
        print(f"error: {args.run_dir}/metrics.jsonl has no training step after the first {args.skip_first}",
              file=sys.stderr)
        return 2
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"{len(phases)} steps of {args.run_dir}: mean rollout {mean([p.rollout for p in phases]):.1f} s, "
          f"learner {mean([p.learner for p in phases]):.1f} s, push {mean([p.push for p in phases]):.1f} s")
    base = simulate(phases, 0)
    print("| max_staleness | predicted mean step (s) | vs k = 0 |\n| --- | --- | --- |")
    for k in args.k:
        total = simulate(phases, k)
        print(f"| {k} | {total / len(phases):.1f} | {total / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
