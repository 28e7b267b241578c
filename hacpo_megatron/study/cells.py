"""A study's cells: its variants (`--variant LABEL=SPEC`), every (variant, seed) as a cell with its run folder
OUT/LABEL/seedN/ and the launcher command that runs it, and what that folder holds: finished, resumable or not
started, and what the run measured (held-out accuracy over steps, each held-out problem's score).
tools/compare_algorithms.py's docstring says what each state means to a study."""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hacpo_megatron.reporting import EVAL_ACCURACY, METRICS_FILE, read_metrics

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"
STEP_DIR = re.compile(r"^step_(\d+)$")  # a finished checkpoint step (checkpoint/run_folder.py); .tmp is not

LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # a folder name, and no ':' (--only LABEL:SEED)
OVERRIDE_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class StudyInputError(Exception):
    """Input the tool cannot use; tools/compare_algorithms.py's main() prints it as one line and exits with code 2."""


# ----------------------------------------------------------------------------------------------------------
# Input: variants, cells, launcher commands
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    label: str
    config: str  # the YAML config this variant starts from
    overrides: Tuple[str, ...] = ()  # KEY=VALUE, applied after the study's common --set lines


@dataclass(frozen=True)
class Cell:
    variant: Variant
    seed: int
    folder: Path

    @property
    def name(self) -> str:
        return f"{self.variant.label}:{self.seed}"


def parse_variant(text: str, base_config: str) -> Variant:
    """`LABEL=SPEC` -> Variant (see tools/compare_algorithms.py's docstring); StudyInputError on a malformed one."""
    label, equals, spec = text.partition("=")
    label = label.strip()
    if not equals or not LABEL.match(label):
        raise StudyInputError(f"--variant {text!r}: expected LABEL=SPEC with a LABEL of letters, digits, "
                              f"'_', '-', '.', '+' (e.g. gspo_x2=algorithm.name=gspo_x2, or hacpo= for --config as is)")
    config, overrides = None, []
    for item in (part.strip() for part in spec.split(";")):
        if not item:
            continue
        if "=" in item:
            key = item.split("=", 1)[0].strip()
            if not OVERRIDE_KEY.match(key):
                raise StudyInputError(f"--variant {label}: {item!r} is not KEY=VALUE")
            if key == "run.seed":
                raise StudyInputError(f"--variant {label}: run.seed comes from --seeds, not from a variant")
            overrides.append(item)
        elif config is not None:
            raise StudyInputError(f"--variant {label}: two config files ({config}, {item}); a variant has one")
        else:
            config = item
    config = config or base_config
    if not Path(config).is_file():
        raise StudyInputError(f"--variant {label}: config file {config}: no such file")
    return Variant(label, config, tuple(overrides))


def parse_cell_ref(text: str) -> Tuple[str, int]:
    """`LABEL:SEED` -> (label, seed)."""
    label, colon, seed = text.rpartition(":")
    if not colon or not label or not re.fullmatch(r"-?\d+", seed.strip()):
        raise StudyInputError(f"--only {text!r}: expected LABEL:SEED, e.g. hacpo:2")
    return label, int(seed)


def parse_comparison(text: str) -> Tuple[str, str]:
    """--compare A:B -> (A, B)."""
    label, sep, other = text.partition(":")
    if not sep or not label.strip() or not other.strip():
        raise StudyInputError(f"--compare {text!r}: expected A:B, two variant labels")
    return label.strip(), other.strip()


def plan_cells(variants: Sequence[Variant], seeds: Sequence[int], out: Path) -> List[Cell]:
    """Every (variant, seed), variant by variant: each variant's seeds finish together."""
    return [Cell(v, seed, out / v.label / f"seed{seed}") for v in variants for seed in seeds]


def launcher_command(cell: Cell, common_overrides: Sequence[str] = (), *, resume: bool = False,
                     python: str = sys.executable) -> List[str]:
    """The launcher's command line for one cell (the same one for a fresh start and, with --resume, a resume)."""
    command = [python, "-m", "hacpo_megatron.launch", "--config", cell.variant.config,
               "--set", f"run.seed={cell.seed}"]
    for override in [*common_overrides, *cell.variant.overrides]:
        command += ["--set", override]
    command += ["--output-dir", str(cell.folder)]
    return command + (["--resume"] if resume else [])


# ----------------------------------------------------------------------------------------------------------
# A cell's run folder: what state it is in, what it measured
# ----------------------------------------------------------------------------------------------------------
FINISHED, RESUMABLE, NOT_STARTED = "finished", "resumable", "not started"


