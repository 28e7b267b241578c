"""Answers per second of the reward pool (compute_score) on a mix of normal answers, with 1 and 2 workers.

    .venv/bin/python benchmarks/bench_reward.py [--answers 2000]

Workers are started and warmed up before timing: a run keeps one pool, so start-up is not per batch.
"""

from __future__ import annotations

import argparse
import random

from hacpo_megatron.rewards import RewardItem, RewardPool


def normal_answers(count: int, seed: int = 0) -> list:
    """Correct and wrong answers in the forms models write: boxed integers, fractions, LaTeX, plain text."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        a, b = rng.randint(1, 99), rng.randint(2, 9)
        guess = a if rng.random() < 0.5 else a + rng.choice([-1, 1])
        form = rng.choice([
            (f"Let me compute step by step.\n... so the result is \\boxed{{{guess}}}.", str(a)),
            (f"The answer is {guess}.", str(a)),
            (f"\\boxed{{\\frac{{{guess}}}{{{b}}}}}", f"{a}/{b}"),
            (f"\\boxed{{{guess / b:.6f}}}", f"\\frac{{{a}}}{{{b}}}"),
            (f"We get $x = {guess}$, hence \\boxed{{x = {guess}}}", str(a)),
            (f"\\boxed{{{guess}\\sqrt{{2}}}}", f"{a}\\sqrt{{2}}"),
        ])
        items.append(RewardItem("bench", *form))
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=2000)
    args = parser.parse_args()
    items = normal_answers(args.answers)
    rows = []
    for workers in (1, 2):
        with RewardPool(num_workers=workers, timeout_s=5.0) as pool:
            pool.score(normal_answers(50, seed=1))  # start-up and sympy's first-call imports
            scores, stats = pool.score(items)
        rows.append((workers, len(items), stats["seconds"], stats["answers_per_s"], sum(scores) / len(scores)))
    print(f"{'workers':>7} {'answers':>8} {'seconds':>8} {'answers/s':>10} {'mean score':>10}")
    for workers, count, seconds, rate, mean in rows:
        print(f"{workers:>7} {count:>8} {seconds:>8.2f} {rate:>10.1f} {mean:>10.3f}")


if __name__ == "__main__":
    main()
