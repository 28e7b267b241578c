"""What `return_freed_memory` costs a trainer rank per step: a full garbage collection each call (the code before
issue 42) against one that froze the long-lived objects at its first call (environment.py now).

    .venv/bin/python benchmarks/bench_freed_memory.py [--preset tiny-qwen3] [--steps 10] [--json OUT]

A trainer rank holds hundreds of thousands of Python objects that live for the whole run (megatron's modules and
config, transformers, tokenizers, Ray's client state), and `return_freed_memory` runs after every training step. In
a fresh child process per mode, this builds what such a rank builds (a one-rank world, the agent's megatron model
and its trainer, a tokenizer, Ray's client module), trains --steps steps of tiny HACPO updates, and times the call
after each step:

    full     gc.collect() then malloc_trim, every call (before)
    frozen   the same, with gc.freeze() after the first call (now)

Reported per mode: the tracked objects before the steps, the objects frozen, the seconds of the timed call after step 1
(the step's own call came first: in `frozen` it froze) and the mean of the later ones, and the later calls' ratio
frozen / full. One invocation, so both modes see
the same machine; the ratio is the figure (a shared 2-core machine's load moves both alike).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def child(mode: str, preset: str, steps: int) -> dict:
    """One mode in this process: build a trainer rank's objects, then time the call after each step."""
    import torch

    from hacpo_megatron import environment
    from hacpo_megatron.algorithms.registry import algorithm_spec
    from hacpo_megatron.bridge.tokenizers import load_tokenizer  # noqa: F401 (what a rank imports)
    from hacpo_megatron.config.schema import AgentConfig, AlgorithmConfig, Config, ParallelConfig, TrainConfig
    from hacpo_megatron.models.build import build_agent_model
    from hacpo_megatron.models.presets import PRESETS
    from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
    from hacpo_megatron.training.batch import SequenceRow
    from hacpo_megatron.training.trainer import AgentTrainer
    import ray  # noqa: F401 (a rank's Ray client state)

    if mode == "full":  # the code before: never freeze
        environment._frozen = True
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29611"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed("gloo")
    [parallel] = create_agent_groups([AgentConfig(name="a", model=preset, parallel=ParallelConfig(first_rank=0))])
    trainer = AgentTrainer(build_agent_model(PRESETS[preset], parallel, seed=1),
                           algorithm_spec(AlgorithmConfig(name="hacpo")),
                           Config(train=TrainConfig(lr=1e-3, micro_batch_size=8)))
    g = torch.Generator().manual_seed(0)
    vocab = PRESETS[preset]["vocab_size"]
    rows = [SequenceRow(prompt_ids=torch.randint(2, vocab, (12,), generator=g).tolist(),
                        response_ids=torch.randint(2, vocab, (6,), generator=g).tolist(), advantage=(-1.0) ** i,
                        is_cross=False, source=0, old_seq_logp=-10.0, prompt_index=i // 4, sample_index=i % 4)
            for i in range(16)]
    objects = len(gc.get_objects())
    calls = []
    for _ in range(steps):
        trainer.train_step([rows])  # calls return_freed_memory itself; time one more call after it
        start = time.perf_counter()
        environment.return_freed_memory(freeze=True)
        calls.append(time.perf_counter() - start)
    return {"mode": mode, "tracked_objects": objects, "frozen_objects": gc.get_freeze_count(),
            "first_s": calls[0], "later_mean_s": statistics.mean(calls[1:]), "calls_s": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-qwen3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json")
    parser.add_argument("--child", choices=["full", "frozen"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.preset, args.steps)))
        return
    results = []
    for mode in ("full", "frozen"):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--preset", args.preset, "--steps",
                              str(args.steps)], capture_output=True, text=True, cwd=REPO,
                             env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
        if out.returncode != 0:
            sys.exit(f"{mode}: exit {out.returncode}\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    full, frozen = results
    print("| mode | tracked objects | frozen | call after step 1, ms | later calls, ms (mean) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['mode']} | {r['tracked_objects']:,} | {r['frozen_objects']:,} | {1e3 * r['first_s']:.1f} | "
              f"{1e3 * r['later_mean_s']:.2f} |")
    print(f"\nlater calls, frozen / full: {frozen['later_mean_s'] / full['later_mean_s']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"load": os.getloadavg(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