@dataclass
class CellState:
    status: str  # FINISHED | RESUMABLE | NOT_STARTED
    total_steps: Optional[int] = None  # from the folder's config.yaml
    last_step: Optional[int] = None  # the last training step every agent logged
    checkpoint_step: Optional[int] = None  # the newest finished checkpoint


def read_run_config(folder: Path) -> Optional[Dict[str, Any]]:
    """The run's resolved config.yaml (written before the first step), or None."""
    import yaml

    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return None  # torn by a crash while it was written: the cell starts over
    return data if isinstance(data, dict) else None


def agent_names_of(config: Mapping[str, Any]) -> List[str]:
    return [agent["name"] for agent in config.get("agents") or [] if isinstance(agent, dict) and "name" in agent]


def checkpoint_steps(folder: Path) -> List[int]:
    """Finished checkpoint steps under folder/checkpoints (what `--resume` may start from), ascending."""
    root = Path(folder) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def load_cell_metrics(folder: Path) -> List[Dict[str, Any]]:
    path = Path(folder) / METRICS_FILE
    return read_metrics(path) if path.is_file() else []


def expects_eval(config: Mapping[str, Any]) -> bool:
    """Whether the run evaluates on held-out prompts (loop.run_hacpo: data.eval_every > 0 and a data.eval)."""
    data = config.get("data") or {}
    return bool(data.get("eval_every")) and bool(data.get("eval"))


def cell_state(folder: Path) -> CellState:
    """Finished, resumable or not started: read from the folder alone (see tools/compare_algorithms.py's docstring)."""
    config = read_run_config(folder)
    checkpoints = checkpoint_steps(folder)
    checkpoint_step = checkpoints[-1] if checkpoints else None
    if config is None:
        return CellState(RESUMABLE if checkpoints else NOT_STARTED, checkpoint_step=checkpoint_step)
    total = (config.get("run") or {}).get("total_steps")
    agents = agent_names_of(config)
    records = load_cell_metrics(folder)
    train_steps: Dict[str, set] = {agent: set() for agent in agents}
    eval_steps: Dict[str, set] = {agent: set() for agent in agents}
    for record in records:
        steps = (eval_steps if record.get("kind") == "eval" else train_steps).get(record.get("agent"))
        if steps is not None and isinstance(record.get("step"), int):
            steps.add(record["step"])
    last_step = min((max(s) if s else 0) for s in train_steps.values()) if agents else None
    finished = (isinstance(total, int) and bool(agents)
                and all(total in train_steps[a] for a in agents)
                and (not expects_eval(config) or all(total in eval_steps[a] for a in agents)))
    status = FINISHED if finished else RESUMABLE if checkpoints else NOT_STARTED
    return CellState(status, total_steps=total, last_step=last_step, checkpoint_step=checkpoint_step)


def eval_curves(records: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[int, float]]:
    """{agent: {step: held-out accuracy}} from metrics.jsonl records (null accuracies left out)."""
    curves: Dict[str, Dict[int, float]] = {}
    for record in records:
        value = record.get(EVAL_ACCURACY)
        if record.get("kind") == "eval" and isinstance(value, (int, float)) and isinstance(record.get("step"), int):
            curves.setdefault(record["agent"], {})[record["step"]] = float(value)
    return curves


def final_accuracies(curves: Mapping[str, Mapping[int, float]]) -> Dict[str, float]:
    """Each agent's held-out accuracy at its last evaluation."""
    return {agent: points[max(points)] for agent, points in curves.items() if points}


def problem_scores_of(folder: Path) -> Dict[str, Dict[int, List[float]]]:
    """Each evaluation's score per held-out problem (eval_scores.jsonl; runs before it existed have none)."""
    scores: Dict[str, Dict[int, List[float]]] = {}
    try:
        lines = (Path(folder) / "eval_scores.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return scores
    for line in lines:
        if line.strip():
            record = json.loads(line)
            scores.setdefault(record["agent"], {})[record["step"]] = record["scores"]
    return scores


def eval_problems_of(folder: Path) -> Optional[int]:
    """How many held-out problems each evaluation scored (run_info.json's prompts.eval.used), or None."""
    try:
        used = json.loads((Path(folder) / "run_info.json").read_text(encoding="utf-8"))["prompts"]["eval"]["used"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return used if isinstance(used, int) and used > 0 else None
