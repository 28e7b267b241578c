"""Make the stronger state of a state pair: train it once, export the chosen steps into the model cache.

    python tools/make_state.py [--config configs/real/smollm2_gspo_state.yaml] --steps 4 8 12 [--run-dir DIR]

1. Trains the config's run into --run-dir (default .cache/runs/<run.name>), continuing from its last intact
   checkpoint when an earlier call stopped, and not at all when the run already holds every step asked for.
2. Exports the agent's checkpoint at each step to a Hugging Face folder in the model cache under its known name
   (hacpo_megatron/checkpoint/derived_models.py: `smollm2-135m-instruct-gspo<STEP>`), with a record of what made
   it, written last: config, step, commit, and the run's held-out accuracy at that step.
A config then names it like any known model: `init_from: smollm2-135m-instruct-gspo8`
(configs/real/smollm2_state.yaml). About 15 minutes for 12 steps on a 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from hacpo_megatron.checkpoint.derived_models import (  # noqa: E402
    DERIVED_MODELS, RECORD_FILE, STATE_CONFIG, derived_name,
)
from hacpo_megatron.checkpoint.gguf_sources import default_cache_dir  # noqa: E402
from hacpo_megatron.checkpoint.run_folder import LATEST_FILE  # noqa: E402
from hacpo_megatron.config import ConfigError, load_config  # noqa: E402
from hacpo_megatron.training import run_checkpoints  # noqa: E402


def step_folder(run_dir: Path, step: int) -> Path:
    return Path(run_checkpoints.step_folder(str(run_dir), step))


def held_out_accuracy(run_dir: Path, step: int, agent: str):
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "eval" and record.get("step") == step and record.get("agent") == agent:
            return record.get("eval/accuracy")
    return None


def commit() -> str:
    result = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def train(config: str, run_dir: Path, steps) -> None:
    if all(step_folder(run_dir, s).is_dir() for s in steps):
        return
    command = [sys.executable, "-m", "hacpo_megatron.launch", "--config", config, "--output-dir", str(run_dir)]
    if (Path(run_checkpoints.checkpoint_root(str(run_dir))) / LATEST_FILE).exists():
        command.append("--resume")
    print("training:", " ".join(command), flush=True)
    subprocess.run(command, cwd=REPO, check=True)
    missing = [s for s in steps if not step_folder(run_dir, s).is_dir()]
    if missing:
        sys.exit(f"make_state: error: the run kept no checkpoint of step(s) {missing} in {run_dir} "
                 f"(checkpoint.save_every / keep_last of {config})")


def export(config: str, run_dir: Path, step: int, cache: Path) -> Path:
    name = derived_name(config, step)
    model = DERIVED_MODELS[name]
    target = cache / name
    if (target / RECORD_FILE).is_file():
        print(f"{name}: already in {target}")
        return target
    if target.exists():
        shutil.rmtree(target)  # an export that stopped before its record: ours, incomplete
    subprocess.run([sys.executable, str(REPO / "tools" / "convert_megatron_to_hf.py"), "--load",
                    str(step_folder(run_dir, step) / model.agent), "--save", str(target)], cwd=REPO, check=True)
    record = dict(name=name, config=config, agent=model.agent, step=step, commit=commit(),
                  held_out_accuracy=held_out_accuracy(run_dir, step, model.agent))
    (target / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    print(f"{name}: exported to {target} (held-out accuracy at step {step}: {record['held_out_accuracy']})")
    return target


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=STATE_CONFIG)
    parser.add_argument("--steps", nargs="+", type=int, required=True)
    parser.add_argument("--run-dir", type=Path, default=None, help="default: .cache/runs/<run.name>")
    args = parser.parse_args(argv)
    unknown = [s for s in args.steps if derived_name(args.config, s) is None]
    if unknown:
        known = ", ".join(f"{m.config} step {m.step}" for m in DERIVED_MODELS.values())
        sys.exit(f"make_state: error: no known model is {args.config} at step(s) {unknown} (known: {known})")
    try:
        cfg = load_config(args.config)
    except ConfigError as error:
        sys.exit(f"make_state: error: {error}")
    run_dir = args.run_dir or REPO / ".cache" / "runs" / cfg.run.name
    train(args.config, run_dir, args.steps)
    for step in args.steps:
        export(args.config, run_dir, step, default_cache_dir().resolve())


if __name__ == "__main__":
    main()
